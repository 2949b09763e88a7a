"""Named ranges and profiler capture around the code a study measures.

:func:`annotate` opens an NVTX range (seen by Nsight Systems) and a ``record_function`` range (seen by
torch.profiler) with the same name, so one set of labels serves both tools. The step benchmark labels
``warmup`` and ``step`` around whole steps, ``forward``, ``backward`` and ``optimizer`` around phases,
and the ``annotated`` attention labels ``attention/scores``, ``attention/softmax`` and
``attention/final_matmul``; :mod:`cs336_harness.analysis.trace` splits kernels by these ranges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")
# The phases of a data-parallel step: the gradient synchronisation after backward is a range of its own.
STEP_PHASES: tuple[str, ...] = ("forward", "backward", "grad_sync", "optimizer")
ATTENTION_RANGES: tuple[str, ...] = ("attention/scores", "attention/softmax", "attention/final_matmul")


@contextlib.contextmanager
def annotate(name: str) -> Iterator[None]:
    """An NVTX range (when CUDA is present) and a profiler ``record_function`` range named ``name``."""
    nvtx = torch.cuda.is_available()
    if nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()


@contextlib.contextmanager
def profile(device: torch.device | str) -> Iterator[torch.profiler.profile]:
    """``torch.profiler`` over the block: CPU ranges and ops, and CUDA kernels when ``device`` is a GPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # One profiling cycle, so accumulating events across cycles changes nothing; without it torch warns on every run
    # that a later cycle would drop this one's events.
    with torch.profiler.profile(activities=activities, acc_events=True) as prof:
        yield prof
