"""``cs336 precision``: low-precision accumulation, autocast dtypes of a toy model, layer norm in fp16 vs bf16.

Examples::

    uv run cs336 precision                         # CPU (fp16 autocast through CPU autocast)
    uv run cs336 precision --device cuda --out precision.jsonl
"""

from __future__ import annotations

import argparse

import torch

from cs336_harness.analysis.tables import format_table
from cs336_harness.results import append_rows
from cs336_harness.studies.precision import accumulation_sums, layernorm_error, toy_model_dtypes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    parser.add_argument("--device", default="cpu", help="device for the toy-model dtypes: cpu (default) | cuda")
    parser.add_argument("--out", metavar="FILE", default=None, help="append rows (with provenance) to this JSONL")


def run(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"cs336 precision: device {args.device!r} asked for, but CUDA is not available here")
    sums = accumulation_sums()
    dtypes = toy_model_dtypes(args.device)
    ln = layernorm_error()
    print(format_table(sums, ["sum", "value", "abs_error"], floatfmt=".6f"))
    print()
    print(format_table([{"what": k, "dtype": v} for k, v in dtypes.items()], ["what", "dtype"]))
    print()
    print(format_table(ln, list(ln[0]), floatfmt=".4g"))
    if args.out:
        rows = [{"experiment": "accumulation", "device": "cpu", **r} for r in sums]
        rows += [{"experiment": "toy_dtypes", "on_device": args.device, "what": k, "dtype": v}
                 for k, v in dtypes.items()]
        rows += [{"experiment": "layernorm", **r} for r in ln]
        append_rows(args.out, rows)
    return 0
