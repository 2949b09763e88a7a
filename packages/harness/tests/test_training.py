"""cs336_harness.training: a step composed from pieces given as callables, the user's own among them, with the memory
budget sized for them (what a block keeps measured on fake tensors), and the config's checks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from cs336_basics.config import ModelConfig
from cs336_basics.model import BlockKernels
from cs336_harness.device import GIB
from cs336_harness.memory_plan import measure_block, memory_plan, reserved_bytes
from cs336_harness.train_config import OptimizerConfig, Parallelism, TrainConfig
from cs336_harness.training import build_training, make_batch
from cs336_sharding.checkpointing import activation_peak_bytes, kept_bytes

MODEL = ModelConfig.from_preset("tiny", vocab_size=101, context_length=24, num_layers=4)


def test_own_attention_and_optimizer_train_under_a_memory_budget() -> None:
    calls = {"attention": 0, "optimizer": 0}

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
        # Causal softmax attention written out (no fused operator: the attention policies keep nothing of it).
        calls["attention"] += 1
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v

    def momentum_sgd(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        calls["optimizer"] += 1
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)

    base = TrainConfig(MODEL, kernels=BlockKernels(attention=attention), global_batch=2,
                       optimizer=OptimizerConfig(momentum_sgd, lr=0.05, weight_decay=0.0))
    block = measure_block(base).memory
    assert block.kept > block.selective > block.checkpointed == 2 * 24 * MODEL.d_model * 4  # the output, fp32
    # A cap that holds two blocks' activations whole and the rest checkpointed, but not every block whole.
    blocks = activation_peak_bytes(block, 4, "first:2")
    assert blocks < activation_peak_bytes(block, 4, "none")
    cap = reserved_bytes(base) + blocks
    config = dataclasses.replace(base, parallelism=Parallelism(checkpoint="budget", memory_cap_gib=cap / GIB))
    plan = memory_plan(config, None)
    assert plan.step.block == block and str(plan.policy) not in ("none", "all")
    assert reserved_bytes(config) + activation_peak_bytes(block, 4, plan.policy) <= cap
    assert sum(kept_bytes(block, 4, plan.policy)) < 4 * block.kept  # some block recomputes

    calls["optimizer"] = 0
    training = build_training(config, torch.device("cpu"))
    # Once for the plan (on fake parameters: its update's temporaries), once for the step.
    assert calls["optimizer"] == 2 and isinstance(training.optimizer, torch.optim.SGD)
    assert training.model.module.layers.policy == str(plan.policy)  # checkpointed as planned
    inputs, targets = make_batch(config)
    calls["attention"] = 0
    losses = [training.step(inputs, targets).item() for _ in range(3)]
    assert losses[2] < losses[1] < losses[0]  # the same batch three times: the step learns it
    assert calls["attention"] >= 3 * 4  # every block's forward each step, and the recomputed ones again


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: TrainConfig({"d_model": 64}), TypeError, "model must be a ModelConfig"),
    (lambda: TrainConfig(MODEL, kernels={"attention": None}), TypeError, "kernels must be a BlockKernels"),
    (lambda: TrainConfig(MODEL, global_batch=3, parallelism=Parallelism(world_size=2)), ValueError,
     "global_batch .3. must be a multiple of world_size .2."),
    (lambda: TrainConfig(MODEL, fused_qkv=1), TypeError, "fused_qkv must be a bool"),
    (lambda: Parallelism(world_size=0), ValueError, "world_size must be a positive int"),
    (lambda: Parallelism(compute_dtype="fp16"), ValueError, "compute_dtype must be one of fp32, bf16, got 'fp16'"),
    (lambda: Parallelism(wrapper="deepspeed"), ValueError,
     "wrapper must be one of none, naive, flat, overlapped, bucketed, torch_ddp, zero1, fsdp, fsdp2, got 'deepspeed'"),
    (lambda: Parallelism(checkpoint="every:2"), ValueError, "unknown checkpoint policy"),
    (lambda: Parallelism(memory_cap_gib=0.0), ValueError, "memory_cap_gib must be positive"),
    (lambda: OptimizerConfig("sgd"), ValueError, "optimizer must be one of adamw, torch-adamw, fused-adamw"),
    (lambda: OptimizerConfig(3), TypeError, "a callable fn.params, lr, weight_decay."),
    (lambda: OptimizerConfig("adamw", lr=0.0), ValueError, "lr > 0"),
])
def test_config_rejects_bad_values(make, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        make()


def test_a_step_on_a_batch_larger_than_the_configs_is_refused() -> None:
    """The memory plan and checkpointing were sized for the config's batch: a larger one is an error, not a run."""
    config = TrainConfig(dataclasses.replace(MODEL, context_length=16), global_batch=2)
    training = build_training(config, torch.device("cpu"))
    inputs, targets = make_batch(config)
    assert training.step(inputs[:1], targets[:1]).isfinite()  # a smaller share fits what was planned
    for ids in (torch.cat([inputs, inputs]), torch.cat([inputs, inputs], dim=1)):
        with pytest.raises(ValueError, match=r"^token_ids must be \(batch, seq\) with at most 2 sequences of at most "
                                             rf"16 tokens .*, got \({ids.shape[0]}, {ids.shape[1]}\)$"):
            training.step(ids, ids)
    with pytest.raises(ValueError, match=r"targets must be shaped like token_ids \(2, 16\), got \(2, 15\)"):
        training.step(inputs, targets[:, :-1])


def test_a_budget_cap_below_what_the_step_holds_names_the_cap_and_what_it_must_cover() -> None:
    config = TrainConfig(MODEL, parallelism=Parallelism(checkpoint="budget", memory_cap_gib=1e-4))
    with pytest.raises(ValueError, match=r"^the memory cap, 0.0001 GiB, must cover what the step holds besides the "
                                         r"blocks' activations \(.* GiB: this rank's weights and AdamW state, .*\) "
                                         r"and leave room for them; raise memory_cap_gib \(--memory-cap-gib\) above "
                                         r"that$"):
        memory_plan(config, None)
