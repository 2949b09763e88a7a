"""Attention benchmarks (``cs336 attention``): plain PyTorch, torch.compile, FlashAttention-2, SDPA.

Parts (handout section 4):

- ``pytorch`` (pytorch_attention): the model's own ``scaled_dot_product_attention`` with a causal mask,
  batch 8, no head dimension, d x seq over ``head_dims`` x ``seq_lens``, fp32. ``passes`` forward passes are
  timed one by one (synchronising after each); then, after one more forward, the memory in use before the
  backward pass; then ``passes`` backward passes, each on a fresh forward graph and timed alone. A
  configuration that runs out of memory is recorded as a row with ``status = "oom"``.
- ``compiled`` (torch_compile a): the same with ``torch.compile(dynamic=True)`` of that function.
- ``flash`` (flash_benchmarking): ``triton.testing.do_bench`` medians, batch 1, one head, causal, every
  (dtype, d, seq) of ``flash_dtypes`` x ``flash_head_dims`` x ``flash_seq_lens``: forward, backward and
  forward+backward of our Triton FlashAttention-2, the plain PyTorch attention and torch SDPA.
- ``anchors``: (1, 32, 32768, 128) (one layer of the leaderboard model), (1, 16, 16384, 64) and
  (4, 32, 4096, 128), bf16, causal, every path of ours and the PyTorch baselines in the same process:
  ``ours`` (``flash_attention`` as it is called by default: the Gluon forward and backward on sm_90),
  ``ours_deterministic`` (the same under ``torch.use_deterministic_algorithms(True)``: the Gluon backward's dQ
  reduce-adds in a fixed order), ``triton`` (Triton forward and backward), ``gluon`` (Gluon forward and
  backward), ``sdpa`` (PyTorch's default backend, cuDNN on an H200), ``sdpa_flash`` (its FlashAttention-2
  backend), ``flex`` (FlexAttention under ``torch.compile`` with a causal block mask), and ``fa4`` and
  ``fa4_deterministic`` (FlashAttention-4's CuTe DSL kernels, ``flash_attn.cute.flash_attn_func`` of the
  ``flash-attn-4`` package, by default and with ``deterministic=True``), which take (batch, seq, heads, d) and are
  given the same tensors through transposes. Where ``flash_attn.cute`` does not import, each FA4 row has
  ``status = "skipped"`` and a ``note`` saying why; ``fa4_version`` is the package's version where known.
  ``anchor_shapes`` and ``anchor_impls`` narrow the part to some shapes and implementations. A row whose
  implementation raised has ``status = "error"`` and the exception in ``error``; the other rows still run.

Packed documents and sliding windows (``--part varlen``, ``--part window``) are
:mod:`cs336_harness.studies.attention_varlen`, which times with :func:`measure_ms` and :func:`timed_row`.

FLOPs of causal attention (two matmuls of 2*s*s*d FLOPs per head, half of the score matrix kept by the mask;
the backward pass has five such matmuls, so 2.5x the forward)::

    fwd = 4 * b * h * s^2 * d / 2        bwd = 2.5 * fwd        fwd+bwd = 3.5 * fwd

Usage::

    from cs336_harness.studies.attention import AttentionBenchConfig, run_attention_bench
    rows = run_attention_bench(AttentionBenchConfig(parts=("anchors",)))
"""

from __future__ import annotations

import importlib.metadata
import multiprocessing
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch.nn.functional as F
from cs336_basics.model import scaled_dot_product_attention
from cs336_kernels import flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from cs336_harness.analysis.tables import markdown_table
from cs336_harness.device import DTYPES, GIB, H200_BF16_MATMUL_FLOPS

PARTS: tuple[str, ...] = ("pytorch", "compiled", "flash", "anchors")
ANCHOR_SHAPES: tuple[tuple[int, int, int, int], ...] = ((1, 32, 32768, 128), (1, 16, 16384, 64), (4, 32, 4096, 128))
ANCHOR_TARGET_MS = {(1, 16, 16384, 64): 4.0}  # fwd+bwd; the 32k shape's target is 0.95x SDPA's time
# What the anchors part times and its table shows, in this order.
ANCHOR_IMPLS: tuple[str, ...] = ("ours", "ours_deterministic", "triton", "gluon", "sdpa", "sdpa_flash", "flex", "fa4",
                                  "fa4_deterministic")
# Timed under torch.use_deterministic_algorithms(True), which our backward reads when it runs (FA4 takes a flag).
DETERMINISTIC_IMPLS: tuple[str, ...] = ("ours_deterministic", "fa4_deterministic")
# FlashAttention-4, timed only where flash_attn.cute imports (it is not a dependency of this workspace).
FA4_IMPLS: tuple[str, ...] = ("fa4", "fa4_deterministic")


@dataclass(frozen=True)
class AttentionBenchConfig:
    parts: tuple[str, ...] = PARTS
    head_dims: tuple[int, ...] = (16, 32, 64, 128)
    seq_lens: tuple[int, ...] = (256, 1024, 4096, 8192, 16384)
    batch: int = 8
    passes: int = 100
    flash_dtypes: tuple[str, ...] = ("bf16", "fp32")
    flash_head_dims: tuple[int, ...] = (16, 32, 64, 128)
    flash_seq_lens: tuple[int, ...] = tuple(2**i for i in range(7, 17))
    warmup_ms: int = 10
    rep_ms: int = 50
    anchor_rep_ms: int = 1000
    anchor_shapes: tuple[tuple[int, int, int, int], ...] = ANCHOR_SHAPES
    anchor_impls: tuple[str, ...] = ANCHOR_IMPLS
    precompile_jobs: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.parts) - set(PARTS)
        if not self.parts or unknown:
            raise ValueError(f"parts must be a non-empty subset of {PARTS}, got {self.parts}")
        bad_dtypes = set(self.flash_dtypes) - set(DTYPES)
        if not self.flash_dtypes or bad_dtypes:
            raise ValueError(f"flash dtypes must be a non-empty subset of {tuple(DTYPES)}, got {self.flash_dtypes}")
        for name in ("head_dims", "seq_lens", "flash_head_dims", "flash_seq_lens"):
            values = getattr(self, name)
            if not values or min(values) <= 0:
                raise ValueError(f"{name} must be non-empty and positive, got {values}")
        if min(self.flash_head_dims) < 16 or max(self.flash_head_dims) > 256:
            raise ValueError(f"flash head dims must lie in [16, 256], got {self.flash_head_dims}")
        for name in ("batch", "passes", "warmup_ms", "rep_ms", "anchor_rep_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.precompile_jobs < 0:
            raise ValueError(f"precompile_jobs must be >= 0, got {self.precompile_jobs}")
        if not self.anchor_shapes or any(len(s) != 4 or min(s) <= 0 for s in self.anchor_shapes):
            raise ValueError(f"anchor shapes must be non-empty (batch, heads, seq, d) of positive ints, got "
                             f"{self.anchor_shapes}")
        unknown_impls = set(self.anchor_impls) - set(ANCHOR_IMPLS)
        if not self.anchor_impls or unknown_impls:
            raise ValueError(f"anchor impls must be a non-empty subset of {ANCHOR_IMPLS}, got {self.anchor_impls}")


def attention_flops(heads: int, head_dim: int, pairs: float) -> dict[str, float]:
    """FLOPs of attention over ``pairs`` (query, key) pairs per head: fwd = 4*h*pairs*d, bwd = 2.5x fwd,
    fwd+bwd = 3.5x fwd."""
    fwd = 4 * heads * pairs * head_dim
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}


def causal_attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> dict[str, float]:
    """FLOPs of causal attention: fwd = 4*b*h*s^2*d/2 (s^2/2 pairs per sequence), bwd = 2.5x fwd, fwd+bwd = 3.5x
    fwd."""
    return attention_flops(heads, head_dim, batch * seq**2 / 2)


# ---------------------------------------------------------------------------- attention implementations


def _causal_mask(seq: int, device: torch.device) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool, device=device).tril()  # True = may attend


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return scaled_dot_product_attention(q, k, v, mask)


def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def causal_mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """FlexAttention's causal ``mask_mod``: query ``q_idx`` sees the keys up to itself."""
    return q_idx >= kv_idx


def flex_attention_impl(mask_mod: Callable[..., torch.Tensor], seq: int, device: torch.device,
                        ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """FlexAttention over (b, h, s, d) tensors of ``seq`` queries and keys under ``torch.compile``, as a user runs it:
    the block mask of ``mask_mod`` built once here, outside any timing; grouped-query heads where k has fewer."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(mask_mod, None, None, seq, seq, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)  # one static build per shape, as the first shape gets
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def fa4_attention(name: str = "flash_attn_func") -> tuple[Callable[..., Any] | None, str | None]:
    """FlashAttention-4's function ``name`` of ``flash_attn.cute`` (package ``flash-attn-4``: ``flash_attn_func``,
    ``flash_attn_varlen_func``), or None and why it cannot be used."""
    try:
        return getattr(importlib.import_module("flash_attn.cute"), name), None
    except Exception as e:  # noqa: BLE001 (any import failure means: no FA4 rows)
        return None, f"flash_attn.cute is not importable: {type(e).__name__}: {e}"


def fa4_version() -> str | None:
    """The installed ``flash-attn-4`` package's version, None where it is not installed as a package."""
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


def fa4_dense(deterministic: bool = False, **knobs: Any) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                                                   torch.Tensor]:
    """Causal FlashAttention-4 (``flash_attn_func``, given ``knobs`` such as ``window_size``) over (b, h, s, d)
    tensors."""
    fa4, why_not = fa4_attention()
    if fa4 is None:
        raise RuntimeError(why_not)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # FA4 takes (batch, seq, heads, d) and returns (out, lse): the same memory, seen through transposes.
        out, _ = fa4(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                     deterministic=deterministic, **knobs)
        return out.transpose(1, 2)

    return attention


def anchor_impl(name: str, seq: int, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                                                       torch.Tensor]:
    """Causal attention over (b, h, s, d) tensors by the implementation ``name`` (of :data:`ANCHOR_IMPLS` or
    ``pytorch``); the ``*_deterministic`` ones of ours need ``torch.use_deterministic_algorithms(True)`` around the
    call, as :data:`DETERMINISTIC_IMPLS` says."""
    if name in FA4_IMPLS:
        return fa4_dense(deterministic=name == "fa4_deterministic")
    if name == "pytorch":
        mask = _causal_mask(seq, device)
        return lambda q, k, v: _plain(q, k, v, mask)
    if name == "flex":
        return flex_attention_impl(causal_mask_mod, seq, device)
    return {
        "ours": lambda q, k, v: flash_attention(q, k, v, is_causal=True),
        "ours_deterministic": lambda q, k, v: flash_attention(q, k, v, is_causal=True),
        "triton": lambda q, k, v: flash_attention(q, k, v, is_causal=True, forward="triton", backward="triton"),
        "gluon": lambda q, k, v: flash_attention(q, k, v, is_causal=True, forward="gluon", backward="gluon"),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa_flash": _sdpa_flash,
    }[name]


# ------------------------------------------------------------------------ pytorch_attention, torch_compile


def _timed_ms(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _pytorch_attention_row(attn: Callable, batch: int, seq: int, head_dim: int, passes: int) -> dict[str, Any]:
    device = torch.device("cuda")
    q, k, v = (torch.randn(batch, seq, head_dim, device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, seq, head_dim, device=device)
    mask = _causal_mask(seq, device)
    for _ in range(3):  # warm-up (and compilation for the compiled variant)
        attn(q, k, v, mask).backward(grad)
    fwd_ms = [_timed_ms(lambda: attn(q, k, v, mask)) for _ in range(passes)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = attn(q, k, v, mask)
    torch.cuda.synchronize()
    saved_bytes = torch.cuda.memory_allocated() - base
    before_backward = torch.cuda.memory_allocated()
    out.backward(grad)
    del out
    bwd_ms = []
    for _ in range(passes):
        out = attn(q, k, v, mask)
        bwd_ms.append(_timed_ms(lambda out=out: out.backward(grad)))
        del out
    return {
        "fwd_ms": sum(fwd_ms) / passes, "bwd_ms": sum(bwd_ms) / passes,
        "mem_before_bwd_gib": before_backward / GIB, "saved_for_bwd_gib": saved_bytes / GIB,
    }


def _pytorch_sweep(cfg: AttentionBenchConfig, compiled: bool) -> Iterator[dict[str, Any]]:
    attn = torch.compile(_plain, dynamic=True) if compiled else _plain
    for head_dim in cfg.head_dims:
        for seq in cfg.seq_lens:
            row = {"bench": "compiled" if compiled else "pytorch", "batch": cfg.batch, "seq": seq,
                   "d": head_dim, "dtype": "fp32", "passes": cfg.passes}
            try:
                row |= _pytorch_attention_row(attn, cfg.batch, seq, head_dim, cfg.passes) | {"status": "ok"}
            except torch.OutOfMemoryError:
                row["status"] = "oom"
            torch.cuda.empty_cache()
            yield row


# ---------------------------------------------------------------------------------- flash_benchmarking


def _bench_ms(fn: Callable[[], Any], warmup_ms: int, rep_ms: int, grad_to_none: Sequence[torch.Tensor]) -> float:
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none), return_mode="median")


# The backward is timed on one retained graph, which a compiled backward that donates buffers refuses.
@functorch_config.patch(donated_buffer=False)
def measure_ms(forward: Callable[[], torch.Tensor | Sequence[torch.Tensor]],
               grads: torch.Tensor | Sequence[torch.Tensor], leaves: Sequence[torch.Tensor], warmup_ms: int,
               rep_ms: int) -> dict[str, Any]:
    """``fwd_ms``, ``bwd_ms`` and ``fwd_bwd_ms``: do_bench medians of ``forward()``, of the backward of its outputs
    from ``grads`` (on one retained graph) and of both, the gradients of ``leaves`` cleared before each repetition;
    None where out of memory."""

    def backward_only() -> float:
        out = forward()
        return _bench_ms(lambda: torch.autograd.backward(out, grads, retain_graph=True), warmup_ms, rep_ms, leaves)

    result: dict[str, Any] = {}
    for mode, bench in (
        ("fwd", lambda: _bench_ms(forward, warmup_ms, rep_ms, leaves)),
        ("bwd", backward_only),
        ("fwd_bwd", lambda: _bench_ms(lambda: torch.autograd.backward(forward(), grads), warmup_ms, rep_ms, leaves)),
    ):
        try:
            result[f"{mode}_ms"] = bench()
        except torch.OutOfMemoryError:
            result[f"{mode}_ms"] = None
        for t in leaves:
            t.grad = None
        torch.cuda.empty_cache()
    return result


def flash_rows(
    shape: tuple[int, int, int, int], dtype_name: str, impl_names: Sequence[str], rep_ms: int,
    cfg: AttentionBenchConfig, bench: str,
) -> Iterator[dict[str, Any]]:
    """Rows (``bench``) of forward, backward and forward+backward do_bench medians and TFLOP/s of each implementation
    of ``impl_names`` at ``shape`` (batch, heads, seq, head_dim), causal, in ``dtype_name``; ``cfg`` gives the
    warm-up time, ``rep_ms`` the repetition time. FA4 rows say why where FA4 does not import."""
    batch, heads, seq, head_dim = shape
    device = torch.device("cuda")
    fa4_missing = fa4_attention()[1] if set(impl_names) & set(FA4_IMPLS) else None
    inputs: tuple[torch.Tensor, ...] = ()
    flops = causal_attention_flops(batch, heads, seq, head_dim)
    for name in impl_names:
        row = {"bench": bench, "impl": name, "dtype": dtype_name, "batch": batch, "heads": heads, "seq": seq,
               "d": head_dim, "causal": True, "rep_ms": rep_ms}
        if name in FA4_IMPLS:
            if fa4_missing is not None:
                yield row | {"status": "skipped", "note": fa4_missing}
                continue
            row["fa4_version"] = fa4_version()
        if not inputs:  # allocated once, for the first implementation that runs
            gen = torch.Generator(device=device).manual_seed(seq * 1000 + head_dim)
            inputs = tuple(torch.randn(shape, device=device, dtype=DTYPES[dtype_name], generator=gen).requires_grad_()
                           for _ in range(3))

        def measure(name: str = name, inputs: tuple[torch.Tensor, ...] = inputs) -> dict[str, Any]:
            impl = anchor_impl(name, seq, device)
            return measure_ms(lambda: impl(*inputs), torch.randn_like(inputs[0]), inputs, cfg.warmup_ms, rep_ms)

        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(name in DETERMINISTIC_IMPLS)
        try:
            row = timed_row(row, measure, flops, inputs, f"{name} at {shape}")
        finally:
            torch.use_deterministic_algorithms(before)
        yield row


def timed_row(row: dict[str, Any], measure: Callable[[], dict[str, Any]], flops: dict[str, float],
              leaves: Sequence[torch.Tensor], what: str) -> dict[str, Any]:
    """``row`` with the medians of ``measure()`` (:func:`measure_ms`), their TFLOP/s (``flops`` by mode) and a
    ``status``: ``ok``, ``oom`` where a mode ran out of memory, or ``error`` with the exception in ``error`` (also
    printed, naming ``what``; the gradients of ``leaves`` cleared), so that one failing implementation does not lose
    the other rows."""
    try:
        row = row | measure()
    except Exception as e:  # noqa: BLE001 (one failing implementation must not lose the other rows)
        row = row | {"status": "error", "error": f"{type(e).__name__}: {e}"}
        print(f"cs336 attention: {what} failed: {row['error']}", file=sys.stderr)
        for t in leaves:
            t.grad = None
        torch.cuda.empty_cache()
        return row
    for mode in ("fwd", "bwd", "fwd_bwd"):
        ms = row[f"{mode}_ms"]
        row[f"{mode}_tflops"] = None if ms is None else flops[mode] / (ms * 1e-3) / 1e12
    row["status"] = "ok" if all(row[f"{m}_ms"] is not None for m in ("fwd", "bwd", "fwd_bwd")) else "oom"
    return row


def warm_kernels(shape: tuple[int, int, int, int], dtype_name: str) -> None:
    """One causal forward + backward of our kernels at ``shape``: compiles (and autotunes) what that launch needs."""
    q, k, v = (torch.randn(*shape, device="cuda", dtype=DTYPES[dtype_name], requires_grad=True) for _ in range(3))
    flash_attention(q, k, v, is_causal=True).sum().backward()
    torch.cuda.synchronize()


def precompile(jobs: Sequence[tuple[tuple[int, int, int, int], str]], processes: int) -> None:
    """Compile every autotuning candidate of our kernels in parallel processes to fill Triton's disk cache.

    Each job is (shape, dtype). Its shape must share the launch specialisation
    (dtype, head dim, divisibility of sizes and strides by 16) of the shapes timed later, so that their
    compilation is a cache hit.
    """
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pool.starmap(warm_kernels, jobs)


def run_attention_bench(
    cfg: AttentionBenchConfig, on_row: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Run the configured parts; every row is also passed to ``on_row`` as soon as it is measured."""
    if not torch.cuda.is_available():
        raise RuntimeError("cs336 attention needs a CUDA GPU")
    if cfg.precompile_jobs:
        jobs = []
        if "flash" in cfg.parts:
            jobs += [((1, 1, 256, d), dt) for dt in cfg.flash_dtypes for d in cfg.flash_head_dims]
        if "anchors" in cfg.parts:
            jobs += list(dict.fromkeys(((b, h, 256, d), "bf16") for b, h, _, d in cfg.anchor_shapes))
        precompile(jobs, cfg.precompile_jobs)
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    if "anchors" in cfg.parts:
        for shape in cfg.anchor_shapes:
            for row in flash_rows(shape, "bf16", cfg.anchor_impls, cfg.anchor_rep_ms, cfg, "anchors"):
                row["target_fwd_bwd_ms"] = ANCHOR_TARGET_MS.get(shape)
                if row.get("fwd_bwd_tflops") is not None:
                    row["fraction_of_772_tflops"] = row["fwd_bwd_tflops"] * 1e12 / H200_BF16_MATMUL_FLOPS
                emit(row)
    if "flash" in cfg.parts:
        for dtype_name in cfg.flash_dtypes:
            for head_dim in cfg.flash_head_dims:
                for seq in cfg.flash_seq_lens:
                    for row in flash_rows((1, 1, seq, head_dim), dtype_name, ("triton", "pytorch", "sdpa"),
                                           cfg.rep_ms, cfg, "flash"):
                        emit(row)
    if "pytorch" in cfg.parts:
        for row in _pytorch_sweep(cfg, compiled=False):
            emit(row)
    if "compiled" in cfg.parts:
        for row in _pytorch_sweep(cfg, compiled=True):
            emit(row)
    return rows


# --------------------------------------------------------------------------------------- markdown tables


def _ms(row: dict[str, Any] | None, key: str) -> str:
    if row is None:
        return "-"
    value = row.get(key)
    if value is None:
        return "OOM" if row.get("status") == "oom" else "-"
    return f"{value:.3g}"


def _ratio(num: dict[str, Any] | None, den: dict[str, Any] | None, key: str) -> str:
    if num is None or den is None or num.get(key) is None or den.get(key) is None:
        return "-"
    return f"{num[key] / den[key]:.3g}"


def _passes(rows: Sequence[dict[str, Any]]) -> str:
    return "/".join(str(p) for p in sorted({r["passes"] for r in rows}))


def attention_tables(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The writeup's markdown tables from saved rows, by name: ``pytorch``, ``compiled``, ``anchors``,
    ``flash_<dtype>``."""
    tables = {}
    eager = {(r["d"], r["seq"]): r for r in rows if r.get("bench") == "pytorch"}
    compiled = {(r["d"], r["seq"]): r for r in rows if r.get("bench") == "compiled"}
    if eager:
        table = [{"d": d, "seq": seq, "fwd": _ms(r, "fwd_ms"), "bwd": _ms(r, "bwd_ms"),
                  "mem": _ms(r, "mem_before_bwd_gib"), "saved": _ms(r, "saved_for_bwd_gib")}
                 for (d, seq), r in sorted(eager.items())]
        first = next(iter(eager.values()))
        tables["pytorch"] = (
            f"Plain PyTorch attention (batch {first['batch']}, fp32, causal mask, mean of "
            f"{_passes(list(eager.values()))} passes), {first['device']}:\n\n"
            + markdown_table(table, list(zip(
                ["d", "seq", "fwd", "bwd", "mem", "saved"],
                ["d", "seq", "fwd (ms)", "bwd (ms)", "memory before bwd (GiB)", "saved by one fwd (GiB)"],
                strict=True)))
        )
    if compiled:
        # Speed-ups are eager time / compiled time, so > 1 means compiling helped.
        table = []
        for (d, seq), c in sorted(compiled.items()):
            e = eager.get((d, seq))
            table.append({
                "d": d, "seq": seq, "efwd": _ms(e, "fwd_ms"), "cfwd": _ms(c, "fwd_ms"), "sfwd": _ratio(e, c, "fwd_ms"),
                "ebwd": _ms(e, "bwd_ms"), "cbwd": _ms(c, "bwd_ms"), "sbwd": _ratio(e, c, "bwd_ms"),
                "esaved": _ms(e, "saved_for_bwd_gib"), "csaved": _ms(c, "saved_for_bwd_gib"),
            })
        first = next(iter(compiled.values()))
        eager_passes = _passes([e for e in (eager.get(k) for k in compiled) if e is not None]) or "-"
        tables["compiled"] = (
            f"Plain PyTorch attention, eager (mean of {eager_passes} passes) vs torch.compile(dynamic=True) (mean "
            f"of {_passes(list(compiled.values()))} passes); batch {first['batch']}, fp32, causal mask, "
            f"{first['device']}:\n\n"
            + markdown_table(table, list(zip(
                ["d", "seq", "efwd", "cfwd", "sfwd", "ebwd", "cbwd", "sbwd", "esaved", "csaved"],
                ["d", "seq", "eager fwd (ms)", "compiled fwd (ms)", "fwd speed-up", "eager bwd (ms)",
                              "compiled bwd (ms)", "bwd speed-up", "eager saved by one fwd (GiB)",
                              "compiled saved by one fwd (GiB)"], strict=True)))
        )
    # Anchor rows accumulate over sessions; the table shows the latest timed run of each (shape, impl).
    latest: dict[tuple, dict[str, Any]] = {}
    for r in sorted((r for r in rows if r.get("bench") == "anchors" and r["impl"] in ANCHOR_IMPLS
                     and r.get("status") not in ("skipped", "error")),
                    key=lambda r: r.get("date", "")):
        latest[(r["batch"], r["heads"], r["seq"], r["d"], r["impl"])] = r
    anchors = sorted(latest.values(), key=lambda r: (-r["seq"] * r["d"], ANCHOR_IMPLS.index(r["impl"])))
    if anchors:
        table = [{**r, "shape": f"({r['batch']}, {r['heads']}, {r['seq']}, {r['d']})",
                  "fwd": _ms(r, "fwd_ms"), "bwd": _ms(r, "bwd_ms"), "fb": _ms(r, "fwd_bwd_ms")} for r in anchors]
        tables["anchors"] = (
            f"Anchor shapes, bf16, causal, do_bench medians, {anchors[0]['device']}:\n\n"
            + markdown_table(table, list(zip(
                ["shape", "impl", "fwd", "bwd", "fb", "fwd_tflops", "bwd_tflops", "fwd_bwd_tflops",
                 "target_fwd_bwd_ms"],
                ["(b, h, s, d)", "impl", "fwd (ms)", "bwd (ms)", "fwd+bwd (ms)", "fwd TFLOP/s", "bwd TFLOP/s",
                 "fwd+bwd TFLOP/s", "target (ms)"],
                strict=True)))
        )
    # The Gluon kernels' first timing rows (tools/gluon bench, before the anchors part timed every path): one line
    # per (shape, pass), the latest row of each implementation.
    gluon: dict[tuple, dict[str, Any]] = {}
    for r in sorted((r for r in rows if r.get("bench") == "gluon_attention"), key=lambda r: r.get("date", "")):
        line = gluon.setdefault((tuple(r["shape"]), r["pass"]), {"shape": str(tuple(r["shape"])), "pass": r["pass"]})
        line[r["impl"]] = f"{r['ms']:.3g}"
        line["device"] = r["device"]
    if gluon:
        lines = [gluon[k] for k in sorted(gluon, key=lambda k: (k[1], -k[0][2] * k[0][3]))]
        tables["gluon"] = (
            f"Gluon kernels against our Triton kernels and SDPA, bf16, causal, do_bench medians in ms, "
            f"{lines[0]['device']}:\n\n"
            + markdown_table(lines, [("shape", "(b, h, s, d)"), ("pass", "pass"), ("gluon", "Gluon"),
                                     ("triton", "Triton"), ("sdpa", "SDPA (cuDNN)")])
        )
    flash = [r for r in rows if r.get("bench") == "flash"]
    for dtype_name in dict.fromkeys(r["dtype"] for r in flash):
        by_key = {(r["d"], r["seq"], r["impl"]): r for r in flash if r["dtype"] == dtype_name}
        table = []
        for d, seq in sorted({(d, s) for d, s, _ in by_key}):
            ours, plain, sdpa = (by_key.get((d, seq, name)) for name in ("triton", "pytorch", "sdpa"))
            entry = {"d": d, "seq": seq}
            for prefix, r in (("t", ours), ("p", plain), ("s", sdpa)):
                for mode in ("fwd", "bwd", "fwd_bwd"):
                    entry[f"{prefix}_{mode}"] = _ms(r, f"{mode}_ms")
            entry["t_tflops"] = _ms(ours, "fwd_bwd_tflops")
            entry["s_tflops"] = _ms(sdpa, "fwd_bwd_tflops")
            table.append(entry)
        columns = ["d", "seq"] + [f"{p}_{m}" for p in "tps" for m in ("fwd", "bwd", "fwd_bwd")]
        headers = ["d", "seq"] + [f"{name} {m}" for name in ("ours", "plain", "SDPA") for m in ("fwd", "bwd", "f+b")]
        tables[f"flash_{dtype_name}"] = (
            f"{dtype_name}, batch 1, one head, causal, do_bench medians in ms; TFLOP/s of fwd+bwd; "
            f"{flash[0]['device']}:\n\n"
            + markdown_table(table, list(zip(
                [*columns, "t_tflops", "s_tflops"],
                [*headers, "ours TFLOP/s", "SDPA TFLOP/s"], strict=True)))
        )
    return tables


def attention_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """All of :func:`attention_tables`, one after another."""
    return "\n\n".join(attention_tables(rows).values())
