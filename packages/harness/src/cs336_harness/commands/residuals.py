"""``cs336 residuals``: how much autograd saves for backward in RMSNorm and in TransformerBlocks.

Examples::

    uv run cs336 residuals --experiment rmsnorm                 # quick on a CPU
    uv run cs336 residuals --device cuda --out residuals.jsonl  # the handout's xl block, batch 4, ctx 2048
"""

from __future__ import annotations

import argparse

from cs336_harness.results import append_rows
from cs336_harness.studies.residuals import EXPERIMENTS, ResidualsConfig, run_experiments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    parser.add_argument("--experiment", action="append", choices=EXPERIMENTS, default=None,
                        help="repeatable; default: all of them")
    parser.add_argument("--d-model", type=int, default=2560)
    parser.add_argument("--d-ff", type=int, default=10240)
    parser.add_argument("--num-heads", type=int, default=32, 
                        help="default 32, the xl preset (the handout's code used 16)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--device", default="cpu", help="cpu (default) | cuda | cuda:N")
    parser.add_argument("--out", metavar="FILE", default=None, help="append rows (with provenance) to this JSONL")


def run(args: argparse.Namespace) -> int:
    try:
        config = ResidualsConfig(
            experiments=tuple(args.experiment or EXPERIMENTS), d_model=args.d_model, d_ff=args.d_ff,
            num_heads=args.num_heads, batch_size=args.batch_size, context_length=args.context_length,
            device=args.device,
        )
    except ValueError as e:
        raise SystemExit(f"cs336 residuals: {e}") from None
    rows, lines = run_experiments(config)
    print("\n".join(lines))
    if args.out:
        append_rows(args.out, rows)
    return 0
