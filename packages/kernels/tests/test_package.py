"""The package's top level: its exports (plain functions, the names the README lists), the version, and the errors
when kernels meet CPU tensors without Triton's interpreter (or without the interpreter's numpy)."""

from __future__ import annotations

import importlib.metadata
import os
import re
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
README_NAMES = ["flash_attention", "flash_attention_varlen", "FlashAttentionTriton", "FlashAttentionPytorch",
                "attention_reference", "attention_reference_varlen", "rms_norm",
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
@pytest.mark.parametrize(("caller", "wrong", "call"), [
    ("flash_attention", "it multiplies bf16 matrices as raw bits",
     lambda: cs336_kernels.flash_attention(*(torch.randn(1, 2, 64, 32, dtype=_BF16) for _ in range(3)), True)),
    ("flash_attention", "it multiplies bf16 matrices as raw bits",
     lambda: cs336_kernels.FlashAttentionTriton.apply(*(torch.randn(1, 2, 64, 32, dtype=_BF16) for _ in range(3)))),
    ("FusedAdamW", "it truncates the updated bf16 parameters where a GPU rounds to nearest, so every step would shrink "
     "them toward zero", lambda: cs336_kernels.FusedAdamW([torch.randn(4, dtype=_BF16)])),
])
def test_what_the_interpreter_computes_wrongly_in_bf16_is_refused_in_one_sentence(caller, wrong, call):
    """Attention's bf16 tl.dot in the interpreter is off by 1e8; AdamW's truncated updates shrink the parameters."""
    with pytest.raises(ValueError) as error:
        call()
    assert str(error.value) == (f"{caller} got bfloat16 tensors on CPU, which Triton's interpreter computes wrongly "
                                f"({wrong}); use float32 or float16 there, or a CUDA GPU.")


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest elementwise |got - want| / |want| (``want`` float64, away from zero)."""
    return ((got.double() - want).abs() / want.abs().clamp_min(1e-3)).max().item()


# The bf16 roundings on the way to each output (the interpreter truncates each one, a GPU rounds it to nearest): the
# norm's output; the residual sum, then the norm; RoPE's rotation; SwiGLU's sigmoid, a * sigmoid(a), then * b.
_BF16_ROUNDINGS = {"rms_norm": 1, "add_rms_norm": 2, "rope": 1, "silu_mul": 3}


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "rope", "silu_mul", "fused_linear_cross_entropy"])
def test_the_elementwise_kernels_are_right_in_bf16_in_the_interpreter(op):
    """They take bf16 in the interpreter, whose casts truncate where a GPU rounds to nearest: each rounding within
    bf16's eps (relative), against a float64 reference on the same bf16 inputs."""
    g = torch.Generator().manual_seed(0)

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(_BF16)

    x, delta, w, a, b = bf16(5, 48), bf16(5, 48), bf16(48), bf16(5, 48), bf16(5, 48)
    q, k, angles = bf16(1, 7, 2, 16), bf16(1, 7, 2, 16), torch.rand(7, 8, generator=g) * 6
    hidden, weight, targets = bf16(9, 32), bf16(11, 32), torch.randint(0, 11, (9,), generator=g)
    cases = {
        "rms_norm": lambda f: [f(x, w)],
        "add_rms_norm": lambda f: list(f(x, delta, w)),
        "rope": lambda f: list(f(q, k, angles.cos(), angles.sin(), torch.arange(7))),
        "silu_mul": lambda f: [f(a, b)],
        "fused_linear_cross_entropy": lambda f: [f(hidden, weight, targets)],
    }
    ours = cases[op](getattr(cs336_kernels, op))
    reference = {"fused_linear_cross_entropy": "linear_cross_entropy_reference"}.get(op, f"{op}_reference")
    want = cases[op](lambda *t: getattr(cs336_kernels, reference)(
        *(v.double() if v.is_floating_point() else v for v in t)))
    for got, expected in zip(ours, want, strict=True):
        if op == "fused_linear_cross_entropy":  # an fp32 loss of bf16 logits (torch's matmul): their tolerance
            assert abs(got.item() - expected.item()) < 1e-2 * abs(expected.item())
        else:
            bound = (1 + torch.finfo(_BF16).eps) ** _BF16_ROUNDINGS[op] - 1  # each rounding within eps, relative
            assert _relative_error(got, expected) <= bound, (op, _relative_error(got, expected), bound)


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


def test_transformers_is_imported_by_the_hf_module_alone():
    # cs336_kernels stays torch + triton: only `import cs336_kernels.hf` (the hf extra) imports transformers, and
    # without transformers (a None entry in sys.modules makes its import fail) that import names the extra.
    code = ("import sys, cs336_kernels\nassert 'transformers' not in sys.modules\n"
            "sys.modules['transformers'] = None\n"
            "try:\n    import cs336_kernels.hf\nexcept ImportError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "install cs336-kernels[hf] (transformers >= 5.4)" in done.stdout


def test_an_older_transformers_is_refused_on_import():
    pytest.importorskip("transformers")
    code = ("import transformers\ntransformers.__version__ = '5.3.0'\n"
            "try:\n    import cs336_kernels.hf\nexcept ImportError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cs336_kernels.hf needs transformers >= 5.4, found 5.3.0" in done.stdout


def test_the_hf_extra_admits_the_oldest_transformers_the_module_takes():
    pytest.importorskip("transformers")
    from cs336_kernels.hf import OLDEST_TRANSFORMERS
    try:
        requires = importlib.metadata.requires("cs336-kernels") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("imported from a source tree on PYTHONPATH: no installed metadata")
    # e.g. 'transformers<5.26,>=5.4; extra == "hf"'
    hf = [req for req in requires if re.match(r"transformers\b", req)]
    assert len(hf) == 1 and re.search(r"""extra\s*==\s*["']hf["']""", hf[0]), requires
    assert re.findall(r">=\s*([\d.]+)", hf[0]) == [OLDEST_TRANSFORMERS], hf[0]
