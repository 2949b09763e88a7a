"""A leaderboard step's peak memory counted on fake tensors: what the memory plan (:mod:`.memory`) predicts,
checked on any machine. :func:`traced_peak` builds the step of a config on fake CPU tensors and counts the
storages of its second step (:class:`cs336_harness.analysis.live_memory.LiveMemory`); nothing is computed, so the
14-layer proxy at context 32,768 takes seconds.

    live = traced_peak(LeaderboardConfig(**PROXY_DEFAULTS, backend="nccl", checkpoint="attention:5"))
    live.peak_bytes / 2**30
"""

from __future__ import annotations

import torch
from cs336_sharding.checkpointing import parse_policy

from cs336_harness.analysis.live_memory import LiveMemory, fake_tensors
from cs336_harness.studies.leaderboard.config import BUDGET, LeaderboardConfig
from cs336_harness.studies.leaderboard.training import build_training, rank_batch


def traceable(config: LeaderboardConfig) -> bool:
    """Whether :func:`traced_peak` can count ``config``: ours on one rank, eager (fake tensors run no collectives,
    FSDP2 needs a process group, and Inductor decides what compiled code saves), not offloading (its copies live in
    host memory, which the count of device tensors would take for the device's)."""
    offloads = config.checkpoint != BUDGET and parse_policy(config.checkpoint).kind == "offload"
    return (config.world_size == 1 and config.impl == "ours" and not config.compile_blocks
            and config.glue != "compiled" and not offloads)


def traced_peak(config: LeaderboardConfig, *, sites: bool = False) -> LiveMemory:
    """The :class:`~cs336_harness.analysis.live_memory.LiveMemory` of ``config``'s second training step (the first
    makes AdamW's state) on fake tensors: ``peak_bytes`` is the step's peak, with the model built inside (what a
    run's ``torch.cuda.max_memory_allocated`` measures after its warm-up); ``sites=True`` also records what was
    alive at the peak.

    Raises:
        ValueError: for a config it cannot trace (:func:`traceable`), or ``budget`` without ``memory_cap_gib``.
    """
    if not traceable(config):
        raise ValueError("traced_peak traces impl 'ours' on one rank, eager (Inductor decides what compiled code "
                         f"saves), not offloading; got impl {config.impl!r}, world_size {config.world_size}, "
                         f"compile_blocks {config.compile_blocks}, glue {config.glue!r}, checkpoint "
                         f"{config.checkpoint!r}")
    if config.checkpoint == BUDGET and config.memory_cap_gib is None:
        raise ValueError("traced_peak of checkpoint 'budget' needs memory_cap_gib (no device to take it from)")
    cpu = torch.device("cpu")
    with fake_tensors(), LiveMemory(sites=sites) as live:
        training = build_training(config, cpu)
        inputs, targets = rank_batch(config, 0, cpu)
        training.step(inputs, targets)
        live.reset_peak()
        training.step(inputs, targets)
    return live
