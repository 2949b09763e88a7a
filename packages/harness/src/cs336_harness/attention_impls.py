"""Attention implementations that can be swapped into ``cs336_basics.model`` by name.

Every entry has the model's signature ``fn(Q, K, V, mask) -> out`` over (..., T, d) tensors, with a
boolean mask that is True where a query may attend to a key. The model looks the module-level name
``scaled_dot_product_attention`` up at call time, so :func:`use_attention` swaps it for the duration of
a ``with`` block and restores the original afterwards::

    with use_attention("sdpa"):
        loss = model(x).sum()

Names: ``eager`` (the model's own), ``annotated`` (the model's math with NVTX and profiler ranges
around scores, softmax and the final matmul), ``compiled`` (``torch.compile`` of the model's own),
``sdpa`` (``torch.nn.functional.scaled_dot_product_attention``) and ``triton`` (our FlashAttention-2
kernel from ``cs336_kernels``, imported only when asked for).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import cs336_basics.model
import torch
import torch.nn.functional as F
from cs336_basics.nn_utils import softmax

from cs336_harness.profiling import annotate

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

# Captured at import so that "eager" means the model's own even while another impl is swapped in.
_MODEL_ATTENTION: AttentionFn = cs336_basics.model.scaled_dot_product_attention


def annotated_attention(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The model's attention math, with each stage inside its own NVTX / record_function range."""
    with annotate("attention"):
        with annotate("attention/scores"):
            scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])  # (..., Tq, Tk)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
        with annotate("attention/softmax"):
            probs = softmax(scores, dim=-1)
        with annotate("attention/final_matmul"):
            return probs @ V  # (..., Tq, d)


def _is_causal(Q: torch.Tensor, K: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the model's mask asks for causal attention.

    The fused kernels only know "causal or not". The model's one mask is the square lower-triangular one;
    checking its contents would cost a pass over a (T, T) tensor and a host sync per layer, so only its
    dtype and shape are checked.
    """
    if mask is not None and (mask.dtype != torch.bool or mask.shape[-2:] != (Q.shape[-2], K.shape[-2])):
        raise ValueError(
            f"fused attention takes no mask or the model's boolean causal (Tq, Tk) mask, got {mask.dtype} "
            f"{tuple(mask.shape)} for Tq={Q.shape[-2]}, Tk={K.shape[-2]}"
        )
    return mask is not None


def sdpa_attention(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """PyTorch's fused attention with ``is_causal`` (its flash kernel), not an explicit mask."""
    return F.scaled_dot_product_attention(Q, K, V, is_causal=_is_causal(Q, K, mask))


def _triton_attention() -> AttentionFn:
    from cs336_kernels.flash_attention import flash_attention

    def triton_attention(
        Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return flash_attention(Q, K, V, is_causal=_is_causal(Q, K, mask))

    return triton_attention


_FACTORIES: dict[str, Callable[[], AttentionFn]] = {
    "eager": lambda: _MODEL_ATTENTION,
    "annotated": lambda: annotated_attention,
    "compiled": lambda: torch.compile(_MODEL_ATTENTION),
    "sdpa": lambda: sdpa_attention,
    "triton": _triton_attention,
}
ATTENTION_IMPLS: tuple[str, ...] = tuple(_FACTORIES)


def get_attention(name: str) -> AttentionFn:
    """The attention function registered as ``name`` (one of :data:`ATTENTION_IMPLS`)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown attention implementation {name!r}; expected one of {', '.join(ATTENTION_IMPLS)}")
    return _FACTORIES[name]()


@contextlib.contextmanager
def use_attention(name: str) -> Iterator[AttentionFn]:
    """Swap ``cs336_basics.model.scaled_dot_product_attention`` for the named impl inside the block."""
    fn = get_attention(name)
    previous = cs336_basics.model.scaled_dot_product_attention
    cs336_basics.model.scaled_dot_product_attention = fn
    try:
        yield fn
    finally:
        cs336_basics.model.scaled_dot_product_attention = previous
