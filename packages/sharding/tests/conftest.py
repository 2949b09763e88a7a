"""Shared setup for the sharding tests.

This folder goes on ``sys.path`` so ranks started by ``torch.multiprocessing.spawn`` can import
``sharding_spawn_checks`` and ``fsdp_checkpointing_checks`` (spawn hands the parent's ``sys.path`` to each child).
One spawn per session runs every distributed check of the FSDP and ZeRO-1 tests (a spawn costs seconds); the tests
assert on what each rank recorded. Without CUDA, our Triton attention (one checkpointing test) runs in Triton's
interpreter, which must be chosen before ``cs336_kernels`` is imported.
"""

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from cs336_comms.process_group import spawn
    from sharding_spawn_checks import WORLD_SIZE, all_checks

    out = tmp_path_factory.mktemp("sharding")
    spawn(all_checks, WORLD_SIZE, str(out), backend="gloo", timeout_s=120)
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(WORLD_SIZE)]
