"""Data-parallel training in deterministic mode against true full-batch training, bit for bit (issue 15).

FSDP (through tests/adapters.py), ZeRO-1 over BucketedDDP gradients and the four DDP wrappers train the
course's toy model, a toy with odd weight sizes, a small Transformer and (FSDP only) a toy whose LM head is
tied to its embedding, with SGD, our AdamW, torch's AdamW and FusedAdamW, on 2 and 4 gloo ranks that each
take a contiguous shard of the batch; after every step their fp32 parameters must equal those of one process
trained on the whole batch. One spawn runs every check of a world size (determinism_checks.py), and the tests assert
on what each rank recorded: the quick run spawns 4 ranks for a share of the runs that has every wrapper, model and
optimizer, and every other check; the whole matrix on 2 and 4 ranks is marked slow.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from cs336_comms.process_group import spawn
from determinism_checks import GPU_RUNS, QUICK_RUNS, RUNS, STEPS, cpu_checks, gpu_checks, quick_checks

# Imported once, in the server the CPU ranks fork from, instead of in every rank: what determinism_checks imports from
# the packages, and torch._dynamo, which torch.use_deterministic_algorithms imports (seconds each on a CPU). CUDA
# ranks start fresh: a fork server must not have touched CUDA, and an import may.
PRELOAD = ("torch._dynamo", "cs336_basics.model", "cs336_comms.ddp", "cs336_kernels", "cs336_sharding.fsdp",
           "cs336_sharding.optimizer")


def _spawn(fn, world_size: int, out, preload: tuple[str, ...] = PRELOAD) -> list[dict]:
    spawn(fn, world_size, str(out), backend="gloo", timeout_s=300, preload=preload)
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


@pytest.fixture(scope="session")
def quick(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Four ranks: QUICK_RUNS (every wrapper, model and optimizer) and every check that is not a run."""
    return _spawn(quick_checks, 4, tmp_path_factory.mktemp("determinism_quick"))


@pytest.fixture(scope="session", params=[pytest.param(w, marks=pytest.mark.slow) for w in (2, 4)],
                ids=lambda w: f"{w}ranks")
def records(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every run of RUNS on 2 and on 4 ranks (several seconds each on two CPU cores, beyond the quick run: slow)."""
    return _spawn(cpu_checks, request.param, tmp_path_factory.mktemp(f"determinism{request.param}"))


def _assert_bit_identical(records: list[dict], run: tuple[str, str, str]) -> None:
    for rank, record in enumerate(records):
        got_steps = record["runs"][run]
        want_steps = record["full_batch"][run[1:]]
        assert len(got_steps) == len(want_steps) == STEPS
        for step, (got, want) in enumerate(zip(got_steps, want_steps, strict=True)):
            assert got.keys() == want.keys()
            for name in want:
                assert got[name].dtype == torch.float32
                diff = (got[name] - want[name]).abs().max().item()
                assert torch.equal(got[name], want[name]), f"rank {rank} step {step}: {name} differs by {diff:.3g}"


@pytest.mark.parametrize("run", QUICK_RUNS, ids=["-".join(r) for r in QUICK_RUNS])
def test_data_parallel_equals_full_batch_training_quick(quick: list[dict], run: tuple[str, str, str]) -> None:
    _assert_bit_identical(quick, run)


@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_data_parallel_equals_full_batch_training(records: list[dict], run: tuple[str, str, str]) -> None:
    _assert_bit_identical(records, run)


def test_wrappers_over_a_process_group_keep_to_it(quick: list[dict]) -> None:
    for rank, record in enumerate(quick):
        for run, got_steps in record["pairs"].items():
            want_steps = record["full_batch"][run[1:]]
            for step, (got, want) in enumerate(zip(got_steps, want_steps, strict=True)):
                for name in want:
                    assert torch.equal(got[name], want[name]), f"rank {rank} {run} step {step}: {name} differs"


def test_without_deterministic_mode_the_comparison_sees_the_summation_order(quick: list[dict]) -> None:
    # The case (FSDP, course model, SGD) in the ordinary mode, where the ranks sum their shares: if
    # these were equal, the tests above could not tell a tree reduction from any other order.
    for record in quick:
        fsdp, full = record["plain"]
        assert any(not torch.equal(f[n], w[n]) for f, w in zip(fsdp, full, strict=True) for n in w)


def test_ordinary_mode_calls_no_deterministic_function(quick: list[dict]) -> None:
    for record in quick:
        assert set(record["calls_plain"].values()) == {0}, record["calls_plain"]
        assert all(n > 0 for n in record["calls_deterministic"].values()), record["calls_deterministic"]


def test_reductions_add_ranks_as_a_balanced_tree(quick: list[dict]) -> None:
    e = 2.0**-24
    for record in quick:
        assert record["tree_order"] == {"all_reduce": [e] * 3, "reduce_scatter": [e] * 2}


@pytest.mark.gpu
@pytest.mark.gpu_exclusive
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_data_parallel_equals_full_batch_training(tmp_path) -> None:
    records = _spawn(gpu_checks, 2, tmp_path, preload=())
    failures = []
    for run in GPU_RUNS:
        try:
            _assert_bit_identical(records, run)
        except AssertionError as e:
            failures.append(f"{'-'.join(run)}: {e}")
    assert not failures, "\n".join(failures)
