"""``cs336 hf``: the training step of Hugging Face Llama-3.2-1B- and Qwen3-1.7B-shaped models with random weights,
as they come (SDPA), with Liger-Kernel's patch and with ours (``cs336_kernels.hf``): tokens per second and peak
memory. On a CPU: two-layer models, a few steps, our kernels in Triton's interpreter (about a minute).

Examples::

    bash tools/gpu.sh python3 -m cs336_harness.cli hf --out writeup/results/hf_step.jsonl
    uv run cs336 hf                                   # the tiny models on a CPU
    uv run cs336 hf --model qwen3-1.7b --impl ours,liger --layout batched --steps 20
    uv run cs336 hf --model llama-3.2-1b --impl ours,liger --layout batched --profile   # GPU time by kind
"""

from __future__ import annotations

import argparse

import torch

from cs336_harness.analysis import kernel_kinds
from cs336_harness.analysis.tables import format_table
from cs336_harness.commands._shared import add_quiet_argument, csv_of
from cs336_harness.results import append_rows, check_writable
from cs336_harness.studies.hf_step import CPU_MODELS, GPU_MODELS, IMPLS, LAYOUTS, MODELS, HFStepConfig, run_hf_step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    d = HFStepConfig  # the GPU defaults, read off the class
    parser.add_argument("--model", type=csv_of(str), default=None,
                        help=f"comma list of {', '.join(MODELS)} (default {','.join(GPU_MODELS)} with CUDA, "
                             f"{','.join(CPU_MODELS)} without)")
    parser.add_argument("--impl", type=csv_of(str), default=None,
                        help=f"comma list, a subset of {','.join(IMPLS)} (default all)")
    parser.add_argument("--layout", choices=LAYOUTS, default=None,
                        help="packed: the documents in one row, positions restarting (DataCollatorWithFlattening); "
                             "batched: a row each (default packed)")
    parser.add_argument("--batch", type=int, default=None, help=f"documents per step (default {d.batch}; 2 on CPU)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"tokens per document (default {d.seq_len}; 16 on CPU)")
    parser.add_argument("--dtype", default=None, help=f"weights, gradients, optimizer state (default {d.dtype}; fp32 "
                                                      f"on CPU)")
    parser.add_argument("--warmup", type=int, default=None, help=f"untimed steps (default {d.warmup}; 1 on CPU)")
    parser.add_argument("--steps", type=int, default=None, help=f"timed steps (default {d.steps}; 2 on CPU)")
    parser.add_argument("--profile", action="store_true",
                        help="one more step per row under torch.profiler: its GPU time by kind of kernel and the "
                             "kernels that took the most (GPU only)")
    parser.add_argument("--out", default=None, help="append rows (with provenance) to this JSONL file")
    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    try:
        config = HFStepConfig.for_device(
            torch.cuda.is_available(), models=args.model, impls=args.impl, layout=args.layout, batch=args.batch,
            seq_len=args.seq_len, dtype=args.dtype, warmup=args.warmup, steps=args.steps, profile=args.profile)
        if args.out:
            check_writable(args.out)
        rows = run_hf_step(config, progress=not args.quiet)
    except ValueError as e:
        raise SystemExit(f"cs336 hf: {e}") from None
    if not rows:
        raise SystemExit("cs336 hf: no implementation ran (see the lines above)")
    columns = ["model", "impl", "layout", "tokens", "status", "step_ms", "tokens_per_s", "vs_liger", "peak_gib"]
    print(format_table(rows, columns, floatfmt=".3f"))
    for model in dict.fromkeys(r["model"] for r in rows):
        profiled = [r for r in rows if r["model"] == model and r.get("breakdown")]
        if not profiled:
            continue
        print(f"\n{model}: GPU time of one step by kind (ms), a column per impl\n"
              + kernel_kinds.breakdown_markdown(profiled, [r["impl"] for r in profiled]))
        for row in profiled:
            print(f"\n{model} {row['impl']}: the kernels with the most GPU time in that step\n"
                  + kernel_kinds.top_kernels_markdown(row["breakdown"]))
    if args.out:
        append_rows(args.out, rows)
    return 0
