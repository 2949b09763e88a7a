"""The residual counter against cases counted by hand."""

from __future__ import annotations

import pytest
import torch
from cs336_harness import cli
from cs336_harness.results import read_rows
from cs336_harness.studies.residuals import (
    ResidualsConfig,
    block_experiment,
    block_gradient_bytes,
    count_residuals,
    rmsnorm_experiment,
)


def test_hand_counted_case_skips_parameters_and_counts_a_storage_once() -> None:
    lin = torch.nn.Linear(5, 4, bias=False)  # weight (4, 5); x @ weight.T saves a view of the parameter
    w = torch.nn.Parameter(torch.randn(4))
    x = torch.randn(3, 5, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)  # saves x (3x5 fp32 = 60 bytes); the weight view is a parameter's storage
        s = torch.sin(h)  # saves h (3x4 = 48 bytes)
        y = s * w  # saves s (48 bytes) and w (a parameter)
        return (x * x).sum() + y.exp().sum()  # x twice (already counted); exp saves its result (48 bytes)

    params = torch.nn.ModuleDict({"lin": lin})
    params.register_parameter("w", w)
    out, report = count_residuals(fn, x, params=params)
    assert report.total_bytes == 60 + 48 + 48 + 48
    assert [r.duplicate for r in report.records].count(True) == 2
    assert [r.saved_by for r in report.records if not r.duplicate] == ["linear", "sin", "mul", "exp"]
    assert report.by("saved_by")["linear"] == 60
    out.backward()
    assert x.grad is not None


def test_module_names_come_from_the_root() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    x = torch.randn(5, 6, requires_grad=True)
    _, report = count_residuals(model, x, params=model)
    # Linear 0 saves x; ReLU saves its output; Linear 2 saves that same output again (counted once).
    assert report.by("module") == {"0": 5 * 6 * 4, "1": 5 * 7 * 4}
    assert [(r.module, r.duplicate) for r in report.records] == [("0", False), ("1", False), ("2", True)]


def test_rmsnorm_eager_keeps_two_full_tensors_and_the_rms() -> None:
    shape = (2, 3, 16)
    report = rmsnorm_experiment(shape)
    full = 2 * 3 * 16 * 4
    assert report.total_bytes == 2 * full + 2 * 3 * 4


def test_block_gradient_bytes() -> None:
    assert block_gradient_bytes(8, 12) == (4 * 64 + 3 * 96 + 16) * 4


def test_cpu_defaults_are_the_tiny_block_and_flags_override_them() -> None:
    config = ResidualsConfig(device="cpu")
    assert (config.size, config.d_model, config.d_ff, config.num_heads, config.context_length) == (
        "tiny", 64, 256, 4, 128)
    config = ResidualsConfig(device="cpu", size="xl", num_heads=16, context_length=64)
    assert (config.d_model, config.d_ff, config.num_heads, config.context_length) == (2560, 10240, 16, 64)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device": "tpu"}, "device must be"), ({"size": "huge"}, "size must be one of"),
    ({"num_heads": 3}, "even integer"), ({"experiments": ("nope",)}, "experiments must be drawn from"),
])
def test_bad_values_are_rejected_with_a_message(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ResidualsConfig(**{"device": "cpu", **kwargs})


def test_the_cpu_default_block_is_small() -> None:
    config = ResidualsConfig(device="cpu")
    report = block_experiment(**config.dims)
    # Under 100 MiB, where the xl block at context 2048 saves gigabytes.
    assert 0 < report.total_mib < 100


@pytest.mark.slow
def test_command_prints_the_block_and_shows_progress(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.jsonl"
    assert cli.main(["residuals", "--experiment", "rmsnorm", "--device", "cpu", "--out", str(out)]) == 0
    printed, err = capsys.readouterr()
    assert printed.startswith("tiny block (d_model 64, d_ff 256, 4 heads), batch 4, context 128, on cpu")
    # The bar shows its total from the start and the last measurement's name; whether it is redrawn at 2/2 before it
    # clears itself depends on tqdm's refresh interval (a loaded machine skips that redraw).
    assert "residuals:" in err and "/2" in err and "RMSNorm compiled" in err
    assert [(r["experiment"], r["variant"]) for r in read_rows(out)] == [("rmsnorm", "eager"), ("rmsnorm", "compiled")]
