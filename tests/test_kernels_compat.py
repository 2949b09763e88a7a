"""The torch, Triton and (``hf`` extra) transformers ranges that ``packages/kernels/pyproject.toml`` declares have a
passing recorded run at both ends (``tools/kernels_compat.py``'s rows in ``writeup/results/kernels_compat.jsonl``): the
oldest and the newest set, each with its CPU suite and its sm_90 builds passed, recorded under the ranges as they stand
now. A range changed without a new run fails here; so does a range wider than its runs."""

from __future__ import annotations

import json

import pytest
from tool_modules import load_tool


@pytest.fixture(scope="module")
def compat():
    return load_tool("kernels_compat")


def test_both_ends_of_the_declared_range_have_a_passing_run(compat):
    rows = [json.loads(line) for line in compat.OUT.read_text().splitlines() if line.strip()]
    assert compat.missing_runs(compat.declared_range(), rows) == []


def test_the_check_catches_missing_and_failed_runs(compat):
    declared = {"torch": "<2.16,>=2.10", "triton": "<3.10,>=3.6", "transformers": "<5.26,>=5.4"}
    run = {"requires": declared, "returncode": 0, "sm90_builds": "passed"}
    oldest = dict(run, torch="2.10.0+cu128", triton="3.6.0", transformers="5.4.0")
    newest = dict(run, torch="2.15.0+cu132", triton="3.9.0", transformers="5.25.0")
    assert compat.missing_runs(declared, [oldest, newest]) == []
    assert compat.missing_runs(declared, [oldest]) == ["newest set: torch 2.15 + triton 3.9 + transformers 5.25"]
    # The oldest torch with the newest transformers leaves the oldest transformers untested.
    assert compat.missing_runs(declared, [dict(oldest, transformers="5.25.0"), newest]) == [
        "oldest set: torch 2.10 + triton 3.6 + transformers 5.4"]
    # A range widened after the runs: they were recorded under another one, and nothing ran Triton 3.10.
    wider = dict(declared, triton="<3.11,>=3.6")
    assert compat.missing_runs(wider, [oldest, newest]) == ["oldest set: torch 2.10 + triton 3.6 + transformers 5.4",
                                                            "newest set: torch 2.15 + triton 3.10 + transformers 5.25"]
    # A failed suite, sm_90 builds that did not run (no ptxas), or a row of before transformers was recorded does not
    # count.
    assert compat.missing_runs(declared, [dict(oldest, returncode=1), newest]) == [
        "oldest set: torch 2.10 + triton 3.6 + transformers 5.4"]
    assert compat.missing_runs(declared, [oldest, dict(newest, sm90_builds="skipped")]) == [
        "newest set: torch 2.15 + triton 3.9 + transformers 5.25"]
    no_transformers = {key: value for key, value in newest.items() if key != "transformers"}
    assert compat.missing_runs(declared, [oldest, no_transformers]) == [
        "newest set: torch 2.15 + triton 3.9 + transformers 5.25"]


def test_the_declared_range_reads_as_its_ends(compat, tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["torch>=2.10,<2.16", "triton >= 3.6, < 3.10", "numpy"]\n'
                         '[project.optional-dependencies]\nhf = ["transformers>=5.4,<5.26"]\n')
    declared = compat.declared_range(pyproject)
    assert declared == {"torch": "<2.16,>=2.10", "triton": "<3.10,>=3.6", "transformers": "<5.26,>=5.4"}
    assert compat.range_ends(declared["torch"]) == ((2, 10), (2, 15))
    assert compat.range_ends(declared["transformers"]) == ((5, 4), (5, 25))
    for spec in (">=2.10", ">=2.10,<3", ">=2.10,<3.0", ">2.10,<2.16", ">=2.10,<2.16,!=2.12.0", "==2.11.*"):
        with pytest.raises(ValueError, match="a range must read"):
            compat.range_ends(spec)
    pyproject.write_text('[project]\ndependencies = ["torch>=2.10,<2.16", "triton>=3.6,<3.10"]\n')
    with pytest.raises(ValueError, match="must require each of"):
        compat.declared_range(pyproject)
