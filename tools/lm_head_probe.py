"""Where the fused LM-head loss spends its time on a GPU, and what its GEMMs could reach: one row per measurement.

At the leaderboard shape (32768 tokens, d 4096, vocab 151936, bf16) the loss is three GEMMs per chunk of tokens
(logits = h W^T, grad_h = dlogits W, grad_W += dlogits^T h) and one memory-bound kernel. This times, per chunk
size, each GEMM in the orientation the op uses and with the logits stored transposed (logits^T = W h^T, so the
largest dimension is the GEMM's M), on the data each sees in a step (dlogits: softmax - onehot, scaled), and the
whole op with the profiler's kernel time by name. Every GEMM's TFLOP/s counts 2 * rows * V * d per chunk.

    bash tools/gpu.sh python3 tools/lm_head_probe.py --out writeup/results/kernel_limits.jsonl
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from cs336_harness.results import append_rows, provenance
from cs336_kernels import fused_linear_cross_entropy
from cs336_kernels.ops.fused_linear_cross_entropy import softmax_grad_inplace
from triton.testing import do_bench

IGNORE_INDEX = -100


def _ms(fn) -> float:
    return float(do_bench(fn, warmup=50, rep=400, return_mode="median"))


def gemm_rows(n: int, d: int, v: int, rows: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(rows, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(v, d, device="cuda", generator=gen) / d**0.5).bfloat16()
    targets = torch.randint(0, v, (rows,), device="cuda", generator=gen)
    logits = h.new_empty(rows, v)
    logits_t = h.new_empty(v, rows)
    grad_h = torch.empty_like(h)
    grad_w = torch.zeros_like(w)
    losses = torch.empty(rows, dtype=torch.float32, device="cuda")
    scale = torch.full((), 1.0 / n, device="cuda")
    torch.mm(h, w.t(), out=logits)
    softmax_grad_inplace(logits, targets, losses, scale, 0, IGNORE_INDEX, True)
    dlogits_t = logits.t().contiguous()  # the same dlogits, stored (V, rows)
    stages = {
        ("logits", "h @ W^T -> (rows, V)"): lambda: torch.mm(h, w.t(), out=logits),
        ("logits", "W @ h^T -> (V, rows)"): lambda: torch.mm(w, h.t(), out=logits_t),
        ("grad_hidden", "dlogits (rows, V) @ W"): lambda: torch.mm(logits, w, out=grad_h),
        ("grad_hidden", "dlogits^T (V, rows) as .t() @ W"): lambda: torch.mm(dlogits_t.t(), w, out=grad_h),
        ("grad_weight", "addmm_(dlogits.t(), h)"): lambda: grad_w.addmm_(logits.t(), h),
        ("grad_weight", "addmm_(dlogits^T (V, rows), h)"): lambda: grad_w.addmm_(dlogits_t, h),
    }
    chunks = -(-n // rows)
    flops = 2 * rows * v * d
    out = []
    for (gemm, form), fn in stages.items():
        ms = _ms(fn)
        out.append({"bench": "lm_head_gemm", "gemm": gemm, "form": form, "chunk_rows": rows, "num_chunks": chunks,
                    "ms_per_chunk": ms, "ms_all_chunks": ms * chunks, "tflops": flops / (ms * 1e-3) / 1e12})
        print(f"{rows:5d} {gemm:12s} {form:34s} {ms:8.3f} ms/chunk {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    ms = _ms(lambda: softmax_grad_inplace(logits, targets, losses, scale, 0, IGNORE_INDEX, True))
    out.append({"bench": "lm_head_gemm", "gemm": "softmax_grad_kernel", "form": "rows in place", "chunk_rows": rows,
                "num_chunks": chunks, "ms_per_chunk": ms, "ms_all_chunks": ms * chunks,
                "tbps": 3 * rows * v * 2 / (ms * 1e-3) / 1e12})
    return out


def whole_op_rows(n: int, d: int, v: int, chunk_sizes: list[int]) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, d, device="cuda", generator=gen) / d**0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    out = []
    for rows in chunk_sizes:
        def step(rows=rows):
            fused_linear_cross_entropy(hidden, weight, targets, chunk_size=rows).backward()

        step()
        torch.cuda.synchronize()
        hidden.grad = weight.grad = None
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 2**30
        hidden.grad = weight.grad = None
        ms = float(do_bench(step, warmup=100, rep=1500, grad_to_none=[hidden, weight], return_mode="median"))
        hidden.grad = weight.grad = None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        hidden.grad = weight.grad = None
        kernels: dict[str, float] = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name[:80]] += e.device_time / 1e3
        out.append({"bench": "lm_head_op", "chunk_rows": rows, "ms": ms, "extra_gib": extra,
                    "tflops": 3 * 2 * n * v * d / (ms * 1e-3) / 1e12, "kernel_ms": dict(kernels),
                    "kernel_total_ms": sum(kernels.values())})
        print(f"op chunk {rows}: {ms:.2f} ms, +{extra:.2f} GiB, kernels {sum(kernels.values()):.2f} ms", flush=True)
        for name, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]:
            print(f"    {t:8.2f} ms  {name}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096])
    args = parser.parse_args()
    meta = provenance()
    rows = []
    for c in args.chunks:
        rows += gemm_rows(args.tokens, args.d_model, args.vocab, c)
        torch.cuda.empty_cache()
    rows += whole_op_rows(args.tokens, args.d_model, args.vocab, args.chunks)
    shape = {"tokens": args.tokens, "d_model": args.d_model, "vocab_size": args.vocab, "dtype": "bf16"}
    append_rows(args.out, [{**shape, **r} for r in rows], meta)


if __name__ == "__main__":
    main()
