"""cs336 bench: flags become validated configs, and a tiny CPU run gives well-formed rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from cs336_harness import cli
from cs336_harness.commands.bench import configs_from_args
from cs336_harness.results import read_rows
from cs336_harness.studies import step_timing
from cs336_harness.training import build_training

PROVENANCE_KEYS = ("command", "device", "torch", "triton", "python", "commit", "date")
TINY = ["--size", "tiny", "--batch-size", "2", "--context-length", "17", "--warmup", "1", "--steps", "2"]


def _configs(*argv: str) -> list[step_timing.BenchConfig]:
    return configs_from_args(cli.parse_args(["bench", *argv]))


def test_flags_parse_into_configs() -> None:
    configs = _configs("--size", "tiny,small", "--context-length", "33,64", "--compute-dtype", "bf16",
                       "--num-layers", "3",
                       "--mode", "forward-backward", "--warmup", "0", "--steps", "7", "--attention", "sdpa",
                       "--checkpoint", "group:2", "--vocab-size", "101", "--device", "cpu")
    assert [(c.size, c.context_length) for c in configs] == [("tiny", 33), ("tiny", 64), ("small", 33), ("small", 64)]
    c = configs[0]
    assert (c.dtype, c.mode, c.warmup, c.steps, c.attention, c.checkpoint, c.vocab_size) == (
        "bf16", "forward-backward", 0, 7, "sdpa", "group:2", 101)
    assert c.dims == {"d_model": 64, "d_ff": 256, "num_layers": 3, "num_heads": 4}
    assert configs[2].dims["d_model"] == 768 and configs[2].dims["num_layers"] == 3


def test_groups_expand_to_single_level_sizes_up_to_depth() -> None:
    configs = _configs("--size", "tiny", "--num-layers", "5", "--checkpoint", "none,groups")
    assert [c.checkpoint for c in configs] == ["none", "group:1", "group:2", "group:3", "group:4"]


def test_defaults_without_cuda_are_tiny_on_cpu() -> None:
    config = step_timing.BenchConfig()
    if not torch.cuda.is_available():
        assert (config.size, config.device) == ("tiny", "cpu")
    assert (config.vocab_size, config.batch_size, config.context_length) == (10_000, 4, 512)


@pytest.mark.parametrize(("argv", "flags"), [
    (["--attention", "triton"], "--attention triton runs"),
    (["--attention", "eager,triton", "--loss", "fused"], "--attention triton and --loss fused run"),
    (["--optimizer", "fused-adamw"], "--optimizer fused-adamw runs"),
])
def test_triton_kernels_on_cpu_default_to_a_short_run_and_say_so(argv: list[str], flags: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    configs = _configs(*argv, "--device", "cpu")
    assert {(c.context_length, c.warmup, c.steps) for c in configs} == {(64, 1, 3)}
    assert capsys.readouterr().err == (
        f"cs336 bench: {flags} in Triton's interpreter on a CPU, seconds a step, so this run defaults to context 64, "
        "1 untimed step, 3 timed steps (set --context-length, --warmup, --steps to choose)\n")


def test_flags_given_win_over_the_interpreters_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    (config,) = _configs("--attention", "triton", "--device", "cpu", "--steps", "2", "--context-length", "40")
    assert (config.context_length, config.warmup, config.steps) == (40, 1, 2)
    assert capsys.readouterr().err.endswith("defaults to 1 untimed step (set --warmup to choose)\n")
    (config,) = _configs("--attention", "triton", "--device", "cpu", "--steps", "2", "--context-length", "40",
                         "--warmup", "0")
    assert (config.context_length, config.warmup, config.steps) == (40, 0, 2) and capsys.readouterr().err == ""
    configs = _configs("--attention", "triton", "--device", "cpu", "--sweep", "--size", "tiny")
    assert [c.context_length for c in configs] == list(step_timing.SWEEP_CONTEXT_LENGTHS)


def test_without_a_triton_kernel_the_defaults_stay(capsys: pytest.CaptureFixture[str]) -> None:
    (config,) = _configs("--attention", "sdpa", "--device", "cpu")
    assert (config.context_length, config.warmup, config.steps) == (512, 5, 10) and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": "huge"}, "size must be one of"),
        ({"context_length": 0}, "context_length must be positive"),
        ({"warmup": -1}, "warmup must be >= 0"),
        ({"mode": "inference"}, "mode must be one of"),
        ({"dtype": "fp8"}, "dtype must be one of"),
        ({"attention": "magic"}, "attention must be one of"),
        ({"optimizer": "sgd"}, "optimizer must be one of"),
        ({"checkpoint": "group"}, "needs a count"),
        ({"checkpoint": "group:0"}, "count >= 1"),
        ({"checkpoint": "every"}, "unknown checkpoint policy"),
        ({"num_heads": 3}, "divisible by num_heads"),
        ({"checkpoint": "all", "mode": "forward"}, "backward pass"),
        ({"device": "tpu"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
        ({"dtype": "bf16", "attention": "triton"}, "--attention triton with dtype bf16 needs a GPU"),
        ({"dtype": "bf16", "loss": "fused"}, "--loss fused with dtype bf16 needs a GPU"),
    ],
)
def test_bad_values_are_rejected_with_a_message(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        step_timing.BenchConfig(size=kwargs.pop("size", "tiny"), device=kwargs.pop("device", "cpu"), **kwargs)


def test_table_shows_every_setting_that_tells_rows_apart() -> None:
    base = {**step_timing.config_fields(step_timing.BenchConfig(size="tiny", device="cpu")), "status": "ok",
            "step_ms_median": 1.0}
    assert step_timing.table_columns([base]) == ["size", "context_length", "mode", "dtype", "status", "step_ms_median"]
    rows = [base, {**base, "attention": "sdpa"}, {**base, "compile": True, "optimizer": "fused-adamw"}]
    columns = step_timing.table_columns(rows)
    assert {"attention", "compile", "optimizer"} <= set(columns) and "loss" not in columns
    assert len({tuple(r[c] for c in columns) for r in rows}) == len(rows)
    # A setting the rows share but that is not the default is shown too, and so is an overridden dimension.
    assert {"loss", "num_layers"} <= set(step_timing.table_columns([{**base, "loss": "fused", "num_layers": 1}]))


def test_cli_reports_bad_flags_and_gpu_only_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="mode must be one of"):
        cli.main(["bench", *TINY, "--mode", "nope", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--memory needs a CUDA device"):
        cli.main(["bench", *TINY, "--memory", "x", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--profile needs a CUDA device"):
        cli.main(["bench", *TINY, "--profile", "x", "--device", "cpu"])


@pytest.mark.parametrize("mode", ["forward", "forward-backward", "train"])
def test_tiny_run_appends_well_formed_rows(tmp_path, mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.jsonl"
    assert cli.main(["bench", *TINY, "--mode", mode, "--device", "cpu", "--out", str(out)]) == 0
    (row,) = read_rows(out)
    assert all(row[k] for k in PROVENANCE_KEYS if k != "triton") and "triton" in row
    assert row["status"] == "ok" and row["mode"] == mode and row["context_length"] == 17
    phases = {"forward": ["forward"], "forward-backward": ["forward", "backward"],
              "train": ["forward", "backward", "optimizer"]}[mode]
    for phase in ("forward", "backward", "optimizer"):
        present = f"{phase}_ms_mean" in row
        assert present == (phase in phases)
        if present:
            assert len(row[f"{phase}_ms_all"]) == 2 and row[f"{phase}_ms_mean"] > 0 and row[f"{phase}_ms_std"] >= 0
    assert "forward_ms_mean" in capsys.readouterr().out


@pytest.mark.slow
def test_sweep_mixes_attention_dtype_and_checkpointing(tmp_path) -> None:
    base = step_timing.BenchConfig(size="tiny", batch_size=2, context_length=9, warmup=0, steps=1, device="cpu",
                             num_layers=3)
    configs = step_timing.expand_configs(base, dtypes=("fp32", "bf16"), attentions=("sdpa",),
                                   checkpoints=("selective", "nested:2"))
    rows = step_timing.run_configs(configs, progress=False)
    assert [r["status"] for r in rows] == ["ok"] * 4
    assert {(r["dtype"], r["checkpoint"]) for r in rows} == {
        (d, c) for d in ("fp32", "bf16") for c in ("selective", "nested:2")}


@pytest.mark.slow
def test_fused_loss_triton_attention_and_fused_adamw_match_the_plain_path() -> None:
    config = step_timing.BenchConfig(size="tiny", context_length=17, batch_size=2, device="cpu")
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=gen)
    targets = torch.randint(0, config.vocab_size, (2, 17), generator=gen)

    def loss_grads_and_step(cfg: step_timing.BenchConfig) -> tuple[torch.Tensor, list, list]:
        training = build_training(cfg.train_config(), torch.device("cpu"))
        loss = training.forward(tokens, targets)
        loss.backward()
        grads = [p.grad.clone() for p in training.model.parameters()]
        training.optimizer.step()
        return loss.detach(), grads, [p.detach() for p in training.model.parameters()]

    ref = loss_grads_and_step(config)
    fused = loss_grads_and_step(replace(config, loss="fused", attention="triton", optimizer="fused-adamw"))
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(fused[1] + fused[2], ref[1] + ref[2], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_profile_and_memory_outputs_on_gpu(tmp_path) -> None:
    config = step_timing.BenchConfig(size="tiny", context_length=33, warmup=1, steps=2, device="cuda",
                               attention="annotated", profile_dir=str(tmp_path / "p"), memory_dir=str(tmp_path / "m"))
    row = step_timing.run_bench(config)
    assert row["status"] == "ok" and row["peak_forward_gib"] > 0 and row["peak_step_gib"] >= row["peak_forward_gib"]
    kernels = read_rows(tmp_path / "p" / "kernels.jsonl")
    ranges = {k["range"] for k in kernels}
    assert {"all", "forward", "backward", "optimizer", "attention/softmax"} <= ranges
    assert all(k["calls_per_step"] > 0 for k in kernels)
    for key in ("trace", "timeline"):
        assert (tmp_path / "p" / row["profile"][key].split("/")[-1]).stat().st_size > 0
    assert (tmp_path / "m" / f"memory_{config.tag}.pickle").stat().st_size > 0
    assert row["memory"]["largest"] and (tmp_path / "m" / f"memory_{config.tag}.png").exists()
