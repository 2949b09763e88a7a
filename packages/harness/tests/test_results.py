"""Provenance: which commit a results row names, with git, with a stale git copy, and without git."""

from __future__ import annotations

from pathlib import Path

import pytest
from cs336_harness import results


@pytest.fixture
def fake_git(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Point the commit file at tmp_path and answer git with the given HEAD and status."""

    def install(head: str | None, status: str = "", recorded: str | None = None, toplevel: Path = tmp_path) -> None:
        commit_file = tmp_path / ".commit"
        if recorded is not None:
            commit_file.write_text(recorded + "\n")
        monkeypatch.setattr(results, "_COMMIT_FILE", commit_file)
        answers = {("rev-parse", "--show-toplevel"): str(toplevel) if head else None,
                   ("rev-parse", "--short=12", "HEAD"): head,
                   ("status", "--porcelain", "--untracked-files=no"): status if head else None}
        monkeypatch.setattr(results, "_git", lambda *args: answers[args])

    return install


@pytest.mark.parametrize(("head", "status", "recorded", "expected"), [
    ("abc123", "", None, "abc123"),  # a clone without the hook
    ("abc123", " M x.py", None, "abc123+dirty"),
    ("abc123", "", "abc123", "abc123"),  # the hook keeps .commit equal to HEAD
    ("abc123", "", "def456", "def456+unchecked"),  # a copy whose .git is stale
    (None, "", "def456", "def456+unchecked"),  # a copy without .git
    (None, "", None, "unknown"),
])
def test_git_commit(fake_git, head: str | None, status: str, recorded: str | None, expected: str) -> None:
    fake_git(head, status, recorded)
    assert results.git_commit() == expected


def test_git_commit_of_a_tree_staged_inside_another_checkout(fake_git, tmp_path: Path) -> None:
    """The outer checkout's HEAD and status say nothing of the staged tree, even where its HEAD is the same commit."""
    fake_git("abc123", " M x.py", "abc123", toplevel=tmp_path.parent)
    assert results.git_commit() == "abc123+unchecked"


def test_check_writable_leaves_no_file_behind_and_keeps_an_existing_one(tmp_path: Path) -> None:
    new = tmp_path / "made" / "rows.jsonl"
    assert results.check_writable(new) == new and not new.exists() and new.parent.is_dir()
    old = tmp_path / "old.jsonl"
    old.write_text('{"a": 1}\n')
    results.check_writable(old)
    assert old.read_text() == '{"a": 1}\n'
    with pytest.raises(ValueError, match="cannot write to '/proc/nope/x.jsonl': No such file or directory"):
        results.check_writable("/proc/nope/x.jsonl")
    with pytest.raises(ValueError, match="cannot write to"):
        results.check_writable(tmp_path)  # a folder, not a file


@pytest.mark.parametrize("below", ["", "/more"])
def test_a_file_where_a_folder_should_be_is_named(tmp_path: Path, below: str) -> None:
    blocker = tmp_path / "rows"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"^cannot write to '{blocker}{below}/x.jsonl': '{blocker}' is a file, not a "
                                         "folder$"):
        results.check_writable(f"{blocker}{below}/x.jsonl")
    with pytest.raises(ValueError, match=f"^cannot write to the folder '{blocker}{below}': '{blocker}' is a file, "
                                         "not a folder$"):
        results.check_writable_dir(f"{blocker}{below}")
    assert blocker.is_file() and blocker.read_text() == ""


def test_command_line_is_what_a_user_types_from_the_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    root = results._REPO_ROOT
    cli = root / "packages/harness/src/cs336_harness/cli.py"
    monkeypatch.setenv("OUT", "/root/out")
    # `python -m cs336_harness.cli` (tools/gpu.sh, torchrun) and the entry point are both `cs336`
    assert results.command_line([str(cli), "bench", "--out", "/root/out/rows.jsonl"]) == (
        "cs336 bench --out $OUT/rows.jsonl")
    assert results.command_line(["/somewhere/.venv/bin/cs336", "ddp", f"--trace-dir={root}/traces"]) == (
        "cs336 ddp --trace-dir=traces")
    assert results.command_line([str(root / "tools/copy_census.py"), "--out", str(root / "writeup/results/x.jsonl"),
                                 "--shapes", "1,2;3,4", "--out-dir", "/root/out"]) == (
        "uv run python tools/copy_census.py --out writeup/results/x.jsonl --shapes '1,2;3,4' --out-dir $OUT")
    assert results.command_line(["tools/determinism_cost.py"]) == "uv run python tools/determinism_cost.py"
    # a path outside the repository and $OUT is what the user typed; without $OUT nothing is read as inside it
    assert results.command_line([str(cli), "bench", "--out", "/data/r.jsonl"]) == "cs336 bench --out /data/r.jsonl"
    monkeypatch.delenv("OUT")
    assert results.command_line([str(cli), "bench", "--out", "/root/out/r"]) == "cs336 bench --out /root/out/r"


def test_portable_path_is_what_a_row_names(monkeypatch: pytest.MonkeyPatch) -> None:
    # The files a run writes (a profile's trace, a memory snapshot) are named in its rows as its command names them.
    root = results._REPO_ROOT
    monkeypatch.setenv("OUT", "/root/out")
    assert results.portable_path(root / "writeup/results/traces/t.json.gz") == "writeup/results/traces/t.json.gz"
    assert results.portable_path("/root/out/memory/m.pickle") == "$OUT/memory/m.pickle"
    assert results.portable_path("traces/t.json.gz") == "traces/t.json.gz"
    assert results.portable_path("/data/t.json.gz") == "/data/t.json.gz"


def test_provenance_names_the_command_as_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", [str(results._REPO_ROOT / "packages/harness/src/cs336_harness/cli.py"),
                                     "leaderboard", "--proxy", "--out", str(results._REPO_ROOT / "rows.jsonl")])
    assert results.provenance()["command"] == "cs336 leaderboard --proxy --out rows.jsonl"


def _rows_in(path: Path) -> list[dict]:
    return results.read_rows(path) if path.exists() else []


@pytest.mark.slow
def test_shard_writes_each_runs_row_as_it_finishes_so_a_killed_run_keeps_them(tmp_path: Path) -> None:
    """``cs336 shard --out`` over four variants, killed (its whole process group, ranks included) once the first
    row is on disk: the file holds the finished runs' rows, each a whole JSON line, and not the unfinished ones."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "rows.jsonl"
    run = subprocess.Popen([sys.executable, "-m", "cs336_harness.cli", "shard", "--compute-dtype", "fp32", "--variants",
                            "ddp,zero1,fsdp,fsdp2", "--out", str(out), "--quiet"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not _rows_in(out) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    lines = out.read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert 1 <= len(rows) < 4, [r["variant"] for r in rows]
    assert [r["variant"] for r in rows] == ["ddp", "zero1", "fsdp"][: len(rows)]
    assert all(r["step_ms"] > 0 and r["size"] == "tiny" and "shard" in r["command"] for r in rows)


def test_row_writer_appends_whole_lines_with_the_provenance_taken_once(tmp_path: Path) -> None:
    import pickle

    writer = pickle.loads(pickle.dumps(results.RowWriter.to(tmp_path / "rows.jsonl")))  # as a spawned rank gets it
    writer([{"a": 1}])
    writer([{"a": 2}, {"a": 3}])
    rows = results.read_rows(tmp_path / "rows.jsonl")
    assert [r["a"] for r in rows] == [1, 2, 3]
    assert len({r["date"] for r in rows}) == 1 and all(r["commit"] for r in rows)
    assert results.RowWriter.to(None) is None
