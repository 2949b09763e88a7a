"""``cs336 collectives``: all-reduce, reduce-scatter and all-gather time and bandwidth over sizes,
world sizes and backends.

Examples::

    uv run cs336 collectives                              # gloo, world sizes 2,4,6, sizes 1,10,100 MiB
    uv run cs336 collectives --backends nccl --world-sizes 1,2 --sizes-mb 1,10,100,1024 \\
        --out writeup/results/collectives.jsonl --plot writeup/figures/collectives.png
    torchrun --nproc-per-node 2 -m cs336_harness.cli collectives --backends nccl
    uv run cs336 collectives --markdown writeup/results/collectives.jsonl
"""

from __future__ import annotations

import argparse
import os

import torch
from cs336_comms.collectives import OPS
from cs336_comms.process_group import RankDiedError, check_world_size, launched_by_torchrun

from cs336_harness import resources
from cs336_harness.analysis.figures import plot_collectives
from cs336_harness.analysis.tables import format_table
from cs336_harness.commands._shared import (
    add_markdown_arguments,
    add_quiet_argument,
    csv_of,
    markdown_requested,
    print_markdown,
)
from cs336_harness.results import RowKind, RowWriter, check_writable
from cs336_harness.studies.collectives import CollectivesConfig, collectives_markdown, run_collectives_study

ROWS = RowKind("collectives", "op",
               {op: ("backend", "world_size", "bytes", "time_ms", "busbw_gbps") for op in OPS})

_HANDOUT_WORLD_SIZES = (2, 4, 6)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    parser.add_argument("--backends", type=csv_of(str), default=None,
                        help="comma list of gloo, nccl (default: nccl with CUDA, else gloo)")
    parser.add_argument("--world-sizes", type=csv_of(int), default=None,
                        help="comma list (default 2,4,6; nccl: those the GPUs allow; under torchrun: its world size)")
    parser.add_argument("--sizes-mb", type=csv_of(float), default=(1, 10, 100),
                        help="comma list of float32 tensor sizes in MiB (default 1,10,100; the handout adds 1024)")
    parser.add_argument("--ops", type=csv_of(str), default=OPS,
                        help=f"comma list, a subset of {','.join(OPS)} (default all)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per size (default 5)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    parser.add_argument("--out", default=None, help="append rows (with provenance) to this JSONL file")
    parser.add_argument("--plot", default=None, help="write bandwidth and time against size to this PNG")
    add_markdown_arguments(parser, fill=False)
    add_quiet_argument(parser)


def _all_reduce_table(rows: list[dict]) -> dict[str, str]:
    if not any(r["op"] == "all_reduce" for r in rows):
        return {}
    return {"collectives": collectives_markdown(rows)}


def host_need(config: CollectivesConfig) -> resources.HostMemoryNeed:
    """What the gloo ranks of ``config``'s largest world size hold in this machine's memory: each, the full tensor
    of the largest size and its shard (the largest world size needs the most in all)."""
    world_size = max(config.world_sizes)
    ranks, spawned = resources.ranks_here(world_size)
    size = max(config.sizes_mb) * 2**20
    return resources.HostMemoryNeed(
        f"collectives on {world_size} ranks with float32 tensors of up to {max(config.sizes_mb):g} MiB",
        {"tensors": size * (1 + 1 / world_size)}, ranks, spawned)


def run(args: argparse.Namespace) -> int:
    if markdown_requested(args):
        return print_markdown(args, ROWS, _all_reduce_table,
                              empty="the rows given have no all_reduce rows, which the table shows")
    backends = args.backends or (("nccl",) if torch.cuda.is_available() else ("gloo",))
    if launched_by_torchrun():
        world_sizes = args.world_sizes or (int(os.environ["WORLD_SIZE"]),)  # checked against torchrun's below
    elif args.world_sizes:
        world_sizes = args.world_sizes
    elif "nccl" in backends:
        world_sizes = tuple(n for n in _HANDOUT_WORLD_SIZES if n <= torch.cuda.device_count()) or (1,)
    else:
        world_sizes = _HANDOUT_WORLD_SIZES
    try:
        config = CollectivesConfig(backends, world_sizes, args.sizes_mb, args.ops, args.warmup, args.iters)
        for world_size in config.world_sizes:
            check_world_size(world_size)
        if "gloo" in config.backends:
            host_need(config).check()
        for path in (args.out, args.plot):
            if path:
                check_writable(path)
    except ValueError as e:
        raise SystemExit(f"cs336 collectives: {e}") from None
    try:
        rows = run_collectives_study(config, progress=not args.quiet, write=RowWriter.to(args.out))
    except RankDiedError as e:
        raise SystemExit(f"cs336 collectives: {e}; the run asked for float32 tensors of up to "
                         f"{max(config.sizes_mb):g} MiB on up to {max(config.world_sizes)} ranks") from None
    if not rows:  # a torchrun rank other than 0
        return 0
    print(format_table(rows, ["op", "backend", "world_size", "size_mb", "time_ms", "algbw_gbps", "busbw_gbps"]))
    if args.plot:
        print(f"plot: {plot_collectives(rows, args.plot)}")
    return 0
