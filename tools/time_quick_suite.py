"""Time the quick test suite (README: `uv run pytest -m "not slow" -n 2`) and append its row to
writeup/results/quick_suite.jsonl: the pytest arguments, wall time, pytest's summary line, return code, provenance.
With ``--log`` pytest's whole output goes to that file (tools/gpu_suite.sh times the quick GPU run so).

    uv run python tools/time_quick_suite.py            # the README's command
    uv run python tools/time_quick_suite.py -- -n 0    # other pytest arguments after --, e.g. one process

Run it on idle cores: the row is the machine's speed at that hour as much as the suite's.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cs336_harness.results import append_rows, provenance

ROOT = Path(__file__).resolve().parent.parent
README_ARGS = ["-m", "not slow", "-n", "2"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "writeup/results/quick_suite.jsonl"), help="rows file")
    parser.add_argument("--log", default=None, help="write pytest's whole output (stdout and stderr) to this file")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest arguments instead of the README's")
    args = parser.parse_args()
    pytest_args = args.pytest_args or README_ARGS
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args]
    start = time.perf_counter()
    with open(args.log or os.devnull, "w") as log:
        # The output streams into the log as it comes, so a run stopped early (gpu_suite.sh's deadline sends
        # SIGTERM) still shows what ran; the stop is passed on to pytest, and no row is written.
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log if args.log else subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        stopped = []
        signal.signal(signal.SIGTERM, lambda *_: (stopped.append(True), proc.terminate()))
        out = proc.communicate()[0]
    if stopped:
        return 143
    wall = time.perf_counter() - start
    if args.log:
        out = Path(args.log).read_text()
    lines = [line for line in out.splitlines() if line.strip()]
    row = {"what": f"the quick test suite's wall time, {os.cpu_count()} CPU cores", "pytest_args": pytest_args,
           "wall_s": round(wall, 1), "pytest_summary": lines[-1].strip("= ") if lines else "",
           "returncode": proc.returncode}
    append_rows(args.out, [row], provenance())
    print(f"{wall:.1f} s wall: {row['pytest_summary']}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
