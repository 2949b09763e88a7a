"""FlashAttention-2 (Triton and tiled PyTorch) against a float64 materialised-attention reference.

On CPU the Triton kernels run in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1), so
those shapes stay tiny; tests marked ``gpu`` repeat the checks at real sizes, in bf16 too, and check that
the backward pass is bitwise deterministic.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
import triton
from attention_tolerances import LSE_TOL, REL_TOL
from cs336_kernels.ops.flash_attention import (
    FlashAttentionPytorch,
    FlashAttentionTriton,
    attention_reference,
    backward_impl,
    flash_attention,
    flash_attention_backward_op,
    flash_attention_op,
    tuning,
)
from cs336_kernels.ops.flash_attention.forward import flash_forward_triton
from cs336_kernels.ops.flash_attention.gluon_backward import CONFIGS, unstage_dq
from cs336_kernels.ops.flash_attention.gluon_common import gluon_applies
from cs336_kernels.ops.flash_attention.params import make_params
from cs336_kernels.ops.flash_attention.reference import flash_backward_pytorch, flash_forward_pytorch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The Triton kernels both ways, whatever "auto" would pick on this machine (the Gluon kernels have their own tests).
triton_attention = functools.partial(flash_attention, forward="triton", backward="triton")

# Relative Frobenius error of O, dQ, dK, dV against float64 on the same (already rounded) inputs, and the
# absolute error of the logsumexp L. The 16-bit kernels round P and dS to the input dtype before their
# matrix products; fp32 uses true fp32 products, not TF32.


def _inputs(shape_q, shape_kv, dtype, device=DEVICE, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in (shape_q, shape_kv, shape_kv))
    do = torch.randn(shape_q, generator=g).to(device=device, dtype=dtype)
    return q, k, v, do


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    # The floor (entries of 0.1 on average) keeps an exactly-zero reference, such as dQ with one key,
    # from turning rounding noise into an infinite relative error.
    assert torch.isfinite(got).all(), "non-finite values"
    floor = 0.1 * ref.numel() ** 0.5
    return ((got.double() - ref).norm() / ref.norm().clamp_min(floor)).item()


def _run(fn, q, k, v, do, is_causal):
    """Output, saved logsumexp and (dq, dk, dv) from ``fn(q, k, v, is_causal)``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, is_causal)
    node = o.grad_fn  # the output's node, or (3-D inputs, flash_attention's views) the first one below it that saves
    while not hasattr(node, "saved_tensors"):
        node = node.next_functions[0][0]
    lse = next(t for t in node.saved_tensors if t.numel() == q.shape[:-1].numel() and t.dtype == torch.float32)
    lse = lse.detach().reshape(q.shape[:-1]).clone()
    o.backward(do)
    return o.detach(), lse, (q.grad, k.grad, v.grad)


def _check_against_reference(fn, q, k, v, do, is_causal, bottom_right=True):
    o, lse, grads = _run(fn, q, k, v, do, is_causal)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = attention_reference(q64, k64, v64, is_causal, bottom_right=bottom_right)
    o_ref.backward(do.double())
    tol = REL_TOL[q.dtype]
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert _rel_err(o, o_ref) < tol
    seen = lse_ref > float("-inf")  # rows that see no key (Tq > Tk, causal bottom-right) have L = -inf in both
    assert torch.equal(lse > float("-inf"), seen)
    assert (lse.double() - lse_ref)[seen].abs().max().item() < LSE_TOL[q.dtype]
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (q64.grad, k64.grad, v64.grad), strict=True):
        assert got.shape == ref.shape and got.dtype == q.dtype, name
        assert _rel_err(got, ref) < tol, f"{name}: {_rel_err(got, ref):.2e}"


# (shape of q, shape of k and v): lengths of 1, primes and non-multiples of the 16-wide interpreter tiles,
# Tq < Tk and Tq > Tk, grouped-query heads, a head dim that is not a power of two, 3-D inputs, and head dims past
# 128 (whose backward takes dV and dK in a pass each).
CPU_SHAPES = [
    ((1, 1, 1, 16), (1, 1, 1, 16)),
    ((2, 17, 16), (2, 17, 16)),
    ((1, 1, 129, 16), (1, 1, 129, 16)),
    ((1, 2, 100, 64), (1, 2, 100, 64)),
    ((1, 4, 33, 32), (1, 2, 70, 32)),
    ((1, 3, 70, 16), (1, 1, 33, 16)),
    ((1, 1, 20, 40), (1, 1, 45, 40)),
    ((1, 2, 45, 256), (1, 1, 45, 256)),
    ((1, 1, 30, 192), (1, 1, 37, 192)),
]

_COMBOS = [(is_causal, dtype) for is_causal in (False, True) for dtype in (torch.float32, torch.float16)]


def _cases(shapes):
    """Every (shape_q, shape_kv, is_causal, dtype); each shape runs one (is_causal, dtype) by default, the next
    shape the next one, so the default run sees every shape and every combination; the rest are ``slow``."""
    def name(shape_q, shape_kv, is_causal, dtype):
        shapes = "-".join("x".join(map(str, shape)) for shape in (shape_q, shape_kv))
        return f"{shapes}-{'causal' if is_causal else 'full'}-{str(dtype).removeprefix('torch.')}"

    return [pytest.param(shape_q, shape_kv, is_causal, dtype, id=name(shape_q, shape_kv, is_causal, dtype),
                         marks=() if j == i % len(_COMBOS) else pytest.mark.slow)
            for i, (shape_q, shape_kv) in enumerate(shapes) for j, (is_causal, dtype) in enumerate(_COMBOS)]


@pytest.mark.parametrize(("shape_q", "shape_kv", "is_causal", "dtype"), _cases(CPU_SHAPES))
def test_triton_matches_reference(shape_q, shape_kv, is_causal, dtype):
    q, k, v, do = _inputs(shape_q, shape_kv, dtype, seed=len(shape_q) + shape_q[-2])
    _check_against_reference(triton_attention, q, k, v, do, is_causal)


@pytest.mark.parametrize(("shape_q", "shape_kv", "is_causal", "dtype"), _cases(CPU_SHAPES))
def test_pytorch_tiled_pieces_match_reference(shape_q, shape_kv, is_causal, dtype):
    # The tiled forward and the (uncompiled) recomputation backward, on every shape; the compiled path
    # through the autograd Function is checked below on fewer shapes because compiling is slow on CPU.
    q, k, v, do = (t.unsqueeze(1) if t.dim() == 3 else t for t in _inputs(shape_q, shape_kv, dtype, seed=1))
    o, lse = flash_forward_pytorch(q, k, v, is_causal)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = attention_reference(q64, k64, v64, is_causal, bottom_right=False)
    o_ref.backward(do.double())
    tol = REL_TOL[dtype]
    assert _rel_err(o, o_ref) < tol
    assert (lse.double() - lse_ref).abs().max().item() < LSE_TOL[dtype]
    grads = flash_backward_pytorch(q, k, v, o, do, lse, is_causal)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (q64.grad, k64.grad, v64.grad), strict=True):
        assert got.dtype == dtype, name
        assert _rel_err(got, ref) < tol, f"{name}: {_rel_err(got, ref):.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pytorch_function", "triton_with_pytorch_backward"])
def test_compiled_pytorch_backward(impl):
    fn = {
        "pytorch_function": FlashAttentionPytorch.apply,
        "triton_with_pytorch_backward": lambda q, k, v, c: FlashAttentionTriton.apply(q, k, v, c, "pytorch"),
    }[impl]
    q, k, v, do = _inputs((2, 4, 37, 32), (2, 2, 50, 32), torch.float32, seed=3)
    _check_against_reference(fn, q, k, v, do, True, bottom_right=False)


def _check_forward(q, k, v, is_causal):
    o, lse = flash_forward_triton(q, k, v, make_params(q.shape[-1], is_causal, None, (-1, -1), 0.0))
    o_ref, lse_ref = attention_reference(q.double(), k.double(), v.double(), is_causal)
    assert _rel_err(o, o_ref) < REL_TOL[q.dtype]
    assert (lse.double() - lse_ref).abs().max().item() < LSE_TOL[q.dtype]


@pytest.mark.parametrize(("shape_q", "shape_kv", "is_causal", "dtype"), _cases([CPU_SHAPES[i] for i in (2, 4, 6)]))
def test_forward_with_tma_loads_matches_reference(monkeypatch, shape_q, shape_kv, is_causal, dtype):
    # The KV_TMA configs are only autotuned on a GPU; force the interpreter onto that path. Covers a partial
    # last key tile, Tq < Tk with grouped heads, and d = 40 inside a 64-wide tile (TMA's zero fill).
    monkeypatch.setattr(
        tuning.autotuned_kernel("fwd"), "configs",
        [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "KV_TMA": True}, num_warps=1, num_stages=1)],
    )
    q, k, v, _ = _inputs(shape_q, shape_kv, dtype, seed=shape_q[-2])
    _check_forward(q, k, v, is_causal)


def _force_backward_tma(monkeypatch, configs):
    # configs: kernel name -> (BLOCK_M, BLOCK_N, num_warps, num_stages) launched with that kernel's TMA flag.
    for name, (block_m, block_n, num_warps, num_stages) in configs.items():
        config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, tuning.TMA_FLAGS[name]: True},
                               num_warps=num_warps, num_stages=num_stages)
        monkeypatch.setattr(tuning.autotuned_kernel(name), "configs", [config])


@pytest.mark.parametrize(("shape_q", "shape_kv", "is_causal", "dtype"), _cases([CPU_SHAPES[i] for i in (2, 4, 6)]))
def test_backward_with_tma_loads_matches_reference(monkeypatch, shape_q, shape_kv, is_causal, dtype):
    # Q, dO by TMA in the dK/dV kernel and K, V by TMA in the dQ kernel, forced (only a GPU autotunes them).
    # Covers partial last tiles, Tq < Tk with two query heads per K/V head (a descriptor per query head) and
    # d = 40 inside a 64-wide tile (TMA's zero fill).
    _force_backward_tma(monkeypatch, {"dkdv": tuning._INTERPRETER_CONFIG, "dq": tuning._INTERPRETER_CONFIG})
    q, k, v, do = _inputs(shape_q, shape_kv, dtype, seed=shape_q[-2])
    _check_against_reference(triton_attention, q, k, v, do, is_causal)


@pytest.mark.parametrize(("n_queries", "head_dim"), [(128, 64), (70, 96), (70, 128)])
def test_the_gluon_backwards_dq_accumulator_is_unstaged_in_row_order_and_scaled(n_queries, head_dim):
    # The Gluon backward stages row 8a + 4b + 2c + d of every dQ tile (64 rows at d = 96 and 128, 128 at d = 64) at
    # row 8a + 4c + 2d + b. At d = 96 the accumulator's rows are 96 wide, read in 128-column tiles.
    block_m = CONFIGS[head_dim][0]
    rows = -(-n_queries // block_m) * block_m
    dq = torch.randn(2, 3, rows, head_dim, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    r = torch.arange(rows)
    a, b, c, d = r // 8, (r // 4) % 2, (r // 2) % 2, r % 2
    staged = torch.empty_like(dq)
    staged[:, :, (8 * a + 4 * c + 2 * d + b).to(DEVICE)] = dq
    # Into a (batch, seq, heads, d) tensor seen as (batch, heads, seq, d), as the backward writes dQ for a model.
    # fp16: the interpreter rounds bf16 its own way.
    out = torch.full((2, n_queries, 3, head_dim), float("nan"), dtype=torch.float16, device=DEVICE).transpose(1, 2)
    assert unstage_dq(staged, out, 0.125) is out
    torch.testing.assert_close(out, (dq[:, :, :n_queries] * 0.125).half(), rtol=0, atol=0)
    with pytest.raises(ValueError, match=f"multiple of {block_m}"):
        unstage_dq(staged[:, :, :-1].contiguous(), out[:, :, 1:], 1.0)
    with pytest.raises(ValueError, match="unit stride"):
        unstage_dq(staged, out.transpose(2, 3).contiguous().transpose(2, 3), 1.0)


def _op(q, k, v, *rest, forward="triton", backward="triton"):
    # The operators of a dense causal batch, by position: flash_attention_op(q, k, v) or
    # flash_attention_backward_op(q, k, v, o, do, lse).
    params = (None, None, 0, 0, q.shape[-1] ** -0.5, -1, 0, True, 0.0)
    if rest:
        return flash_attention_backward_op(q, k, v, *rest, None, *params, backward, False)
    return flash_attention_op(q, k, v, *params, forward, backward, False)


def test_outputs_and_gradients_take_the_layout_of_their_inputs():
    # A model's (batch, seq, heads, d) projections seen as (batch, heads, seq, d): O and dQ, dK, dV come back in
    # that layout, so the output projection (and the backward into the projections) reshapes them without a copy;
    # the fake implementations, what torch.compile plans with, give the same strides. Inputs without a unit stride
    # on d are copied first, and their results are contiguous.
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, do = (t.transpose(1, 2) for t in _inputs((1, 33, 4, 16), (1, 33, 2, 16), torch.float32, seed=1))
    o, lse = _op(q, k, v)
    grads = _op(q, k, v, o, do, lse)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (q, k, v, o, do, lse)]
        fake_o, _ = _op(*fakes[:3])
        fake_grads = _op(*fakes)
    for got, fake, like in zip((o, *grads), (fake_o, *fake_grads), (q, q, k, v), strict=True):
        assert got.stride() == like.stride() == fake.stride()
        assert got.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(o, _op(*(t.contiguous() for t in (q, k, v)))[0], rtol=0, atol=0)
    no_unit = q.transpose(2, 3).contiguous().transpose(2, 3)
    assert _op(no_unit, k, v)[0].is_contiguous()
    with mode:
        assert _op(mode.from_tensor(no_unit), *fakes[1:3])[0].is_contiguous()


def test_causal_alignment_bottom_right_in_flash_attention_top_left_in_the_course_functions():
    # flash_attention follows FlashAttention-2 (query i's diagonal is key i + Tk - Tq); the course's autograd
    # Functions follow scaled_dot_product_attention(is_causal=True) (key i).
    for tq, tk in ((19, 40), (40, 19)):
        q, k, v, _ = _inputs((1, 2, tq, 16), (1, 2, tk, 16), torch.float32, seed=4)
        top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(FlashAttentionTriton.apply(q, k, v, True), top_left, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(FlashAttentionPytorch.apply(q, k, v, True), top_left, rtol=1e-5, atol=1e-5)
        mask = torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=tk - tq)
        bottom_right = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).nan_to_num()  # rows seeing no key: 0
        torch.testing.assert_close(flash_attention(q, k, v, True), bottom_right, rtol=1e-5, atol=1e-5)


def test_keys_past_the_last_query_get_zero_gradient_when_causal_top_left():
    q, k, v, do = _inputs((1, 1, 5, 16), (1, 1, 40, 16), torch.float32, seed=5)
    _, _, (_, dk, dv) = _run(FlashAttentionTriton.apply, q, k, v, do, True)
    assert dk[..., 5:, :].abs().max() == 0 and dv[..., 5:, :].abs().max() == 0
    assert dk[..., :5, :].abs().max() > 0


def _bad(shape_q, shape_kv=None, dtype=torch.float32):
    q, k, v, _ = _inputs(shape_q, shape_kv or shape_q, dtype)
    return q, k, v


@pytest.mark.parametrize("fn", [FlashAttentionTriton.apply, FlashAttentionPytorch.apply])
@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (lambda: _bad((2, 16)), ValueError, "batch, seq, d"),
        (lambda: _bad((1, 1, 2, 4, 16)), ValueError, "batch, seq, d"),
        (lambda: (*_bad((1, 4, 16))[:2], torch.randn(1, 1, 4, 16)), ValueError, "batch, seq, d"),
        (lambda: _bad((1, 4, 8)), ValueError, "head dim"),
        (lambda: _bad((1, 4, 272)), ValueError, "head dim"),
        (lambda: _bad((1, 3, 4, 16), (1, 2, 4, 16)), ValueError, "multiple"),
        (lambda: _bad((2, 4, 16), (1, 4, 16)), ValueError, "batch and head dim"),
        (lambda: _bad((1, 4, 16), (1, 4, 32)), ValueError, "batch and head dim"),
        (lambda: (*_bad((1, 4, 16))[:2], torch.randn(1, 5, 16, device=DEVICE)), ValueError, "same shape"),
        (lambda: _bad((1, 0, 16), (1, 4, 16)), ValueError, "positive"),
        (lambda: _bad((1, 4, 16), dtype=torch.float64), TypeError, "dtype"),
        (lambda: (*_bad((1, 4, 16))[:2], torch.randn(1, 4, 16).half()), TypeError, "dtype"),
        (lambda: (torch.randn(1, 4, 16).numpy(), *_bad((1, 4, 16))[1:]), TypeError, "torch.Tensor"),
        (lambda: (*_bad((1, 4, 16))[:2], torch.randn(1, 4, 16, device="meta")), ValueError, "one device"),
    ],
)
def test_bad_inputs_raise(fn, args, error, match):
    with pytest.raises(error, match=match):
        fn(*args(), False)


def test_bad_flags_raise():
    q, k, v = _bad((1, 4, 16))
    with pytest.raises(TypeError, match="is_causal"):
        flash_attention(q, k, v, 1)
    with pytest.raises(ValueError, match="backward must be one of auto, triton, gluon, pytorch"):
        flash_attention(q, k, v, backward="cuda")
    with pytest.raises(ValueError, match="forward must be one of auto, triton, gluon"):
        flash_attention(q, k, v, forward="fa3")


def test_auto_forward_is_triton_off_sm90():
    # On this machine (CPU, or a GPU other than sm_90) "auto" runs the Triton forward: its output equals the
    # forced Triton path bit for bit; forcing the Gluon kernels where they cannot run names what they need.
    q, k, v = (torch.randn(1, 2, 33, 64) for _ in range(3))
    if torch.cuda.is_available():
        q, k, v = (t.cuda() for t in (q, k, v))
    assert not gluon_applies(q, "forward")
    assert torch.equal(flash_attention(q, k, v, True), flash_attention(q, k, v, True, forward="triton"))
    with pytest.raises((ValueError, TypeError), match="sm_90|dtype"):
        flash_attention(q, k, v, True, forward="gluon")


def test_auto_backward_is_triton_off_sm90():
    # "auto" names the Gluon backward only where the Gluon kernels apply (in deterministic mode, where its own
    # deterministic mode is the faster); off sm_90 (here) it is the Triton one; a named backward stays.
    q = torch.randn(1, 2, 33, 64)
    assert backward_impl(q, "auto") == "triton"
    assert [backward_impl(q, name) for name in ("triton", "gluon", "pytorch")] == ["triton", "gluon", "pytorch"]
    torch.use_deterministic_algorithms(True)
    try:
        assert backward_impl(q, "auto") == "triton"
    finally:
        torch.use_deterministic_algorithms(False)
    with pytest.raises(ValueError, match="backward must be one of"):
        backward_impl(q, "fa3")


# ------------------------------------------------------------------------------------------------ GPU

GPU_CASES = [
    # (q shape, kv shape, dtype, causal)
    ((2, 4, 1024, 128), (2, 4, 1024, 128), torch.bfloat16, True),
    ((1, 8, 777, 64), (1, 2, 1500, 64), torch.bfloat16, True),
    ((2, 3, 300, 64), (2, 3, 300, 64), torch.float16, False),
    ((4, 1000, 64), (4, 1000, 64), torch.float16, True),
    ((1, 2, 513, 128), (1, 2, 513, 128), torch.float32, True),
    ((1, 2, 300, 64), (1, 2, 211, 64), torch.float32, False),
    ((1, 2, 300, 256), (1, 2, 300, 256), torch.bfloat16, True),
    ((1, 2, 129, 16), (1, 2, 1, 16), torch.bfloat16, False),
    ((1, 3, 400, 96), (1, 3, 400, 96), torch.bfloat16, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("shape_q", "shape_kv", "dtype", "is_causal"), GPU_CASES)
def test_gpu_matches_reference(shape_q, shape_kv, dtype, is_causal):
    q, k, v, do = _inputs(shape_q, shape_kv, dtype, seed=shape_q[-2])
    _check_against_reference(triton_attention, q, k, v, do, is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("head_dim", "entry"), [(d, e) for (_, d), es in tuning.listed_configs("fwd", tma=True).items() for e in es]
)
def test_gpu_forward_with_tma_loads_matches_reference(monkeypatch, head_dim, entry):
    # Each KV_TMA config on its own: the autotuner would run only the fastest one.
    block_m, block_n, num_warps, num_stages = entry
    config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "KV_TMA": True}, num_warps=num_warps,
                           num_stages=num_stages)
    monkeypatch.setattr(tuning.autotuned_kernel("fwd"), "configs", [config])
    for is_causal in (False, True):
        q, k, v, _ = _inputs((2, 4, 777, head_dim), (2, 2, 1000, head_dim), torch.bfloat16, seed=head_dim)
        _check_forward(q, k, v, is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "head_dim", "entry"),
    [(name, d, e) for name in ("dkdv", "dq") for (_, d), entries in tuning.listed_configs(name, tma=True).items()
     for e in entries],
)
def test_gpu_backward_with_tma_loads_matches_reference_and_is_deterministic(monkeypatch, name, head_dim, entry):
    # Each backward TMA config on its own (the autotuner would run only the fastest one), twice: the TMA path
    # must stay bitwise reproducible.
    _force_backward_tma(monkeypatch, {name: entry})
    for is_causal in (False, True):
        q, k, v, do = _inputs((2, 4, 777, head_dim), (2, 2, 1000, head_dim), torch.bfloat16, seed=head_dim)
        _check_against_reference(triton_attention, q, k, v, do, is_causal)
        first, second = (_run(triton_attention, q, k, v, do, is_causal)[2] for _ in range(2))
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.gpu
def test_gpu_pytorch_function_and_compiled_backward():
    q, k, v, do = _inputs((2, 4, 300, 64), (2, 2, 300, 64), torch.bfloat16, seed=7)
    _check_against_reference(FlashAttentionPytorch.apply, q, k, v, do, True)
    _check_against_reference(lambda *a: flash_attention(*a, backward="pytorch"), q, k, v, do, True)


@pytest.mark.gpu
@pytest.mark.gpu_exclusive
@pytest.mark.parametrize(("shape", "heads_kv"), [((1, 16, 8192, 64), 16), ((1, 8, 4096, 128), 2)])
def test_gpu_large_bf16_matches_sdpa_in_fp32(shape, heads_kv):
    # A float64 reference would not fit; fp32 SDPA on the same bf16-rounded inputs stands in for it.
    shape_kv = (shape[0], heads_kv, *shape[2:])
    q, k, v, do = _inputs(shape, shape_kv, torch.bfloat16, seed=8)
    o, _, grads = _run(triton_attention, q, k, v, do, True)
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    o_ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    o_ref.backward(do.float())
    tol = REL_TOL[torch.bfloat16]
    assert _rel_err(o, o_ref.double()) < tol
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (q32.grad, k32.grad, v32.grad), strict=True):
        assert _rel_err(got, ref.double()) < tol, name


@pytest.mark.gpu
def test_gpu_backward_is_deterministic():
    q, k, v, do = _inputs((2, 8, 2048, 128), (2, 2, 2048, 128), torch.bfloat16, seed=9)
    first = _run(triton_attention, q, k, v, do, True)
    second = _run(triton_attention, q, k, v, do, True)
    for a, b in zip((first[0], first[1], *first[2]), (second[0], second[1], *second[2]), strict=True):
        assert torch.equal(a, b)

