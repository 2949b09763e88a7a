"""rms_norm against its float64 reference: output, both gradients, awkward shapes, weight dtypes, errors.

CPU tests run the kernels in the Triton interpreter (root conftest) in fp32 and fp16; GPU tests run bf16 at the
leaderboard shape (32,768 x 4,096) and compare with the reference evaluated in bf16, which is the model's
``RMSNorm.forward`` (``packages/harness/tests/test_fused_bench.py`` checks that they are the same computation).
"""

from __future__ import annotations

import pytest
import torch
from cs336_kernels.rms_norm import rms_norm, rms_norm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# ||ours - float64|| / ||float64|| allowed, by the dtype the result is rounded to (one rounding of an fp32 value,
# plus fp32 summation order). Against the same formula evaluated by PyTorch in the input dtype, ours may differ
# by fp32 summation order alone, which moves a bf16 result by one ulp now and then.
REL_TOL = {torch.float64: 1e-6, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 5e-3}
SAME_FORMULA_TOL = {torch.float32: 1e-6, torch.bfloat16: 2e-4}
# Ours may be less accurate than PyTorch's evaluation of the same formula by this much (fp32 summation order).
FP32_ORDER_SLACK = 2e-6


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _inputs(shape, x_dtype, w_dtype, seed=0, device=DEVICE):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(shape, generator=gen, device=device) * 3 + 0.5).to(x_dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen, device=device)).to(w_dtype).requires_grad_()
    dy = torch.randn(shape, generator=gen, device=device).to(x_dtype)
    return x, w, dy


def _forward_backward(fn, x, w, dy, eps):
    y = fn(x, w, eps)
    y.backward(dy)
    grads = x.grad, w.grad
    x.grad = w.grad = None
    return y.detach(), *grads


def _check(shape, x_dtype, w_dtype, eps=1e-5, seed=0):
    x, w, dy = _inputs(shape, x_dtype, w_dtype, seed)
    ours = _forward_backward(rms_norm, x, w, dy, eps)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    ref = _forward_backward(rms_norm_reference, x64, w64, dy.double(), eps)
    assert ours[0].dtype == ours[1].dtype == x_dtype and ours[2].dtype == w_dtype
    for name, out, expected, dtype in zip(("y", "dx", "dw"), ours, ref, (x_dtype, x_dtype, w_dtype), strict=True):
        assert out.shape == expected.shape, name
        err = _rel_err(out, expected)
        assert err < REL_TOL[dtype], (name, err)


# Rows are split over 3 programs in the interpreter: 130 leaves a ragged last block, 4 rows leave one program
# empty. d = 1 is left out: there the x gradient is O(eps) and fp32 cancellation swamps it (PyTorch's too).
@pytest.mark.parametrize(
    "shape",
    [(3, 5, 37), (130, 64), (1, 1, 7), (4, 2), (2, 5000)],
    ids=["odd-d", "rows-not-multiple", "one-row", "d-2", "d-above-4096"],
)
def test_matches_float64_reference_fp32(shape):
    _check(shape, torch.float32, torch.float32)


@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                                  (torch.float32, torch.float16), (torch.float32, torch.float64)])
def test_matches_float64_reference_mixed_dtypes(x_dtype, w_dtype):
    _check((17, 3, 96), x_dtype, w_dtype, seed=1)


def test_large_eps_and_strided_input():
    x, w, dy = _inputs((6, 2, 40), torch.float32, torch.float32, seed=2)
    strided = x.transpose(0, 1)  # (2, 6, 40) with non-unit strides on the leading dims
    y = rms_norm(strided, w, eps=0.5)
    expected = rms_norm_reference(strided.double(), w.double(), eps=0.5)
    assert y.shape == strided.shape and _rel_err(y, expected) < REL_TOL[torch.float32]
    y.backward(dy.transpose(0, 1))
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    rms_norm_reference(x64.transpose(0, 1), w64, eps=0.5).backward(dy.double().transpose(0, 1))
    assert _rel_err(x.grad, x64.grad) < REL_TOL[torch.float32]
    assert _rel_err(w.grad, w64.grad) < REL_TOL[torch.float32]


def test_weight_without_grad_and_empty_input():
    x, w, dy = _inputs((5, 12), torch.float32, torch.float32, seed=3)
    w.requires_grad_(False)
    rms_norm(x, w).backward(dy)
    assert w.grad is None and x.grad is not None
    empty = torch.empty(0, 12, device=DEVICE, requires_grad=True)
    out = rms_norm(empty, w)
    out.sum().backward()
    assert out.shape == (0, 12) and empty.grad.shape == (0, 12)


@pytest.mark.parametrize(
    ("x", "w", "eps", "error", "message"),
    [
        (torch.randn(3, 4), torch.randn(5), 1e-5, ValueError, r"weight \(d,\)"),
        (torch.randn(3, 4), torch.randn(1, 4), 1e-5, ValueError, r"weight \(d,\)"),
        (torch.randn(()), torch.randn(1), 1e-5, ValueError, r"\(\.\.\., d\)"),
        (torch.randn(3, 4, dtype=torch.float64), torch.randn(4), 1e-5, TypeError, "x must have a dtype"),
        (torch.randn(3, 4), torch.randn(4).to(torch.int32), 1e-5, TypeError, "weight must have a dtype"),
        (torch.randn(3, 4), torch.randn(4), -1.0, ValueError, "eps"),
        (torch.randn(3, 4), torch.randn(4), "1e-5", ValueError, "eps"),
        ([1.0, 2.0], torch.randn(2), 1e-5, TypeError, "x must be a torch.Tensor"),
        (torch.randn(2, 65537), torch.randn(65537), 1e-5, ValueError, "d must be in"),
    ],
)
def test_rejects_bad_inputs(x, w, eps, error, message):
    with pytest.raises(error, match=message):
        rms_norm(x, w, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_leaderboard_shape_bf16_on_gpu(w_dtype):
    shape = (32768, 4096)
    _check(shape, torch.bfloat16, w_dtype, seed=4)
    x, w, dy = _inputs(shape, torch.bfloat16, w_dtype, seed=5)
    ours = _forward_backward(rms_norm, x, w, dy, 1e-5)
    eager = _forward_backward(rms_norm_reference, x, w, dy, 1e-5)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    exact = _forward_backward(rms_norm_reference, x64, w64, dy.double(), 1e-5)
    for name, out, same, expected in zip(("y", "dx", "dw"), ours, eager, exact, strict=True):
        assert torch.isfinite(out).all(), name
        tol = SAME_FORMULA_TOL[out.dtype] if out.dtype in SAME_FORMULA_TOL else REL_TOL[out.dtype]
        if name == "y":  # the forward is the same formula; the backward is PyTorch's autograd of it
            assert _rel_err(out, same) < tol, (name, _rel_err(out, same))
        # Never less accurate than PyTorch running the module's formula in bf16.
        assert _rel_err(out, expected) <= 1.01 * _rel_err(same, expected) + FP32_ORDER_SLACK, name
