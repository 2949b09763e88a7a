"""Flags that several commands share, defined once."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cs336_basics.config import DEFAULT_CONTEXT_LENGTH, PRESETS

from cs336_harness.analysis.tables import columns_with_values, format_table, print_or_fill
from cs336_harness.device import CPU_CONTEXT_LENGTH
from cs336_harness.results import RowKind, read_rows_of


def attention_shape(text: str) -> tuple[int, int, int, int]:
    """An argparse ``type`` for an attention shape ``b,h,s,d``: four positive ints."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) <= 0:
        raise argparse.ArgumentTypeError(f"expected four positive ints b,h,s,d, got {text!r}")
    return shape


def csv_of(convert: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """An argparse ``type`` for a non-empty comma-separated list, each item passed through ``convert``; an empty
    item (``fp32,,bf16``) or one given twice (which would run and write the same rows twice) is an error."""

    def parse(text: str) -> tuple[Any, ...]:
        expected = f"expected a comma-separated list of {convert.__name__} values"
        parts = [v.strip() for v in text.split(",")]
        try:
            items = tuple(convert(v) for v in parts if v)
        except ValueError:
            items = ()
        if not items or not all(parts):
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}" + ("" if all(parts) else " (an empty item)"))
        twice = [v for i, v in enumerate(items) if v in items[:i]]
        if twice:
            raise argparse.ArgumentTypeError(f"{expected}, each once, got {text!r} ({twice[0]} twice)")
        return items

    return parse


def add_quiet_argument(parser: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress bar on stderr (the command's tables and messages still print)."""
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")


def add_distributed_run_arguments(
    parser: argparse.ArgumentParser, variants: Sequence[str], default_dtypes: Sequence[str]
) -> None:
    """The flags shared by the multi-rank training benchmarks (``cs336 ddp``, ``cs336 shard``)."""
    parser.add_argument("--size", default=None, help=f"{', '.join(PRESETS)} (default xl with CUDA, tiny without)")
    parser.add_argument("--context-length", type=int, default=None,
                        help=f"default {DEFAULT_CONTEXT_LENGTH} with CUDA, {CPU_CONTEXT_LENGTH} without")
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step over all ranks (default 4)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--backend", default=None, help="nccl | gloo (default: nccl with CUDA, gloo without)")
    parser.add_argument("--compute-dtype", type=csv_of(str), default=tuple(default_dtypes),
                        help=f"comma list of fp32, bf16 (default {','.join(default_dtypes)})")
    parser.add_argument("--variants", type=csv_of(str), default=tuple(variants),
                        help=f"comma list, a subset of {','.join(variants)} (default all)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    parser.add_argument("--trace-dir", default=None, help="keep rank 0's profiler traces here")
    parser.add_argument("--out", default=None, help="append rows (with provenance) to this JSONL file")
    add_quiet_argument(parser)


def distributed_run_fields(args: argparse.Namespace) -> dict[str, Any]:
    """Config fields from :func:`add_distributed_run_arguments`'s flags, with the CPU/GPU defaults."""
    import torch

    cuda = torch.cuda.is_available()
    default_context = DEFAULT_CONTEXT_LENGTH if cuda else CPU_CONTEXT_LENGTH
    return dict(
        size=args.size or ("xl" if cuda else "tiny"),
        context_length=default_context if args.context_length is None else args.context_length,
        global_batch=args.global_batch, world_size=args.world_size, backend=args.backend, dtypes=args.compute_dtype,
        variants=args.variants, warmup=args.warmup, steps=args.steps,
    )


def print_measured_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], floatfmt: str,
                         cuda_only: str | None = None) -> None:
    """Print the ``columns`` of ``rows`` that hold a value, then name the ones left out; ``cuda_only`` (printed
    when the rows ran on gloo) says which of them only a GPU measures."""
    shown, empty = columns_with_values(rows, columns)
    print(format_table(rows, shown, floatfmt=floatfmt))
    if empty:
        print(f"left out, no value in any row: {', '.join(empty)}")
    if empty and cuda_only and rows[0].get("backend") == "gloo":
        print(f"on CPU (gloo) {cuda_only}")


def add_markdown_arguments(parser: argparse.ArgumentParser, fill: bool) -> None:
    """``--markdown ROWS...`` (tables from saved rows, nothing run) and, with ``fill``, ``--fill SECTION``."""
    parser.add_argument("--markdown", metavar="ROWS", nargs="+", default=None,
                        help="print the tables of these JSONL files' rows as markdown; run nothing")
    if fill:
        parser.add_argument("--fill", metavar="SECTION", default=None,
                            help="with --markdown: rewrite the <!-- table:NAME --> blocks of this markdown file "
                                 "instead of printing")


def markdown_requested(args: argparse.Namespace) -> bool:
    """Whether the command should make tables from saved rows (:func:`print_markdown`) instead of running."""
    return args.markdown is not None or getattr(args, "fill", None) is not None


def print_markdown(args: argparse.Namespace, kind: RowKind,
                   tables: Callable[[list[dict[str, Any]]], Mapping[str, str]], empty: str | None = None) -> int:
    """``--markdown`` / ``--fill`` of every command that has them: the rows of ``kind`` in the files given, made into
    ``tables`` (marker name -> markdown), printed or filled into the section. Lines of other kinds are left out with
    a note on stderr.

    Raises:
        SystemExit: with one line, if ``--fill`` comes without ``--markdown``, a file or section cannot be read, no
            line is a row of ``kind``, or the rows make no table (``empty`` says why, if the command knows).
    """
    try:
        if args.markdown is None:
            raise ValueError("--fill SECTION needs --markdown ROWS, the rows to make its tables from")
        rows, notes = read_rows_of(args.markdown, kind)
        for note in notes:
            print(f"cs336 {kind.name}: {note}", file=sys.stderr)
        made = tables(rows)
        if not made:
            raise ValueError(empty or f"the {kind.name} rows given make no table")
        print_or_fill(made, getattr(args, "fill", None))
    except ValueError as e:
        raise SystemExit(f"cs336 {kind.name}: {e}") from None
    return 0
