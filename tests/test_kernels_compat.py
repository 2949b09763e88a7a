"""The torch and Triton range that ``packages/kernels/pyproject.toml`` declares has a passing recorded run at both ends
(``tools/kernels_compat.py``'s rows in ``writeup/results/kernels_compat.jsonl``): the oldest and the newest pair, each
with its CPU suite and its sm_90 builds passed, recorded under the range as it stands now. A range changed without a
new run fails here; so does a range wider than its runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compat():
    spec = importlib.util.spec_from_file_location("kernels_compat", ROOT / "tools" / "kernels_compat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_ends_of_the_declared_range_have_a_passing_run(compat):
    rows = [json.loads(line) for line in compat.OUT.read_text().splitlines() if line.strip()]
    assert compat.missing_runs(compat.declared_range(), rows) == []


def test_the_check_catches_missing_and_failed_runs(compat):
    declared = {"torch": "<2.16,>=2.10", "triton": "<3.10,>=3.6"}
    run = {"requires": declared, "returncode": 0, "sm90_builds": "passed"}
    oldest, newest = dict(run, torch="2.10.0+cu128", triton="3.6.0"), dict(run, torch="2.15.0+cu132", triton="3.9.0")
    assert compat.missing_runs(declared, [oldest, newest]) == []
    assert compat.missing_runs(declared, [oldest]) == ["newest pair: torch 2.15 + triton 3.9"]
    # A range widened after the runs: they were recorded under another one, and nothing ran Triton 3.10.
    wider = dict(declared, triton="<3.11,>=3.6")
    assert compat.missing_runs(wider, [oldest, newest]) == ["oldest pair: torch 2.10 + triton 3.6",
                                                            "newest pair: torch 2.15 + triton 3.10"]
    # A failed suite, or sm_90 builds that did not run (no ptxas), does not count.
    assert compat.missing_runs(declared, [dict(oldest, returncode=1), newest]) == [
        "oldest pair: torch 2.10 + triton 3.6"]
    assert compat.missing_runs(declared, [oldest, dict(newest, sm90_builds="skipped")]) == [
        "newest pair: torch 2.15 + triton 3.9"]


def test_the_declared_range_reads_as_its_ends(compat, tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["torch>=2.10,<2.16", "triton >= 3.6, < 3.10", "numpy"]\n')
    declared = compat.declared_range(pyproject)
    assert declared == {"torch": "<2.16,>=2.10", "triton": "<3.10,>=3.6"}
    assert compat.range_ends(declared["torch"]) == ((2, 10), (2, 15))
    for spec in (">=2.10", ">=2.10,<3", ">=2.10,<3.0", ">2.10,<2.16", ">=2.10,<2.16,!=2.12.0", "==2.11.*"):
        with pytest.raises(ValueError, match="a range must read"):
            compat.range_ends(spec)
    pyproject.write_text('[project]\ndependencies = ["torch>=2.10,<2.16"]\n')
    with pytest.raises(ValueError, match="must require each of"):
        compat.declared_range(pyproject)
