"""tools/kernel_limits_profile.py's join on CPU: ncu's raw CSV (a header, a units row, one row per kernel, a marker
kernel closing each case) becomes one row per kernel, in ms, bytes and MHz whatever units ncu chose, and one summary
row per case; a CSV whose marked cases do not match the order file is refused."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from tool_modules import load_tool


@pytest.fixture
def profile_tool():
    return load_tool("kernel_limits_profile")


def _write(tmp_path: Path, tool, kernels: list[dict], order: list[dict]) -> tuple[Path, Path]:
    units = {"gpu__time_duration.sum": "usecond", "dram__bytes_read.sum": "Mbyte", "dram__bytes_write.sum": "Kbyte",
             "sm__cycles_elapsed.avg.per_second": "Ghz", "launch__registers_per_thread": "register/thread"}
    header = ["ID", "Kernel Name", *tool.METRICS]
    path = tmp_path / "raw.csv"
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(header)
        out.writerow(["", "", *(units.get(m, "%") for m in tool.METRICS)])
        for i, k in enumerate(kernels):
            out.writerow([str(i), k["name"], *(k.get(m, "1") for m in tool.METRICS)])
    order_path = tmp_path / "order.json"
    order_path.write_text(json.dumps(order))
    return path, order_path


def test_join_splits_cases_at_markers_and_converts_units(tmp_path, profile_tool):
    kernels = [
        {"name": "_rms_norm_fwd", "gpu__time_duration.sum": "1,000", "dram__bytes_read.sum": "3,000",
         "dram__bytes_write.sum": "1,000,000", "sm__cycles_elapsed.avg.per_second": "1.98",
         "launch__registers_per_thread": "40 (40)", "launch__grid_size": "1,056 (1,056)"},
        {"name": "_rms_norm_bwd", "gpu__time_duration.sum": "500"},
        {"name": "void at::native::spin_kernel(long)"},
        {"name": "nvjet_gemm", "gpu__time_duration.sum": "20,000",
         "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed": "91.5"},
        {"name": "void at::native::spin_kernel(long)"},
    ]
    order = [{"op": "rms_norm", "impl": "ours", "bytes": 6 * 10**9}, {"op": "linear_ce", "impl": "ours", "bytes": 0}]
    rows = profile_tool.join(*_write(tmp_path, profile_tool, kernels, order))
    assert [(r["op"], r["kernel"]) for r in rows] == [
        ("rms_norm", "_rms_norm_fwd"), ("rms_norm", "_rms_norm_bwd"), ("rms_norm", "all"),
        ("linear_ce", "nvjet_gemm"), ("linear_ce", "all")]
    fwd, bwd, norm, gemm, loss = rows
    assert fwd["ms"] == pytest.approx(1.0) and bwd["ms"] == pytest.approx(0.5)
    assert fwd["dram_read_bytes"] == pytest.approx(3e9) and fwd["dram_write_bytes"] == pytest.approx(1e9)
    assert fwd["dram_gbps"] == pytest.approx(4e9 / 1e-3 / 1e9)
    assert fwd["sm_clock_mhz"] == pytest.approx(1980) and fwd["registers"] == 40 and fwd["grid"] == 1056
    assert norm == {"bench": "kernel_profile", "op": "rms_norm", "impl": "ours", "kernel": "all", "kernels": 2,
                    "ms": pytest.approx(1.5), "bytes": 6 * 10**9, "gbps": pytest.approx(6e9 / 1.5e-3 / 1e9)}
    assert gemm["tensor_pct"] == pytest.approx(91.5) and gemm["ms"] == pytest.approx(20.0)
    assert loss["kernels"] == 1 and "gbps" not in loss


def test_join_refuses_cases_that_do_not_match_the_order(tmp_path, profile_tool):
    kernels = [{"name": "_rms_norm_fwd"}, {"name": "spin_kernel"}]
    order = [{"op": "rms_norm", "impl": "ours", "bytes": 1}, {"op": "rope", "impl": "ours", "bytes": 1}]
    with pytest.raises(ValueError, match="holds 1 marked cases"):
        profile_tool.join(*_write(tmp_path, profile_tool, kernels, order))
    with pytest.raises(ValueError, match="more cases than"):
        profile_tool.join(*_write(tmp_path, profile_tool, kernels * 3, order))


def test_join_refuses_unknown_units_and_missing_columns(tmp_path, profile_tool):
    path, order_path = _write(tmp_path, profile_tool, [{"name": "k"}, {"name": "spin_kernel"}],
                              [{"op": "rope", "impl": "ours", "bytes": 1}])
    text = path.read_text().replace("usecond", "fortnight")
    path.write_text(text)
    with pytest.raises(ValueError, match="fortnight"):
        profile_tool.join(path, order_path)
    path.write_text(text.replace("gpu__time_duration.sum", "something_else"))
    with pytest.raises(ValueError, match="lacks the columns"):
        profile_tool.join(path, order_path)
