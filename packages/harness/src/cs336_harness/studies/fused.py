"""Benchmarks of the fused kernels in cs336_kernels against PyTorch (``cs336 fused``).

(a) One AdamW step over ``adamw_params`` float32 parameters split into ``adamw_tensors`` tensors:
    FusedAdamW vs torch.optim.AdamW(foreach=True) vs torch.optim.AdamW(fused=True), do_bench medians (L2
    flushed between calls). The bytes floor: each parameter reads param, grad, exp_avg, exp_avg_sq and writes
    param, exp_avg, exp_avg_sq, 7 x 4 = 28 bytes, so

        floor_ms = 28 * num_params / 4.24e12 B/s * 1e3

    with 4.24 TB/s the device-to-device copy bandwidth (bytes read + written) measured on an H200
    (ANCHORS.md); the same run also measures its own copy bandwidth and reports it in ``copy_tbps``.
(b) LM head + cross-entropy, forward and backward: fused_linear_cross_entropy vs plain PyTorch
    (F.linear + F.cross_entropy, cs336_kernels' reference), in bfloat16. Median time, and peak memory above
    the inputs and their gradients (max_memory_allocated during one fwd+bwd minus what was allocated before it,
    minus the gradients' bytes). The matmul floor counts three (N x V x d) products, forward logits and the
    two gradients, at 772 TFLOP/s (bf16 8192^3 on random data, ANCHORS.md):

        matmul_floor_ms = 3 * 2 * N * V * d / 772e12 * 1e3

    Each row also carries the relative error of our loss and gradients against plain PyTorch's.

    from cs336_harness.fused_bench import FusedBenchConfig, run_fused_bench, fused_markdown
    rows = run_fused_bench(FusedBenchConfig())
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from cs336_kernels.fused_adamw import FusedAdamW
from cs336_kernels.fused_linear_cross_entropy import (
    chunk_rows,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
    softmax_grad_inplace,
)
from triton.testing import do_bench

from cs336_harness.analysis.tables import markdown_table

BENCHES: tuple[str, ...] = ("adamw", "linear-ce")
COPY_BYTES_PER_S = 4.24e12  # H200 device-to-device copy, bytes read + written (ANCHORS.md)
BF16_MATMUL_FLOPS = 772e12  # H200 bf16 8192^3 matmul on random data (ANCHORS.md)
ADAMW_BYTES_PER_PARAM = 28  # fp32: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq
_IGNORE_INDEX = -100


@dataclass(frozen=True)
class FusedBenchConfig:
    benches: tuple[str, ...] = BENCHES
    adamw_params: int = 10**9
    adamw_tensors: int = 16
    tokens: int = 32768
    d_model: int = 4096
    vocab_size: int = 151936
    warmup_ms: int = 200
    rep_ms: int = 1000
    # FusedAdamW launch granularities timed besides the default.
    adamw_elements_per_program: tuple[int, ...] = (2048, 262144)
    # Fused variants with these token chunk sizes are timed besides the default (which fits the memory budget).
    extra_chunk_sizes: tuple[int, ...] = (2048, 8192)

    def __post_init__(self) -> None:
        if not torch.cuda.is_available():
            raise ValueError("the fused-kernel benchmarks measure GPU kernels and need a CUDA GPU")
        if not self.benches or any(b not in BENCHES for b in self.benches):
            raise ValueError(f"benches must be a non-empty subset of {BENCHES}, got {self.benches}")
        if self.adamw_tensors < 1 or self.adamw_params < self.adamw_tensors:
            raise ValueError(f"need 1 <= adamw_tensors <= adamw_params, got {self.adamw_tensors} tensors "
                             f"for {self.adamw_params} params")
        for name in ("tokens", "d_model", "vocab_size", "warmup_ms", "rep_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if any(n < 1 or n % 2048 for n in self.adamw_elements_per_program):
            raise ValueError(f"adamw elements per program must be positive multiples of 2048, "
                             f"got {self.adamw_elements_per_program}")
        if any(c < 1 for c in self.extra_chunk_sizes):
            raise ValueError(f"extra chunk sizes must be positive, got {self.extra_chunk_sizes}")


def _median_ms(fn: Callable[[], Any], config: FusedBenchConfig, grad_to_none: Sequence[torch.Tensor] = ()) -> float:
    return float(do_bench(fn, warmup=config.warmup_ms, rep=config.rep_ms, grad_to_none=list(grad_to_none) or None,
                          return_mode="median"))


def measure_copy_tbps(config: FusedBenchConfig, num_bytes: int = 2**32) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), config)
    return 2 * num_bytes / (ms * 1e-3) / 1e12


def bench_adamw(config: FusedBenchConfig) -> list[dict[str, Any]]:
    """One step of each AdamW implementation over the same float32 parameters and gradients."""
    sizes = [config.adamw_params // config.adamw_tensors] * config.adamw_tensors
    sizes[-1] += config.adamw_params - sum(sizes)
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(n, device="cuda", generator=gen).requires_grad_() for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)
    floor_ms = ADAMW_BYTES_PER_PARAM * config.adamw_params / COPY_BYTES_PER_S * 1e3
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
        ms = _median_ms(opt.step, config)
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


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def bench_linear_ce(config: FusedBenchConfig) -> list[dict[str, Any]]:
    """Forward + backward of the LM head and loss, fused vs plain PyTorch, in bfloat16."""
    n, d, v = config.tokens, config.d_model, config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, d, device="cuda", generator=gen) / d**0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    grads_bytes = hidden.nbytes + weight.nbytes
    matmul_floor_ms = 3 * 2 * n * v * d / BF16_MATMUL_FLOPS * 1e3
    default_rows = chunk_rows(n, v, hidden.element_size(), None)
    impls: dict[str, Callable[..., torch.Tensor]] = {f"fused (ours), chunk {default_rows}": fused_linear_cross_entropy}
    for rows_per_chunk in config.extra_chunk_sizes:
        impls[f"fused, chunk {rows_per_chunk}"] = functools.partial(fused_linear_cross_entropy,
                                                                    chunk_size=rows_per_chunk)
    impls["plain torch"] = linear_cross_entropy_reference
    rows, results = [], {}
    for name, loss_fn in impls.items():
        def step(loss_fn=loss_fn) -> torch.Tensor:
            loss = loss_fn(hidden, weight, targets, "mean", _IGNORE_INDEX)
            loss.backward()
            return loss.detach()

        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = step()
        torch.cuda.synchronize()
        extra_gib = (torch.cuda.max_memory_allocated() - before - grads_bytes) / 2**30
        results[name] = (loss, hidden.grad, weight.grad)
        hidden.grad = weight.grad = None
        ms = _median_ms(step, config, grad_to_none=(hidden, weight))
        rows.append({
            "bench": "linear_ce", "impl": name, "tokens": n, "d_model": d, "vocab_size": v, "dtype": "bf16",
            "median_ms": ms, "matmul_floor_ms": matmul_floor_ms, "floor_fraction": matmul_floor_ms / ms,
            "extra_gib": extra_gib, "loss": loss.item(),
        })
    ref = results["plain torch"]
    for r in rows:
        r["speedup_vs_torch"] = rows[-1]["median_ms"] / r["median_ms"]
        if r["impl"] != "plain torch":
            ours = results[r["impl"]]
            r.update(loss_rel_err=_rel_err(ours[0], ref[0]), grad_hidden_rel_err=_rel_err(ours[1], ref[1]),
                     grad_weight_rel_err=_rel_err(ours[2], ref[2]))
    del results
    return rows + [_linear_ce_parts(hidden.detach(), weight.detach(), targets, default_rows, config)]


def _linear_ce_parts(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows_per_chunk: int,
                     config: FusedBenchConfig) -> dict[str, Any]:
    """Where the fused time goes: each stage on one chunk, times the number of chunks."""
    n, v = hidden.shape[0], weight.shape[0]
    h = hidden[:rows_per_chunk]
    logits = hidden.new_empty(rows_per_chunk, v)
    grad_hidden = torch.empty_like(h)
    grad_weight = torch.zeros_like(weight)
    losses = torch.empty(rows_per_chunk, dtype=torch.float32, device=hidden.device)
    scale = torch.full((), 1.0 / n, device=hidden.device)
    stages = {
        "logits_mm": lambda: torch.mm(h, weight.t(), out=logits),
        "softmax_grad_kernel": lambda: softmax_grad_inplace(logits, targets[:rows_per_chunk], losses, scale, 0,
                                                            _IGNORE_INDEX, True),
        "grad_hidden_mm": lambda: torch.mm(logits, weight, out=grad_hidden),
        "grad_weight_addmm": lambda: grad_weight.addmm_(logits.t(), h),
    }
    num_chunks = -(-n // rows_per_chunk)
    row: dict[str, Any] = {"bench": "linear_ce_parts", "impl": f"fused, chunk {rows_per_chunk}",
                           "chunk_rows": rows_per_chunk, "num_chunks": num_chunks}
    chunk_flops = 2 * rows_per_chunk * v * hidden.shape[1]
    for name, fn in stages.items():
        fn()  # the kernel turns logits into dlogits first, so every stage sees the data it sees in a real step
        ms = _median_ms(fn, config)
        row[f"{name}_ms"] = ms * num_chunks
        if name.endswith("mm"):
            row[f"{name}_tflops"] = chunk_flops / (ms * 1e-3) / 1e12
    # The kernel reads each logit twice (statistics, then gradient) and writes it once.
    row["softmax_grad_kernel_tbps"] = 3 * rows_per_chunk * v * hidden.element_size() / (
        row["softmax_grad_kernel_ms"] / num_chunks * 1e-3) / 1e12
    return row


def run_fused_bench(config: FusedBenchConfig) -> list[dict[str, Any]]:
    """Rows of every benchmark in ``config.benches``."""
    rows: list[dict[str, Any]] = []
    if "adamw" in config.benches:
        rows += bench_adamw(config)
        torch.cuda.empty_cache()
    if "linear-ce" in config.benches:
        rows += bench_linear_ce(config)
    return rows


def _latest_run(rows: Sequence[dict[str, Any]], bench: str) -> list[dict[str, Any]]:
    """Rows of ``bench`` from its most recent run (rows of one run share their provenance date)."""
    picked = [r for r in rows if r.get("bench") == bench]
    latest = max((r.get("date", "") for r in picked), default="")
    return [r for r in picked if r.get("date", "") == latest]


def fused_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The writeup's tables from the latest run of each benchmark: AdamW, linear + cross-entropy, its stages."""
    parts = []
    adamw = _latest_run(rows, "adamw")
    if adamw:
        p = adamw[0]
        parts.append(
            f"AdamW step, {p['num_params'] / 1e9:g}e9 fp32 params in {p['num_tensors']} tensors, one GPU of "
            f"{p['device']}; "
            f"bytes floor {p['floor_ms']:.2f} ms (28 B/param at 4.24 TB/s); copy measured in the same run at "
            f"{p['copy_tbps']:.2f} TB/s.\n\n"
            + markdown_table(adamw, list(zip(
                ["impl", "median_ms", "speedup_vs_torch_fused", "floor_fraction", "achieved_tbps"],
                ["implementation", "median (ms)", "vs torch fused", "floor / time", "TB/s moved"], strict=True)))
        )
    ce = _latest_run(rows, "linear_ce")
    if ce:
        p = ce[0]
        parts.append(
            f"LM head + cross-entropy fwd+bwd, {p['tokens']} tokens x d {p['d_model']} x vocab {p['vocab_size']}, "
            f"{p['dtype']}, one GPU of {p['device']}; matmul floor {p['matmul_floor_ms']:.0f} ms "
            "(3 products at 772 TFLOP/s).\n\n"
            + markdown_table(ce, list(zip(
                ["impl", "median_ms", "speedup_vs_torch", "floor_fraction", "extra_gib", "loss_rel_err",
                 "grad_hidden_rel_err", "grad_weight_rel_err"],
                ["implementation", "median (ms)", "vs plain torch", "floor / time", "peak above inputs+grads (GiB)",
                 "loss rel. err", "grad h rel. err", "grad W rel. err"], strict=True)))
        )
    for p in _latest_run(rows, "linear_ce_parts"):
        stages = [
            {"stage": name.replace("_", " "), "ms": p[f"{name}_ms"],
             "rate": f"{p[name + '_tflops']:.0f} TFLOP/s" if name.endswith("mm")
             else f"{p['softmax_grad_kernel_tbps']:.2f} TB/s"}
            for name in ("logits_mm", "softmax_grad_kernel", "grad_hidden_mm", "grad_weight_addmm")
        ]
        parts.append(
            f"Fused stages, {p['num_chunks']} chunks of {p['chunk_rows']} tokens (one chunk timed, times the count)."
            "\n\n" + markdown_table(stages, [("stage", "stage"), ("ms", "total (ms)"), ("rate", "rate")])
        )
    return "\n\n".join(parts)
