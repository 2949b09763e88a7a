"""CUDA memory history: record a snapshot, read its active-memory timeline, draw it, list big allocations.

:func:`record_memory_history` wraps ``torch.cuda.memory._record_memory_history`` and always writes the
snapshot pickle (also when the block runs out of memory), which a user can drop on
https://pytorch.org/memory_viz. :func:`active_memory_timeline` rebuilds from the snapshot what that
tool's "Active Memory Timeline" shows (bytes held by live tensors after each allocator event), and
:func:`plot_active_memory` saves it as a PNG, so the figure needs no browser.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch


def require_cuda(what: str) -> None:
    """Raise a clear error when ``what`` needs CUDA and there is none."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU, and torch.cuda.is_available() is False on this machine")


@contextlib.contextmanager
def record_memory_history(path: str | Path, max_entries: int = 1_000_000) -> Iterator[Path]:
    """Record allocator events inside the block and dump the snapshot to ``path`` on the way out."""
    require_cuda("memory profiling (--memory)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Python frames only: C++ frames make the pickle several times larger and slow to symbolise.
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield path
    finally:
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)


def load_snapshot(path: str | Path) -> dict[str, Any]:
    with Path(path).open("rb") as f:
        return pickle.load(f)


def active_memory_timeline(snapshot: dict[str, Any], device: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Bytes held by live allocations after each allocator event: (event times in us, bytes).

    Tensors allocated before recording started have no ``alloc`` event; their total is the live bytes
    at the end (the snapshot's ``active_allocated`` blocks) minus the net change over the trace, and it
    is added as a constant baseline, as memory_viz does.
    """
    trace = snapshot["device_traces"][device]
    deltas = []
    times = []
    for e in trace:
        if e["action"] == "alloc":
            deltas.append(e["size"])
        elif e["action"] == "free_completed":
            deltas.append(-e["size"])
        else:
            continue
        times.append(e.get("time_us", len(times)))
    live_at_end = sum(
        b["size"]
        for seg in snapshot["segments"]
        if seg.get("device", device) == device
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    )
    net = np.cumsum(np.array(deltas, dtype=np.int64)) if deltas else np.zeros(0, dtype=np.int64)
    baseline = live_at_end - (int(net[-1]) if len(net) else 0)
    return np.array(times, dtype=np.float64), net + baseline


def largest_allocations(snapshot: dict[str, Any], top: int = 5, device: int = 0) -> list[dict[str, Any]]:
    """The ``top`` largest ``alloc`` events with their size and innermost frames from our own code."""
    allocs = [e for e in snapshot["device_traces"][device] if e["action"] == "alloc"]
    allocs.sort(key=lambda e: -e["size"])
    rows = []
    seen: set[tuple[int, str]] = set()
    for e in allocs:
        frames = [
            f"{Path(f['filename']).name}:{f['line']} {f['name']}"
            for f in e.get("frames", [])
            if "cs336" in f["filename"]
        ]
        where = " <- ".join(frames[:3]) or "(no Python frame from this repo)"
        if (e["size"], where) in seen:
            continue
        seen.add((e["size"], where))
        rows.append({"size_mib": e["size"] / 2**20, "count": sum(a["size"] == e["size"] for a in allocs),
                     "where": where})
        if len(rows) == top:
            break
    return rows


def gradient_allocations(
    snapshot: dict[str, Any], optimizer_file: str = "optimizer.py", device: int = 0
) -> dict[int, int]:
    """Sizes (bytes -> count) of the tensors the backward pass leaves alive for the optimizer.

    Backward allocations come from autograd's engine thread, so their stacks hold no Python frame of
    ours; those still alive when the first allocation from ``optimizer_file`` happens are the
    gradients, plus any workspace a library keeps for that thread (cuBLAS: one block).
    """
    trace = snapshot["device_traces"][device]
    start = next((i for i, e in enumerate(trace) if e["action"] == "alloc"
                  and any(optimizer_file in f["filename"] for f in e.get("frames", []))), None)
    if start is None:
        raise ValueError(f"no allocation from {optimizer_file!r} in the trace; was an optimizer step recorded?")
    live: dict[int, dict[str, Any]] = {}
    for e in trace[:start]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    sizes: dict[int, int] = {}
    for e in live.values():
        if not any("cs336" in f["filename"] for f in e.get("frames", [])):
            sizes[e["size"]] = sizes.get(e["size"], 0) + 1
    return dict(sorted(sizes.items(), reverse=True))
