"""One Transformer block, eager and under ``torch.compile(fullgraph=True)``, with our kernels and with PyTorch's
(``cs336 block``).

The block is :func:`cs336_harness.train_config.build_block` at a size preset's shape (default: one block of the 8B
model, one sequence of 32,768 tokens, bf16 weights and activations), built with its pieces from one of two sets of
:mod:`cs336_harness.registry` (:data:`KERNELS`):

- ``ours``: attention ``triton`` (``cs336_kernels.flash_attention``, the Gluon kernels on sm_90) and glue ``triton``
  (``rms_norm``, ``add_rms_norm``: the first residual add folded into the second norm, ``rope`` and ``silu_mul``),
  each a registered operator;
- ``torch``: attention ``sdpa`` (cuDNN on an H200) and glue ``model``, the model's own PyTorch code.

Each set runs eagerly and compiled (the whole block, ``fullgraph=True``, Inductor), so the four rows separate
what the kernels buy from what the compiler buys around them. A row times forward + backward of the block
(``triton.testing.do_bench``, median, the gradients reset between repetitions) and the forward alone, and records
the peak memory above the inputs and weights, the graph breaks ``torch._dynamo.explain`` counts (compiled rows),
the first call's time (compilation included) and the ratio to the compiled ``torch`` row of the same run.

    bash tools/gpu.sh python3 -m cs336_harness.cli block --out writeup/results/compiled_block.jsonl

Row fields: ``variant`` (``eager_ours``, ``compiled_ours``, ``eager_torch``, ``compiled_torch``), ``kernels``,
``compiled``, ``size``, ``batch``, ``seq``, ``dtype``, ``fwd_bwd_ms``, ``fwd_ms``, ``peak_gib`` (allocated during
forward + backward above what was allocated before), ``graph_breaks``, ``first_call_s``,
``vs_compiled_torch`` (``fwd_bwd_ms`` over the compiled ``torch`` row's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from cs336_basics.config import PRESETS, ModelConfig

from cs336_harness import registry
from cs336_harness.device import DTYPES, GIB
from cs336_harness.progress import progress_bar
from cs336_harness.train_config import build_block

VARIANTS: tuple[str, ...] = ("eager_ours", "compiled_ours", "eager_torch", "compiled_torch")
BASELINE = "compiled_torch"
# Each set's (attention, glue) names.
KERNELS: dict[str, tuple[str, str]] = {"ours": ("triton", "triton"), "torch": ("sdpa", "model")}


@dataclass(frozen=True)
class BlockBenchConfig:
    """One run of ``cs336 block``: the block of a size preset at ``batch`` sequences of ``seq`` tokens."""

    size: str = "8B"
    batch: int = 1
    seq: int = 32_768
    dtype: str = "bf16"
    variants: tuple[str, ...] = VARIANTS
    warmup_ms: int = 200
    rep_ms: int = 1000

    def __post_init__(self) -> None:
        if self.size not in PRESETS:
            raise ValueError(f"size must be one of {', '.join(PRESETS)}, got {self.size!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(f"variants must be among {', '.join(VARIANTS)}, got {', '.join(self.variants) or 'none'}")
        for name in ("batch", "seq", "warmup_ms", "rep_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_preset(self.size, context_length=self.seq)


def variant_block(config: BlockBenchConfig, variant: str, device: torch.device | str) -> torch.nn.Module:
    """The block of ``variant`` on ``device`` in the config's dtype, its weights from a fixed seed (every variant
    gets the same)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    attention, glue = KERNELS[variant.split("_")[1]]
    block = build_block(config.model_config, registry.kernels(attention, glue), device=torch.device(device),
                        dtype=DTYPES[config.dtype])
    return torch.compile(block, fullgraph=True) if variant.startswith("compiled") else block


def graph_breaks(block: torch.nn.Module, x: torch.Tensor) -> int:
    """The graph breaks Dynamo meets tracing ``block(x)`` (the module under any compile wrapper)."""
    torch._dynamo.reset()
    return torch._dynamo.explain(getattr(block, "_orig_mod", block))(x).graph_break_count


def _time(fn: Callable[[], Any], config: BlockBenchConfig, grad_to_none: list[torch.Tensor]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=config.warmup_ms, rep=config.rep_ms, grad_to_none=grad_to_none,
                          return_mode="median"))


def measure(config: BlockBenchConfig, variant: str) -> dict[str, Any]:
    """One row: the block of ``variant`` timed on the GPU (see the module docstring)."""
    device = torch.device("cuda")
    block = variant_block(config, variant, device)
    model = config.model_config
    gen = torch.Generator(device=device).manual_seed(1)
    dtype = DTYPES[config.dtype]
    x = torch.randn(config.batch, config.seq, model.d_model, device=device, dtype=dtype, generator=gen)
    x.requires_grad_()
    upstream = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
    leaves = [x, *block.parameters()]
    compiled = variant.startswith("compiled")
    breaks = graph_breaks(block, x) if compiled else None

    def fwd_bwd() -> None:
        block(x).backward(upstream)

    torch.cuda.synchronize()
    start = time.perf_counter()
    fwd_bwd()
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start
    for t in leaves:
        t.grad = None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak_gib = (torch.cuda.max_memory_allocated() - base) / GIB
    fwd_bwd_ms = _time(fwd_bwd, config, leaves)
    with torch.no_grad():
        fwd_ms = _time(lambda: block(x), config, [])
    return {
        "bench": "compiled_block", "variant": variant, "kernels": variant.split("_")[1], "compiled": compiled,
        "size": config.size, "batch": config.batch, "seq": config.seq, "dtype": config.dtype,
        "fwd_bwd_ms": fwd_bwd_ms, "fwd_ms": fwd_ms, "peak_gib": peak_gib, "graph_breaks": breaks,
        "first_call_s": first_call_s,
    }


def run_block_bench(config: BlockBenchConfig, progress: bool = False) -> list[dict[str, Any]]:
    """The rows of every variant of ``config``, with ``vs_compiled_torch`` when that variant ran. Needs CUDA."""
    if not torch.cuda.is_available():
        raise ValueError("cs336 block times GPU kernels and needs a CUDA GPU")
    rows = []
    bar = progress_bar(total=len(config.variants), desc="block", enabled=progress, unit="variant")
    for variant in config.variants:
        bar.set_postfix_str(variant)
        rows.append(measure(config, variant))
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        bar.update()
    bar.close()
    baseline = next((r["fwd_bwd_ms"] for r in rows if r["variant"] == BASELINE), None)
    for row in rows:
        row["vs_compiled_torch"] = None if baseline is None else row["fwd_bwd_ms"] / baseline
    return rows
