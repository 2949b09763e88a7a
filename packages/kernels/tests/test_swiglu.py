"""silu_mul against its float64 reference and the module's own rounding: output, both gradients, errors.

CPU tests run the kernels in the Triton interpreter (root conftest) in fp32 and fp16, on both index paths
(contiguous rows and strided rows) and across program blocks; GPU tests run bf16 at the leaderboard shape
(32,768 x 11,008) and past 2^31 elements. The reference, ``a * sigmoid(a) * b``, is the expression of
``cs336_basics.model.SwiGLU`` (``packages/harness/tests/test_fused_bench.py`` checks the whole module).
"""

from __future__ import annotations

import pytest
import torch
from cs336_kernels.ops import swiglu
from cs336_kernels.ops.swiglu import MAX_N, MAX_NUMEL, silu_mul, silu_mul_backward, silu_mul_forward, silu_mul_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Far out in the tails, where silu(a) * b is ~1e-12: the interpreter's numpy exp against the GPU's exp2, which is
# within 2 ulp (ex2.approx) and is scaled by 30 * log2(e) on the way in.
SATURATED_RTOL = {"cpu": 1e-6, "cuda": 2e-6}
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


@pytest.mark.parametrize(
    "shape",
    [(3, 5, 37), (2, 2100), (1,), (4, 1), (3, 7), (5, 1000), (2, swiglu._BLOCK), (swiglu._BLOCK + 1, 1)],
    ids=["odd", "row-not-multiple-of-block", "one-element", "n-1", "n-7", "tail-block", "two-whole-blocks",
         "n-1-past-a-block"],
)
def test_matches_float64_reference_fp32(shape):
    _check(shape, torch.float32)


def _padded(rows, n, pad, gen, dtype=torch.float32):
    """(rows, n) random values as the first n columns of a (rows, n + pad) buffer whose other columns are NaN."""
    buf = torch.full((rows, n + pad), float("nan"), dtype=dtype, device=DEVICE)
    buf[:, :n] = torch.randn(rows, n, generator=gen, device=DEVICE) * 3
    return buf[:, :n]


# (rows, n): blocks begin inside a row (n = 7, 1000), a block holds many rows (n = 1, 7), numel is not a
# multiple of the block.
STRIDED_SHAPES = [(swiglu._BLOCK + 5, 1), (1000, 7), (9, 1000)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", STRIDED_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_strided_rows_match_contiguous_rows_exactly(shape, dtype):
    # Row strides 3 + n, n (b alone is contiguous) and 5 + n; a wrong row or column offset reads a NaN or another
    # element, and the contiguous path (checked against float64 above) must agree bit for bit.
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    rows, n = shape
    a, b, g = _padded(rows, n, 3, gen, dtype), _padded(rows, n, 0, gen, dtype), _padded(rows, n, 5, gen, dtype)
    assert swiglu._row_strided(a, b) and swiglu._row_strided(g, a, b)
    ca, cb, cg = a.contiguous(), b.contiguous(), g.contiguous()
    assert not swiglu._row_strided(ca, cb) and not swiglu._row_strided(cg, ca, cb)
    out, (da, db) = silu_mul_forward(a, b), silu_mul_backward(g, a, b)
    for ours, contiguous in zip((out, da, db), (silu_mul_forward(ca, cb), *silu_mul_backward(cg, ca, cb)),
                                strict=True):
        assert torch.isfinite(ours).all()
        assert torch.equal(ours, contiguous)
    a64, b64 = (t.double().requires_grad_() for t in (ca, cb))
    expected = silu_mul_reference(a64, b64)
    expected.backward(cg.double())
    for name, ours, exact in zip(("out", "da", "db"), (out, da, db), (expected, a64.grad, b64.grad), strict=True):
        assert _rel_err(ours, exact) < REL_TOL[dtype], (name, _rel_err(ours, exact))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_last_block_stores_nothing_past_the_output(strided):
    # 5 x 1000 = 4096 + 904 elements: the second program's block is 78% masked. Outputs are the heads of longer
    # buffers holding a sentinel; inputs are followed by NaN, so an unmasked lane past numel would show.
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    rows, n, block = 5, 1000, swiglu._BLOCK
    numel = rows * n
    grid = swiglu._grid(numel)
    assert grid == (2,) and numel % block
    ins = [_padded(rows, n, 2 if strided else 0, gen) for _ in range(3)]
    if not strided:
        ins = [torch.cat([t.flatten(), torch.full((block,), float("nan"), device=DEVICE)])[:numel].view(rows, n)
               for t in ins]
    g, a, b = ins
    assert swiglu._row_strided(g, a, b) == strided
    bufs = [torch.full((numel + block,), -7.0, device=DEVICE) for _ in range(3)]
    out, da, db = (buf[:numel].view(rows, n) for buf in bufs)
    swiglu._silu_mul_fwd_kernel[grid](a, b, out, a.stride(0), b.stride(0), n, numel, BLOCK=block,
                                      ROW_STRIDED=strided, num_warps=swiglu._NUM_WARPS)
    swiglu._silu_mul_bwd_kernel[grid](g, a, b, da, db, g.stride(0), a.stride(0), b.stride(0), n, numel, BLOCK=block,
                                      ROW_STRIDED=strided, num_warps=swiglu._NUM_WARPS)
    for buf in bufs:
        assert torch.isfinite(buf[:numel]).all()
        assert (buf[numel:] == -7.0).all()
    assert torch.equal(out, silu_mul_forward(a.contiguous(), b.contiguous()))
    assert all(torch.equal(x, y) for x, y in zip((da, db), silu_mul_backward(*(t.contiguous() for t in ins)),
                                                 strict=True))


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
        torch.testing.assert_close(out.double(), expected, rtol=SATURATED_RTOL[DEVICE], atol=1e-30)


@pytest.mark.parametrize(
    ("a", "b", "error", "message"),
    [
        (torch.randn(3, 4), torch.randn(3, 5), ValueError, "one shape"),
        (torch.randn(()), torch.randn(()), ValueError, "one shape"),
        (torch.randn(3, 4), torch.randn(3, 4).half(), TypeError, "share a dtype"),
        (torch.randn(3, 4).double(), torch.randn(3, 4).double(), TypeError, "share a dtype"),
        (torch.randn(3, 4), None, TypeError, "b must be a torch.Tensor"),
        (torch.randn(1).expand(MAX_N + 1), torch.randn(1).expand(MAX_N + 1), ValueError, "last dim must be at most"),
        (torch.randn(1, 1).expand(MAX_NUMEL // 8 + 1, 8), torch.randn(1, 1).expand(MAX_NUMEL // 8 + 1, 8), ValueError,
         "elements"),
    ],
)
def test_rejects_bad_inputs(a, b, error, message):
    with pytest.raises(error, match=message):
        silu_mul(a, b)


@pytest.mark.gpu
@pytest.mark.gpu_exclusive
def test_leaderboard_shape_bf16_on_gpu():
    _check((32768, 11008), torch.bfloat16, seed=3)


@pytest.mark.gpu
@pytest.mark.gpu_exclusive
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_past_2_31_elements_bf16_on_gpu(strided):
    # Offsets past 2^31 elements (program starts, the strided rows' first row) must not wrap in int32.
    n = 11008
    rows = 2**31 // n + 2
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    if strided:
        fused = torch.randn(rows, 2 * n, generator=gen, device=DEVICE, dtype=torch.bfloat16)
        a, b = fused[:, :n], fused[:, n:]
    else:
        a, b = (torch.randn(rows, n, generator=gen, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    g = torch.randn(rows, n, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    assert a.numel() > 2**31 and swiglu._row_strided(g, a, b) == strided
    ours = (silu_mul_forward(a, b), *silu_mul_backward(g, a, b))
    for part in (slice(0, 2), slice(rows - 2, rows)):
        a64, b64 = (t[part].double().requires_grad_() for t in (a, b))
        expected = silu_mul_reference(a64, b64)
        expected.backward(g[part].double())
        for name, out, exact in zip(("out", "da", "db"), ours, (expected, a64.grad, b64.grad), strict=True):
            assert _rel_err(out[part], exact) < REL_TOL[torch.bfloat16], (name, part, _rel_err(out[part], exact))
