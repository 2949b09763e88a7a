"""``cs336 leaderboard``: time the handout's leaderboard training step (8B, context 32768, batch 2, two GPUs), or
its one-GPU proxy of a rank (``--proxy``), ours and the PyTorch-only baselines (``--impl``).

Without CUDA the defaults are a CPU try-out instead (tiny model, vocabulary 1000, context 32, fp32, two gloo
ranks, Triton kernels in the interpreter), which finishes in seconds. See ``cs336_harness.studies.leaderboard``.

``--memory-plan`` runs nothing: it prints each impl's checkpointing policy and expected peak memory, and for ours
(one rank, eager) the peak counted on fake tensors, in seconds and without a GPU.

The proxy is the way to work on the step with one GPU: world size 1, one sequence of 32768 tokens, the 8B block
shape with 14 layers (whose unsharded fp32 state is a rank's), the memory cap a rank's activation memory scaled to
14 of its 34 layers. ``--impl ours,torch_native,torch_native_compiled`` runs our step and the two PyTorch-only
baselines (plain: every block checkpointed; strong: compiled blocks, each kept, selectively or fully checkpointed,
the mix that fits the cap) as rows of one call; ``--profile`` adds each row's GPU time by kind of kernel.

Examples::

    uv run cs336 leaderboard                                        # CPU try-out, or the real run on 2 GPUs
    uv run cs336 leaderboard --out writeup/results/leaderboard.jsonl
    uv run cs336 leaderboard --attention sdpa --optimizer torch-adamw   # ablations, one piece at a time
    uv run cs336 leaderboard --proxy --impl ours,torch_native,torch_native_compiled --profile \\
        --out writeup/results/leaderboard_proxy.jsonl                 # one GPU
    uv run cs336 leaderboard --proxy --glue triton --checkpoint budget --profile   # our glue kernels, sized policy
    uv run cs336 leaderboard --proxy --glue triton --checkpoint budget --memory-cap-gib 92 --memory-plan   # no GPU
    uv run cs336 leaderboard --size xl --context-length 4096 --vocab-size 32000 --steps 5
    uv run cs336 leaderboard --markdown writeup/results/leaderboard_proxy.jsonl \\
        --fill writeup/sections/09-leaderboard.md
    torchrun --nproc-per-node 2 -m cs336_harness.cli leaderboard
"""

from __future__ import annotations

import argparse
import sys

import torch
from cs336_basics.config import PRESETS, ModelConfig
from cs336_comms.process_group import RankDiedError, check_world_size
from cs336_sharding.checkpointing import parse_policy

from cs336_harness import registry, resources
from cs336_harness.analysis import kernel_kinds
from cs336_harness.commands._shared import (
    add_markdown_arguments,
    add_quiet_argument,
    csv_of,
    markdown_requested,
    print_markdown,
    print_measured_table,
)
from cs336_harness.device import GIB
from cs336_harness.memory_plan import device_memory_bytes, memory_plan
from cs336_harness.results import RowKind, append_rows, check_writable
from cs336_harness.studies import leaderboard
from cs336_harness.train_config import COMPUTE_DTYPES

_SIZED = ("size", "vocab_size", "context_length", "global_batch", "world_size", "num_layers", "compute_dtype")
# What the tables read of every row (writeup_tables picks the leaderboard configuration and the proxy by these).
ROWS = RowKind("leaderboard", "compute_dtype", {
    dtype: ("size", "context_length", "global_batch", "world_size", "step_s") for dtype in COMPUTE_DTYPES})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    gpu, cpu = leaderboard.LEADERBOARD_DEFAULTS, leaderboard.CPU_DEFAULTS

    def default(name: str) -> str:
        return f"default {gpu[name]} with CUDA, {cpu[name]} without"

    parser.add_argument("--proxy", action="store_true",
                        help="the one-GPU proxy of a rank: world size 1, global batch 1, "
                             f"{leaderboard.PROXY_DEFAULTS['num_layers']} layers of the 8B preset (flags given win)")
    parser.add_argument("--size", default=None, help=f"{', '.join(PRESETS)} ({default('size')})")
    parser.add_argument("--num-layers", type=int, default=None, help="blocks (default: the preset's)")
    parser.add_argument("--vocab-size", type=int, default=None, help=default("vocab_size"))
    parser.add_argument("--context-length", type=int, default=None, help=default("context_length"))
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step over all ranks "
                        f"({default('global_batch')})")
    parser.add_argument("--world-size", type=int, default=None, help=f"ranks ({default('world_size')})")
    parser.add_argument("--compute-dtype", default=None, help=f"bf16 | fp32 ({default('compute_dtype')})")
    parser.add_argument("--backend", default=None, help="nccl | gloo (default: nccl with CUDA, gloo without)")
    parser.add_argument("--impl", type=csv_of(str), default=("ours",),
                        help=f"comma list of {', '.join(leaderboard.IMPLS)}: ours, and PyTorch's plain and strong "
                             "steps, one row each (default ours)")
    parser.add_argument("--attention", default="triton", help=f"{' | '.join(registry.ATTENTIONS)} (default triton)")
    parser.add_argument("--checkpoint", default="all",
                        help="activation checkpointing policy: none, all, group:K, first:N, first:N+selective:M, "
                             "sqrt, nested:B, selective[:N], attention[:N], attention:N+selective:M, offload[:N], "
                             "offload:N+selective:M (what the first N blocks save goes to pinned host memory), or "
                             "budget (the least recomputation that fits the memory cap) for ours (default all); the "
                             "baselines' are their recipes' (plain all, strong budget without the attention tier: "
                             "first:N+selective:M)")
    parser.add_argument("--glue", default="model",
                        help=f"{' | '.join(registry.GLUES)}: RMSNorm, RoPE and SiLU-mul by the model's code, our "
                             "Triton kernels or torch.compile of their references (ours only; default model)")
    parser.add_argument("--compile-blocks", action="store_true", help="each block's forward under torch.compile "
                        "(ours; the strong baseline always)")
    parser.add_argument("--fused-qkv", action="store_true", help="one (3d, d) matmul for q, k, v (ours only)")
    parser.add_argument("--memory-cap-gib", type=float, default=None,
                        help="memory the step may use, for --checkpoint budget and the rows' within_cap (default: "
                             "a leaderboard rank's activation memory scaled to this run's layers, on a GPU)")
    parser.add_argument("--optimizer", default="fused-adamw",
                        help="fused-adamw (our Triton FusedAdamW, default) | torch-adamw (torch.optim.AdamW, fused) | "
                             "adamw (cs336_basics' AdamW); ours only")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument("--profile", action="store_true",
                        help="one more step under torch.profiler: the row's GPU time by kind of kernel (GPU only)")
    parser.add_argument("--handout-timing", action="store_true",
                        help="also time the step as the handout does (triton.testing.do_bench around zero_grad, "
                             "forward, loss, backward and optimizer step, the maximum over ranks; CUDA only)")
    parser.add_argument("--time-limit-s", type=float, default=600.0,
                        help="per impl: stop before any step that would start later than this, model build "
                             "included (default 600)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-plan", action="store_true",
                        help="run nothing: print the checkpointing policy and expected peak memory of each impl, and "
                             "for ours on one rank the peak counted on fake tensors (no GPU needed)")
    parser.add_argument("--out", default=None, help="append the rows (with provenance) to this JSONL file")
    add_markdown_arguments(parser, fill=True)
    add_quiet_argument(parser)


def configs_from_args(args: argparse.Namespace) -> list[leaderboard.LeaderboardConfig]:
    """One config per ``--impl``: flags given, else the proxy's, the leaderboard's (CUDA) or the CPU try-out's
    defaults; each baseline with its recipe's settings (attention, glue, checkpointing, compilation, optimizer are
    the recipe's; the sizes, the memory cap and the run's settings are shared)."""
    defaults = leaderboard.LEADERBOARD_DEFAULTS if torch.cuda.is_available() else leaderboard.CPU_DEFAULTS
    if args.proxy:
        defaults = leaderboard.PROXY_DEFAULTS
    sized = {name: defaults.get(name) if getattr(args, name) is None else getattr(args, name) for name in _SIZED}
    # A plan of the GPU run on a machine without one describes it on nccl.
    backend = args.backend or ("nccl" if args.memory_plan and args.proxy else None)
    ours = leaderboard.LeaderboardConfig(
        **sized, backend=backend, attention=args.attention, checkpoint=args.checkpoint, glue=args.glue,
        compile_blocks=args.compile_blocks, fused_qkv=args.fused_qkv, memory_cap_gib=args.memory_cap_gib,
        optimizer=args.optimizer, warmup=args.warmup, steps=args.steps, profile=args.profile,
        handout_timing=args.handout_timing, time_limit_s=args.time_limit_s, seed=args.seed,
    )
    return [leaderboard.recipe(ours, impl) for impl in args.impl]


def _check_cpu_run(config: leaderboard.LeaderboardConfig) -> None:
    """That a run on gloo ranks asks for nothing only GPUs measure, and fits in this machine's memory.

    Raises:
        ValueError: naming the flag, or what the ranks need and what there is.
    """
    for flag, asked in (("--profile", config.profile), ("--handout-timing", config.handout_timing)):
        if asked:
            raise ValueError(f"{flag} times GPU kernels and needs CUDA; on CPU (gloo) there are none to time")
    model = config.model_config
    ranks, spawned = resources.ranks_here(config.world_size)
    activations = resources.activation_bytes(
        model, config.batch_per_rank, dtype_bytes=4, attention=config.attention,
        checkpoint=str(memory_plan(config.train_config(), None).policy), backward=True, fused_loss=True)
    shard = model.num_params / config.world_size
    peak = resources.largest({"weights (built whole, then sharded)": 4 * model.num_params},
                             resources.step_peak(shard, activations, backward=True, adamw=True))
    what = (f"the leaderboard step ({config.impl}) of size {config.size} ({model.num_layers} layers), context "
            f"{config.context_length}, global batch {config.global_batch} on {config.world_size} ranks")
    resources.HostMemoryNeed(what, peak, ranks, spawned).check()


def _check_offload_fits(config: leaderboard.LeaderboardConfig) -> None:
    """That this machine's memory holds the host copies of what an ``offload`` policy's blocks save, on every rank
    here (pinned on a GPU, so not swappable).

    Raises:
        ValueError: with what the ranks need and what there is.
    """
    if config.checkpoint == registry.BUDGET:
        return
    spec = parse_policy(config.checkpoint)
    if spec.kind != "offload":
        return
    blocks = spec.per_block(config.model_config.num_layers).count("offloaded")
    block = memory_plan(config.train_config(), None).step.block
    ranks, spawned = resources.ranks_here(config.world_size)
    what = f"--checkpoint {spec} ({blocks} blocks' saved activations in host memory on each of {ranks} ranks)"
    resources.HostMemoryNeed(what, {"host copies": blocks * block.kept}, ranks, spawned).check()


def _print_memory_plans(configs: list[leaderboard.LeaderboardConfig]) -> int:
    """The ``--memory-plan`` table: each config's policy, cap and expected peak, and the fake-tensor count where it
    can be made (ours on one rank, eager).

    Raises:
        ValueError: for a ``budget`` policy with no cap given and no GPU to take one from.
    """
    device_bytes = device_memory_bytes(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for config in configs:
        if config.checkpoint == registry.BUDGET and config.memory_cap_gib is None and device_bytes is None:
            raise ValueError("--memory-plan of --checkpoint budget needs --memory-cap-gib without a GPU (the default "
                             "cap comes from the GPU's memory)")
        train = config.train_config()
        plan = memory_plan(train, device_bytes)
        traceable = leaderboard.traceable(train)
        if traceable:
            print(f"counting the {config.impl} step's tensors on fake tensors...", file=sys.stderr)
        rows.append({
            "impl": config.impl, "num_layers": config.model_config.num_layers, "checkpoint": str(plan.policy),
            "cap_gib": None if plan.cap_bytes is None else plan.cap_bytes / GIB,
            "planned_peak_gib": None if plan.expected_peak_bytes is None else plan.expected_peak_bytes / GIB,
            "fake_tensor_peak_gib": leaderboard.traced_peak(train).peak_bytes / GIB if traceable else None,
            "block_kept_gib": plan.step.block.kept / GIB,
        })
    print_measured_table(rows, list(rows[0]), floatfmt=".2f")
    print("planned: the memory plan (a block's, the loss's and the optimizer's bytes counted on fake tensors, compiled "
          "blocks' by the byte model, the wrapper's buffers by formula: exact for ours, an estimate for the "
          "baselines); fake_tensor_peak: the step's tensors counted without running it; the allocator adds cuBLAS' "
          "workspace and rounding (about 0.07 GiB on the proxy)")
    return 0


def _proxy_needs_a_gpu() -> str:
    proxy = {k: v for k, v in leaderboard.PROXY_DEFAULTS.items() if k in ("vocab_size", "context_length", "num_layers")}
    model = ModelConfig.from_preset(leaderboard.PROXY_DEFAULTS["size"], **proxy)
    return (f"--proxy is a GPU measurement: one rank of the leaderboard run on one GPU ({model.num_layers} layers of "
            f"the {leaderboard.PROXY_DEFAULTS['size']} model, context {model.context_length}, bf16), whose fp32 "
            f"weights, gradients and AdamW state alone take {16 * model.num_params / GIB:.0f} GiB; it needs a CUDA "
            "GPU (without --proxy, the command runs its CPU try-out; --memory-plan shows its memory without a GPU)")


def run(args: argparse.Namespace) -> int:
    if markdown_requested(args):
        return print_markdown(args, ROWS, leaderboard.writeup_tables,
                              empty="no ok rows of the leaderboard configuration (8B, context 32768, global batch 2, "
                                    "2 ranks, bf16) and no proxy rows; no table to make")
    try:
        if args.proxy and not torch.cuda.is_available() and not args.memory_plan:
            raise ValueError(_proxy_needs_a_gpu())
        configs = configs_from_args(args)
        if args.memory_plan:
            return _print_memory_plans(configs)
        for config in configs:
            check_world_size(config.world_size)
            leaderboard.check_runs_here(config)
            if config.resolved_backend == "gloo":
                _check_cpu_run(config)
            _check_offload_fits(config)
        if args.out:
            check_writable(args.out)
    except ValueError as e:
        raise SystemExit(f"cs336 leaderboard: {e}") from None
    progress = None if args.quiet else lambda msg: print(msg, file=sys.stderr)
    rows = []
    for config in configs:
        try:
            run_rows = leaderboard.run_leaderboard(config, progress=progress)
        except leaderboard.TimeLimitExceeded as e:
            print(f"cs336 leaderboard: stopped: {e}", file=sys.stderr)
            return 1
        except RankDiedError as e:
            raise SystemExit(f"cs336 leaderboard: {e}; the run asked for {config.impl}, {config.size} "
                             f"({config.model_config.num_layers} layers), context {config.context_length}, global "
                             f"batch {config.global_batch}, {config.world_size} ranks") from None
        if not run_rows:  # a torchrun rank other than 0
            return 0
        if args.out:  # each row as soon as it exists: a later impl that fails cannot take it along
            append_rows(args.out, run_rows)
        rows += run_rows
    print_measured_table(rows, leaderboard.TABLE_COLUMNS, floatfmt=".4g",
                         cuda_only="MFU, peak memory and the default memory cap are GPU measures")
    for row in rows:
        if row.get("peak_step_gib_per_rank") is not None:
            print(f"{row['impl']}: peak memory per rank (GiB): "
                  + ", ".join(f"{p:.2f}" for p in row["peak_step_gib_per_rank"]))
        if row.get("breakdown"):
            print(f"\n{row['impl']}: GPU time of one step by kind (ms)\n"
                  + kernel_kinds.breakdown_markdown([row], [row["impl"]])
                  + f"\n\n{row['impl']}: the kernels with the most GPU time in that step\n"
                  + kernel_kinds.top_kernels_markdown(row["breakdown"]))
    return 0
