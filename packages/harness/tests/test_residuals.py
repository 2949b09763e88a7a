"""The residual counter against cases counted by hand."""

from __future__ import annotations

import torch
from cs336_harness.studies.residuals import block_gradient_bytes, count_residuals, rmsnorm_experiment


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
