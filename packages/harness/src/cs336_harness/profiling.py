"""Named ranges, torch.profiler capture, a kernel table split by range, and a timeline figure.

:func:`annotate` opens an NVTX range (seen by Nsight Systems) and a ``record_function`` range (seen by
torch.profiler) with the same name, so one set of labels serves both tools. The benchmark labels
``warmup`` and ``step`` around whole steps, ``forward``, ``backward`` and ``optimizer`` around phases,
and the ``annotated`` attention labels ``attention/scores``, ``attention/softmax`` and
``attention/final_matmul``.

From an exported Chrome trace (the JSON that Perfetto and chrome://tracing open), :func:`kernel_table`
attributes every GPU kernel to the ranges that were open on the CPU when it was launched (found through
the launch's correlation id), the way an ``nsys stats --filter-nvtx`` report does, and
:func:`plot_timeline` draws the kernels of each stream on one time axis, coloured by phase.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")
ATTENTION_RANGES: tuple[str, ...] = ("attention/scores", "attention/softmax", "attention/final_matmul")
_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


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


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a Chrome trace written by ``torch.profiler`` (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def host_op_times(events: Sequence[dict[str, Any]], within: str, names: Sequence[str]) -> dict[str, dict[str, float]]:
    """CPU time of the host-side events ``names`` (operators, CUDA runtime calls) that start inside the first
    ``within`` range, on any thread: per name its ``calls``, ``total_ms`` and ``median_us``.

    In a step bound by how fast the CPU issues work, these say where the issuing thread spends its time
    (e.g. ``c10d::allreduce_`` per collective against ``aten::mm`` per matmul during ``backward``).
    """
    spans = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X" and e["name"] == within]
    if not spans:
        raise ValueError(f"no {within!r} range in the trace")
    start = min(float(e["ts"]) for e in spans)
    first = next(e for e in spans if float(e["ts"]) == start)
    end = start + float(first["dur"])
    out = {}
    for name in names:
        durs = [float(e["dur"]) for e in events
                if e.get("ph") == "X" and e.get("name") == name and e.get("cat") in ("cpu_op", "cuda_runtime")
                and start <= float(e["ts"]) <= end]
        out[name] = {"calls": len(durs), "total_ms": sum(durs) / 1e3,
                     "median_us": float(np.median(durs)) if durs else float("nan")}
    return out


def _ranges(events: Sequence[dict[str, Any]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """CPU-side user ranges by name, as sorted (starts, ends) arrays in trace microseconds."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("ph") == "X":
            spans[e["name"]].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    out = {}
    for name, s in spans.items():
        arr = np.array(sorted(s))
        out[name] = (arr[:, 0], arr[:, 1])
    return out


def gpu_activities(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """GPU kernels, copies and memsets, each with ``launch_ts``: when the CPU asked for it."""
    launch_ts = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in _LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    out = []
    for e in events:
        if e.get("cat") in _GPU_CATEGORIES and e.get("ph") == "X":
            corr = e.get("args", {}).get("correlation")
            out.append({
                "name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"]),
                "stream": e.get("args", {}).get("stream", e.get("tid")),
                "launch_ts": launch_ts.get(corr, float(e["ts"])),
            })
    return out


def label_activities(activities: list[dict[str, Any]], events: Sequence[dict[str, Any]]) -> None:
    """Add ``ranges`` to each activity: the names of the user ranges open at its launch time."""
    ranges = _ranges(events)
    if not activities:
        return
    t = np.array([a["launch_ts"] for a in activities])
    inside: dict[str, np.ndarray] = {}
    for name, (starts, ends) in ranges.items():
        # Ranges of one name never overlap (they are sequential on one thread), so the last start
        # at or before t is the only candidate.
        idx = np.searchsorted(starts, t, side="right") - 1
        inside[name] = (idx >= 0) & (t < ends[np.maximum(idx, 0)])
    for i, a in enumerate(activities):
        a["ranges"] = [name for name, mask in inside.items() if mask[i]]


def kernel_table(
    events: Sequence[dict[str, Any]],
    within: str = "step",
    split_by: Sequence[str] = PHASES + ATTENTION_RANGES,
    top: int = 10,
    num_steps: int = 1,
) -> list[dict[str, Any]]:
    """Top kernels by GPU time inside the ``within`` range, overall and for each range in ``split_by``.

    Returns rows with ``range`` (``all`` or a name from ``split_by``), ``kernel``, ``calls_per_step``,
    ``total_ms_per_step``, ``share_of_range`` and ``share_of_step`` (of all GPU time inside ``within``).
    One row per range with ``kernel == "(total)"`` carries the range's summed GPU time.
    """
    if num_steps <= 0:
        raise ValueError(f"num_steps must be positive, got {num_steps}")
    acts = gpu_activities(events)
    label_activities(acts, events)
    acts = [a for a in acts if within in a.get("ranges", ())]
    step_total = sum(a["dur"] for a in acts)
    rows: list[dict[str, Any]] = []
    for group in ("all", *split_by):
        chosen = acts if group == "all" else [a for a in acts if group in a["ranges"]]
        if not chosen:
            continue
        by_kernel: dict[str, list[float]] = defaultdict(list)
        for a in chosen:
            by_kernel[a["name"]].append(a["dur"])
        group_total = sum(a["dur"] for a in chosen)
        rows.append({
            "range": group, "kernel": "(total)", "calls_per_step": len(chosen) / num_steps,
            "total_ms_per_step": group_total / 1e3 / num_steps, "share_of_range": 1.0,
            "share_of_step": group_total / step_total,
        })
        ranked = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
        for name, durs in ranked:
            rows.append({
                "range": group, "kernel": name, "calls_per_step": len(durs) / num_steps,
                "total_ms_per_step": sum(durs) / 1e3 / num_steps, "share_of_range": sum(durs) / group_total,
                "share_of_step": sum(durs) / step_total,
            })
    return rows


def kernel_class(name: str) -> str:
    """A coarse family for a kernel name: matmul, elementwise, reduction, copy or other."""
    n = name.lower()
    if any(k in n for k in ("gemm", "cutlass", "cublas", "sm90_xmma", "wgmma", "nvjet", "matmul", "_mm_")):
        return "matmul"
    if any(k in n for k in ("reduce", "softmax", "norm", "welford")):
        return "reduction"
    if any(k in n for k in ("memcpy", "memset", "copy")):
        return "copy"
    if any(k in n for k in ("elementwise", "vectorized", "unrolled", "foreach", "triton_poi", "fill")):
        return "elementwise"
    return "other"


_OP_PATTERNS = (  # tried in order: the first match names the op of an ATen kernel
    r"at::native::(?:\(anonymous namespace\)::)?(\w+?)(?:_kernel)?(?:_cuda)?\(",
    r"binary_internal::(\w+?)Functor",
    r"CUDAFunctor(?:OnSelf)?_(\w+)",
    r"func_wrapper_t<\w+, at::native::(\w+?)_?[Ff]unctor",
)


def short_kernel_name(name: str, width: int = 60) -> str:
    """A readable label for a (often 300+ character) kernel name, e.g. ``elementwise: mul``."""
    if "at::native::" in name:
        family = "reduce" if "reduce_kernel" in name else "elementwise"
        match = next((m for m in (re.search(p, name) for p in _OP_PATTERNS) if m), None)
        return f"{family}: {match.group(1).lower() if match else '?'}"
    gemm = re.search(r"gemm_(\w+?)_.*?_(nn|nt|tn|tt)_.*?tilesize(\d+x\d+)", name) or re.search(
        r"_(\w*gemm)_(\d+x\d+)_\w+?_(nn|nt|tn|tt)_", name
    )
    if gemm:
        return "gemm " + " ".join(gemm.groups())
    short = re.sub(r"^void ", "", name).split("(")[0].strip()
    return short if len(short) <= width else short[: width - 3] + "..."


def class_shares(events: Sequence[dict[str, Any]], within: str) -> dict[str, float]:
    """Fraction of GPU time inside ``within`` spent in each :func:`kernel_class`."""
    acts = gpu_activities(events)
    label_activities(acts, events)
    acts = [a for a in acts if within in a.get("ranges", ())]
    total = sum(a["dur"] for a in acts) or 1.0
    shares: dict[str, float] = defaultdict(float)
    for a in acts:
        shares[kernel_class(a["name"])] += a["dur"] / total
    return dict(shares)


def plot_timeline(
    events: Sequence[dict[str, Any]], path: str | Path, within: str = "step", title: str = ""
) -> Path:
    """Draw the first ``within`` range: CPU phase ranges above, GPU kernels per stream below, one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranges = _ranges(events)
    if within not in ranges:
        raise ValueError(f"trace has no {within!r} range; ranges present: {sorted(ranges)}")
    t0, t1 = ranges[within][0][0], ranges[within][1][0]
    acts = gpu_activities(events)
    label_activities(acts, events)
    acts = [a for a in acts if t0 <= a["launch_ts"] <= t1]
    streams = sorted({a["stream"] for a in acts}, key=str)
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.5 * (len(streams) + len(PHASES))))
    rows = [f"CPU {p}" for p in PHASES] + [f"GPU stream {s}" for s in streams]
    for i, phase in enumerate(PHASES):
        if phase in ranges:
            starts, ends = ranges[phase]
            keep = (starts >= t0) & (starts <= t1)
            spans = [((s - t0) / 1e3, (e - s) / 1e3) for s, e in zip(starts[keep], ends[keep], strict=True)]
            ax.broken_barh(spans, (i - 0.4, 0.8), color=colors[phase])
    for j, stream in enumerate(streams):
        by_phase: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for a in acts:
            if a["stream"] == stream:
                phase = next((p for p in PHASES if p in a["ranges"]), "other")
                by_phase[phase].append(((a["ts"] - t0) / 1e3, a["dur"] / 1e3))
        for phase, spans in by_phase.items():
            ax.broken_barh(spans, (len(PHASES) + j - 0.4, 0.8), color=colors.get(phase, "tab:gray"))
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("time since step start (ms)")
    ax.set_title(title or "one step: CPU ranges and GPU kernels (colour = phase at launch)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
