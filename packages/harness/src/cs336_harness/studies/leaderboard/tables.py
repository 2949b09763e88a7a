"""Tables of leaderboard rows: the printed columns, the one-GPU proxy rows against their call's baselines
(:func:`proxy_rows`) and the writeup's tables (:func:`writeup_tables`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from cs336_harness.analysis import kernel_kinds
from cs336_harness.analysis.tables import markdown_table

TABLE_COLUMNS = ("impl", "num_layers", "world_size", "compute_dtype", "attention", "glue", "checkpoint", "optimizer",
                 "loss", "step_s", "step_max_s", "tokens_per_s", "mfu", "peak_step_gib", "memory_cap_gib")

_WRITEUP_COLUMNS = ("attention", "checkpoint", "optimizer", "step_s", "step_max_s", "tokens_per_s", "mfu",
                    "peak_init_gib", "peak_step_gib", "commit")
_WRITEUP_HEADERS = ("attention", "checkpointing", "AdamW", "step (s)", "slowest step (s)", "tokens/s", "MFU",
                    "peak at init (GiB)", "peak in step (GiB)", "commit")
_PROXY_COLUMNS = (("impl", "impl"), ("attention", "attention"), ("glue", "glue"), ("compile_blocks", "compiled blocks"),
                  ("fused_qkv", "one qkv matmul"), ("checkpoint", "checkpointing"), ("step_s", "step (s)"),
                  ("vs_strong", "vs strong"), ("vs_plain", "vs plain"), ("peak_step_gib", "peak (GiB)"),
                  ("memory_cap_gib", "cap (GiB)"), ("expected_peak_gib", "expected peak (GiB)"),
                  ("glue_share", "glue share"), ("call_id", "call"))


def _is_proxy(row: dict[str, Any]) -> bool:
    return (row.get("status") == "ok" and row["world_size"] == 1 and row["size"] == "8B"
            and row["context_length"] == 32768 and row["compute_dtype"] == "bf16")


def proxy_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The one-GPU proxy rows (8B blocks, world size 1, context 32768, bf16), each with its step time over the same
    call's strong and plain baselines (``vs_strong``, ``vs_plain``; None without that baseline in the call) and its
    glue share when profiled; by call, fastest first."""
    by_call: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if _is_proxy(r):
            by_call[r.get("call_id")].append(r)
    out = []
    for call in sorted(by_call, key=str):
        call_rows = sorted(by_call[call], key=lambda r: r["step_s"])
        baseline = {impl: min((r["step_s"] for r in call_rows if r.get("impl") == impl), default=None)
                    for impl in ("torch_native", "torch_native_compiled")}
        for r in call_rows:
            strong, plain = baseline["torch_native_compiled"], baseline["torch_native"]
            out.append({**r, "vs_strong": r["step_s"] / strong if strong else None,
                        "vs_plain": r["step_s"] / plain if plain else None,
                        "glue_share": (r.get("breakdown") or {}).get("glue_share")})
    return out


def _label(row: dict[str, Any]) -> str:
    if row.get("impl", "ours") != "ours":
        return row["impl"]
    extras = [row["glue"], row["checkpoint"], *(["compiled"] if row.get("compile_blocks") else []),
              *(["qkv"] if row.get("fused_qkv") else [])]
    return f"ours ({row['attention']}, {', '.join(extras)})"


def writeup_tables(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The writeup's tables by marker name: ``leaderboard``, our rows of the leaderboard configuration (8B, context
    32768, batch 2, two ranks, bf16) fastest first; ``leaderboard_proxy``, the one-GPU proxy rows against their
    call's baselines (:func:`proxy_rows`); ``leaderboard_breakdown``, the GPU time by kind of the latest profiled
    proxy row of each configuration: the latest call's first, then older ones (so a "before" stays in the table),
    each of those labelled with its call. A table without rows is left out (its marker keeps what it has)."""
    chosen = [r for r in rows if (r["size"], r["context_length"], r["global_batch"], r["world_size"],
                                  r["compute_dtype"]) == ("8B", 32768, 2, 2, "bf16") and r.get("status") == "ok"
              and r.get("impl", "ours") == "ours"]
    chosen.sort(key=lambda r: r["step_s"])
    proxy = proxy_rows(rows)
    by_label: dict[str, dict[str, Any]] = {}
    for r in sorted((r for r in proxy if r.get("breakdown")), key=lambda r: str(r.get("call_id"))):
        by_label[_label(r)] = r
    latest = max((str(r.get("call_id")) for r in by_label.values()), default=None)
    profiled = sorted(by_label.items(), key=lambda item: str(item[1].get("call_id")) != latest)
    tables = {}
    if chosen:
        tables["leaderboard"] = markdown_table(chosen, list(zip(_WRITEUP_COLUMNS, _WRITEUP_HEADERS, strict=True)),
                                               floatfmt=".4g")
    if proxy:
        # Spaces for underscores, so that a narrow PDF column can wrap the baselines' names.
        shown = [{**r, "impl": r["impl"].replace("_", " ")} for r in proxy]
        tables["leaderboard_proxy"] = markdown_table(shown, _PROXY_COLUMNS, floatfmt=".4g")
    if profiled:
        labels = [label if str(r.get("call_id")) == latest else f"{label}, call {r.get('call_id')}"
                  for label, r in profiled]
        tables["leaderboard_breakdown"] = kernel_kinds.breakdown_markdown([r for _, r in profiled], labels)
    return tables
