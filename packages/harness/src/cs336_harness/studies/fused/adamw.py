"""``cs336 fused --bench adamw`` (a): one AdamW step over ``adamw_params`` float32 parameters split into
``adamw_tensors`` tensors: FusedAdamW vs torch.optim.AdamW(foreach=True) vs torch.optim.AdamW(fused=True), do_bench
medians (L2 flushed between calls). The bytes floor: each parameter reads param, grad, exp_avg, exp_avg_sq and
writes param, exp_avg, exp_avg_sq, 7 x 4 = 28 bytes, so

    floor_ms = 28 * num_params / 4.24e12 B/s * 1e3

with 4.24 TB/s the device-to-device copy bandwidth (bytes read + written) measured on an H200
(:data:`cs336_harness.device.H200_COPY_BYTES_PER_S`); the same run also measures its own copy bandwidth and
reports it in ``copy_tbps``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from cs336_kernels import FusedAdamW

from cs336_harness.device import H200_COPY_BYTES_PER_S
from cs336_harness.studies.fused.common import copy_step, median_ms
from cs336_harness.studies.fused.config import FusedBenchConfig

ADAMW_BYTES_PER_PARAM = 28  # fp32: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq


def measure_copy_tbps(config: FusedBenchConfig, num_bytes: int = 2**32) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    ms = median_ms(copy_step(2 * num_bytes), config)
    return 2 * num_bytes / (ms * 1e-3) / 1e12


def bench_adamw(config: FusedBenchConfig) -> list[dict[str, Any]]:
    """One step of each AdamW implementation over the same float32 parameters and gradients."""
    sizes = [config.adamw_params // config.adamw_tensors] * config.adamw_tensors
    sizes[-1] += config.adamw_params - sum(sizes)
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(n, device="cuda", generator=gen).requires_grad_() for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)
    floor_ms = ADAMW_BYTES_PER_PARAM * config.adamw_params / H200_COPY_BYTES_PER_S * 1e3
    copy_tbps = measure_copy_tbps(config)
    impls: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "FusedAdamW (ours)": lambda: FusedAdamW(params, lr=1e-4, weight_decay=0.01),
        **{
            f"FusedAdamW, {n} elements/program": functools.partial(FusedAdamW, params, lr=1e-4, weight_decay=0.01,
                                                                   elements_per_program=n)
            for n in config.adamw_elements_per_program
        },
        "torch AdamW foreach": lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True),
        "torch AdamW fused": lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True),
    }
    rows = []
    for name, make in impls.items():
        opt = make()
        ms = median_ms(opt.step, config)
        rows.append({
            "bench": "adamw", "impl": name, "num_params": config.adamw_params, "num_tensors": config.adamw_tensors,
            "median_ms": ms, "floor_ms": floor_ms, "floor_fraction": floor_ms / ms,
            "achieved_tbps": ADAMW_BYTES_PER_PARAM * config.adamw_params / (ms * 1e-3) / 1e12,
            "copy_tbps": copy_tbps,
        })
        del opt
        torch.cuda.empty_cache()
    fused_ms = next(r["median_ms"] for r in rows if r["impl"] == "torch AdamW fused")
    for r in rows:
        r["speedup_vs_torch_fused"] = fused_ms / r["median_ms"]
    return rows
