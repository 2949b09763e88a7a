"""Data-parallel wrappers on two gloo ranks against single-process training, bit for bit in fp32.

One spawn runs every check in comms_spawn_checks.py (a spawn costs seconds); each rank records
what it saw and the tests below assert on both ranks' records.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from comms_spawn_checks import INIT_SEED, VARIANTS, WORLD_SIZE, all_checks, new_model
from cs336_comms.collectives import OPS
from cs336_comms.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP
from cs336_comms.process_group import spawn

pytestmark = pytest.mark.slow  # every test reads the one spawn's records

FULL_BATCH_RTOL, FULL_BATCH_ATOL = 1e-5, 1e-6  # reference vs one full-batch backward (sum order differs)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    spawn(all_checks, WORLD_SIZE, str(out), backend="gloo", timeout_s=120)
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("num_micro", [1, 2], ids=["one_batch", "no_sync_accumulation"])
@pytest.mark.parametrize("kind", ["toy", "tied"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_single_process_exactly(records: list[dict], variant: str, kind: str, num_micro: int) -> None:
    for rank, record in enumerate(records):
        trained, ref = record["train"][variant, kind, num_micro]
        assert trained.keys() == ref.keys()
        for name in ref:
            assert torch.equal(trained[name], ref[name]), f"rank {rank}, {name} differs from single-process"


@pytest.mark.parametrize("num_micro", [1, 2])
@pytest.mark.parametrize("kind", ["toy", "tied"])
def test_reference_is_full_batch_training(records: list[dict], kind: str, num_micro: int) -> None:
    ref, full = records[0]["reference_vs_full"][kind, num_micro]
    initial = new_model(kind, seed=INIT_SEED).state_dict()
    for name in ref:
        torch.testing.assert_close(ref[name], full[name], rtol=FULL_BATCH_RTOL, atol=FULL_BATCH_ATOL)
    # The parameter no step uses keeps its initial value (no gradient, so no weight decay either).
    if kind == "toy":
        assert torch.equal(ref["unused"], initial["unused"])
        assert torch.equal(ref["scale"], initial["scale"])
        assert not torch.equal(ref["extra"], initial["extra"])


def test_buckets_close_once_they_reach_the_cap(records: list[dict]) -> None:
    # Reverse registration order (the model's own parameters come before its children's); a bucket closes
    # once it holds >= 50 floats, so each bias rides with the weight after it (5 + 55, 11 + 143 floats) and
    # the small leftovers share the last bucket; the frozen scale is left out.
    for r in records:
        assert r["buckets"] == [["fc2.bias", "fc2.weight"], ["fc1.bias", "fc1.weight"], ["unused", "extra"]]


def test_dropping_the_wrapper_frees_the_model(records: list[dict]) -> None:
    for record in records:
        assert record["freed"] == {variant: True for variant in VARIANTS}


def test_mismatched_shapes_raise_on_every_rank(records: list[dict]) -> None:
    for record in records:
        assert record["mismatch"] is not None and "0.weight" in record["mismatch"]


def test_second_backward_without_finish_raises(records: list[dict]) -> None:
    for record in records:
        assert record["double_backward"] is not None and "no_sync" in record["double_backward"]


def test_collectives_rows_are_well_formed(records: list[dict]) -> None:
    rows = records[0]["collectives"]
    assert rows == records[1]["collectives"]  # the slowest rank's median, agreed on by all ranks
    assert [(r["op"], r["bytes"]) for r in rows] == [(op, b) for b in (4096, 40_000) for op in OPS]
    for r in rows:
        assert r["backend"] == "gloo" and r["world_size"] == WORLD_SIZE
        assert r["time_ms"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_ms"] / 1e3) / 1e9)
        factor = 2 * (WORLD_SIZE - 1) / WORLD_SIZE if r["op"] == "all_reduce" else (WORLD_SIZE - 1) / WORLD_SIZE
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)


def test_tree_reductions_sum_over_ranks(records: list[dict]) -> None:
    # 1 + 2 for each element: all-reduce [3, 30] everywhere; rank r receives chunk r of every rank's input.
    for rank, record in enumerate(records):
        assert record["tree"]["all_reduce"] == [3.0, 30.0]
        assert record["tree"]["reduce_scatter"] == [3.0 * (2 * rank + 1), 3.0 * (2 * rank + 2)]
        assert "world_size (2) x output (3)" in record["tree"]["size_error"]


def test_unused_parameters_are_not_counted_by_default(records: list[dict]) -> None:
    for record in records:
        got = record["default_unused"]
        assert got["all_reduces"] == got["trainable"]  # one per gradient, no extra flag reduction
        assert torch.equal(got["unused_grad"], torch.zeros_like(got["unused_grad"]))
    # Only rank 0 used `extra`: every rank holds the average of rank 0's gradient and zeros.
    assert torch.equal(records[0]["default_unused"]["extra_grad"], records[1]["default_unused"]["extra_grad"])
    assert records[0]["default_unused"]["extra_grad"].abs().sum() > 0


@pytest.mark.parametrize("cls", [NaiveDDP, FlatDDP, OverlappedDDP, BucketedDDP])
def test_without_a_process_group_a_wrapper_is_a_single_rank(cls) -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ddp = cls(model)
    x = torch.randn(4, 3)
    ddp(x).sum().backward()
    ddp.finish_gradient_synchronization()
    plain = torch.nn.Linear(3, 2)
    plain.load_state_dict(model.state_dict())
    plain(x).sum().backward()
    assert torch.equal(model.weight.grad, plain.weight.grad) and torch.equal(model.bias.grad, plain.bias.grad)
