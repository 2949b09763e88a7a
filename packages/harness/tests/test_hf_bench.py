"""``cs336 hf`` on CPU (our kernels in Triton's interpreter, fp32, the two-layer models): every impl that runs trains
the same model on the same batches (equal losses), the rows and the table, Liger's line when it does not import,
bad configs refused; on a GPU the real shapes (marked gpu)."""

from __future__ import annotations

import json

import pytest
import torch
from cs336_harness.cli import main
from cs336_harness.studies.hf_step import HFStepConfig, batches, run_hf_step

pytest.importorskip("transformers")

# The losses of one model trained by two impls in fp32: the same function, rounded differently.
LOSS_REL_TOL = 1e-4


def _liger_importable() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def test_impls_train_the_same_model_on_the_same_batches():
    config = HFStepConfig.for_device(False, models=("tiny-qwen3",), impls=("sdpa", "ours", "liger"), steps=1)
    said = []
    rows = run_hf_step(config, say=said.append)
    by_impl = {row["impl"]: row for row in rows}
    if not _liger_importable():
        assert said == ["cs336 hf: tiny-qwen3 liger not run: liger_kernel.transformers is not importable: "
                        "ModuleNotFoundError: No module named 'liger_kernel'"]
        assert by_impl.keys() == {"sdpa", "ours"}
    for row in rows:
        assert row["status"] == "ok" and row["tokens"] == 32 and row["layout"] == "packed"
        assert row["tokens_per_s"] == pytest.approx(32 / (row["step_ms"] / 1e3))
        assert len(row["losses"]) == 2 and row["peak_gib"] is None
    want = torch.tensor(by_impl["sdpa"]["losses"])
    assert ((torch.tensor(by_impl["ours"]["losses"]) - want).abs() / want).max() < LOSS_REL_TOL


def test_packed_batches_restart_positions_and_ignore_the_first_token():
    config = HFStepConfig.for_device(False, batch=3, seq_len=5, warmup=0, steps=1)
    (packed,) = batches(config, vocab=50)
    assert packed["input_ids"].shape == (1, 15)
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4] * 3]
    assert packed["labels"][0, ::5].tolist() == [-100] * 3
    (rows,) = batches(HFStepConfig.for_device(False, batch=3, seq_len=5, warmup=0, steps=1, layout="batched"), 50)
    assert rows.keys() == {"input_ids", "labels"} and rows["input_ids"].shape == (3, 5)
    assert torch.equal(rows["input_ids"].reshape(1, -1), packed["input_ids"])  # the same tokens either way


def test_command_prints_the_table_and_writes_rows(tmp_path, capsys):
    out = tmp_path / "hf.jsonl"
    assert main(["hf", "--model", "tiny-llama", "--impl", "sdpa", "--layout", "batched", "--warmup", "0",
                 "--steps", "1", "--quiet", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tiny-llama" in printed and "tokens_per_s" in printed
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["impl"] == "sdpa" and row["layout"] == "batched" and {"command", "commit", "device"} <= row.keys()


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "gpt-5"], "models must be among"),
    (["--impl", "ours,flash"], "impls must be among"),
    (["--steps", "0"], "steps must be a positive int"),
    (["--dtype", "bf16"], "computes bf16 wrongly"),
])
def test_bad_flags_give_one_line(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["hf", *argv])


def test_profiled_rows_print_one_table_per_model_with_a_column_per_impl(monkeypatch, capsys):
    import cs336_harness.commands.hf as hf_command

    def breakdown(attention_ms: float) -> dict:
        kernel_ms = {"attention": attention_ms, "gemm": 10.0}
        return {"kernel_ms": kernel_ms, "kernel_total_ms": attention_ms + 10.0, "step_wall_ms": 30.0, "idle_ms": 1.0,
                "glue_share": 0.0, "top_kernels": [{"name": "gemm_kernel", "kind": "gemm", "count": 2, "ms": 10.0}]}

    rows = [{"model": "llama-3.2-1b", "impl": impl, "layout": "batched", "tokens": 8, "status": "ok", "step_ms": 30.0,
             "tokens_per_s": 1.0, "vs_liger": None, "peak_gib": 1.0, "breakdown": breakdown(ms)}
            for impl, ms in (("ours", 4.0), ("liger", 6.0))]
    monkeypatch.setattr(hf_command, "run_hf_step", lambda config, progress: rows)
    assert main(["hf", "--model", "llama-3.2-1b", "--impl", "ours,liger", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("GPU time of one step by kind") == 1
    table = printed.split("a column per impl\n", 1)[1]
    assert "| ours" in table.splitlines()[0] and "liger" in table.splitlines()[0]
    assert "4 (28.6%)" in table and "6 (37.5%)" in table
    assert "llama-3.2-1b ours: the kernels with the most GPU time" in printed
    assert "llama-3.2-1b liger: the kernels with the most GPU time" in printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA --profile is a valid flag")
def test_profile_without_cuda_is_refused():
    with pytest.raises(SystemExit, match="profile times GPU kernels and needs CUDA"):
        main(["hf", "--profile"])


# The 1B and 1.7B models with their gradients and optimizer state hold far more than a test sharing the GPU may;
# building and stepping each model both ways is left to the slow GPU tests.
@pytest.mark.gpu
@pytest.mark.gpu_exclusive
@pytest.mark.slow
def test_gpu_rows_at_the_real_shapes():
    config = HFStepConfig(impls=("sdpa", "ours"), seq_len=2048, warmup=1, steps=2, profile=True)
    rows = run_hf_step(config)
    assert {(r["model"], r["impl"]) for r in rows} == {(m, i) for m in config.models for i in ("sdpa", "ours")}
    for row in rows:
        assert row["status"] == "ok" and row["peak_gib"] > 0
        kernel_ms = row["breakdown"]["kernel_ms"]
        assert kernel_ms["attention"] > 0 and kernel_ms["gemm"] > 0
