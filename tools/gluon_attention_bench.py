"""Time the Gluon FlashAttention forward against our Triton forward and SDPA, in one process, one GPU.

bf16, causal, forward only, at the issue-18 anchor shapes. Each row: shape, impl, median ms
(triton.testing.do_bench), TFLOP/s with causal forward FLOPs = 4 * b * h * s^2 * d / 2, and the repo's
provenance fields plus a call id shared by the rows of one run.

    bash tools/gpu.sh python3 tools/gluon_attention_bench.py --out $OUT/gluon_attention.jsonl --call-id ID
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
import triton
from cs336_harness.results import append_rows, provenance
from cs336_kernels.flash_attention import flash_attention
from cs336_kernels.gluon_attention import gluon_attention_forward

SHAPES = ((1, 32, 32768, 128), (1, 16, 16384, 64), (4, 32, 4096, 128))


def _impls() -> dict:
    return {
        "gluon": lambda q, k, v: gluon_attention_forward(q, k, v, True),
        "triton": lambda q, k, v: flash_attention(q, k, v, True),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="append rows to this JSONL file")
    parser.add_argument("--call-id", required=True, help="shared by every row of this run")
    parser.add_argument("--rep-ms", type=int, default=500, help="do_bench repetition time per measurement")
    args = parser.parse_args()
    meta = provenance() | {"call_id": args.call_id}
    for batch, heads, seq, head_dim in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        flops = 4 * batch * heads * seq**2 * head_dim / 2
        with torch.no_grad():
            for impl, fn in _impls().items():
                run = functools.partial(fn, q, k, v)
                run()  # compile and autotune outside the measurement
                ms = triton.testing.do_bench(run, rep=args.rep_ms, return_mode="median")
                row = {"bench": "gluon_forward", "impl": impl, "dtype": "bf16", "causal": True,
                       "shape": [batch, heads, seq, head_dim], "ms": ms, "tflops": flops / ms / 1e9,
                       "rep_ms": args.rep_ms}
                print(row, flush=True)
                append_rows(args.out, [row], meta)


if __name__ == "__main__":
    main()
