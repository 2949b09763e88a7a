"""Mixed-precision experiments: the sums, the autocast dtypes, the layer norm errors."""

from __future__ import annotations

import torch
from cs336_harness.studies.precision import accumulation_sums, layernorm_error, toy_model_dtypes


def test_fp16_accumulator_loses_most() -> None:
    err = {r["sum"]: r["abs_error"] for r in accumulation_sums()}
    assert err["fp32 += fp32"] < 1e-3 < err["fp32 += fp16"] < err["fp16 += fp16"]
    assert err["fp32 += fp16"] == err["fp32 += fp16.to(fp32)"]  # the same rounding of 0.01, once


def test_toy_model_dtypes_under_cpu_autocast() -> None:
    seen = toy_model_dtypes("cpu", torch.float16)
    assert seen["parameters inside autocast"] == "float32"
    assert seen["output of fc1"] == "float16" and seen["logits"] == "float16"
    assert seen["loss"] == "float32" and seen["gradients"] == "float32"


def test_layernorm_fp16_breaks_at_large_scale_and_bf16_does_not() -> None:
    rows = {(r["input_scale"], r["dtype"]): r for r in layernorm_error(scales=(1.0, 1000.0), width=512)}
    assert not rows[(1000.0, "fp16")]["sum_of_squares_finite"]
    assert rows[(1000.0, "bf16")]["sum_of_squares_finite"] and rows[(1000.0, "bf16")]["max_abs_error"] < 0.1
    assert rows[(1.0, "fp16")]["max_abs_error"] < rows[(1.0, "bf16")]["max_abs_error"]
