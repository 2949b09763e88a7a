"""A prediction of the two-GPU leaderboard step from the latest one-GPU proxy run: one row of ``kind: prediction``.

Two methods, both scaling the proxy's step (ours, the ``budget`` policy, the latest run of
``writeup/results/leaderboard_proxy.jsonl``) to the two-GPU step:

- ``ratio``: by the ratio the 30 Nov code showed between its two-GPU step (the 6.804 s row of
  ``writeup/results/leaderboard.jsonl``) and its proxy (2.85 s, a reference measurement of the project, not a row:
  ``PROXY_30_NOV_S``);
- ``layers``: by the ratio of layers, 34 / 14 (the proxy does one rank's work per layer).

Both assume that communication hides behind compute as on 30 Nov and that the policy sized on the proxy fits a rank
with 34 layers; the row says so. Predictions never enter the tables of measurements (``tools/writeup_tables.py``
leaves out ``kind: prediction``).

    uv run python tools/predict_leaderboard.py          # appends the row to writeup/results/leaderboard.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cs336_harness.results import append_rows, read_rows

RESULTS = Path(__file__).resolve().parents[1] / "writeup" / "results"
PROXY_30_NOV_S = 2.85
TWO_GPU_30_NOV_S = 6.804  # the row it is read from must exist (checked below)
LAYERS, PROXY_LAYERS = 34, 14


def predict() -> dict:
    """The prediction row from the rows on disk."""
    two_gpu = [r for r in read_rows(RESULTS / "leaderboard.jsonl")
               if r.get("kind") != "prediction" and round(r.get("step_s", 0), 3) == TWO_GPU_30_NOV_S]
    if not two_gpu:
        raise ValueError(f"no two-GPU row with step_s {TWO_GPU_30_NOV_S} in {RESULTS / 'leaderboard.jsonl'}")
    proxy = [r for r in read_rows(RESULTS / "leaderboard_proxy.jsonl")
             if r.get("impl") == "ours" and r.get("checkpoint_requested") == "budget" and r.get("status") == "ok"]
    if not proxy:
        raise ValueError("no proxy row of ours with the budget policy")
    latest = max(proxy, key=lambda r: r["date"])
    step = latest["step_s"]
    return {
        "kind": "prediction", "what": "two-GPU leaderboard step (8B, context 32768, batch 2), seconds",
        "predicted_step_s": step * TWO_GPU_30_NOV_S / PROXY_30_NOV_S,
        "predicted_step_s_layers": step * LAYERS / PROXY_LAYERS,
        "method": (f"proxy step x {TWO_GPU_30_NOV_S} / {PROXY_30_NOV_S} (the 30 Nov two-GPU step over that code's "
                   f"proxy, a reference measurement); and proxy step x {LAYERS} / {PROXY_LAYERS} layers"),
        "assumes": ("communication hidden behind compute as on 30 Nov; the budget policy sized on the proxy fits 34 "
                    "layers"),
        "proxy_step_s": step, "proxy_call_id": latest.get("call_id"), "proxy_commit": latest.get("commit"),
        "two_gpu_row_date": two_gpu[0]["date"], "two_gpu_row_commit": two_gpu[0].get("commit"),
    }


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options; --help
    row = predict()
    append_rows(RESULTS / "leaderboard.jsonl", [row])
    print(json.dumps({k: row[k] for k in ("predicted_step_s", "predicted_step_s_layers", "proxy_step_s")}))
