"""The host-memory checks' figure for a spawned rank (``cs336_harness.resources.RANK_BASE_BYTES``) against what
``tools/rank_host_memory.py`` measured (``writeup/results/host_memory.jsonl``): it covers every measured rank, less
the tensors the commands' own checks count for it, and is not far above the largest."""

from __future__ import annotations

import json
from pathlib import Path

from cs336_harness.device import GIB
from cs336_harness.resources import RANK_BASE_BYTES

ROWS = Path(__file__).resolve().parents[1] / "writeup" / "results" / "host_memory.jsonl"


def _measured_bases() -> dict[str, float]:
    """Each measured run's per-rank memory besides the tensors its command's check counts, in GiB."""
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
    return {f"{r['run']}": max(r["rank_private_gib"], r["ranks_pss_gib"] / r["ranks"]) - r["rank_tensors_gib"]
            for r in rows}


def test_the_rank_figure_covers_every_measured_rank_and_is_close_to_the_largest() -> None:
    bases = _measured_bases()
    assert {run.split()[0] for run in bases} == {"ddp", "collectives"} and any(" 8 " in run for run in bases)
    largest = max(bases.values())
    assert largest <= RANK_BASE_BYTES / GIB <= 1.25 * largest, bases

