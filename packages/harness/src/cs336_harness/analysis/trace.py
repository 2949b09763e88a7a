"""Reading a torch.profiler trace: kernels split by range, kernel classes, communication overlap, FSDP gathers.

From an exported Chrome trace (the JSON that Perfetto and chrome://tracing open), :func:`kernel_table`
attributes every GPU kernel to the ranges that were open on the CPU when it was launched (found through
the launch's correlation id), the way an ``nsys stats --filter-nvtx`` report does (the ranges come from
:func:`cs336_harness.instrument.annotate`). :func:`comm_overlap` measures how much NCCL time no compute
kernel hides, and :func:`forward_gathers` whether each FSDP unit's all-gather landed before the unit ran.
Figures drawn from traces are in :mod:`cs336_harness.analysis.figures`.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cs336_harness.instrument import ATTENTION_RANGES, PHASES

_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


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


def range_bounds(events: Sequence[dict[str, Any]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
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
    ranges = range_bounds(events)
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
    acts = [a for a in gpu_activities(events) if a["dur"] > 0]
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


FORWARD_RANGE = "fsdp.forward."


GATHER_RANGE = "fsdp.all_gather."


def labelled_kernels(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    acts = [a for a in gpu_activities(events) if a["dur"] > 0]
    label_activities(acts, events)
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
    acts = labelled_kernels(events)
    compute = [a for a in acts if not is_comm_kernel(a["name"])]
    gathers = _first_with([a for a in acts if is_comm_kernel(a["name"])], GATHER_RANGE)
    layers = _first_with(compute, FORWARD_RANGE)
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
