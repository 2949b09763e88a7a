"""tools/attention_peers_profile.py on a CPU: each case takes its own implementations, refuses the others by name
before anything runs, and without a GPU says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tool_modules import load_tool

SCRIPT = Path(__file__).parents[1] / "tools" / "attention_peers_profile.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("args", "message"), [
    (["--case", "varlen", "--impls", "ours,sdpa"], "for --case varlen, got ['sdpa']"),
    (["--case", "window", "--impls", "ours_deterministic"], "for --case window, got ['ours_deterministic']"),
    (["--case", "window", "--window", "0"], "--window must be positive, got 0"),
    (["--case", "dense"], "invalid choice: 'dense'"),
])
def test_bad_arguments_fail_with_their_reason(args: list[str], message: str):
    done = _run(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message without CUDA")
@pytest.mark.parametrize("case", ["anchor", "varlen", "window"])
def test_without_a_gpu_each_case_with_its_default_impls_says_so(case: str):
    done = _run("--case", case)
    assert done.returncode != 0 and "needs a CUDA GPU" in done.stderr, done.stderr


def test_each_case_lists_its_implementations():
    tool = load_tool("attention_peers_profile")
    assert tool.CASES["varlen"] == ("ours", "flex", "sdpa_varlen", "fa4")
    assert set(tool.CASES["window"]) == {"ours", "fa4", "flex"} and "sdpa" in tool.CASES["anchor"]
