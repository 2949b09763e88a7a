"""``cs336 ddp``: time data-parallel training steps with each of our DDP wrappers and torch's DDP.

Examples::

    uv run cs336 ddp                                      # CPU: tiny model, 2 gloo ranks, seconds
    uv run cs336 ddp --size xl --world-size 2 --dtypes fp32,bf16 \\
        --out writeup/results/ddp.jsonl --figure-dir writeup/figures
    torchrun --nproc-per-node 2 -m cs336_harness.cli ddp --size xl --world-size 2
    uv run cs336 ddp --markdown writeup/results/ddp.jsonl  # print the rows as markdown tables, run nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch

from cs336_harness import ddp_bench
from cs336_harness.presets import DEFAULT_CONTEXT_LENGTH, MODEL_SIZES
from cs336_harness.results import append_rows, format_table, read_rows

CPU_CONTEXT_LENGTH = 128  # keeps the CPU try-out to seconds per variant
HELP = "time DDP training steps (naive, flat, overlapped, bucketed, torch DDP) with timelines"


def _csv(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    parser.add_argument("--size", default=None, help=f"{', '.join(MODEL_SIZES)} (default xl with CUDA, tiny without)")
    parser.add_argument("--context-length", type=int, default=None,
                        help=f"default {DEFAULT_CONTEXT_LENGTH} with CUDA, {CPU_CONTEXT_LENGTH} without")
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step over all ranks (default 4)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--backend", default=None, help="nccl | gloo (default: nccl with CUDA, gloo without)")
    parser.add_argument("--dtypes", type=_csv, default=("fp32",), help="fp32 and/or bf16 (autocast), comma-separated")
    parser.add_argument("--variants", type=_csv, default=ddp_bench.VARIANTS,
                        help=f"comma-separated subset of {','.join(ddp_bench.VARIANTS)} (default all)")
    parser.add_argument("--bucket-size-mb", type=float, default=25.0, help="bucketed and torch_ddp (default 25 MiB)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    parser.add_argument("--trace-dir", default=None, help="keep rank 0's profiler traces here")
    parser.add_argument("--figure-dir", default=None, help="write ddp_timeline_<dtype>.png here")
    parser.add_argument("--out", default=None, help="append rows (with provenance) to this JSONL file")
    parser.add_argument("--markdown", metavar="ROWS", default=None,
                        help="print the rows of this JSONL file as a markdown table and exit")


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        print(ddp_bench.ddp_markdown(read_rows(args.markdown)))
        return 0
    cuda = torch.cuda.is_available()
    try:
        config = ddp_bench.DDPBenchConfig(
            size=args.size or ("xl" if cuda else "tiny"),
            context_length=args.context_length or (DEFAULT_CONTEXT_LENGTH if cuda else CPU_CONTEXT_LENGTH),
            global_batch=args.global_batch, world_size=args.world_size,
            backend=args.backend, dtypes=args.dtypes, variants=args.variants, bucket_size_mb=args.bucket_size_mb,
            warmup=args.warmup, steps=args.steps, trace_dir=args.trace_dir,
        )
    except ValueError as e:
        raise SystemExit(f"cs336 ddp: {e}") from None
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = config.trace_dir or tmp
        config = dataclasses.replace(config, trace_dir=trace_dir)
        rows = ddp_bench.run_ddp_bench(config)
        if not rows:  # a torchrun rank other than 0
            return 0
        print(format_table(rows, ddp_bench.DDP_COLUMNS, floatfmt=".2f"))
        if args.figure_dir:
            for dtype in config.dtypes:
                path = Path(args.figure_dir) / f"ddp_timeline_{dtype}.png"
                ddp_bench.timeline_figure_from_rows(rows, trace_dir, dtype, path)
                print(f"timeline: {path}")
    if args.out:
        append_rows(args.out, [{k: v for k, v in r.items() if k != "trace_dir"} for r in rows])
    return 0
