"""``cs336 fused --bench rms-norm|add-rms-norm|rope|swiglu`` (c): the glue of a Transformer block at the leaderboard
shapes, bf16, forward + backward: RMSNorm (tokens x d_model, bf16 weight as FSDP hands it over), the block's first
residual add folded into its second RMSNorm (h = x + delta and rms_norm(h), tokens x d_model, with h's gradient from
the residual path), RoPE on q and k ((1, tokens, heads, head_dim) views of the projections) and SwiGLU's silu(a) * b
(tokens x d_ff). Implementations: ours (cs336_kernels), torch.compile of the same PyTorch reference the tests use,
the eager model code (cs336_basics' RMSNorm and RotaryEmbedding modules, the block's add then RMSNorm, SwiGLU's
expression), and Liger-Kernel's op when ``liger_kernel`` imports (a row saying why otherwise). Each row: do_bench
median of forward + backward, GB/s from the bytes the op must move, the peak memory above inputs, upstream gradients
and the inputs' gradients (negative where an implementation writes gradients into its inputs, as Liger's SiLU-mul
and RoPE do), and the forward's relative difference from the eager output. Bytes that must move, forward + backward
(N tokens, e bytes per element):

    rms_norm:  5 * N * d * e + 8 * N + 3 * d * e_w        x, y, dy, x again, dx; rstd; w twice, dw
    add_rms_norm:  8 * N * d * e + 8 * N + 3 * d * e_w    x, delta, h, y; dy, dh, h again, dx (one gradient
                                                          for x and delta); rstd; w twice, dw
    rope:      4 * (q.numel() + k.numel()) * e + 8 * N * D + 16 * N
                                                          q, k in and out twice; cos, sin rows and
                                                          int64 positions, once per pass
    silu_mul:  8 * N * d_ff * e                           a, b, out; dout, a, b, da, db
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from cs336_basics.model import RMSNorm, RotaryEmbedding
from cs336_kernels import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
    rope,
    rope_reference,
    silu_mul,
    silu_mul_reference,
)

from cs336_harness.device import GIB
from cs336_harness.studies.fused.common import liger_functional, median_ms, rel_err
from cs336_harness.studies.fused.config import FusedBenchConfig

GLUE_OPS = {"rms-norm": "rms_norm", "add-rms-norm": "add_rms_norm", "rope": "rope", "swiglu": "silu_mul"}


@dataclass(frozen=True)
class GlueImpl:
    """One implementation of an op: ``run()`` is its forward on fixed inputs; ``upstream`` are the gradients of
    its outputs; the backward fills ``leaves[i].grad``. ``note`` says what the row should know about it."""

    run: Callable[[], tuple[torch.Tensor, ...]]
    upstream: tuple[torch.Tensor, ...]
    leaves: tuple[torch.Tensor, ...]
    note: str | None = None
    compare: bool = True  # False where the outputs are not the eager module's (another pairing convention)


def _leaf(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, device=gen.device, generator=gen).bfloat16().requires_grad_()


def _fresh_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


GlueCase = tuple[str, int, dict[str, GlueImpl | str]]  # shape, bytes that must move, implementations


def rms_norm_case(n: int, d: int, liger: Any, device: str = "cuda") -> GlueCase:
    """x (n, d) and a bf16 weight; ``liger`` is Liger's functional module or None."""
    gen = torch.Generator(device=device).manual_seed(1)
    x = _leaf((n, d), gen)
    w = (1 + 0.1 * torch.randn(d, device=device, generator=gen)).bfloat16().requires_grad_()
    dy = torch.randn(n, d, device=device, generator=gen).bfloat16()
    module = RMSNorm(d, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
    compiled = torch.compile(rms_norm_reference)
    impls: dict[str, GlueImpl | str] = {
        "ours": GlueImpl(lambda: (rms_norm(x, w),), (dy,), (x, w)),
        "torch_compile": GlueImpl(lambda: (compiled(x, w),), (dy,), (x, w)),
        "eager": GlueImpl(lambda: (module(x),), (dy,), (x, module.weight)),
    }
    if liger is None:
        impls["liger"] = "skipped"
    else:
        # Its "gemma" casting is our numerics (fp32 throughout, the weight too); it writes dx into dy.
        impls["liger"] = GlueImpl(lambda: (liger.liger_rms_norm(x, w, 1e-5, casting_mode="gemma"),), (dy.clone(),),
                                  (x, w), note="casting_mode='gemma'; backward writes dx into dy")
    nbytes = 5 * n * d * x.element_size() + 8 * n + 3 * d * w.element_size()
    return f"{n}x{d}", nbytes, impls


def add_rms_norm_case(n: int, d: int, liger: Any, device: str = "cuda") -> GlueCase:
    """The residual stream x (n, d), the attention's output delta added to it, and a bf16 weight. Outputs are
    (y, h), so the row's forward difference is the norm's."""
    gen = torch.Generator(device=device).manual_seed(4)
    x, delta = _leaf((n, d), gen), _leaf((n, d), gen)
    w = (1 + 0.1 * torch.randn(d, device=device, generator=gen)).bfloat16().requires_grad_()
    dy, dh = (torch.randn(n, d, device=device, generator=gen).bfloat16() for _ in range(2))
    module = RMSNorm(d, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
    compiled = torch.compile(add_rms_norm_reference)

    def eager() -> tuple[torch.Tensor, ...]:
        h = x + delta  # the block's add, then its ln2
        return module(h), h

    impls: dict[str, GlueImpl | str] = {
        "ours": GlueImpl(lambda: add_rms_norm(x, delta, w)[::-1], (dy, dh), (x, delta, w)),
        "torch_compile": GlueImpl(lambda: compiled(x, delta, w)[::-1], (dy, dh), (x, delta, w)),
        "eager": GlueImpl(eager, (dy, dh), (x, delta, module.weight)),
    }
    if liger is None:
        impls["liger"] = "skipped"
    else:
        # Its (y, residual sum) with the "gemma" casting (fp32 throughout); its backward adds dh to the norm's
        # gradient before the one rounding (autograd rounds each) and writes dx into dy.
        impls["liger"] = GlueImpl(lambda: liger.liger_fused_add_rms_norm(x, delta, w, 1e-5, casting_mode="gemma"),
                                  (dy.clone(), dh), (x, delta, w),
                                  note="casting_mode='gemma'; dx + dh rounded once; backward writes dx into dy")
    nbytes = 8 * n * d * x.element_size() + 8 * n + 3 * d * w.element_size()
    return f"{n}x{d}", nbytes, impls


def rope_case(n: int, d_model: int, heads: int, liger: Any, device: str = "cuda") -> GlueCase:
    """q, k as (1, n, heads, head_dim) views of (1, n, d_model) projections, positions 0..n-1."""
    head_dim = d_model // heads
    gen = torch.Generator(device=device).manual_seed(2)
    q_proj, k_proj = _leaf((1, n, d_model), gen), _leaf((1, n, d_model), gen)
    q, k = q_proj.view(1, n, heads, head_dim), k_proj.view(1, n, heads, head_dim)  # (1, N, H, Dh) views
    dq, dk = (torch.randn(1, n, heads, head_dim, device=device, generator=gen).bfloat16() for _ in range(2))
    module = RotaryEmbedding(n, head_dim, device=device)
    positions = torch.arange(n, device=device)
    cos, sin = module.cos, module.sin  # (N, Dh / 2) fp32
    compiled = torch.compile(rope_reference)

    def eager() -> tuple[torch.Tensor, ...]:
        # The model rotates (batch, heads, seq, head_dim) views; transposing back is free.
        return tuple(module(t.transpose(1, 2), positions).transpose(1, 2) for t in (q, k))

    impls: dict[str, GlueImpl | str] = {
        "ours": GlueImpl(lambda: rope(q, k, cos, sin, positions), (dq, dk), (q_proj, k_proj)),
        "torch_compile": GlueImpl(lambda: compiled(q, k, cos, sin, positions), (dq, dk), (q_proj, k_proj)),
        "eager": GlueImpl(eager, (dq, dk), (q_proj, k_proj)),
    }
    if liger is None:
        impls["liger"] = "skipped"
    else:
        # Liger follows Hugging Face: it rotates the halves (x[i], x[i + Dh/2]) with full-width (1, N, Dh) tables,
        # in place in copies of its (batch, heads, seq, Dh) inputs; same traffic, another pairing.
        lq, lk = _fresh_leaf(q_proj), _fresh_leaf(k_proj)
        cos_full, sin_full = (torch.cat((t, t), dim=-1)[None] for t in (cos, sin))

        def liger_rope() -> tuple[torch.Tensor, ...]:
            views = (t.view(1, n, heads, head_dim).transpose(1, 2) for t in (lq, lk))
            return tuple(out.transpose(1, 2) for out in liger.liger_rope(*views, cos_full, sin_full))

        impls["liger"] = GlueImpl(liger_rope, (dq.clone(), dk.clone()), (lq, lk), compare=False,
                                  note="rotates halves (Hugging Face convention), not interleaved pairs")
    nbytes = 4 * (q.numel() + k.numel()) * q.element_size() + 8 * n * head_dim + 16 * n
    return f"1x{n}x{heads}x{head_dim}", nbytes, impls


def swiglu_case(n: int, d_ff: int, liger: Any, device: str = "cuda") -> GlueCase:
    """a = w1 x and b = w3 x as (n, d_ff)."""
    gen = torch.Generator(device=device).manual_seed(3)
    a, b = _leaf((n, d_ff), gen), _leaf((n, d_ff), gen)
    g = torch.randn(n, d_ff, device=device, generator=gen).bfloat16()
    compiled = torch.compile(silu_mul_reference)
    impls: dict[str, GlueImpl | str] = {
        "ours": GlueImpl(lambda: (silu_mul(a, b),), (g,), (a, b)),
        "torch_compile": GlueImpl(lambda: (compiled(a, b),), (g,), (a, b)),
        "eager": GlueImpl(lambda: (silu_mul_reference(a, b),), (g,), (a, b), note="SwiGLU's expression"),
    }
    if liger is None:
        impls["liger"] = "skipped"
    else:
        # Liger's backward writes da and db into its saved inputs: give it its own copies.
        la, lb = _fresh_leaf(a), _fresh_leaf(b)
        impls["liger"] = GlueImpl(lambda: (liger.liger_swiglu(la, lb),), (g,), (la, lb),
                                  note="backward writes da, db into a, b")
    return f"{n}x{d_ff}", 8 * a.numel() * a.element_size(), impls


_GLUE_CASES: dict[str, Callable[[FusedBenchConfig, Any], GlueCase]] = {
    "rms-norm": lambda c, liger: rms_norm_case(c.tokens, c.d_model, liger),
    "add-rms-norm": lambda c, liger: add_rms_norm_case(c.tokens, c.d_model, liger),
    "rope": lambda c, liger: rope_case(c.tokens, c.d_model, c.num_heads, liger),
    "swiglu": lambda c, liger: swiglu_case(c.tokens, c.d_ff, liger),
}


def glue_step(impl: GlueImpl) -> None:
    """One forward + backward of ``impl``."""
    torch.autograd.backward(impl.run(), impl.upstream)


def _measure_glue(impl: GlueImpl, config: FusedBenchConfig) -> dict[str, Any]:
    """Forward output, peak memory above inputs and gradients of one fwd+bwd, and the do_bench median."""
    with torch.no_grad():
        first = impl.run()[0].detach().clone()
    glue_step(impl)  # compiles (torch.compile, Triton) outside the measurements
    for leaf in impl.leaves:
        leaf.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    glue_step(impl)
    torch.cuda.synchronize()
    grads_bytes = sum(leaf.grad.nbytes for leaf in impl.leaves if leaf.grad is not None)
    extra_gib = (torch.cuda.max_memory_allocated() - before - grads_bytes) / GIB
    for leaf in impl.leaves:
        leaf.grad = None
    ms = median_ms(lambda: glue_step(impl), config, grad_to_none=impl.leaves)
    return {"median_ms": ms, "extra_gib": extra_gib, "first": first}


def bench_glue(op: str, config: FusedBenchConfig) -> list[dict[str, Any]]:
    """Rows of one glue op (``rms-norm``, ``add-rms-norm``, ``rope`` or ``swiglu``): every implementation, forward +
    backward."""
    liger, why_not = liger_functional()
    shape, nbytes, impls = _GLUE_CASES[op](config, liger)
    base = {"bench": "glue", "op": GLUE_OPS[op], "shape": shape, "dtype": "bf16", "bytes_moved": nbytes}
    rows, outputs = [], {}
    for name, impl in impls.items():
        row: dict[str, Any] = {**base, "impl": name}
        if isinstance(impl, str):
            rows.append({**row, "note": why_not})
            continue
        if impl.note:
            row["note"] = impl.note
        try:
            measured = _measure_glue(impl, config)
        except Exception as e:  # noqa: BLE001 (one failing implementation must not lose the other rows)
            print(f"cs336 fused: {op} {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            rows.append({**row, "error": f"{type(e).__name__}: {e}"})
            torch.cuda.empty_cache()
            continue
        if impl.compare:
            outputs[name] = measured.pop("first")
        else:
            measured.pop("first")
        row.update(measured, gbps=nbytes / (measured["median_ms"] * 1e-3) / 1e9)
        rows.append(row)
        torch.cuda.empty_cache()
    eager = next((r for r in rows if r["impl"] == "eager" and "median_ms" in r), None)
    for r in rows:
        if eager is not None and "median_ms" in r:
            r["speedup_vs_eager"] = eager["median_ms"] / r["median_ms"]
        if "eager" in outputs and r["impl"] in outputs:
            r["out_rel_err_vs_eager"] = rel_err(outputs[r["impl"]], outputs["eager"])
    return rows
