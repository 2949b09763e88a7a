"""``cs336 fused --bench rms-norm|add-rms-norm|rope|swiglu`` (c): the glue of a Transformer block at the leaderboard
shapes, bf16, forward + backward, against the bandwidth a plain copy reaches in the same process: RMSNorm (tokens x
d_model, bf16 weight as FSDP hands it over), the block's first residual add folded into its second RMSNorm
(h = x + delta and rms_norm(h), tokens x d_model, with h's gradient from the residual path), RoPE on q and k
((1, tokens, heads, head_dim) views of the projections) and SwiGLU's silu(a) * b (tokens x d_ff).

Implementations (``impl``): ours (cs336_kernels), torch.compile of the same PyTorch reference the tests use, the
eager model code (cs336_basics' RMSNorm and RotaryEmbedding modules, the block's add then RMSNorm, SwiGLU's
expression), Liger-Kernel's op when ``liger_kernel`` imports and QuACK's (``quack.rmsnorm.rmsnorm``, with
``residual=x, prenorm=True`` for the add; ``quack.rotary.apply_rotary_emb`` with interleaved pairs) when it imports
(a row saying why otherwise; QuACK has no SwiGLU op of its own: it runs SwiGLU in a GEMM's epilogue), and ``copy``:
``torch.Tensor.copy_`` of a buffer of half the op's bytes, which reads and writes as many bytes as the op must move.

Every timed callable is measured ``repeats`` times (each a ``triton.testing.do_bench`` median, L2 flushed between
calls), round-robin over the implementations so that drift of the clocks meets all of them alike. Each row:

    part          "fwd+bwd" (the implementations), or one part of ours timed alone (below)
    ms            the median of the repeats' medians; ms_calls: every repeat's median; max_over_min: their spread
    graph_ms      the same from CUDA-graph replays (graph_ms_calls, graph_max_over_min, graph_gbps, graph_vs_copy
                  against the copy's do_bench rate, as a copy captured in a graph becomes a memcpy node, which ran
                  at 2.7 TB/s at some sizes): the GPU's time alone. A forward + backward through autograd issues
                  its kernels more slowly than they run at these sizes, so ``ms`` then measures the host; in a
                  training step the GPU is busy with the GEMMs meanwhile and only the GPU time counts
    gbps          bytes that must move / ms; copy_gbps: the same bytes / the copy's ms (the copy row of that part);
                  vs_copy = gbps / copy_gbps
    extra_gib     the peak memory of one forward + backward above inputs, upstream gradients and the inputs'
                  gradients (negative where an implementation writes gradients into its inputs, as Liger's SiLU-mul
                  and RoPE do, or hands two inputs one gradient tensor, as QuACK's add does)
    speedup_vs_eager, out_rel_err_vs_eager   against the model code (the forward's relative difference)

Bytes that must move, forward + backward (N tokens, e bytes per element, e_w of the weight):

    rms_norm:  5 * N * d * e + 8 * N + 3 * d * e_w        x, y, dy, x again, dx; rstd; w twice, dw
    add_rms_norm:  8 * N * d * e + 8 * N + 3 * d * e_w    x, delta, h, y; dy, dh, h again, dx (one gradient
                                                          for x and delta); rstd; w twice, dw
    rope:      4 * (q.numel() + k.numel()) * e + 8 * N * D + 16 * N
                                                          q, k in and out twice; cos, sin rows and
                                                          int64 positions, once per pass
    silu_mul:  8 * N * d_ff * e                           a, b, out; dout, a, b, da, db

The norms' parts, ours alone (``a`` = 1 with the add folded in, P the backward's programs):

    fwd             (2 + 2a) * N * d * e + 4 * N + d * e_w             x (and delta) in, y (and h) out, rstd, w
    bwd             (3 + a) * N * d * e + 4 * N + 2 * d * e_w           x (h), dy (and dh) in, dx out, rstd, w, dw
    bwd kernel      (3 + a) * N * d * e + 4 * N + d * e_w + 4 * P * d   the same without dw, with the partial sums
    dw reduction    4 * P * d + d * e_w                                 the partial sums in, dw out

so the weight gradient's reduction is measured alone, beside a copy of its own (small, latency-bound) size.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
from cs336_kernels.ops.rms_norm import (
    reduce_weight_grad,
    rms_norm_backward,
    rms_norm_backward_rows,
    rms_norm_forward,
)

from cs336_harness.device import GIB
from cs336_harness.studies.fused.common import (
    copy_step,
    free_cached_memory,
    graph_median_ms,
    median_ms,
    peer_module,
    rel_err,
)
from cs336_harness.studies.fused.config import FusedBenchConfig

GLUE_OPS = {"rms-norm": "rms_norm", "add-rms-norm": "add_rms_norm", "rope": "rope", "swiglu": "silu_mul"}
Peer = tuple[Any, str | None]  # a peer library's module, or None and why it cannot be used
NO_QUACK_SWIGLU = "QuACK has no SwiGLU op of its own (it runs SwiGLU in a GEMM's epilogue)"
EPS = 1e-5


@dataclass(frozen=True)
class GlueImpl:
    """One implementation of an op: ``run()`` is its forward on fixed inputs; ``upstream`` are the gradients of
    its outputs; the backward fills ``leaves[i].grad``. ``note`` says what the row should know about it."""

    run: Callable[[], tuple[torch.Tensor, ...]]
    upstream: tuple[torch.Tensor, ...]
    leaves: tuple[torch.Tensor, ...]
    note: str | None = None
    compare: bool = True  # False where the outputs are not the eager module's (another pairing convention)


@dataclass(frozen=True)
class GluePart:
    """One part of our op timed alone: ``run()`` launches it on fixed inputs; ``nbytes`` is the traffic it must
    make."""

    run: Callable[[], Any]
    nbytes: int


@dataclass(frozen=True)
class GlueCase:
    """An op's inputs at one shape: its implementations (or why one is missing), the bytes its forward + backward
    must move, and the parts of ours that are timed alone."""

    shape: str
    nbytes: int
    impls: dict[str, GlueImpl | str]
    parts: dict[str, GluePart] = field(default_factory=dict)


def _leaf(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, device=gen.device, generator=gen).bfloat16().requires_grad_()


def _fresh_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _peer_impl(peer: Peer, make: Callable[[Any], GlueImpl]) -> GlueImpl | str:
    """``make(module)`` where the peer imports, else the reason it does not."""
    module, why_not = peer
    return make(module) if module is not None else str(why_not)


def norm_parts(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, delta: torch.Tensor | None = None,
               dh: torch.Tensor | None = None) -> dict[str, GluePart]:
    """Our RMSNorm's forward, backward, backward kernel and weight-gradient reduction on (rows, d) inputs (with
    ``delta`` and ``dh``: the add folded in), each alone, with the bytes it must move (module docstring)."""
    x, weight = x.detach(), weight.detach()
    delta = None if delta is None else delta.detach()
    rows, d = x.shape
    e, e_w, add = x.element_size(), weight.element_size(), int(delta is not None)
    _, rstd, h = rms_norm_forward(x, weight, EPS, delta)
    saved = x if h is None else h
    _, partial = rms_norm_backward_rows(dy, saved, weight, rstd, dh)
    partial_bytes = partial.numel() * partial.element_size()
    return {
        "fwd": GluePart(lambda: rms_norm_forward(x, weight, EPS, delta),
                        (2 + 2 * add) * rows * d * e + 4 * rows + d * e_w),
        "bwd": GluePart(lambda: rms_norm_backward(dy, saved, weight, rstd, dh),
                        (3 + add) * rows * d * e + 4 * rows + 2 * d * e_w),
        "bwd kernel": GluePart(lambda: rms_norm_backward_rows(dy, saved, weight, rstd, dh),
                               (3 + add) * rows * d * e + 4 * rows + d * e_w + partial_bytes),
        "dw reduction": GluePart(lambda: reduce_weight_grad(partial, weight.dtype), partial_bytes + d * e_w),
    }


def rms_norm_case(n: int, d: int, liger: Peer, quack: Peer, device: str = "cuda") -> GlueCase:
    """x (n, d) and a bf16 weight; ``liger`` is Liger's functional module, ``quack`` QuACK's ``quack.rmsnorm``."""
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
        # Its "gemma" casting is our numerics (fp32 throughout, the weight too); it writes dx into dy.
        "liger": _peer_impl(liger, lambda m: GlueImpl(
            lambda: (m.liger_rms_norm(x, w, EPS, casting_mode="gemma"),), (dy.clone(),), (x, w),
            note="casting_mode='gemma'; backward writes dx into dy")),
        "quack": _peer_impl(quack, lambda m: GlueImpl(lambda: (m.rmsnorm(x, w, eps=EPS),), (dy.clone(),), (x, w))),
    }
    nbytes = 5 * n * d * x.element_size() + 8 * n + 3 * d * w.element_size()
    return GlueCase(f"{n}x{d}", nbytes, impls, norm_parts(x, w, dy))


def add_rms_norm_case(n: int, d: int, liger: Peer, quack: Peer, device: str = "cuda") -> GlueCase:
    """The residual stream x (n, d), the attention's output delta added to it, and a bf16 weight. Outputs are
    (y, h), so the row's forward difference is the norm's. Only x is a leaf that takes a gradient: in the model x
    and delta are both made by earlier ops, and the one gradient tensor of h flows to both without a copy, but two
    leaves given the same tensor make autograd copy it for one of them (a pass over n x d that the model never
    makes)."""
    gen = torch.Generator(device=device).manual_seed(4)
    x, delta = _leaf((n, d), gen), _leaf((n, d), gen).detach()
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
        "ours": GlueImpl(lambda: add_rms_norm(x, delta, w)[::-1], (dy, dh), (x, w)),
        "torch_compile": GlueImpl(lambda: compiled(x, delta, w)[::-1], (dy, dh), (x, w)),
        "eager": GlueImpl(eager, (dy, dh), (x, module.weight)),
        # Its (y, residual sum) with the "gemma" casting (fp32 throughout); its backward adds dh to the norm's
        # gradient before the one rounding (autograd rounds each) and writes dx into dy.
        "liger": _peer_impl(liger, lambda m: GlueImpl(
            lambda: m.liger_fused_add_rms_norm(x, delta, w, EPS, casting_mode="gemma"), (dy.clone(), dh),
            (x, w), note="casting_mode='gemma'; dx + dh rounded once; backward writes dx into dy")),
        # The pre-norm residual: rmsnorm(delta, residual=x, prenorm=True) returns (y, x + delta); its backward
        # hands x and delta one gradient tensor.
        "quack": _peer_impl(quack, lambda m: GlueImpl(
            lambda: m.rmsnorm(delta, w, residual=x, prenorm=True, eps=EPS), (dy.clone(), dh.clone()),
            (x, w), note="residual=x, prenorm=True")),
    }
    nbytes = 8 * n * d * x.element_size() + 8 * n + 3 * d * w.element_size()
    return GlueCase(f"{n}x{d}", nbytes, impls, norm_parts(x, w, dy, delta, dh))


def rope_case(n: int, d_model: int, heads: int, liger: Peer, quack: Peer, device: str = "cuda") -> GlueCase:
    """q, k as (1, n, heads, head_dim) views of (1, n, d_model) projections, positions 0..n-1; ``quack`` is QuACK's
    ``quack.rotary``."""
    head_dim = d_model // heads
    gen = torch.Generator(device=device).manual_seed(2)
    q_proj, k_proj = _leaf((1, n, d_model), gen), _leaf((1, n, d_model), gen)

    def heads_of(*projections: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # (1, N, H, Dh) views, taken inside each timed call: autograd runs a node's backward on the stream its
        # forward ran on, so a view taken once outside would run its backward on the default stream, which a
        # CUDA-graph capture on another stream cannot include.
        return tuple(t.view(1, n, heads, head_dim) for t in projections)

    dq, dk = (torch.randn(1, n, heads, head_dim, device=device, generator=gen).bfloat16() for _ in range(2))
    module = RotaryEmbedding(n, head_dim, device=device)
    positions = torch.arange(n, device=device)
    cos, sin = module.cos, module.sin  # (N, Dh / 2) fp32
    compiled = torch.compile(rope_reference)

    def eager() -> tuple[torch.Tensor, ...]:
        # The model rotates (batch, heads, seq, head_dim) views; transposing back is free.
        return tuple(module(t.transpose(1, 2), positions).transpose(1, 2) for t in heads_of(q_proj, k_proj))

    def liger_impl(m: Any) -> GlueImpl:
        # Liger follows Hugging Face: it rotates the halves (x[i], x[i + Dh/2]) with full-width (1, N, Dh) tables,
        # in place in copies of its (batch, heads, seq, Dh) inputs; same traffic, another pairing.
        lq, lk = _fresh_leaf(q_proj), _fresh_leaf(k_proj)
        cos_full, sin_full = (torch.cat((t, t), dim=-1)[None] for t in (cos, sin))

        def liger_rope() -> tuple[torch.Tensor, ...]:
            views = (t.transpose(1, 2) for t in heads_of(lq, lk))
            return tuple(out.transpose(1, 2) for out in m.liger_rope(*views, cos_full, sin_full))

        return GlueImpl(liger_rope, (dq.clone(), dk.clone()), (lq, lk), compare=False,
                        note="rotates halves (Hugging Face convention), not interleaved pairs")

    impls: dict[str, GlueImpl | str] = {
        "ours": GlueImpl(lambda: rope(*heads_of(q_proj, k_proj), cos, sin, positions), (dq, dk), (q_proj, k_proj)),
        "torch_compile": GlueImpl(lambda: compiled(*heads_of(q_proj, k_proj), cos, sin, positions), (dq, dk),
                                  (q_proj, k_proj)),
        "eager": GlueImpl(eager, (dq, dk), (q_proj, k_proj)),
        "liger": _peer_impl(liger, liger_impl),
        # Interleaved pairs with (N, Dh / 2) tables: our convention; one call for q, one for k.
        "quack": _peer_impl(quack, lambda m: GlueImpl(
            lambda: tuple(m.apply_rotary_emb(t, cos, sin, interleaved=True) for t in heads_of(q_proj, k_proj)),
            (dq, dk), (q_proj, k_proj), note="interleaved=True, q and k in two calls")),
    }
    nbytes = 4 * (q_proj.numel() + k_proj.numel()) * q_proj.element_size() + 8 * n * head_dim + 16 * n
    return GlueCase(f"1x{n}x{heads}x{head_dim}", nbytes, impls)


def swiglu_case(n: int, d_ff: int, liger: Peer, device: str = "cuda") -> GlueCase:
    """a = w1 x and b = w3 x as (n, d_ff)."""
    gen = torch.Generator(device=device).manual_seed(3)
    a, b = _leaf((n, d_ff), gen), _leaf((n, d_ff), gen)
    g = torch.randn(n, d_ff, device=device, generator=gen).bfloat16()
    compiled = torch.compile(silu_mul_reference)

    def liger_impl(m: Any) -> GlueImpl:
        # Liger's backward writes da and db into its saved inputs: give it its own copies.
        la, lb = _fresh_leaf(a), _fresh_leaf(b)
        return GlueImpl(lambda: (m.liger_swiglu(la, lb),), (g,), (la, lb), note="backward writes da, db into a, b")

    impls: dict[str, GlueImpl | str] = {
        "ours": GlueImpl(lambda: (silu_mul(a, b),), (g,), (a, b)),
        "torch_compile": GlueImpl(lambda: (compiled(a, b),), (g,), (a, b)),
        "eager": GlueImpl(lambda: (silu_mul_reference(a, b),), (g,), (a, b), note="SwiGLU's expression"),
        "liger": _peer_impl(liger, liger_impl),
        "quack": NO_QUACK_SWIGLU,
    }
    return GlueCase(f"{n}x{d_ff}", 8 * a.numel() * a.element_size(), impls)


def _peers() -> dict[str, Peer]:
    return {name: peer_module(name) for name in ("liger_kernel.transformers.functional", "quack.rmsnorm",
                                                 "quack.rotary")}


_GLUE_CASES: dict[str, Callable[[FusedBenchConfig, dict[str, Peer]], GlueCase]] = {
    "rms-norm": lambda c, p: rms_norm_case(c.tokens, c.d_model, p["liger_kernel.transformers.functional"],
                                           p["quack.rmsnorm"]),
    "add-rms-norm": lambda c, p: add_rms_norm_case(c.tokens, c.d_model, p["liger_kernel.transformers.functional"],
                                                   p["quack.rmsnorm"]),
    "rope": lambda c, p: rope_case(c.tokens, c.d_model, c.num_heads, p["liger_kernel.transformers.functional"],
                                   p["quack.rotary"]),
    "swiglu": lambda c, p: swiglu_case(c.tokens, c.d_ff, p["liger_kernel.transformers.functional"]),
}


def glue_step(impl: GlueImpl) -> None:
    """One forward + backward of ``impl``."""
    torch.autograd.backward(impl.run(), impl.upstream)


def _first_call(impl: GlueImpl) -> dict[str, Any]:
    """Forward output and the peak memory above inputs and gradients of one forward + backward (after one that
    compiles what the implementation compiles)."""
    with torch.no_grad():
        first = impl.run()[0].detach().clone()
    glue_step(impl)
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
    return {"extra_gib": extra_gib, "first": first}


@dataclass(frozen=True)
class _Timed:
    """One callable of the round-robin: its row so far, what it runs, the gradients do_bench resets."""

    row: dict[str, Any]
    fn: Callable[[], Any]
    nbytes: int
    leaves: tuple[torch.Tensor, ...] = ()
    graph: bool = True  # also timed from CUDA-graph replays


def _time_round_robin(timed: Sequence[_Timed], config: FusedBenchConfig) -> None:
    """``config.repeats`` do_bench medians and CUDA-graph medians of every callable (do_bench's alone for those
    with ``graph`` False), taken in turns; each row gets ms (the median of the repeats), ms_calls, max_over_min and
    gbps, and the same prefixed ``graph_`` (or ``graph_error`` where the callable cannot be captured); a callable
    that fails gets ``error`` and no times, and the others go on."""
    calls: list[list[float]] = [[] for _ in timed]
    graph_calls: list[list[float]] = [[] for _ in timed]
    for _ in range(config.repeats):
        for t, ms, graph_ms in zip(timed, calls, graph_calls, strict=True):
            if "error" in t.row:
                continue
            try:
                ms.append(median_ms(t.fn, config, grad_to_none=t.leaves))
            except Exception as e:  # noqa: BLE001 (one failing callable must not lose the other rows)
                print(f"cs336 fused: {t.row['op']} {t.row['impl']} ({t.row['part']}) failed: {type(e).__name__}: "
                      f"{e}", file=sys.stderr)
                t.row["error"] = f"{type(e).__name__}: {e}"
                ms.clear()
                graph_ms.clear()
                free_cached_memory()
                continue
            if not t.graph or "graph_error" in t.row:
                continue
            try:
                graph_ms.append(graph_median_ms(t.fn, config, grad_to_none=t.leaves))
            except Exception as e:  # noqa: BLE001 (a callable that cannot be captured keeps its do_bench times)
                t.row["graph_error"] = f"{type(e).__name__}: {e}"
    for t, ms, graph_ms in zip(timed, calls, graph_calls, strict=True):
        for prefix, times in (("", ms), ("graph_", graph_ms)):
            if times:
                median = statistics.median(times)
                t.row.update({f"{prefix}ms": median, f"{prefix}ms_calls": times,
                              f"{prefix}max_over_min": max(times) / min(times),
                              f"{prefix}gbps": t.nbytes / (median * 1e-3) / 1e9})


def bench_glue(op: str, config: FusedBenchConfig) -> list[dict[str, Any]]:
    """Rows of one glue op (``rms-norm``, ``add-rms-norm``, ``rope`` or ``swiglu``): every implementation and the
    copy, forward + backward, and the parts of ours timed alone, each beside a copy of its bytes."""
    case = _GLUE_CASES[op](config, _peers())
    base = {"bench": "glue", "op": GLUE_OPS[op], "shape": case.shape, "dtype": "bf16"}
    rows: list[dict[str, Any]] = []
    timed: list[_Timed] = []
    outputs = {}
    for name, impl in case.impls.items():
        row: dict[str, Any] = {**base, "part": "fwd+bwd", "impl": name, "bytes_moved": case.nbytes}
        rows.append(row)
        if isinstance(impl, str):
            row["note"] = impl
            continue
        if impl.note:
            row["note"] = impl.note
        try:
            first = _first_call(impl)
        except Exception as e:  # noqa: BLE001 (one failing implementation must not lose the other rows)
            print(f"cs336 fused: {op} {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            row["error"] = f"{type(e).__name__}: {e}"
            free_cached_memory()
            continue
        if impl.compare:
            outputs[name] = first["first"]
        row["extra_gib"] = first["extra_gib"]
        timed.append(_Timed(row, lambda impl=impl: glue_step(impl), case.nbytes, impl.leaves))
    copies = {"fwd+bwd": case.nbytes} | {part: p.nbytes for part, p in case.parts.items()}
    for part, nbytes in copies.items():
        row = {**base, "part": part, "impl": "copy", "bytes_moved": nbytes}
        rows.append(row)
        timed.append(_Timed(row, copy_step(nbytes), nbytes, graph=False))
    for part, p in case.parts.items():
        row = {**base, "part": part, "impl": "ours", "bytes_moved": p.nbytes}
        rows.append(row)
        p.run()  # compiles the launch outside the timing
        timed.append(_Timed(row, p.run, p.nbytes))
    _time_round_robin(timed, config)
    copy_gbps = {r["part"]: r["gbps"] for r in rows if r["impl"] == "copy"}
    eager = next((r for r in rows if r["impl"] == "eager" and "ms" in r), None)
    for r in rows:
        if "ms" not in r:
            continue
        r["copy_gbps"] = copy_gbps[r["part"]]
        r["vs_copy"] = r["gbps"] / r["copy_gbps"]
        if "graph_gbps" in r:
            r["graph_vs_copy"] = r["graph_gbps"] / r["copy_gbps"]
        if eager is not None and r["part"] == "fwd+bwd":
            r["speedup_vs_eager"] = eager["ms"] / r["ms"]
        if "eager" in outputs and r["impl"] in outputs and r["part"] == "fwd+bwd":
            r["out_rel_err_vs_eager"] = rel_err(outputs[r["impl"]], outputs["eager"])
    return rows
