"""``cs336 fused``: our fused kernels (AdamW, linear + cross-entropy, RMSNorm, residual add + RMSNorm, RoPE,
SiLU-mul) against PyTorch.

Examples::

    bash tools/gpu.sh python3 -m cs336_harness.cli fused --out writeup/results/fused.jsonl
    uv run cs336 fused --bench linear-ce --tokens 8192 --vocab-size 32000
    uv run cs336 fused --bench rms-norm --bench add-rms-norm --bench rope --bench swiglu     # the block glue only
    uv run cs336 fused --bench rms-norm --repeats 5 --rep-ms 250   # 5 do_bench medians of each implementation, in turns
    uv run cs336 fused --markdown writeup/results/fused.jsonl     # the writeup's tables from saved rows
"""

from __future__ import annotations

import argparse

from cs336_harness.analysis.tables import format_table
from cs336_harness.commands._shared import (
    add_markdown_arguments,
    add_quiet_argument,
    markdown_requested,
    print_markdown,
)
from cs336_harness.results import RowKind, RowWriter, check_writable
from cs336_harness.studies.fused import BENCHES, FusedBenchConfig, fused_markdown, run_fused_bench

# What fused_markdown reads of each benchmark's rows.
ROWS = RowKind("fused", "bench", {
    "adamw": ("impl", "num_params", "num_tensors", "device", "floor_ms", "copy_tbps"),
    "linear_ce": ("impl", "tokens", "d_model", "vocab_size", "dtype", "device", "matmul_floor_ms"),
    "linear_ce_parts": ("num_chunks", "chunk_rows", *(f"{stage}_ms" for stage in (
        "logits_mm", "softmax_grad_kernel", "grad_hidden_mm", "grad_weight_addmm")), "logits_mm_tflops",
        "grad_hidden_mm_tflops", "grad_weight_addmm_tflops", "softmax_grad_kernel_tbps"),
    "glue": ("impl", "op", "shape", "dtype", "device", "bytes_moved"),
})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    d = FusedBenchConfig  # the dataclass defaults, read off the class
    parser.add_argument("--bench", choices=BENCHES, action="append", default=None,
                        help="run only this benchmark (repeatable; default all)")
    parser.add_argument("--adamw-params", type=int, default=d.adamw_params, help="default 1e9")
    parser.add_argument("--adamw-tensors", type=int, default=d.adamw_tensors, help="default 16")
    parser.add_argument("--tokens", type=int, default=d.tokens, help="default 32768")
    parser.add_argument("--d-model", type=int, default=d.d_model, help="default 4096")
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size, help="default 151936")
    parser.add_argument("--d-ff", type=int, default=d.d_ff, help="SwiGLU width (default 11008)")
    parser.add_argument("--num-heads", type=int, default=d.num_heads, help="RoPE heads (default 32)")
    parser.add_argument("--warmup-ms", type=int, default=d.warmup_ms, help="do_bench warm-up (default 200)")
    parser.add_argument("--rep-ms", type=int, default=d.rep_ms, help="do_bench repetition time (default 1000)")
    parser.add_argument("--repeats", type=int, default=d.repeats,
                        help="glue benchmarks: do_bench medians per implementation, taken in turns (default 5)")
    parser.add_argument("--out", default=None, help="append rows (with provenance) to this JSONL file")
    add_markdown_arguments(parser, fill=False)
    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    if markdown_requested(args):
        return print_markdown(args, ROWS, lambda rows: {"fused": fused_markdown(rows)})
    try:
        config = FusedBenchConfig(
            benches=tuple(args.bench or FusedBenchConfig.benches), adamw_params=args.adamw_params,
            adamw_tensors=args.adamw_tensors, tokens=args.tokens, d_model=args.d_model,
            vocab_size=args.vocab_size, d_ff=args.d_ff, num_heads=args.num_heads, warmup_ms=args.warmup_ms,
            rep_ms=args.rep_ms, repeats=args.repeats,
        )
        if args.out:
            check_writable(args.out)
    except ValueError as e:
        raise SystemExit(f"cs336 fused: {e}") from None
    rows = run_fused_bench(config, progress=not args.quiet, write=RowWriter.to(args.out))
    for bench in dict.fromkeys(r["bench"] for r in rows):
        picked = [r for r in rows if r["bench"] == bench]
        columns = list(dict.fromkeys(c for r in picked for c in r if c != "bench"))
        print(format_table(picked, columns, floatfmt=".3f"))
    return 0
