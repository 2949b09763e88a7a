"""ShardedOptimizer (ZeRO-1) on two gloo ranks against the unsharded optimizer, plus single-process checks.

The distributed checks run once per session (conftest.py, sharding_spawn_checks.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from cs336_basics.optimizer import AdamW
from cs336_sharding.optimizer import ShardedOptimizer
from sharding_spawn_checks import SHARDED_OPTIMIZERS, TiedToy, _groups, _train_tied, batches

NAMES = list(SHARDED_OPTIMIZERS)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_matches_unsharded_optimizer_exactly(records: list[dict], name: str) -> None:
    for rank, record in enumerate(records):
        for step, (got, want) in enumerate(record["sharded"][name]["steps"]):
            for n in want:
                assert torch.equal(got[n], want[n]), f"rank {rank} step {step}: {n} differs"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_each_rank_keeps_state_only_for_its_shard(records: list[dict], name: str) -> None:
    owners = records[0]["sharded"][name]["owners"]
    assert owners == records[1]["sharded"][name]["owners"], "ranks must agree on the assignment"
    numel = records[0]["sharded"][name]["numel"]
    for rank, record in enumerate(records):
        expected = sorted(n for n, r in owners.items() if r == rank)
        assert record["sharded"][name]["local_state"] == expected
    load = [sum(numel[n] for n, r in owners.items() if r == rank) for rank in range(len(records))]
    assert max(load) - min(load) <= max(numel.values()), f"unbalanced assignment: {load}"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_consolidated_state_dict_equals_unsharded(records: list[dict], name: str) -> None:
    got, want = records[0]["sharded"][name]["consolidated"], records[0]["sharded"][name]["reference_state"]
    assert records[1]["sharded"][name]["consolidated"] is None
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                assert torch.equal(got["state"][i][key], value.cpu()), (i, key)
            else:
                assert got["state"][i][key] == value, (i, key)


@pytest.mark.slow
@pytest.mark.parametrize("consolidated", [False, True], ids=["shard", "consolidated"])
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_continues_identically(records: list[dict], name: str, consolidated: bool) -> None:
    for rank, record in enumerate(records):
        run = record["resume"][name, consolidated]
        for n, want in run["uninterrupted"].items():
            assert torch.equal(run["resumed"][n], want), f"rank {rank}: {n} differs after reload"


@pytest.mark.parametrize("name", NAMES)
def test_without_process_group_equals_wrapped_optimizer(name: str) -> None:
    cls, kwargs = SHARDED_OPTIMIZERS[name]
    torch.manual_seed(0)
    ref = TiedToy()
    model = copy.deepcopy(ref)
    ref_opt, opt = cls(_groups(ref), **kwargs), ShardedOptimizer(_groups(model), cls, **kwargs)
    data = batches(5, seed=11)
    _train_tied(ref, ref_opt, data, 0, 5)
    _train_tied(model, opt, data, 0, 5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n
    got, want = opt.state_dict(), ref_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()


def test_outer_groups_show_the_wrapped_defaults() -> None:
    opt = ShardedOptimizer([torch.nn.Parameter(torch.randn(3))], AdamW, lr=0.5)
    assert opt.param_groups[0]["lr"] == 0.5
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)


def test_a_callable_that_makes_the_optimizer_wraps_as_its_class_does() -> None:
    def momentum_sgd(groups: list[dict], lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)

    torch.manual_seed(0)
    ref = TiedToy()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(_groups(ref), lr=0.1, momentum=0.9)
    opt = ShardedOptimizer(_groups(model), momentum_sgd, lr=0.1)
    assert isinstance(opt.inner, torch.optim.SGD) and opt.param_groups[0]["momentum"] == 0.9
    data = batches(3, seed=5)
    _train_tied(ref, ref_opt, data, 0, 3)
    _train_tied(model, opt, data, 0, 3)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_bad_arguments() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(TypeError, match="optimizer_cls must be a torch.optim.Optimizer subclass or a callable that "
                                        "makes one, got 'adamw'"):
        ShardedOptimizer([p], "adamw")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer_cls must be .*, got <class 'int'>"):
        ShardedOptimizer([p], int)
    opt = ShardedOptimizer([p], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="groups do not match"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1], "lr": 0.1}]})
    with pytest.raises(ValueError, match="not managed"):
        opt.owner_of(torch.nn.Parameter(torch.randn(2)))
