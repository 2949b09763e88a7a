"""``cs336 precision``: low-precision accumulation, autocast dtypes of a toy model, layer norm in fp16 vs bf16.

The sums and the layer norm run on the CPU; ``--device`` picks where the toy model runs under autocast, and each
table's ``on_device`` column says where its rows ran (autocast picks some output dtypes differently on CPU and CUDA).

Examples::

    uv run cs336 precision                         # CPU (fp16 autocast through CPU autocast)
    uv run cs336 precision --device cuda --out precision.jsonl
"""

from __future__ import annotations

import argparse

from cs336_harness.analysis.tables import format_table
from cs336_harness.device import check_device
from cs336_harness.results import append_rows, check_writable
from cs336_harness.studies.precision import accumulation_sums, layernorm_error, toy_model_dtypes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    parser.add_argument("--device", default="cpu", help="where the toy model runs: cpu (default) | cuda | cuda:N")
    parser.add_argument("--out", metavar="FILE", default=None, help="append rows (with provenance) to this JSONL")


def run(args: argparse.Namespace) -> int:
    try:
        check_device(args.device)
        if args.out:
            check_writable(args.out)
    except ValueError as e:
        raise SystemExit(f"cs336 precision: {e}") from None
    sums = [{"experiment": "accumulation", "on_device": "cpu", **r} for r in accumulation_sums()]
    dtypes = [{"experiment": "toy_dtypes", "on_device": args.device, "what": k, "dtype": v}
              for k, v in toy_model_dtypes(args.device).items()]
    ln = [{"experiment": "layernorm", "on_device": "cpu", **r} for r in layernorm_error()]
    print(format_table(sums, ["on_device", "sum", "value", "abs_error"], floatfmt=".6f"))
    print()
    print(format_table(dtypes, ["on_device", "what", "dtype"]))
    print()
    print(format_table(ln, [c for c in ln[0] if c != "experiment"], floatfmt=".4g"))
    if args.out:
        append_rows(args.out, sums + dtypes + ln)
    return 0
