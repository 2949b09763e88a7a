"""The ``cs336`` command. Each subcommand lives in ``cs336_harness.commands.<name>``.

A command module defines ``HELP`` (one line) and ``add_arguments(parser)``, and ``run(args) -> int``.
The CLI only parses flags; each command turns them into a frozen config and calls library code.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cs336_harness import commands

CPU_CONTEXT_LENGTH = 128  # keeps the CPU try-out of the multi-rank benchmarks to seconds per variant


def csv_of(convert: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """An argparse ``type`` for a non-empty comma-separated list, each item passed through ``convert``."""

    def parse(text: str) -> tuple[Any, ...]:
        items = tuple(convert(v.strip()) for v in text.split(",") if v.strip())
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return items

    return parse


def add_distributed_run_arguments(
    parser: argparse.ArgumentParser, variants: Sequence[str], default_dtypes: Sequence[str]
) -> None:
    """The flags shared by the multi-rank training benchmarks (``cs336 ddp``, ``cs336 shard``)."""
    from cs336_harness.presets import DEFAULT_CONTEXT_LENGTH, MODEL_SIZES

    parser.add_argument("--size", default=None, help=f"{', '.join(MODEL_SIZES)} (default xl with CUDA, tiny without)")
    parser.add_argument("--context-length", type=int, default=None,
                        help=f"default {DEFAULT_CONTEXT_LENGTH} with CUDA, {CPU_CONTEXT_LENGTH} without")
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step over all ranks (default 4)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--backend", default=None, help="nccl | gloo (default: nccl with CUDA, gloo without)")
    parser.add_argument("--dtypes", type=csv_of(str), default=tuple(default_dtypes),
                        help=f"fp32 and/or bf16, comma-separated (default {','.join(default_dtypes)})")
    parser.add_argument("--variants", type=csv_of(str), default=tuple(variants),
                        help=f"comma-separated subset of {','.join(variants)} (default all)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    parser.add_argument("--trace-dir", default=None, help="keep rank 0's profiler traces here")
    parser.add_argument("--out", default=None, help="append rows (with provenance) to this JSONL file")


def distributed_run_fields(args: argparse.Namespace) -> dict[str, Any]:
    """Config fields from :func:`add_distributed_run_arguments`'s flags, with the CPU/GPU defaults."""
    import torch

    from cs336_harness.presets import DEFAULT_CONTEXT_LENGTH

    cuda = torch.cuda.is_available()
    return dict(
        size=args.size or ("xl" if cuda else "tiny"),
        context_length=args.context_length or (DEFAULT_CONTEXT_LENGTH if cuda else CPU_CONTEXT_LENGTH),
        global_batch=args.global_batch, world_size=args.world_size, backend=args.backend, dtypes=args.dtypes,
        variants=args.variants, warmup=args.warmup, steps=args.steps,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cs336", description="Measure and speed up Transformer training on one or more GPUs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        p = sub.add_parser(info.name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
