"""Attention implementations by name, for the studies that compare them inside the model.

Every entry is a model attention function ``fn(q, k, v, is_causal) -> out`` over (batch, heads, seq, head_dim)
tensors, as ``BasicsTransformerLM`` takes at build time or through ``set_attention``::

    model = BasicsTransformerLM.from_config(config, attention=get_attention("triton"))

Names: ``eager`` (the model's own), ``annotated`` (the model's math with NVTX and profiler ranges around scores,
softmax and the final matmul), ``compiled`` (``torch.compile`` of the model's own), ``sdpa``
(``torch.nn.functional.scaled_dot_product_attention``) and ``triton`` (our kernels, ``cs336_kernels.flash_attention``
as it runs by default: Triton, or the Gluon kernels on sm_90; imported only when asked for).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from cs336_basics.model import AttentionFn, eager_attention, sdpa_attention
from cs336_basics.nn_utils import softmax

from cs336_harness.instrument import annotate


def annotated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """The model's attention math, with each stage inside its own NVTX / record_function range."""
    with annotate("attention"):
        with annotate("attention/scores"):
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., Tq, Tk)
            if is_causal:
                keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
                scores = scores.masked_fill(~keep, float("-inf"))
        with annotate("attention/softmax"):
            probs = softmax(scores, dim=-1)
        with annotate("attention/final_matmul"):
            return probs @ v  # (..., Tq, d)


def _triton_attention() -> AttentionFn:
    from cs336_kernels import flash_attention

    def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
        return flash_attention(q, k, v, is_causal=is_causal)

    return triton_attention


_FACTORIES: dict[str, Callable[[], AttentionFn]] = {
    "eager": lambda: eager_attention,
    "annotated": lambda: annotated_attention,
    "compiled": lambda: torch.compile(eager_attention),
    "sdpa": lambda: sdpa_attention,
    "triton": _triton_attention,
}
ATTENTION_IMPLS: tuple[str, ...] = tuple(_FACTORIES)


def get_attention(name: str) -> AttentionFn:
    """The attention function registered as ``name`` (one of :data:`ATTENTION_IMPLS`)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown attention implementation {name!r}; expected one of {', '.join(ATTENTION_IMPLS)}")
    return _FACTORIES[name]()
