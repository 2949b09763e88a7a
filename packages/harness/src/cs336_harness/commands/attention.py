"""``cs336 attention``: plain / compiled PyTorch attention, FlashAttention-2 vs PyTorch and SDPA, anchors.

Examples::

    bash tools/gpu.sh python3 -m cs336_harness.cli attention --out writeup/results/attention.jsonl
    bash tools/gpu.sh python3 -m cs336_harness.cli attention --part anchors
    bash tools/gpu.sh python3 -m cs336_harness.cli attention --part anchors --anchor-impls ours,sdpa,fa4
    uv run cs336 attention --quick --part flash            # a few sizes only, within a minute or two
    uv run cs336 attention --markdown writeup/results/attention_*.jsonl   # tables from saved rows
    uv run cs336 attention --markdown writeup/results/attention_*.jsonl --fill writeup/sections/04-attention.md
"""

from __future__ import annotations

import argparse
import sys

import torch

from cs336_harness.commands._shared import (
    add_markdown_arguments,
    add_quiet_argument,
    attention_shape,
    csv_of,
    markdown_requested,
    print_markdown,
)
from cs336_harness.progress import progress_bar
from cs336_harness.results import RowKind, append_rows, check_writable, provenance
from cs336_harness.studies.attention import (
    PARTS,
    AttentionBenchConfig,
    attention_tables,
    run_attention_bench,
)

_SWEEP_FIELDS = ("d", "seq", "batch", "device", "passes")
# What attention_tables reads of each part's rows (gluon_attention: the Gluon kernels' first timings).
ROWS = RowKind("attention", "bench", {
    "pytorch": _SWEEP_FIELDS, "compiled": _SWEEP_FIELDS, "anchors": ("impl", "batch", "heads", "seq", "d", "device"),
    "flash": ("impl", "dtype", "d", "seq", "device"), "gluon_attention": ("impl", "shape", "pass", "ms", "device"),
})

# --quick: a handful of sizes from each sweep, enough to see the trends within minutes.
_QUICK = {
    "head_dims": (16, 128), "seq_lens": (256, 4096), "passes": 10,
    "flash_head_dims": (64, 128), "flash_seq_lens": (1024, 8192, 32768),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    d = AttentionBenchConfig  # the dataclass defaults, read off the class
    parser.add_argument("--part", choices=PARTS, action="append", default=None,
                        help="run only this part (repeatable; default all)")
    parser.add_argument("--quick", action="store_true", help="a few sizes of each sweep, 10 passes")
    parser.add_argument("--head-dims", type=csv_of(int), default=d.head_dims,
                        help="pytorch/compiled parts: comma list of head dims")
    parser.add_argument("--seq-lens", type=csv_of(int), default=d.seq_lens,
                        help="pytorch/compiled parts: comma list of sequence lengths")
    parser.add_argument("--batch", type=int, default=d.batch, help="pytorch/compiled parts (default 8)")
    parser.add_argument("--passes", type=int, default=d.passes, help="timed passes each way (default 100)")
    parser.add_argument("--flash-dtypes", type=csv_of(str), default=d.flash_dtypes,
                        help="flash part: comma list of dtypes (default bf16,fp32)")
    parser.add_argument("--flash-head-dims", type=csv_of(int), default=d.flash_head_dims,
                        help="flash part: comma list of head dims")
    parser.add_argument("--flash-seq-lens", type=csv_of(int), default=d.flash_seq_lens,
                        help="flash part: comma list of sequence lengths (default 128..65536, powers of 2)")
    parser.add_argument("--warmup-ms", type=int, default=d.warmup_ms, help="do_bench warm-up (default 10)")
    parser.add_argument("--rep-ms", type=int, default=d.rep_ms, help="do_bench repetition (default 50)")
    parser.add_argument("--anchor-rep-ms", type=int, default=d.anchor_rep_ms, help="anchors part (default 1000)")
    parser.add_argument("--anchor-shapes", type=attention_shape, nargs="+", default=d.anchor_shapes, metavar="B,H,S,D",
                        help="anchors part: the shapes (default the three anchors)")
    parser.add_argument("--anchor-impls", type=csv_of(str), default=d.anchor_impls,
                        help=f"anchors part: comma list of implementations (default all: {','.join(d.anchor_impls)})")
    parser.add_argument("--precompile-jobs", type=int, default=d.precompile_jobs,
                        help="compile our kernels' autotuning candidates in this many processes first")
    parser.add_argument("--out", default=None, help="append each row (with provenance) to this JSONL file")
    add_markdown_arguments(parser, fill=True)
    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    if markdown_requested(args):
        return print_markdown(args, ROWS, attention_tables)
    sizes = {
        "head_dims": args.head_dims, "seq_lens": args.seq_lens, "passes": args.passes,
        "flash_head_dims": args.flash_head_dims, "flash_seq_lens": args.flash_seq_lens,
    }
    if args.quick:
        sizes |= _QUICK
    try:
        config = AttentionBenchConfig(
            parts=tuple(args.part or PARTS), batch=args.batch, flash_dtypes=args.flash_dtypes,
            warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, anchor_rep_ms=args.anchor_rep_ms,
            anchor_shapes=tuple(args.anchor_shapes), anchor_impls=args.anchor_impls,
            precompile_jobs=args.precompile_jobs, **sizes,
        )
        if args.out:
            check_writable(args.out)
    except ValueError as e:
        raise SystemExit(f"cs336 attention: {e}") from None
    if not torch.cuda.is_available():
        raise SystemExit("cs336 attention: the attention benchmarks time GPU kernels and need a CUDA GPU "
                         "(use --markdown ROWS to render existing results)")
    meta = provenance()
    bar = progress_bar(total=None, desc="attention", enabled=not args.quiet, unit="row")

    def on_row(row: dict) -> None:
        # Rows are written as they come, so a run stopped part-way keeps what it measured.
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}
        bar.write(" ".join(f"{k}={v}" for k, v in shown.items()), file=sys.stdout)
        what = " ".join(str(row[k]) for k in ("bench", "impl", "dtype") if k in row)
        bar.set_postfix_str(f"last: {what} seq {row['seq']} d {row['d']}")
        bar.update()
        if args.out:
            append_rows(args.out, [row], meta)

    run_attention_bench(config, on_row)
    bar.close()
    return 0
