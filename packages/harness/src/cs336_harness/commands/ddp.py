"""``cs336 ddp``: time data-parallel training steps with each of our DDP wrappers and torch's DDP.

Examples::

    uv run cs336 ddp                                      # CPU: tiny model, 2 gloo ranks, seconds
    uv run cs336 ddp --size xl --world-size 2 --compute-dtype fp32,bf16 \\
        --out writeup/results/ddp.jsonl --figure-dir writeup/figures
    torchrun --nproc-per-node 2 -m cs336_harness.cli ddp --size xl --world-size 2
    uv run cs336 ddp --markdown writeup/results/ddp.jsonl  # print the rows as markdown tables, run nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from cs336_comms.process_group import RankDiedError, check_world_size

from cs336_harness import resources
from cs336_harness.commands._shared import (
    add_distributed_run_arguments,
    add_markdown_arguments,
    distributed_run_fields,
    markdown_requested,
    print_markdown,
    print_measured_table,
)
from cs336_harness.device import DTYPES
from cs336_harness.results import RowKind, RowWriter, check_writable, check_writable_dir
from cs336_harness.studies import ddp as ddp_study

ROWS = RowKind("ddp", "variant", {v: ("dtype", "step_ms") for v in ddp_study.VARIANTS})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    add_distributed_run_arguments(parser, ddp_study.VARIANTS, default_dtypes=("fp32",))
    parser.add_argument("--bucket-size-mb", type=float, default=25.0, help="bucketed and torch_ddp (default 25 MiB)")
    parser.add_argument("--figure-dir", default=None, help="write ddp_timeline_<dtype>.png here")
    add_markdown_arguments(parser, fill=False)


def host_need(config: ddp_study.DDPBenchConfig) -> resources.HostMemoryNeed:
    """What the gloo ranks of ``config`` hold in this machine's memory: each trains the whole model (the model's own
    attention) on its share of the batch."""
    ranks, spawned = resources.ranks_here(config.world_size)
    model = config.model_config
    activations = resources.activation_bytes(
        model, config.global_batch // config.world_size, dtype_bytes=max(DTYPES[d].itemsize for d in config.dtypes),
        attention="eager", checkpoint="none", backward=True, fused_loss=False)
    return resources.HostMemoryNeed(
        f"ddp of size {config.size}, context {config.context_length}, global batch {config.global_batch} on "
        f"{config.world_size} ranks", resources.step_peak(model.num_params, activations, backward=True, adamw=True),
        ranks, spawned)


def table_notes(rows: list[dict]) -> list[str]:
    """What the printed table cannot say itself: why ``nocomm``'s replicas differ, and what an overhead below zero
    means."""
    notes = []
    if any(r["variant"] == "nocomm" for r in rows):
        notes.append("params_in_sync is False for nocomm by design: its ranks exchange no gradients, so each replica "
                     "trains on its own share of the batch and they differ from the first step")
    negative = [r["variant"] for r in rows if (r.get("overhead_ms") or 0) < 0]
    if negative:
        notes.append(f"overhead_ms below zero ({', '.join(negative)}): each step_ms is a median over a run of its "
                     "own, and the gradient exchange cost less than steps vary from run to run (step_max_ms shows "
                     "how much); read it as no overhead measurable here")
    return notes


def run(args: argparse.Namespace) -> int:
    if markdown_requested(args):
        return print_markdown(args, ROWS, lambda rows: {"ddp": ddp_study.ddp_markdown(
            [ddp_study.bucket_where_used(r) for r in rows])})
    try:
        config = ddp_study.DDPBenchConfig(
            **distributed_run_fields(args), bucket_size_mb=args.bucket_size_mb, trace_dir=args.trace_dir
        )
        check_world_size(config.world_size)
        if config.resolved_backend == "gloo":
            host_need(config).check()
        figures = {dtype: Path(args.figure_dir) / f"ddp_timeline_{dtype}.png"
                   for dtype in (config.dtypes if args.figure_dir else ())}
        for path in [*figures.values(), *([args.out] if args.out else [])]:
            check_writable(path)
        if args.trace_dir:
            check_writable_dir(args.trace_dir)
    except ValueError as e:
        raise SystemExit(f"cs336 ddp: {e}") from None
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = config.trace_dir or tmp
        config = dataclasses.replace(config, trace_dir=trace_dir)
        try:
            rows = ddp_study.run_ddp_bench(config, progress=not args.quiet, write=RowWriter.to(args.out))
        except RankDiedError as e:
            raise SystemExit(f"cs336 ddp: {e}; the run asked for {config.describe()}") from None
        if not rows:  # a torchrun rank other than 0
            return 0
        print_measured_table(rows, ddp_study.PRINTED_COLUMNS, floatfmt=".2f",
                             cuda_only="there are no NCCL kernels to time and no CUDA allocator to ask for peaks")
        for note in table_notes(rows):
            print(note)
        for dtype, path in figures.items():
            ddp_study.timeline_figure_from_rows(rows, trace_dir, dtype, path)
            print(f"timeline: {path}")
    return 0
