"""``cs336 block``: one Transformer block's forward + backward, eager and compiled, with our kernels and with
PyTorch's (needs a CUDA GPU).

Examples::

    bash tools/gpu.sh python3 -m cs336_harness.cli block --out writeup/results/compiled_block.jsonl
    uv run cs336 block --size small --seq 4096 --variant compiled_ours --variant compiled_torch
"""

from __future__ import annotations

import argparse

from cs336_harness.analysis.tables import format_table
from cs336_harness.commands._shared import add_quiet_argument
from cs336_harness.results import append_rows, check_writable
from cs336_harness.studies.compiled_block import VARIANTS, BlockBenchConfig, run_block_bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    d = BlockBenchConfig  # the dataclass defaults, read off the class
    parser.add_argument("--size", default=d.size, help=f"model-size preset of the block (default {d.size})")
    parser.add_argument("--batch", type=int, default=d.batch, help=f"sequences (default {d.batch})")
    parser.add_argument("--seq", type=int, default=d.seq, help=f"tokens per sequence (default {d.seq})")
    parser.add_argument("--dtype", default=d.dtype, help=f"weights and activations (default {d.dtype})")
    parser.add_argument("--variant", choices=VARIANTS, action="append", default=None,
                        help="run only this variant (repeatable; default all four)")
    parser.add_argument("--warmup-ms", type=int, default=d.warmup_ms, help="do_bench warm-up (default 200)")
    parser.add_argument("--rep-ms", type=int, default=d.rep_ms, help="do_bench repetition time (default 1000)")
    parser.add_argument("--out", default=None, help="append rows (with provenance) to this JSONL file")
    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    try:
        config = BlockBenchConfig(size=args.size, batch=args.batch, seq=args.seq, dtype=args.dtype,
                                  variants=tuple(args.variant or VARIANTS), warmup_ms=args.warmup_ms,
                                  rep_ms=args.rep_ms)
        if args.out:
            check_writable(args.out)
        rows = run_block_bench(config, progress=not args.quiet)
    except ValueError as e:
        raise SystemExit(f"cs336 block: {e}") from None
    columns = ["variant", "fwd_bwd_ms", "fwd_ms", "vs_compiled_torch", "peak_gib", "graph_breaks", "first_call_s"]
    print(format_table(rows, columns, floatfmt=".3f"))
    if args.out:
        append_rows(args.out, rows)
    return 0
