"""The standard CS336 assignment-2 adapter interface, implemented with our packages.

Tests written against the course's ``tests/adapters.py`` run unchanged against these functions.
"""

from __future__ import annotations

from typing import Any

import torch


def get_flashattention_autograd_function_pytorch() -> type[torch.autograd.Function]:
    """The tiled pure-PyTorch FlashAttention-2 ``autograd.Function`` (``apply(Q, K, V, is_causal)``)."""
    from cs336_kernels import FlashAttentionPytorch

    return FlashAttentionPytorch


def get_flashattention_autograd_function_triton() -> type[torch.autograd.Function]:
    """The Triton FlashAttention-2 ``autograd.Function`` (``apply(Q, K, V, is_causal)``)."""
    from cs336_kernels import FlashAttentionTriton

    return FlashAttentionTriton


def get_ddp(module: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``module`` for data parallel training with gradients all-reduced as they become ready."""
    from cs336_comms.ddp import OverlappedDDP

    return OverlappedDDP(module)


def ddp_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Called after ``loss.backward()`` and before ``optimizer.step()``."""
    ddp_model.finish_gradient_synchronization()


def get_fsdp(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Shard ``module``'s 2-D weights across ranks; compute in ``compute_dtype`` if given."""
    from cs336_sharding.fsdp import FSDP

    return FSDP(module, compute_dtype=compute_dtype)


def fsdp_on_after_backward(fsdp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Called after ``loss.backward()`` and before ``optimizer.step()``."""
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the wrapped module, unsharded, by its name in the original module."""
    return fsdp_model.gather_full_params()


def get_sharded_optimizer(
    params: Any, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
) -> torch.optim.Optimizer:
    """An optimizer whose state is sharded across ranks (ZeRO stage 1) around ``optimizer_cls``."""
    from cs336_sharding.optimizer import ShardedOptimizer

    return ShardedOptimizer(params, optimizer_cls, **kwargs)
