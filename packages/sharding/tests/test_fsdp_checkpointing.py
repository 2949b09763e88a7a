"""FSDP composed with activation checkpointing (applied to the model first, then wrapped, and the other
order) on two gloo ranks: bit-exact against single-process training without checkpointing, and the checkpointing still
saves memory (FSDP adds no saved tensors of its own and keeps no gathered weights between forward and
backward). One spawn runs every check (fsdp_checkpointing_checks.py)."""

from __future__ import annotations

import pickle

import pytest
import torch
from fsdp_checkpointing_checks import POLICIES, WORLD_SIZE, all_checks

pytestmark = pytest.mark.slow  # every test reads the one spawn's records


@pytest.fixture(scope="module")
def checkpointed_records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from cs336_comms.process_group import spawn

    out = tmp_path_factory.mktemp("fsdp_checkpointing")
    spawn(all_checks, WORLD_SIZE, str(out), backend="gloo", timeout_s=120)
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("policy", [*POLICIES, "all, after FSDP"])
def test_fp32_matches_single_process_without_checkpointing_exactly(checkpointed_records: list[dict],
                                                                   policy: str) -> None:
    for rank, record in enumerate(checkpointed_records):
        run = record["training"][policy]
        for step, (got, want) in enumerate(zip(run["fsdp"], run["reference"], strict=True)):
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), f"rank {rank} step {step}: {name} differs"


def test_checkpointing_under_fsdp_saves_as_much_as_without_fsdp(checkpointed_records: list[dict]) -> None:
    for record in checkpointed_records:
        saved = record["saved"]
        for policy in ("none", "all"):
            plain, fsdp = saved[policy, False], saved[policy, True]
            assert fsdp["activation_bytes"] == plain["activation_bytes"], policy
            # Autograd holds views of the gathered buffers, but their storage is freed after each forward.
            assert fsdp["gathered_views"] > 0 and fsdp["gathered_view_bytes_after_forward"] == 0, policy
            assert fsdp["gathered_after_forward"] == 0, policy
        # Inside the blocks only segment inputs stay (held by the checkpoints, not saved): what the outermost
        # hook sees is the embedding, final norm, head and loss.
        assert saved["all", True]["activation_bytes"] < saved["none", True]["activation_bytes"] / 4


def test_recomputation_reuses_the_backward_gather(checkpointed_records: list[dict]) -> None:
    for record in checkpointed_records:
        for policy in ("none", "all"):
            run = record["saved"][policy, True]
            assert run["backward_gathers"] == run["num_units"], policy  # one per unit, none for the recompute
