"""What the kernels' launchers share: row views, the device a launch runs on, and log2(e).

Triton launches on the current CUDA device, so every launcher enters its tensors' device first (a no-op on CPU,
where the kernels run in Triton's interpreter).
"""

from __future__ import annotations

import contextlib

import torch

# Kernels work in log2 units so that every exponential is an exp2: exp(x) = exp2(x * LOG2E).
LOG2E = 1.4426950408889634


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if its last dim has unit stride, else a contiguous copy (kernels index that dim densely)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def output_like(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor shaped and typed like ``x``, its dims laid out in the order of ``x``'s strides
    (``torch.empty_like``) where ``x`` has unit stride on its last dim and that order keeps it there, else
    contiguous (the layout of ``unit_stride(x)``, so an operator that copies its inputs first allocates the same).
    Kernels write their outputs in the layout of their inputs: a (batch, seq, heads, d) projection seen as (batch,
    heads, seq, d) gets its result, or its gradient, back in that layout and reshapes it without a copy. Fake
    implementations call this too, so a compiled graph sees the strides the kernels produce."""
    if x.stride(-1) == 1:
        out = torch.empty_like(x)
        if out.stride(-1) == 1:
            return out
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., d) as (rows, d) with unit stride on d: a view where the layout allows, else a copy."""
    return unit_stride(t.reshape(-1, t.shape[-1]))


def device_context(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context that makes ``t``'s CUDA device current for a launch; nothing for CPU tensors."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
