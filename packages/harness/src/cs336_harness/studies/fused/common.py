"""What the fused-kernel benchmarks share: the do_bench median, the relative error, Liger-Kernel where it imports."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from triton.testing import do_bench

from cs336_harness.studies.fused.config import FusedBenchConfig


def median_ms(fn: Callable[[], Any], config: FusedBenchConfig, grad_to_none: Sequence[torch.Tensor] = ()) -> float:
    """``triton.testing.do_bench``'s median of ``fn`` in ms, with the config's warm-up and repetition times."""
    return float(do_bench(fn, warmup=config.warmup_ms, rep=config.rep_ms, grad_to_none=list(grad_to_none) or None,
                          return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||``, in fp32."""
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def liger_functional() -> tuple[Any, str | None]:
    """Liger-Kernel's functional API, or None and why it cannot be used."""
    try:
        from liger_kernel.transformers import functional
    except Exception as e:  # noqa: BLE001 (any import failure means: no Liger rows)
        return None, f"liger_kernel is not importable: {type(e).__name__}: {e}"
    return functional, None
