"""The memory plan and the fake-tensor count of each proxy configuration of ours that a GPU measured: one row of
``kind: trace`` per configuration (not a GPU measurement), next to the allocator's peak in the latest row that
measured it (its call id and commit; the row's code may predate the plan's and the count's commit).

For each ``writeup/results/leaderboard_proxy.jsonl`` row that ``traceable`` accepts (ours on one rank, eager),
the config the row ran (its policy resolved) is traced on fake tensors (``traced_peak``) and planned
(``memory_plan``); a last row has what the proxy's ``budget`` policy picks at the 92 GiB cap, with its block memory.

    uv run python tools/trace_proxy_memory.py      # writes the rows to writeup/results/memory_trace.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from cs336_harness.device import GIB
from cs336_harness.memory_plan import memory_plan
from cs336_harness.results import append_rows, provenance, read_rows
from cs336_harness.studies.leaderboard import PROXY_DEFAULTS, LeaderboardConfig, traceable, traced_peak

RESULTS = Path(__file__).resolve().parents[1] / "writeup" / "results"
_FIELDS = {f.name for f in dataclasses.fields(LeaderboardConfig)}
_SHOWN = ("num_layers", "context_length", "checkpoint", "glue", "attention", "fused_qkv")  # what decides memory


def trace_rows() -> list[dict]:
    latest: dict[tuple, tuple[LeaderboardConfig, dict]] = {}
    for row in read_rows(RESULTS / "leaderboard_proxy.jsonl"):
        if row.get("status") != "ok":
            continue
        fields = {k: v for k, v in row.items() if k in _FIELDS}
        fields.update(checkpoint=row["checkpoint"], backend="nccl", memory_cap_gib=None, profile=False)
        cfg = LeaderboardConfig(**fields)
        if not traceable(cfg.train_config()):
            continue
        key = tuple(getattr(cfg, k) for k in _SHOWN)
        if key not in latest or row["date"] > latest[key][1]["date"]:
            latest[key] = (cfg, row)
    out = []
    for cfg, row in latest.values():
        train = cfg.train_config()
        traced = traced_peak(train).peak_bytes / GIB
        planned = memory_plan(train, None).expected_peak_bytes / GIB
        out.append({
            "kind": "trace", "what": "the step's peak (GiB) counted on fake tensors, and the memory plan's",
            "config": {k: getattr(cfg, k) for k in _SHOWN},
            "traced_peak_gib": traced, "planned_peak_gib": planned,
            "measured_peak_gib": row["peak_step_gib"], "measured_call_id": row.get("call_id"),
            "measured_commit": row.get("commit"), "measured_minus_traced_gib": row["peak_step_gib"] - traced,
        })
    budget = LeaderboardConfig(**{**PROXY_DEFAULTS, "backend": "nccl", "glue": "triton", "checkpoint": "budget",
                                  "memory_cap_gib": 92.0})
    plan = memory_plan(budget.train_config(), None)
    out.append({
        "kind": "trace", "what": "the proxy's budget policy at a 92 GiB cap: its peak on fake tensors and planned",
        "config": {**{k: getattr(budget, k) for k in _SHOWN}, "checkpoint": str(plan.policy)},
        "traced_peak_gib": traced_peak(budget.train_config()).peak_bytes / GIB,
        "planned_peak_gib": plan.expected_peak_bytes / GIB,
        "block_gib": {k: v / GIB for k, v in dataclasses.asdict(plan.step.block).items()},
    })
    return out


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options; --help
    meta = provenance()  # before the file changes, so the commit is named clean
    rows = trace_rows()
    path = RESULTS / "memory_trace.jsonl"
    path.unlink(missing_ok=True)  # derived rows: each run replaces them
    append_rows(path, rows, meta)
    for r in rows:
        print(json.dumps({k: r.get(k) for k in ("config", "traced_peak_gib", "planned_peak_gib", "measured_peak_gib")}))
