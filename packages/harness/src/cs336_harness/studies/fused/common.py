"""What the fused-kernel benchmarks share: the do_bench median, the CUDA-graph median (the GPU's time alone), a
copy of a given byte count (the bandwidth reference), the relative error, and the peer libraries (Liger-Kernel,
QuACK) where they import."""

from __future__ import annotations

import importlib
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from triton.testing import do_bench

from cs336_harness.studies.fused.config import FusedBenchConfig


def median_ms(fn: Callable[[], Any], config: FusedBenchConfig, grad_to_none: Sequence[torch.Tensor] = ()) -> float:
    """``triton.testing.do_bench``'s median of ``fn`` in ms, with the config's warm-up and repetition times."""
    return float(do_bench(fn, warmup=config.warmup_ms, rep=config.rep_ms, grad_to_none=list(grad_to_none) or None,
                          return_mode="median"))


def graph_median_ms(fn: Callable[[], Any], config: FusedBenchConfig, grad_to_none: Sequence[torch.Tensor] = (),
                    calls: int = 10) -> float:
    """The GPU time of ``fn`` alone, in ms: ``calls`` calls captured in one CUDA graph (each after the gradients of
    ``grad_to_none`` are set to None, as do_bench does), the graph replayed for about ``config.rep_ms``, the median
    replay divided by ``calls``. Unlike :func:`median_ms` it leaves out the host's time between kernels, which
    exceeds the kernels' own when a forward + backward through autograd moves a few hundred MB."""

    def call() -> None:
        for t in grad_to_none:
            t.grad = None
        fn()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture needs warm-up calls on a side stream
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        replays = max(3, int(config.rep_ms / max(start.elapsed_time(end), 1e-3)))
        times = []
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
    finally:
        # The gradients left by the last captured call live in the graph's memory pool; the pool returns to the
        # allocator only once they and the graph are gone (else every callable timed keeps its pool until the GPU
        # is full). A capture that fails keeps what it allocated: PyTorch frees a pool only after a capture ended.
        for t in grad_to_none:
            t.grad = None
        del graph
        free_cached_memory()
    return statistics.median(times)


def free_cached_memory() -> None:
    """Return the CUDA caching allocator's free blocks (a dead graph's pool among them) to the device."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def copy_step(nbytes: int, device: str = "cuda") -> Callable[[], Any]:
    """A device-to-device copy that moves ``nbytes`` bytes in all (half read, half written, as the ops count their
    traffic): the bandwidth an op that must move as many bytes is measured against."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||``, in fp32."""
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def peer_module(name: str) -> tuple[Any, str | None]:
    """A peer library's module by its import name, or None and why it cannot be used."""
    try:
        return importlib.import_module(name), None
    except Exception as e:  # noqa: BLE001 (any import failure means: no rows of that peer)
        return None, f"{name} is not importable: {type(e).__name__}: {e}"


def liger_functional() -> tuple[Any, str | None]:
    """Liger-Kernel's functional API, or None and why it cannot be used."""
    return peer_module("liger_kernel.transformers.functional")
