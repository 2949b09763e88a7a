"""silu_mul against its float64 reference and the module's own rounding: output, both gradients, errors.

CPU tests run the kernels in the Triton interpreter (root conftest) in fp32 and fp16; GPU tests run bf16 at
the leaderboard shape (32,768 x 11,008). The reference, ``a * sigmoid(a) * b``, is the expression of
``cs336_basics.model.SwiGLU`` (``packages/harness/tests/test_fused_bench.py`` checks the whole module).
"""

from __future__ import annotations

import pytest
import torch
from cs336_kernels.swiglu import silu_mul, silu_mul_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# ||ours - float64|| / ||float64|| allowed, by dtype: three roundings in the forward (as the module), one per
# gradient. Against the module's expression evaluated by PyTorch in the same dtype the forward rounds at the same
# places, so only the fp32 sigmoid (exp implementations) differs, a rare one-ulp flip; rounding once instead of
# three times is 3.8e-4 off in fp16 (test_fp16_rounds_like_the_module's inputs), 7x what this allows.
REL_TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SAME_FORMULA_TOL = {torch.float32: 1e-6, torch.float16: 5e-5, torch.bfloat16: 5e-4}
# Ours may be less accurate than PyTorch's evaluation of the same expression by this much (fp32 arithmetic).
FP32_SLACK = 1e-6


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _inputs(shape, dtype, seed, device=DEVICE):
    gen = torch.Generator(device=device).manual_seed(seed)
    a, b, g = (torch.randn(shape, generator=gen, device=device) * 3 for _ in range(3))
    return a.to(dtype).requires_grad_(), b.to(dtype).requires_grad_(), g.to(dtype)


def _forward_backward(fn, a, b, g):
    out = fn(a, b)
    out.backward(g)
    grads = a.grad, b.grad
    a.grad = b.grad = None
    return out.detach(), *grads


def _compare(shape, dtype, seed=0):
    """Ours, PyTorch's evaluation of the expression in dtype, and float64, for out, da and db."""
    a, b, g = _inputs(shape, dtype, seed)
    ours = _forward_backward(silu_mul, a, b, g)
    same = _forward_backward(silu_mul_reference, a, b, g)
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    exact = _forward_backward(silu_mul_reference, a64, b64, g.double())
    for out in ours:
        assert out.dtype == dtype and out.shape == shape and torch.isfinite(out).all()
    return ours, same, exact


def _check(shape, dtype, seed=0):
    ours, same, exact = _compare(shape, dtype, seed)
    for name, out, pytorch, expected in zip(("out", "da", "db"), ours, same, exact, strict=True):
        assert _rel_err(out, expected) < REL_TOL[dtype], (name, _rel_err(out, expected))
        if name != "da":  # out and db are the same formula as PyTorch's; da is rounded once, not five times
            assert _rel_err(out, pytorch) < SAME_FORMULA_TOL[dtype], (name, _rel_err(out, pytorch))
        assert _rel_err(out, expected) <= 1.01 * _rel_err(pytorch, expected) + FP32_SLACK, name


@pytest.mark.parametrize("shape", [(3, 5, 37), (2, 2100), (1,), (4, 1)],
                         ids=["odd", "row-not-multiple-of-block", "one-element", "n-1"])
def test_matches_float64_reference_fp32(shape):
    _check(shape, torch.float32)


def test_fp16_rounds_like_the_module():
    _check((33, 1030), torch.float16, seed=1)


def test_strided_column_slices_of_a_fused_projection():
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    fused = (torch.randn(2, 7, 2 * 50, generator=gen, device=DEVICE) * 2).requires_grad_()
    a, b = fused[..., :50], fused[..., 50:]  # views with row stride 100
    g = torch.randn(2, 7, 50, generator=gen, device=DEVICE)
    silu_mul(a, b).backward(g)
    fused64 = fused.detach().double().requires_grad_()
    expected = silu_mul_reference(fused64[..., :50], fused64[..., 50:])
    expected.backward(g.double())
    assert _rel_err(silu_mul(a, b), expected) < REL_TOL[torch.float32]
    assert _rel_err(fused.grad, fused64.grad) < REL_TOL[torch.float32]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's exp(100)
def test_saturated_gate():
    # sigmoid saturates at both ends: the gradient 1 + a (1 - s) must not overflow or lose its sign.
    a = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0], device=DEVICE, requires_grad=True)
    b = torch.full_like(a, 2.0).requires_grad_()
    ours = _forward_backward(silu_mul, a, b, torch.ones_like(a))
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    exact = _forward_backward(silu_mul_reference, a64, b64, torch.ones_like(a64))
    for out, expected in zip(ours, exact, strict=True):
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize(
    ("a", "b", "error", "message"),
    [
        (torch.randn(3, 4), torch.randn(3, 5), ValueError, "one shape"),
        (torch.randn(()), torch.randn(()), ValueError, "one shape"),
        (torch.randn(3, 4), torch.randn(3, 4).half(), TypeError, "share a dtype"),
        (torch.randn(3, 4).double(), torch.randn(3, 4).double(), TypeError, "share a dtype"),
        (torch.randn(3, 4), None, TypeError, "b must be a torch.Tensor"),
    ],
)
def test_rejects_bad_inputs(a, b, error, message):
    with pytest.raises(error, match=message):
        silu_mul(a, b)


@pytest.mark.gpu
def test_leaderboard_shape_bf16_on_gpu():
    _check((32768, 11008), torch.bfloat16, seed=3)
