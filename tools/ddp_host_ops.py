"""Where the backward thread spends its CPU time in bf16 DDP steps: a markdown table from profiler traces.

Reads the traces `cs336 ddp --trace-dir` wrote (one profiled step on rank 0 per variant), counts the
host-side events that start inside the step's `backward` range (cs336_harness.analysis.trace.host_op_times) and
prints calls, total and median per event for each trace. Used for writeup section 5:

    uv run python tools/ddp_host_ops.py writeup/results/traces/ddp_bf16_{nocomm,bucketed_25mb,torch_ddp_25mb}.json.gz
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cs336_harness.analysis.tables import markdown_table
from cs336_harness.analysis.trace import host_op_times, load_trace

NAMES = ("c10d::allreduce_", "aten::mm", "aten::mul", "cudaLaunchKernel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    args = parser.parse_args()
    rows = []
    for path in args.traces:
        times = host_op_times(load_trace(path), "backward", NAMES)
        row = {"trace": path.name.removesuffix(".json.gz").removesuffix(".json")}
        for name, t in times.items():
            row[name] = f"{t['calls']} x {t['median_us']:.0f} us = {t['total_ms']:.1f} ms" if t["calls"] else "-"
        rows.append(row)
    print(markdown_table(rows, list(zip(["trace", *NAMES], ["trace (backward range)", *NAMES], strict=True))))


if __name__ == "__main__":
    main()
