"""What every ``cs336`` command shares: a light top-level help, the CPU rules, progress and ``--quiet``, comma-list
help, and the same clear message for the same mistake in every command."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from cs336_comms.process_group import RankDiedError, RankStalledError
from cs336_harness import cli, instrument, resources
from cs336_harness.analysis import trace
from cs336_harness.commands import COMMANDS
from cs336_harness.commands._shared import print_measured_table
from cs336_harness.device import check_device
from cs336_harness.memory_plan import memory_plan
from cs336_harness.studies import collectives as collectives_study
from cs336_harness.studies import ddp as ddp_study
from cs336_harness.studies import leaderboard as leaderboard_study
from cs336_harness.studies import shard as shard_study

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rules apply without CUDA")
UNWRITABLE = "/proc/nope/rows.jsonl"  # /proc takes no new folders, even for root
TINY_BENCH = ["bench", "--size", "tiny", "--context-length", "9", "--batch-size", "2", "--warmup", "0", "--steps",
              "1", "--device", "cpu"]


def _cs336(*argv: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cs336_harness.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _env_without_cpu_settings() -> dict[str, str]:
    """This process's environment less what the CLI sets on CPU (conftest.py sets TRITON_INTERPRET here)."""
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KINETO_LOG_LEVEL")}


def test_top_level_help_imports_no_torch() -> None:
    code = ("import sys\nfrom cs336_harness import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False"
    assert all(name in done.stdout for name in COMMANDS)


def _actions(name: str) -> list[argparse.Action]:
    parser = cli._parser(name)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]._actions


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_comma_list_flag_says_so(name: str) -> None:
    listed = [a for a in _actions(name) if getattr(a.type, "__qualname__", "").startswith("csv_of")]
    assert all("comma list" in a.help for a in listed), [a.dest for a in listed if "comma list" not in a.help]


@pytest.mark.parametrize("name", [n for n in COMMANDS if n != "sizes"])
def test_commands_that_run_for_long_take_quiet(name: str) -> None:
    assert any(a.dest == "quiet" for a in _actions(name)) == (name != "precision")


@NO_CUDA
def test_the_cli_chooses_the_triton_interpreter_before_a_command_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    cli.parse_args(["sizes"])
    assert os.environ["TRITON_INTERPRET"] == "1" and os.environ["KINETO_LOG_LEVEL"] == "5"


def test_progress_goes_to_stderr_unless_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(TINY_BENCH) == 0
    out, err = capsys.readouterr()
    assert "bench:" in err and "1/1" in err and "tiny_ctx9_train_fp32" in err and "bench:" not in out
    assert cli.main([*TINY_BENCH, "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "forward_ms_mean" in out


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The studies' run functions fail the test if a command calls them."""
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started")

    for study, fn in ((ddp_study, "run_ddp_bench"), (shard_study, "run_shard_bench")):
        monkeypatch.setattr(study, fn, never)
    monkeypatch.setattr("cs336_harness.commands.collectives.run_collectives_study", never)
    monkeypatch.setattr("cs336_harness.studies.step_timing.run_configs", never)
    monkeypatch.setattr("cs336_harness.commands.residuals.run_experiments", never)
    monkeypatch.setattr(leaderboard_study, "run_leaderboard", never)


@pytest.mark.parametrize("argv", [
    ["bench", "--device", "cpu"], ["residuals", "--device", "cpu"], ["precision"], ["ddp", "--backend", "gloo"],
    ["shard", "--backend", "gloo"], ["collectives", "--backends", "gloo"],
])
def test_an_unwritable_out_fails_before_the_run(argv: list[str], no_run: None) -> None:
    with pytest.raises(SystemExit, match=f"cs336 {argv[0]}: cannot write to '{UNWRITABLE}': No such file"):
        cli.main([*argv, "--out", UNWRITABLE])


@pytest.mark.parametrize("argv", [["bench", "--device", "cpu"], ["leaderboard"], ["ddp", "--backend", "gloo"]])
def test_an_out_below_a_file_names_the_file(argv: list[str], no_run: None, tmp_path: Path) -> None:
    (tmp_path / "rows").write_text("")
    with pytest.raises(SystemExit, match=f"^cs336 {argv[0]}: cannot write to '{tmp_path}/rows/x.jsonl': "
                                         f"'{tmp_path}/rows' is a file, not a folder$"):
        cli.main([*argv, "--out", str(tmp_path / "rows" / "x.jsonl")])


@pytest.mark.parametrize(("argv", "flag"), [
    (["ddp", "--backend", "gloo"], "--figure-dir"), (["shard", "--backend", "gloo"], "--figure"),
    (["collectives", "--backends", "gloo"], "--plot"),
])
def test_an_unwritable_figure_fails_before_the_run(argv: list[str], flag: str) -> None:
    target = "/proc/nope" if flag == "--figure-dir" else "/proc/nope/figure.png"
    with pytest.raises(SystemExit, match=f"cs336 {argv[0]}: cannot write to '/proc/nope/"):
        cli.main([*argv, flag, target])


@NO_CUDA
@pytest.mark.parametrize("argv", [["ddp", "--backend", "nccl"], ["shard", "--backend", "nccl"],
                                  ["collectives", "--backends", "nccl"]])
def test_nccl_on_cpu_is_one_clear_message(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match=f"cs336 {argv[0]}: backend 'nccl' needs CUDA GPUs and none is visible here"):
        cli.main(argv)


@pytest.mark.parametrize("name", ["bench", "residuals", "precision"])
def test_an_unknown_device_is_one_clear_message(name: str) -> None:
    with pytest.raises(SystemExit, match=f"cs336 {name}: device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        cli.main([name, "--device", "tpu"])


@pytest.mark.parametrize(("name", "asked"), [
    ("ddp", "the run asked for size tiny (1M parameters, 0.02 GiB of fp32 weights"),
    ("shard", "the run asked for size tiny (1M parameters"),
    ("collectives", "the run asked for float32 tensors of up to 100 MiB on up to 6 ranks"),
])
@pytest.mark.parametrize(("error", "said"), [
    (RankDiedError(1, "SIGKILL", -9), "rank 1 died (signal SIGKILL), most likely out of host memory"),
    (RankStalledError(1, 60), "rank 1 stopped answering (no heartbeat for 60 s: stopped, hung or swapped out); every "
                              "rank was ended"),
], ids=["killed", "stalled"])
def test_a_rank_killed_or_stalled_is_one_line_with_the_asked_size(name: str, asked: str, error: RankDiedError,
                                                                  said: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(ddp_study, "run_ddp_bench", fails)
    monkeypatch.setattr(shard_study, "run_shard_bench", fails)
    monkeypatch.setattr("cs336_harness.commands.collectives.run_collectives_study", fails)
    argv = [name, "--backends", "gloo"] if name == "collectives" else [name, "--size", "tiny", "--backend", "gloo"]
    with pytest.raises(SystemExit, match=re.escape(f"cs336 {name}: {said}; {asked}")):
        cli.main(argv)


def test_printed_tables_leave_out_empty_columns_and_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"variant": "ddp", "backend": "gloo", "peak_step_gib": None, "params_gib": 0.5}]
    print_measured_table(rows, ["variant", "peak_step_gib", "params_gib"], ".2f", cuda_only="memory: CUDA only")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["variant", "params_gib"]
    assert lines[-2:] == ["left out, no value in any row: peak_step_gib", "on CPU (gloo) memory: CUDA only"]
    assert "commit" not in ddp_study.PRINTED_COLUMNS  # rows get their commit when written


def test_collectives_bar_counts_backend_and_world_size_runs(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    calls = []
    monkeypatch.setattr(collectives_study, "run_collectives",
                        lambda ws, backend, *args: calls.append((backend, ws)) or [])
    config = collectives_study.CollectivesConfig(("gloo",), (2, 3), (1.0,), warmup=0, iters=1)
    assert collectives_study.run_collectives_study(config, progress=True) == []
    assert calls == [("gloo", 2), ("gloo", 3)] and "collectives:" in capsys.readouterr().err


def test_leaderboard_markdown_says_why_its_table_is_empty(tmp_path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"size": "tiny", "context_length": 32, "global_batch": 2, "world_size": 2,
                                "compute_dtype": "fp32", "status": "ok", "step_s": 1.0}) + "\n")
    with pytest.raises(SystemExit, match="cs336 leaderboard: no ok rows of the leaderboard configuration"):
        cli.main(["leaderboard", "--markdown", str(rows)])


@NO_CUDA
def test_leaderboard_proxy_on_cpu_says_it_is_a_gpu_measurement() -> None:
    said = ("cs336 leaderboard: --proxy is a GPU measurement: one rank of the leaderboard run on one GPU (14 layers of "
            "the 8B model, context 32768, bf16), whose fp32 weights, gradients and AdamW state alone take 61 GiB; it "
            "needs a CUDA GPU")
    for argv in (["--proxy"], ["--proxy", "--compute-dtype", "fp32"]):
        with pytest.raises(SystemExit, match=re.escape(said)):
            cli.main(["leaderboard", *argv])


def test_leaderboard_memory_plan_runs_nothing_and_counts_ours(no_run: None, capsys: pytest.CaptureFixture) -> None:
    argv = ["leaderboard", "--proxy", "--num-layers", "3", "--glue", "triton", "--checkpoint", "budget",
            "--memory-cap-gib", "36", "--impl", "ours,torch_native", "--memory-plan"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    ours = next(line.split() for line in lines if line.split()[:1] == ["ours"])
    plain = next(line.split() for line in lines if line.split()[:1] == ["torch_native"])
    assert ours[2] == "selective:2" and ours[4] == ours[5]  # the plan's peak is the fake-tensor count
    assert float(ours[4]) <= 36 and plain[2] == "all" and plain[5] == "-"  # the baseline is not traced


def test_leaderboard_offload_is_planned_and_its_host_copies_must_fit(no_run: None, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture) -> None:
    argv = ["leaderboard", "--proxy", "--num-layers", "3", "--glue", "triton", "--checkpoint", "offload:1",
            "--memory-plan"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    ours = next(line.split() for line in out.splitlines() if line.split()[:1] == ["ours"])
    assert ours[2] == "offload:1" and float(ours[3]) > 0  # planned; not traced (its copies are host memory)
    assert "no value in any row: cap_gib, fake_tensor_peak_gib" in out
    from cs336_harness.commands.leaderboard import _check_offload_fits

    config = leaderboard_study.LeaderboardConfig(**leaderboard_study.PROXY_DEFAULTS, backend="nccl", glue="triton",
                                                 checkpoint="offload:4")
    block = memory_plan(config.train_config(), None).step.block
    monkeypatch.setattr(resources, "available_host_bytes", lambda: 16 * 2**30)
    with pytest.raises(ValueError, match=re.escape(
            f"--checkpoint offload:4 (4 blocks' saved activations in host memory on each of 1 ranks) needs at least "
            f"{(4 * block.kept + resources.RANK_BASE_BYTES) / 2**30:.3g} GiB")):
        _check_offload_fits(config)
    monkeypatch.setattr(resources, "available_host_bytes", lambda: 64 * 2**30)
    _check_offload_fits(config)


@NO_CUDA
def test_leaderboard_memory_plan_of_a_budget_needs_a_cap_without_a_gpu(no_run: None) -> None:
    with pytest.raises(SystemExit, match="--memory-plan of --checkpoint budget needs --memory-cap-gib"):
        cli.main(["leaderboard", "--proxy", "--glue", "triton", "--checkpoint", "budget", "--memory-plan"])


@NO_CUDA
@pytest.mark.parametrize("flag", ["--profile", "--handout-timing"])
def test_leaderboard_gpu_only_flags_are_refused_on_cpu(flag: str, no_run: None) -> None:
    with pytest.raises(SystemExit, match=f"cs336 leaderboard: {flag} times GPU kernels and needs CUDA"):
        cli.main(["leaderboard", flag])


def test_leaderboard_table_leaves_out_columns_no_row_fills(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    row = {"impl": "ours", "num_layers": 2, "world_size": 2, "compute_dtype": "fp32", "step_s": 0.5, "mfu": None,
           "peak_step_gib": None, "backend": "gloo"}
    monkeypatch.setattr(leaderboard_study, "run_leaderboard", lambda config, progress: [row])
    assert cli.main(["leaderboard", "--backend", "gloo", "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "mfu" not in lines[0] and "peak_step_gib" not in lines[0] and "step_s" in lines[0]
    assert lines[-2].startswith("left out, no value in any row: ") and "mfu" in lines[-2]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_examples_keep_their_lines(name: str) -> None:
    sub = next(a for a in cli._parser(name)._actions if isinstance(a, argparse._SubParsersAction))
    epilog = sub.choices[name].epilog or ""
    assert all(len(line) <= 120 for line in epilog.splitlines()), epilog  # a joined continuation runs longer


def test_precision_tables_say_where_they_ran(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["precision"]) == 0
    tables = capsys.readouterr().out.split("\n\n")
    assert len(tables) == 3 and all(t.split()[0] == "on_device" for t in tables)


@NO_CUDA
@pytest.mark.slow
def test_triton_kernels_in_bench_run_on_cpu_without_setup() -> None:
    done = _cs336(*TINY_BENCH, "--loss", "fused", "--optimizer", "fused-adamw", "--attention", "triton",
                  "--quiet", env=_env_without_cpu_settings())
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "triton" in done.stdout and "fused-adamw" in done.stdout and "fused" in done.stdout


@pytest.mark.slow
@pytest.mark.gpu_exclusive
@pytest.mark.parametrize("argv", [["bench", "--attention", "triton"], ["bench", "--loss", "fused", "--optimizer",
                                                                       "fused-adamw"], ["leaderboard"]])
def test_commands_with_triton_kernels_finish_at_their_defaults(argv: list[str]) -> None:
    """On a CPU each takes about a minute on two cores, the kernels in the interpreter (at the context and steps of a
    GPU run they took from forty minutes up); the timeout is a bound on that, not a measurement."""
    done = _cs336(*argv, "--quiet", timeout=300)
    assert done.returncode == 0, done.stderr


@NO_CUDA
@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["residuals", "--experiment", "rmsnorm"],  # torch.compile on CPU
    ["ddp", "--variants", "nocomm,naive", "--context-length", "16", "--warmup", "1", "--steps", "1"],  # profiler
])
def test_successful_cpu_runs_print_nothing_on_stderr_with_quiet(argv: list[str]) -> None:
    done = _cs336(*argv, "--quiet", env=_env_without_cpu_settings())
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


@pytest.mark.gpu
def test_gpu_profile_records_kernels_without_a_warning(tmp_path) -> None:
    x = torch.randn(256, 256, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with instrument.profile("cuda") as prof:
            (x @ x).sum().item()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    assert any(e.get("cat") == "kernel" for e in trace.load_trace(tmp_path / "trace.json"))


@pytest.mark.gpu
def test_gpu_devices_and_ranks_beyond_the_visible_gpus_are_one_clear_message() -> None:
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"device 'cuda:{n}' asked for, but only {n} GPUs are visible"):
        check_device(f"cuda:{n}")
    with pytest.raises(SystemExit, match=f"needs one GPU per rank: {n + 1} ranks asked for, {n} GPUs visible"):
        cli.main(["ddp", "--world-size", str(n + 1), "--global-batch", str(n + 1)])


@pytest.mark.parametrize("name", ["attention", "collectives", "ddp", "fused", "leaderboard", "shard"])
def test_markdown_from_a_missing_or_broken_rows_file_is_one_clear_message(name: str, tmp_path) -> None:
    with pytest.raises(SystemExit, match=f"cs336 {name}: cannot read rows from '/nonexistent.jsonl': No such file"):
        cli.main([name, "--markdown", "/nonexistent.jsonl"])
    broken = tmp_path / "rows.jsonl"
    broken.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(SystemExit, match=f"cs336 {name}: '{broken}' line 2 is not JSON"):
        cli.main([name, "--markdown", str(broken)])


# One row that each command's --markdown reads.
MARKDOWN_ROWS = {
    "attention": {"bench": "flash", "impl": "triton", "dtype": "bf16", "d": 64, "seq": 128, "device": "H200",
                  "fwd_ms": 1.5},
    "collectives": {"op": "all_reduce", "backend": "gloo", "world_size": 2, "bytes": 2**20, "time_ms": 1.5,
                    "busbw_gbps": 0.7},
    "ddp": {"variant": "naive", "dtype": "fp32", "step_ms": 1.5},
    "fused": {"bench": "glue", "impl": "eager", "op": "rms_norm", "part": "fwd+bwd", "shape": "(8, 16)",
              "dtype": "bf16", "device": "H200", "bytes_moved": 1e9, "ms": 1.5},
    "shard": {"variant": "fsdp", "dtype": "fp32", "step_ms": 1.5},
    "leaderboard": {"size": "8B", "context_length": 32768, "global_batch": 2, "world_size": 2,
                    "compute_dtype": "bf16", "status": "ok", "step_s": 1.5, "attention": "triton",
                    "checkpoint": "all", "optimizer": "fused-adamw"},
}
FILL_COMMANDS = ["attention", "leaderboard", "shard"]


def _rows_file(tmp_path, *rows: object) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("name", FILL_COMMANDS)
def test_fill_of_a_missing_section_is_one_clear_message(name: str, tmp_path) -> None:
    rows = _rows_file(tmp_path, MARKDOWN_ROWS[name])
    with pytest.raises(SystemExit, match=f"cs336 {name}: cannot read the section '/nonexistent.md'"):
        cli.main([name, "--markdown", rows, "--fill", "/nonexistent.md"])


@pytest.mark.parametrize("name", FILL_COMMANDS)
def test_fill_without_markdown_is_refused_before_anything_runs(name: str, tmp_path, no_run: None) -> None:
    section = tmp_path / "section.md"
    with pytest.raises(SystemExit, match=f"cs336 {name}: --fill SECTION needs --markdown ROWS"):
        cli.main([name, "--fill", str(section)])


@pytest.mark.parametrize("name", list(MARKDOWN_ROWS))
def test_markdown_of_its_own_rows_prints_a_table(name: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([name, "--markdown", _rows_file(tmp_path, MARKDOWN_ROWS[name])]) == 0
    out, err = capsys.readouterr()
    assert "| 1.5" in out or "1.5 ms" in out, out
    assert err == ""


@pytest.mark.parametrize("name", list(MARKDOWN_ROWS))
def test_markdown_of_another_commands_rows_names_the_line_and_fails(name: str, tmp_path) -> None:
    other = MARKDOWN_ROWS["shard" if name == "ddp" else "ddp"]
    rows = _rows_file(tmp_path, other)
    with pytest.raises(SystemExit, match=f"cs336 {name}: no {name} rows in '{rows}': line 1 has "):
        cli.main([name, "--markdown", rows])


@pytest.mark.parametrize("name", list(MARKDOWN_ROWS))
@pytest.mark.parametrize(("line", "what"), [("[1, 2]", "list"), ("3", "int"), ('"row"', "str")])
def test_markdown_of_a_line_that_is_not_an_object_names_it(name: str, line: str, what: str, tmp_path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(MARKDOWN_ROWS[name]) + "\n" + line + "\n")
    with pytest.raises(SystemExit, match=re.escape(f"cs336 {name}: '{path}' line 2 is not a row: expected a JSON "
                                                   f"object, got {what}")):
        cli.main([name, "--markdown", str(path)])


@pytest.mark.parametrize("name", list(MARKDOWN_ROWS))
def test_markdown_of_an_empty_file_fails(name: str, tmp_path) -> None:
    rows = _rows_file(tmp_path)
    with pytest.raises(SystemExit, match=f"cs336 {name}: no {name} rows in '{rows}': no rows at all"):
        cli.main([name, "--markdown", rows])


def test_markdown_leaves_out_other_rows_and_says_which(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    build = {"bench": "build", "impl": "triton"}  # a kind of row the attention files hold and no table reads
    mixed = _rows_file(tmp_path, build, MARKDOWN_ROWS["attention"], build)
    assert cli.main(["attention", "--markdown", mixed]) == 0
    out, err = capsys.readouterr()
    assert "| 64 | 128 | 1.5 |" in out
    assert err.splitlines() == [f"cs336 attention: left out 2 rows of '{mixed}' that are not attention rows (line 1 "
                                "has bench 'build', not one of pytorch, compiled, anchors, flash, gluon_attention, "
                                "varlen, window; and 1 more)"]


def test_markdown_rows_that_lack_a_field_their_table_reads_are_not_rows(tmp_path) -> None:
    rows = _rows_file(tmp_path, {"op": "all_reduce", "backend": "gloo", "world_size": 2})
    with pytest.raises(SystemExit, match="line 1 has op 'all_reduce' but no 'bytes', 'time_ms', 'busbw_gbps'"):
        cli.main(["collectives", "--markdown", rows])


def test_collectives_markdown_without_all_reduce_rows_fails(tmp_path) -> None:
    rows = _rows_file(tmp_path, {**MARKDOWN_ROWS["collectives"], "op": "all_gather"})
    with pytest.raises(SystemExit, match="cs336 collectives: the rows given have no all_reduce rows"):
        cli.main(["collectives", "--markdown", rows])


def test_markdown_reads_several_files(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps(MARKDOWN_ROWS["ddp"]) + "\n")
    second.write_text(json.dumps({**MARKDOWN_ROWS["ddp"], "variant": "flat"}) + "\n")
    assert cli.main(["ddp", "--markdown", str(first), str(second)]) == 0
    table = capsys.readouterr().out
    assert "| naive |" in table and "| flat |" in table


def test_a_comma_list_of_the_wrong_type_says_what_it_expected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["collectives", "--world-sizes", "2,four"])
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == ("cs336 collectives: error: argument --world-sizes: expected a comma-separated list of int values, "
                   "got '2,four'")


@pytest.mark.parametrize("argv", [["residuals"], ["ddp"], ["shard"]])
def test_a_context_length_of_zero_is_refused_not_replaced_by_the_default(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match=f"cs336 {argv[0]}: .*context.length must be positive.*0"):
        cli.main([*argv, "--context-length", "0"])


def test_ddp_table_explains_nocomm_replicas_and_an_overhead_below_zero(monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"variant": v, "dtype": "fp32", "bucket_size_mb": None, "step_ms": ms, "overhead_ms": ms - 10.0,
             "backend": "gloo", "params_in_sync": v != "nocomm"} for v, ms in (("nocomm", 10.0), ("naive", 9.5))]
    monkeypatch.setattr(ddp_study, "run_ddp_bench", lambda *args, **kwargs: rows)
    assert cli.main(["ddp", "--backend", "gloo", "--variants", "nocomm,naive"]) == 0
    notes = capsys.readouterr().out.splitlines()[-2:]
    assert notes[0].startswith("params_in_sync is False for nocomm by design: its ranks exchange no gradients")
    assert notes[1].startswith("overhead_ms below zero (naive): each step_ms is a median over a run of its own")
    rows[1].update(step_ms=10.5, overhead_ms=0.5)
    assert cli.main(["ddp", "--backend", "gloo", "--variants", "nocomm,naive"]) == 0
    assert "overhead_ms below zero" not in capsys.readouterr().out


def test_ddp_shows_a_bucket_size_only_for_the_variants_with_buckets(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"variant": v, "dtype": "fp32", "bucket_size_mb": 25.0, "step_ms": 1.0, "backend": "gloo"}
            for v in ("naive", "bucketed")]
    assert [ddp_study.bucket_where_used(r)["bucket_size_mb"] for r in rows] == [None, 25.0]  # what a run writes
    saved = tmp_path / "rows.jsonl"
    saved.write_text("".join(json.dumps(r) + "\n" for r in rows))  # rows that kept it, as older runs did
    assert cli.main(["ddp", "--markdown", str(saved)]) == 0
    table = [[cell.strip() for cell in line.split("|")[1:4]] for line in capsys.readouterr().out.splitlines()]
    assert table[2] == ["fp32", "naive", "-"] and table[3] == ["fp32", "bucketed", "25"]


@pytest.mark.parametrize("argv", [["ddp", "--world-size", "3", "--global-batch", "3"], ["shard", "--world-size", "3",
                                  "--global-batch", "3"], ["collectives", "--world-sizes", "2,3"],
                                  ["leaderboard", "--world-size", "3", "--global-batch", "3"]])
@pytest.mark.parametrize("rank", ["0", "1"])
def test_torchrun_with_another_world_size_is_one_line_from_rank_0(argv: list[str], rank: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", rank), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    waits = []
    monkeypatch.setattr(cli.time, "sleep", waits.append)
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--backend" if argv[0] != "collectives" else "--backends", "gloo"])
    said = (f"cs336 {argv[0]}: asked for world size 3, but torchrun started 2 ranks; give --nproc-per-node and the "
            "world size the same number")
    if rank == "0":
        assert e.value.code == said and waits == []
    else:  # torchrun ends this rank during the wait, once rank 0 has said it; else it says it
        assert e.value.code == f"{said} (rank 1)" and waits == [cli._OTHER_RANKS_WAIT_S]


@pytest.mark.parametrize(("argv", "what"), [
    (["bench", "--size", "8B", "--device", "cpu"], "8B_ctx512_train_fp32 (batch 4) needs at least"),
    (["ddp", "--size", "xl", "--backend", "gloo"], "ddp of size xl, context 128, global batch 4 on 2 ranks needs "
                                                   "at least"),
    (["shard", "--size", "xl", "--backend", "gloo"], "shard of size xl, context 128, global batch 4 on 2 ranks "
                                                     "needs at least"),
    (["residuals", "--context-length", "100000", "--device", "cpu"], "residuals of the tiny block at batch 4, "
                                                                      "context 100000 needs at least"),
    (["leaderboard", "--size", "8B", "--backend", "gloo"], "the leaderboard step (ours) of size 8B (34 layers), "
                                                           "context 32, global batch 2 on 2 ranks needs at least"),
    (["collectives", "--world-sizes", "1000"], "collectives on 1000 ranks with float32 tensors of up to 100 MiB "
                                               "needs at least 648 GiB of host memory (1000 ranks of 0.648 GiB: the "
                                               "process 0.55, tensors 0.0978), and 16 GiB is available: at most 24 "
                                               "of these ranks fit"),
])
def test_a_cpu_run_too_big_for_host_memory_is_refused_before_it_starts(
        argv: list[str], what: str, no_run: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(resources, "available_host_bytes", lambda: 16 * 2**30)
    if argv[0] == "bench":  # a row with status oom, as on CUDA, the reason on stderr, and a failure: nothing ran
        with pytest.raises(SystemExit, match=r"^cs336 bench: no configuration ran \(1 of 1 out of memory\)$"):
            cli.main([*argv, "--quiet"])
        out, err = capsys.readouterr()
        assert out.splitlines()[-1].split() == ["8B", "512", "train", "fp32", "oom"]
        assert err.startswith(f"cs336 bench: not run (its row says oom): {what}") and "16 GiB is available" in err
    else:
        with pytest.raises(SystemExit, match=re.escape(f"cs336 {argv[0]}: {what}")):
            cli.main(argv)


@pytest.mark.parametrize("name", ["ddp", "shard", "leaderboard"])
@pytest.mark.parametrize("ranks", ["0", "-2"])
def test_a_world_size_below_one_is_named_as_the_mistake(name: str, ranks: str, no_run: None) -> None:
    with pytest.raises(SystemExit, match=f"^cs336 {name}: world_size must be a positive int, got {ranks}$"):
        cli.main([name, "--world-size", ranks])


def test_a_bench_run_in_part_says_how_many_configurations_ran(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(resources, "available_host_bytes", lambda: 16 * 2**30)
    argv = ["bench", "--size", "8B,tiny", "--context-length", "9", "--batch-size", "2", "--warmup", "0", "--steps",
            "1", "--device", "cpu", "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    status = out[0].split().index("status")
    assert [(line.split()[0], line.split()[status]) for line in out[2:4]] == [("8B", "oom"), ("tiny", "ok")]
    assert out[-1] == "ran 1 of 2 configurations (1 out of memory)"


@pytest.mark.parametrize(("argv", "said"), [
    (["collectives", "--backends", "gloo,gloo"], "argument --backends: expected a comma-separated list of str values, "
                                                 "each once, got 'gloo,gloo' (gloo twice)"),
    (["bench", "--compute-dtype", "fp32,,bf16"], "argument --compute-dtype: expected a comma-separated list of str "
                                                 "values, got 'fp32,,bf16' (an empty item)"),
    (["ddp", "--variants", "naive,", "--backend", "gloo"], "(an empty item)"),
])
def test_an_empty_or_repeated_list_item_is_one_line(argv: list[str], said: str, no_run: None,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(argv)
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"cs336 {argv[0]}: error: ") and error.endswith(said), error


@pytest.mark.parametrize("name", ["bench", "leaderboard"])
def test_a_policy_naming_more_blocks_than_the_model_has_is_one_line(name: str, no_run: None) -> None:
    with pytest.raises(SystemExit, match=f"^cs336 {name}: checkpoint policy first:99 names 99 blocks, but the model "
                                         "has 2$"):
        cli.main([name, "--checkpoint", "first:99"])


def test_a_budget_cap_below_what_the_step_holds_names_the_cap_and_what_it_must_cover() -> None:
    with pytest.raises(SystemExit, match=r"^cs336 leaderboard: the memory cap, 40 GiB, is below the step's peak with "
                                         r"every block checkpointed \(\d+.\d GiB: this rank's weights, gradients and "
                                         r"optimizer state, .*\); raise memory_cap_gib \(--memory-cap-gib\) to that or "
                                         r"more$"):
        cli.main(["leaderboard", "--proxy", "--checkpoint", "budget", "--memory-cap-gib", "40", "--memory-plan"])


@pytest.mark.parametrize("argv", [["ddp", "--backend", "gloo"], ["shard", "--backend", "gloo"]])
def test_an_unwritable_trace_dir_fails_before_the_run(argv: list[str], no_run: None) -> None:
    with pytest.raises(SystemExit, match=f"^cs336 {argv[0]}: cannot write to the folder '/proc/nope/traces': No such "
                                         "file or directory$"):
        cli.main([*argv, "--trace-dir", "/proc/nope/traces"])


@pytest.mark.parametrize("argv", [["ddp", "--world-size", "64", "--global-batch", "64"],
                                  ["shard", "--world-size", "64", "--global-batch", "64"],
                                  ["leaderboard", "--world-size", "64", "--global-batch", "64"],
                                  ["collectives", "--world-sizes", "2,64", "--backends", "gloo"]])
def test_every_multi_rank_command_refuses_more_ranks_than_host_memory_holds(argv: list[str], no_run: None,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """64 gloo ranks on a 24 GiB machine (what ran one out of memory): each rank's own memory is the measured
    ``RANK_BASE_BYTES`` (tests/test_host_memory.py), so at most 24 GiB / (that + its tensors) ranks fit."""
    monkeypatch.setattr(resources, "available_host_bytes", lambda: 24 * 2**30)
    with pytest.raises(SystemExit, match=rf"^cs336 {argv[0]}: .* on (up to )?64 ranks .*needs at least .* GiB of "
                                         r"host memory \(64 ranks of .*\), and 24 GiB is available: at most "
                                         r"(3\d|4\d) of these ranks fit$"):
        cli.main(argv)
