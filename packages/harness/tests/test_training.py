"""cs336_harness.training: a step composed from pieces given as callables, the user's own among them (an attention
defined outside the packages, own_pieces.py), in a bench step, a two-rank data-parallel step and the memory plan, with
the memory budget sized for them; and the config's checks."""

from __future__ import annotations

import dataclasses

import own_pieces
import pytest
import torch
from cs336_basics.config import ModelConfig
from cs336_basics.model import BlockKernels
from cs336_comms.process_group import spawn
from cs336_harness import cli, registry
from cs336_harness.device import GIB
from cs336_harness.memory_plan import expected_peak_bytes, memory_plan
from cs336_harness.step_memory import measure_step
from cs336_harness.studies.leaderboard import traced_peak
from cs336_harness.train_config import OptimizerConfig, Parallelism, TrainConfig
from cs336_harness.training import build_training, make_batch
from cs336_sharding.checkpointing import kept_bytes, parse_policy

MODEL = ModelConfig.from_preset("tiny", vocab_size=101, context_length=24, num_layers=4)
OWN = BlockKernels(attention=own_pieces.own_attention)


def test_own_attention_runs_in_bench_a_data_parallel_step_and_the_memory_plan(own_registry, capsys) -> None:
    # The command line takes it by name once registered: one bench step.
    registry.register_attention("own", own_pieces.own_attention)
    own_pieces.CALLS["attention"] = 0
    assert cli.main(["bench", "--attention", "own", "--context-length", "17", "--batch-size", "2", "--warmup", "0",
                     "--steps", "1", "--quiet"]) == 0
    assert own_pieces.CALLS["attention"] == 2  # the tiny preset's two blocks
    bench_row = capsys.readouterr().out.splitlines()[2].split()
    assert bench_row[:4] == ["tiny", "17", "train", "fp32"] and {"own", "ok"} <= set(bench_row)

    # Two gloo ranks of our bucketed DDP take one step on half the batch each: the same as one process on all of it.
    config = TrainConfig(MODEL, kernels=OWN, global_batch=4, optimizer=OptimizerConfig(own_pieces.sgd, lr=0.1),
                         parallelism=Parallelism(world_size=2, backend="gloo", wrapper="bucketed"))
    ranks = spawn(own_pieces.data_parallel_step, 2, config, backend="gloo", timeout_s=120)
    assert ranks["in_sync"] and ranks["attention_calls"] == 4
    one = build_training(dataclasses.replace(config, parallelism=Parallelism(wrapper="none")), torch.device("cpu"))
    one.step(*make_batch(config))
    for name, want in one.model.named_parameters():
        torch.testing.assert_close(ranks["params"][name], want.detach(), rtol=1e-5, atol=1e-6)

    # The memory plan counts its (seq, seq) scores: the step's peak to the byte, for each loss.
    for loss in registry.LOSSES:
        step = TrainConfig(MODEL, kernels=dataclasses.replace(OWN, loss=registry.loss(loss)), global_batch=2,
                           optimizer=OptimizerConfig("adamw"), parallelism=Parallelism(checkpoint="first:1"))
        assert memory_plan(step, None).expected_peak_bytes == traced_peak(step).peak_bytes


def test_own_attention_and_optimizer_train_under_a_memory_budget() -> None:
    calls = {"optimizer": 0}

    def momentum_sgd(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        calls["optimizer"] += 1
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)

    # Long enough sequences that the blocks' activations (the attention's (seq, seq) scores) outweigh the rest.
    base = TrainConfig(dataclasses.replace(MODEL, context_length=96), kernels=OWN, global_batch=4,
                       optimizer=OptimizerConfig(momentum_sgd, lr=0.05, weight_decay=0.0))
    step = measure_step(base)
    assert step.block.kept > step.block.selective > step.block.checkpointed == 4 * 96 * MODEL.d_model * 4  # fp32
    # A cap that holds two blocks' activations whole and the rest checkpointed, but not every block whole.
    cap = expected_peak_bytes(base, step, parse_policy("first:2"))
    assert expected_peak_bytes(base, step, parse_policy("all")) < cap < expected_peak_bytes(base, step,
                                                                                            parse_policy("none"))
    config = dataclasses.replace(base, parallelism=Parallelism(checkpoint="budget", memory_cap_gib=cap / GIB))
    plan = memory_plan(config, None)
    assert plan.step == step and str(plan.policy) not in ("none", "all")
    assert plan.expected_peak_bytes <= cap and plan.expected_peak_bytes == traced_peak(config).peak_bytes
    assert sum(kept_bytes(step.block, 4, plan.policy)) < 4 * step.block.kept  # some block recomputes
    with pytest.raises(ValueError, match=r"^the memory cap, .* GiB, is below the step's peak with every block "
                                         r"checkpointed \(.* GiB: this rank's weights, gradients and optimizer state, "
                                         r".*\); raise memory_cap_gib \(--memory-cap-gib\) to that or more$"):
        memory_plan(dataclasses.replace(config, parallelism=Parallelism(checkpoint="budget", memory_cap_gib=1e-4)),
                    None)

    calls["optimizer"] = 0
    training = build_training(config, torch.device("cpu"))
    # Once for the plan (on fake parameters: its update's temporaries), once for the step when it first needs it.
    assert calls["optimizer"] == 1
    assert isinstance(training.optimizer, torch.optim.SGD) and calls["optimizer"] == 2
    assert training.model.module.layers.policy == str(plan.policy)  # checkpointed as planned
    inputs, targets = make_batch(config)
    own_pieces.CALLS["attention"] = 0
    losses = [training.step(inputs, targets).item() for _ in range(3)]
    assert losses[2] < losses[1] < losses[0]  # the same batch three times: the step learns it
    assert own_pieces.CALLS["attention"] >= 3 * 4  # every block's forward each step, and the recomputed ones again


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
    (lambda: Parallelism(compile="graph"), ValueError, "compile must be one of none, blocks, model, got 'graph'"),
    (lambda: Parallelism(compile="model"), ValueError, "compile 'model' compiles the bare model .wrapper 'none'., got "
                                                       "wrapper 'fsdp'; under a wrapper, compile 'blocks'"),
    (lambda: Parallelism(bucket_size_mb=0), ValueError, "bucket_size_mb must be positive, got 0"),
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


def test_a_compute_dtype_is_autocast_where_the_wrapper_does_not_cast_the_weights() -> None:
    casting = {w for w in ("none", "naive", "flat", "overlapped", "bucketed", "torch_ddp", "zero1", "fsdp", "fsdp2")
               if not Parallelism(compute_dtype="bf16", wrapper=w).autocast}
    assert casting == {"fsdp", "fsdp2"} and not Parallelism(wrapper="none").autocast  # fp32: nothing to cast
    config = TrainConfig(dataclasses.replace(MODEL, context_length=8), global_batch=2,
                         parallelism=Parallelism(compute_dtype="bf16", wrapper="none"))
    training = build_training(config, torch.device("cpu"))
    seen = []
    training.model.layers[0].ffn.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    training.forward(*make_batch(config))
    assert seen == [torch.bfloat16]  # the blocks' matmuls ran under autocast; the weights stay fp32
    assert all(p.dtype == torch.float32 for p in training.model.parameters())
    for wrapper in ("torch_ddp", "zero1", "fsdp2"):
        with pytest.raises(ValueError, match=f"wrapper '{wrapper}' on world_size 1 needs an initialised process "
                                             "group of that many ranks; without one, world_size 1 runs with any "
                                             "wrapper but torch_ddp, zero1, fsdp2"):
            build_training(dataclasses.replace(config, parallelism=Parallelism(wrapper=wrapper)), torch.device("cpu"))
