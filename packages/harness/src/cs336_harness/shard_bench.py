"""Memory and step time of sharded data-parallel training: DDP, ZeRO-1, our FSDP and torch's FSDP2.

Every rank builds the same ``BasicsTransformerLM`` (torch SDPA attention), trains on its
``global_batch / world_size`` sequences with fused ``torch.optim.AdamW``, and one of:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (full parameters, gradients, optimizer state);
- ``zero1``: the same DDP with :class:`cs336_sharding.optimizer.ShardedOptimizer` (state sharded);
- ``fsdp``: :class:`cs336_sharding.fsdp.FSDP` (weights, gradients and state sharded);
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` per Transformer block and on the root, the baseline.

``bf16`` means autocast for ``ddp`` / ``zero1``, ``compute_dtype=bfloat16`` for ``fsdp`` and
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` for ``fsdp2``: bf16 compute with
fp32 master weights and fp32 gradient reduction in all four.

Measured per (dtype, variant), the maximum over ranks:

- ``alloc_before_gib``: allocated when the variant starts, after the previous one was freed and the
  allocator's cache emptied (zero but for a leak; its peaks are then measured from a clean device).
- ``peak_init_gib``: peak allocated while building model, wrapper and optimizer (FSDP builds the full
  model before sharding it, so this includes one full fp32 copy); ``alloc_init_gib`` what stays.
- ``peak_before_step_gib``: peak during forward, backward and gradient synchronisation of a step taken
  after warm-up (optimizer state exists); ``peak_step_gib``: peak during ``optimizer.step()``.
- the breakdown at the moment before the optimizer step, from tensor sizes: ``params_gib``, ``grads_gib``
  and ``optim_state_gib`` (this rank's local tensors), and ``activations_gib``, the growth of allocated
  memory across the forward (what autograd saved, plus logits and loss).
- ``step_ms``: median wall time of ``steps`` whole steps, devices synchronised around each.
- for the profiled variants (``fsdp``, ``fsdp2``): NCCL kernel time and the part of it not overlapped
  with compute (:func:`cs336_harness.ddp_bench.comm_overlap`); for ``fsdp`` also, per forward unit of
  communication (a Transformer block, the embedding, the LM head), whether its all-gather finished before
  the compute stream reached the unit (:func:`forward_gathers`).

:func:`plot_fsdp_timeline` renders the traced ``fsdp`` step. On CPU it uses gloo and the ``tiny`` preset;
memory columns are then empty (no allocator statistics) and the timeline shows CPU ranges.
Run it as ``uv run cs336 shard`` (``--help``).
"""

from __future__ import annotations

import contextlib
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
from cs336_comms.process_group import current_device, run_ranks
from cs336_sharding.fsdp import FSDP
from cs336_sharding.optimizer import ShardedOptimizer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from cs336_harness import profiling
from cs336_harness.attention_impls import use_attention
from cs336_harness.ddp_bench import DTYPES, DistributedRunConfig, comm_overlap, is_comm_kernel
from cs336_harness.presets import MODEL_SIZES
from cs336_harness.results import markdown_table

VARIANTS: tuple[str, ...] = ("ddp", "zero1", "fsdp", "fsdp2")
PROFILED: tuple[str, ...] = ("fsdp", "fsdp2")
GIB = 2**30


@dataclass(frozen=True)
class ShardBenchConfig(DistributedRunConfig):
    VARIANTS: ClassVar[tuple[str, ...]] = VARIANTS
    MIN_WARMUP: ClassVar[int] = 1  # so the measured step already has optimizer state

    dtypes: tuple[str, ...] = ("fp32", "bf16")


@dataclass
class _Setup:
    model: nn.Module  # what the step calls
    optimizer: torch.optim.Optimizer
    finish: Callable[[], None]  # gradient synchronisation after backward
    autocast: torch.dtype | None


def _build(variant: str, dtype: str, config: ShardBenchConfig, device: torch.device) -> _Setup:
    size = MODEL_SIZES[config.size]
    torch.manual_seed(0)
    model = BasicsTransformerLM(
        config.vocab_size, config.context_length, size.d_model, size.num_layers, size.num_heads, size.d_ff,
        device=device,
    )
    compute = DTYPES[dtype]
    adamw = {"lr": config.lr, "fused": True}
    if variant in ("ddp", "zero1"):
        device_ids = [device.index] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        optimizer = (torch.optim.AdamW(model.parameters(), **adamw) if variant == "ddp"
                     else ShardedOptimizer(model.parameters(), torch.optim.AdamW, **adamw))
        return _Setup(wrapped, optimizer, lambda: None, compute)
    if variant == "fsdp":
        fsdp = FSDP(model, compute_dtype=compute)
        return _Setup(fsdp, torch.optim.AdamW(fsdp.parameters(), **adamw), fsdp.finish_gradient_synchronization,
                      None)
    mesh = init_device_mesh(device.type, (config.world_size,))
    policy = MixedPrecisionPolicy() if compute is None else MixedPrecisionPolicy(compute, torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return _Setup(model, torch.optim.AdamW(model.parameters(), **adamw), lambda: None, None)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _breakdown(setup: _Setup) -> dict[str, float]:
    """This rank's parameter, gradient and optimizer-state bytes, from the tensors themselves."""
    params = list({id(p): p for p in setup.model.parameters()}.values())
    state = [v for s in setup.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "params_gib": sum(_local_bytes(p) for p in params) / GIB,
        "grads_gib": sum(_local_bytes(p.grad) for p in params if p.grad is not None) / GIB,
        "optim_state_gib": sum(_local_bytes(v) for v in state) / GIB,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Memory:
    """Allocator statistics on CUDA; None on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / GIB if self.cuda else None

    def allocated(self) -> float | None:
        return torch.cuda.memory_allocated(self.device) / GIB if self.cuda else None


def _bench_one(variant: str, dtype: str, config: ShardBenchConfig, rank: int, device: torch.device,
               trace_path: Path) -> dict[str, Any]:
    memory = _Memory(device)
    memory.reset_peak()
    alloc_before = memory.allocated()
    setup = _build(variant, dtype, config, device)
    _sync(device)
    row: dict[str, Any] = {"variant": variant, "dtype": dtype, "alloc_before_gib": alloc_before,
                           "peak_init_gib": memory.peak(), "alloc_init_gib": memory.allocated()}
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the global batch
    tokens = torch.randint(0, config.vocab_size, (config.global_batch // config.world_size,
                                                  config.context_length + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B/n, T)

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=setup.autocast or torch.float32, enabled=setup.autocast is not None)

    def forward() -> torch.Tensor:
        with profiling.annotate("forward"), autocast():
            return cross_entropy(setup.model(inputs), targets)

    def backward(loss: torch.Tensor) -> None:
        with profiling.annotate("backward"):
            loss.backward()
        with profiling.annotate("grad_sync"):
            setup.finish()

    def optimizer_step() -> None:
        with profiling.annotate("optimizer"):
            setup.optimizer.step()
            setup.optimizer.zero_grad(set_to_none=True)

    def step() -> None:
        with profiling.annotate("step"):
            backward(forward())
            optimizer_step()

    for _ in range(config.warmup):
        step()
    times = []
    for _ in range(config.steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)

    memory.reset_peak()
    before_forward = memory.allocated()
    loss = forward()
    _sync(device)
    after_forward = memory.allocated()
    backward(loss)
    del loss
    row["peak_before_step_gib"] = memory.peak()
    row.update(_breakdown(setup))
    row["activations_gib"] = None if after_forward is None else after_forward - before_forward
    memory.reset_peak()
    optimizer_step()
    row["peak_step_gib"] = memory.peak()

    if variant in PROFILED:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        _sync(device)
        with torch.profiler.profile(activities=activities) as prof:
            step()
            _sync(device)
        if rank == 0:
            prof.export_chrome_trace(str(trace_path))
            row["trace"] = trace_path.name
        del prof

    # The slowest rank sets the pace and the fullest rank the memory limit: report the maximum over ranks.
    keys = ["step_ms", "step_max_ms"] + [k for k, v in row.items() if k.endswith("_gib") and v is not None]
    values = {"step_ms": statistics.median(times) * 1e3, "step_max_ms": max(times) * 1e3}
    packed = torch.tensor([values.get(k, row.get(k)) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    row.update(dict(zip(keys, packed.tolist(), strict=True)))
    return row


def _rank_main(rank: int, world_size: int, config: ShardBenchConfig, trace_dir: str, out_path: str) -> None:
    device = current_device()
    rows = []
    with use_attention("sdpa"):
        for dtype in config.dtypes:
            for variant in config.variants:
                # Each variant starts from an empty device: the previous one's tensors died with its frame
                # (gc.collect for reference cycles), and its cached blocks go back to the driver.
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append(_bench_one(variant, dtype, config, rank, device,
                                       Path(trace_dir) / f"shard_{dtype}_{variant}.json"))
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))


# Trace analysis: our FSDP labels each unit's forward compute with "fsdp.forward.<unit>" (opened after the
# weights are ready on the CPU side) and each collective launch with "fsdp.all_gather.<unit>" /
# "fsdp.reduce_scatter.<unit>", so kernels can be tied to the unit they serve; a unit is named by its
# module ("layers.3") or, when it holds one weight, by that weight ("lm_head.weight").

_FORWARD = "fsdp.forward."
_GATHER = "fsdp.all_gather."


def _labelled_kernels(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    acts = [a for a in profiling.gpu_activities(events) if a["dur"] > 0]
    profiling.label_activities(acts, events)
    return sorted(acts, key=lambda a: a["ts"])


def _first_with(acts: Sequence[dict[str, Any]], prefix: str) -> dict[str, dict[str, Any]]:
    """The first kernel launched inside a range named ``prefix + <param>``, by param."""
    out: dict[str, dict[str, Any]] = {}
    for a in acts:
        for r in a["ranges"]:
            if r.startswith(prefix) and r[len(prefix):] not in out:
                out[r[len(prefix):]] = a
    return out


def forward_gathers(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per unit of communication, in forward order: when its all-gather ended and when the compute stream was
    free to run the unit (the end of the last compute kernel that started before the unit's first kernel).

    ``margin_ms`` > 0: the weights were there before the unit could start; < 0: the unit waited that long.
    Empty for a trace without GPU kernels.
    """
    acts = _labelled_kernels(events)
    compute = [a for a in acts if not is_comm_kernel(a["name"])]
    gathers = _first_with([a for a in acts if is_comm_kernel(a["name"])], _GATHER)
    layers = _first_with(compute, _FORWARD)
    out = []
    for name, first in sorted(layers.items(), key=lambda kv: kv[1]["ts"]):
        if name not in gathers:
            continue
        ag = gathers[name]
        free_at = max((a["ts"] + a["dur"] for a in compute if a["ts"] < first["ts"]), default=first["ts"])
        ag_end = ag["ts"] + ag["dur"]
        out.append({"param": name, "gather_ms": ag["dur"] / 1e3, "margin_ms": (free_at - ag_end) / 1e3,
                    "gather_end": ag_end, "layer_start": first["ts"]})
    return out


def gather_summary(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts and waiting time over :func:`forward_gathers`; None values for a CPU trace."""
    gathers = forward_gathers(events)
    if not gathers:
        return {"fwd_gathers": None, "fwd_gathers_in_time": None, "fwd_gather_wait_ms": None}
    return {
        "fwd_gathers": len(gathers),
        "fwd_gathers_in_time": sum(g["margin_ms"] >= 0 for g in gathers),
        "fwd_gather_wait_ms": sum(-g["margin_ms"] for g in gathers if g["margin_ms"] < 0),
    }


def run_shard_bench(config: ShardBenchConfig, trace_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Benchmark every (dtype, variant) of ``config``; rows carry the config and the trace metrics.

    Under torchrun only rank 0 returns rows (the others return []). Traces are kept in ``trace_dir``
    when it is given.
    """
    with tempfile.TemporaryDirectory() as tmp:
        traces = Path(trace_dir or tmp)
        traces.mkdir(parents=True, exist_ok=True)
        out = Path(tmp) / "rows.json"
        if not run_ranks(_rank_main, config.world_size, config, str(traces), str(out),
                         backend=config.resolved_backend, timeout_s=600):
            return []
        rows = json.loads(out.read_text())
        for row in rows:
            if "trace" in row:
                events = profiling.load_trace(traces / row["trace"])
                row.update(comm_overlap(events))
                if row["variant"] == "fsdp":
                    row.update(gather_summary(events))
    fields = {k: v for k, v in asdict(config).items() if k not in ("dtypes", "variants")}
    fields.update(backend=config.resolved_backend, attention="sdpa", optimizer="torch AdamW (fused)")
    for row in rows:
        row.update(fields)
    return rows


def plot_fsdp_timeline(events: Sequence[dict[str, Any]], path: str | Path, title: str = "",
                       zoom_layers: int = 16) -> Path:
    """Two panels from one traced FSDP step: the whole step (compute kernels by phase, NCCL all-gathers,
    other NCCL kernels), and the first ``zoom_layers`` forward units, where each unit's all-gather and its
    compute share a colour, so a gather that ends after its unit starts shows at a glance.

    A CPU trace (no kernels) shows the CPU ranges instead: forward layers and gather launches.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acts = _labelled_kernels(events)
    gpu = bool(acts)
    if gpu:
        compute = [a for a in acts if not is_comm_kernel(a["name"])]
        comm = [a for a in acts if is_comm_kernel(a["name"])]
        spans = {
            "forward": [a for a in compute if "forward" in a["ranges"]],
            "backward": [a for a in compute if "backward" in a["ranges"] or "grad_sync" in a["ranges"]],
            "optimizer": [a for a in compute if "optimizer" in a["ranges"]],
            "all-gather": [a for a in comm if "allgather" in a["name"].lower()],
            "reduce-scatter / all-reduce": [a for a in comm if "allgather" not in a["name"].lower()],
        }
        bars = {k: [(a["ts"], a["dur"]) for a in v] for k, v in spans.items()}
    else:
        ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
        pick = lambda pred: [(float(e["ts"]), float(e["dur"])) for e in ranges if pred(e["name"])]  # noqa: E731
        bars = {"forward": pick(lambda n: n.startswith(_FORWARD)), "backward": pick(lambda n: n == "backward"),
                "optimizer": pick(lambda n: n == "optimizer"), "all-gather": pick(lambda n: n.startswith(_GATHER)),
                "reduce-scatter / all-reduce": pick(lambda n: n.startswith("fsdp.reduce_scatter."))}
    t0 = min(s for v in bars.values() for s, _ in v)
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green",
              "all-gather": "tab:purple", "reduce-scatter / all-reduce": "tab:red"}
    lanes = {"forward": 0, "backward": 0, "optimizer": 0, "all-gather": 1, "reduce-scatter / all-reduce": 2}
    fig, (top, zoom) = plt.subplots(2, 1, figsize=(13, 5.5))
    for name, spans in bars.items():
        top.broken_barh([((s - t0) / 1e3, d / 1e3) for s, d in spans], (lanes[name] - 0.4, 0.8),
                        color=colors[name], label=name)
    top.set_yticks([0, 1, 2], ["compute" if gpu else "CPU ranges", "all-gather", "other collectives"])
    top.invert_yaxis()
    top.legend(loc="upper right", fontsize=8, ncol=5)
    top.set_xlabel("ms since the step's first event")
    top.grid(True, axis="x", alpha=0.3)

    gathers = forward_gathers(events)[:zoom_layers]
    if gathers:
        z0 = min(g["gather_end"] - g["gather_ms"] * 1e3 for g in gathers)
        cmap = plt.get_cmap("tab10")
        layer_spans = _layer_spans(compute, [g["param"] for g in gathers])
        for i, g in enumerate(gathers):
            c = cmap(i % 10)
            zoom.broken_barh([((g["gather_end"] - g["gather_ms"] * 1e3 - z0) / 1e3, g["gather_ms"])], (0.6, 0.8),
                             color=c)
            start, end = layer_spans[g["param"]]
            zoom.broken_barh([((start - z0) / 1e3, (end - start) / 1e3)], (-0.4, 0.8), color=c)
            zoom.text((start - z0) / 1e3, -0.55, g["param"].replace(".weight", ""), fontsize=6, rotation=30)
        waited = sum(g["margin_ms"] < 0 for g in gathers)
        zoom.set_title(f"first {len(gathers)} forward units: gather (row 2) and the unit's compute (row 1) in "
                       f"one colour; {waited} of them had to wait", fontsize=9, loc="left")
        zoom.set_yticks([0, 1], ["unit compute", "its all-gather"])
        zoom.invert_yaxis()
        zoom.set_xlabel("ms since the first of these gathers started")
        zoom.grid(True, axis="x", alpha=0.3)
    else:
        zoom.set_axis_off()
        zoom.text(0.01, 0.5, "no GPU kernels in this trace (CPU run): per-layer gather timing needs a GPU",
                  fontsize=9)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _layer_spans(compute: Sequence[dict[str, Any]], params: Sequence[str]) -> dict[str, tuple[float, float]]:
    """First start and last end of the compute kernels launched inside each unit's forward range."""
    out: dict[str, tuple[float, float]] = {}
    for p in params:
        mine = [a for a in compute if _FORWARD + p in a["ranges"]]
        out[p] = (mine[0]["ts"], max(a["ts"] + a["dur"] for a in mine))
    return out


def fsdp_timeline_from_rows(rows: Sequence[dict[str, Any]], trace_dir: str | Path, dtype: str,
                            path: str | Path) -> Path:
    """:func:`plot_fsdp_timeline` of the ``fsdp`` row of ``dtype``, from its trace in ``trace_dir``."""
    chosen = [r for r in rows if r["dtype"] == dtype and r["variant"] == "fsdp" and "trace" in r]
    if not chosen:
        raise ValueError(f"no traced fsdp row with dtype {dtype!r}")
    r = chosen[0]
    title = (f"our FSDP, {r['size']}, context {r['context_length']}, global batch {r['global_batch']}, "
             f"{r['world_size']} ranks ({r['backend']}), {dtype}: one profiled step on rank 0, "
             f"step {r['step_ms']:.0f} ms")
    return plot_fsdp_timeline(profiling.load_trace(Path(trace_dir) / r["trace"]), path, title)


# Tables for the writeup, generated from the rows.

MEMORY_COLUMNS = ("dtype", "variant", "alloc_before_gib", "peak_init_gib", "peak_before_step_gib", "peak_step_gib",
                  "params_gib", "grads_gib", "optim_state_gib", "activations_gib")
MEMORY_HEADERS = ("dtype", "wrapper", "allocated at start", "peak at init", "peak fwd+bwd (before step)",
                  "peak in step", "params", "grads", "optimizer state", "activations")
NET_COLUMNS = ("dtype", "variant", "carried_gib", "net_peak_before_step_gib", "net_peak_step_gib")
NET_HEADERS = ("dtype", "wrapper", "allocated beyond own state at init", "net peak fwd+bwd", "net peak in step")


def _measured_from_clean_start(row: dict[str, Any]) -> bool:
    """Rows made since each variant records what was allocated when it started (``alloc_before_gib``). Older
    rows were measured in one process after runs of an FSDP that leaked its shards."""
    return "alloc_before_gib" in row


def _net(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Peaks less what was allocated before the run started, estimated for rows that did not record it:
    ``alloc_init_gib`` minus what the wrapper itself keeps after init (its parameters, and for torch DDP its
    gradient buckets, one more copy of them)."""
    out = []
    for r in rows:
        r = dict(r)
        own = r["params_gib"] * (2 if r["variant"] in ("ddp", "zero1") else 1)
        if r.get("alloc_init_gib") is not None:
            r["carried_gib"] = r["alloc_init_gib"] - own
            r["net_peak_before_step_gib"] = r["peak_before_step_gib"] - r["carried_gib"]
            r["net_peak_step_gib"] = r["peak_step_gib"] - r["carried_gib"]
        out.append(r)
    return out
TIME_COLUMNS = ("dtype", "variant", "step_ms", "vs_fsdp2", "comm_ms", "exposed_comm_ms", "fwd_gathers_in_time",
                "fwd_gather_wait_ms")
TIME_HEADERS = ("dtype", "wrapper", "step (ms)", "step / FSDP2 step", "NCCL kernels (ms)",
                "NCCL not overlapped (ms)", "forward gathers in time", "forward wait on gathers (ms)")


def _with_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    fsdp2 = {r["dtype"]: r["step_ms"] for r in rows if r["variant"] == "fsdp2"}
    out = []
    for r in rows:
        r = dict(r)
        base = fsdp2.get(r["dtype"])
        r["vs_fsdp2"] = None if base is None else r["step_ms"] / base
        if r.get("fwd_gathers") is not None:
            r["fwd_gathers_in_time"] = f"{r['fwd_gathers_in_time']} / {r['fwd_gathers']}"
        out.append(r)
    return out


def memory_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Peak memory per phase and the breakdown before the step (GiB per GPU), one line per run."""
    return markdown_table(rows, MEMORY_COLUMNS, MEMORY_HEADERS, floatfmt=".2f")


def net_memory_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Memory held before each run started (left by earlier runs in the process) and the peaks without it;
    only needed for rows that predate ``alloc_before_gib``."""
    return markdown_table(_net(rows), NET_COLUMNS, NET_HEADERS, floatfmt=".2f")


def time_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Step time, its ratio to FSDP2 of the same dtype, and communication overlap, one line per run."""
    return markdown_table(_with_ratios(rows), TIME_COLUMNS, TIME_HEADERS, floatfmt=".3g")


def writeup_tables(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The section's tables by marker name (``<!-- table:NAME -->``, see ``cs336_harness.report.fill_tables``).

    The leak-corrected ``shard_net_memory`` table is only made for rows that predate clean starts; rows
    measured from a clean device need no correction.
    """
    tables = {"shard_memory": memory_markdown(rows), "shard_time": time_markdown(rows)}
    leaky = [r for r in rows if not _measured_from_clean_start(r)]
    if leaky:
        tables["shard_net_memory"] = net_memory_markdown(leaky)
    return tables


__all__ = ["ShardBenchConfig", "VARIANTS", "run_shard_bench", "forward_gathers", "gather_summary",
           "plot_fsdp_timeline", "fsdp_timeline_from_rows", "memory_markdown", "net_memory_markdown", "time_markdown",
           "writeup_tables"]
