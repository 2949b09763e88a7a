"""rms_norm and add_rms_norm against their float64 references: outputs, every gradient, awkward shapes, weight
dtypes, errors; add_rms_norm also bit for bit against the unfused add, rms_norm and autograd's sum.

CPU tests run the kernels in the Triton interpreter (root conftest) in fp32 and fp16 (the interpreter truncates
fp32 to bf16 where PyTorch and the GPU round to nearest, so bf16 bit equality is checked on the GPU only); GPU
tests run bf16 at the leaderboard shape (32,768 x 4,096) and compare with the reference evaluated in bf16, which is
the model's ``RMSNorm.forward`` (``packages/harness/tests/test_fused_bench.py`` checks that they are the same
computation).
"""

from __future__ import annotations

import pytest
import torch
from cs336_kernels.ops.rms_norm import (
    Launch,
    add_rms_norm,
    add_rms_norm_reference,
    launch_settings,
    num_programs,
    reduce_weight_grad,
    rms_norm,
    rms_norm_backward,
    rms_norm_backward_rows,
    rms_norm_forward,
    rms_norm_reference,
)

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
@pytest.mark.gpu_exclusive
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


# The variants other models' norms need: Hugging Face Llama's rounding (cast before the weight) and Gemma's offset.

def _hf_llama_rms_norm(x, w, eps):
    """``LlamaRMSNorm.forward`` (Qwen2, Qwen3 and Mistral's are the same) written out."""
    h = x.to(torch.float32 if x.dtype != torch.float64 else torch.float64)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _gemma_rms_norm(x, w, eps):
    """Gemma's RMSNorm: normalise in fp32, scale by 1 + w in fp32, round once."""
    acc = torch.float32 if x.dtype != torch.float64 else torch.float64
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.to(acc))).type_as(x)


VARIANTS = {"hf_llama": ({"cast_before_weight": True}, _hf_llama_rms_norm),
            "gemma": ({"offset": 1.0}, _gemma_rms_norm)}


def _check_variant(variant, shape, dtype, seed=0, view=lambda t: t):
    kwargs, formula = VARIANTS[variant]
    x, w, dy = _inputs(shape, dtype, dtype, seed)
    ours = _forward_backward(lambda x_, w_, eps: rms_norm(view(x_), w_, eps, **kwargs), x, w, view(dy), 1e-6)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    exact = _forward_backward(lambda x_, w_, eps: formula(view(x_), w_, eps), x64, w64, view(dy).double(), 1e-6)
    ref = _forward_backward(lambda x_, w_, eps: rms_norm_reference(view(x_), w_, eps, **kwargs), x64, w64,
                            view(dy).double(), 1e-6)
    for name, out, expected, reference in zip(("y", "dx", "dw"), ours, exact, ref, strict=True):
        assert out.dtype == dtype and out.shape == expected.shape, name
        assert _rel_err(out, expected) < REL_TOL[dtype], (name, _rel_err(out, expected))
        torch.testing.assert_close(reference, expected, rtol=1e-12, atol=1e-12)
    return x, w, dy, ours, formula


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("shape", "dtype"), [((3, 5, 37), torch.float32), ((130, 64), torch.float16),
                                              ((1, 1, 7), torch.float32)], ids=["odd-d", "fp16-130-rows", "one-row"])
def test_variants_match_their_formulas(variant, shape, dtype):
    _check_variant(variant, shape, dtype)


def test_hf_rounding_is_hf_bit_for_bit_in_fp16():
    # Each product of the rounded x * rstd and an fp16 weight is exact in fp32, so one rounding gives fp16's
    # product: the forward equals HF's module bit for bit (the statistics are fp32 in both).
    x, w, _ = _inputs((9, 40), torch.float16, torch.float16, seed=3)
    assert torch.equal(rms_norm(x, w, 1e-6, cast_before_weight=True), _hf_llama_rms_norm(x, w, 1e-6))


def test_per_head_qk_norm_on_a_projection_view():
    # Qwen3 normalises each head of q: the (batch, seq, heads * head_dim) projection seen as (batch, seq, heads,
    # head_dim), normalised over head_dim with a (head_dim,) weight.
    proj, _, dy = _inputs((2, 7, 3 * 16), torch.float32, torch.float32, seed=4)
    w = _inputs((16,), torch.float32, torch.float32, seed=5)[1]
    heads = lambda t: t.view(2, 7, 3, 16)
    ours = _forward_backward(lambda p_, w_, eps: rms_norm(heads(p_), w_, eps, cast_before_weight=True), proj, w,
                             heads(dy), 1e-6)
    p64, w64 = (t.detach().double().requires_grad_() for t in (proj, w))
    exact = _forward_backward(lambda p_, w_, eps: _hf_llama_rms_norm(heads(p_), w_, eps), p64, w64,
                              heads(dy).double(), 1e-6)
    assert ours[0].shape == (2, 7, 3, 16)
    for name, out, expected in zip(("y", "dproj", "dw"), ours, exact, strict=True):
        assert _rel_err(out, expected) < REL_TOL[torch.float32], (name, _rel_err(out, expected))


@pytest.mark.parametrize(("kwargs", "message"), [({"offset": float("nan")}, "offset must be a finite float"),
                                                 ({"offset": True}, "offset must be a finite float")])
def test_variants_reject_bad_inputs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rms_norm(torch.randn(3, 4), torch.randn(4), **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_bf16_on_gpu(variant):
    # Llama-3.2-1B's width at 8,192 tokens. With HF's rounding, the forward is HF's up to where the fp32 statistics
    # (summed in another order than PyTorch's) put x * rstd across a bf16 rounding boundary: each element is the
    # weight times HF's rounded x * rstd or one of its two bf16 neighbours, rounded.
    x, w, dy, ours, formula = _check_variant(variant, (8192, 2048), torch.bfloat16, seed=6)
    if variant == "hf_llama":
        h = x.detach().float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        bits = h.view(torch.int16)
        candidates = [w.detach() * n for n in (h, (bits + 1).view(torch.bfloat16), (bits - 1).view(torch.bfloat16))]
        assert torch.equal(candidates[0], formula(x.detach(), w.detach(), 1e-6))
        assert torch.stack([ours[0] == c for c in candidates]).any(0).all()


# add_rms_norm: the residual add folded into the norm.

def _add_inputs(shape, dtype, w_dtype, seed=0, device=DEVICE):
    x, w, dy = _inputs(shape, dtype, w_dtype, seed, device)
    gen = torch.Generator(device=device).manual_seed(seed + 100)
    delta = torch.randn(shape, generator=gen, device=device).to(dtype).requires_grad_()
    dh = torch.randn(shape, generator=gen, device=device).to(dtype)
    return x, delta, w, dh, dy


def _unfused(x, delta, w, eps):
    """What the block computes without the fold: PyTorch's add, then the rms_norm kernel on its result."""
    h = x + delta
    return h, rms_norm(h, w, eps)


def _add_forward_backward(fn, x, delta, w, dh, dy, eps=1e-5):
    h, y = fn(x, delta, w, eps)
    torch.autograd.backward((h, y), (dh, dy))  # autograd sums dh and the norm's gradient into h's gradient
    grads = x.grad, delta.grad, w.grad
    x.grad = delta.grad = w.grad = None
    return h.detach(), y.detach(), *grads


ADD_NAMES = ("h", "y", "dx", "ddelta", "dw")


def _check_add(shape, dtype, w_dtype, eps=1e-5, seed=0):
    x, delta, w, dh, dy = _add_inputs(shape, dtype, w_dtype, seed)
    ours = _add_forward_backward(add_rms_norm, x, delta, w, dh, dy, eps)
    x64, delta64, w64 = (t.detach().double().requires_grad_() for t in (x, delta, w))
    ref = _add_forward_backward(add_rms_norm_reference, x64, delta64, w64, dh.double(), dy.double(), eps)
    dtypes = (dtype,) * 4 + (w_dtype,)
    for name, out, expected, want_dtype in zip(ADD_NAMES, ours, ref, dtypes, strict=True):
        assert out.shape == expected.shape and out.dtype == want_dtype, name
        # h is rounded to x's dtype before the norm reads it (as in the model), so even an fp32 dw carries that
        # rounding: each result is held to the coarser of its own dtype and x's.
        err = _rel_err(out, expected)
        assert err < max(REL_TOL[want_dtype], REL_TOL[dtype]), (name, err)
    return x, delta, w, dh, dy, ours


# Rows 1, 7 and 333 (a ragged last block over the interpreter's 3 programs); d = 37, 100, 65 and 5000 are not powers
# of two, 5000 is above one 4096 block.
# The 333-row shape takes seconds in the interpreter (each of 3 programs walks 111 rows): slow, the others quick.
ADD_SHAPES = [(1, 1, 37), (7, 100), pytest.param((3, 111, 65), marks=pytest.mark.slow), (2, 5000)]
ADD_IDS = ["one-row", "7-rows", "333-rows", "d-above-4096"]


@pytest.mark.parametrize("shape", ADD_SHAPES, ids=ADD_IDS)
def test_add_matches_float64_reference_fp32(shape):
    _check_add(shape, torch.float32, torch.float32)


@pytest.mark.parametrize(("dtype", "w_dtype"), [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                                (torch.float32, torch.float64)])
def test_add_matches_float64_reference_mixed_dtypes(dtype, w_dtype):
    _check_add((17, 3, 96), dtype, w_dtype, seed=1)


# fp32 in the interpreter only: compiled for a GPU, the add of the residual's gradient contracts with the norm's last
# product into one FMA (one rounding where the unfused kernels round twice); fp16 rounds in between, so it is exact.
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.interpreter), torch.float16])
@pytest.mark.parametrize("shape", ADD_SHAPES[:3], ids=ADD_IDS[:3])
def test_add_is_the_unfused_add_and_norm_bit_for_bit(shape, dtype):
    x, delta, w, dh, dy, ours = _check_add(shape, dtype, torch.float32, seed=2)
    unfused = _add_forward_backward(_unfused, x, delta, w, dh, dy)
    for name, got, want in zip(ADD_NAMES, ours, unfused, strict=True):
        assert torch.equal(got, want), name
    # x and delta get one gradient, as from the add, but not one tensor: changing one in place leaves the other.
    h, y = add_rms_norm(x, delta, w)
    torch.autograd.backward((h, y), (dh, dy))
    assert x.grad.data_ptr() != delta.grad.data_ptr()


def test_add_strided_inputs_and_large_eps():
    x, delta, w, dh, dy = _add_inputs((6, 2, 40), torch.float32, torch.float32, seed=3)
    x64, delta64, w64 = (t.detach().double().requires_grad_() for t in (x, delta, w))
    outs = []
    for fn, a, b, c, upstream in ((add_rms_norm, x, delta, w, (dh, dy)),
                                  (add_rms_norm_reference, x64, delta64, w64, (dh.double(), dy.double()))):
        h, y = fn(a.transpose(0, 1), b.transpose(0, 1), c, 0.5)  # (2, 6, 40), non-unit strides on the leading dims
        torch.autograd.backward((h, y), tuple(t.transpose(0, 1) for t in upstream))
        outs.append((h.detach(), y.detach(), a.grad, b.grad, c.grad))
    ours, ref = outs
    assert ours[0].shape == ours[1].shape == (2, 6, 40)
    for name, out, expected in zip(ADD_NAMES, ours, ref, strict=True):
        assert _rel_err(out, expected) < REL_TOL[torch.float32], name


def test_add_needs_only_the_gradients_asked_for_and_empty_input():
    x, delta, w, dh, dy = _add_inputs((5, 12), torch.float32, torch.float32, seed=4)
    w.requires_grad_(False)
    delta.requires_grad_(False)
    h, y = add_rms_norm(x, delta, w)
    torch.autograd.backward((h, y), (dh, dy))
    assert w.grad is None and delta.grad is None and x.grad is not None
    x.grad = None
    add_rms_norm(x, delta, w)[1].backward(dy)  # h unused: its gradient is zero, x's is the norm's alone
    assert torch.equal(x.grad, _forward_backward(rms_norm, x, w, dy, 1e-5)[1])
    empty = torch.empty(0, 12, device=DEVICE, requires_grad=True)
    h, y = add_rms_norm(empty, torch.empty(0, 12, device=DEVICE), w)
    (h.sum() + y.sum()).backward()
    assert h.shape == y.shape == (0, 12) and empty.grad.shape == (0, 12)


@pytest.mark.parametrize(
    ("x", "delta", "w", "error", "message"),
    [
        (torch.randn(3, 4), torch.randn(3, 5), torch.randn(4), ValueError, r"delta must have x's shape \(3, 4\), got "
                                                                            r"\(3, 5\)"),
        (torch.randn(3, 4), torch.randn(4), torch.randn(4), ValueError, "delta must have x's shape"),  # no broadcast
        (torch.randn(3, 4), torch.randn(3, 4).half(), torch.randn(4), TypeError,
         "delta must have x's dtype torch.float32, got torch.float16"),
        (torch.randn(3, 4), [1.0], torch.randn(4), TypeError, "delta must be a torch.Tensor"),
        (torch.randn(3, 4), torch.randn(3, 4, device="meta"), torch.randn(4), ValueError, "one device"),
        (torch.randn(3, 4), torch.randn(3, 4), torch.randn(5), ValueError, r"weight \(d,\)"),
        (torch.randn(3, 4).double(), torch.randn(3, 4).double(), torch.randn(4), TypeError, "x must have a dtype"),
    ],
)
def test_add_rejects_bad_inputs(x, delta, w, error, message):
    with pytest.raises(error, match=message):
        add_rms_norm(x, delta, w)


@pytest.mark.gpu
@pytest.mark.gpu_exclusive
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_add_leaderboard_shape_bf16_on_gpu(w_dtype):
    shape = (32768, 4096)
    x, delta, w, dh, dy, ours = _check_add(shape, torch.bfloat16, w_dtype, seed=5)
    # On the GPU, bf16 rounds to nearest in the kernel as in PyTorch's add: bit for bit the unfused sequence.
    unfused = _add_forward_backward(_unfused, x, delta, w, dh, dy)
    for name, got, want in zip(ADD_NAMES, ours, unfused, strict=True):
        assert torch.isfinite(got).all(), name
        assert torch.equal(got, want), name
    eager = _add_forward_backward(add_rms_norm_reference, x, delta, w, dh, dy)
    x64, delta64, w64 = (t.detach().double().requires_grad_() for t in (x, delta, w))
    exact = _add_forward_backward(add_rms_norm_reference, x64, delta64, w64, dh.double(), dy.double())
    for name, got, same, expected in zip(ADD_NAMES, ours, eager, exact, strict=True):
        # Never less accurate than PyTorch running the model's add and norm in bf16.
        assert _rel_err(got, expected) <= 1.01 * _rel_err(same, expected) + FP32_ORDER_SLACK, name


# Launches other than the defaults (the GPU sweep's candidates, tools/glue_sweep.py): several rows per block with a
# ragged last block (23 rows), a pipelined loop, and rows spread over the interpreter's 3 programs unevenly.
LAUNCHES = [Launch(block_rows=4, num_warps=4, programs_per_sm=1, stages=2),
            Launch(block_rows=2, num_warps=8, programs_per_sm=2, stages=3),
            Launch(block_rows=8, num_warps=4, programs_per_sm=4, stages=1)]


def _strided_rows(rows, d, dtype, seed):
    """(rows, d) with a unit column stride and rows d + 13 apart: a column slice, as the launchers accept it."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    wide = torch.randn(rows, d + 13, generator=gen, device=DEVICE) * 2 + 0.3
    return wide.to(dtype)[:, 5:5 + d]


@pytest.mark.parametrize("launch", LAUNCHES, ids=["4-rows-2-stages", "2-rows-3-stages", "8-rows-1-stage"])
@pytest.mark.parametrize(("dtype", "w_dtype"), [(torch.float32, torch.float32), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("add", [False, True], ids=["norm", "add"])
def test_launches_match_float64_reference(launch, dtype, w_dtype, add):
    rows, d = 23, 37
    x, dy = _strided_rows(rows, d, dtype, seed=6), _strided_rows(rows, d, dtype, seed=7)
    delta, dh = (_strided_rows(rows, d, dtype, seed=s) if add else None for s in (8, 9))
    w = (1 + 0.5 * torch.randn(d, generator=torch.Generator(device=DEVICE).manual_seed(10), device=DEVICE)).to(w_dtype)
    assert x.stride() == (d + 13, 1)
    y, rstd, h = rms_norm_forward(x, w, 1e-5, delta, launch=launch)
    dx, dw = rms_norm_backward(dy, x if h is None else h, w, rstd, dh, launch=launch)
    if add:
        assert torch.equal(h, x + delta)  # one fp32 add, one rounding, as PyTorch's
    hr = (x if h is None else h).double().requires_grad_()
    w64 = w.double().requires_grad_()
    y64 = rms_norm_reference(hr, w64)
    y64.backward(dy.double())
    dx64 = hr.grad if dh is None else hr.grad + dh.double()
    rstd64 = hr.detach().pow(2).mean(-1).add(1e-5).rsqrt()
    tol = REL_TOL[dtype]
    for name, got, want in (("y", y, y64), ("rstd", rstd, rstd64), ("dx", dx, dx64), ("dw", dw, w64.grad)):
        assert _rel_err(got, want) < max(tol, REL_TOL[got.dtype]), (name, _rel_err(got, want))
    assert y.dtype == dx.dtype == dtype and dw.dtype == w_dtype and rstd.dtype == torch.float32


@pytest.mark.parametrize("launch", LAUNCHES[:2], ids=["4-rows-2-stages", "2-rows-3-stages"])
def test_add_launch_is_the_unfused_launch_bit_for_bit(launch):
    # fp16: the interpreter rounds it to nearest as PyTorch does (see test_add_is_the_unfused_add_and_norm...).
    rows, d = 23, 37
    x, delta, dy, dh = (_strided_rows(rows, d, torch.float16, seed=s) for s in (11, 12, 13, 14))
    w = torch.rand(d, generator=torch.Generator(device=DEVICE).manual_seed(15), device=DEVICE) + 0.5
    y, rstd, h = rms_norm_forward(x, w, 1e-5, delta, launch=launch)
    y_unfused, rstd_unfused, _ = rms_norm_forward(x + delta, w, 1e-5, launch=launch)
    assert torch.equal(y, y_unfused) and torch.equal(rstd, rstd_unfused)
    dx, dw = rms_norm_backward(dy, h, w, rstd, dh, launch=launch)
    dx_norm, dw_unfused = rms_norm_backward(dy, h, w, rstd, launch=launch)
    assert torch.equal(dx, dx_norm + dh) and torch.equal(dw, dw_unfused)


def test_backward_rows_and_weight_grad_reduction():
    rows, d = 23, 37
    x, dy = _strided_rows(rows, d, torch.float32, seed=16), _strided_rows(rows, d, torch.float32, seed=17)
    w = torch.rand(d, device=DEVICE) + 0.5
    launch = LAUNCHES[0]
    _, rstd, _ = rms_norm_forward(x, w, 1e-5, launch=launch)
    dx, partial = rms_norm_backward_rows(dy, x, w, rstd, launch=launch)
    # one fp32 row per program, together the whole dw
    assert partial.shape == (num_programs(launch, rows, x.device), d) and partial.dtype == torch.float32
    xhat = x.double() * rstd.double()[:, None]
    assert _rel_err(partial.sum(0), (dy.double() * xhat).sum(0)) < REL_TOL[torch.float32]
    assert torch.equal(reduce_weight_grad(partial, torch.float32), rms_norm_backward(dy, x, w, rstd, launch=launch)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_weight_grad_reduction_of_many_partials(dtype):
    # 150 partial rows: two full blocks of 64 and a ragged one; 70 columns: two full blocks of 32 and a ragged one.
    gen = torch.Generator(device=DEVICE).manual_seed(18)
    partial = torch.randn(150, 70, generator=gen, device=DEVICE)
    dw = reduce_weight_grad(partial, dtype)
    assert dw.dtype == dtype and dw.shape == (70,)
    want = partial.double().sum(0)
    assert _rel_err(dw, want) < max(REL_TOL[torch.float32], REL_TOL[dtype])


@pytest.mark.parametrize(
    ("change", "message"),
    [({"block_rows": 3}, "block_rows must be a power of two, got 3"), ({"num_warps": 0}, "num_warps must be a power"),
     ({"num_warps": 64}, "num_warps must be at most 32, got 64"), ({"programs_per_sm": 0}, "programs_per_sm must be"),
     ({"stages": 0}, "stages must be positive, got 0")],
)
def test_launch_rejects_bad_settings(change, message):
    with pytest.raises(ValueError, match=message):
        Launch(**{"block_rows": 1, "num_warps": 8, "programs_per_sm": 2, "stages": 3, **change})


def test_default_launches():
    # Short rows batched to about 4096 (backward) or 8192 (forward) values per block, pipelining only where the
    # blocks ahead fit in shared memory.
    assert launch_settings(4096, backward=True) == Launch(1, 8, 2, 3)
    assert launch_settings(4096, backward=False) == Launch(2, 16, 1, 4)
    assert launch_settings(37, backward=False) == Launch(128, 16, 1, 4)
    assert launch_settings(16384, backward=False) == Launch(1, 32, 1, 1)
    assert launch_settings(5000, backward=True) == Launch(1, 16, 2, 3)
    assert launch_settings(65536, backward=True) == Launch(1, 32, 2, 1)
