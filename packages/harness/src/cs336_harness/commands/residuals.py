"""``cs336 residuals``: how much autograd saves for backward in RMSNorm and in TransformerBlocks.

Examples::

    uv run cs336 residuals                                      # CPU: the tiny block, context 128, a minute
    uv run cs336 residuals --experiment rmsnorm                 # seconds on a CPU
    uv run cs336 residuals --out residuals.jsonl                # CUDA: the handout's xl block, batch 4, ctx 2048
"""

from __future__ import annotations

import argparse
import warnings

from cs336_basics.config import PRESETS, ModelConfig

from cs336_harness import resources
from cs336_harness.commands._shared import add_quiet_argument
from cs336_harness.device import CPU_CONTEXT_LENGTH
from cs336_harness.results import append_rows, check_writable
from cs336_harness.studies.residuals import (
    EXPERIMENTS,
    GPU_CONTEXT_LENGTH,
    GPU_SIZE,
    ResidualsConfig,
    run_experiments,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    parser.add_argument("--experiment", action="append", choices=EXPERIMENTS, default=None,
                        help="repeatable; default: all of them")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    parser.add_argument("--size", default=None,
                        help=f"block preset: {', '.join(PRESETS)} (default {GPU_SIZE} on CUDA, tiny on CPU)")
    parser.add_argument("--d-model", type=int, default=None, help="override the preset's d_model")
    parser.add_argument("--d-ff", type=int, default=None, help="override the preset's d_ff")
    parser.add_argument("--num-heads", type=int, default=None,
                        help="override the preset's num_heads (xl has 32; the handout's code used 16)")
    parser.add_argument("--batch-size", type=int, default=4, help="default 4")
    parser.add_argument("--context-length", type=int, default=None,
                        help=f"default {GPU_CONTEXT_LENGTH} on CUDA, {CPU_CONTEXT_LENGTH} on CPU")
    add_quiet_argument(parser)
    parser.add_argument("--out", metavar="FILE", default=None, help="append rows (with provenance) to this JSONL")


# The block experiments by what they apply: one block run once eagerly, or one compiled block run four times.
_APPLICATIONS = {"block": (1, "eager"), "four-blocks": (4, "compiled")}


def host_need(config: ResidualsConfig) -> resources.HostMemoryNeed:
    """What the block experiments of ``config`` hold in host memory at their largest: one block's fp32 weights and
    what autograd saves in its applications (:func:`cs336_harness.resources.activation_bytes`; no LM head)."""
    shape = dict(d_model=config.d_model, d_ff=config.d_ff, num_heads=config.num_heads, vocab_size=1,
                 context_length=config.context_length)
    weights = 4 * ModelConfig(**shape, num_layers=1).num_params
    saved = max((resources.activation_bytes(ModelConfig(**shape, num_layers=layers), config.batch_size,
                                            dtype_bytes=4, attention=attention, checkpoint="none", backward=True,
                                            fused_loss=True)
                 for name, (layers, attention) in _APPLICATIONS.items() if name in config.experiments), default=0)
    return resources.HostMemoryNeed(f"residuals of the {config.size} block at batch {config.batch_size}, context "
                                    f"{config.context_length}", {"weights": weights, "saved for backward": saved})


def run(args: argparse.Namespace) -> int:
    try:
        if args.context_length is not None and args.context_length < 1:
            # ResidualsConfig reads 0 as "the device's default".
            raise ValueError(f"--context-length must be positive, got {args.context_length}")
        config = ResidualsConfig(
            experiments=tuple(args.experiment or EXPERIMENTS), size=args.size, d_model=args.d_model, d_ff=args.d_ff,
            num_heads=args.num_heads, batch_size=args.batch_size, context_length=args.context_length,
            **({"device": args.device} if args.device else {}),
        )
        if config.device == "cpu":
            host_need(config).check()
        if args.out:
            check_writable(args.out)
    except ValueError as e:
        raise SystemExit(f"cs336 residuals: {e}") from None
    print(f"{config.size} block (d_model {config.d_model}, d_ff {config.d_ff}, {config.num_heads} heads), "
          f"batch {config.batch_size}, context {config.context_length}, on {config.device}")
    # Bytes saved for backward do not depend on matmul precision, so Inductor's advice to enable TF32 for fp32 is noise.
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores", category=UserWarning)
    rows, lines = run_experiments(config, progress=not args.quiet)
    print("\n".join(lines))
    if args.out:
        append_rows(args.out, rows)
    return 0
