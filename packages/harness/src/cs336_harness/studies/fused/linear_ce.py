"""``cs336 fused --bench linear-ce`` (b): LM head + cross-entropy, forward and backward: fused_linear_cross_entropy vs
plain PyTorch (F.linear + F.cross_entropy, cs336_kernels' reference), Liger-Kernel's and Cut Cross-Entropy's fused
losses where they import (a row saying why otherwise), in bfloat16. Median time, and peak memory above the inputs
and their gradients (max_memory_allocated during one fwd+bwd minus what was allocated before it, minus the
gradients' bytes). The matmul floor counts three (N x V x d) products, forward logits and the two gradients, at 772
TFLOP/s (:data:`cs336_harness.device.H200_BF16_MATMUL_FLOPS`):

    matmul_floor_ms = 3 * 2 * N * V * d / 772e12 * 1e3

Each row also carries the relative error of its loss against an fp32 reference (the logits in fp32,
chunk by chunk) and of our gradients against plain PyTorch's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from cs336_kernels import fused_linear_cross_entropy, linear_cross_entropy_reference
from cs336_kernels.ops.fused_linear_cross_entropy import chunk_rows, softmax_grad_inplace

from cs336_harness.device import GIB, H200_BF16_MATMUL_FLOPS
from cs336_harness.studies.fused.common import liger_functional, median_ms, rel_err
from cs336_harness.studies.fused.config import FusedBenchConfig

IGNORE_INDEX = -100


def _fp32_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 4096) -> float:
    """Mean cross-entropy of fp32 logits, a chunk of tokens at a time, summed in float64."""
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start:start + chunk].float(), weight.float())
            total += F.cross_entropy(logits, targets[start:start + chunk], ignore_index=IGNORE_INDEX,
                                     reduction="sum").double()
    return (total / (targets != IGNORE_INDEX).sum()).item()


def bench_linear_ce(config: FusedBenchConfig) -> list[dict[str, Any]]:
    """Forward + backward of the LM head and loss, fused vs plain PyTorch, in bfloat16."""
    n, d, v = config.tokens, config.d_model, config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, d, device="cuda", generator=gen) / d**0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    grads_bytes = hidden.nbytes + weight.nbytes
    matmul_floor_ms = 3 * 2 * n * v * d / H200_BF16_MATMUL_FLOPS * 1e3
    default_rows = chunk_rows(n, v, hidden.element_size(), None)
    impls: dict[str, Callable[..., torch.Tensor]] = {f"fused (ours), chunk {default_rows}": fused_linear_cross_entropy}
    for rows_per_chunk in config.extra_chunk_sizes:
        impls[f"fused, chunk {rows_per_chunk}"] = functools.partial(fused_linear_cross_entropy,
                                                                    chunk_size=rows_per_chunk)
    impls["plain torch"] = linear_cross_entropy_reference
    others, missing = _other_linear_ce()
    impls.update(others)
    loss_fp32 = _fp32_loss(hidden.detach(), weight.detach(), targets)
    rows, results = [], {}
    for name, loss_fn in impls.items():
        def step(loss_fn=loss_fn) -> torch.Tensor:
            loss = loss_fn(hidden, weight, targets, "mean", IGNORE_INDEX)
            loss.backward()
            return loss.detach()

        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = step()
        torch.cuda.synchronize()
        extra_gib = (torch.cuda.max_memory_allocated() - before - grads_bytes) / GIB
        results[name] = (loss, hidden.grad, weight.grad)
        hidden.grad = weight.grad = None
        ms = median_ms(step, config, grad_to_none=(hidden, weight))
        rows.append({
            "bench": "linear_ce", "impl": name, "tokens": n, "d_model": d, "vocab_size": v, "dtype": "bf16",
            "median_ms": ms, "matmul_floor_ms": matmul_floor_ms, "floor_fraction": matmul_floor_ms / ms,
            "extra_gib": extra_gib, "loss": loss.item(), "loss_dtype": str(loss.dtype).removeprefix("torch."),
            "loss_rel_err": abs(loss.item() - loss_fp32) / loss_fp32,
        })
    ref = results["plain torch"]
    torch_ms = next(r["median_ms"] for r in rows if r["impl"] == "plain torch")
    for r in rows:
        if "median_ms" not in r:
            continue
        r["speedup_vs_torch"] = torch_ms / r["median_ms"]
        if r["impl"] != "plain torch":
            ours = results[r["impl"]]
            r.update(grad_hidden_rel_err=rel_err(ours[1], ref[1]), grad_weight_rel_err=rel_err(ours[2], ref[2]))
    del results
    shape = {"tokens": n, "d_model": d, "vocab_size": v, "dtype": "bf16"}
    rows += [{"bench": "linear_ce", "impl": name, **shape, "note": why} for name, why in missing.items()]
    return rows + [_linear_ce_parts(hidden.detach(), weight.detach(), targets, default_rows, config)]


def _other_linear_ce() -> tuple[dict[str, Callable[..., torch.Tensor]], dict[str, str]]:
    """Liger-Kernel's and Cut Cross-Entropy's fused LM head + loss, called as ours is (hidden, weight, targets,
    reduction, ignore_index), where they import; and for each that does not, why."""
    impls: dict[str, Callable[..., torch.Tensor]] = {}
    missing: dict[str, str] = {}
    liger, why_not = liger_functional()
    if liger is None:
        missing["Liger-Kernel"] = why_not
    else:
        impls["Liger-Kernel"] = lambda h, w, t, reduction, ignore_index: liger.liger_fused_linear_cross_entropy(
            h, w, t, ignore_index=ignore_index, reduction=reduction)
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as e:  # noqa: BLE001 (any import failure means: no CCE row)
        missing["Cut Cross-Entropy"] = f"cut_cross_entropy is not importable: {type(e).__name__}: {e}"
    else:
        impls["Cut Cross-Entropy"] = lambda h, w, t, reduction, ignore_index: linear_cross_entropy(
            h, w, t, ignore_index=ignore_index, reduction=reduction)
    return impls, missing


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
                                                            IGNORE_INDEX, True),
        "grad_hidden_mm": lambda: torch.mm(logits, weight, out=grad_hidden),
        "grad_weight_addmm": lambda: grad_weight.addmm_(logits.t(), h),
    }
    num_chunks = -(-n // rows_per_chunk)
    row: dict[str, Any] = {"bench": "linear_ce_parts", "impl": f"fused, chunk {rows_per_chunk}",
                           "chunk_rows": rows_per_chunk, "num_chunks": num_chunks}
    chunk_flops = 2 * rows_per_chunk * v * hidden.shape[1]
    for name, fn in stages.items():
        fn()  # the kernel turns logits into dlogits first, so every stage sees the data it sees in a real step
        ms = median_ms(fn, config)
        row[f"{name}_ms"] = ms * num_chunks
        if name.endswith("mm"):
            row[f"{name}_tflops"] = chunk_flops / (ms * 1e-3) / 1e12
    # The kernel reads each logit twice (statistics, then gradient) and writes it once.
    row["softmax_grad_kernel_tbps"] = 3 * rows_per_chunk * v * hidden.element_size() / (
        row["softmax_grad_kernel_ms"] / num_chunks * 1e-3) / 1e12
    return row
