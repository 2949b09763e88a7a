"""Time the Gluon FlashAttention kernels against our Triton kernels and SDPA, in one process, on one GPU.

bf16, causal, at the issue-18 anchor shapes: the forward alone and forward + backward. Each row: shape,
impl, pass, median ms (triton.testing.do_bench) and TFLOP/s with causal forward FLOPs = 4 * b * h * s^2 * d / 2
and forward + backward = 3.5x that (ANCHORS.md), plus the repo's provenance fields and a call id shared by
the rows of one run.

    bash tools/gpu.sh python3 tools/gluon_attention_bench.py --out $OUT/gluon_attention.jsonl --call-id ID
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
from cs336_harness.results import append_rows, provenance
from cs336_kernels.flash_attention import flash_attention
from cs336_kernels.gluon_attention import gluon_attention_backward, gluon_attention_forward

SHAPES = ((1, 32, 32768, 128), (1, 16, 16384, 64), (4, 32, 4096, 128))
FWD_BWD_FLOPS_PER_FWD = 3.5


def _gluon_fwd_bwd(q, k, v, do):
    o, lse = gluon_attention_forward(q, k, v, True)
    gluon_attention_backward(q, k, v, o, do, lse, True)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _passes(q, k, v, do) -> tuple[dict, list[torch.Tensor]]:
    """{(impl, pass): zero-argument callable} and the leaves that require grad, on which the autograd ones run."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return {
        ("gluon", "fwd"): lambda: gluon_attention_forward(q, k, v, True),
        ("triton", "fwd"): lambda: flash_attention(q, k, v, True),
        ("sdpa", "fwd"): lambda: _sdpa(q, k, v),
        ("gluon", "fwd_bwd"): lambda: _gluon_fwd_bwd(q, k, v, do),
        ("triton", "fwd_bwd"): lambda: flash_attention(*leaves, True).backward(do),
        ("sdpa", "fwd_bwd"): lambda: _sdpa(*leaves).backward(do),
    }, leaves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="append rows to this JSONL file")
    parser.add_argument("--call-id", required=True, help="shared by every row of this run")
    parser.add_argument("--rep-ms", type=int, default=500, help="do_bench repetition time per measurement")
    parser.add_argument("--passes", nargs="+", choices=("fwd", "fwd_bwd"), default=["fwd", "fwd_bwd"])
    parser.add_argument("--shapes", default=None, help="b,h,s,d[;b,h,s,d...] (default: the three anchors)")
    args = parser.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(x) for x in item.split(",")) for item in args.shapes.split(";"))
    meta = provenance() | {"call_id": args.call_id}
    for which, (batch, heads, seq, head_dim) in ((w, shape) for w in args.passes for shape in shapes):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                       for _ in range(4))
        fwd_flops = 4 * batch * heads * seq**2 * head_dim / 2
        runs, leaves = _passes(q, k, v, do)
        for (impl, kind), run in runs.items():
            if kind != which:
                continue
            run()  # compile and autotune outside the measurement
            ms = triton.testing.do_bench(run, rep=args.rep_ms, grad_to_none=leaves, return_mode="median")
            flops = fwd_flops * (FWD_BWD_FLOPS_PER_FWD if which == "fwd_bwd" else 1)
            row = {"bench": "gluon_attention", "impl": impl, "pass": which, "dtype": "bf16", "causal": True,
                   "shape": [batch, heads, seq, head_dim], "ms": ms, "tflops": flops / ms / 1e9, "rep_ms": args.rep_ms}
            print(row, flush=True)
            append_rows(args.out, [row], meta)


if __name__ == "__main__":
    main()
