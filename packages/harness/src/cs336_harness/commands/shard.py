"""``cs336 shard``: memory and step time of DDP, ZeRO-1 (our sharded optimizer), our FSDP and FSDP2.

Examples::

    uv run cs336 shard                                    # CPU: tiny model, 2 gloo ranks, seconds
    uv run cs336 shard --size xl --world-size 2 --compute-dtype fp32,bf16 \\
        --out writeup/results/shard.jsonl --figure writeup/figures/fsdp_timeline_bf16.png
    torchrun --nproc-per-node 2 -m cs336_harness.cli shard --size xl --world-size 2
    uv run cs336 shard --markdown writeup/results/shard.jsonl   # print the tables, run nothing
    uv run cs336 shard --markdown writeup/results/shard.jsonl --fill writeup/sections/06-sharding.md
"""

from __future__ import annotations

import argparse
import tempfile

from cs336_comms.process_group import RankDiedError

from cs336_harness.analysis.tables import print_or_fill
from cs336_harness.commands._shared import add_distributed_run_arguments, distributed_run_fields, print_measured_table
from cs336_harness.results import append_rows, check_writable, read_rows
from cs336_harness.studies import shard as shard_study


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    add_distributed_run_arguments(parser, shard_study.VARIANTS, default_dtypes=("fp32", "bf16"))
    parser.add_argument("--figure", default=None,
                        help="write the FSDP timeline of the last dtype (bf16 by default) to this PNG")
    parser.add_argument("--markdown", metavar="ROWS", default=None,
                        help="print the rows of this JSONL file as markdown tables and exit")
    parser.add_argument("--fill", metavar="SECTION", default=None,
                        help="with --markdown: rewrite the <!-- table:shard_* --> blocks of this markdown file")


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        try:
            print_or_fill(shard_study.writeup_tables(read_rows(args.markdown)), args.fill)
        except ValueError as e:
            raise SystemExit(f"cs336 shard: {e}") from None
        return 0
    try:
        config = shard_study.ShardBenchConfig(**distributed_run_fields(args))
        for path in (args.out, args.figure):
            if path:
                check_writable(path)
    except ValueError as e:
        raise SystemExit(f"cs336 shard: {e}") from None
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = args.trace_dir or tmp
        try:
            rows = shard_study.run_shard_bench(config, trace_dir, progress=not args.quiet)
        except RankDiedError as e:
            raise SystemExit(f"cs336 shard: {e}; the run asked for {config.describe()}") from None
        if not rows:  # a torchrun rank other than 0
            return 0
        print_measured_table(rows, shard_study.MEMORY_COLUMNS, floatfmt=".3g",
                             cuda_only="memory is measured on CUDA only (allocator statistics); params, grads and "
                                       "optimizer state are sizes of this rank's tensors")
        print()
        print_measured_table(rows, [c for c in shard_study.TIME_COLUMNS if c != "vs_fsdp2"], floatfmt=".2f",
                             cuda_only="there are no NCCL kernels to time")
        if args.figure and "fsdp" in config.variants:
            path = shard_study.fsdp_timeline_from_rows(rows, trace_dir, config.dtypes[-1], args.figure)
            print(f"timeline: {path}")
    if args.out:
        append_rows(args.out, rows)
    return 0
