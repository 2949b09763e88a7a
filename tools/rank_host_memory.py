"""Measure the host memory of a multi-rank command's spawned ranks on this CPU machine and append one row per run to
writeup/results/host_memory.jsonl: the largest private memory (USS: Private_Clean + Private_Dirty of
/proc/PID/smaps_rollup) any rank reached, and the largest sum over the ranks of their proportional set size (PSS, which
counts each shared page once over the processes that map it), sampled every 0.2 s while the command runs.

    uv run python tools/rank_host_memory.py                               # ddp and collectives at 2 and 8 ranks
    uv run python tools/rank_host_memory.py -- ddp --world-size 4 --global-batch 4

A rank's private memory is what each added rank costs at least; its PSS share adds its part of the shared libraries.
The row also has what the command's own host-memory check counts for a rank's tensors (``rank_tensors_gib``):
``cs336_harness.resources.RANK_BASE_BYTES`` must cover the larger per-rank figure less that, in every row
(tests/test_host_memory.py checks it against these rows).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from cs336_harness import cli, resources
from cs336_harness.commands import collectives as collectives_command
from cs336_harness.commands import ddp as ddp_command
from cs336_harness.commands._shared import distributed_run_fields
from cs336_harness.results import append_rows, provenance
from cs336_harness.studies.collectives import CollectivesConfig
from cs336_harness.studies.ddp import DDPBenchConfig

ROOT = Path(__file__).resolve().parent.parent
RUNS = [
    ["ddp", "--world-size", "2", "--global-batch", "2", "--quiet"],
    ["ddp", "--world-size", "8", "--global-batch", "8", "--quiet"],
    ["collectives", "--world-sizes", "2", "--quiet"],
    ["collectives", "--world-sizes", "8", "--quiet"],
]


def _descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        direct = [int(p) for p in children.read_text().split()]
    except OSError:
        return []
    return direct + [d for child in direct for d in _descendants(child)]


def _memory(pid: int) -> tuple[int, int] | None:
    """(USS, PSS) of ``pid`` in bytes, or None once it has ended."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    except (OSError, ValueError):
        return None
    kib = {name: int(value.split()[0]) * 1024 for name, value in fields.items()}
    return kib["Private_Clean"] + kib["Private_Dirty"], kib["Pss"]


def _is_rank(pid: int) -> bool:
    """A spawned rank (multiprocessing's child), not the resource tracker or the command itself."""
    try:
        return "multiprocessing.spawn" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def tensor_bytes(argv: list[str]) -> float:
    """What the command's own host-memory check counts for one rank besides :data:`RANK_BASE_BYTES` (its tensors)."""
    args = cli.parse_args(argv)
    if args.command == "ddp":
        need = ddp_command.host_need(DDPBenchConfig(**distributed_run_fields(args)))
    elif args.command == "collectives":
        need = collectives_command.host_need(CollectivesConfig(("gloo",), args.world_sizes, args.sizes_mb, args.ops,
                                                               args.warmup, args.iters))
    else:
        raise SystemExit(f"measures ddp and collectives runs, got {args.command!r}")
    return need.rank_bytes - resources.RANK_BASE_BYTES


def measure(argv: list[str]) -> dict:
    command = [sys.executable, "-m", "cs336_harness.cli", *argv]
    run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rank_uss, ranks_pss, ranks_seen = 0, 0, 0
    while run.poll() is None:
        ranks = [p for p in _descendants(run.pid) if _is_rank(p)]
        sizes = [m for m in map(_memory, ranks) if m is not None]
        ranks_seen = max(ranks_seen, len(sizes))
        if sizes:
            rank_uss = max(rank_uss, *(uss for uss, _ in sizes))
            ranks_pss = max(ranks_pss, sum(pss for _, pss in sizes))
        time.sleep(0.2)
    stderr = run.stderr.read()
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {stderr.strip().splitlines()[-1:]}")
    return {"what": "host memory of a command's spawned ranks, sampled every 0.2 s", "run": " ".join(argv),
            "ranks": ranks_seen, "rank_private_gib": rank_uss / 2**30, "ranks_pss_gib": ranks_pss / 2**30,
            "rank_tensors_gib": tensor_bytes(argv) / 2**30, "cpu_count": os.cpu_count()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "writeup/results/host_memory.jsonl"), help="rows file")
    parser.add_argument("argv", nargs="*", help="after --: one cs336 command line instead of the default runs")
    args = parser.parse_args()
    meta = provenance()  # before the first row makes the tree differ from its commit
    for argv in [args.argv] if args.argv else RUNS:
        row = measure(argv)
        append_rows(args.out, [row], meta)
        print(f"{row['run']}: {row['ranks']} ranks, at most {row['rank_private_gib']:.3f} GiB private per rank, "
              f"{row['ranks_pss_gib']:.3f} GiB PSS in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
