"""The package's top level: its exports, the names shared by a submodule and its function, the version, and
the error when kernels meet CPU tensors without Triton's interpreter."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import cs336_kernels
import pytest
import torch


def test_version_is_the_installed_distributions():
    assert cs336_kernels.__version__ == importlib.metadata.version("cs336-kernels")


def test_every_export_is_defined():
    assert all(getattr(cs336_kernels, name) is not None for name in cs336_kernels.__all__)


def test_flash_attention_is_the_subpackage_and_callable_as_its_function():
    import cs336_kernels.flash_attention as fa
    from cs336_kernels import flash_attention as top_level
    from cs336_kernels.flash_attention import flash_attention as function

    assert top_level is fa and fa is cs336_kernels.flash_attention
    assert fa.attention_reference is cs336_kernels.attention_reference
    assert callable(function) and function is not fa
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 19, 16, generator=g) for _ in range(3))
    assert torch.equal(top_level(q, k, v, True), function(q, k, v, is_causal=True))
    assert torch.equal(top_level(q, k, v, is_causal=True, backward="pytorch"), function(q, k, v, True))


@pytest.mark.parametrize("name", ["rms_norm", "rope"])
def test_glue_modules_are_callable_as_their_functions(name):
    import importlib

    module = importlib.import_module(f"cs336_kernels.{name}")
    assert getattr(cs336_kernels, name) is module and callable(module)
    assert module.__call__ is not None and getattr(module, name) is not module


def test_fused_linear_cross_entropy_is_the_module_and_callable_as_its_function():
    import cs336_kernels.fused_linear_cross_entropy as module
    from cs336_kernels import fused_linear_cross_entropy as top_level
    from cs336_kernels.fused_linear_cross_entropy import fused_linear_cross_entropy as function

    assert top_level is module and module.FusedLinearCrossEntropy is cs336_kernels.FusedLinearCrossEntropy
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(7, 16, generator=g), torch.randn(11, 16, generator=g)
    targets = torch.randint(0, 11, (7,), generator=g)
    assert torch.equal(top_level(hidden, weight, targets, "sum"), function(hidden, weight, targets, reduction="sum"))


@pytest.mark.parametrize(
    "call",
    [
        lambda: cs336_kernels.flash_attention(*(torch.randn(1, 4, 16, device="meta") for _ in range(3))),
        lambda: cs336_kernels.FusedAdamW([torch.empty(4, device="meta")]),
        lambda: cs336_kernels.fused_linear_cross_entropy(
            torch.randn(3, 16, device="meta"), torch.randn(5, 16, device="meta"),
            torch.zeros(3, dtype=torch.long, device="meta"),
        ),
        lambda: cs336_kernels.rms_norm(torch.randn(3, 16, device="meta"), torch.ones(16, device="meta")),
        lambda: cs336_kernels.rms_norm.add_rms_norm(*(torch.randn(3, 16, device="meta") for _ in range(2)),
                                                    torch.ones(16, device="meta")),
        lambda: cs336_kernels.rope(*(torch.randn(1, 3, 2, 16, device="meta") for _ in range(2)),
                                   *(torch.randn(8, 8, device="meta") for _ in range(2)),
                                   torch.arange(3, device="meta")),
        lambda: cs336_kernels.silu_mul(torch.randn(3, 16, device="meta"), torch.randn(3, 16, device="meta")),
    ],
)
def test_kernels_reject_devices_they_cannot_run_on(call):
    with pytest.raises(ValueError, match="or on CPU tensors in Triton's interpreter; got tensors on meta"):
        call()


# Each kernel on CPU tensors in a process that imported cs336_kernels without TRITON_INTERPRET=1, first with
# the variable still unset, then set after the import. Prints each error message, one per line.
_WITHOUT_INTERPRETER = """
import os
import torch
import cs336_kernels

calls = [
    lambda: cs336_kernels.flash_attention(*(torch.randn(1, 4, 16) for _ in range(3))),
    lambda: cs336_kernels.FusedAdamW([torch.randn(4)]),
    lambda: cs336_kernels.fused_linear_cross_entropy(torch.randn(3, 16), torch.randn(5, 16), torch.zeros(3).long()),
]
for interpret in ("0", "1"):
    os.environ["TRITON_INTERPRET"] = interpret
    for call in calls:
        try:
            call()
            print("no error")
        except ValueError as error:
            print(error)
"""


@pytest.mark.slow
def test_cpu_tensors_without_the_interpreter_say_to_set_it_before_import():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", _WITHOUT_INTERPRETER], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 6
    callers = ("flash_attention", "FusedAdamW", "fused_linear_cross_entropy") * 2
    for i, (line, caller) in enumerate(zip(lines, callers, strict=True)):
        assert line.startswith(f"{caller} runs Triton kernels on CUDA tensors"), line
        assert "set TRITON_INTERPRET=1 before importing cs336_kernels" in line, line
        assert ("it is set now, but was not when cs336_kernels was imported" in line) == (i >= 3), line
