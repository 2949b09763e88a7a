"""cs336 leaderboard: one sharded step (FSDP, fused LM head loss, fused or torch AdamW, Triton or SDPA
attention, checkpointing, our glue kernels, one qkv matmul) and the PyTorch-only baselines (FSDP2, chunked loss)
on two ranks and on one, against a plain single-process step (the model's own glue, logits, F.cross_entropy,
torch AdamW) over the same global batch, in fp32; config checks; the command on CPU; a run on two GPUs.

The sharded step differs from the reference in summation order and fp32 rounding only (chunked loss, per-rank
halves of the batch, a reduce-scatter, kernels instead of the model's glue), so losses and updated parameters
agree to fp32 rounding, not bitwise."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cs336_basics.config import ModelConfig
from cs336_comms.process_group import spawn
from cs336_harness import cli, device, registry
from cs336_harness.device import GIB
from cs336_harness.memory_plan import expected_peak_bytes, memory_plan
from cs336_harness.studies import leaderboard
from cs336_harness.studies.leaderboard import LeaderboardConfig
from cs336_harness.train_config import build_model
from cs336_harness.training import build_training, make_batch
from cs336_sharding.checkpointing import apply_checkpointing, parse_policy
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the checks module by name

from leaderboard_checks import one_step_each  # noqa: E402

# fp32 rounding of a few differently ordered sums. The gradients are compared directly, since AdamW hides
# a wrong gradient scale. AdamW's first step moves a weight by lr * g / (|g| + eps), which turns rounding of a
# gradient near eps (1e-8) into an error of a sizeable fraction of lr, so parameters are compared where the
# reference gradient exceeds CONDITIONED_GRAD = 100 eps; there the update's error is tiny. A gradient that
# is exactly zero (an embedding row no input token uses) is well conditioned too: only weight decay moves it.
LOSS_RTOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4
CONDITIONED_GRAD = 1e-6
PARAM_ATOL, PARAM_RTOL = 1e-6, 1e-5

# Awkward sizes: a prime context and vocabulary, two sequences per rank. One config per attention; the
# optimizers and checkpointing policies are spread over them.
_SMALL = dict(size="tiny", vocab_size=37, context_length=13, global_batch=4, world_size=2, compute_dtype="fp32",
              lr=1e-4, warmup=0, steps=1)
_GLUE = dict(_SMALL, backend="gloo", attention="triton", glue="triton", fused_qkv=True, seed=2)


def _cap_for(config: LeaderboardConfig, policy: str) -> float:
    """The memory cap (GiB) that is exactly the peak ``policy`` plans: the budget rule must pick it."""
    train = dataclasses.replace(config, checkpoint="all", memory_cap_gib=None).train_config()
    return expected_peak_bytes(train, memory_plan(train, None).step, parse_policy(policy)) / GIB


CPU_CONFIGS = [
    LeaderboardConfig(**_SMALL, backend="gloo", attention="sdpa", optimizer="fused-adamw", checkpoint="all"),
    LeaderboardConfig(**_SMALL, backend="gloo", attention="triton", optimizer="torch-adamw", checkpoint="group:2",
                      seed=1),
    LeaderboardConfig(**_GLUE, checkpoint="budget", memory_cap_gib=_cap_for(LeaderboardConfig(**_GLUE), "selective:1")),
    leaderboard.recipe(LeaderboardConfig(**_SMALL, backend="gloo", seed=3), "torch_native"),
    # Three tiers: attention outputs kept, matmul outputs kept, a block kept whole.
    LeaderboardConfig(**{**_GLUE, "num_layers": 3, "checkpoint": "attention:1+selective:1", "fused_qkv": False}),
]
# On one rank: ours with the compiled glue is slow to compile, so the one-rank set is ours plain and the baseline.
ONE_RANK_CONFIGS = [dataclasses.replace(c, global_batch=2, world_size=1) for c in (CPU_CONFIGS[0], CPU_CONFIGS[3])]


def _reference_step(config: LeaderboardConfig, checkpoint: str, device: torch.device) -> tuple[float, dict, dict]:
    """One plain step on one process over the whole global batch: the model's own glue and three q / k / v
    matmuls, logits, F.cross_entropy, torch AdamW."""
    # The same checkpointing keeps the parameter names equal to the sharded model's; it changes no value.
    model = build_model(config.model_config, registry.kernels(config.attention), seed=config.seed, device=device)
    model = apply_checkpointing(model, checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    inputs, targets = (t.to(device) for t in make_batch(config.train_config()))
    logits = model(inputs)  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {name: p.grad.cpu() for name, p in model.named_parameters()}
    optimizer.step()
    return loss.item(), grads, {name: p.detach().cpu() for name, p in model.named_parameters()}


def _sharded_steps(configs: list[LeaderboardConfig], tmp_path: Path) -> list[dict]:
    # CPU ranks fork from a server that imported these once (torch._dynamo: FSDP2 imports it), not each on its own;
    # CUDA ranks start fresh, since a fork server must not have touched CUDA and an import may.
    backend = configs[0].resolved_backend
    spawn(one_step_each, configs[0].world_size, configs, str(tmp_path), backend=backend, timeout_s=120,
          preload=("torch._dynamo", "cs336_harness.studies.leaderboard") if backend == "gloo" else ())
    return pickle.loads((tmp_path / "records.pkl").read_bytes())


def _assert_same_step(configs: list[LeaderboardConfig], records: list[dict], device: torch.device) -> None:
    for config, record in zip(configs, records, strict=True):
        loss, grads, params = _reference_step(config, record["checkpoint"], device)
        assert record["loss"] == pytest.approx(loss, rel=LOSS_RTOL), config
        assert record["grads"].keys() == grads.keys() == record["params"].keys() == params.keys()
        for name, want in grads.items():
            torch.testing.assert_close(record["grads"][name], want, atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                       msg=lambda m, n=name, c=config: f"{c.attention}/{c.optimizer} grad {n}: {m}")
        conditioned = 0
        for name, want in params.items():
            mask = (grads[name].abs() > CONDITIONED_GRAD) | (grads[name] == 0)
            conditioned += int(mask.sum())
            torch.testing.assert_close(record["params"][name][mask], want[mask], atol=PARAM_ATOL, rtol=PARAM_RTOL,
                                       msg=lambda m, n=name, c=config: f"{c.attention}/{c.optimizer} param {n}: {m}")
        assert conditioned > 0.99 * sum(p.numel() for p in params.values())
        # The step did move every weight (a test that cannot fail is no test).
        train = config.train_config()
        initial = apply_checkpointing(build_model(train.model, train.kernels, fused_qkv=train.fused_qkv,
                                                  seed=train.seed, device=device), record["checkpoint"])
        moved = [n for n, p in initial.named_parameters() if not torch.equal(p.detach().cpu(), record["params"][n])]
        assert len(moved) == len(params)


@pytest.mark.slow
def test_sharded_step_matches_single_process_step(tmp_path: Path) -> None:
    records = _sharded_steps(CPU_CONFIGS, tmp_path)
    assert [r["checkpoint"] for r in records] == ["all", "group:2", "selective:1", "all", "attention:1+selective:1"]
    _assert_same_step(CPU_CONFIGS, records, torch.device("cpu"))


def test_one_rank_step_matches_single_process_step(tmp_path: Path) -> None:
    _assert_same_step(ONE_RANK_CONFIGS, _sharded_steps(ONE_RANK_CONFIGS, tmp_path), torch.device("cpu"))


@pytest.mark.slow
def test_compiled_steps_match_single_process_step(tmp_path: Path) -> None:
    # torch.compile on CPU (Inductor's C++ backend): the strong baseline on FSDP2, and ours (our FSDP) with compiled
    # glue and blocks, each block compiled with its checkpoint.
    configs = [leaderboard.recipe(LeaderboardConfig(**_SMALL, backend="gloo", seed=4, num_layers=3,
                                                    memory_cap_gib=2.1 / 1024), "torch_native_compiled"),
               LeaderboardConfig(**_SMALL, backend="gloo", attention="sdpa", glue="compiled", compile_blocks=True,
                                 checkpoint="attention", seed=5)]
    records = _sharded_steps(configs, tmp_path)
    assert records[0]["checkpoint"] == "first:1+selective:1"  # 2.1 MiB: each kind of block once
    _assert_same_step(configs, records, torch.device("cpu"))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("size", "huge", "size must be one of"),
    ("global_batch", 3, "multiple of world_size"),
    ("world_size", 0, "world_size must be a positive int"),
    ("context_length", 0, "context_length must be a positive int"),
    ("vocab_size", 1, "vocab_size must be at least 2"),
    ("warmup", -1, "warmup must be a non-negative int"),
    ("steps", 0, "steps must be a positive int"),
    ("attention", "flash3", "attention must be one of eager, annotated, compiled, sdpa, triton"),
    ("optimizer", "sgd", "optimizer must be one of adamw, torch-adamw, fused-adamw"),
    ("compute_dtype", "fp16", "compute_dtype must be one of fp32, bf16"),
    ("backend", "mpi", "backend must be one of"),
    ("checkpoint", "every:2", "unknown checkpoint policy"),
    ("lr", 0.0, "lr > 0"),
    ("time_limit_s", 0.0, "time_limit_s must be positive"),
])
def test_config_rejects_bad_values(field: str, value: object, message: str) -> None:
    base = {**leaderboard.CPU_DEFAULTS, "backend": "gloo"}
    with pytest.raises(ValueError, match=message):
        LeaderboardConfig(**{**base, field: value})


def test_config_rejects_bf16_on_cpu() -> None:
    with pytest.raises(ValueError, match="bf16.*needs GPUs"):
        LeaderboardConfig(**{**leaderboard.CPU_DEFAULTS, "backend": "gloo", "compute_dtype": "bf16"})


def test_flops_formula_is_what_a_step_of_the_model_multiplies() -> None:
    """PyTorch's FLOP counter over one forward and backward of the model (eager attention, which computes the scores
    a causal mask discards) counts the formula's model FLOPs plus that discarded half: three times (forward and
    backward) half of Q K^T and P V."""
    config = ModelConfig.from_preset("tiny", vocab_size=37, context_length=9)  # d 64, 2 layers, 4 heads of 16
    model = build_model(config)
    ids = torch.randint(0, 37, (3, 9))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    masked = 3 * (4 * 3 * 4 * 9**2 * 16) / 2 * config.num_layers
    assert counter.get_total_flops() == leaderboard.step_flops(config, global_batch=3) + masked


def test_mfu_is_over_the_named_gpus_measured_ceiling() -> None:
    assert device.mfu(3 * 772e12, 1.5, 2, "NVIDIA H200") == pytest.approx(1.0)
    assert device.mfu(1e15, 1.0, 1, "NVIDIA H100 80GB HBM3") is None  # no measured ceiling: no ratio against another's


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults")
def test_command_runs_on_cpu_and_writes_a_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.jsonl"
    assert cli.main(["leaderboard", "--warmup", "1", "--steps", "2", "--out", str(out)]) == 0
    assert "tokens_per_s" in capsys.readouterr().out
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    config = LeaderboardConfig(**{k: row[k] for k in (f.name for f in dataclasses.fields(LeaderboardConfig))})
    assert (config.size, config.context_length, config.world_size, config.backend) == ("tiny", 32, 2, "gloo")
    assert (config.attention, config.checkpoint, config.optimizer) == ("triton", "all", "fused-adamw")
    assert row["status"] == "ok" and len(row["step_s_all_rank0"]) == 2
    assert 0 < row["step_s"] <= row["step_max_s"]
    assert row["tokens_per_s"] == pytest.approx(2 * 32 / row["step_s"])
    assert abs(row["loss"] - math.log(1000)) < 1.0  # random tokens, freshly initialised model
    assert row["mfu"] is None and "peak_step_gib" not in row  # no allocator statistics on CPU
    for key in ("command", "device", "torch", "commit", "date"):
        assert row[key], key


@pytest.mark.slow
def test_command_stops_at_the_time_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.jsonl"
    args = ["leaderboard", "--backend", "gloo", "--size", "tiny", "--vocab-size", "50", "--context-length", "8",
            "--compute-dtype", "fp32", "--attention", "sdpa", "--time-limit-s", "1e-3", "--out", str(out)]
    assert cli.main(args) == 1
    assert "time limit of 0.001 s reached after 0 of 5 steps" in capsys.readouterr().err
    assert not out.exists()


def test_markdown_keeps_leaderboard_rows_fastest_first(tmp_path: Path) -> None:
    base = dict(size="8B", context_length=32768, global_batch=2, world_size=2, compute_dtype="bf16", status="ok",
                checkpoint="all", optimizer="fused-adamw", step_max_s=1.0, tokens_per_s=1.0, mfu=0.5, peak_init_gib=1.0,
                peak_step_gib=2.0, commit="abc")
    rows = [dict(base, attention="triton", step_s=7.5), dict(base, attention="sdpa", step_s=6.5),
            dict(base, attention="sdpa", step_s=1.0, size="tiny")]  # another configuration: left out
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = tmp_path / "section.md"
    section.write_text("text\n<!-- table:leaderboard -->\nold\n<!-- /table:leaderboard -->\nmore\n")
    assert cli.main(["leaderboard", "--markdown", str(path), "--fill", str(section)]) == 0
    lines = section.read_text().splitlines()
    table = lines[lines.index("<!-- table:leaderboard -->") + 1: lines.index("<!-- /table:leaderboard -->")]
    assert len(table) == 4 and "| sdpa |" in table[2] and "| triton |" in table[3] and lines[-1] == "more"


def test_command_reports_bad_flags() -> None:
    with pytest.raises(SystemExit, match="global_batch .3. must be a multiple of world_size"):
        cli.main(["leaderboard", "--backend", "gloo", "--compute-dtype", "fp32", "--global-batch", "3"])


needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.mark.gpu
@pytest.mark.gpu_exclusive
@needs_two_gpus
def test_gpu_sharded_step_matches_single_process_step(tmp_path: Path) -> None:
    # SDPA: fp32 on the GPU without TF32, so the same tolerances hold as on CPU.
    configs = [dataclasses.replace(CPU_CONFIGS[0], backend="nccl", context_length=131, vocab_size=1031)]
    _assert_same_step(configs, _sharded_steps(configs, tmp_path), torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.gpu_exclusive
@needs_two_gpus
def test_gpu_leaderboard_step_at_small_size() -> None:
    config = LeaderboardConfig(size="small", vocab_size=32_000, context_length=2048, global_batch=2, world_size=2,
                               warmup=1, steps=2, time_limit_s=240)
    (row,) = leaderboard.run_leaderboard(config)
    assert (row["backend"], row["compute_dtype"], row["attention"], row["optimizer"]) == (
        "nccl", "bf16", "triton", "fused-adamw")
    assert abs(row["loss"] - math.log(32_000)) < 1.0
    assert 0 < row["mfu"] < 1 and row["tokens_per_s"] > 0
    assert len(row["peak_step_gib_per_rank"]) == 2 and all(p > 0 for p in row["peak_step_gib_per_rank"])


def test_process_age_counts_from_the_start_of_this_process() -> None:
    import time

    age = leaderboard.process_age_s()
    time.sleep(0.05)
    later = leaderboard.process_age_s()
    assert 0 < age < later and later - age >= 0.04  # /proc's clock ticks are 10 ms


def test_handout_timing_is_a_flag_of_the_config() -> None:
    with pytest.raises(TypeError, match="handout_timing must be a bool"):
        LeaderboardConfig(**{**leaderboard.CPU_DEFAULTS, "backend": "gloo", "handout_timing": "yes"})
    from cs336_harness.commands.leaderboard import configs_from_args

    args = cli.parse_args(["leaderboard", "--backend", "gloo", "--compute-dtype", "fp32", "--handout-timing"])
    (config,) = configs_from_args(args)
    assert config.handout_timing and not configs_from_args(cli.parse_args(["leaderboard"]))[0].handout_timing


def test_build_training_needs_a_process_group_that_matches() -> None:
    cpu = torch.device("cpu")
    two_ranks = LeaderboardConfig(**{**leaderboard.CPU_DEFAULTS, "backend": "gloo"})
    with pytest.raises(ValueError, match="world_size 2 needs an initialised process group"):
        build_training(two_ranks.train_config(), cpu)
    one_rank = dataclasses.replace(two_ranks, world_size=1, global_batch=1)
    with pytest.raises(ValueError, match="wrapper 'fsdp2' on world_size 1 needs an initialised process group"):
        build_training(leaderboard.recipe(one_rank, "torch_native").train_config(), cpu)  # FSDP2 needs a mesh
    with pytest.raises(TypeError, match="config must be a TrainConfig"):
        build_training(one_rank, cpu)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device must be a torch.device"):
        build_training(one_rank.train_config(), "cpu")  # type: ignore[arg-type]
