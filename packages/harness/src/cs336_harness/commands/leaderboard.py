"""``cs336 leaderboard``: time the handout's leaderboard training step (8B, context 32768, batch 2, two GPUs).

Without CUDA the defaults are a CPU try-out instead (tiny model, vocabulary 1000, context 32, fp32, two gloo
ranks, Triton kernels in the interpreter), which finishes in seconds. See ``cs336_harness.leaderboard``.

Examples::

    uv run cs336 leaderboard                                        # CPU try-out, or the real run on 2 GPUs
    uv run cs336 leaderboard --out writeup/results/leaderboard.jsonl
    uv run cs336 leaderboard --attention sdpa --optimizer torch-adamw   # ablations, one piece at a time
    uv run cs336 leaderboard --size xl --context-length 4096 --vocab-size 32000 --steps 5
    uv run cs336 leaderboard --markdown writeup/results/leaderboard.jsonl --fill writeup/sections/10-leaderboard.md
    torchrun --nproc-per-node 2 -m cs336_harness.cli leaderboard
"""

from __future__ import annotations

import argparse
import sys

import torch
from cs336_basics.config import PRESETS

from cs336_harness.analysis.tables import format_table, print_or_fill
from cs336_harness.commands._shared import add_quiet_argument
from cs336_harness.results import append_rows, read_rows
from cs336_harness.studies import leaderboard

_SIZED = ("size", "vocab_size", "context_length", "global_batch", "world_size", "compute_dtype")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    gpu, cpu = leaderboard.LEADERBOARD_DEFAULTS, leaderboard.CPU_DEFAULTS

    def default(name: str) -> str:
        return f"default {gpu[name]} with CUDA, {cpu[name]} without"

    parser.add_argument("--size", default=None, help=f"{', '.join(PRESETS)} ({default('size')})")
    parser.add_argument("--vocab-size", type=int, default=None, help=default("vocab_size"))
    parser.add_argument("--context-length", type=int, default=None, help=default("context_length"))
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step over all ranks "
                        f"({default('global_batch')})")
    parser.add_argument("--world-size", type=int, default=None, help=f"ranks ({default('world_size')})")
    parser.add_argument("--compute-dtype", default=None, help=f"bf16 | fp32 ({default('compute_dtype')})")
    parser.add_argument("--backend", default=None, help="nccl | gloo (default: nccl with CUDA, gloo without)")
    parser.add_argument("--attention", default="triton", help=f"{' | '.join(leaderboard.ATTENTIONS)} (default triton)")
    parser.add_argument("--checkpoint", default="all",
                        help="activation checkpointing policy: none, all, group:K, first:N, sqrt, nested:B, "
                             "selective, attention (default all)")
    parser.add_argument("--optimizer", default="fused-adamw",
                        help="fused-adamw (our Triton FusedAdamW, default) | torch-adamw (torch.optim.AdamW, fused)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument("--time-limit-s", type=float, default=600.0,
                        help="stop before any step that would start later than this, model build included "
                             "(default 600)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="append the row (with provenance) to this JSONL file")
    parser.add_argument("--markdown", metavar="ROWS", default=None,
                        help="print this JSONL file's leaderboard-configuration rows as a markdown table; run nothing")
    parser.add_argument("--fill", metavar="SECTION", default=None,
                        help="with --markdown: rewrite the <!-- table:leaderboard --> block of this markdown file")
    add_quiet_argument(parser)


def config_from_args(args: argparse.Namespace) -> leaderboard.LeaderboardConfig:
    """The run's config: flags given, else the leaderboard defaults with CUDA and the CPU try-out without."""
    defaults = leaderboard.LEADERBOARD_DEFAULTS if torch.cuda.is_available() else leaderboard.CPU_DEFAULTS
    sized = {name: defaults[name] if getattr(args, name) is None else getattr(args, name) for name in _SIZED}
    return leaderboard.LeaderboardConfig(
        **sized, backend=args.backend, attention=args.attention, checkpoint=args.checkpoint,
        optimizer=args.optimizer, warmup=args.warmup, steps=args.steps, time_limit_s=args.time_limit_s,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        try:
            tables = leaderboard.writeup_tables(read_rows(args.markdown))
            if tables == leaderboard.writeup_tables([]):
                print(f"cs336 leaderboard: {args.markdown} has no ok rows of the leaderboard configuration (8B, "
                      "context 32768, global batch 2, 2 ranks, bf16); the table is empty", file=sys.stderr)
            print_or_fill(tables, args.fill)
        except ValueError as e:
            raise SystemExit(f"cs336 leaderboard: {e}") from None
        return 0
    try:
        config = config_from_args(args)
    except ValueError as e:
        raise SystemExit(f"cs336 leaderboard: {e}") from None
    try:
        progress = None if args.quiet else lambda msg: print(msg, file=sys.stderr)
        rows = leaderboard.run_leaderboard(config, progress=progress)
    except leaderboard.TimeLimitExceeded as e:
        print(f"cs336 leaderboard: stopped: {e}", file=sys.stderr)
        return 1
    if not rows:  # a torchrun rank other than 0
        return 0
    print(format_table(rows, leaderboard.TABLE_COLUMNS, floatfmt=".4g"))
    if rows[0].get("peak_step_gib_per_rank") is not None:
        print("peak memory per rank (GiB): " + ", ".join(f"{p:.2f}" for p in rows[0]["peak_step_gib_per_rank"]))
    if args.out:
        append_rows(args.out, rows)
    return 0
