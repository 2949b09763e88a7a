"""The module layer: each module against the PyTorch reference of what it wraps (float64), state dicts shared with
``torch.nn``, a block built from the modules under ``torch.compile(fullgraph=True)`` and under FSDP2, bad sizes.
On CPU the kernels run in Triton's interpreter, in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cs336_kernels import attention_reference, linear_cross_entropy_reference, rope_reference, silu_mul_reference
from cs336_kernels import nn as knn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "inductor" if torch.cuda.is_available() else "aot_eager"
# fp32 kernels against float64 references: one rounding per op, fp32 accumulation.
REL_TOL = 1e-5


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE).requires_grad_()


def _check_grads(module: torch.nn.Module, reference: torch.nn.Module, out: torch.Tensor, ref: torch.Tensor,
                 inputs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Outputs, input gradients and parameter gradients of ``module`` against a float64 copy, ``reference``."""
    assert _rel_err(out, ref) < REL_TOL
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(DEVICE)
    grads = torch.autograd.grad(out, [inputs[0], *module.parameters()], upstream)
    ref_grads = torch.autograd.grad(ref, [inputs[1], *reference.parameters()], upstream.double())
    for got, expected in zip(grads, ref_grads, strict=True):
        assert _rel_err(got, expected) < REL_TOL


def test_rms_norm_shares_torch_nn_state_and_matches_float64():
    ours = knn.RMSNorm(37, eps=1e-5, device=DEVICE)
    theirs = torch.nn.RMSNorm(37, eps=1e-5, device=DEVICE, dtype=torch.float64)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
    ours.load_state_dict(theirs.state_dict())  # float64 values into our fp32 parameter
    theirs.load_state_dict(ours.state_dict())  # and back: the same keys and shapes
    x = _x(3, 5, 37)
    x64 = x.detach().double().requires_grad_()
    _check_grads(ours, theirs, ours(x), theirs(x64), (x, x64))


def test_swiglu_matches_float64():
    ours = knn.SwiGLU(24, 40, device=DEVICE)
    reference = knn.SwiGLU(24, 40, device=DEVICE, dtype=torch.float64)
    reference.load_state_dict(ours.state_dict())
    assert set(ours.state_dict()) == {"w1.weight", "w2.weight", "w3.weight"}
    x = _x(2, 7, 24)
    x64 = x.detach().double().requires_grad_()
    ref = reference.w2(silu_mul_reference(reference.w1(x64), reference.w3(x64)))
    _check_grads(ours, reference, ours(x), ref, (x, x64))


def test_causal_self_attention_matches_float64():
    ours = knn.CausalSelfAttention(32, 2, context_length=20, device=DEVICE)
    reference = knn.CausalSelfAttention(32, 2, context_length=20, device=DEVICE, dtype=torch.float64)
    reference.load_state_dict(ours.state_dict())
    assert set(ours.state_dict()) == {f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "output_proj")}
    x = _x(2, 13, 32)
    x64 = x.detach().double().requires_grad_()

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(2, 13, 2, 16)  # (B, T, H, Dh)

    positions = torch.arange(13, device=DEVICE)
    q, k = rope_reference(heads(reference.q_proj(x64)), heads(reference.k_proj(x64)), reference.cos.double(),
                          reference.sin.double(), positions)
    out, _ = attention_reference(q.transpose(1, 2), k.transpose(1, 2), heads(reference.v_proj(x64)).transpose(1, 2),
                                 True)
    ref = reference.output_proj(out.transpose(1, 2).reshape(2, 13, 32))
    _check_grads(ours, reference, ours(x), ref, (x, x64))


def test_fused_linear_cross_entropy_loss_matches_float64():
    hidden, weight = _x(9, 16, seed=1), _x(11, 16, seed=2)
    targets = torch.randint(0, 11, (9,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    loss = knn.FusedLinearCrossEntropyLoss(reduction="sum")(hidden, weight, targets)
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    ref = linear_cross_entropy_reference(h64, w64, targets, "sum")
    assert abs(loss.item() - ref.item()) < REL_TOL * abs(ref.item())
    loss.backward()
    ref.backward()
    assert _rel_err(hidden.grad, h64.grad) < REL_TOL and _rel_err(weight.grad, w64.grad) < REL_TOL


class Block(torch.nn.Module):
    """A pre-norm Transformer block from the modules."""

    def __init__(self, dtype: torch.dtype | None = None):
        super().__init__()
        self.ln1, self.ln2 = knn.RMSNorm(32, device=DEVICE, dtype=dtype), knn.RMSNorm(32, device=DEVICE, dtype=dtype)
        self.attn = knn.CausalSelfAttention(32, 2, 24, device=DEVICE, dtype=dtype)
        self.ffn = knn.SwiGLU(32, 48, device=DEVICE, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


def _step(block: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = block(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *block.parameters()])
    return [out.detach(), *grads]


@pytest.mark.slow
def test_block_of_modules_compiles_fullgraph_and_equals_eager():
    torch.manual_seed(0)
    block, x = Block(), _x(2, 19, 32)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(block, fullgraph=True, backend=BACKEND)
    for got, expected in zip(_step(compiled, x), _step(block, x), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.slow
def test_block_of_modules_under_fsdp2_equals_unsharded():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    block, reference = Block(), Block()
    reference.load_state_dict(block.state_dict())
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(block)
        x = _x(2, 19, 32)
        sharded = _step(block, x)
    finally:
        dist.destroy_process_group()
    grads = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in sharded]
    for got, expected in zip(grads, _step(reference, x), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("make", [
    lambda: knn.RMSNorm(0),
    lambda: knn.SwiGLU(16, True),
    lambda: knn.CausalSelfAttention(30, 4, 8),
    lambda: knn.CausalSelfAttention(12, 4, 8),  # head dim 3: odd, RoPE needs pairs
    lambda: knn.FusedLinearCrossEntropyLoss(reduction="avg"),
])
def test_bad_sizes_raise_value_error(make):
    with pytest.raises(ValueError, match="must be"):
        make()


@pytest.mark.parametrize("cast", [
    lambda m: m.bfloat16(), lambda m: m.half(), lambda m: m.to(torch.float16), lambda m: m.to(DEVICE, torch.bfloat16),
    lambda m: m.double(),
])
def test_casting_attention_keeps_its_rotary_tables_fp32(cast):
    plain = knn.CausalSelfAttention(32, 2, context_length=20, device=DEVICE)
    cast_module = cast(knn.CausalSelfAttention(32, 2, context_length=20, device=DEVICE))
    assert cast_module.q_proj.weight.dtype != torch.float32
    assert cast_module.cos.dtype == cast_module.sin.dtype == torch.float32
    assert torch.equal(cast_module.cos, plain.cos) and torch.equal(cast_module.sin, plain.sin)


def test_block_cast_to_half_runs_and_matches_its_fp32_self():
    """A block cast after construction, as ``Block().cuda().bfloat16()`` (fp16: what the interpreter also takes),
    runs and stays within fp16 rounding of the same weights in fp32."""
    torch.manual_seed(0)
    block = Block()
    half = Block()
    half.load_state_dict(block.state_dict())
    half = half.half()
    x = _x(2, 19, 32)
    out = half(x.detach().half())
    assert out.dtype == torch.float16
    assert _rel_err(out, block(x)) < 5e-3


@pytest.mark.interpreter
@pytest.mark.parametrize("make", [
    lambda bf16: knn.CausalSelfAttention(32, 2, 20, dtype=bf16),
    lambda bf16: knn.CausalSelfAttention(32, 2, 20).to(bf16),
])
def test_attention_refuses_bf16_in_the_interpreter_in_one_sentence(make):
    with pytest.raises(ValueError) as error:
        make(torch.bfloat16)(torch.randn(1, 5, 32, dtype=torch.bfloat16))
    assert str(error.value) == ("flash_attention got bfloat16 tensors on CPU, which Triton's interpreter computes "
                                "wrongly (it multiplies bf16 matrices as raw bits); use float32 or float16 there, or "
                                "a CUDA GPU.")
