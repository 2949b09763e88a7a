"""``cs336 shard``: memory and step time of DDP, ZeRO-1 (our sharded optimizer), our FSDP and FSDP2.

Examples::

    uv run cs336 shard                                    # CPU: tiny model, 2 gloo ranks, seconds
    uv run cs336 shard --size xl --world-size 2 --dtypes fp32,bf16 \\
        --out writeup/results/shard.jsonl --figure writeup/figures/fsdp_timeline_bf16.png
    torchrun --nproc-per-node 2 -m cs336_harness.cli shard --size xl --world-size 2
    uv run cs336 shard --markdown writeup/results/shard.jsonl   # print the tables, run nothing
    uv run cs336 shard --markdown writeup/results/shard.jsonl --fill writeup/sections/06-sharding.md
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from cs336_harness import shard_bench
from cs336_harness.presets import DEFAULT_CONTEXT_LENGTH, MODEL_SIZES
from cs336_harness.report import fill_tables
from cs336_harness.results import append_rows, format_table, read_rows

HELP = "peak memory and step time of DDP, ZeRO-1, our FSDP and FSDP2, with an FSDP timeline figure"


def _csv(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    parser.add_argument("--size", default=None, help=f"{', '.join(MODEL_SIZES)} (default xl with CUDA, tiny without)")
    parser.add_argument("--context-length", type=int, default=DEFAULT_CONTEXT_LENGTH, help="default 512")
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step over all ranks (default 4)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--backend", default=None, help="nccl | gloo (default: nccl with CUDA, gloo without)")
    parser.add_argument("--dtypes", type=_csv, default=("fp32", "bf16"), help="fp32 and/or bf16, comma-separated")
    parser.add_argument("--variants", type=_csv, default=shard_bench.VARIANTS,
                        help=f"comma-separated subset of {','.join(shard_bench.VARIANTS)} (default all)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    parser.add_argument("--trace-dir", default=None, help="keep rank 0's profiler traces here")
    parser.add_argument("--figure", default=None,
                        help="write the FSDP timeline of the last dtype (bf16 by default) to this PNG")
    parser.add_argument("--out", default=None, help="append rows (with provenance) to this JSONL file")
    parser.add_argument("--markdown", metavar="ROWS", default=None,
                        help="print the rows of this JSONL file as markdown tables and exit")
    parser.add_argument("--fill", metavar="SECTION", default=None,
                        help="with --markdown: rewrite the <!-- table:shard_* --> blocks of this markdown file")


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        tables = shard_bench.writeup_tables(read_rows(args.markdown))
        if args.fill:
            section = Path(args.fill)
            section.write_text(fill_tables(section.read_text(), tables))
        else:
            print(*tables.values(), sep="\n\n")
        return 0
    try:
        config = shard_bench.ShardBenchConfig(
            size=args.size or ("xl" if torch.cuda.is_available() else "tiny"),
            context_length=args.context_length, global_batch=args.global_batch, world_size=args.world_size,
            backend=args.backend, dtypes=args.dtypes, variants=args.variants, warmup=args.warmup, steps=args.steps,
        )
    except ValueError as e:
        raise SystemExit(f"cs336 shard: {e}") from None
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = args.trace_dir or tmp
        rows = shard_bench.run_shard_bench(config, trace_dir)
        if not rows:  # a torchrun rank other than 0
            return 0
        print(format_table(rows, shard_bench.MEMORY_COLUMNS, floatfmt=".2f"))
        print(format_table(rows, [c for c in shard_bench.TIME_COLUMNS if c != "vs_fsdp2"], floatfmt=".2f"))
        if args.figure and "fsdp" in config.variants:
            path = shard_bench.fsdp_timeline_from_rows(rows, trace_dir, config.dtypes[-1], args.figure)
            print(f"timeline: {path}")
    if args.out:
        append_rows(args.out, rows)
    return 0
