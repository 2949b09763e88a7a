"""Gluon FlashAttention (sm_90) against the float64 materialised-attention reference: O, L, dQ, dK, dV.

Gluon kernels do not run in the Triton interpreter, so every test here is a ``gpu`` test for an H100/H200 (skipped
on other GPUs): ``pytest -m gpu packages/kernels/tests/test_gluon_attention.py``.
"""

from __future__ import annotations

import pytest
import torch
from attention_tolerances import LSE_TOL, REL_TOL
from cs336_kernels.ops.flash_attention import (
    attention_reference,
    attention_reference_varlen,
    backward_impl,
    flash_attention,
    flash_attention_varlen,
    forward_impl,
)
from cs336_kernels.ops.flash_attention.gluon_backward import gluon_attention_backward as _backward
from cs336_kernels.ops.flash_attention.gluon_common import HEAD_DIMS, gluon_applies
from cs336_kernels.ops.flash_attention.gluon_forward import gluon_attention_forward as _forward
from cs336_kernels.ops.flash_attention.params import make_params

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                       reason="the Gluon kernels need an sm_90 GPU (H100/H200)"),
]


def _params(q, is_causal):
    # The course's alignment (top-left), which these kernels run at any lengths.
    return make_params(q.shape[-1], is_causal, None, (-1, -1), 0.0, bottom_right=False)


def gluon_attention_forward(q, k, v, is_causal):
    return _forward(q, k, v, _params(q, is_causal))


def gluon_attention_backward(q, k, v, o, do, lse, is_causal):
    return _backward(q, k, v, o, do, lse, None, _params(q, is_causal))


def _inputs(shape_q, shape_kv, dtype, seed):
    """q, k, v and an output gradient dO shaped like q."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    shapes = (shape_q, shape_kv, shape_kv, shape_q)
    return tuple(torch.randn(s, generator=g).to(device="cuda", dtype=dtype) for s in shapes)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    # The floor (entries of 0.1 on average) keeps an exactly-zero reference, such as dQ with one key, from
    # turning rounding noise into an infinite relative error.
    assert torch.isfinite(got).all(), "non-finite values"
    floor = 0.1 * ref.numel() ** 0.5
    return ((got.double() - ref).norm() / ref.norm().clamp_min(floor)).item()


def _check(q, k, v, is_causal):
    o, lse = gluon_attention_forward(q, k, v, is_causal)
    o_ref, lse_ref = attention_reference(q.double(), k.double(), v.double(), is_causal, bottom_right=False)
    assert o.shape == q.shape and o.dtype == q.dtype and o.stride() == q.stride()
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert torch.isfinite(lse).all()
    rel = _rel_err(o, o_ref)
    assert rel < REL_TOL[q.dtype], f"O: relative error {rel:.2e}"
    lse_err = (lse.double() - lse_ref).abs().max().item()
    assert lse_err < LSE_TOL[q.dtype], f"L: max error {lse_err:.2e}"


def _check_backward(q, k, v, do, is_causal):
    o, lse = gluon_attention_forward(q, k, v, is_causal)
    grads = gluon_attention_backward(q, k, v, o, do, lse, is_causal)
    assert [g.stride() for g in grads] == [t.stride() for t in (q, k, v)]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    attention_reference(q64, k64, v64, is_causal, bottom_right=False)[0].backward(do.double())
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (q64.grad, k64.grad, v64.grad), strict=True):
        assert got.shape == ref.shape and got.dtype == q.dtype, name
        rel = _rel_err(got, ref)
        assert rel < REL_TOL[q.dtype], f"{name}: relative error {rel:.2e}"


# (shape of q, shape of k and v): one query and one key; lengths that are not multiples of the query tiles (64
# or 128 rows) or the 128-key tiles (127, 1000, 4097); Tq < Tk and Tq > Tk; grouped-query heads (2:1, 4:1, 2:1).
SHAPES = [
    ((1, 2, 1, 64), (1, 2, 1, 64)),
    ((2, 4, 127, 128), (2, 2, 127, 128)),
    ((1, 4, 1000, 64), (1, 1, 1000, 64)),
    ((1, 2, 4097, 128), (1, 2, 4097, 128)),
    ((2, 3, 300, 64), (2, 3, 777, 64)),
    ((1, 2, 777, 128), (1, 1, 300, 128)),
]
CASES = [(sq, skv, torch.bfloat16) for sq, skv in SHAPES] + [(sq, skv, torch.float16) for sq, skv in SHAPES[2::3]]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("shape_q", "shape_kv", "dtype"), CASES)
def test_gpu_forward_matches_reference(shape_q, shape_kv, dtype, is_causal):
    q, k, v, _ = _inputs(shape_q, shape_kv, dtype, seed=shape_q[-2])
    _check(q, k, v, is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("shape_q", "shape_kv", "dtype"), CASES)
def test_gpu_backward_matches_reference(shape_q, shape_kv, dtype, is_causal):
    _check_backward(*_inputs(shape_q, shape_kv, dtype, seed=shape_q[-2]), is_causal)


# Head dims 96 (in 128-column tiles whose columns past 96 read as zeros) and 256 (the forward only: 64-key tiles, O
# stored from registers), as (batch, heads_q, seq_q), (batch, heads_kv, seq_k): one query and one key; an odd length
# with 2:1 grouped-query heads; Tq < Tk and Tq > Tk.
WIDE_ROWS = [((1, 2, 1), (1, 2, 1)), ((2, 4, 333), (2, 2, 333)), ((1, 2, 300), (1, 1, 777)),
             ((1, 4, 1000), (1, 2, 517))]
# fp16 at these dims repeats the bf16 cases' kernels in the other 16-bit type (d = 64 and 128 test both in the quick
# GPU run): slow, so that the quick run takes each path once.
WIDE_DTYPES = [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", WIDE_DTYPES)
@pytest.mark.parametrize(("rows_q", "rows_kv"), WIDE_ROWS)
@pytest.mark.parametrize("head_dim", [96, 256])
def test_gpu_forward_at_head_dims_96_and_256_matches_reference(head_dim, rows_q, rows_kv, dtype, is_causal):
    q, k, v, _ = _inputs((*rows_q, head_dim), (*rows_kv, head_dim), dtype, seed=rows_q[-1])
    _check(q, k, v, is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", WIDE_DTYPES)
@pytest.mark.parametrize(("rows_q", "rows_kv"), WIDE_ROWS)
def test_gpu_backward_at_head_dim_96_matches_reference(rows_q, rows_kv, dtype, is_causal):
    # dQ's accumulator is 96 columns wide: the reduce-adds of its 128-column tiles drop the columns past 96.
    _check_backward(*_inputs((*rows_q, 96), (*rows_kv, 96), dtype, seed=rows_q[-1]), is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
def test_gpu_head_dim_256_takes_the_gluon_forward_and_the_triton_backward(is_causal):
    # The Gluon backward has no d = 256; a named Gluon forward pairs with "auto"'s Triton backward through the
    # public function, and a named Gluon backward says why it cannot run.
    q, k, v, do = _inputs((2, 4, 333, 256), (2, 2, 333, 256), torch.bfloat16, seed=13)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert backward_impl(q, "auto") == "triton"
    out = flash_attention(q, k, v, is_causal=is_causal, forward="gluon")
    out.backward(do)
    o_ref, _ = attention_reference(q.double(), k.double(), v.double(), is_causal)
    ref_grads = torch.autograd.grad(o_ref, (q, k, v), do.double())
    assert _rel_err(out, o_ref) < REL_TOL[torch.bfloat16]
    for name, got, ref in zip(("dQ", "dK", "dV"), (q.grad, k.grad, v.grad), ref_grads, strict=True):
        assert _rel_err(got, ref) < REL_TOL[torch.bfloat16], name
    with pytest.raises(ValueError, match=r"Gluon backward takes head dims \(64, 96, 128\); got 256"):
        flash_attention(q, k, v, is_causal=is_causal, backward="gluon")


@pytest.mark.parametrize("head_dim", [96, 256])
def test_gpu_auto_runs_gluon_at_head_dims_96_and_256(head_dim):
    # Timed the faster at (1, 32, 16384, 96) and (1, 16, 16384, 256) in bf16 (attention_notes.md, session 31); the
    # Gluon backward has no 256, which the Triton backward takes.
    q = _inputs((1, 2, 64, head_dim), (1, 2, 64, head_dim), torch.bfloat16, seed=0)[0]
    assert forward_impl(q, "auto") == "gluon"
    assert backward_impl(q, "auto") == ("gluon" if head_dim == 96 else "triton")


@pytest.mark.parametrize("head_dim", [96, 256])
def test_gpu_packed_forward_at_head_dims_96_and_256_matches_reference(head_dim):
    # A packed batch's O leaves from registers, masked to its sequence's rows and (d = 96) the head dim's columns.
    lengths = [300, 1, 0, 700, 129]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v, _ = _inputs((sum(lengths), 4, head_dim), (sum(lengths), 2, head_dim), torch.bfloat16, seed=head_dim)
    for causal in (False, True):
        o, lse = flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal, return_lse=True,
                                        forward="gluon")
        o_ref, lse_ref = attention_reference_varlen(q.double(), k.double(), v.double(), cu, cu, causal)
        assert _rel_err(o, o_ref) < REL_TOL[torch.bfloat16], f"causal={causal}"
        assert (lse.double() - lse_ref).abs().max().item() < LSE_TOL[torch.bfloat16], f"causal={causal}"


@pytest.mark.gpu_exclusive  # the float64 reference materialises 3 x 8 x 4097^2 scores: about 9 GiB at its peak
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_gpu_forward_takes_many_tiles_from_its_queue(head_dim, is_causal):
    # 3 x 8 heads x 33 query tiles: several times more tiles than the persistent kernel has programs, so each program
    # hands its Q and O buffers from tile to tile, and a length past the last full tile. Each tile has one owner:
    # two runs agree bit for bit.
    q, k, v, _ = _inputs((3, 8, 4097, head_dim), (3, 2, 4097, head_dim), torch.bfloat16, seed=6)
    _check(q, k, v, is_causal)
    first, second = (gluon_attention_forward(q, k, v, is_causal) for _ in range(2))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_gpu_backward_dk_dv_are_deterministic(head_dim):
    # dK and dV have one owner per key tile and a fixed order over the query heads; dQ is summed by reduce-adds.
    q, k, v, do = _inputs((2, 8, 1500, head_dim), (2, 2, 1500, head_dim), torch.bfloat16, seed=3)
    o, lse = gluon_attention_forward(q, k, v, True)
    first, second = (gluon_attention_backward(q, k, v, o, do, lse, True) for _ in range(2))
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("shape_q", "shape_kv", "dtype"), CASES)
def test_gpu_deterministic_backward_matches_reference_and_repeats_bit_for_bit(shape_q, shape_kv, dtype, is_causal):
    # Under deterministic algorithms every dQ tile takes its key blocks' reduce-adds in one order: two runs agree
    # bit for bit in dQ too, and each is as accurate as the default mode.
    q, k, v, do = _inputs(shape_q, shape_kv, dtype, seed=shape_q[-2])
    o, lse = gluon_attention_forward(q, k, v, is_causal)
    torch.use_deterministic_algorithms(True)
    try:
        _check_backward(q, k, v, do, is_causal)
        first, second = (gluon_attention_backward(q, k, v, o, do, lse, is_causal) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    default = gluon_attention_backward(q, k, v, o, do, lse, is_causal)
    assert torch.equal(first[1], default[1]) and torch.equal(first[2], default[2])


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_gpu_deterministic_backward_repeats_bit_for_bit_at_scale(head_dim):
    # Many key blocks per head and more programs than SMs, so that the locks are waited on across waves.
    q, k, v, do = _inputs((2, 8, 8192, head_dim), (2, 2, 8192, head_dim), torch.bfloat16, seed=4)
    o, lse = gluon_attention_forward(q, k, v, True)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [gluon_attention_backward(q, k, v, o, do, lse, True) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run, strict=True))
    default = gluon_attention_backward(q, k, v, o, do, lse, True)
    # The same sums in another order: equal to fp32 rounding.
    torch.testing.assert_close(runs[0][0], default[0], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_gpu_takes_strided_heads(head_dim):
    # (batch, seq, heads, d) memory seen as (batch, heads, seq, d), as a model's projections produce it: the
    # TMA descriptors (and at d = 256 the forward's stores from registers) take the strides as they are, and O,
    # dQ, dK, dV come back in that layout.
    shapes = ((2, 515, 4, head_dim), (2, 515, 2, head_dim))
    q, k, v, do = (t.transpose(1, 2) for t in _inputs(*shapes, torch.bfloat16, seed=5))
    assert not q.is_contiguous()
    _check(q, k, v, True)
    if head_dim in HEAD_DIMS["backward"]:
        _check_backward(q, k, v, do, True)


def test_gpu_input_checks():
    q, k, v, _ = _inputs((1, 2, 64, 64), (1, 2, 64, 64), torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="batch, heads, seq, d"):
        gluon_attention_forward(q[0], k[0], v[0], True)
    with pytest.raises(ValueError, match="got torch.float32"):
        gluon_attention_forward(q.float(), k.float(), v.float(), True)
    with pytest.raises(ValueError, match="head dim"):
        gluon_attention_forward(q[..., :32], k[..., :32], v[..., :32], True)
    with pytest.raises(ValueError, match="multiple"):
        gluon_attention_forward(q, *_inputs((1, 3, 64, 64), (1, 3, 64, 64), torch.bfloat16, seed=1)[1:3], True)
    with pytest.raises(ValueError, match="CUDA"):
        gluon_attention_forward(q.cpu(), k.cpu(), v.cpu(), True)


@pytest.mark.parametrize(("forward", "backward"),
                         [("auto", "auto"), ("auto", "triton"), ("gluon", "gluon"), ("triton", "gluon")])
def test_gpu_flash_attention_runs_each_path(forward, backward):
    # Through the public function: the operators' dispatch, their autograd formula and the backward choice.
    q, k, v, do = _inputs((2, 4, 777, 128), (2, 2, 777, 128), torch.bfloat16, seed=11)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert gluon_applies(q, "forward") and gluon_applies(q, "backward")
    out = flash_attention(q, k, v, is_causal=True, forward=forward, backward=backward)
    out.backward(do)
    grads = [t.grad for t in (q, k, v)]
    o_ref, _ = attention_reference(q.double(), k.double(), v.double(), True)
    ref_grads = torch.autograd.grad(o_ref, (q, k, v), do.double())
    assert _rel_err(out, o_ref) < REL_TOL[torch.bfloat16]
    for name, got, ref in zip(("dQ", "dK", "dV"), grads, ref_grads, strict=True):
        assert _rel_err(got, ref.double()) < REL_TOL[torch.bfloat16], name
    assert not gluon_applies(q.float(), "forward") and not gluon_applies(q[..., :32], "forward")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_auto_backward_is_gluon_deterministic_or_not(head_dim):
    # On sm_90 "auto" runs the Gluon backward: its dK and dV equal the forced Gluon path's bit for bit (dQ's
    # reduce-adds land in a varying order). Under deterministic algorithms it runs the Gluon one in its
    # deterministic mode, bit for bit.
    q, k, v, do = _inputs((1, 4, 300, head_dim), (1, 2, 300, head_dim), torch.bfloat16, seed=12)

    def grads(**backward):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        flash_attention(*leaves, is_causal=True, **backward).backward(do)
        return [t.grad for t in leaves]

    assert backward_impl(q, "auto") == "gluon"
    auto, gluon = grads(), grads(backward="gluon")
    assert torch.equal(auto[1], gluon[1]) and torch.equal(auto[2], gluon[2])
    assert _rel_err(auto[0], gluon[0]) < REL_TOL[torch.bfloat16]
    torch.use_deterministic_algorithms(True)
    try:
        assert backward_impl(q, "auto") == "gluon"
        deterministic, again = grads(), grads(backward="gluon")
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(deterministic, again, strict=True))


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("lengths", [[300, 1, 0, 700, 129], [1, 300], [300, 65, 212], [128, 128, 128]],
                         ids=["mixed", "one-then-long", "unaligned-middle", "aligned"])
def test_gpu_packed_backward_takes_sequences_that_start_at_any_token(lengths, head_dim):
    # The Gluon backward of a packed batch, through the kernels' own calls.
    # Its TMA reads L and D along their rows, where a box must start 16-byte aligned: with a sequence starting at
    # a token that is not a multiple of four it stopped on an illegal instruction; it now reads them laid out as
    # the dQ accumulator is, each sequence from a whole tile.
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lengths)
    q, k, v, do = _inputs((total, 4, head_dim), (total, 2, head_dim), torch.bfloat16, seed=head_dim)
    params = make_params(head_dim, True, None, (-1, -1), 0.0, True, cu, cu, max(lengths), max(lengths))
    dense = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, do)]  # the kernels' (1, heads, total, d) views
    o, lse = _forward(*dense[:3], params)
    grads = _backward(*dense[:3], o, dense[3], lse, None, params)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o_ref, _ = attention_reference_varlen(q64, k64, v64, cu, cu, True)
    ref_grads = torch.autograd.grad(o_ref, (q64, k64, v64), do.double())
    assert _rel_err(o[0].transpose(0, 1), o_ref) < REL_TOL[torch.bfloat16]
    for name, got, ref in zip(("dQ", "dK", "dV"), grads, ref_grads, strict=True):
        assert _rel_err(got[0].transpose(0, 1), ref) < REL_TOL[torch.bfloat16], name
