"""The writeup's tables of the fused-kernel benchmarks, from their rows (:func:`fused_markdown`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cs336_harness.analysis.tables import markdown_table


def latest_run(rows: Sequence[dict[str, Any]], bench: str) -> list[dict[str, Any]]:
    """Rows of ``bench`` from its most recent run (rows of one run share their provenance date)."""
    picked = [r for r in rows if r.get("bench") == bench]
    latest = max((r.get("date", "") for r in picked), default="")
    return [r for r in picked if r.get("date", "") == latest]


def fused_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The writeup's tables from the latest run of each benchmark: AdamW, linear + cross-entropy, its stages,
    and one table per glue op (its implementations, the copy, and the parts of ours timed alone)."""
    parts = []
    adamw = latest_run(rows, "adamw")
    if adamw:
        p = adamw[0]
        parts.append(
            f"AdamW step, {p['num_params'] / 1e9:g}e9 fp32 params in {p['num_tensors']} tensors, one GPU of "
            f"{p['device']}; "
            f"bytes floor {p['floor_ms']:.2f} ms (28 B/param at 4.24 TB/s); copy measured in the same run at "
            f"{p['copy_tbps']:.2f} TB/s.\n\n"
            + markdown_table(adamw, list(zip(
                ["impl", "median_ms", "speedup_vs_torch_fused", "floor_fraction", "achieved_tbps"],
                ["implementation", "median (ms)", "vs torch fused", "floor / time", "TB/s moved"], strict=True)))
        )
    ce = latest_run(rows, "linear_ce")
    if ce:
        p = ce[0]
        parts.append(
            f"LM head + cross-entropy fwd+bwd, {p['tokens']} tokens x d {p['d_model']} x vocab {p['vocab_size']}, "
            f"{p['dtype']}, one GPU of {p['device']}; matmul floor {p['matmul_floor_ms']:.0f} ms "
            "(3 products at 772 TFLOP/s).\n\n"
            + markdown_table(ce, list(zip(
                ["impl", "median_ms", "speedup_vs_torch", "floor_fraction", "extra_gib", "loss_rel_err",
                 "grad_hidden_rel_err", "grad_weight_rel_err"],
                ["implementation", "median (ms)", "vs plain torch", "floor / time", "peak above inputs+grads (GiB)",
                 "loss rel. err vs fp32", "grad h rel. err", "grad W rel. err"], strict=True))
                + ([("note", "note")] if any(r.get("note") for r in ce) else []))
        )
    for p in latest_run(rows, "linear_ce_parts"):
        stages = [
            {"stage": name.replace("_", " "), "ms": p[f"{name}_ms"],
             "rate": f"{p[name + '_tflops']:.0f} TFLOP/s" if name.endswith("mm")
             else f"{p['softmax_grad_kernel_tbps']:.2f} TB/s"}
            for name in ("logits_mm", "softmax_grad_kernel", "grad_hidden_mm", "grad_weight_addmm")
        ]
        parts.append(
            f"Fused stages, {p['num_chunks']} chunks of {p['chunk_rows']} tokens (one chunk timed, times the count)."
            "\n\n" + markdown_table(stages, [("stage", "stage"), ("ms", "total (ms)"), ("rate", "rate")])
        )
    glue = latest_run(rows, "glue")
    for op in dict.fromkeys(r["op"] for r in glue):
        picked = [{**r, "note": r.get("error") or r.get("note")} for r in glue if r["op"] == op]
        p = picked[0]
        parts.append(
            f"{op}, {p['shape']} {p['dtype']}, one GPU of {p['device']}; {p['bytes_moved'] / 1e9:.2f} GB must move "
            "forward + backward; each time the median of the repeats' do_bench medians (host and GPU) and of their "
            "CUDA-graph replays (the GPU alone), beside a copy of the same bytes.\n\n"
            + markdown_table(picked, list(zip(
                ["part", "impl", "graph_ms", "graph_max_over_min", "graph_gbps", "graph_vs_copy", "ms",
                 "max_over_min", "vs_copy", "speedup_vs_eager", "extra_gib", "out_rel_err_vs_eager", "note"],
                ["part", "implementation", "GPU (ms)", "max / min", "GB/s", "vs copy", "do_bench (ms)", "max / min",
                 "vs copy", "vs eager", "peak above inputs+grads (GiB)", "out rel. diff vs eager", "note"],
                strict=True)))
        )
    return "\n\n".join(parts)
