"""FlashAttention-2's knobs (softmax scale, sliding window, softcap, logsumexp, causal aligned bottom-right) and packed
sequences (``flash_attention_varlen``) against a float64 materialised reference, forward and backward.

On CPU the Triton kernels run in the interpreter at small sizes in fp32 and fp16 (as ``test_flash_attention.py``);
the ``gpu`` tests repeat the checks at real sizes in bf16 by FlashAttention's rule (the kernel's error against an
fp32 reference within twice that of PyTorch's own bf16 attention), on every path ``auto`` may pick.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from attention_tolerances import LSE_TOL, REL_TOL
from cs336_kernels import attention_reference, attention_reference_varlen, flash_attention, flash_attention_varlen

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NEG_INF = float("-inf")


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DEVICE, dtype)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(got).all(), "non-finite values"
    floor = 0.1 * ref.numel() ** 0.5  # an exactly-zero reference (a row that sees no key) is not divided by
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(floor)).item()


def _grads(fn, inputs, do, dlse):
    """(out, lse, grads of the inputs) of ``fn(*inputs) -> (out, lse)`` under upstream gradients do and dlse (the
    logsumexp's only where it is finite: a row that sees no key has -inf and no gradient)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = fn(*leaves)
    loss = (out.double() * do.double()).sum() + (lse.masked_fill(lse == NEG_INF, 0).double() * dlse.double()).sum()
    return out.detach(), lse.detach(), torch.autograd.grad(loss, leaves)


def _check(got, ref, dtype):
    (o, lse, grads), (o_ref, lse_ref, grads_ref) = got, ref
    tol = REL_TOL[dtype]
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == lse_ref.shape
    assert _rel_err(o, o_ref) < tol
    seen = lse_ref > NEG_INF
    assert torch.equal(lse > NEG_INF, seen)
    if seen.any():
        assert (lse.double() - lse_ref)[seen].abs().max().item() < LSE_TOL[dtype]
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True):
        assert _rel_err(g, g_ref) < tol, f"{name}: {_rel_err(g, g_ref):.2e}"


def _dense(shape_q, shape_kv, dtype, seed, **knobs):
    q, k, v = (_randn(*s, dtype=dtype, seed=seed + i) for i, s in enumerate((shape_q, shape_kv, shape_kv)))
    do = _randn(*shape_q, dtype=dtype, seed=seed + 3)
    dlse = _randn(*shape_q[:-1], dtype=torch.float32, seed=seed + 4)
    causal = knobs.pop("causal", False)
    ours = _grads(lambda q, k, v: flash_attention(q, k, v, causal, return_lse=True, **knobs), (q, k, v), do, dlse)
    ref = _grads(lambda q, k, v: attention_reference(q, k, v, causal, **knobs), (t.double() for t in (q, k, v)),
                 do, dlse)
    return ours, ref


# (q shape, kv shape, knobs): windows smaller and larger than the sequence, on either side, with and without the
# causal mask; softcap and scale alone and with a window; Tq < Tk and Tq > Tk bottom-right (rows that see no key);
# grouped-query heads; 3-D inputs; lengths of 1 and not multiples of the 16-wide interpreter tiles.
CPU_CASES = [
    ((1, 2, 70, 16), (1, 2, 70, 16), {"causal": True, "window_size": (9, -1)}),
    ((1, 4, 53, 32), (1, 2, 53, 32), {"window_size": (20, 5)}),
    ((1, 2, 40, 16), (1, 2, 40, 16), {"window_size": (100, 100)}),
    ((1, 2, 33, 16), (1, 2, 33, 16), {"window_size": (-1, 3)}),
    ((1, 2, 45, 16), (1, 2, 45, 16), {"window_size": (0, 0)}),
    ((2, 37, 16), (2, 37, 16), {"causal": True, "softcap": 5.0}),
    ((1, 3, 30, 24), (1, 1, 41, 24), {"softmax_scale": 0.77}),
    ((1, 2, 50, 16), (1, 2, 50, 16), {"causal": True, "window_size": (12, -1), "softcap": 2.0,
                                      "softmax_scale": 0.4}),
    ((1, 2, 19, 16), (1, 2, 61, 16), {"causal": True}),
    ((1, 2, 61, 16), (1, 2, 19, 16), {"causal": True}),
    ((1, 2, 61, 16), (1, 2, 19, 16), {"window_size": (3, 2)}),
    ((1, 1, 1, 16), (1, 1, 1, 16), {"causal": True, "window_size": (0, 0)}),
]


@pytest.mark.parametrize(("shape_q", "shape_kv", "knobs"), CPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_knobs_match_reference(shape_q, shape_kv, knobs, dtype):
    ours, ref = _dense(shape_q, shape_kv, dtype, seed=shape_q[-2], **knobs)
    _check(ours, ref, dtype)


def test_window_and_causal_flags_agree():
    # causal is window_size (left, 0); a window wider than the sequence is no window.
    q, k, v = (_randn(1, 2, 40, 16, dtype=torch.float32, seed=i) for i in range(3))
    torch.testing.assert_close(flash_attention(q, k, v, True, window_size=(7, -1)),
                               flash_attention(q, k, v, window_size=(7, 0)), rtol=0, atol=0)
    torch.testing.assert_close(flash_attention(q, k, v, window_size=(64, 64)), flash_attention(q, k, v),
                               rtol=1e-6, atol=1e-6)
    sdpa = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(flash_attention(q, k, v, softmax_scale=0.3), sdpa, rtol=1e-5, atol=1e-5)


def _packed(lengths_q, lengths_k, heads, heads_kv, head_dim, dtype, seed):
    cu_q, cu_k = (F.pad(torch.tensor(n, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0)).to(DEVICE)
                  for n in (lengths_q, lengths_k))
    q = _randn(sum(lengths_q), heads, head_dim, dtype=dtype, seed=seed)
    k, v = (_randn(sum(lengths_k), heads_kv, head_dim, dtype=dtype, seed=seed + i) for i in (1, 2))
    do = _randn(*q.shape, dtype=dtype, seed=seed + 3)
    dlse = _randn(heads, sum(lengths_q), dtype=torch.float32, seed=seed + 4)
    return q, k, v, do, dlse, cu_q, cu_k


def _varlen(q, k, v, do, dlse, cu_q, cu_k, lengths_q, lengths_k, **knobs):
    causal = knobs.pop("causal", False)
    ours = _grads(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                         causal=causal, return_lse=True, **knobs), (q, k, v), do, dlse)
    ref = _grads(lambda q, k, v: attention_reference_varlen(q, k, v, cu_q, cu_k, causal, **knobs),
                 (t.double() for t in (q, k, v)), do, dlse)
    return ours, ref


# Document lengths: 1, empty documents (queries and keys both, or keys only), lengths not a multiple of the tile, a
# long one beside short ones; queries and keys of different lengths per document (bottom-right causal).
VARLEN_CASES = [
    ([17, 1, 0, 40, 5], [17, 1, 0, 40, 5], {"causal": True}),
    ([33, 2, 20], [33, 2, 20], {"window_size": (6, 3)}),
    ([9, 30, 3], [20, 30, 0], {"causal": True}),
    ([25, 11], [25, 11], {"causal": True, "window_size": (4, -1), "softcap": 3.0, "softmax_scale": 0.5}),
    ([1, 47], [1, 47], {}),
]


@pytest.mark.parametrize(("lengths_q", "lengths_k", "knobs"), VARLEN_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_matches_reference(lengths_q, lengths_k, knobs, dtype):
    inputs = _packed(lengths_q, lengths_k, 4, 2, 16, dtype, seed=len(lengths_q))
    ours, ref = _varlen(*inputs, lengths_q, lengths_k, **knobs)
    _check(ours, ref, dtype)


def test_varlen_equals_each_document_alone():
    # Packed results are the dense kernel's on each document by itself, bit for bit (same tiles, same order).
    lengths = [21, 1, 40, 7]
    q, k, v, *_, cu, _ = _packed(lengths, lengths, 4, 2, 16, torch.float32, seed=3)
    out = flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, window_size=(11, -1))
    bounds = cu.tolist()
    for b in range(len(lengths)):
        doc = (t[bounds[b]:bounds[b + 1]].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        alone = flash_attention(*doc, True, window_size=(11, -1))[0].transpose(0, 1)
        torch.testing.assert_close(out[bounds[b]:bounds[b + 1]], alone, rtol=0, atol=0)


def test_varlen_gradients_are_bitwise_reproducible():
    lengths = [30, 13, 1]
    q, k, v, do, dlse, cu, _ = _packed(lengths, lengths, 4, 1, 16, torch.float32, seed=5)
    fn = functools.partial(flash_attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=30,
                           max_seqlen_k=30, causal=True, return_lse=True, deterministic=True)
    runs = [_grads(fn, (q, k, v), do, dlse) for _ in range(2)]
    for a, b in zip((runs[0][0], *runs[0][2]), (runs[1][0], *runs[1][2]), strict=True):
        assert torch.equal(a, b)


def _cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda q, k, v: flash_attention(q, k, v, window_size=(3,)), TypeError, "window_size must be a pair"),
    (lambda q, k, v: flash_attention(q, k, v, window_size=(2.0, 1)), TypeError, "window_size must be a pair"),
    (lambda q, k, v: flash_attention(q, k, v, window_size=(-2, 1)), ValueError, "window_size sides"),
    (lambda q, k, v: flash_attention(q, k, v, softcap=-1.0), ValueError, "softcap must be"),
    (lambda q, k, v: flash_attention(q, k, v, softmax_scale=0.0), ValueError, "softmax_scale must be"),
    (lambda q, k, v: flash_attention(q, k, v, softmax_scale=float("nan")), ValueError, "softmax_scale must be"),
    (lambda q, k, v: flash_attention(q, k, v, window_size=(2, 2), backward="pytorch"), ValueError,
     "backward='pytorch' runs plain"),
    (lambda q, k, v: flash_attention_varlen(q[0], k[0], v[0], _cu(0, 10), _cu(0, 10), 10, 10, causal=1), TypeError,
     "causal must be a bool"),
    (lambda q, k, v: flash_attention_varlen(q, k, v, _cu(0, 10), _cu(0, 10), 10, 10), ValueError,
     r"\(total_tokens, heads, d\)"),
    (lambda q, k, v: flash_attention_varlen(q[0], k[0], v[0], _cu(0, 10, dtype=torch.int64), _cu(0, 10), 10, 10),
     ValueError, "cu_seqlens_q must be a 1-D int32"),
    (lambda q, k, v: flash_attention_varlen(q[0], k[0], v[0], _cu(0, 5, 10), _cu(0, 10), 10, 10), ValueError,
     "the same length"),
    (lambda q, k, v: flash_attention_varlen(q[0], k[0], v[0], _cu(0, 10), _cu(0, 10), -1, 10), ValueError,
     "max_seqlen_q must be an int >= 0"),
    (lambda q, k, v: flash_attention_varlen(q[0], k[0], v[0], _cu(0, 10), [0, 10], 10, 10), TypeError,
     "cu_seqlens_k must be a torch.Tensor"),
    (lambda q, k, v: flash_attention_varlen(q[0], k[0], v[0], _cu(0, 10), _cu(0, 10), 10, 10, backward="pytorch"),
     ValueError, "dense batches only"),
    (lambda q, k, v: flash_attention_varlen(q[0], k[0], v[0], _cu(0, 10), _cu(0, 10), 10, 10, backward="gluon"),
     ValueError, "need CUDA tensors on an sm_90 GPU"),
])
def test_bad_knobs_and_packed_inputs_raise(call, error, match):
    q, k, v = (_randn(1, 10, 2, 16, dtype=torch.float32, seed=i) for i in range(3))
    with pytest.raises(error, match=match):
        call(q, k, v)


# ------------------------------------------------------------------------------------------------ GPU


def _fa_rule(ours, ref64, ref_low):
    """FlashAttention's test rule: each output's error against the fp32/64 reference within twice (plus a small
    absolute slack) that of PyTorch's own attention in the low precision."""
    (o, lse, grads), (o_ref, lse_ref, grads_ref), (o_low, _, grads_low) = ours, ref64, ref_low
    seen = lse_ref > NEG_INF
    assert torch.equal(lse > NEG_INF, seen)
    assert (lse.double() - lse_ref.double())[seen].abs().max().item() < LSE_TOL[torch.bfloat16]
    for name, got, want, low in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref), (o_low, *grads_low),
                                    strict=True):
        err = (got.double() - want.double()).abs().max().item()
        err_low = (low.double() - want.double()).abs().max().item()
        assert err <= 2 * err_low + 1e-4, f"{name}: {err:.3e} against PyTorch's bf16 {err_low:.3e}"


# Both kernels on the GPU: "auto" (the Gluon ones on an H100/H200 where they run, else Triton) and Triton.
GPU_PATHS = {"auto": {}, "triton": {"forward": "triton", "backward": "triton"}}


def _gpu_cases(knobs: dict[str, dict], head_dims: list[int]) -> list:
    """Every (head_dim, knobs, path). Each knob setting compiles and autotunes kernels of its own, so the quick GPU
    run takes each one once per path, at that path's head dims in turn ("auto" at 64 and 128 only: at 96 and 256 the
    Gluon kernels are the named ones of test_gluon_attention.py); the rest are slow."""
    cases = []
    for head_dim in head_dims:
        for i, (name, knob) in enumerate(knobs.items()):
            for path, kwargs in GPU_PATHS.items():
                dims = [d for d in head_dims if path == "triton" or d in (64, 128)]
                quick = head_dim == dims[(i + (path == "auto")) % len(dims)]
                cases.append(pytest.param(head_dim, knob, kwargs, id=f"{head_dim}-{name}-{path}",
                                          marks=() if quick else pytest.mark.slow))
    return cases


GPU_KNOBS = {
    "sliding-causal": {"causal": True, "window_size": (255, -1)},
    "window": {"window_size": (100, 37)},
    "softcap-scale": {"causal": True, "softcap": 30.0, "softmax_scale": 0.09},
    "bottom-right": {"causal": True, "tq": 700},
}


@pytest.mark.gpu
@pytest.mark.parametrize(("head_dim", "knobs", "path"), _gpu_cases(GPU_KNOBS, [64, 128, 96]))
def test_gpu_knobs_bf16(knobs, head_dim, path):
    knobs = dict(knobs)
    shape_q, shape_kv = (2, 8, knobs.pop("tq", 1000), head_dim), (2, 2, 1000, head_dim)
    q, k, v = (_randn(*s, dtype=torch.bfloat16, seed=i) for i, s in enumerate((shape_q, shape_kv, shape_kv)))
    do, dlse = _randn(*shape_q, dtype=torch.bfloat16, seed=3), _randn(*shape_q[:-1], dtype=torch.float32, seed=4)
    causal = knobs.pop("causal", False)
    ours = _grads(lambda q, k, v: flash_attention(q, k, v, causal, return_lse=True, **knobs, **path), (q, k, v), do,
                  dlse)
    ref = _grads(lambda q, k, v: attention_reference(q, k, v, causal, **knobs), (t.float() for t in (q, k, v)),
                 do, dlse)
    low = _grads(lambda q, k, v: attention_reference(q, k, v, causal, **knobs), (q, k, v), do, dlse)
    _fa_rule(ours, ref, low)


GPU_VARLEN_KNOBS = {"causal": {"causal": True}, "sliding": {"causal": True, "window_size": (200, -1)}, "full": {},
                    "softcap": {"causal": True, "softcap": 20.0}}


@pytest.mark.gpu
@pytest.mark.parametrize(("head_dim", "knobs", "path"), _gpu_cases(GPU_VARLEN_KNOBS, [64, 128]))
def test_gpu_varlen_bf16(head_dim, knobs, path):
    knobs = dict(knobs) | path
    gen = torch.Generator().manual_seed(head_dim)
    lengths = [int(n) for n in torch.randint(1, 700, (9,), generator=gen)] + [0, 1, 1024]
    q, k, v, do, dlse, cu_q, cu_k = _packed(lengths, lengths, 8, 2, head_dim, torch.bfloat16, seed=head_dim)
    causal = knobs.pop("causal", False)
    ours = _grads(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths), max(lengths),
                                                         causal=causal, return_lse=True, **knobs), (q, k, v), do, dlse)
    ref_knobs = {name: value for name, value in knobs.items() if name not in path}
    ref = _grads(lambda q, k, v: attention_reference_varlen(q, k, v, cu_q, cu_k, causal, **ref_knobs),
                 (t.float() for t in (q, k, v)), do, dlse)
    low = _grads(lambda q, k, v: attention_reference_varlen(q, k, v, cu_q, cu_k, causal, **ref_knobs), (q, k, v),
                 do, dlse)
    _fa_rule(ours, ref, low)
    again = _grads(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths), max(lengths),
                                                          causal=causal, return_lse=True, deterministic=True,
                                                          **knobs), (q, k, v), do, dlse)
    twice = _grads(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths), max(lengths),
                                                          causal=causal, return_lse=True, deterministic=True,
                                                          **knobs), (q, k, v), do, dlse)
    for a, b in zip((again[0], *again[2]), (twice[0], *twice[2]), strict=True):
        assert torch.equal(a, b)
