"""tools/time_quick_suite.py (which tools/gpu_suite.sh runs for each quick GPU run): a finished run leaves one row and
its whole output in the log; a run stopped by SIGTERM (the GPU script's deadline) stops pytest, keeps the output so far
and leaves no row."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "tools" / "time_quick_suite.py"


def _start(tmp_path: Path, body: str) -> subprocess.Popen:
    (tmp_path / "test_subject.py").write_text(body)
    return subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(tmp_path / "rows.jsonl"), "--log",
                             str(tmp_path / "log.txt"), "--", str(tmp_path / "test_subject.py"), "-v"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_finished_run_leaves_its_row_and_its_log(tmp_path: Path):
    proc = _start(tmp_path, "def test_one():\n    pass\n")
    assert proc.wait(timeout=120) == 0, proc.stdout.read()
    (row,) = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert row["returncode"] == 0 and row["pytest_summary"].startswith("1 passed in ")
    assert row["pytest_args"][-1] == "-v" and row["wall_s"] > 0 and "commit" in row
    assert "test_subject.py::test_one PASSED" in (tmp_path / "log.txt").read_text()


def test_a_stopped_run_keeps_its_log_and_writes_no_row(tmp_path: Path):
    marker = tmp_path / "started"
    proc = _start(tmp_path, f"import pathlib, time\n\ndef test_long():\n    pathlib.Path({str(marker)!r}).touch()\n"
                            "    time.sleep(120)\n")
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "the test never started"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert not (tmp_path / "rows.jsonl").exists()
    assert "test_subject.py::test_long" in (tmp_path / "log.txt").read_text()
