"""GPU time of a training step by kind of kernel, from a torch.profiler trace: where the leaderboard step goes.

:func:`kernel_kind` sorts a kernel name into one of :data:`KINDS`; :func:`step_breakdown` sums the GPU time of the
kernels launched inside one ``step`` range (:func:`cs336_harness.analysis.trace.label_activities`) by kind, and
adds the step's idle time: the range's wall time (the step ends with a device synchronisation, so it covers the
GPU's work) less the union of its kernels' intervals, and the kernels that took the most time, by name.
:func:`breakdown_markdown` renders rows that carry a breakdown as one table, a column per row, and
:func:`top_kernels_markdown` one row's kernels by name.

Kinds, tried in this order (the first that matches names the kernel):

- ``attention``: FlashAttention kernels, ours (``_attn_fwd_kernel``, ``_attn_bwd_dkdv_kernel``,
  ``_attn_bwd_dq_kernel``, ``bwd_preprocess_kernel``, the Gluon ``_attn_bwd_kernel``) and SDPA's (flash, cuDNN,
  memory-efficient ``fmha``);
- ``causal_mask``: building a (T, T) mask (``triu_tril_kernel``);
- ``elementwise``: our glue kernels (RMSNorm, RoPE, ``silu(a) * b``) and Inductor's generated kernels
  (``triton_poi``, ``triton_red``, ``triton_per``: compiled glue), before the families below;
- ``loss_optimizer_reductions``: the fused LM head + cross-entropy's softmax-gradient kernel, AdamW (ours and
  torch's fused or foreach kernels) and other reductions (``kernel_class`` ``reduction``);
- by :func:`~cs336_harness.analysis.trace.kernel_class`: ``copies_casts`` (``copy``: direct and strided copies,
  ``cat``, dtype conversions, memcpy / memset), ``gemm`` (``matmul``), ``elementwise`` (ATen's elementwise
  kernels and fills);
- ``communication``: NCCL; ``other``: the rest;
- ``host_transfers``: copies between pinned host memory and the device (``Memcpy HtoD`` / ``DtoH``, offloaded
  activations), tried first. The copy engines run them beside the kernels, so they are not kernel time: neither in
  ``kernel_total_ms`` nor in what keeps the GPU from being idle.

The glue is copies and casts, elementwise and the mask: ``glue_share`` is their part of the kernel time.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cs336_harness import instrument
from cs336_harness.analysis import trace
from cs336_harness.analysis.tables import markdown_table

KINDS: tuple[str, ...] = ("attention", "gemm", "copies_casts", "elementwise", "causal_mask",
                          "loss_optimizer_reductions", "communication", "other", "host_transfers")
GLUE_KINDS: tuple[str, ...] = ("copies_casts", "elementwise", "causal_mask")
KIND_LABELS: dict[str, str] = {
    "attention": "attention", "gemm": "GEMMs", "copies_casts": "copies and casts",
    "elementwise": "elementwise (incl. RMSNorm, RoPE, SiLU-mul)", "causal_mask": "the (T, T) causal mask",
    "loss_optimizer_reductions": "fused LM head + CE, AdamW, reductions", "communication": "communication",
    "other": "other", "host_transfers": "host transfers (copy engines, beside the kernels)",
}
_ATTENTION = ("_attn_fwd", "_attn_bwd", "bwd_preprocess_kernel", "flash_fwd", "flash_bwd", "pytorch_flash",
              "fmha", "cudnn_generated_fort_native_sdpa", "sdpa", "attention_kernel")
_LOSS_OPTIMIZER = ("_softmax_grad_kernel", "adam")
_GLUE_KERNELS = ("_rms_norm_", "_rope_kernel", "_silu_mul_", "triton_poi", "triton_red", "triton_per")
_FAMILY_KINDS = {"copy": "copies_casts", "matmul": "gemm", "elementwise": "elementwise"}
TOP_KERNELS = 12
_NAME_CHARS = 90  # of a kernel's name in ``top_kernels``: C++ template names run to thousands


def kernel_kind(name: str) -> str:
    """The kind (:data:`KINDS`) of a GPU kernel, copy or memset named ``name``."""
    n = name.lower()
    if n.startswith(("memcpy htod", "memcpy dtoh")):
        return "host_transfers"
    if any(k in n for k in _ATTENTION):
        return "attention"
    if "triu_tril" in n:
        return "causal_mask"
    if any(k in n for k in _GLUE_KERNELS):
        return "elementwise"
    family = trace.kernel_class(name)
    if any(k in n for k in _LOSS_OPTIMIZER) or family == "reduction":
        return "loss_optimizer_reductions"
    if family in _FAMILY_KINDS:
        return _FAMILY_KINDS[family]
    return "communication" if trace.is_comm_kernel(name) else "other"


def step_breakdown(events: Sequence[dict[str, Any]], within: str = "step") -> dict[str, Any]:
    """GPU time of the first ``within`` range of a trace, by kind.

    Returns ``kernel_ms`` (per kind of :data:`KINDS`, every kind present), ``kernel_total_ms``, ``step_wall_ms``
    (the range's wall time), ``idle_ms`` (wall time without any kernel running) and ``glue_share`` (of the kernel
    time) and ``top_kernels``: the :data:`TOP_KERNELS` names with the most kernel time, most first, each with its
    ``kind``, ``count`` (launches in the step) and ``ms`` (their total), names cut to 90 characters. Kernel time
    counts each kernel's own duration, so kernels overlapping on two streams count twice; host transfers are
    counted by kind and by name but are not kernel time.

    Raises:
        ValueError: if the trace has no ``within`` range or no GPU kernel launched inside it.
    """
    spans = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"
                    and e["name"] == within), key=lambda e: float(e["ts"]))
    if not spans:
        raise ValueError(f"no {within!r} range in the trace")
    start = float(spans[0]["ts"])
    end = start + float(spans[0]["dur"])
    acts = trace.gpu_activities(events)
    trace.label_activities(acts, events)
    acts = [a for a in acts if within in a.get("ranges", ()) and start <= a["launch_ts"] <= end]
    if not acts:
        raise ValueError(f"no GPU kernel was launched inside the {within!r} range (a CPU trace?)")
    by_kind = dict.fromkeys(KINDS, 0.0)
    by_name: dict[str, list[float]] = {}
    for a in acts:
        by_kind[kernel_kind(a["name"])] += a["dur"] / 1e3
        count_ms = by_name.setdefault(a["name"], [0, 0.0])
        count_ms[0] += 1
        count_ms[1] += a["dur"] / 1e3
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
    total = sum(ms for kind, ms in by_kind.items() if kind != "host_transfers")
    on_sms = [a for a in acts if kernel_kind(a["name"]) != "host_transfers"]
    busy = trace._union([(max(a["ts"], start), min(a["ts"] + a["dur"], end)) for a in on_sms
                         if a["ts"] + a["dur"] > start and a["ts"] < end])
    wall_ms = (end - start) / 1e3
    return {"kernel_ms": by_kind, "kernel_total_ms": total, "step_wall_ms": wall_ms,
            "idle_ms": max(0.0, wall_ms - trace._length(busy) / 1e3),
            "glue_share": sum(by_kind[k] for k in GLUE_KINDS) / total,
            "top_kernels": [{"name": name[:_NAME_CHARS], "kind": kernel_kind(name), "count": count, "ms": ms}
                            for name, (count, ms) in top]}


def profiled_breakdown(step: Callable[[], None], device: torch.device) -> dict[str, Any] | None:
    """Run ``step`` (one training step that ends with a device synchronisation) once under torch.profiler inside a
    ``step`` range, and return its GPU time by kind (:func:`step_breakdown`); None on a CPU, which has no GPU kernels
    to sort."""
    with instrument.profile(device) as prof, instrument.annotate("step"):
        step()
    if torch.device(device).type != "cuda":
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return step_breakdown(trace.load_trace(path))


def breakdown_markdown(rows: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    """One markdown table: a line per kind (ms and share of kernel time; host transfers, not kernel time, in ms
    alone), then idle and the glue's share, with a column per row that has a ``breakdown`` (:func:`step_breakdown`;
    rows from before a kind existed show 0 for it); ``labels`` name the columns."""
    chosen = [(label, r["breakdown"]) for label, r in zip(labels, rows, strict=True) if r.get("breakdown")]
    table = []
    for kind in KINDS:
        if not any(b["kernel_ms"].get(kind) for _, b in chosen):
            continue
        line = {"kind": KIND_LABELS[kind]}
        for label, b in chosen:
            ms = b["kernel_ms"].get(kind, 0.0)
            line[label] = f"{ms:.4g}" if kind == "host_transfers" else f"{ms:.4g} ({ms / b['kernel_total_ms']:.1%})"
        table.append(line)
    table.append({"kind": "kernel time", **{label: f"{b['kernel_total_ms']:.4g}" for label, b in chosen}})
    table.append({"kind": "idle", **{label: f"{b['idle_ms']:.4g}" for label, b in chosen}})
    table.append({"kind": "glue share", **{label: f"{b['glue_share']:.1%}" for label, b in chosen}})
    columns = [("kind", "kind (ms, share of kernel time)"), *((label, label) for label, _ in chosen)]
    return markdown_table(table, columns)


def top_kernels_markdown(breakdown: dict[str, Any]) -> str:
    """One markdown table of a breakdown's ``top_kernels``: name, kind, launches, total and mean ms, share of the
    step's kernel time."""
    table = [{"kernel": k["name"], "kind": k["kind"], "count": k["count"], "ms": f"{k['ms']:.4g}",
              "mean": f"{k['ms'] / k['count']:.4g}", "share": f"{k['ms'] / breakdown['kernel_total_ms']:.1%}"}
             for k in breakdown["top_kernels"]]
    columns = [("kernel", "kernel"), ("kind", "kind"), ("count", "launches"), ("ms", "ms"), ("mean", "ms each"),
               ("share", "share of kernel time")]
    return markdown_table(table, columns)
