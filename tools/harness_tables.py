"""Regenerate the harness tables of writeup sections 2, 3 and 4 from the rows in writeup/results/.

Each table goes between ``<!-- table:NAME -->`` markers in the section files (see
``cs336_harness.report.fill_tables``); the prose around them is written by hand.

    uv run python tools/harness_tables.py          # rewrite the two sections in place
    uv run python tools/harness_tables.py --print  # print the tables instead
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cs336_harness.analysis import memory
from cs336_harness.analysis.tables import fill_tables, markdown_table
from cs336_harness.analysis.trace import kernel_class, short_kernel_name
from cs336_harness.results import read_rows

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "writeup" / "results"
SECTIONS = {
    "02": ROOT / "writeup" / "sections" / "02-profiling.md",
    "03": ROOT / "writeup" / "sections" / "03-gradient-checkpointing.md",
    "04": ROOT / "writeup" / "sections" / "04-attention.md",
}
SIZE_ORDER = ["small", "medium", "large", "xl", "10B"]
GIB = 2**30


def rows(name: str) -> list[dict[str, Any]]:
    path = RESULTS / f"{name}.jsonl"
    return read_rows(path) if path.exists() else []


def pm(row: dict[str, Any], phase: str) -> str | None:
    """``mean ± std`` of a phase in ms, or None when the phase was not run."""
    if f"{phase}_ms_mean" not in row:
        return None
    return f"{row[f'{phase}_ms_mean']:.1f} ± {row[f'{phase}_ms_std']:.1f}"


def by_size(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rs, key=lambda r: (SIZE_ORDER.index(r["size"]), r.get("dtype", ""), r.get("context_length", 0)))


def table_sizes() -> str:
    out = []
    # fp32 throughout, plus the 10B rows in bf16 (its fp32 training state does not fit in 141 GB).
    for r in by_size([r for r in rows("bench_sizes") if r["dtype"] == "fp32" or r["size"] == "10B"]):
        out.append({"size": r["size"], "params (M)": r.get("params", 0) / 1e6, "mode": r["mode"], "dtype": r["dtype"],
                    "fwd": pm(r, "forward"), "bwd": pm(r, "backward"), "opt": pm(r, "optimizer"),
                    "step median": r.get("step_ms_median"), "status": r["status"]})
    return markdown_table(out, ["size", "params (M)", "mode", "dtype", ("fwd", "forward (ms)"),
                                ("bwd", "backward (ms)"), ("opt", "optimizer (ms)"),
                                ("step median", "step median (ms)"), "status"], floatfmt=".1f")


def table_warmup() -> str:
    out = []
    for r in sorted(rows("bench_warmup"), key=lambda r: (SIZE_ORDER.index(r["size"]), r["warmup"])):
        out.append({"size": r["size"], "warm-up": r["warmup"], "fwd": pm(r, "forward"), "bwd": pm(r, "backward"),
                    "opt": pm(r, "optimizer"), "first fwd": r["forward_ms_all"][0],
                    "rest fwd": sum(r["forward_ms_all"][1:]) / (len(r["forward_ms_all"]) - 1)})
    return markdown_table(out, ["size", "warm-up", ("fwd", "forward (ms)"), ("first fwd", "1st measured fwd"),
                                ("rest fwd", "mean of the other 9"), ("bwd", "backward (ms)"),
                                ("opt", "optimizer (ms)")], floatfmt=".1f")


def _pairs(rs: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[Any, dict[str, dict]]:
    grouped: dict[Any, dict[str, dict]] = {}
    for r in rs:
        grouped.setdefault(key(r), {})[r["dtype"]] = r
    return grouped


def table_bf16() -> str:
    out = []
    grouped = _pairs([r for r in rows("bench_sizes") if r["status"] == "ok"], lambda r: (r["size"], r["mode"]))
    for (size, mode), d in sorted(grouped.items(), key=lambda kv: SIZE_ORDER.index(kv[0][0])):
        if "fp32" not in d or "bf16" not in d:
            continue
        f, b = d["fp32"], d["bf16"]
        row = {"size": size, "mode": mode}
        for phase in ("forward", "backward", "optimizer"):
            if f"{phase}_ms_mean" in f:
                row[phase] = f"{f[f'{phase}_ms_mean']:.1f} / {b[f'{phase}_ms_mean']:.1f}"
        row["speed-up"] = f["step_ms_median"] / b["step_ms_median"]
        row["peak"] = f"{f['peak_step_gib']:.1f} / {b['peak_step_gib']:.1f}"
        out.append(row)
    return markdown_table(out, ["size", "mode", ("forward", "forward fp32 / bf16 (ms)"),
                                ("backward", "backward fp32 / bf16 (ms)"), ("optimizer", "optimizer fp32 / bf16 (ms)"),
                                ("speed-up", "step speed-up"), ("peak", "peak GiB fp32 / bf16")], floatfmt=".2f")


def table_compile() -> str:
    # Eager and compiled steps of one run, so the speed-up is against a baseline measured beside it.
    eager = {(r["size"], r["dtype"]): r for r in rows("bench_compile") if not r["compile"]}
    out = []
    for r in by_size([r for r in rows("bench_compile") if r["compile"]]):
        e = eager.get((r["size"], r["dtype"]))
        if e is None:
            continue
        out.append({"size": r["size"], "dtype": r["dtype"], "eager fwd": e["forward_ms_mean"],
                    "compiled fwd": r["forward_ms_mean"], "eager bwd": e["backward_ms_mean"],
                    "compiled bwd": r["backward_ms_mean"], "eager step": e["step_ms_median"],
                    "compiled step": r["step_ms_median"], "speed-up": e["step_ms_median"] / r["step_ms_median"]})
    return markdown_table(out, ["size", "dtype", ("eager fwd", "eager fwd (ms)"), ("compiled fwd", "compiled fwd"),
                                ("eager bwd", "eager bwd"), ("compiled bwd", "compiled bwd"),
                                ("eager step", "eager step"), ("compiled step", "compiled step"), "speed-up"],
                          floatfmt=".1f")


def _kernels(size: str, ctx: int, mode: str = "train") -> list[dict[str, Any]]:
    return [r for r in rows("bench_kernels")
            if r["size"] == size and r["context_length"] == ctx and r["mode"] == mode]


def _total(ks: list[dict[str, Any]], rng: str) -> float | None:
    return next((k["total_ms_per_step"] for k in ks if k["range"] == rng and k["kernel"] == "(total)"), None)


def _top(ks: list[dict[str, Any]], rng: str) -> dict[str, Any] | None:
    return next((k for k in ks if k["range"] == rng and k["kernel"] != "(total)"), None)


def _matmul_share(ks: list[dict[str, Any]], rng: str) -> float:
    return sum(k["share_of_range"] for k in ks if k["range"] == rng and k["kernel"] != "(total)"
               and kernel_class(k["kernel"]) == "matmul")


def table_profile() -> str:
    out = []
    for r in by_size([r for r in rows("bench_profile") if r["mode"] == "train"]):
        ks = _kernels(r["size"], r["context_length"])
        top_f, top_all = _top(ks, "forward"), _top(ks, "all")
        out.append({
            "size": r["size"], "ctx": r["context_length"], "status": r["status"],
            "timer fwd": r.get("forward_ms_mean"), "kernels fwd": _total(ks, "forward"),
            "timer step": r.get("step_ms_mean"), "kernels step": _total(ks, "all"),
            "top fwd": f"{short_kernel_name(top_f['kernel'])} ({top_f['calls_per_step']:.0f}x)" if top_f else None,
            "top step": f"{short_kernel_name(top_all['kernel'])} ({top_all['calls_per_step']:.0f}x)"
            if top_all else None,
            "mm fwd": _matmul_share(ks, "forward"), "mm step": _matmul_share(ks, "all"),
        })
    return markdown_table(out, ["size", "ctx", "status", ("timer fwd", "fwd timer (ms)"),
                                ("kernels fwd", "fwd GPU kernels (ms)"),
                                ("timer step", "step timer (ms)"), ("kernels step", "step GPU kernels (ms)"),
                                ("top fwd", "top fwd kernel (calls/step)"), ("top step", "top fwd+bwd+opt kernel"),
                                ("mm fwd", "matmul share fwd"), ("mm step", "matmul share step")], floatfmt=".2f")


def table_kernels_forward(size: str = "small", ctx: int = 512) -> str:
    ks = [k for k in _kernels(size, ctx) if k["range"] == "forward" and k["kernel"] != "(total)"]
    out = [{"kernel": short_kernel_name(k["kernel"]), "class": kernel_class(k["kernel"]),
            "calls": k["calls_per_step"], "ms": k["total_ms_per_step"], "share": 100 * k["share_of_range"]}
           for k in ks]
    return markdown_table(out, ["kernel", "class", ("calls", "calls per fwd"), ("ms", "GPU ms per fwd"),
                                ("share", "% of fwd")], floatfmt=".2f")


def table_attention() -> str:
    out = []
    for r in by_size([r for r in rows("bench_profile") if r["mode"] == "train"]):
        ks = _kernels(r["size"], r["context_length"])
        scores, soft, final = (_total(ks, f"attention/{p}") for p in ("scores", "softmax", "final_matmul"))
        if None in (scores, soft, final):
            continue
        mm = sum(k["total_ms_per_step"] for k in ks if k["range"] in ("attention/scores", "attention/final_matmul")
                 and k["kernel"] != "(total)" and kernel_class(k["kernel"]) == "matmul")
        d = r["d_model"] // r["num_heads"]
        # Per (query, key) pair: QK^T and PV are 2d FLOPs each; softmax about 5 (max, sub, exp, sum, div).
        out.append({"size": r["size"], "ctx": r["context_length"], "scores": scores, "softmax": soft, "final": final,
                    "mm": mm, "time ratio": mm / soft, "flop ratio": 4 * d / 5})
    return markdown_table(out, ["size", "ctx", ("scores", "scores range (ms)"), ("softmax", "softmax range (ms)"),
                                ("final", "final matmul range (ms)"), ("mm", "the two matmuls (ms)"),
                                ("time ratio", "matmul / softmax time"), ("flop ratio", "matmul / softmax FLOPs")],
                          floatfmt=".2f")


def table_precision_sums() -> str:
    return markdown_table([r for r in rows("precision") if r["experiment"] == "accumulation"],
                          ["sum", "value", ("abs_error", "abs. error vs 10")], floatfmt=".6f")


def table_toy_dtypes() -> str:
    return markdown_table([r for r in rows("precision") if r["experiment"] == "toy_dtypes"],
                          ["what", "dtype", ("on_device", "device")], floatfmt=".1f")


def table_layernorm() -> str:
    return markdown_table([r for r in rows("precision") if r["experiment"] == "layernorm"],
                          [("input_scale", "input scale"), "dtype", ("sum_of_squares_finite", "sum of squares finite"),
                           ("max_abs_error", "max abs. error vs fp64"), ("output_finite", "output finite")],
                          floatfmt=".4g")


def table_memory() -> str:
    out = []
    for r in sorted(rows("bench_memory"), key=lambda r: (r["context_length"], r["mode"], r["checkpoint"], r["dtype"])):
        out.append({"ctx": r["context_length"], "mode": r["mode"], "dtype": r["dtype"], "status": r["status"],
                    "checkpoint": r["checkpoint"], "warm-up": r["warmup"],
                    "fwd": r.get("peak_forward_gib"), "bwd": r.get("peak_backward_gib"),
                    "opt": r.get("peak_optimizer_gib"), "peak": r.get("peak_step_gib")})
    return markdown_table(out, ["ctx", "mode", "dtype", "checkpoint", "warm-up", "status",
                                ("fwd", "peak in forward (GiB)"), ("bwd", "in backward"),
                                ("opt", "in optimizer"), ("peak", "peak (GiB)")], floatfmt=".1f")


def table_largest(ctx: int = 2048, dtype: str = "fp32") -> str:
    r = next((r for r in rows("bench_memory") if r["context_length"] == ctx and r["mode"] == "forward"
              and r["dtype"] == dtype and r.get("memory")), None)
    if r is None:
        return "(no memory snapshot rows)"
    return markdown_table(r["memory"]["largest"], [("size_mib", "size (MiB)"), ("count", "allocations of that size"),
                                                   ("where", "innermost frames in our code")], floatfmt=".1f")


def table_residuals() -> str:
    out = []
    for r in rows("residuals"):
        if r["experiment"] in ("block", "four-blocks", "rmsnorm"):
            out.append({"experiment": r["experiment"], "variant": r["variant"], "heads": r.get("num_heads"),
                        "mib": r["saved_mib"], "n": r["num_saved"]})
        elif r["experiment"] == "block-gradients":
            out.append({"experiment": "block gradients (fp32)", "variant": "-", "heads": r.get("num_heads"),
                        "mib": r["grad_mib"]})
    return markdown_table(out, ["experiment", "variant", ("heads", "heads"), ("mib", "MiB"),
                                ("n", "tensors saved")], floatfmt=".2f")


def table_residual_top5() -> str:
    out = []
    for r in rows("residuals"):
        if r["experiment"] == "block" and r.get("top5"):
            out += [{"heads": r["num_heads"], "op": t["op"], "mib": t["mib"], "share": 100 * t["share"]}
                    for t in r["top5"]]
    return markdown_table(out, ["heads", ("op", "module: saved by"), ("mib", "MiB"), ("share", "% of block")],
                          floatfmt=".1f")


def table_checkpoint() -> str:
    out = []
    for r in rows("bench_checkpoint"):
        out.append({"policy": r["checkpoint"], "status": r["status"], "fwd": r.get("peak_forward_gib"),
                    "bwd": r.get("peak_backward_gib"), "opt": r.get("peak_optimizer_gib"),
                    "fb": max(r.get("peak_forward_gib", 0), r.get("peak_backward_gib", 0)) or None,
                    "step": r.get("step_ms_median")})
    return markdown_table(out, ["policy", "status", ("fwd", "peak in fwd (GiB)"), ("bwd", "peak in bwd (GiB)"),
                                ("fb", "activation-phase peak"), ("opt", "peak in optimizer"),
                                ("step", "step (ms)")], floatfmt=".1f")


def table_gradients() -> str:
    path = RESULTS / "snapshots" / "memory_xl_ctx2048_train_fp32_ckpt-group1.pickle"
    if not path.exists():
        return "(snapshot missing)"
    sizes = memory.gradient_allocations(memory.load_snapshot(path))
    out = [{"size": size / 2**20, "count": n, "total": size * n / 2**20} for size, n in sizes.items()]
    out.append({"size": None, "count": sum(sizes.values()), "total": sum(s * n for s, n in sizes.items()) / 2**20})
    return markdown_table(out, [("size", "allocation (MiB)"), ("count", "count"), ("total", "total (MiB)")],
                          floatfmt=".2f")


TABLES: dict[str, dict[str, Callable[[], str]]] = {
    "02": {"sizes": table_sizes, "warmup": table_warmup, "profile": table_profile,
           "kernels_forward": table_kernels_forward, "attention": table_attention, "sums": table_precision_sums,
           "toy_dtypes": table_toy_dtypes, "layernorm": table_layernorm, "bf16": table_bf16,
           "memory": table_memory, "largest": table_largest, "residuals": table_residuals,
           "residual_top5": table_residual_top5, "gradients": table_gradients},
    "03": {"checkpoint": table_checkpoint},
    "04": {"compile": table_compile},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the tables instead of rewriting the sections")
    args = parser.parse_args()
    for section, tables in TABLES.items():
        built = {name: fn() for name, fn in tables.items()}
        if args.print:
            for name, table in built.items():
                print(f"## {section}/{name}\n{table}\n")
            continue
        path = SECTIONS[section]
        path.write_text(fill_tables(path.read_text(), built))
        print(f"wrote {len(built)} tables into {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
