"""The leaderboard step composed from this repo's pieces: :func:`build_training` (config in, a :class:`Training` with
``step(inputs, targets)`` out), and the batch it trains on (:func:`make_batch`, :func:`rank_batch`).

For ``impl="ours"``:

1. :func:`build_model`: a ``BasicsTransformerLM`` with fp32 master weights on the rank's device, built with its
   pieces: its attention (``attention``: ``triton``, our FlashAttention-2 kernel, or ``sdpa``), its glue (``glue``,
   :mod:`cs336_harness.studies.glue`: the model's code, our Triton RMSNorm (with the residual add before ``ln2``
   folded in) / RoPE / SiLU-mul kernels, or torch.compile of their references), the LM head's loss
   ``cs336_kernels.fused_linear_cross_entropy`` (the (tokens, vocab) logits never exist) and, with ``fused_qkv``,
   one (3d, d) matmul for q, k and v;
2. :func:`cs336_sharding.parallelize.parallelize`: activation checkpointing of the blocks (the memory plan's
   policy, :mod:`~cs336_harness.studies.leaderboard.memory`), optionally each block's forward compiled
   (``compile_blocks``), and our FSDP with ``compute_dtype``; ``finish_gradient_synchronization()`` after each
   backward;
3. AdamW over the FSDP model's parameters (this rank's fp32 shards), by the names of
   :mod:`cs336_harness.studies.optimizers` (``optimizer``): our Triton ``fused-adamw`` or ``torch-adamw`` (fused).

``impl="torch_native"`` and ``"torch_native_compiled"`` are the PyTorch-only steps of
:mod:`~cs336_harness.studies.leaderboard.baselines` (FSDP2, SDPA, a chunked checkpointed LM head + CE, fused torch
AdamW), plain and strong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from cs336_basics.model import BasicsTransformerLM
from cs336_sharding.parallelize import parallelize

from cs336_harness.device import DTYPES
from cs336_harness.studies.attention_impls import get_attention
from cs336_harness.studies.glue import glue_kernels
from cs336_harness.studies.leaderboard.baselines import build_baseline, chunked_cross_entropy
from cs336_harness.studies.leaderboard.config import LeaderboardConfig
from cs336_harness.studies.leaderboard.memory import MemoryPlan, memory_plan
from cs336_harness.studies.optimizers import build_optimizer


def build_model(config: LeaderboardConfig, device: torch.device) -> BasicsTransformerLM:
    """The run's model with fp32 weights and its pieces: attention, glue and the LM head's loss (ours
    ``cs336_kernels.fused_linear_cross_entropy``, the baselines'
    :func:`~cs336_harness.studies.leaderboard.baselines.chunked_cross_entropy`); seeded, so every rank and a
    reference build the same weights."""
    if config.impl == "ours":
        # Imported here: on CPU the Triton interpreter must be chosen before the kernels load.
        from cs336_kernels import fused_linear_cross_entropy as loss
    else:
        loss = chunked_cross_entropy
    torch.manual_seed(config.seed)
    return BasicsTransformerLM.from_config(config.model_config, attention=get_attention(config.attention),
                                           **glue_kernels(config.glue), loss=loss, fused_qkv=config.fused_qkv,
                                           device=device)


@dataclass
class Training:
    """What :func:`build_training` composed; :meth:`step` is one training step on this rank's batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    finish_sync: Callable[[], None]  # after backward: every .grad the averaged local gradient
    plan: MemoryPlan

    def forward_backward(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward, loss, backward and gradient sync (each ``.grad`` is then the averaged local shard gradient);
        returns this rank's loss (not synchronised)."""
        loss = self.model(token_ids, targets)
        loss.backward()
        self.finish_sync()
        return loss.detach()

    def step(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`forward_backward`, then the optimizer update; returns this rank's loss (not synchronised)."""
        loss = self.forward_backward(token_ids, targets)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def build_training(config: LeaderboardConfig, device: torch.device) -> Training:
    """The steps of the module docstring for ``config.impl``, on ``device``.

    With ``world_size`` ranks, call it on every rank of an initialised process group of that size (FSDP broadcasts
    rank 0's weights; :func:`~cs336_harness.studies.leaderboard.runner.run_leaderboard` starts one). Our step on one
    rank also runs without a process group, in this process.

    Raises:
        ValueError: if the process group (or its absence) does not match ``config.world_size`` and ``config.impl``.
    """
    if not isinstance(config, LeaderboardConfig):
        raise TypeError(f"config must be a LeaderboardConfig, got {type(config).__name__}")
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {type(device).__name__}")
    ranks = dist.get_world_size() if dist.is_initialized() else None
    if ranks is None and (config.world_size != 1 or config.impl != "ours"):
        raise ValueError(f"impl {config.impl!r} on world_size {config.world_size} needs an initialised process group "
                         "of that many ranks (run_leaderboard starts one); without one, only impl 'ours' on world_size "
                         "1 runs")
    if ranks is not None and ranks != config.world_size:
        raise ValueError(f"config.world_size is {config.world_size}, but the process group has {ranks} ranks")
    cuda = device.type == "cuda"
    plan = memory_plan(config, torch.cuda.get_device_properties(device).total_memory if cuda else None)
    model = build_model(config, device)
    compute = DTYPES[config.compute_dtype]
    if config.impl == "ours":
        fsdp = parallelize(model, checkpoint=plan.policy, compute_dtype=compute, compile_blocks=config.compile_blocks)
        optimizer = build_optimizer(config.optimizer, fsdp.parameters(), config.lr, config.weight_decay)
        return Training(fsdp, optimizer, fsdp.finish_gradient_synchronization, plan)
    model = build_baseline(model, device, config.world_size, checkpoint=plan.policy, compute_dtype=compute,
                           compile_blocks=config.compile_blocks)
    optimizer = build_optimizer(config.optimizer, model.parameters(), config.lr, config.weight_decay)
    return Training(model, optimizer, lambda: None, plan)


def make_batch(config: LeaderboardConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Random input and target token ids of the whole global batch, each (global_batch, context_length), on CPU;
    rank r trains on rows ``[r * B / n, (r + 1) * B / n)``."""
    g = torch.Generator().manual_seed(1000 + config.seed)
    shape = (config.global_batch, config.context_length)
    return (torch.randint(0, config.vocab_size, shape, generator=g),
            torch.randint(0, config.vocab_size, shape, generator=g))


def rank_batch(config: LeaderboardConfig, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of :func:`make_batch`, on ``device``."""
    per_rank = config.batch_per_rank
    inputs, targets = make_batch(config)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return inputs[rows].to(device), targets[rows].to(device)
