"""Counting live tensor storages (cs336_harness.analysis.live_memory), and the leaderboard memory plan against that
count of the step itself on fake tensors (and, on a GPU, against the allocator)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cs336_basics.config import ModelConfig
from cs336_harness import registry
from cs336_harness.analysis.live_memory import LiveMemory, fake_tensors
from cs336_harness.device import GIB
from cs336_harness.memory_plan import expected_peak_bytes, memory_plan
from cs336_harness.studies.leaderboard import PROXY_DEFAULTS, LeaderboardConfig, traced_peak
from cs336_harness.train_config import OptimizerConfig, Parallelism, TrainConfig
from cs336_sharding.checkpointing import parse_policy

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_storage_counts_once_until_it_is_freed() -> None:
    with LiveMemory() as live:
        a = torch.empty(1000)
        view = a.view(10, 100)[2:]  # same storage
        assert live.live_bytes == 4000
        b = view + 1  # 800 new floats
        assert live.live_bytes == 4000 + 3200
        del b
        assert live.live_bytes == 4000 and live.peak_bytes == 7200
        live.reset_peak()
        assert live.peak_bytes == 4000
        del a, view
        assert live.live_bytes == 0


def test_storages_made_before_are_not_counted_and_resizes_are() -> None:
    before = torch.ones(10)
    resize = torch.UntypedStorage.resize_
    with LiveMemory() as live:
        full = torch.empty(256, dtype=torch.float16)
        full.untyped_storage().resize_(0)  # how FSDP frees a gathered weight
        assert live.live_bytes == 0 and live.peak_bytes == 512
        full.untyped_storage().resize_(512)
        assert live.live_bytes == 512
        before.add_(1)  # in place on an uncounted storage: nothing new
        assert live.live_bytes == 512
    assert torch.UntypedStorage.resize_ is resize


def test_fake_tensors_count_what_real_ones_would_hold() -> None:
    with fake_tensors(), LiveMemory(sites=True) as live:
        x = torch.empty(2**20, 2**10, dtype=torch.bfloat16)  # 2 GiB, never allocated
        assert int(x.sum().item()) == 0  # a host read of a fake value gets 0
        y = x.float()
        del y
    assert live.peak_bytes == 6 * GIB  # x and its fp32 copy
    top = live.peak_sites()[0]
    assert "_to_copy" in top.what and top.bytes == 4 * GIB and top.count == 1
    assert "test_live_memory.py" not in top.where  # only frames of cs336 packages name a site


def test_a_backward_that_works_in_place_on_a_device_does_so_on_fake_tensors() -> None:
    # Gather's backward makes zeros and scatter-adds into them: in place, except on fake tensors or under a
    # dispatch mode (as LiveMemory is), where PyTorch calls the out-of-place operator. Counted, the gradient is
    # held once, as in a run without the mode; beside it, the loss and its gradient (two fp32 scalars).
    def peak(fake: bool) -> int:
        with fake_tensors() if fake else contextlib.nullcontext():
            logits = torch.zeros(256, 1024, requires_grad=True)
            targets = torch.zeros(256, 1, dtype=torch.long)
            with LiveMemory() as live:
                logits.gather(-1, targets).sum().backward()
        return live.peak_bytes

    assert peak(fake=True) == peak(fake=False) == 256 * 1024 * 4 + 2 * 4


def test_peak_sites_needs_sites() -> None:
    with LiveMemory() as live:
        torch.empty(4)
    with pytest.raises(ValueError, match="sites=True"):
        live.peak_sites()


# The memory plan, exact for ours: the proxy's 8B block shape, context 32,768.

def _proxy(**overrides: object) -> TrainConfig:
    return LeaderboardConfig(**{**PROXY_DEFAULTS, "backend": "nccl", "glue": "triton", **overrides}).train_config()


@pytest.mark.parametrize("overrides", [
    dict(num_layers=3, checkpoint="none"),  # peak in the last block's backward
    dict(num_layers=3, checkpoint="all"),  # in the first block's backward
    pytest.param(dict(num_layers=3, checkpoint="attention:1", fused_qkv=True), marks=pytest.mark.slow),
    # in the embedding's backward:
    pytest.param(dict(num_layers=3, checkpoint="attention:2", context_length=8192), marks=pytest.mark.slow),
    pytest.param(dict(num_layers=4, checkpoint="attention:1+selective:2"), marks=pytest.mark.slow),
    pytest.param(dict(checkpoint="attention:7"), marks=pytest.mark.slow),  # the 14-layer proxy
    pytest.param(dict(num_layers=5, checkpoint="group:3"), marks=pytest.mark.slow),
    pytest.param(dict(num_layers=4, checkpoint="nested:2"), marks=pytest.mark.slow),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_the_plan_expects_the_traced_peak(overrides: dict) -> None:
    config = _proxy(**overrides)
    plan = memory_plan(config, None)
    assert plan.expected_peak_bytes == pytest.approx(traced_peak(config).peak_bytes, abs=2**20)


@pytest.mark.slow
def test_the_proxy_budget_recomputes_matmuls_only_where_memory_forces() -> None:
    config = _proxy(checkpoint="budget", memory_cap_gib=92.0)
    plan = memory_plan(config, None)
    assert str(plan.policy) == "selective:13"  # no block recomputes a matmul
    assert plan.expected_peak_bytes == pytest.approx(traced_peak(config).peak_bytes, abs=2**20)
    assert plan.expected_peak_bytes <= 92 * GIB
    # One block fewer recomputing anything does not fit.
    assert expected_peak_bytes(config, plan.step, parse_policy("selective:12")) > 92 * GIB


# The plan to the byte at a tiny awkward shape (a prime context and vocabulary, three sequences, five blocks) for every
# loss and every checkpointing kind, with either glue and compute dtype spread over them: the fake-tensor count takes
# as long at any size, and at this one every small tensor (rstd, int64 ids, a norm's gradient) shows. Five blocks make
# segments of several blocks differ: group:2 (2, 2, 1), group:3 and sqrt (3, 2: the short one last), nested:2
# ((2, 1), 2) and nested:3 (2, 2, 1).
_TINY = ModelConfig.from_preset("tiny", vocab_size=997, context_length=37, num_layers=5, d_model=48, num_heads=3,
                                d_ff=136)
_KINDS = ["none", "all", "first:2", "selective:3", "attention", "attention:2+selective:2", "first:1+selective:2",
          "group:2", "group:3", "sqrt", "nested:2", "nested:3"]
_EVERY_LOSS_AND_KIND = [(loss, kind, ("triton", "model")[(i + j) % 2], ("bf16", "fp32")[j % 2])
                        for i, loss in enumerate(registry.LOSSES) for j, kind in enumerate(_KINDS)]
# In the default run besides none and all: a segment of several blocks whose blocks do not save their input (the
# model's glue in bf16), and nested segments.
_DEFAULT_RUN = {("fused", "group:3"), ("standard", "nested:2")}


@pytest.mark.parametrize(("loss", "checkpoint", "glue", "dtype"), [
    case if case[1] in ("none", "all") or case[:2] in _DEFAULT_RUN else pytest.param(*case, marks=pytest.mark.slow)
    for case in _EVERY_LOSS_AND_KIND])
def test_the_plan_is_the_traced_peak_for_every_loss(loss: str, checkpoint: str, glue: str, dtype: str) -> None:
    config = TrainConfig(_TINY, kernels=registry.kernels("sdpa", glue, loss), global_batch=3,
                         parallelism=Parallelism(checkpoint=checkpoint, compute_dtype=dtype),
                         optimizer=OptimizerConfig("adamw"))
    assert memory_plan(config, None).expected_peak_bytes == traced_peak(config).peak_bytes


def test_traced_peak_refuses_what_it_cannot_trace() -> None:
    with pytest.raises(ValueError, match="on one rank"):
        traced_peak(_proxy(world_size=2, global_batch=2))
    with pytest.raises(ValueError, match="memory_cap_gib"):
        traced_peak(_proxy(checkpoint="budget"))
    with pytest.raises(ValueError, match="eager"):
        traced_peak(_proxy(glue="compiled"))
    with pytest.raises(ValueError, match="eager"):
        traced_peak(_proxy(compile_blocks=True))


# The allocator's peak of a step in a process of its own: what earlier GPU tests leave in the allocator changes the
# peak it reports (by 0.34 GiB after the proxy's GPU tests), which is not the step's memory. The proxy's 8B block
# shape with our kernels and glue, bf16, three layers at context 8192, each loss.
_ALLOCATOR_PEAK = """
import sys
import torch
from cs336_harness.training import build_training, rank_batch
sys.path.insert(0, sys.argv[3])
from test_live_memory import gpu_proxy_step
config = gpu_proxy_step(sys.argv[1], sys.argv[2])
training = build_training(config, torch.device("cuda"))
inputs, targets = rank_batch(config, 0, torch.device("cuda"))
for _ in range(2):  # the runner's warm-up: the optimizer's state, compiles and autotunes, cuBLAS's workspace
    training.step(inputs, targets)
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
training.step(inputs, targets)
torch.cuda.synchronize()
print(torch.cuda.max_memory_allocated())
"""
_GPU_KINDS = ["none", "all", "first:2", "selective:2", "attention:1", "attention:1+selective:1", "offload:1"]
# The quick GPU run measures ours (the fused loss) under two policies at once; the other 20 steps, each an 8B-block
# step in a process of its own that the whole GPU waits on, are slow: tools/gpu_memory_plan.sh runs all 21.
_QUICK_GPU_STEP = ("fused", "attention:1+selective:1")


def gpu_proxy_step(loss: str, checkpoint: str) -> TrainConfig:
    """The step the GPU memory test measures (and the subprocess it starts builds)."""
    model = ModelConfig.from_preset("8B", vocab_size=PROXY_DEFAULTS["vocab_size"], context_length=8192, num_layers=3)
    return TrainConfig(model, kernels=registry.kernels("triton", "triton", loss), optimizer=OptimizerConfig(),
                       parallelism=Parallelism(compute_dtype="bf16", checkpoint=checkpoint))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.gpu_exclusive
@pytest.mark.parametrize(("loss", "checkpoint"), [
    pytest.param(loss, kind, id=f"{loss}-{kind}", marks=() if (loss, kind) == _QUICK_GPU_STEP else pytest.mark.slow)
    for loss in registry.LOSSES for kind in _GPU_KINDS])
def test_gpu_allocator_peak_is_the_planned_peak(loss: str, checkpoint: str) -> None:
    run = subprocess.run([sys.executable, "-c", _ALLOCATOR_PEAK, loss, checkpoint, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    measured = int(run.stdout.split()[-1])
    config = gpu_proxy_step(loss, checkpoint)
    planned = memory_plan(config, None).expected_peak_bytes
    # The numbers behind the verdict, for the GPU log (tools/gpu_memory_plan.sh runs with -s).
    print(f"\n{loss} {checkpoint}: planned {planned / GIB:.3f} GiB, allocator {measured / GIB:.3f} GiB, "
          f"difference {(measured - planned) / GIB:+.3f} GiB")
    if parse_policy(checkpoint).kind == "offload":
        # What offloaded blocks save leaves for host memory as the later blocks run; the plan counts the copies as
        # out by the backward, and their return with the next block's backward at once: a bound from above, up to
        # what the count leaves out (below).
        assert -0.1 * GIB <= planned - measured < 1.5 * GIB
        return
    # What the count leaves out: the allocator's 512-byte rounding and the libraries' workspaces (cuBLAS: 32 MiB
    # per stream and handle).
    assert planned == traced_peak(config).peak_bytes
    assert measured - planned == pytest.approx(0, abs=0.1 * GIB)
