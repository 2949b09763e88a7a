"""A script for torchrun (``test_process_group.py``'s torchrun tests): two gloo ranks of :func:`run_ranks` that
all-reduce in a loop, each writing its pid to ``DIR/rank<N>.pid`` first.

    python -m torch.distributed.run --nproc-per-node 2 torchrun_ranks.py DIR TIMEOUT_S STOP_AT

Rank 1 stops itself (SIGSTOP) at all-reduce number ``STOP_AT`` (never when it is 0); ``TIMEOUT_S`` is the group's
collective timeout.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from cs336_comms.process_group import run_ranks


def _loop(rank: int, world_size: int, folder: str, stop_at: int) -> None:
    (Path(folder) / f"rank{rank}.pid").write_text(str(os.getpid()))
    x = torch.ones(4)
    for step in range(1, 100_000):
        if rank == 1 and step == stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(x)
        time.sleep(0.05)


if __name__ == "__main__":
    folder, timeout_s, stop_at = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    run_ranks(_loop, 2, folder, stop_at, backend="gloo", timeout_s=timeout_s)
