"""save_state / load_state: a run resumed from a save continues exactly as the uninterrupted one, on two gloo ranks
(the session's spawn, sharding_spawn_checks.py) and in one process; and the accessor they use rejects bad input."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from cs336_sharding.fsdp import FSDP
from cs336_sharding.state import load_state, save_state
from sharding_spawn_checks import OPTIMIZERS, batches, loss_of, new_model


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["torch_adamw", "basics_adamw"])
def test_resume_from_saved_state_equals_uninterrupted_run(records: list[dict], optimizer: str) -> None:
    for rank, record in enumerate(records):
        run = record["state"][optimizer]
        for name, want in run["uninterrupted"].items():
            assert torch.equal(run["resumed"][name], want), f"rank {rank}: {name} differs after resume"


def _train(model: FSDP, opt: torch.optim.Optimizer, steps: list) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=True)
        loss_of(model, *step[0]).backward()
        model.finish_gradient_synchronization()
        opt.step()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, as intended
def test_single_process_round_trip(tmp_path: Path) -> None:
    data = batches(3, seed=11)
    model = FSDP(new_model("toy", seed=0))
    opt = OPTIMIZERS["torch_adamw"](model.parameters())
    _train(model, opt, data[:1])
    save_state(tmp_path / "state", model, opt)
    resumed = FSDP(new_model("toy", seed=5))
    resumed_opt = OPTIMIZERS["torch_adamw"](resumed.parameters())
    load_state(tmp_path / "state", resumed, resumed_opt)
    _train(model, opt, data[1:])
    _train(resumed, resumed_opt, data[1:])
    want, got = model.gather_full_params(), resumed.gather_full_params()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_bad_arguments(tmp_path: Path) -> None:
    fsdp = FSDP(new_model("toy", seed=0))
    with pytest.raises(TypeError, match="FSDP model"):
        save_state(tmp_path / "s", new_model("toy", seed=0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="optimizer must be built over the FSDP model"):
        save_state(tmp_path / "s", fsdp, OPTIMIZERS["sgd"](copy.deepcopy(fsdp.module).parameters()))
    with pytest.raises(ValueError, match="not a parameter"):
        fsdp.state_tensor("nonexistent.weight", torch.zeros(3))
    with pytest.raises(ValueError, match="this rank's shape"):
        fsdp.state_tensor("lm_head.weight", torch.zeros(3))


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_unwritable_or_missing_paths_are_one_os_error_naming_the_path(tmp_path: Path, with_optimizer: bool) -> None:
    """torch.distributed.checkpoint raises a CheckpointException (a BaseException, missed by ``except Exception``,
    whose message lists ranks only); save_state and load_state turn it into an OSError naming the path and cause."""
    model = FSDP(new_model("toy", seed=0))
    opt = torch.optim.AdamW(model.parameters()) if with_optimizer else None
    (tmp_path / "file").write_text("")
    unwritable, missing = tmp_path / "file" / "state", tmp_path / "missing"
    with pytest.raises(OSError, match=f"save_state could not write {unwritable}: Not a directory"):
        save_state(unwritable, model, opt)
    with pytest.raises(FileNotFoundError, match=f"load_state could not read {missing}: No such file or directory"):
        load_state(missing, model, opt)
