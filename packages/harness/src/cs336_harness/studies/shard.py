"""Memory and step time of sharded data-parallel training: DDP, ZeRO-1, our FSDP and torch's FSDP2.

Every rank builds the training step of the same ``BasicsTransformerLM`` (torch SDPA attention; :func:`train_config`,
composed by :func:`cs336_harness.training.build_training`), trains on its ``global_batch / world_size`` sequences with
fused ``torch.optim.AdamW``, and one of:

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
  with compute (:func:`cs336_harness.analysis.trace.comm_overlap`); for ``fsdp`` also, per forward unit of
  communication (a Transformer block, the embedding, the LM head), whether its all-gather finished before
  the compute stream reached the unit (:func:`forward_gathers`).

:func:`plot_fsdp_timeline` renders the traced ``fsdp`` step. On CPU it uses gloo and the ``tiny`` preset;
memory columns are then empty (no allocator statistics) and the timeline shows CPU ranges.
Run it as ``uv run cs336 shard`` (``--help``).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from cs336_comms.process_group import current_device, run_ranks
from torch.distributed.tensor import DTensor

from cs336_harness import instrument, registry
from cs336_harness.analysis import figures, trace
from cs336_harness.analysis.tables import markdown_table
from cs336_harness.device import GIB, sync
from cs336_harness.progress import progress_bar
from cs336_harness.studies.distributed import DistributedRunConfig, trace_folder
from cs336_harness.train_config import OptimizerConfig, Parallelism, TrainConfig
from cs336_harness.training import Training, build_training

VARIANTS: tuple[str, ...] = ("ddp", "zero1", "fsdp", "fsdp2")
PROFILED: tuple[str, ...] = ("fsdp", "fsdp2")


@dataclass(frozen=True)
class ShardBenchConfig(DistributedRunConfig):
    VARIANTS: ClassVar[tuple[str, ...]] = VARIANTS
    MIN_WARMUP: ClassVar[int] = 1  # so the measured step already has optimizer state

    dtypes: tuple[str, ...] = ("fp32", "bf16")


# The wrapper of each variant (cs336_harness.train_config.Parallelism).
WRAPPER_OF: dict[str, str] = {"ddp": "torch_ddp", "zero1": "zero1", "fsdp": "fsdp", "fsdp2": "fsdp2"}


def fused_torch_adamw(params: Iterable[nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """``torch.optim.AdamW(fused=True)`` on any device: every variant's optimizer (ZeRO-1 shards its state)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)


def train_config(config: ShardBenchConfig, variant: str, dtype: str) -> TrainConfig:
    """The step ``variant`` runs: SDPA attention, the variant's wrapper with ``dtype`` as its compute dtype (autocast
    for DDP and ZeRO-1), fused torch AdamW."""
    return TrainConfig(
        config.model_config, kernels=registry.kernels("sdpa"),
        parallelism=Parallelism(world_size=config.world_size, backend=config.resolved_backend, compute_dtype=dtype,
                                wrapper=WRAPPER_OF[variant]),
        optimizer=OptimizerConfig(fused_torch_adamw, lr=config.lr), global_batch=config.global_batch)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _breakdown(training: Training) -> dict[str, float]:
    """This rank's parameter, gradient and optimizer-state bytes, from the tensors themselves."""
    params = list({id(p): p for p in training.model.parameters()}.values())
    state = [v for s in training.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "params_gib": sum(_local_bytes(p) for p in params) / GIB,
        "grads_gib": sum(_local_bytes(p.grad) for p in params if p.grad is not None) / GIB,
        "optim_state_gib": sum(_local_bytes(v) for v in state) / GIB,
    }


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
    training = build_training(train_config(config, variant, dtype), device)
    sync(device)
    row: dict[str, Any] = {"variant": variant, "dtype": dtype, "alloc_before_gib": alloc_before,
                           "peak_init_gib": memory.peak(), "alloc_init_gib": memory.allocated()}
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the global batch
    tokens = torch.randint(0, config.vocab_size, (config.global_batch // config.world_size,
                                                  config.context_length + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B/n, T)

    def forward() -> torch.Tensor:
        with instrument.annotate("forward"):
            return training.forward(inputs, targets)

    def backward(loss: torch.Tensor) -> None:
        with instrument.annotate("backward"):
            loss.backward()
        with instrument.annotate("grad_sync"):
            training.finish_sync()

    def optimizer_step() -> None:
        with instrument.annotate("optimizer"):
            training.optimizer_step()

    def step() -> None:
        with instrument.annotate("step"):
            backward(forward())
            optimizer_step()

    for _ in range(config.warmup):
        step()
    times = []
    for _ in range(config.steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)

    memory.reset_peak()
    before_forward = memory.allocated()
    loss = forward()
    sync(device)
    after_forward = memory.allocated()
    backward(loss)
    del loss
    row["peak_before_step_gib"] = memory.peak()
    row.update(_breakdown(training))
    row["activations_gib"] = None if after_forward is None else after_forward - before_forward
    memory.reset_peak()
    optimizer_step()
    row["peak_step_gib"] = memory.peak()

    if variant in PROFILED:
        sync(device)
        with instrument.profile(device) as prof:
            step()
            sync(device)
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


def _finish(row: dict[str, Any], config: ShardBenchConfig, traces: Path) -> dict[str, Any]:
    """Rank 0's row of one run with its trace's metrics and the config's fields."""
    if "trace" in row:
        events = trace.load_trace(traces / row["trace"])
        row.update(trace.comm_overlap(events))
        if row["variant"] == "fsdp":
            row.update(trace.gather_summary(events))
    row.update({k: v for k, v in asdict(config).items() if k not in ("dtypes", "variants")},
               backend=config.resolved_backend, attention="sdpa", optimizer="torch AdamW (fused)")
    return row


def _rank_main(rank: int, world_size: int, config: ShardBenchConfig, trace_dir: str, progress: bool,
               write: Callable[[list[dict[str, Any]]], Any] | None) -> list[dict[str, Any]]:
    device = current_device()
    runs = [(dtype, variant) for dtype in config.dtypes for variant in config.variants]
    bar = progress_bar(total=len(runs), desc="shard", enabled=progress and rank == 0, unit="run")
    rows = []
    for dtype, variant in runs:
        bar.set_postfix_str(f"{dtype} {variant}")
        # Each variant starts from an empty device: the previous one's tensors died with its frame
        # (gc.collect for reference cycles), and its cached blocks go back to the driver.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row = _bench_one(variant, dtype, config, rank, device, Path(trace_dir) / f"shard_{dtype}_{variant}.json")
        if rank == 0:
            rows.append(_finish(row, config, Path(trace_dir)))
            if write:
                write(rows[-1:])
        bar.update()
    bar.close()
    return rows


def run_shard_bench(config: ShardBenchConfig, trace_dir: str | Path | None = None, progress: bool = False,
                    write: Callable[[list[dict[str, Any]]], Any] | None = None) -> list[dict[str, Any]]:
    """Benchmark every (dtype, variant) of ``config``; rows carry the config and the trace metrics.

    Under torchrun only rank 0 returns rows (the others return []). Traces are kept in ``trace_dir``
    when it is given. With ``progress``, rank 0 shows a bar on stderr: runs done, and which is running.
    ``write`` (a picklable callable, e.g. a :class:`~cs336_harness.results.RowWriter`) gets each run's row on
    rank 0 as soon as the run finishes.
    """
    with trace_folder(trace_dir) as traces:
        rows = run_ranks(_rank_main, config.world_size, config, str(traces), progress, write,
                         backend=config.resolved_backend, timeout_s=600)
    return rows or []


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
    return figures.plot_fsdp_timeline(trace.load_trace(Path(trace_dir) / r["trace"]), path, title)


# Tables for the writeup, generated from the rows.

MEMORY_COLUMNS = ("dtype", "variant", "alloc_before_gib", "peak_init_gib", "peak_before_step_gib", "peak_step_gib",
                  "params_gib", "grads_gib", "optim_state_gib", "activations_gib")
MEMORY_HEADERS = ("dtype", "wrapper", "allocated at start", "peak at init", "peak fwd+bwd (before step)",
                  "peak in step", "params", "grads", "optimizer state", "activations")


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
    return markdown_table(rows, list(zip(MEMORY_COLUMNS, MEMORY_HEADERS, strict=True)), floatfmt=".2f")


def time_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Step time, its ratio to FSDP2 of the same dtype, and communication overlap, one line per run."""
    return markdown_table(_with_ratios(rows), list(zip(TIME_COLUMNS, TIME_HEADERS, strict=True)), floatfmt=".3g")


def writeup_tables(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The section's tables by marker name (``<!-- table:NAME -->``, see
    :func:`cs336_harness.analysis.tables.fill_tables`)."""
    return {"shard_memory": memory_markdown(rows), "shard_time": time_markdown(rows)}


