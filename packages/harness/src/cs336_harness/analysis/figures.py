"""Figures rendered from what a run recorded: profiler timelines, memory timelines, collectives bandwidth.

Every function draws with matplotlib's Agg backend (no display), writes one PNG and returns its path.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cs336_comms.collectives import OPS

from cs336_harness.analysis.memory import active_memory_timeline
from cs336_harness.analysis.trace import (
    FORWARD_RANGE,
    GATHER_RANGE,
    forward_gathers,
    gpu_activities,
    is_comm_kernel,
    label_activities,
    labelled_kernels,
    range_bounds,
)
from cs336_harness.instrument import PHASES, STEP_PHASES

LABEL_SIZE = 12  # points: axis labels and legends of the multi-panel figures that are shown at page width


def plot_timeline(
    events: Sequence[dict[str, Any]], path: str | Path, within: str = "step", title: str = ""
) -> Path:
    """Draw the first ``within`` range: CPU phase ranges above, GPU kernels per stream below, one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranges = range_bounds(events)
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
        acts = [a for a in gpu_activities(events) if a["dur"] > 0]
        if acts:
            label_activities(acts, events)
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

    acts = labelled_kernels(events)
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
        bars = {"forward": pick(lambda n: n.startswith(FORWARD_RANGE)), "backward": pick(lambda n: n == "backward"),
                "optimizer": pick(lambda n: n == "optimizer"), "all-gather": pick(lambda n: n.startswith(GATHER_RANGE)),
                "reduce-scatter / all-reduce": pick(lambda n: n.startswith("fsdp.reduce_scatter."))}
    t0 = min(s for v in bars.values() for s, _ in v)
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green",
              "all-gather": "tab:purple", "reduce-scatter / all-reduce": "tab:red"}
    lanes = {"forward": 0, "backward": 0, "optimizer": 0, "all-gather": 1, "reduce-scatter / all-reduce": 2}
    # Shown at page width: 10 inches keep LABEL_SIZE text legible there, and the constrained layout keeps the legend,
    # set above the panel it explains, clear of the bars and of the title.
    fig, (top, zoom) = plt.subplots(2, 1, figsize=(10, 6), layout="constrained")
    for name, spans in bars.items():
        top.broken_barh([((s - t0) / 1e3, d / 1e3) for s, d in spans], (lanes[name] - 0.4, 0.8),
                        color=colors[name], label=name)
    top.set_yticks([0, 1, 2], ["compute" if gpu else "CPU ranges", "all-gather", "other collectives"])
    top.invert_yaxis()
    top.legend(loc="lower left", bbox_to_anchor=(0, 1), ncol=5, fontsize=LABEL_SIZE, frameon=False,
               handlelength=1, columnspacing=1)
    top.set_xlabel("ms since the step's first event", fontsize=LABEL_SIZE)
    top.tick_params(labelsize=LABEL_SIZE)
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
        waited = sum(g["margin_ms"] < 0 for g in gathers)
        zoom.set_yticks([0, 1], ["unit compute", "its all-gather"])
        zoom.invert_yaxis()
        zoom.set_title(f"first {len(gathers)} forward units in order, gather and compute in one colour; "
                       f"{waited} waited", fontsize=LABEL_SIZE, loc="left")
        zoom.set_xlabel("ms since the first of these gathers started", fontsize=LABEL_SIZE)
        zoom.tick_params(labelsize=LABEL_SIZE)
        zoom.grid(True, axis="x", alpha=0.3)
    else:
        zoom.set_axis_off()
        zoom.text(0.01, 0.5, "no GPU kernels in this trace (CPU run): per-layer gather timing needs a GPU",
                  fontsize=9)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=LABEL_SIZE)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _layer_spans(compute: Sequence[dict[str, Any]], params: Sequence[str]) -> dict[str, tuple[float, float]]:
    """First start and last end of the compute kernels launched inside each unit's forward range."""
    out: dict[str, tuple[float, float]] = {}
    for p in params:
        mine = [a for a in compute if FORWARD_RANGE + p in a["ranges"]]
        out[p] = (mine[0]["ts"], max(a["ts"] + a["dur"] for a in mine))
    return out


def plot_active_memory(snapshot: dict[str, Any], path: str | Path, title: str = "", device: int = 0) -> Path:
    """Save the active-memory timeline (GiB over time since the first event) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, live = active_memory_timeline(snapshot, device)
    if len(times) == 0:
        raise ValueError("the snapshot has no alloc/free events on this device; was anything recorded?")
    x = (times - times[0]) / 1e3
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.fill_between(x, live / 2**30, step="post", alpha=0.6)
    ax.plot(x, live / 2**30, drawstyle="steps-post", lw=0.8)
    ax.set_xlabel("time since recording started (ms)")
    ax.set_ylabel("active memory (GiB)")
    ax.set_title(title or "active memory timeline")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_collectives(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Bus bandwidth (left) and time (right) against size, one panel row per op, one line per
    (backend, world size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in OPS if any(r["op"] == op for r in rows)]
    if not ops:
        raise ValueError("plot_collectives needs at least one row")
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.2 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        series: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for r in rows:
            if r["op"] == op:
                series.setdefault((r["backend"], r["world_size"]), []).append(r)
        for (backend, ws), rs in sorted(series.items()):
            rs = sorted(rs, key=lambda r: r["bytes"])
            mb = [r["size_mb"] for r in rs]
            label = f"{backend}, {ws} rank{'s' if ws > 1 else ''}"
            axes[i, 0].plot(mb, [r["busbw_gbps"] for r in rs], marker="o", label=label)
            axes[i, 1].plot(mb, [r["time_ms"] for r in rs], marker="o", label=label)
        axes[i, 0].set_ylabel(f"{op}\nbus bandwidth (GB/s)", fontsize=LABEL_SIZE)
        axes[i, 1].set_ylabel("time (ms)", fontsize=LABEL_SIZE)
        axes[i, 1].set_yscale("log")
        for ax in axes[i]:
            ax.set_xscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.tick_params(labelsize=LABEL_SIZE - 1)
        # Legible where the figure is shown at page width: the legend as large as the axis labels.
        axes[i, 0].legend(fontsize=LABEL_SIZE)
    for ax in axes[-1]:
        ax.set_xlabel("size (MiB, float32)", fontsize=LABEL_SIZE)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
