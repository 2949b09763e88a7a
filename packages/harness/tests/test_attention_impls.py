"""Attention implementations agree with a float64 reference, forward and backward, and plug into the model."""

from __future__ import annotations

import math

import pytest
import torch
from cs336_basics.model import BasicsTransformerLM
from cs336_harness.studies.attention_impls import ATTENTION_IMPLS, get_attention

RTOL, ATOL = 1e-5, 1e-5  # fp32 against a float64 reference


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v.double()


# "compiled" spends most of a minute in the CPU inductor compiler; it is the same math as "eager".
@pytest.mark.parametrize("name", ["eager", "annotated", "sdpa", pytest.param("compiled", marks=pytest.mark.slow)])
def test_impl_matches_reference(name: str) -> None:
    gen = torch.Generator().manual_seed(3)
    b, h, t, d = 2, 3, 13, 8
    q, k, v = (torch.randn(b, h, t, d, generator=gen, requires_grad=True) for _ in range(3))
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    out = get_attention(name)(q, k, v, True)
    ref = _reference(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    grad_out = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out.double())
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.double(), r.double(), rtol=RTOL, atol=ATOL)


def test_model_takes_an_impl_by_callable() -> None:
    torch.manual_seed(0)
    model = BasicsTransformerLM(vocab_size=37, context_length=9, d_model=24, num_layers=2, num_heads=3, d_ff=40)
    ids = torch.randint(0, 37, (2, 9))
    eager = model(ids)
    model.set_attention(get_attention("annotated"))
    torch.testing.assert_close(model(ids), eager, rtol=RTOL, atol=ATOL)


def test_unknown_name_is_rejected() -> None:
    assert set(ATTENTION_IMPLS) == {"eager", "annotated", "compiled", "sdpa", "triton"}
    with pytest.raises(ValueError, match="expected one of"):
        get_attention("flash3")
