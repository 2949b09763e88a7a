"""The AdamW variants the studies compare, by one set of names.

- ``adamw``: ours, :class:`cs336_basics.optimizer.AdamW` (plain PyTorch, one tensor at a time);
- ``torch-adamw``: ``torch.optim.AdamW``, with ``fused=True`` on CUDA (what a PyTorch user picks);
- ``fused-adamw``: our Triton :class:`cs336_kernels.FusedAdamW` (one launch per group and dtype).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

OPTIMIZERS: tuple[str, ...] = ("adamw", "torch-adamw", "fused-adamw")


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float,
                    weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer ``name`` of :data:`OPTIMIZERS` over ``params``."""
    params = list(params)
    if name == "adamw":
        from cs336_basics.optimizer import AdamW

        return AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "torch-adamw":
        on_cuda = bool(params) and params[0].device.type == "cuda"
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=on_cuda)
    if name == "fused-adamw":
        # Imported here: on CPU the Triton interpreter must be chosen before the kernels load.
        from cs336_kernels import FusedAdamW

        return FusedAdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")
