"""Benchmarks of the fused kernels in cs336_kernels against PyTorch (``cs336 fused``).

(a) One AdamW step over ``adamw_params`` float32 parameters split into ``adamw_tensors`` tensors:
    FusedAdamW vs torch.optim.AdamW(foreach=True) vs torch.optim.AdamW(fused=True), do_bench medians (L2
    flushed between calls). The bytes floor: each parameter reads param, grad, exp_avg, exp_avg_sq and writes
    param, exp_avg, exp_avg_sq, 7 x 4 = 28 bytes, so

        floor_ms = 28 * num_params / 4.24e12 B/s * 1e3

    with 4.24 TB/s the device-to-device copy bandwidth (bytes read + written) measured on an H200
    (:data:`cs336_harness.device.H200_COPY_BYTES_PER_S`); the same run also measures its own copy bandwidth and
    reports it in ``copy_tbps``.
(b) LM head + cross-entropy, forward and backward: fused_linear_cross_entropy vs plain PyTorch
    (F.linear + F.cross_entropy, cs336_kernels' reference), Liger-Kernel's and Cut Cross-Entropy's fused
    losses where they import (a row saying why otherwise), in bfloat16. Median time, and peak memory above
    the inputs and their gradients (max_memory_allocated during one fwd+bwd minus what was allocated before it,
    minus the gradients' bytes). The matmul floor counts three (N x V x d) products, forward logits and the
    two gradients, at 772 TFLOP/s (:data:`cs336_harness.device.H200_BF16_MATMUL_FLOPS`):

        matmul_floor_ms = 3 * 2 * N * V * d / 772e12 * 1e3

    Each row also carries the relative error of its loss against an fp32 reference (the logits in fp32,
    chunk by chunk) and of our gradients against plain PyTorch's.
(c) The glue of a Transformer block at the leaderboard shapes, bf16, forward + backward: RMSNorm (tokens x
    d_model, bf16 weight as FSDP hands it over), the block's first residual add folded into its second RMSNorm
    (h = x + delta and rms_norm(h), tokens x d_model, with h's gradient from the residual path), RoPE on q and k
    ((1, tokens, heads, head_dim) views of the projections) and SwiGLU's silu(a) * b (tokens x d_ff).
    Implementations: ours (cs336_kernels), torch.compile of the same PyTorch reference the tests use, the eager
    model code (cs336_basics' RMSNorm and RotaryEmbedding modules, the block's add then RMSNorm, SwiGLU's
    expression), and Liger-Kernel's op when ``liger_kernel`` imports (a row saying why otherwise). Each row:
    do_bench median of forward + backward, GB/s from the bytes the op must move, the peak memory above inputs,
    upstream gradients and the inputs' gradients (negative where an implementation writes gradients into its
    inputs, as Liger's SiLU-mul and RoPE do), and the forward's relative difference from the eager output. Bytes
    that must move, forward + backward (N tokens, e bytes per element):

        rms_norm:  5 * N * d * e + 8 * N + 3 * d * e_w        x, y, dy, x again, dx; rstd; w twice, dw
        add_rms_norm:  8 * N * d * e + 8 * N + 3 * d * e_w    x, delta, h, y; dy, dh, h again, dx (one gradient
                                                              for x and delta); rstd; w twice, dw
        rope:      4 * (q.numel() + k.numel()) * e + 8 * N * D + 16 * N
                                                              q, k in and out twice; cos, sin rows and
                                                              int64 positions, once per pass
        silu_mul:  8 * N * d_ff * e                           a, b, out; dout, a, b, da, db

    from cs336_harness.studies.fused import FusedBenchConfig, run_fused_bench, fused_markdown
    rows = run_fused_bench(FusedBenchConfig())
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from cs336_basics.model import RMSNorm, RotaryEmbedding
from cs336_kernels import (
    FusedAdamW,
    add_rms_norm,
    add_rms_norm_reference,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
    rms_norm,
    rms_norm_reference,
    rope,
    rope_reference,
    silu_mul,
    silu_mul_reference,
)
from cs336_kernels.ops.fused_linear_cross_entropy import chunk_rows, softmax_grad_inplace
from triton.testing import do_bench

from cs336_harness.analysis.tables import markdown_table
from cs336_harness.device import H200_BF16_MATMUL_FLOPS, H200_COPY_BYTES_PER_S
from cs336_harness.progress import progress_bar

BENCHES: tuple[str, ...] = ("adamw", "linear-ce", "rms-norm", "add-rms-norm", "rope", "swiglu")
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
    d_ff: int = 11008
    num_heads: int = 32
    warmup_ms: int = 200
    rep_ms: int = 1000
    # FusedAdamW launch granularities timed besides the default.
    adamw_elements_per_program: tuple[int, ...] = (2048, 262144)
    # Fused variants with these token chunk sizes are timed besides the default (which fits the memory budget).
    extra_chunk_sizes: tuple[int, ...] = (1024, 4096)

    def __post_init__(self) -> None:
        if not torch.cuda.is_available():
            raise ValueError("the fused-kernel benchmarks measure GPU kernels and need a CUDA GPU")
        if not self.benches or any(b not in BENCHES for b in self.benches):
            raise ValueError(f"benches must be a non-empty subset of {BENCHES}, got {self.benches}")
        if self.adamw_tensors < 1 or self.adamw_params < self.adamw_tensors:
            raise ValueError(f"need 1 <= adamw_tensors <= adamw_params, got {self.adamw_tensors} tensors "
                             f"for {self.adamw_params} params")
        for name in ("tokens", "d_model", "vocab_size", "d_ff", "num_heads", "warmup_ms", "rep_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ValueError(f"d_model must be num_heads times an even head_dim, got d_model {self.d_model} and "
                             f"{self.num_heads} heads")
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


def _fp32_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 4096) -> float:
    """Mean cross-entropy of fp32 logits, a chunk of tokens at a time, summed in float64."""
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start:start + chunk].float(), weight.float())
            total += F.cross_entropy(logits, targets[start:start + chunk], ignore_index=_IGNORE_INDEX,
                                     reduction="sum").double()
    return (total / (targets != _IGNORE_INDEX).sum()).item()


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
            r.update(grad_hidden_rel_err=_rel_err(ours[1], ref[1]), grad_weight_rel_err=_rel_err(ours[2], ref[2]))
    del results
    shape = {"tokens": n, "d_model": d, "vocab_size": v, "dtype": "bf16"}
    rows += [{"bench": "linear_ce", "impl": name, **shape, "note": why} for name, why in missing.items()]
    return rows + [_linear_ce_parts(hidden.detach(), weight.detach(), targets, default_rows, config)]


def _other_linear_ce() -> tuple[dict[str, Callable[..., torch.Tensor]], dict[str, str]]:
    """Liger-Kernel's and Cut Cross-Entropy's fused LM head + loss, called as ours is (hidden, weight, targets,
    reduction, ignore_index), where they import; and for each that does not, why."""
    impls: dict[str, Callable[..., torch.Tensor]] = {}
    missing: dict[str, str] = {}
    liger, why_not = _liger()
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

# ---------------------------------------------------------------------------------------- block glue (c)

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


def _liger() -> tuple[Any, str | None]:
    """Liger-Kernel's functional API, or None and why it cannot be used."""
    try:
        from liger_kernel.transformers import functional
    except Exception as e:  # noqa: BLE001 (any import failure means: no Liger rows)
        return None, f"liger_kernel is not importable: {type(e).__name__}: {e}"
    return functional, None


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
    extra_gib = (torch.cuda.max_memory_allocated() - before - grads_bytes) / 2**30
    for leaf in impl.leaves:
        leaf.grad = None
    ms = _median_ms(lambda: glue_step(impl), config, grad_to_none=impl.leaves)
    return {"median_ms": ms, "extra_gib": extra_gib, "first": first}


def bench_glue(op: str, config: FusedBenchConfig) -> list[dict[str, Any]]:
    """Rows of one glue op (``rms-norm``, ``add-rms-norm``, ``rope`` or ``swiglu``): every implementation, forward +
    backward."""
    liger, why_not = _liger()
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
            r["out_rel_err_vs_eager"] = _rel_err(outputs[r["impl"]], outputs["eager"])
    return rows


def run_fused_bench(config: FusedBenchConfig, progress: bool = False) -> list[dict[str, Any]]:
    """Rows of every benchmark in ``config.benches``, in :data:`BENCHES` order; with ``progress``, a bar on stderr
    counts the benchmarks done and names the one running."""
    runs: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "adamw": lambda: bench_adamw(config), "linear-ce": lambda: bench_linear_ce(config),
        **{op: lambda op=op: bench_glue(op, config) for op in GLUE_OPS},
    }
    chosen = [name for name in BENCHES if name in config.benches]
    bar = progress_bar(total=len(chosen), desc="fused", enabled=progress, unit="benchmark")
    rows: list[dict[str, Any]] = []
    for name in chosen:
        bar.set_postfix_str(name)
        rows += runs[name]()
        torch.cuda.empty_cache()
        bar.update()
    bar.close()
    return rows


def _latest_run(rows: Sequence[dict[str, Any]], bench: str) -> list[dict[str, Any]]:
    """Rows of ``bench`` from its most recent run (rows of one run share their provenance date)."""
    picked = [r for r in rows if r.get("bench") == bench]
    latest = max((r.get("date", "") for r in picked), default="")
    return [r for r in picked if r.get("date", "") == latest]


def fused_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The writeup's tables from the latest run of each benchmark: AdamW, linear + cross-entropy, its stages,
    and one table per glue op."""
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
                 "loss rel. err vs fp32", "grad h rel. err", "grad W rel. err"], strict=True))
                + ([("note", "note")] if any(r.get("note") for r in ce) else []))
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
    glue = _latest_run(rows, "glue")
    for op in dict.fromkeys(r["op"] for r in glue):
        picked = [{**r, "note": r.get("error") or r.get("note")} for r in glue if r["op"] == op]
        p = picked[0]
        parts.append(
            f"{op} forward + backward, {p['shape']} {p['dtype']}, one GPU of {p['device']}; "
            f"{p['bytes_moved'] / 1e9:.2f} GB must move.\n\n"
            + markdown_table(picked, list(zip(
                ["impl", "median_ms", "gbps", "speedup_vs_eager", "extra_gib", "out_rel_err_vs_eager", "note"],
                ["implementation", "median (ms)", "GB/s", "vs eager", "peak above inputs+grads (GiB)",
                 "out rel. diff vs eager", "note"], strict=True)))
        )
    return "\n\n".join(parts)
