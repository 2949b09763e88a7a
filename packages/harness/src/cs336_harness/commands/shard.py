"""``cs336 shard``: memory and step time of DDP, ZeRO-1 (our sharded optimizer), our FSDP and FSDP2.

Examples::

    uv run cs336 shard                                    # CPU: tiny model, 2 gloo ranks, seconds
    uv run cs336 shard --size xl --world-size 2 --compute-dtype fp32,bf16 \\
        --out writeup/results/shard.jsonl --figure writeup/figures/fsdp_timeline_bf16.png
    torchrun --nproc-per-node 2 -m cs336_harness.cli shard --size xl --world-size 2
    uv run cs336 shard --markdown writeup/results/shard.jsonl   # print the tables, run nothing
    uv run cs336 shard --markdown writeup/results/shard.jsonl --fill writeup/sections/06-sharding.md
"""

from __future__ import annotations

import argparse
import tempfile

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
from cs336_harness.studies import shard as shard_study

ROWS = RowKind("shard", "variant", {v: ("dtype", "step_ms") for v in shard_study.VARIANTS})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    add_distributed_run_arguments(parser, shard_study.VARIANTS, default_dtypes=("fp32", "bf16"))
    parser.add_argument("--figure", default=None,
                        help="write the FSDP timeline of the last dtype (bf16 by default) to this PNG")
    add_markdown_arguments(parser, fill=True)


def _variant_peak(variant: str, num_params: int, world_size: int, activations: float) -> dict[str, float]:
    """A rank's peak under ``variant`` (:func:`cs336_harness.resources.step_peak`): DDP's whole state; ZeRO-1's with
    AdamW's state sharded; FSDP's (ours and FSDP2) sharded, or the whole fp32 model each rank builds before
    sharding it."""
    if variant == "ddp":
        return resources.step_peak(num_params, activations, backward=True, adamw=True)
    if variant == "zero1":
        weights = {"weights": 4 * num_params}
        update = {**weights, "gradients": 4 * num_params, "AdamW state": 8 * num_params / world_size}
        return resources.largest({**weights, "activations": activations}, update)
    shard = num_params / world_size
    return resources.largest({"weights (built whole, then sharded)": 4 * num_params},
                             resources.step_peak(shard, activations, backward=True, adamw=True))


def host_need(config: shard_study.ShardBenchConfig) -> resources.HostMemoryNeed:
    """What the gloo ranks of ``config`` hold in this machine's memory, under the variant that holds the most (they
    run one after another); attention is SDPA, which builds no score matrices on CPU."""
    ranks, spawned = resources.ranks_here(config.world_size)
    model = config.model_config
    activations = resources.activation_bytes(
        model, config.global_batch // config.world_size, dtype_bytes=max(DTYPES[d].itemsize for d in config.dtypes),
        attention="sdpa", checkpoint="none", backward=True, fused_loss=False)
    peak = resources.largest(*(_variant_peak(v, model.num_params, config.world_size, activations)
                               for v in config.variants))
    return resources.HostMemoryNeed(
        f"shard of size {config.size}, context {config.context_length}, global batch {config.global_batch} on "
        f"{config.world_size} ranks", peak, ranks, spawned)


def run(args: argparse.Namespace) -> int:
    if markdown_requested(args):
        return print_markdown(args, ROWS, shard_study.writeup_tables)
    try:
        config = shard_study.ShardBenchConfig(**distributed_run_fields(args))
        check_world_size(config.world_size)
        if config.resolved_backend == "gloo":
            host_need(config).check()
        for path in (args.out, args.figure):
            if path:
                check_writable(path)
        if args.trace_dir:
            check_writable_dir(args.trace_dir)
    except ValueError as e:
        raise SystemExit(f"cs336 shard: {e}") from None
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = args.trace_dir or tmp
        try:
            rows = shard_study.run_shard_bench(config, trace_dir, progress=not args.quiet,
                                               write=RowWriter.to(args.out))
        except RankDiedError as e:
            raise SystemExit(f"cs336 shard: {e}; the run asked for {config.describe()}") from None
        if not rows:  # a torchrun rank other than 0
            return 0
        print_measured_table(rows, shard_study.MEMORY_COLUMNS, floatfmt=".3g",
                             cuda_only="memory is measured on CUDA only (allocator statistics); params, grads and "
                                       "optimizer state are sizes of this rank's tensors")
        print()
        print_measured_table(rows, [c for c in shard_study.TIME_COLUMNS if c != "vs_fsdp2"], floatfmt=".2f",
                             cuda_only="there are no NCCL kernels to time")
        if args.figure and "fsdp" in config.variants:
            path = shard_study.fsdp_timeline_from_rows(rows, trace_dir, config.dtypes[-1], args.figure)
            print(f"timeline: {path}")
    return 0
