"""Data-parallel training steps of the Transformer LM: our four DDP wrappers against torch's DDP.

Every rank builds a ``BasicsTransformerLM`` of a preset size, wraps it (``naive``, ``flat``,
``overlapped``, ``bucketed`` from :mod:`cs336_comms.ddp`, ``torch_ddp`` =
``torch.nn.parallel.DistributedDataParallel`` with the same bucket size, or ``nocomm``: the bare model,
no gradient exchange, the compute-only reference) and trains on a random batch of
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
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from cs336_basics.model import BasicsTransformerLM
from cs336_basics.nn_utils import cross_entropy
from cs336_basics.optimizer import AdamW
from cs336_comms.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP
from cs336_comms.process_group import current_device, default_backend, run_ranks

from cs336_harness import profiling
from cs336_harness.presets import DEFAULT_CONTEXT_LENGTH, DEFAULT_VOCAB_SIZE, MODEL_SIZES
from cs336_harness.results import markdown_table

VARIANTS: tuple[str, ...] = ("nocomm", "naive", "flat", "overlapped", "bucketed", "torch_ddp")
DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
STEP_PHASES: tuple[str, ...] = ("forward", "backward", "grad_sync", "optimizer")


@dataclass(frozen=True)
class DistributedRunConfig:
    """What every multi-rank training benchmark takes: a preset model, a global batch split over the
    ranks, dtypes, and wrapper variants from the subclass's ``VARIANTS``."""

    VARIANTS: ClassVar[tuple[str, ...]] = ()
    MIN_WARMUP: ClassVar[int] = 0

    size: str = "xl"
    context_length: int = DEFAULT_CONTEXT_LENGTH
    global_batch: int = 4
    world_size: int = 2
    backend: str | None = None  # nccl with GPUs, gloo without
    dtypes: tuple[str, ...] = ("fp32",)
    variants: tuple[str, ...] = ()  # empty: all of VARIANTS
    warmup: int = 2
    steps: int = 5
    vocab_size: int = DEFAULT_VOCAB_SIZE
    lr: float = 1e-4

    def __post_init__(self) -> None:
        if not self.variants:
            object.__setattr__(self, "variants", self.VARIANTS)
        if self.size not in MODEL_SIZES:
            raise ValueError(f"size must be one of {sorted(MODEL_SIZES)}, got {self.size!r}")
        if self.world_size < 1 or self.global_batch % self.world_size != 0:
            raise ValueError(
                f"global_batch ({self.global_batch}) must be a positive multiple of world_size ({self.world_size})"
            )
        if self.global_batch < 1 or self.context_length < 1 or self.vocab_size < 2:
            raise ValueError("global_batch and context_length must be positive and vocab_size at least 2, got "
                             f"{self.global_batch}, {self.context_length}, {self.vocab_size}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {self.backend!r}")
        if not self.dtypes or any(d not in DTYPES for d in self.dtypes):
            raise ValueError(f"dtypes must be a non-empty subset of {list(DTYPES)}, got {self.dtypes}")
        if any(v not in self.VARIANTS for v in self.variants):
            raise ValueError(f"variants must be a non-empty subset of {list(self.VARIANTS)}, got {self.variants}")
        if self.warmup < self.MIN_WARMUP or self.steps < 1:
            raise ValueError(f"need warmup >= {self.MIN_WARMUP} and steps >= 1; got {self.warmup}, {self.steps}")

    @property
    def resolved_backend(self) -> str:
        return self.backend or default_backend()


@dataclass(frozen=True)
class DDPBenchConfig(DistributedRunConfig):
    VARIANTS: ClassVar[tuple[str, ...]] = VARIANTS

    bucket_size_mb: float = 25.0
    trace_dir: str | None = None  # where rank 0's per-variant traces go; None: a temporary folder

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {self.bucket_size_mb}")


def _wrap(variant: str, model: nn.Module, device: torch.device, bucket_size_mb: float) -> nn.Module:
    if variant == "nocomm":
        return model
    if variant == "torch_ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_size_mb)
    if variant == "bucketed":
        return BucketedDDP(model, bucket_size_mb=bucket_size_mb)
    return {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP}[variant](model)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _make_step(config: DDPBenchConfig, wrapped: nn.Module, optimizer: torch.optim.Optimizer, dtype: str,
               device: torch.device, rank: int, sync_end: _Stamp) -> Callable[[], dict[str, float]]:
    """One training step as a function returning the host (CPU) seconds each phase took to issue; ``sync_end``
    is recorded once the gradients are synchronised (for torch DDP, which waits inside backward: after it)."""
    local_batch = config.global_batch // config.world_size
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the global batch
    tokens = torch.randint(0, config.vocab_size, (local_batch, config.context_length + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B/n, T)
    autocast_dtype = DTYPES[dtype]
    finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)

    def step() -> dict[str, float]:
        t0 = time.perf_counter()
        with profiling.annotate("forward"), torch.autocast(
            device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None
        ):
            loss = cross_entropy(wrapped(inputs), targets)
        t1 = time.perf_counter()
        with profiling.annotate("backward"):
            loss.backward()
        t2 = time.perf_counter()
        with profiling.annotate("grad_sync"):
            finish()
        sync_end.record()
        t3 = time.perf_counter()
        with profiling.annotate("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "grad_sync": t3 - t2, "optimizer": t4 - t3}

    return step


@dataclass
class _Run:
    """One variant ready to train: the bare model, a step function, and the stamp it records at the end of
    gradient synchronisation."""

    model: nn.Module
    step: Callable[[], dict[str, float]]
    sync_end: _Stamp


def _build(config: DDPBenchConfig, variant: str, dtype: str, rank: int, device: torch.device) -> _Run:
    size = MODEL_SIZES[config.size]
    torch.manual_seed(rank)  # different weights per rank: the wrappers must broadcast rank 0's
    model = BasicsTransformerLM(
        config.vocab_size, config.context_length, size.d_model, size.num_layers, size.num_heads, size.d_ff,
        device=device,
    )
    wrapped = _wrap(variant, model, device, config.bucket_size_mb)
    optimizer = AdamW(model.parameters(), lr=config.lr)
    sync_end = _Stamp(device)
    return _Run(model, _make_step(config, wrapped, optimizer, dtype, device, rank, sync_end), sync_end)


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
        with profiling.annotate("warmup"):
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
        _sync(device)
        t0 = time.perf_counter()
        with profiling.annotate("step"):
            host.append(run.step())
        _sync(device)
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
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
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
        with profiling.annotate("warmup"):
            run.step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        with profiling.annotate("step"):
            run.step()
        _sync(device)
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


def _rank_main(rank: int, world_size: int, config: DDPBenchConfig, trace_dir: str, out_path: str) -> None:
    device = current_device()
    runs = [(dtype, variant) for dtype in config.dtypes for variant in config.variants]
    # Every variant is timed before any is profiled. When each variant was profiled right after its timed
    # steps, the variant timed next in the same process was 21-93 ms slower on the H200s, whichever it
    # was (writeup/results/ddp_bf16_repeats.jsonl, commit ee317fe); timed first, the difference is gone.
    rows = [_time_variant(config, variant, dtype, rank, device) for dtype, variant in runs]
    for row in rows:
        row["trace"] = f"{row['dtype']}_{row['variant']}.json"
        _trace_variant(config, row["variant"], row["dtype"], rank, device, Path(trace_dir) / row["trace"])
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlap of two sorted, disjoint span lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def is_comm_kernel(name: str) -> bool:
    return "nccl" in name.lower()


def comm_overlap(events: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """NCCL kernel time and the part of it with no compute kernel running, in ms, from one step's trace.

    Returns None values for a trace without GPU kernels (a CPU run).
    """
    acts = [a for a in profiling.gpu_activities(events) if a["dur"] > 0]
    if not acts:
        return {"comm_ms": None, "exposed_comm_ms": None, "gpu_span_ms": None}
    comm = _union([(a["ts"], a["ts"] + a["dur"]) for a in acts if is_comm_kernel(a["name"])])
    compute = _union([(a["ts"], a["ts"] + a["dur"]) for a in acts if not is_comm_kernel(a["name"])])
    span = max(a["ts"] + a["dur"] for a in acts) - min(a["ts"] for a in acts)
    return {
        "comm_ms": _length(comm) / 1e3,
        "exposed_comm_ms": (_length(comm) - _length(_intersection(comm, compute))) / 1e3,
        "gpu_span_ms": span / 1e3,
    }


def run_ddp_bench(config: DDPBenchConfig) -> list[dict[str, Any]]:
    """Benchmark every (dtype, variant) of ``config``; rows carry the config and the trace metrics.

    Under torchrun only rank 0 returns rows (the others return []). Traces stay in ``config.trace_dir``
    when it is given.
    """
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(config.trace_dir or tmp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        out = Path(tmp) / "rows.json"
        if not run_ranks(_rank_main, config.world_size, config, str(trace_dir), str(out),
                         backend=config.resolved_backend, timeout_s=600):
            return []
        rows = json.loads(out.read_text())
        for row in rows:
            row.update(comm_overlap(profiling.load_trace(trace_dir / row["trace"])))
    nocomm = {r["dtype"]: r["step_ms"] for r in rows if r["variant"] == "nocomm"}
    fields = {k: v for k, v in asdict(config).items() if k not in ("dtypes", "variants", "trace_dir")}
    fields["backend"] = config.resolved_backend
    for row in rows:
        base = nocomm.get(row["dtype"])
        row["overhead_ms"] = None if base is None else row["step_ms"] - base
        row["exposed_share"] = None if row["exposed_comm_ms"] is None else row["exposed_comm_ms"] / row["step_ms"]
        for tail in ("sync_tail", "comm_tail"):
            row[f"{tail}_share"] = None if row[f"{tail}_ms"] is None else row[f"{tail}_ms"] / row["step_ms"]
        row.update(fields)
    return rows


def _phase_spans(events: Sequence[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("ph") == "X" and e["name"] in STEP_PHASES:
            spans.setdefault(e["name"], []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return spans


def plot_timelines(traces: dict[str, Sequence[dict[str, Any]]], path: str | Path, title: str = "") -> Path:
    """One panel per trace (label -> events): CPU phase ranges, compute kernels coloured by the phase
    that launched them, and NCCL kernels, all on one time axis from the step's first event.

    On a CPU trace (no kernels) the panel shows the phases and the gloo collectives the CPU issued.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"forward": "tab:blue", "backward": "tab:orange", "grad_sync": "tab:red", "optimizer": "tab:green",
              "other": "tab:gray", "comm": "tab:purple"}
    fig, axes = plt.subplots(len(traces), 1, figsize=(13, 1.5 * len(traces) + 0.6), squeeze=False, sharex=True)
    for ax, (label, events) in zip(axes[:, 0], traces.items(), strict=True):
        phases = _phase_spans(events)
        acts = [a for a in profiling.gpu_activities(events) if a["dur"] > 0]
        if acts:
            profiling.label_activities(acts, events)
            compute = [a for a in acts if not is_comm_kernel(a["name"])]
            comm = [(a["ts"], a["dur"]) for a in acts if is_comm_kernel(a["name"])]
            rows = {"compute": compute}
        else:  # CPU: the collectives are CPU ops named after c10d's functions
            comm = [(float(e["ts"]), float(e["dur"])) for e in events if e.get("cat") == "cpu_op"
                    and any(k in e["name"] for k in ("allreduce", "all_reduce"))]
            rows = {}
        t0 = min([s for spans in phases.values() for s, _ in spans] + [a["ts"] for a in acts] + [s for s, _ in comm])
        for phase, spans in phases.items():
            ax.broken_barh([((s - t0) / 1e3, (e - s) / 1e3) for s, e in spans], (0.6, 0.8), color=colors[phase])
        for phase in (*STEP_PHASES, "other"):
            mine = [((a["ts"] - t0) / 1e3, a["dur"] / 1e3) for a in rows.get("compute", [])
                    if next((p for p in STEP_PHASES if p in a["ranges"]), "other") == phase]
            ax.broken_barh(mine, (1.6, 0.8), color=colors[phase])
        ax.broken_barh([((s - t0) / 1e3, d / 1e3) for s, d in comm], (2.6, 0.8), color=colors["comm"])
        ax.set_yticks([1, 2, 3], ["CPU phases", "GPU compute" if acts else "", "NCCL" if acts else "gloo calls"])
        ax.set_ylim(0.4, 3.6)
        ax.invert_yaxis()
        ax.set_title(label, fontsize=9, loc="left")
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time since the step's first event (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", ncol=len(colors), fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


DDP_COLUMNS = ("dtype", "variant", "bucket_size_mb", "step_ms", "step_max_ms", "overhead_ms", "comm_ms",
               "exposed_comm_ms", "exposed_share", "sync_tail_ms", "sync_tail_share", "comm_tail_ms",
               "comm_tail_share", "host_backward_ms", "peak_mem_gib", "params_in_sync", "commit")
DDP_HEADERS = ("dtype", "wrapper", "bucket (MiB)", "median step (ms)", "slowest step (ms)", "vs no-comm step (ms)",
               "NCCL kernels (ms)", "NCCL not overlapped (ms)", "not overlapped / step", "sync after backward (ms)",
               "sync after backward / step", "comm after last rank's backward (ms)",
               "comm after last rank's backward / step", "backward host time (ms)", "peak memory (GiB)",
               "replicas equal", "commit")


def ddp_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The DDP rows as a markdown table, one line per (dtype, wrapper) in run order."""
    return markdown_table(rows, DDP_COLUMNS, DDP_HEADERS, floatfmt=".3g")


def collectives_markdown(rows: Sequence[dict[str, Any]], op: str = "all_reduce") -> str:
    """Bus bandwidth (GB/s) and time (ms) of ``op``: one line per (backend, world size), one column per size.

    Sizes are matched by their label (3 significant digits), since each run rounds the size down to a
    multiple of its world size.
    """
    chosen = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])
    labels = list(dict.fromkeys(_size_label(r["bytes"]) for r in chosen))
    lines = []
    for backend, ws in sorted({(r["backend"], r["world_size"]) for r in chosen}):
        line: dict[str, Any] = {"backend": backend, "world_size": ws}
        for r in chosen:
            if (r["backend"], r["world_size"]) == (backend, ws):
                line[_size_label(r["bytes"])] = f"{r['busbw_gbps']:.3g} GB/s, {r['time_ms']:.3g} ms"
        lines.append(line)
    return markdown_table(lines, ["backend", "world_size", *labels], ["backend", "ranks", *labels])


def _size_label(nbytes: int) -> str:
    mib = nbytes / 2**20
    return f"{mib / 1024:.3g} GiB" if mib >= 1024 else f"{mib:.3g} MiB"


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
        ): profiling.load_trace(Path(trace_dir) / r["trace"])
        for r in chosen
    }
    r0 = chosen[0]
    title = (f"{r0['size']}, context {r0['context_length']}, global batch {r0['global_batch']}, "
             f"{r0['world_size']} ranks ({r0['backend']}), {dtype}: one profiled step on rank 0")
    return plot_timelines(traces, path, title)


__all__ = ["DistributedRunConfig", "DDPBenchConfig", "VARIANTS", "run_ddp_bench", "comm_overlap", "plot_timelines",
           "ddp_markdown",
           "collectives_markdown", "timeline_figure_from_rows"]
