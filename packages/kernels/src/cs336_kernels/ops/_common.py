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


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., d) as (rows, d) with unit stride on d: a view where the layout allows, else a copy."""
    return unit_stride(t.reshape(-1, t.shape[-1]))


def device_context(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context that makes ``t``'s CUDA device current for a launch; nothing for CPU tensors."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
