"""Time the quick test suite (README: `uv run pytest -m "not slow" -n 2`) and append its row to
writeup/results/quick_suite.jsonl: wall time, pytest's summary line, return code, provenance.

    uv run python tools/time_quick_suite.py            # the README's command
    uv run python tools/time_quick_suite.py -- -n 0    # other pytest arguments after --, e.g. one process

Run it on idle cores: the row is the machine's speed at that hour as much as the suite's.
"""

from __future__ import annotations

import argparse
import os
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
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest arguments instead of the README's")
    args = parser.parse_args()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(args.pytest_args or README_ARGS)]
    start = time.perf_counter()
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    row = {"what": f"the quick test suite's wall time, {os.cpu_count()} CPU cores", "wall_s": round(wall, 1),
           "pytest_summary": lines[-1] if lines else "", "returncode": run.returncode}
    append_rows(args.out, [row], provenance())
    print(f"{wall:.1f} s wall: {row['pytest_summary']}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
