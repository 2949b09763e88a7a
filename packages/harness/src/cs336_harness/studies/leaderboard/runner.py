"""Running a leaderboard config on its ranks: :func:`run_leaderboard` (one row per config).

It runs ``warmup`` untimed and ``steps`` timed steps (devices synchronised and the ranks at a barrier before and
after each) and returns one row: step time (the maximum over ranks of each rank's median, and the maximum of all),
tokens per second, model FLOPs utilisation (:func:`~cs336_harness.studies.leaderboard.flops.step_flops` against the
running GPU's measured bf16 matmul rate, :func:`cs336_harness.device.mfu`) and peak memory per rank. With
``profile``, one more step runs under torch.profiler and the row gets its GPU time by kind of kernel (``breakdown``,
:func:`cs336_harness.analysis.kernel_kinds.step_breakdown`; GPU only). Past ``time_limit_s`` no new step starts
and :class:`TimeLimitExceeded` is raised. On CPU (gloo) the Triton kernels run in the Triton interpreter,
so only fp32 compute is allowed there (bf16 ``tl.dot`` is wrong in the interpreter).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cs336_comms.process_group import current_device, run_ranks

from cs336_harness import registry
from cs336_harness.analysis import kernel_kinds
from cs336_harness.device import GIB, mfu
from cs336_harness.memory_plan import device_memory_bytes, memory_plan
from cs336_harness.progress import progress_bar
from cs336_harness.studies.leaderboard.config import LeaderboardConfig
from cs336_harness.studies.leaderboard.flops import step_flops
from cs336_harness.training import Training, build_training, rank_batch


class TimeLimitExceeded(RuntimeError):
    """The run passed its ``time_limit_s`` before all its steps were done."""


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    packed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return packed.tolist()


def _handout_ms(training: Training, inputs: torch.Tensor, targets: torch.Tensor, device: torch.device,
                fastest_s: float) -> float | None:
    """The handout's measurement: ``triton.testing.do_bench`` (its defaults) around the whole step on each rank,
    the maximum over ranks; None where a step is too short for it to be safe with several ranks.

    do_bench picks its warm-up and repeat counts from its own estimate of one call; with steps longer than its
    100 ms budget on every rank both counts are 1, so every rank runs the same steps and their collectives match.
    """
    fastest_everywhere = -_max_over_ranks([-fastest_s], device)[0]
    if fastest_everywhere <= 0.1:
        return None
    from triton.testing import do_bench

    def step() -> None:
        training.optimizer.zero_grad(set_to_none=True)
        training.step(inputs, targets)

    return _max_over_ranks([do_bench(step)], device)[0]


def _rank_main(rank: int, world_size: int, config: LeaderboardConfig, show_progress: bool) -> dict[str, Any]:
    start = time.perf_counter()
    device = current_device()
    cuda = device.type == "cuda"
    if not cuda:
        # Before any kernel module is imported in this (fresh) process; see the module docstring.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # triton.testing.do_bench runs a step 8 times when each takes over its 100 ms budget (1 + 5 to estimate,
    # 1 warm-up, 1 timed); see _handout_ms.
    total_steps = config.warmup + config.steps + int(config.profile) + 8 * int(config.handout_timing)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()

    def check_time(done: int) -> None:
        # Every rank must take the same decision, or one would wait forever in the next step's collectives.
        over = _max_over_ranks([time.perf_counter() - start], device)[0] > config.time_limit_s
        if over:
            raise TimeLimitExceeded(
                f"time limit of {config.time_limit_s:g} s reached after {done} of {total_steps} "
                "steps (model build included); raise --time-limit-s or lower --steps/--warmup")

    bar = progress_bar(total=total_steps, desc=f"leaderboard {config.impl}", enabled=show_progress and rank == 0,
                       unit="step")
    bar.set_postfix_str("building the model")
    train = config.train_config()
    training = build_training(train, device)
    inputs, targets = rank_batch(train, rank, device)
    sync()
    peak_init = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    times: list[float] = []
    breakdown = None
    try:
        bar.set_postfix_str("warm-up")
        for i in range(config.warmup):
            check_time(i)
            training.step(inputs, targets)
            bar.update()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        bar.set_postfix_str("timed steps")
        for i in range(config.steps):
            check_time(config.warmup + i)
            sync()
            t0 = time.perf_counter()
            loss = training.step(inputs, targets)
            sync()
            times.append(time.perf_counter() - t0)
            bar.update()
        peak_step = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
        if config.profile:
            bar.set_postfix_str("profiled step")
            check_time(config.warmup + config.steps)
            def step() -> None:
                training.step(inputs, targets)
                sync()

            breakdown = kernel_kinds.profiled_breakdown(step, device)
            bar.update()
        handout_ms = None
        if config.handout_timing and cuda:
            check_time(total_steps - 8)
            bar.set_postfix_str("do_bench")
            handout_ms = _handout_ms(training, inputs, targets, device, min(times))
            bar.update(8)
    except TimeLimitExceeded as e:
        # Every rank stops here together; the caller raises the message again.
        bar.close()
        return {"time_limit_exceeded": str(e)}
    bar.close()
    loss_sum = loss.float().reshape(1)
    dist.all_reduce(loss_sum)  # gloo has no AVG
    step_s, step_max_s = _max_over_ranks([statistics.median(times), max(times)], device)
    peaks = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(peaks, torch.tensor([peak_init or 0.0, peak_step or 0.0], dtype=torch.float64, device=device))
    plan = training.plan
    result = {"loss": loss_sum.item() / world_size, "step_s": step_s, "step_max_s": step_max_s,
              "step_s_all_rank0": [round(t, 6) for t in times], "checkpoint": str(plan.policy),
              "memory_cap_gib": None if plan.cap_bytes is None else plan.cap_bytes / GIB,
              "expected_peak_gib": None if plan.expected_peak_bytes is None else plan.expected_peak_bytes / GIB,
              "block_memory_gib": {k: v / GIB for k, v in asdict(plan.step.block).items()}, "breakdown": breakdown,
              "handout_do_bench_s": None if handout_ms is None else handout_ms / 1e3}
    if cuda:
        result["peak_init_gib_per_rank"] = [p[0].item() for p in peaks]
        result["peak_step_gib_per_rank"] = [p[1].item() for p in peaks]
    return result


def check_runs_here(config: LeaderboardConfig) -> None:
    """That this machine has the GPUs ``config`` runs on. Checked before a run, not by the config, which may describe
    a GPU run on a machine without one (to see its memory plan).

    Raises:
        ValueError: if ``config`` runs on nccl with more ranks than visible GPUs, or its budget's memory cap cannot
            hold the step (:func:`~cs336_harness.memory_plan.memory_plan`).
    """
    if config.resolved_backend == "nccl" and config.world_size > torch.cuda.device_count():
        raise ValueError(f"world_size {config.world_size} needs that many GPUs for nccl; "
                         f"{torch.cuda.device_count()} visible")
    if config.checkpoint == registry.BUDGET:
        nccl = config.resolved_backend == "nccl"
        memory_plan(config.train_config(), device_memory_bytes(torch.device("cuda" if nccl else "cpu")))


def run_leaderboard(config: LeaderboardConfig, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run ``config`` on its ranks; one row (config, timings, throughput, MFU, memory, the breakdown when profiled),
    or [] on a torchrun rank other than 0. The row's ``checkpoint`` is the policy that ran (``budget`` resolved;
    ``checkpoint_requested`` is the config's).

    Raises:
        ValueError: if this machine cannot run ``config`` (:func:`check_runs_here`).
        TimeLimitExceeded: if a step would start after ``time_limit_s`` (every rank stops before it).
    """
    check_runs_here(config)
    if progress is not None:
        progress(f"leaderboard {config.impl}: {config.size} ({config.model_config.num_layers} layers), context "
                 f"{config.context_length}, global batch {config.global_batch}, {config.world_size} ranks "
                 f"({config.resolved_backend}), {config.compute_dtype}, attention {config.attention}, glue "
                 f"{config.glue}, checkpoint {config.checkpoint}, optimizer {config.optimizer}"
                 + (", compiled blocks" if config.compile_blocks else "") + (", fused qkv" if config.fused_qkv else ""))
    # The group's timeout bounds a hung collective; the time limit is checked between steps.
    result = run_ranks(_rank_main, config.world_size, config, progress is not None,
                       backend=config.resolved_backend, timeout_s=config.time_limit_s + 60)
    if result is None:  # a torchrun rank other than 0
        return []
    if "time_limit_exceeded" in result:
        raise TimeLimitExceeded(result["time_limit_exceeded"])
    model_config = config.model_config
    flops = step_flops(model_config, config.global_batch)
    tokens = config.global_batch * config.context_length
    on_gpu = config.resolved_backend == "nccl"
    dims = {k: getattr(model_config, k) for k in ("d_model", "d_ff", "num_layers", "num_heads")}
    row: dict[str, Any] = {**asdict(config), "checkpoint_requested": config.checkpoint, **dims,
                           "backend": config.resolved_backend, "params": model_config.num_params,
                           "tokens_per_step": tokens, "model_flops_per_step": flops, **result}
    row["tokens_per_s"] = tokens / row["step_s"]
    row["mfu"] = mfu(flops, row["step_s"], config.world_size, torch.cuda.get_device_name()) if on_gpu else None
    if on_gpu:
        row["peak_step_gib"] = max(row["peak_step_gib_per_rank"])
        row["peak_init_gib"] = max(row["peak_init_gib_per_rank"])
        row["within_cap"] = row["memory_cap_gib"] is None or row["peak_step_gib"] <= row["memory_cap_gib"]
    row["wall_s_since_process_start"] = process_age_s()
    row["status"] = "ok"
    return [row]


def process_age_s() -> float:
    """Seconds since this process started (Linux's /proc), model builds, compiles and autotuning included: what the
    handout's 10-minute rule for a run from empty caches counts."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # the 22nd field of stat, counting from the pid
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
