"""Benchmark all-reduce, reduce-scatter and all-gather: time, algorithm bandwidth and bus bandwidth.

Sizes are those of the full float32 tensor (nccl-tests' convention): the all-reduce buffer, the
reduce-scatter input and the all-gather output; each rank's shard is ``size / world_size``.
Bandwidths follow nccl-tests' definitions (docs/PERFORMANCE.md in NVIDIA/nccl-tests):

    algbw = size / time
    busbw = algbw * 2 (n - 1) / n      all-reduce (a ring sends each byte 2 (n - 1) / n times)
    busbw = algbw * (n - 1) / n        reduce-scatter and all-gather

busbw is comparable across world sizes and with the link's peak; at ``n = 1`` it is zero.

Each rank times every call on its own (CUDA events on the current stream under NCCL, a wall clock
under gloo) after a barrier, takes the median, and the reported time is the slowest rank's median,
since a collective is done only when every rank is done.

    from cs336_comms.collectives import run_collectives
    rows = run_collectives(world_size=2, backend="gloo", sizes_bytes=[2**20])   # spawns the ranks

The same call works under torchrun (``torchrun --nproc-per-node 2 script.py``): rank 0 gets the rows.
``cs336 collectives --plot`` (in cs336-harness) draws them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cs336_comms.process_group import run_ranks

OPS: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather")
DEFAULT_SIZES_BYTES: tuple[int, ...] = (2**20, 10 * 2**20, 100 * 2**20, 2**30)
_BYTES_PER_ELEMENT = 4  # float32


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for ``op`` at ``world_size`` ranks."""
    if op == "all_reduce":
        return 2 * (world_size - 1) / world_size
    if op in ("reduce_scatter", "all_gather"):
        return (world_size - 1) / world_size
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _make_call(op: str, numel: int, world_size: int, device: torch.device) -> Callable[[], None]:
    shard = numel // world_size
    if op == "all_reduce":
        buf = torch.rand(numel, device=device)
        return lambda: dist.all_reduce(buf)
    if op == "reduce_scatter":
        full, out = torch.rand(numel, device=device), torch.empty(shard, device=device)
        return lambda: dist.reduce_scatter_tensor(out, full)
    if op == "all_gather":
        full, part = torch.empty(numel, device=device), torch.rand(shard, device=device)
        return lambda: dist.all_gather_into_tensor(full, part)
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _time_calls(call: Callable[[], None], iters: int, device: torch.device) -> list[float]:
    """Seconds per call, each measured separately after a barrier."""
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return times


def benchmark_collectives(
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    ops: Sequence[str] = OPS,
    warmup: int = 5,
    iters: int = 20,
) -> list[dict[str, Any]]:
    """Time each op at each size in the current process group; every rank returns the same rows.

    Each size is rounded down to a multiple of ``4 * world_size`` bytes so every rank's shard is
    whole; ``bytes`` in the rows is the size actually moved.
    """
    if not dist.is_initialized():
        raise RuntimeError("benchmark_collectives needs an initialized process group")
    for op in ops:
        bus_factor(op, 1)
    if warmup < 0 or iters < 1:
        raise ValueError(f"need warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")
    world_size, backend = dist.get_world_size(), dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    rows = []
    for size in sizes_bytes:
        numel = size // _BYTES_PER_ELEMENT // world_size * world_size
        if numel == 0:
            raise ValueError(f"size {size} B is smaller than one float32 per rank at world size {world_size}")
        nbytes = numel * _BYTES_PER_ELEMENT
        for op in ops:
            call = _make_call(op, numel, world_size, device)
            for _ in range(warmup):
                call()
            median = statistics.median(_time_calls(call, iters, device))
            slowest = torch.tensor(median, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            t = float(slowest)
            algbw = nbytes / t / 1e9
            rows.append({
                "op": op, "backend": backend, "world_size": world_size, "bytes": nbytes,
                "size_mb": nbytes / 2**20, "time_ms": t * 1e3, "algbw_gbps": algbw,
                "busbw_gbps": algbw * bus_factor(op, world_size), "iters": iters, "warmup": warmup,
            })
            del call
    return rows


def _rank_main(rank: int, world_size: int, sizes: list[int], ops: list[str], warmup: int,
               iters: int) -> list[dict[str, Any]]:
    return benchmark_collectives(sizes, ops, warmup, iters)


def run_collectives(
    world_size: int,
    backend: str,
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    ops: Sequence[str] = OPS,
    warmup: int = 5,
    iters: int = 20,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """:func:`benchmark_collectives`' rows from ``world_size`` ranks on ``backend``: spawned locally, or
    torchrun's ranks when torchrun started this process (then only rank 0 returns rows, the others [])."""
    rows = run_ranks(_rank_main, world_size, list(sizes_bytes), list(ops), warmup, iters, backend=backend,
                     timeout_s=timeout_s)
    return rows or []


