"""The package's top level: its exports (plain functions, the names the README lists), the version, and the errors
when kernels meet CPU tensors without Triton's interpreter (or without the interpreter's numpy)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import cs336_kernels
import pytest
import torch


def test_version_is_the_installed_distributions():
    try:
        installed = importlib.metadata.version("cs336-kernels")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree on PYTHONPATH
        installed = "unknown"
    assert cs336_kernels.__version__ == installed


def test_every_export_is_defined():
    assert all(getattr(cs336_kernels, name) is not None for name in cs336_kernels.__all__)


# What the kernels README's public API table lists: each is a plain function or class at the top level.
README_NAMES = ["flash_attention", "FlashAttentionTriton", "FlashAttentionPytorch", "attention_reference", "rms_norm",
                "rms_norm_reference", "add_rms_norm", "add_rms_norm_reference", "rope", "rope_reference", "silu_mul",
                "silu_mul_reference", "fused_linear_cross_entropy", "linear_cross_entropy_reference", "FusedAdamW",
                "CHUNK_BYTES"]


@pytest.mark.parametrize("name", README_NAMES)
def test_public_names_are_exported_functions_not_modules(name):
    import types

    value = getattr(cs336_kernels, name)
    assert name in cs336_kernels.__all__ and not isinstance(value, types.ModuleType)


def test_readme_lists_every_export():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    missing = [name for name in cs336_kernels.__all__ if name != "__version__" and f"`{name}" not in readme]
    assert not missing, missing


def test_top_level_functions_are_the_ops_modules_functions():
    from cs336_kernels.ops import flash_attention, fused_linear_cross_entropy, rms_norm, rope, swiglu

    assert cs336_kernels.flash_attention is flash_attention.flash_attention
    assert cs336_kernels.rms_norm is rms_norm.rms_norm and cs336_kernels.add_rms_norm is rms_norm.add_rms_norm
    assert cs336_kernels.rope is rope.rope and cs336_kernels.silu_mul is swiglu.silu_mul
    assert cs336_kernels.fused_linear_cross_entropy is fused_linear_cross_entropy.fused_linear_cross_entropy
    assert cs336_kernels.nn.RMSNorm.__module__ == "cs336_kernels.nn"


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
        lambda: cs336_kernels.add_rms_norm(*(torch.randn(3, 16, device="meta") for _ in range(2)),
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


_BF16 = torch.bfloat16


@pytest.mark.interpreter
@pytest.mark.parametrize(("caller", "call"), [
    ("flash_attention", lambda: cs336_kernels.flash_attention(*(torch.randn(1, 2, 64, 32, dtype=_BF16)
                                                                for _ in range(3)), is_causal=True)),
    ("flash_attention", lambda: cs336_kernels.FlashAttentionTriton.apply(*(torch.randn(1, 2, 64, 32, dtype=_BF16)
                                                                          for _ in range(3)), True)),
    ("FusedAdamW", lambda: cs336_kernels.FusedAdamW([torch.randn(4, dtype=_BF16)])),
    ("fused_linear_cross_entropy", lambda: cs336_kernels.fused_linear_cross_entropy(
        torch.randn(3, 16, dtype=_BF16), torch.randn(5, 16, dtype=_BF16), torch.zeros(3, dtype=torch.long))),
    ("rms_norm", lambda: cs336_kernels.rms_norm(torch.randn(3, 16, dtype=_BF16), torch.ones(16, dtype=_BF16))),
    ("add_rms_norm", lambda: cs336_kernels.add_rms_norm(*(torch.randn(3, 16, dtype=_BF16) for _ in range(2)),
                                                        torch.ones(16, dtype=_BF16))),
    ("rope", lambda: cs336_kernels.rope(*(torch.randn(1, 3, 2, 16, dtype=_BF16) for _ in range(2)),
                                        *(torch.randn(8, 8) for _ in range(2)), torch.arange(3))),
    ("silu_mul", lambda: cs336_kernels.silu_mul(*(torch.randn(3, 16, dtype=_BF16) for _ in range(2)))),
])
def test_every_op_refuses_bf16_in_the_interpreter_in_one_sentence(caller, call):
    """The interpreter multiplies bf16 matrices as raw bits (attention off by 1e8) and truncates casts to bf16."""
    with pytest.raises(ValueError) as error:
        call()
    assert str(error.value) == (
        f"{caller} got bfloat16 tensors on CPU, which Triton's interpreter computes wrongly (it multiplies bf16 "
        "matrices as raw bits and truncates casts to bf16); use float32 or float16 there, or a CUDA GPU.")


# Each kernel on CPU tensors in a process that imported cs336_kernels without TRITON_INTERPRET=1, first with
# the variable still unset, then set after the import. Prints each error message, one per line, then what fake
# tensors give.
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
# Fake tensors run no kernel: the device check lets them through (e.g. counting a step's memory on a CPU).
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():
    out = calls[0]()
    normed = cs336_kernels.rms_norm(torch.randn(3, 16), torch.ones(16))
    print("fake", tuple(out.shape), tuple(normed.shape))
"""


@pytest.mark.slow
def test_cpu_tensors_without_the_interpreter_say_to_set_it_before_import():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", _WITHOUT_INTERPRETER], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 7 and lines.pop() == "fake (1, 4, 16) (3, 16)"
    callers = ("flash_attention", "FusedAdamW", "fused_linear_cross_entropy") * 2
    for i, (line, caller) in enumerate(zip(lines, callers, strict=True)):
        assert line.startswith(f"{caller} runs Triton kernels on CUDA tensors"), line
        assert "set TRITON_INTERPRET=1 before importing cs336_kernels" in line, line
        assert ("it is set now, but was not when cs336_kernels was imported" in line) == (i >= 3), line
