"""``cs336 sizes``: the model-size table with parameter counts and fp32 training-state memory."""

from __future__ import annotations

import argparse

from cs336_harness.presets import DEFAULT_VOCAB_SIZE, MODEL_SIZES, num_params
from cs336_harness.results import format_table

HELP = "print the model-size presets with parameter counts and training-state memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="vocabulary size (default 10000)")


def run(args: argparse.Namespace) -> int:
    if args.vocab_size <= 0:
        raise SystemExit(f"--vocab-size must be positive, got {args.vocab_size}")
    rows = []
    for name, s in MODEL_SIZES.items():
        n = num_params(s, args.vocab_size)
        rows.append({
            "size": name, "d_model": s.d_model, "d_ff": s.d_ff, "num_layers": s.num_layers,
            "num_heads": s.num_heads, "params (M)": n / 1e6,
            # fp32 parameter + gradient + two AdamW moments = 16 bytes per parameter
            "param+grad+adam (GiB)": 16 * n / 2**30,
        })
    print(format_table(rows, list(rows[0]), floatfmt=".1f"))
    return 0
