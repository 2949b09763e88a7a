"""Every public kernel as a registered operator: ``torch.library.opcheck`` on each operator, and each public function
inside ``torch.compile(fullgraph=True)``: forward and backward equal to eager, no graph break, two sequence lengths
with one compile under dynamic shapes.

On CPU the kernels run in Triton's interpreter and the compiled function goes through AOTAutograd with the
``aot_eager`` backend (the fake implementations, the autograd formulas and functionalization, without Inductor's
C++ build); on a GPU through Inductor. The compiled and eager runs call the same kernels, so they must agree bit
for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch._dynamo.testing
from cs336_kernels import (
    FusedAdamW,
    add_rms_norm,
    flash_attention,
    flash_attention_varlen,
    fused_linear_cross_entropy,
    rms_norm,
    rope,
    silu_mul,
)
from cs336_kernels.ops.flash_attention import flash_attention_backward_op, flash_attention_op
from cs336_kernels.ops.fused_adamw import fused_adamw_step_op
from cs336_kernels.ops.fused_linear_cross_entropy import (
    linear_cross_entropy_backward_op,
    linear_cross_entropy_op,
    scale_inplace,
)
from cs336_kernels.ops.rms_norm import add_rms_norm_op, rms_norm_backward_op, rms_norm_op
from cs336_kernels.ops.rope import rope_op
from cs336_kernels.ops.swiglu import silu_mul_backward_op, silu_mul_op

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BACKEND = "inductor" if CUDA else "aot_eager"
DTYPE = torch.bfloat16 if CUDA else torch.float32
HEAD_DIM = 64 if CUDA else 16  # 64: the Gluon kernels' head dim on an H100/H200
LENGTHS = (37, 52)  # two sequence lengths, neither a multiple of a tile


def _randn(*shape: int, seed: int, requires_grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DEVICE, DTYPE).requires_grad_(requires_grad)


@dataclass(frozen=True)
class Case:
    """A public function and its inputs at a sequence length (the grads are taken of the tensors that require
    them)."""

    fn: Callable
    inputs: Callable[[int], tuple]


def _rope_inputs(n: int) -> tuple:
    angles = torch.randn(64, HEAD_DIM // 2, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    return (_randn(2, n, 3, HEAD_DIM, seed=1), _randn(2, n, 1, HEAD_DIM, seed=2), angles.cos(), angles.sin(),
            torch.arange(n, device=DEVICE))


def _rope_half_inputs(n: int) -> tuple:
    angles = torch.randn(1, n, HEAD_DIM // 2, generator=torch.Generator().manual_seed(3)).to(DEVICE, DTYPE)
    angles = torch.cat((angles, angles), dim=-1)  # Hugging Face's cat(freqs, freqs)
    return _randn(2, n, 3, HEAD_DIM, seed=1), _randn(2, n, 1, HEAD_DIM, seed=2), angles.cos(), angles.sin()


def _lce_inputs(n: int) -> tuple:
    targets = torch.randint(0, 11, (n,), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    targets[::5] = -100
    return _randn(n, 32, seed=4), _randn(11, 32, seed=5), targets


CASES = {
    "rms_norm": Case(lambda x, w: rms_norm(x, w, 1e-5), lambda n: (_randn(2, n, 48, seed=0), _randn(48, seed=1))),
    "rms_norm_variants": Case(lambda x, w: rms_norm(x, w, 1e-6, offset=1.0, cast_before_weight=True),
                              lambda n: (_randn(2, n, 48, seed=0), _randn(48, seed=1))),
    "add_rms_norm": Case(add_rms_norm, lambda n: (_randn(2, n, 48, seed=0), _randn(2, n, 48, seed=1),
                                                  _randn(48, seed=2))),
    "rope": Case(rope, _rope_inputs),
    "rope_half": Case(lambda q, k, cos, sin: rope(q, k, cos, sin, layout="half"), _rope_half_inputs),
    "silu_mul": Case(silu_mul, lambda n: (_randn(2, n, 40, seed=0), _randn(2, n, 40, seed=1))),
    "linear_cross_entropy_mean": Case(fused_linear_cross_entropy, _lce_inputs),
    "linear_cross_entropy_none": Case(lambda h, w, t: fused_linear_cross_entropy(h, w, t, "none"), _lce_inputs),
    "linear_cross_entropy_options": Case(
        lambda h, w, t: fused_linear_cross_entropy(h, w, t, label_smoothing=0.1, z_loss=1e-3, softcap=5.0),
        _lce_inputs),
    **{f"flash_attention_{backward}": Case(
        lambda q, k, v, backward=backward: flash_attention(q, k, v, True, backward=backward),
        lambda n: tuple(_randn(1, 2, n, HEAD_DIM, seed=i) for i in range(3)))
       for backward in ("auto", "triton")},
    # A packed batch of three sequences (one of them empty); its longest length bounded by the total, so that
    # nothing but the tensors' (dynamic) lengths enters the graph.
    **{f"flash_attention_varlen_{backward}": Case(
        lambda q, k, v, cu, backward=backward: flash_attention_varlen(
            q, k, v, cu, cu, q.shape[0], k.shape[0], causal=True, window_size=(9, -1), backward=backward),
        lambda n: (*(_randn(n, 2, HEAD_DIM, seed=i) for i in range(3)), _cu_seqlens(n)))
       for backward in ("auto", "triton")},
}


def _cu_seqlens(n: int) -> torch.Tensor:
    return torch.tensor([0, n // 3, n // 3, n], dtype=torch.int32, device=DEVICE)


# The quick run (-m "not slow") keeps one case of each kind of check: the cheapest in the interpreter.
QUICK = ("silu_mul",)


def _cases() -> list:
    return [pytest.param(name, marks=() if name in QUICK else pytest.mark.slow) for name in CASES]


def _run(fn: Callable, inputs: tuple) -> list[torch.Tensor]:
    """The outputs of ``fn`` and the gradients, for fixed random upstream gradients, of the inputs that require
    them (the upstream gradients come from outside the compiled code, so both runs' backwards see the same)."""
    out = fn(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    gen = torch.Generator().manual_seed(7)
    # A scalar (a loss) gets 1, as from loss.backward(): the fused loss scales its bf16 gradients by it, which eager
    # PyTorch rounds to bf16 first and Inductor does not, so only 1 gives both the same bits.
    upstream = [torch.ones((), device=o.device, dtype=o.dtype) if o.dim() == 0 else
                torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, leaves, upstream)
    return [o.detach() for o in outs] + list(grads)


@pytest.mark.parametrize("name", _cases())
def test_fullgraph_compile_equals_eager_forward_and_backward(name):
    case = CASES[name]
    torch._dynamo.reset()
    inputs = case.inputs(LENGTHS[0])
    compiled = _run(torch.compile(case.fn, fullgraph=True, backend=BACKEND), inputs)
    for got, expected in zip(compiled, _run(case.fn, inputs), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("name", list(CASES))
def test_no_graph_break(name):
    case = CASES[name]
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(case.fn)(*case.inputs(LENGTHS[0]))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("name", _cases())
def test_two_lengths_one_compile(name):
    case = CASES[name]
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(BACKEND)
    compiled = torch.compile(case.fn, fullgraph=True, backend=counter)
    for n in LENGTHS:
        inputs = case.inputs(n)
        for t in inputs:  # the sequence dims are dynamic (no other dim of the inputs has a length of LENGTHS)
            for dim in (d for d, size in enumerate(t.shape) if size == n):
                torch._dynamo.mark_dynamic(t, dim)
        for got, expected in zip(_run(compiled, inputs), _run(case.fn, inputs), strict=True):
            assert torch.equal(got, expected)
    assert counter.frame_count == 1


@pytest.mark.slow
def test_fused_adamw_step_compiles_fullgraph_and_equals_eager():
    def params() -> list[torch.nn.Parameter]:
        ps = [torch.nn.Parameter(_randn(5, seed=0, requires_grad=False).float()),
              torch.nn.Parameter(_randn(3, 7, seed=1, requires_grad=False))]
        for i, p in enumerate(ps):
            p.grad = _randn(*p.shape, seed=10 + i, requires_grad=False).to(p.dtype)
        return ps

    torch._dynamo.reset()
    eager, compiled = params(), params()
    eager_opt, compiled_opt = FusedAdamW(eager, lr=1e-2), FusedAdamW(compiled, lr=1e-2)
    step = torch.compile(compiled_opt.step, fullgraph=True, backend=BACKEND)
    assert torch._dynamo.explain(FusedAdamW(params(), lr=1e-2).step)().graph_break_count == 0
    for _ in range(2):
        eager_opt.step()
        step()
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


def _opcheck_cases() -> list:
    x, w, d = _randn(3, 5, 48, seed=0), _randn(48, seed=1), _randn(3, 5, 48, seed=2)
    y, rstd = (t.detach() for t in rms_norm_op(x, w, 1e-5))
    q, k, cos, sin, positions = _rope_inputs(9)
    a, b = _randn(4, 5, 40, seed=3), _randn(4, 5, 40, seed=4)
    hidden, weight, targets = _lce_inputs(13)
    qa, ka, va = (_randn(1, 2, 19, HEAD_DIM, seed=i) for i in range(3))
    dense = (None, None, 0, 0, HEAD_DIM ** -0.5, -1, 0, True, 0.0)
    oa, lse = flash_attention_op(qa, ka, va, *dense, "auto", "auto", False)
    grad = _randn(1, 2, 19, HEAD_DIM, seed=9, requires_grad=False)
    qp, kp, vp = (_randn(19, 2, HEAD_DIM, seed=i) for i in range(3))
    packed = (_cu_seqlens(19), _cu_seqlens(19), 13, 13, 0.3, 4, 0, True, 2.0)
    op, lsep = flash_attention_op(qp, kp, vp, *packed, "auto", "auto", False)
    params = [_randn(5, seed=5, requires_grad=False).float(), _randn(3, 7, seed=6, requires_grad=False).float()]
    state = [[torch.randn_like(p) for p in params], [torch.zeros_like(p) for p in params],
             [torch.zeros_like(p) for p in params], [torch.zeros((), device=DEVICE) for _ in params]]
    return [
        pytest.param(rms_norm_op, (x, w, 1e-5), id="rms_norm_forward"),
        pytest.param(rms_norm_op, (x, w, 1e-6, 1.0, True), id="rms_norm_forward_variants"),
        pytest.param(add_rms_norm_op, (x, d, w, 1e-5), id="add_rms_norm_forward"),
        pytest.param(rms_norm_backward_op, (torch.randn_like(y), x.detach(), w.detach(), rstd, None),
                     id="rms_norm_backward"),
        pytest.param(rms_norm_backward_op, (torch.randn_like(y), x.detach(), w.detach(), rstd, d.detach()),
                     id="rms_norm_backward_add"),
        pytest.param(rms_norm_backward_op, (torch.randn_like(y), x.detach(), w.detach(), rstd, None, 1.0, True),
                     id="rms_norm_backward_variants"),
        pytest.param(rope_op, (q, k, cos, sin, positions, False, False), id="rope"),
        pytest.param(rope_op, (*_rope_half_inputs(9)[:4], None, False, True), id="rope_half"),
        pytest.param(silu_mul_op, (a, b), id="silu_mul_forward"),
        pytest.param(silu_mul_backward_op, (torch.randn_like(a), a.detach(), b.detach()), id="silu_mul_backward"),
        *(pytest.param(linear_cross_entropy_op, (hidden, weight, targets, reduction, -100, 4, True, True),
                       id=f"linear_cross_entropy_{reduction}") for reduction in ("mean", "sum", "none")),
        pytest.param(linear_cross_entropy_op, (hidden, weight, targets, "mean", -100, 4, True, True, 0.1, 1e-3, 5.0),
                     id="linear_cross_entropy_options"),
        pytest.param(linear_cross_entropy_backward_op, (hidden.detach(), weight.detach(), targets,
                                                        torch.rand(13, device=DEVICE), -100, None, True, False),
                     id="linear_cross_entropy_backward"),
        pytest.param(scale_inplace, (_randn(3, 70, seed=10, requires_grad=False), torch.tensor(0.5, device=DEVICE)),
                     id="scale_inplace"),
        pytest.param(flash_attention_op, (qa, ka, va, *dense, "auto", "auto", False), id="flash_attention_forward"),
        *(pytest.param(flash_attention_backward_op, (qa.detach(), ka.detach(), va.detach(), oa.detach(), grad,
                                                     lse.detach(), None, *dense, backward, False),
                       id=f"flash_attention_backward_{backward}") for backward in ("auto", "triton")),
        pytest.param(flash_attention_op, (qp, kp, vp, *packed, "auto", "auto", False),
                     id="flash_attention_varlen_forward"),
        pytest.param(flash_attention_backward_op, (qp.detach(), kp.detach(), vp.detach(), op.detach(),
                                                   torch.randn_like(op), lsep.detach(), torch.randn_like(lsep),
                                                   *packed, "auto", False),
                     id="flash_attention_varlen_backward"),
        pytest.param(fused_adamw_step_op, (params, *state, 1e-3, 0.9, 0.999, 1e-8, 0.01, 16), id="fused_adamw_step"),
    ]


QUICK_OPCHECKS = ("silu_mul_forward", "silu_mul_backward", "rms_norm_backward", "fused_adamw_step")


@pytest.mark.parametrize(("op", "args"), [
    pytest.param(*case.values, id=case.id, marks=() if case.id in QUICK_OPCHECKS else pytest.mark.slow)
    for case in _opcheck_cases()
])
def test_opcheck(op, args):
    torch.library.opcheck(op, args)
