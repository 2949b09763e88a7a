"""``cs336 tune``: widen our FlashAttention kernels' autotuning lists and time every candidate at the real shapes,
then ours against SDPA (needs a CUDA GPU); or, with ``--builds``, compile every listed and candidate config for
sm_90 and record registers, spills and instruction counts (no GPU). See ``cs336_harness.studies.attention_tuning``.

Without CUDA the CLI turns on Triton's interpreter, which cannot compile for a GPU: run the builds there with
``TRITON_INTERPRET=0``.

Examples::

    uv run cs336 tune --out attention_tuning.jsonl                     # one GPU
    uv run cs336 tune --shapes 1,32,32768,128 --rep-ms 500
    TRITON_INTERPRET=0 uv run cs336 tune --builds --out writeup/results/attention_builds.jsonl
"""

from __future__ import annotations

import argparse
import os

from cs336_harness.commands._shared import add_quiet_argument, attention_shape
from cs336_harness.results import check_writable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    parser.add_argument("--out", default=None, help="append rows (with provenance) to this JSONL file")
    parser.add_argument("--rep-ms", type=int, default=1000, help="do_bench repetition for the variants rows")
    parser.add_argument("--precompile-jobs", type=int, default=4, help="processes compiling candidates first")
    parser.add_argument("--shapes", type=attention_shape, nargs="+", default=None, metavar="B,H,S,D",
                        help="shapes to tune at (default: the two anchors and two more)")
    parser.add_argument("--builds", action="store_true",
                        help="no GPU: compile every config for sm_90 and record registers and spills")
    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from cs336_harness.studies import attention_tuning

    try:
        if args.out:
            check_writable(args.out)
    except ValueError as e:
        raise SystemExit(f"cs336 tune: {e}") from None
    if args.builds:
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise SystemExit("cs336 tune --builds compiles for sm_90, which Triton's interpreter (on here, as the CLI "
                             "sets it without CUDA) cannot: run it as TRITON_INTERPRET=0 cs336 tune --builds")
        attention_tuning.build_rows(args.out, progress=not args.quiet)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("cs336 tune times GPU kernels and needs a CUDA GPU (--builds needs none)")
    attention_tuning.run_tuning(tuple(args.shapes or attention_tuning.SHAPES), args.rep_ms, args.out,
                                args.precompile_jobs, progress=not args.quiet)
    return 0
