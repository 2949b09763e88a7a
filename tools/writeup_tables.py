"""The writeup's tables and figures from the rows, traces and snapshots in ``writeup/results/``: :data:`TABLES`,
:func:`fill_sections`, :func:`render_figures`. The report's machinery, beside the PDF's builder (``build_writeup.py``):
it reads the harness's rows and tables, and no command of the harness needs it.

Each table goes between ``<!-- table:NAME -->`` markers in a section file (see
:func:`cs336_harness.analysis.tables.fill_tables`); the prose around them is written by hand. The tables of the
sharding section come from ``cs336 shard --markdown ... --fill`` instead (writeup/README.md lists both).
``tools/harness_tables.py`` is the command over this module:

    uv run python tools/harness_tables.py            # rewrite the sections' tables in place
    uv run python tools/harness_tables.py --print    # print the tables instead
    uv run python tools/harness_tables.py --figures  # also re-render the figures in writeup/figures/
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cs336_basics.config import ModelConfig
from cs336_harness.analysis import figures, kernel_kinds, memory, trace
from cs336_harness.analysis.tables import fill_tables, markdown_table
from cs336_harness.analysis.trace import kernel_class, short_kernel_name
from cs336_harness.device import mfu
from cs336_harness.results import read_rows
from cs336_harness.studies import collectives as collectives_study
from cs336_harness.studies import ddp as ddp_study
from cs336_harness.studies.fused.report import latest_run
from cs336_harness.studies.leaderboard.flops import step_flops
from cs336_harness.studies.leaderboard.tables import proxy_rows

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "writeup" / "results"
FIGURES = ROOT / "writeup" / "figures"
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


def _trace_share(row: dict[str, Any], phase: str) -> float | None:
    """The matmul share of a phase's GPU kernel time over every kernel of the trace (None for a failed run)."""
    classes = (row.get("profile") or {}).get(f"{phase}_kernel_classes")
    if not classes:
        return None
    return classes.get("share_matmul", classes.get("matmul"))


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
            "mm fwd": _trace_share(r, "forward"), "mm step": _trace_share(r, "step"),
        })
    return markdown_table(out, ["size", "ctx", "status", ("timer fwd", "fwd timer (ms)"),
                                ("kernels fwd", "fwd GPU kernels (ms)"),
                                ("timer step", "step timer (ms)"), ("kernels step", "step GPU kernels (ms)"),
                                ("top fwd", "top fwd kernel (calls/step)"), ("top step", "top fwd+bwd+opt kernel"),
                                ("mm fwd", "matmul share fwd"), ("mm step", "matmul share step")], floatfmt=".2f")


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


def table_residual_top5() -> str:
    out = []
    for r in rows("residuals"):
        # Our xl block (32 heads); the handout's 16-head variant is quoted in the text.
        if r["experiment"] == "block" and r.get("top5") and r["num_heads"] == 32:
            out += [{"heads": r["num_heads"], "op": t["op"], "mib": t["mib"], "share": 100 * t["share"]}
                    for t in r["top5"]]
    return markdown_table(out, [("op", "module: saved by"), ("mib", "MiB"), ("share", "% of block")],
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


# ------------------------------------------------------------------------------------------- section 4

def _ms(r: dict[str, Any] | None, key: str) -> str:
    """A time in ms to 3 significant digits; "OOM" where that measurement ran out of memory, "-" where not run."""
    if r is None or r.get(key) is None:
        return "OOM" if r is not None and r.get("status") == "oom" else "-"
    return f"{r[key]:.3g}"


def table_attention_plain() -> str:
    """Plain PyTorch attention, eager and compiled, one line per (d, seq); the latest row of each wins."""
    by = {(r["bench"], r["d"], r["seq"]): r for r in rows("attention_pytorch")}
    out = []
    for d, seq in sorted({(d, seq) for _, d, seq in by}):
        e, c = by.get(("pytorch", d, seq)), by.get(("compiled", d, seq))
        out.append({"d": d, "seq": seq, "efwd": _ms(e, "fwd_ms"), "ebwd": _ms(e, "bwd_ms"),
                    "emem": _ms(e, "mem_before_bwd_gib"), "esaved": _ms(e, "saved_for_bwd_gib"),
                    "cfwd": _ms(c, "fwd_ms"), "cbwd": _ms(c, "bwd_ms"), "csaved": _ms(c, "saved_for_bwd_gib")})
    return markdown_table(out, ["d", "seq", ("efwd", "eager fwd (ms)"), ("ebwd", "eager bwd (ms)"),
                                ("emem", "eager memory before bwd (GiB)"), ("esaved", "eager saved by one fwd (GiB)"),
                                ("cfwd", "compiled fwd (ms)"), ("cbwd", "compiled bwd (ms)"),
                                ("csaved", "compiled saved by one fwd (GiB)")])


def _flash(dtype: str) -> Callable[[], str]:
    def table() -> str:
        """Ours, plain PyTorch and SDPA at one dtype, one line per (d, seq); the latest row of each wins."""
        by = {(r["impl"], r["d"], r["seq"]): r for r in rows("attention_flash") if r["dtype"] == dtype}
        out = []
        for d, seq in sorted({(d, seq) for _, d, seq in by}):
            line: dict[str, Any] = {"d": d, "seq": seq}
            for impl, name in (("triton", "ours"), ("pytorch", "plain")):
                for mode in ("fwd", "bwd", "fwd_bwd"):
                    line[f"{name} {mode}"] = _ms(by.get((impl, d, seq)), f"{mode}_ms")
            line["sdpa"] = _ms(by.get(("sdpa", d, seq)), "fwd_bwd_ms")
            out.append(line)
        modes = {"fwd": "fwd", "bwd": "bwd", "fwd_bwd": "f+b"}
        return markdown_table(out, ["d", "seq", *((f"{n} {m}", f"{n} {h}") for n in ("ours", "plain")
                                                  for m, h in modes.items()), ("sdpa", "SDPA f+b")])
    return table


# ------------------------------------------------------------------------------------------- section 5

def _collectives(op: str) -> Callable[[], str]:
    return lambda: collectives_study.collectives_markdown(rows("collectives"), op)


DDP_SHOWN = ("variant", "step_ms", "step_max_ms", "overhead_ms", "comm_ms", "exposed_comm_ms", "exposed_share",
             "sync_tail_ms", "peak_mem_gib", "params_in_sync")


def table_ddp(dtype: str = "fp32") -> str:
    headers = dict(zip(ddp_study.DDP_COLUMNS, ddp_study.DDP_HEADERS, strict=True))
    return markdown_table([r for r in rows("ddp") if r["dtype"] == dtype], [(c, headers[c]) for c in DDP_SHOWN])


# ------------------------------------------------------------------------------------------- section 9

# NVIDIA's data-sheet peak for dense BF16 on an H200 SXM; the harness's MFU uses the measured 772 TFLOP/s.
H200_DATASHEET_BF16_FLOPS = 989e12


# How the leaderboard rows' settings read in the writeup's tables.
SHOWN_AS = {
    "attention": {"triton": "ours", "sdpa": "SDPA"},
    "glue": {"triton": "ours", "model": "model code", "compiled": "torch.compile"},
    "impl": {"ours": "ours", "torch_native": "PyTorch plain", "torch_native_compiled": "PyTorch strong"},
    "optimizer": {"fused": "ours", "fused-adamw": "ours", "torch": "torch fused", "torch-adamw": "torch fused"},
}


def _shown(r: dict[str, Any]) -> dict[str, Any]:
    return {**r, **{k: names.get(r[k], r[k]) for k, names in SHOWN_AS.items() if k in r}}


def _measured(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rs if r.get("kind") != "prediction"]


def model_flops(row: dict[str, Any]) -> float:
    """The model FLOPs of a leaderboard row's step (:func:`~cs336_harness.studies.leaderboard.flops.step_flops` of its
    shape), computed rather than read from its ``model_flops_per_step`` so that every row counts by one formula (the
    older rows counted FlashAttention's recomputed scores too)."""
    shape = ModelConfig(**{k: row[k] for k in ("d_model", "d_ff", "num_layers", "num_heads", "vocab_size",
                                               "context_length")})
    return step_flops(shape, row["global_batch"])


def row_mfu(row: dict[str, Any]) -> float | None:
    """A leaderboard row's model FLOPs utilisation against the measured ceiling of the GPU it names."""
    gpu = re.sub(r"^\d+x ", "", row["device"])  # "2x NVIDIA H200": the host's GPUs, one kind
    return mfu(model_flops(row), row["step_s"], row["world_size"], gpu)


def table_two_gpu() -> str:
    """Our two-GPU rows of the leaderboard configuration, fastest first, MFU against both peaks."""
    picked = [r for r in _measured(rows("leaderboard")) if r.get("status") == "ok" and r["world_size"] == 2
              and r["size"] == "8B" and r["global_batch"] == 2 and r["context_length"] == 32768]
    out = [{**_shown(r), "date": r["date"][:10], "mfu": row_mfu(r), "datasheet": model_flops(r) / r["step_s"]
            / (r["world_size"] * H200_DATASHEET_BF16_FLOPS)} for r in sorted(picked, key=lambda r: r["step_s"])]
    return markdown_table(out, ["attention", ("checkpoint", "checkpointing"), ("optimizer", "AdamW"),
                                ("step_s", "step (s)"), ("mfu", "MFU (772)"), ("datasheet", "MFU (989)"),
                                ("peak_step_gib", "peak (GiB)"), ("date", "date (UTC)")], floatfmt=".4g")


def _proxy() -> list[dict[str, Any]]:
    """The one-GPU proxy rows by run, fastest first, each with its step over the same run's strong and plain
    PyTorch-only baselines (``vs_strong``, ``vs_plain``)."""
    return proxy_rows(_measured(rows("leaderboard_proxy")))


PROXY_SHOWN = [("impl", "impl"), ("attention", "attention"), ("glue", "glue"), ("checkpoint", "checkpointing"),
               ("step_s", "step (s)"), ("vs_strong", "vs strong"), ("vs_plain", "vs plain"),
               ("peak_step_gib", "peak (GiB)")]


def _proxy_columns(rs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    timed = [("handout_do_bench_s", "do_bench (s)")] if any(r.get("handout_do_bench_s") for r in rs) else []
    return PROXY_SHOWN[:5] + timed + PROXY_SHOWN[5:]


def table_proxy_latest() -> str:
    """The latest proxy run with ours and both baselines: its rows."""
    proxy = _proxy()
    impls: dict[str, set[str]] = {}
    for r in proxy:
        impls.setdefault(str(r.get("call_id")), set()).add(r["impl"])
    latest = max(call for call, found in impls.items() if {"ours", "torch_native", "torch_native_compiled"} <= found)
    shown = [_shown(r) for r in proxy if str(r.get("call_id")) == latest]
    return markdown_table(shown, _proxy_columns(shown), floatfmt=".4g")


def table_prediction() -> str:
    """The latest prediction row (``tools/predict_leaderboard.py``): the proxy scaled by layers against each two-GPU
    step it is checked on, then the predicted step."""
    (*_, row) = (r for r in rows("leaderboard") if r.get("kind") == "prediction" and "calibration" in r)
    scaled = f"{row['predicted_step_s']:.3f} (predicted)"
    checks = [{"impl": "ours", **p, "two_gpu": p["two_gpu_step_s"]} for p in row["calibration"]]
    checks.append({"impl": "torch_native", "attention": "sdpa", "glue": "model", "checkpoint": "all",
                   **row["plain_check"], "two_gpu": f"{row['plain_check']['two_gpu_reference_s']} (not a row)"})
    out = [{**_shown(c), "error": f"{c['error']:+.1%}"} for c in checks]
    out.append({**_shown({"impl": "ours", "attention": "triton", "glue": "triton"}),
                "checkpoint": row["proxy_checkpoint"], "proxy_step_s": row["proxy_step_s"],
                "scaled_step_s": row["predicted_step_s_layers"], "two_gpu": scaled})
    return markdown_table(out, [("impl", "impl"), ("attention", "attention"), ("glue", "glue"),
                                ("checkpoint", "checkpointing"), ("proxy_step_s", "proxy (s)"),
                                ("scaled_step_s", "proxy × 34/14 (s)"), ("two_gpu", "two GPUs (s)"),
                                ("error", "scaling's error")], floatfmt=".4g")


# ------------------------------------------------------------------------------------------- appendix

def _anchor_shape(r: dict[str, Any]) -> tuple[int, int, int, int]:
    return r["batch"], r["heads"], r["seq"], r["d"]


def _kept_anchors() -> list[dict[str, Any]]:
    """The anchors rows of the kernels that were kept: a row with a ``variant`` timed a change that was not, beside
    them in the same call."""
    return [r for r in rows("attention_anchors") if not r.get("variant")]


def table_anchors() -> str:
    """Our attention against library kernels: per shape, the latest call that timed our kept kernels there (one row
    per implementation of that call)."""
    anchors = [r for r in _kept_anchors() if r.get("bench") == "anchors" and r.get("impl") in (
        "ours", "ours_deterministic", "triton", "sdpa", "sdpa_flash", "flex")]
    latest: dict[tuple[int, int, int, int], str] = {}
    for r in anchors:
        if r["impl"] == "ours":
            latest[_anchor_shape(r)] = max(latest.get(_anchor_shape(r), ""), r.get("call_id") or "")
    # A run may time an implementation at a shape twice (a second pass beside the deterministic modes): its last row.
    last = {(*_anchor_shape(r), r["impl"]): r for r in anchors
            if _anchor_shape(r) in latest and (r.get("call_id") or "") == latest[_anchor_shape(r)]}
    picked = sorted(last.values(), key=lambda r: (-r["seq"] * r["d"] * r["batch"], r["fwd_bwd_ms"]))
    names = {"ours": "ours (default)", "ours_deterministic": "ours, deterministic mode",
             "triton": "ours, Triton backward", "sdpa": "SDPA (cuDNN)",
             "sdpa_flash": "SDPA flash backend", "flex": "FlexAttention"}
    out = [{"shape": f"({r['batch']},{r['heads']},{r['seq']},{r['d']})", "impl": names[r["impl"]],
            "fwd": r["fwd_ms"], "bwd": r["bwd_ms"], "fb": r["fwd_bwd_ms"]} for r in picked]
    return markdown_table(out, [("shape", "(b,h,s,d)"), "impl", ("fwd", "fwd (ms)"), ("bwd", "bwd (ms)"),
                                ("fb", "fwd+bwd (ms)")], floatfmt=".3g")


def table_anchors_fa4() -> str:
    """Ours, cuDNN and FlashAttention-4 forward + backward from the latest call that timed FA4, with our time over
    FA4's in that call: ours as that call ran it, its kept kernels where it also timed a change (rows with a
    ``variant``), else the kernels it timed, which a later change replaced."""
    timed = [r for r in rows("attention_anchors") if r.get("status") == "ok" and "fwd_bwd_ms" in r]
    latest = max(r["call_id"] for r in timed if r["impl"] == "fa4")
    in_call = sorted((r for r in timed if r.get("call_id") == latest), key=lambda r: not r.get("variant"))
    last = {(*_anchor_shape(r), r["impl"]): r for r in in_call}  # kept rows last, so they win
    out = []
    for b, h, seq, d in dict.fromkeys(key[:4] for key in last):
        ms = {impl: last[(b, h, seq, d, impl)]["fwd_bwd_ms"] for impl in ("ours", "sdpa", "fa4")}
        out.append({"shape": f"({b},{h},{seq},{d})", **ms, "ratio": ms["ours"] / ms["fa4"]})
    return markdown_table(out, [("shape", "(b,h,s,d)"), ("ours", "ours (ms)"), ("sdpa", "cuDNN (ms)"),
                                ("fa4", "FA4 (ms)"), ("ratio", "ours / FA4")], floatfmt=".3g")


_VARLEN_IMPLS = {"ours": "ours", "ours_per_document": "ours, each document alone", "flex": "FlexAttention",
                 "sdpa_varlen": "torch varlen", "fa4": "FA4"}


def table_varlen_window() -> str:
    """Packed documents and a sliding window (``cs336 attention --part varlen`` and ``--part window``), each from its
    latest call: forward, backward and both per implementation, and ours over each in that call."""
    out = []
    for bench, case in (("varlen", "packed"), ("window", "window")):
        timed = [r for r in rows("attention_varlen") if r["bench"] == bench and r.get("status") == "ok"]
        latest = max(r["call_id"] for r in timed)
        in_call = {r["impl"]: r for r in timed if r["call_id"] == latest}
        ours = in_call["ours"]["fwd_bwd_ms"]
        out += [{"case": case, "impl": _VARLEN_IMPLS[impl], "fwd": r["fwd_ms"], "bwd": r["bwd_ms"],
                 "fb": r["fwd_bwd_ms"], "ratio": ours / r["fwd_bwd_ms"]} for impl, r in in_call.items()]
    return markdown_table(out, [("case", "case"), ("impl", "impl"), ("fwd", "fwd (ms)"), ("bwd", "bwd (ms)"),
                                ("fb", "fwd+bwd (ms)"), ("ratio", "ours / its time")], floatfmt=".3g")


def table_hf() -> str:
    """The Hugging Face training step (``cs336 hf``) of each model from the latest call of each layout (packed, and
    batched: a row each): with Liger-Kernel's patch and with ours ("OOM" where a step ran out of memory); HF as it
    comes (SDPA) only where it ran, since the section says where it did not."""
    hf = rows("hf_step")
    out = []
    for layout in ("packed", "batched"):
        timed = [r for r in hf if r["layout"] == layout]
        latest = max(r["call_id"] for r in timed)
        out += [{"model": r["model"], "layout": layout, "impl": r["impl"],
                 **({"ms": r["step_ms"], "tps": round(r["tokens_per_s"]), "peak": r["peak_gib"]}
                    if r["status"] == "ok" else {"ms": "OOM"})}
                for r in timed if r["call_id"] == latest and (r["impl"] != "sdpa" or r["status"] == "ok")]
    return markdown_table(out, [("model", "model"), ("layout", "layout"), ("impl", "impl"), ("ms", "step (ms)"),
                                ("tps", "tokens/s"), ("peak", "peak (GiB)")], floatfmt=".4g")


def table_proxy_breakdown() -> str:
    """GPU kernel time by kind in each implementation's latest profiled run, its fastest profiled row there (ours
    against the strong baseline), each column named by its checkpointing policy."""
    profiled = sorted((r for r in _proxy() if r.get("breakdown")), key=lambda r: str(r.get("call_id")))
    latest: dict[str, str] = {}
    for r in profiled:
        latest[_shown(r)["impl"]] = str(r.get("call_id"))
    fastest: dict[str, dict[str, Any]] = {}
    for r in profiled:  # within a run, _proxy() lists the rows fastest first
        if str(r.get("call_id")) == latest[_shown(r)["impl"]]:
            fastest.setdefault(_shown(r)["impl"], r)
    picked = list(fastest.values())
    labels = [f"{_shown(r)['impl']}, {r['checkpoint']}" for r in picked]
    return kernel_kinds.breakdown_markdown(picked, labels)


def table_adamw() -> str:
    """The latest AdamW run: ours at its default launch, and torch's (the other launches are in the rows)."""
    return markdown_table([r for r in latest_run(rows("fused"), "adamw") if "elements/program" not in r["impl"]],
                          [("impl", "implementation"), ("median_ms", "median (ms)"),
                           ("speedup_vs_torch_fused", "vs torch fused"), ("floor_fraction", "bytes floor / time"),
                           ("achieved_tbps", "TB/s moved")])


def table_lm_head() -> str:
    """The latest LM-head run: ours at its default chunk and at the chunk that holds as much as Liger-Kernel's, and
    the others (every chunk size timed is in the rows)."""
    return markdown_table([r for r in latest_run(rows("fused"), "linear_ce") if r["impl"] != "fused, chunk 4096"],
                          [("impl", "implementation"), ("median_ms", "median (ms)"), ("speedup_vs_torch", "vs plain"),
                           ("extra_gib", "peak above inputs+grads (GiB)"), ("loss_rel_err", "loss rel. err"),
                           ("grad_weight_rel_err", "grad W rel. err")])


def table_glue() -> str:
    """One line per glue op from its latest call in ``kernel_limits`` that timed ours: each implementation's forward +
    backward, the GPU's time alone (CUDA-graph replays) where the call measured it, else do_bench's (host included),
    and ours against a copy of the same bytes."""
    glue = [r for r in rows("kernel_limits") if r.get("bench") == "glue" and r.get("part") == "fwd+bwd"]
    out = []
    for op in dict.fromkeys(r["op"] for r in glue):
        timed_ours = [r for r in glue if r["op"] == op and r["impl"] == "ours" and "ms" in r]
        if not timed_ours:
            continue
        call_id = max(timed_ours, key=lambda r: r["date"])["call_id"]
        call = [r for r in glue if r["op"] == op and r["call_id"] == call_id and "ms" in r]
        graph = all("graph_ms" in r for r in call if r["impl"] != "copy")
        line: dict[str, Any] = {"op": op.replace("_", " "), "timing": "GPU alone" if graph else "do_bench"}
        for r in call:
            line[r["impl"]] = r["graph_ms" if graph and r["impl"] != "copy" else "ms"]
            if r["impl"] == "ours":
                line["vs_copy"] = r["graph_vs_copy" if graph else "vs_copy"]
        out.append(line)
    return markdown_table(out, ["op", "timing", ("ours", "ours (ms)"), ("torch_compile", "torch.compile"),
                                ("liger", "Liger"), ("quack", "QuACK"), ("copy", "copy (ms)"),
                                ("vs_copy", "ours vs copy")])


TABLES: dict[str, dict[str, Callable[[], str]]] = {
    "02": {"sizes": table_sizes, "warmup": table_warmup, "profile": table_profile,
           "attention": table_attention, "sums": table_precision_sums,
           "toy_dtypes": table_toy_dtypes, "layernorm": table_layernorm, "bf16": table_bf16,
           "memory": table_memory, "residual_top5": table_residual_top5,
           "gradients": table_gradients},
    "03": {"checkpoint": table_checkpoint},
    "04": {"plain_attention": table_attention_plain, "compile": table_compile, "flash_bf16": _flash("bf16"),
           "flash_fp32": _flash("fp32")},
    "05": {"all_reduce": _collectives("all_reduce"), "reduce_scatter": _collectives("reduce_scatter"),
           "all_gather": _collectives("all_gather"), "ddp": table_ddp},
    "09": {"two_gpu": table_two_gpu, "proxy_latest": table_proxy_latest, "prediction": table_prediction},
    "10": {"anchors": table_anchors, "anchors_fa4": table_anchors_fa4, "varlen_window": table_varlen_window,
           "hf": table_hf, "proxy_breakdown": table_proxy_breakdown,
           "adamw": table_adamw, "lm_head": table_lm_head, "glue": table_glue},
}


# ------------------------------------------------------------------------------------------- figures

MEMORY_FIGURES = {
    "memory_xl_ctx128_forward_fp32": "xl, forward pass (no_grad), context 128, fp32",
    "memory_xl_ctx128_train_fp32": "xl, training step, context 128, fp32",
    "memory_xl_ctx2048_forward_fp32": "xl, forward pass (no_grad), context 2048, fp32",
    "memory_xl_ctx2048_train_fp32_oom": "xl, training step, context 2048, fp32: out of memory in the forward",
    "memory_xl_ctx2048_train_fp32_ckpt-group1": "xl, training step, context 2048, fp32, every block checkpointed",
}


def render_figures() -> list[Path]:
    """Re-render the figures whose sources are committed: the profiled step's timeline, the memory timelines
    and the collectives plots."""
    events = trace.load_trace(RESULTS / "traces" / "trace_small_ctx512_train_fp32_annotated.json.gz")
    out = [figures.plot_timeline(events, FIGURES / "profile_timeline_small_ctx512_train.png",
                                 title="small, context 512, fp32: one profiled training step")]
    for stem, title in MEMORY_FIGURES.items():
        snapshot = memory.load_snapshot(RESULTS / "snapshots" / f"{stem}.pickle")
        out.append(figures.plot_active_memory(snapshot, FIGURES / f"{stem.replace('-', '_')}.png", title=title))
    coll = rows("collectives")
    out.append(figures.plot_collectives([r for r in coll if r["backend"] == "nccl"], FIGURES / "collectives_nccl.png"))
    out.append(figures.plot_collectives([r for r in coll if r["backend"] == "gloo"],
                                        FIGURES / "collectives_gloo_cpu.png"))
    return out


def build_tables() -> dict[str, dict[str, str]]:
    """Every table of :data:`TABLES`, built from the rows: section -> marker name -> markdown."""
    return {section: {name: fn() for name, fn in tables.items()} for section, tables in TABLES.items()}


def fill_sections(built: dict[str, dict[str, str]]) -> list[Path]:
    """Write ``built`` (:func:`build_tables`) between the markers of each section file (``writeup/sections/NN-*.md``);
    the files written."""
    written = []
    for section, tables in built.items():
        (path,) = (ROOT / "writeup" / "sections").glob(f"{section}-*.md")
        path.write_text(fill_tables(path.read_text(), tables))
        written.append(path)
    return written
