"""``cs336 attention``: plain / compiled PyTorch attention, FlashAttention-2 vs PyTorch and SDPA, anchors, packed
documents and sliding windows (``studies/attention.py``, ``studies/attention_varlen.py``).

Examples::

    bash tools/gpu.sh python3 -m cs336_harness.cli attention --out writeup/results/attention.jsonl
    bash tools/gpu.sh python3 -m cs336_harness.cli attention --part anchors
    bash tools/gpu.sh python3 -m cs336_harness.cli attention --part anchors --anchor-impls ours,sdpa,fa4
    bash tools/gpu.sh python3 -m cs336_harness.cli attention --part varlen --part window
    bash tools/gpu.sh python3 -m cs336_harness.cli attention --part varlen --varlen-impls ours,fa4 --varlen-seed 1
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
from cs336_harness.studies.attention_varlen import (
    VARLEN_PARTS,
    VarlenBenchConfig,
    run_varlen_bench,
    varlen_tables,
)

_SWEEP_FIELDS = ("d", "seq", "batch", "device", "passes")
# What attention_tables reads of each part's rows (gluon_attention: the Gluon kernels' first timings).
ROWS = RowKind("attention", "bench", {
    "pytorch": _SWEEP_FIELDS, "compiled": _SWEEP_FIELDS, "anchors": ("impl", "batch", "heads", "seq", "d", "device"),
    "flash": ("impl", "dtype", "d", "seq", "device"), "gluon_attention": ("impl", "shape", "pass", "ms", "device"),
    "varlen": ("impl", "tokens", "heads", "heads_kv", "d", "docs", "doc_seed", "doc_range"),
    "window": ("impl", "batch", "heads", "seq", "d", "window"),
})

# --quick: a handful of sizes from each sweep, enough to see the trends within minutes.
_QUICK = {
    "head_dims": (16, 128), "seq_lens": (256, 4096), "passes": 10,
    "flash_head_dims": (64, 128), "flash_seq_lens": (1024, 8192, 32768),
}
_QUICK_VARLEN = {"tokens": 8192, "doc_lengths": (256, 2048), "window_shape": (1, 32, 8192, 128), "window": 1024}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    d = AttentionBenchConfig  # the dataclass defaults, read off the class
    dv = VarlenBenchConfig
    parser.add_argument("--part", choices=PARTS + VARLEN_PARTS, action="append", default=None,
                        help="run only this part (repeatable; default all)")
    parser.add_argument("--quick", action="store_true",
                        help="a few sizes of each sweep, 10 passes; the varlen and window parts at 8,192 tokens")
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
    parser.add_argument("--varlen-tokens", type=int, default=dv.tokens,
                        help=f"varlen part: tokens in the packed batch (default {dv.tokens})")
    parser.add_argument("--varlen-heads", type=csv_of(int), default=dv.heads, metavar="HQ,HKV",
                        help=f"varlen part: comma list of query and key/value heads (default "
                             f"{dv.heads[0]},{dv.heads[1]})")
    parser.add_argument("--varlen-head-dim", type=int, default=dv.head_dim,
                        help=f"varlen part: head dim (default {dv.head_dim})")
    parser.add_argument("--varlen-doc-lengths", type=csv_of(int), default=dv.doc_lengths, metavar="MIN,MAX",
                        help=f"varlen part: comma list of the shortest and longest document drawn (default "
                             f"{dv.doc_lengths[0]},{dv.doc_lengths[1]})")
    parser.add_argument("--varlen-seed", type=int, default=dv.seed,
                        help=f"varlen and window parts: seed of the document lengths and inputs (default {dv.seed})")
    parser.add_argument("--varlen-impls", type=csv_of(str), default=dv.impls,
                        help=f"varlen part: comma list of implementations (default all: {','.join(dv.impls)})")
    parser.add_argument("--window-shape", type=attention_shape, default=dv.window_shape, metavar="B,H,S,D",
                        help=f"window part: the shape (default {','.join(map(str, dv.window_shape))})")
    parser.add_argument("--window", type=int, default=dv.window,
                        help=f"window part: keys each query sees, itself included (default {dv.window})")
    parser.add_argument("--window-impls", type=csv_of(str), default=dv.window_impls,
                        help=f"window part: comma list of implementations (default all: {','.join(dv.window_impls)})")
    parser.add_argument("--varlen-rep-ms", type=int, default=dv.rep_ms,
                        help=f"varlen and window parts: do_bench repetition (default {dv.rep_ms})")
    parser.add_argument("--precompile-jobs", type=int, default=d.precompile_jobs,
                        help="compile our kernels' autotuning candidates in this many processes first")
    parser.add_argument("--out", default=None, help="append each row (with provenance) to this JSONL file")
    add_markdown_arguments(parser, fill=True)
    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    if markdown_requested(args):
        return print_markdown(args, ROWS, lambda rows: attention_tables(rows) | varlen_tables(rows))
    sizes = {
        "head_dims": args.head_dims, "seq_lens": args.seq_lens, "passes": args.passes,
        "flash_head_dims": args.flash_head_dims, "flash_seq_lens": args.flash_seq_lens,
    }
    varlen_sizes = {"tokens": args.varlen_tokens, "doc_lengths": args.varlen_doc_lengths,
                    "window_shape": args.window_shape, "window": args.window}
    if args.quick:
        sizes |= _QUICK
        varlen_sizes |= _QUICK_VARLEN
    parts = tuple(args.part or PARTS + VARLEN_PARTS)
    try:
        config = AttentionBenchConfig(
            parts=tuple(p for p in parts if p in PARTS), batch=args.batch, flash_dtypes=args.flash_dtypes,
            warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, anchor_rep_ms=args.anchor_rep_ms,
            anchor_shapes=tuple(args.anchor_shapes), anchor_impls=args.anchor_impls,
            precompile_jobs=args.precompile_jobs, **sizes,
        ) if set(parts) & set(PARTS) else None
        varlen_config = VarlenBenchConfig(
            parts=tuple(p for p in parts if p in VARLEN_PARTS), heads=args.varlen_heads, head_dim=args.varlen_head_dim,
            seed=args.varlen_seed, impls=args.varlen_impls, window_impls=args.window_impls,
            warmup_ms=args.warmup_ms, rep_ms=args.varlen_rep_ms, **varlen_sizes,
        ) if set(parts) & set(VARLEN_PARTS) else None
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
        bar.set_postfix_str(f"last: {what} seq {row.get('seq', row.get('tokens'))} d {row['d']}")
        bar.update()
        if args.out:
            append_rows(args.out, [row], meta)

    if config is not None:
        run_attention_bench(config, on_row)
    if varlen_config is not None:
        run_varlen_bench(varlen_config, on_row)
    bar.close()
    return 0
