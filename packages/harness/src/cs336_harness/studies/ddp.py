"""Data-parallel training steps of the Transformer LM: our four DDP wrappers against torch's DDP.

Every rank builds the training step of a ``BasicsTransformerLM`` of a preset size (:func:`train_config`, composed by
:func:`cs336_harness.training.build_training`) in one wrapper (``naive``, ``flat``, ``overlapped``, ``bucketed`` from
:mod:`cs336_comms.ddp`, ``torch_ddp`` = ``torch.nn.parallel.DistributedDataParallel`` with the same bucket size, or
``nocomm``: the bare model, no gradient exchange, the compute-only reference) and trains on a random batch of
``global_batch / world_size`` sequences with our AdamW, in fp32 or under bf16 autocast.

What is measured, per (dtype, variant):

- ``step_ms``: median wall time of a whole step (forward, backward, gradient sync, optimizer), the
  device synchronised around each step; the slowest rank's median.
- ``overhead_ms``: ``step_ms`` minus the ``nocomm`` step of the same dtype in the same run. This is
  the end-to-end price of data parallelism, including compute slowed by NCCL kernels sharing the GPU.
- ``host_<phase>_ms`` (forward, backward, grad_sync, optimizer): rank 0's median CPU time to issue each
  phase, the device not synchronised inside the step. When a phase's host time is close to the step's
  share of it, the CPU's launch rate, not the GPU, bounds that phase (the bf16 steps here), and any
  Python a wrapper runs during it (hooks, collective calls) adds to the step.
- ``sync_tail_ms``: in every timed step, the device time from the end of the backward's compute (a CUDA
  event recorded when its last gradient is accumulated; which parameter that is comes from the first
  warm-up step) to the end of gradient synchronisation (an event after ``finish_gradient_synchronization``,
  or after ``backward`` for torch DDP, which waits inside it); the slowest rank's median, and
  ``sync_tail_share`` of the step. It is what a rank waits for after its backward, measured without the
  profiler and the same way for every wrapper; it needs a warm-up step (on CPU it is host time).
- ``comm_tail_ms``: the same tail, but per step the smallest over the ranks, then the median over steps
  (and ``comm_tail_share``). A collective ends at about the same moment on every rank, so the rank whose
  backward finished last has the smallest tail: this is the communication left once every rank has
  finished its backward. ``sync_tail_ms`` minus it is time spent waiting for a slower rank (ranks drift
  apart when their CPUs, not the GPUs, set the pace, as in the bf16 steps).
- ``comm_ms`` and ``exposed_comm_ms`` from a ``torch.profiler`` trace of one more step on rank 0: the
  time NCCL kernels run, and the part of it when no compute kernel runs. Only the exposed part can
  lengthen the step; the trace measures it directly for every variant, torch's DDP included (whose
  waits happen inside ``backward``, where timing ``finish_gradient_synchronization`` would miss them).

The same trace renders the timeline figure (:func:`plot_timelines`): compute kernels coloured by the
phase that launched them and NCCL kernels on their own row, one time axis per variant.

Run it as ``uv run cs336 ddp`` (``--help``); on CPU it uses gloo and the ``tiny`` preset quickly. Under
``torchrun --nproc-per-node N -m cs336_harness.cli ddp --world-size N`` the same code joins torchrun's
group. Nsight users get the same labels: every phase is an NVTX range as well.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from cs336_comms.process_group import current_device, run_ranks

from cs336_harness import instrument
from cs336_harness.analysis import figures, trace
from cs336_harness.analysis.tables import markdown_table
from cs336_harness.device import GIB, sync
from cs336_harness.instrument import STEP_PHASES
from cs336_harness.progress import progress_bar
from cs336_harness.studies.distributed import DistributedRunConfig, trace_folder
from cs336_harness.train_config import OptimizerConfig, Parallelism, TrainConfig
from cs336_harness.training import Training, build_training

VARIANTS: tuple[str, ...] = ("nocomm", "naive", "flat", "overlapped", "bucketed", "torch_ddp")


@dataclass(frozen=True)
class DDPBenchConfig(DistributedRunConfig):
    VARIANTS: ClassVar[tuple[str, ...]] = VARIANTS

    bucket_size_mb: float = 25.0
    trace_dir: str | None = None  # where rank 0's per-variant traces go; None: a temporary folder

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {self.bucket_size_mb}")


# The wrapper of each variant (cs336_harness.train_config.Parallelism); nocomm is the bare model.
WRAPPER_OF: dict[str, str] = {"nocomm": "none", "naive": "naive", "flat": "flat", "overlapped": "overlapped",
                              "bucketed": "bucketed", "torch_ddp": "torch_ddp"}


class _Stamp:
    """A point on the device's timeline: a CUDA event on the current stream, or the host clock on CPU."""

    def __init__(self, device: torch.device):
        self.event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        self.t = 0.0

    def record(self) -> None:
        if self.event is not None:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def ms_until(self, later: _Stamp) -> float:
        """Milliseconds from this stamp to ``later`` (both recorded; CUDA: call after synchronising)."""
        return self.event.elapsed_time(later.event) if self.event is not None else (later.t - self.t) * 1e3


def _last_gradient(step: Callable[[], Any], params: list[nn.Parameter]) -> nn.Parameter:
    """The parameter whose gradient one run of ``step`` accumulates last (its backward's final gradient)."""
    order: list[nn.Parameter] = []
    handles = [p.register_post_accumulate_grad_hook(order.append) for p in params]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    if not order:
        raise ValueError("the step produced no gradient")
    return order[-1]


def _make_step(config: DDPBenchConfig, training: Training, rank: int, device: torch.device,
               sync_end: _Stamp) -> Callable[[], dict[str, float]]:
    """One training step as a function returning the host (CPU) seconds each phase took to issue; ``sync_end``
    is recorded once the gradients are synchronised (for torch DDP, which waits inside backward: after it)."""
    local_batch = config.global_batch // config.world_size
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the global batch
    tokens = torch.randint(0, config.vocab_size, (local_batch, config.context_length + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B/n, T)

    def step() -> dict[str, float]:
        t0 = time.perf_counter()
        with instrument.annotate("forward"):
            loss = training.forward(inputs, targets)
        t1 = time.perf_counter()
        with instrument.annotate("backward"):
            loss.backward()
        t2 = time.perf_counter()
        with instrument.annotate("grad_sync"):
            training.finish_sync()
        sync_end.record()
        t3 = time.perf_counter()
        with instrument.annotate("optimizer"):
            training.optimizer_step()
        t4 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "grad_sync": t3 - t2, "optimizer": t4 - t3}

    return step


@dataclass
class _Run:
    """One variant ready to train: its model (in its wrapper), a step function, and the stamp it records at the end
    of gradient synchronisation."""

    model: nn.Module
    step: Callable[[], dict[str, float]]
    sync_end: _Stamp


def train_config(config: DDPBenchConfig, variant: str, dtype: str, rank: int) -> TrainConfig:
    """The step ``variant`` runs on ``rank``: the model's own PyTorch code, the variant's wrapper, ``dtype`` under
    autocast, our AdamW; each rank's weights drawn from its own seed (the wrappers must broadcast rank 0's)."""
    return TrainConfig(
        config.model_config,
        parallelism=Parallelism(world_size=config.world_size, backend=config.resolved_backend, compute_dtype=dtype,
                                wrapper=WRAPPER_OF[variant], bucket_size_mb=config.bucket_size_mb),
        optimizer=OptimizerConfig("adamw", lr=config.lr), global_batch=config.global_batch, seed=rank)


def _build(config: DDPBenchConfig, variant: str, dtype: str, rank: int, device: torch.device) -> _Run:
    training = build_training(train_config(config, variant, dtype, rank), device)
    sync_end = _Stamp(device)
    return _Run(training.model, _make_step(config, training, rank, device, sync_end), sync_end)


def _release(device: torch.device) -> None:
    """Give the previous variant's memory back (call once its ``_Run`` is no longer referenced)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _time_variant(config: DDPBenchConfig, variant: str, dtype: str, rank: int, device: torch.device) -> dict[str, Any]:
    """Warm-up, then ``config.steps`` timed steps without the profiler; the row's timing fields."""
    run = _build(config, variant, dtype, rank, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    last = None
    for i in range(config.warmup):
        with instrument.annotate("warmup"):
            if i == 0:
                last = _last_gradient(run.step, [p for p in run.model.parameters() if p.requires_grad])
            else:
                run.step()
    # The backward's last gradient marks the end of its compute: every backward kernel has been issued then.
    compute_end, tail_hook = _Stamp(device), None
    if last is not None:
        tail_hook = last.register_post_accumulate_grad_hook(lambda _: compute_end.record())
    times, host, tails = [], [], []
    for _ in range(config.steps):
        sync(device)
        t0 = time.perf_counter()
        with instrument.annotate("step"):
            host.append(run.step())
        sync(device)
        times.append(time.perf_counter() - t0)
        if tail_hook is not None:
            tails.append(compute_end.ms_until(run.sync_end))
    if tail_hook is not None:
        tail_hook.remove()
    host_ms = {f"host_{phase}_ms": statistics.median(h[phase] for h in host) * 1e3 for phase in STEP_PHASES}
    tail = statistics.median(tails) if tails else float("nan")
    slowest = torch.tensor([statistics.median(times), max(times), tail], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    last_rank_tails = torch.tensor(tails, dtype=torch.float64, device=device)
    dist.all_reduce(last_rank_tails, op=dist.ReduceOp.MIN)
    in_sync = _params_in_sync(run.model)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    del run, last
    _release(device)
    return {
        "variant": variant, "dtype": dtype, "step_ms": float(slowest[0]) * 1e3,
        "step_max_ms": float(slowest[1]) * 1e3, "peak_mem_gib": peak, "params_in_sync": in_sync, **host_ms,
        "sync_tail_ms": None if not tails else float(slowest[2]),
        "comm_tail_ms": None if not tails else statistics.median(last_rank_tails.tolist()),
    }


def _trace_variant(config: DDPBenchConfig, variant: str, dtype: str, rank: int, device: torch.device,
                   trace_path: Path) -> None:
    """Warm-up, then one step under ``torch.profiler``; rank 0 writes the trace."""
    run = _build(config, variant, dtype, rank, device)
    for _ in range(config.warmup):
        with instrument.annotate("warmup"):
            run.step()
    sync(device)
    with instrument.profile(device) as prof:
        with instrument.annotate("step"):
            run.step()
        sync(device)
    if rank == 0:
        prof.export_chrome_trace(str(trace_path))
    del run, prof
    _release(device)


def _params_in_sync(model: nn.Module) -> bool:
    """Whether every rank holds bit-identical parameters (per-tensor fp64 sums agree on all ranks).

    A check that the wrappers really keep the replicas together after several steps; ``nocomm``
    replicas start and stay different, so it is False there by design.
    """
    sums = torch.stack([p.detach().sum(dtype=torch.float64) for p in model.parameters()])
    lo, hi = sums.clone(), sums.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


# The variants that group gradients into buckets; the others ignore bucket_size_mb.
BUCKETED: tuple[str, ...] = ("bucketed", "torch_ddp")


def bucket_where_used(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with ``bucket_size_mb`` None for a variant that has no buckets."""
    return row if row["variant"] in BUCKETED else {**row, "bucket_size_mb": None}


def _finish(row: dict[str, Any], timed: Sequence[dict[str, Any]], config: DDPBenchConfig,
            trace_dir: Path) -> dict[str, Any]:
    """Rank 0's row of one (dtype, variant) with its trace's metrics, what follows from them and from the ``nocomm``
    step of its dtype (among ``timed``, every run's timing), and the config's fields."""
    row.update(trace.comm_overlap(trace.load_trace(trace_dir / row["trace"])))
    base = next((r["step_ms"] for r in timed if r["variant"] == "nocomm" and r["dtype"] == row["dtype"]), None)
    row["overhead_ms"] = None if base is None else row["step_ms"] - base
    row["exposed_share"] = None if row["exposed_comm_ms"] is None else row["exposed_comm_ms"] / row["step_ms"]
    for tail in ("sync_tail", "comm_tail"):
        row[f"{tail}_share"] = None if row[f"{tail}_ms"] is None else row[f"{tail}_ms"] / row["step_ms"]
    row.update({k: v for k, v in asdict(config).items() if k not in ("dtypes", "variants", "trace_dir")},
               backend=config.resolved_backend)
    return bucket_where_used(row)


def _rank_main(rank: int, world_size: int, config: DDPBenchConfig, trace_dir: str, progress: bool,
               write: Callable[[list[dict[str, Any]]], Any] | None) -> list[dict[str, Any]]:
    device = current_device()
    runs = [(dtype, variant) for dtype in config.dtypes for variant in config.variants]
    bar = progress_bar(total=2 * len(runs), desc="ddp", enabled=progress and rank == 0, unit="run")
    # Every variant is timed before any is profiled: a profiled run slows the next variant timed in the same
    # process.
    timed, rows = [], []
    for dtype, variant in runs:
        bar.set_postfix_str(f"timing {dtype} {variant}")
        timed.append(_time_variant(config, variant, dtype, rank, device))
        bar.update()
    for row in timed:
        bar.set_postfix_str(f"profiling {row['dtype']} {row['variant']}")
        row["trace"] = f"{row['dtype']}_{row['variant']}.json"
        _trace_variant(config, row["variant"], row["dtype"], rank, device, Path(trace_dir) / row["trace"])
        if rank == 0:  # a run is finished once profiled: its row is complete, and written at once
            rows.append(_finish(dict(row), timed, config, Path(trace_dir)))
            if write:
                write(rows[-1:])
        bar.update()
    bar.close()
    return rows


def run_ddp_bench(config: DDPBenchConfig, progress: bool = False,
                  write: Callable[[list[dict[str, Any]]], Any] | None = None) -> list[dict[str, Any]]:
    """Benchmark every (dtype, variant) of ``config``; rows carry the config and the trace metrics.

    Under torchrun only rank 0 returns rows (the others return []). Traces stay in ``config.trace_dir``
    when it is given. With ``progress``, rank 0 shows a bar on stderr: timed and profiled runs done, and which.
    ``write`` (a picklable callable, e.g. a :class:`~cs336_harness.results.RowWriter`) gets each run's row on
    rank 0 as soon as the run finishes.
    """
    with trace_folder(config.trace_dir) as trace_dir:
        rows = run_ranks(_rank_main, config.world_size, config, str(trace_dir), progress, write,
                         backend=config.resolved_backend, timeout_s=600)
    return rows or []


DDP_COLUMNS = ("dtype", "variant", "bucket_size_mb", "step_ms", "step_max_ms", "overhead_ms", "comm_ms",
               "exposed_comm_ms", "exposed_share", "sync_tail_ms", "sync_tail_share", "comm_tail_ms",
               "comm_tail_share", "host_backward_ms", "peak_mem_gib", "params_in_sync", "commit")
DDP_HEADERS = ("dtype", "wrapper", "bucket (MiB)", "median step (ms)", "slowest step (ms)", "vs no-comm step (ms)",
               "NCCL kernels (ms)", "NCCL not overlapped (ms)", "not overlapped / step", "sync after backward (ms)",
               "sync after backward / step", "comm after last rank's backward (ms)",
               "comm after last rank's backward / step", "backward host time (ms)", "peak memory (GiB)",
               "replicas equal", "commit")


# The terminal's table: the commit is in the rows written with --out, not in the rows just measured.
PRINTED_COLUMNS = tuple(c for c in DDP_COLUMNS if c != "commit")


def ddp_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The DDP rows as a markdown table, one line per (dtype, wrapper) in run order."""
    return markdown_table(rows, list(zip(DDP_COLUMNS, DDP_HEADERS, strict=True)), floatfmt=".3g")


def timeline_figure_from_rows(rows: Sequence[dict[str, Any]], trace_dir: str | Path, dtype: str,
                              path: str | Path) -> Path:
    """:func:`plot_timelines` of every variant of ``dtype`` in ``rows`` from the traces in ``trace_dir``."""
    chosen = [r for r in rows if r["dtype"] == dtype]
    if not chosen:
        raise ValueError(f"no rows with dtype {dtype!r}; have {sorted({r['dtype'] for r in rows})}")
    traces = {
        f"{r['variant']}: step {r['step_ms']:.1f} ms" + (
            f", NCCL {r['comm_ms']:.1f} ms of which {r['exposed_comm_ms']:.1f} ms not overlapped"
            if r.get("comm_ms") is not None else ""
        ): trace.load_trace(Path(trace_dir) / r["trace"])
        for r in chosen
    }
    r0 = chosen[0]
    title = (f"{r0['size']}, context {r0['context_length']}, global batch {r0['global_batch']}, "
             f"{r0['world_size']} ranks ({r0['backend']}), {dtype}: one profiled step on rank 0")
    return figures.plot_timelines(traces, path, title)


