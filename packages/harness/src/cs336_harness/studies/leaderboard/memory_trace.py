"""A training step's peak memory counted on fake tensors: what the memory plan (:mod:`cs336_harness.memory_plan`)
predicts, checked on any machine. :func:`traced_peak` builds the step of a config on fake CPU tensors and counts the
storages of its second step (:class:`cs336_harness.analysis.live_memory.LiveMemory`); nothing is computed, so the
14-layer proxy at context 32,768 takes seconds.

    live = traced_peak(LeaderboardConfig(**PROXY_DEFAULTS, backend="nccl", checkpoint="attention:5").train_config())
    live.peak_bytes / 2**30
"""

from __future__ import annotations

import torch
from cs336_sharding.checkpointing import parse_policy

from cs336_harness.analysis.live_memory import LiveMemory, fake_tensors
from cs336_harness.registry import BUDGET
from cs336_harness.step_memory import compiled
from cs336_harness.train_config import TrainConfig
from cs336_harness.training import build_training, rank_batch


def traceable(config: TrainConfig) -> bool:
    """Whether :func:`traced_peak` can count ``config``: our FSDP on one rank, eager (fake tensors run no collectives,
    FSDP2 needs a process group, and Inductor decides what compiled code saves), not offloading (its copies live in
    host memory, which the count of device tensors would take for the device's)."""
    par = config.parallelism
    offloads = par.checkpoint != BUDGET and parse_policy(par.checkpoint).kind == "offload"
    return par.world_size == 1 and par.wrapper == "fsdp" and not compiled(config) and not offloads


def traced_peak(config: TrainConfig, *, sites: bool = False) -> LiveMemory:
    """The :class:`~cs336_harness.analysis.live_memory.LiveMemory` of ``config``'s second training step (the first
    makes AdamW's state) on fake tensors: ``peak_bytes`` is the step's peak, with the model built inside (what a
    run's ``torch.cuda.max_memory_allocated`` measures after its warm-up); ``sites=True`` also records what was
    alive at the peak.

    Raises:
        ValueError: for a config it cannot trace (:func:`traceable`), or ``budget`` without ``memory_cap_gib``.
    """
    par = config.parallelism
    if not traceable(config):
        raise ValueError("traced_peak traces our FSDP on one rank, eager (Inductor decides what compiled code saves), "
                         f"not offloading; got wrapper {par.wrapper!r}, world_size {par.world_size}, compiled "
                         f"{compiled(config)}, checkpoint {par.checkpoint!r}")
    if par.checkpoint == BUDGET and par.memory_cap_gib is None:
        raise ValueError("traced_peak of checkpoint 'budget' needs memory_cap_gib (no device to take it from)")
    cpu = torch.device("cpu")
    with fake_tensors(), LiveMemory(sites=sites) as live:
        training = build_training(config, cpu)
        inputs, targets = rank_batch(config, 0, cpu)
        training.step(inputs, targets)
        live.reset_peak()
        training.step(inputs, targets)
    return live
