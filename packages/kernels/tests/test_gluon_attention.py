"""Gluon FlashAttention (sm_90) against the float64 materialised-attention reference.

Gluon kernels do not run in the Triton interpreter, so every test here is a ``gpu`` test for an H100/H200:
``pytest -m gpu packages/kernels/tests/test_gluon_attention.py``.
"""

from __future__ import annotations

import pytest
import torch
from cs336_kernels.flash_attention import attention_reference
from cs336_kernels.gluon_attention import gluon_attention_forward

pytestmark = pytest.mark.gpu

# The tolerances of the Triton kernels' GPU tests (test_flash_attention.py): relative Frobenius error of O
# against float64 on the same rounded inputs (P is rounded to the input dtype before P V), absolute error of L.
REL_TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
LSE_TOL = 2e-4


def _inputs(shape_q, shape_kv, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(torch.randn(s, generator=g).to(device="cuda", dtype=dtype) for s in (shape_q, shape_kv, shape_kv))


def _check(q, k, v, is_causal):
    o, lse = gluon_attention_forward(q, k, v, is_causal)
    o_ref, lse_ref = attention_reference(q.double(), k.double(), v.double(), is_causal)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    rel = ((o.double() - o_ref).norm() / o_ref.norm()).item()
    assert rel < REL_TOL[q.dtype], f"O: relative error {rel:.2e}"
    lse_err = (lse.double() - lse_ref).abs().max().item()
    assert lse_err < LSE_TOL, f"L: max error {lse_err:.2e}"


# (shape of q, shape of k and v): one query and one key; lengths that are not multiples of the 64-row query
# tiles or the 128-key tiles (127, 1000, 4097); Tq < Tk and Tq > Tk; grouped-query heads (2:1, 4:1, 2:1).
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
    q, k, v = _inputs(shape_q, shape_kv, dtype, seed=shape_q[-2])
    _check(q, k, v, is_causal)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_forward_takes_strided_heads(head_dim):
    # (batch, seq, heads, d) memory seen as (batch, heads, seq, d), as a model's projections produce it: the
    # TMA descriptors take the strides as they are.
    q, k, v = (t.transpose(1, 2) for t in _inputs((2, 515, 4, head_dim), (2, 515, 2, head_dim), torch.bfloat16, 5))
    assert not q.is_contiguous()
    _check(q, k, v, True)


def test_gpu_input_checks():
    q, k, v = _inputs((1, 2, 64, 64), (1, 2, 64, 64), torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="batch, heads, seq, d"):
        gluon_attention_forward(q[0], k[0], v[0], True)
    with pytest.raises(TypeError, match="dtype"):
        gluon_attention_forward(q.float(), k.float(), v.float(), True)
    with pytest.raises(ValueError, match="head dim"):
        gluon_attention_forward(q[..., :32], k[..., :32], v[..., :32], True)
    with pytest.raises(ValueError, match="multiple"):
        gluon_attention_forward(q, *_inputs((1, 3, 64, 64), (1, 3, 64, 64), torch.bfloat16, seed=1)[1:], True)
    with pytest.raises(ValueError, match="CUDA"):
        gluon_attention_forward(q.cpu(), k.cpu(), v.cpu(), True)
    with pytest.raises(TypeError, match="is_causal"):
        gluon_attention_forward(q, k, v, 1)
