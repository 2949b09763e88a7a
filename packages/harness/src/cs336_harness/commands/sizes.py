"""``cs336 sizes``: the model-size table with parameter counts and fp32 training-state memory."""

from __future__ import annotations

import argparse

from cs336_basics.config import DEFAULT_VOCAB_SIZE, PRESETS, ModelConfig

from cs336_harness.analysis.tables import format_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="vocabulary size (default 10000)")


def run(args: argparse.Namespace) -> int:
    if args.vocab_size <= 0:
        raise SystemExit(f"--vocab-size must be positive, got {args.vocab_size}")
    rows = []
    for name in PRESETS:
        config = ModelConfig.from_preset(name, vocab_size=args.vocab_size)
        n = config.num_params
        rows.append({
            "size": name, "d_model": config.d_model, "d_ff": config.d_ff, "num_layers": config.num_layers,
            "num_heads": config.num_heads, "params (M)": n / 1e6,
            # fp32 parameter + gradient + two AdamW moments = 16 bytes per parameter
            "param+grad+adam (GiB)": 16 * n / 2**30,
        })
    print(format_table(rows, list(rows[0]), floatfmt=".1f"))
    return 0
