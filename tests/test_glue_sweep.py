"""tools/glue_sweep.py on CPU (the kernels in Triton's interpreter, fake timings, fewer candidates): every candidate
runs, the rows of the three passes carry what the lead reads off them, and the best launch of each direction is
the fastest of pass 2, compared with the default."""

from __future__ import annotations

import pytest
import torch
from cs336_kernels.ops.rms_norm import Launch, launch_settings
from tool_modules import load_tool


@pytest.fixture
def glue_sweep(monkeypatch):
    module = load_tool("glue_sweep")
    monkeypatch.setattr(module, "SHAPES", {"fwd": ((1, 4), (2, 8)), "bwd": ((1, 8), (2, 16))})
    monkeypatch.setattr(module, "STAGES", (1, 3))
    monkeypatch.setattr(module, "PROGRAMS_PER_SM", {"fwd": (1, 4), "bwd": (2,)})
    return module


def _launch(row: dict) -> Launch:
    return Launch(row["block_rows"], row["num_warps"], row["programs_per_sm"], row["stages"])


@pytest.mark.slow
def test_sweep_rows_on_cpu(glue_sweep):
    rows, d = 23, 64  # at d = 64 the defaults batch 64 rows per block: not a candidate, timed besides them
    inputs = glue_sweep.make_inputs(rows, d, "cpu")
    gen = torch.Generator().manual_seed(0)

    def fake_timer(fn, rep_ms):
        fn()
        return 1.0 + torch.rand((), generator=gen).item()

    emitted = []
    best = glue_sweep.sweep(inputs, fake_timer, jobs=0, finalists=2, repeats=3, rep_ms=5, pass1_until=float("inf"),
                            emit=emitted.append)
    first = [r for r in emitted if r.get("pass") == 1]
    for direction, count in (("fwd", 2 * 2 * 2 + 1), ("bwd", 2 * 2 * 1 + 1)):  # the candidates and the default
        launches = [_launch(r) for r in first if r["direction"] == direction]
        assert len(set(launches)) == count and len(launches) == 2 * count  # the norm and the folded add
        default = launch_settings(d, backward=direction == "bwd")
        assert [r["default"] for r in first if r["direction"] == direction and _launch(r) == default] == [True] * 2
    assert all(r["ms"] >= 1 and r["gbps"] > 0 and "error" not in r for r in first)
    second = [r for r in emitted if r.get("pass") == 2]
    for row in best:
        direction = row["direction"]
        picked = [r for r in second if r["direction"] == direction]
        # the two fastest of pass 1 and the default, each with the norm's and the folded add's row
        totals = {}
        for r in first:
            if r["direction"] == direction:
                totals[_launch(r)] = totals.get(_launch(r), 0.0) + r["ms"]
        finalists = set(sorted(totals, key=totals.__getitem__)[:2]) | {launch_settings(d, direction == "bwd")}
        assert {_launch(r) for r in picked} == finalists and len(picked) == 2 * len(finalists)
        for r in picked:
            assert len(r["ms_calls"]) == 3 and r["ms"] == sorted(r["ms_calls"])[1]
            assert r["vs_copy"] == pytest.approx(r["gbps"] / r["copy_gbps"])
        second_totals = {}
        for r in picked:
            second_totals[_launch(r)] = second_totals.get(_launch(r), 0.0) + r["ms"]
        assert _launch(row) == min(second_totals, key=second_totals.__getitem__)
        assert row["vs_default"] == pytest.approx(
            second_totals[launch_settings(d, direction == "bwd")] / second_totals[_launch(row)])
    assert [r["direction"] for r in best] == ["fwd", "bwd"] and emitted[-2:] == best
    reduce_rows = [r for r in emitted if r.get("direction") == "dw_reduce"]
    assert [r["programs"] for r in reduce_rows] == [1, 2, 3, 4] and all(r["ms"] >= 1 for r in reduce_rows)


def test_a_sweep_cut_short_still_compares_with_the_default(glue_sweep):
    inputs = glue_sweep.make_inputs(5, 64, "cpu")
    emitted = []
    best = glue_sweep.sweep(inputs, lambda fn, rep_ms: 1.0, jobs=0, finalists=2, repeats=1, rep_ms=5, pass1_until=0.0,
                            emit=emitted.append)
    assert emitted[0]["note"].startswith("pass 1 stopped for time: 0 of ")
    assert not [r for r in emitted if r.get("pass") == 1]
    for row in best:  # only the default is left to time in pass 2
        assert _launch(row) == launch_settings(64, backward=row["direction"] == "bwd") and row["vs_default"] == 1.0


def test_candidates_are_valid_launches(glue_sweep):
    for direction in ("fwd", "bwd"):
        launches = glue_sweep.candidates(direction)
        assert len(set(launches)) == len(launches) == 2 * 2 * len(glue_sweep.PROGRAMS_PER_SM[direction])


def test_bytes_are_the_benchmarks(glue_sweep):
    # forward + backward of each op is what cs336 fused counts for it (block_glue's formulas)
    n, d = 32768, 4096
    for add, factor in ((False, 5), (True, 8)):
        total = sum(glue_sweep.nbytes(direction, add, n, d, 2, 2) for direction in ("fwd", "bwd"))
        assert total == factor * n * d * 2 + 8 * n + 3 * d * 2
