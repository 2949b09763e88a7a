"""``cs336 bench``: time forward, backward and optimizer phases of a Transformer LM; optional profile and memory.

Examples::

    uv run cs336 bench                                   # seconds on a CPU (size tiny), small on a GPU
    uv run cs336 bench --size xl --mode train --compute-dtype fp32,bf16 --out results.jsonl
    uv run cs336 bench --sweep --steps 10 --warmup 5     # sizes small..10B x contexts 128..1024
    uv run cs336 bench --size small --attention annotated --profile prof/
    uv run cs336 bench --size xl --context-length 2048 --checkpoint groups --warmup 1 --steps 2

On a CPU, a step that runs a Triton kernel (``--attention triton``, ``--loss fused``, ``--optimizer fused-adamw``)
runs it in Triton's interpreter, seconds a step even for the tiny model: the flags not given then default to
:data:`INTERPRETER_DEFAULTS` (a run of about a minute on two cores), and the command says so in one line.
"""

from __future__ import annotations

import argparse
import json
import sys

from cs336_basics.config import DEFAULT_CONTEXT_LENGTH, DEFAULT_VOCAB_SIZE, PRESETS

from cs336_harness import registry, resources
from cs336_harness.analysis.tables import format_table
from cs336_harness.commands._shared import add_quiet_argument, csv_of
from cs336_harness.device import DTYPES, GIB, default_device
from cs336_harness.results import RowWriter, check_writable, check_writable_dir
from cs336_harness.studies import step_timing

# The run's defaults where Triton's interpreter runs a kernel of the step (seconds a step at these sizes on two
# cores, where the default context of 512 takes minutes a step).
INTERPRETER_DEFAULTS = {"context_length": 64, "warmup": 1, "steps": 3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    g = parser.add_argument_group("model (flags marked 'comma list' run every value, every combination)")
    g.add_argument("--size", type=csv_of(str), default=(),
                   help=f"comma list of presets: {', '.join(PRESETS)} (default: small with CUDA, tiny without)")
    for name in ("d-model", "d-ff", "num-layers", "num-heads"):
        g.add_argument(f"--{name}", type=int, default=None, help=f"override the preset's {name}")
    g.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help=f"default {DEFAULT_VOCAB_SIZE}")
    g.add_argument("--batch-size", type=int, default=step_timing.DEFAULT_BATCH_SIZE, help="default 4")
    g.add_argument("--context-length", type=csv_of(int), default=(),
                   help=f"comma list (default {DEFAULT_CONTEXT_LENGTH}; "
                        f"{INTERPRETER_DEFAULTS['context_length']} for Triton kernels on CPU)")
    r = parser.add_argument_group("run")
    r.add_argument("--mode", default="train", help="forward (no grad) | forward-backward | train (default)")
    r.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; "
                   f"{INTERPRETER_DEFAULTS['warmup']} for Triton kernels on CPU)")
    r.add_argument("--steps", type=int, default=None, help="timed steps (default 10; "
                   f"{INTERPRETER_DEFAULTS['steps']} for Triton kernels on CPU)")
    r.add_argument("--compute-dtype", type=csv_of(str), default=(),
                   help="comma list of fp32 (default), bf16 (autocast)")
    r.add_argument("--compile", action="store_true", help="torch.compile the model")
    r.add_argument("--attention", type=csv_of(str), default=(),
                   help=f"comma list of {', '.join(registry.ATTENTIONS)} (default eager)")
    r.add_argument("--optimizer", default="adamw",
                   help=f"{' | '.join(registry.OPTIMIZERS)} (default adamw, ours; torch-adamw is fused on CUDA, "
                        "fused-adamw our Triton kernel)")
    r.add_argument("--loss", default="standard",
                   help=f"{' | '.join(registry.LOSSES)} (default standard: logits, then cross-entropy; fused: our "
                        "fused linear + cross-entropy kernel; chunked: PyTorch's a chunk of tokens at a time)")
    r.add_argument("--checkpoint", type=csv_of(str), default=(),
                   help="comma list of none (default), all, group:K, first:N[+selective:M], sqrt, nested[:B], "
                        "selective[:N], attention[:N[+selective:M]], "
                        "offload[:N] (saved activations to pinned host memory), groups (= group:K for K in "
                        "1,2,3,4,6,8,16,32 up to num_layers)")
    r.add_argument("--sweep", action="store_true",
                   help=f"sizes {','.join(step_timing.SWEEP_SIZES)} x contexts "
                        f"{','.join(map(str, step_timing.SWEEP_CONTEXT_LENGTHS))} unless --size/--context-length given")
    r.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    add_quiet_argument(r)
    o = parser.add_argument_group("outputs (without these, the command only prints its table)")
    o.add_argument("--profile", metavar="DIR", default=None,
                   help="CUDA only: torch.profiler trace, kernel table (kernels.jsonl) and timeline PNG in DIR")
    o.add_argument("--memory", metavar="DIR", default=None,
                   help="CUDA only: memory snapshot pickle (for pytorch.org/memory_viz) and its PNG in DIR")
    o.add_argument("--out", metavar="FILE", default=None, help="append rows (with provenance) to this JSONL file")


def interpreted_kernels(args: argparse.Namespace) -> list[str]:
    """The flags of ``args`` that put a Triton kernel in the step where it runs in Triton's interpreter (on a CPU)."""
    if (args.device or default_device()) != "cpu":
        return []
    chosen = {"--attention triton": "triton" in args.attention, "--loss fused": args.loss == "fused",
              "--optimizer fused-adamw": args.optimizer == "fused-adamw"}
    return [flag for flag, used in chosen.items() if used]


def interpreter_defaults(args: argparse.Namespace) -> dict[str, int]:
    """Of :data:`INTERPRETER_DEFAULTS`, those for flags not given, if a kernel of the step runs in the interpreter;
    each chosen is said in one line on stderr."""
    kernels = interpreted_kernels(args)
    if not kernels:
        return {}
    given = {"context_length": bool(args.context_length or args.sweep), "warmup": args.warmup is not None,
             "steps": args.steps is not None}
    chosen = {name: value for name, value in INTERPRETER_DEFAULTS.items() if not given[name]}
    if chosen:
        said = {"context_length": f"context {chosen.get('context_length')}",
                "warmup": f"{chosen.get('warmup')} untimed step{'s' * (chosen.get('warmup') != 1)}",
                "steps": f"{chosen.get('steps')} timed step{'s' * (chosen.get('steps') != 1)}"}
        runs = "runs" if len(kernels) == 1 else "run"
        print(f"cs336 bench: {' and '.join(kernels)} {runs} in Triton's interpreter on a CPU, seconds a step, so "
              f"this run defaults to {', '.join(said[name] for name in chosen)} (set "
              f"{', '.join('--' + name.replace('_', '-') for name in chosen)} to choose)", file=sys.stderr)
    return chosen


def configs_from_args(args: argparse.Namespace) -> list[step_timing.BenchConfig]:
    """Turn parsed flags into validated configs (raises ValueError with a message on a bad value)."""
    run = {name: getattr(args, name) for name in ("warmup", "steps") if getattr(args, name) is not None}
    run.update(interpreter_defaults(args))
    base = step_timing.BenchConfig(
        d_model=args.d_model, d_ff=args.d_ff, num_layers=args.num_layers, num_heads=args.num_heads,
        vocab_size=args.vocab_size, batch_size=args.batch_size, mode=args.mode, compile=args.compile,
        optimizer=args.optimizer, loss=args.loss, profile_dir=args.profile, memory_dir=args.memory,
        **run, **({"device": args.device} if args.device else {}),
    )
    sizes = args.size or (step_timing.SWEEP_SIZES if args.sweep else ())
    contexts = args.context_length or (step_timing.SWEEP_CONTEXT_LENGTHS if args.sweep else ())
    return step_timing.expand_configs(base, sizes, contexts, args.compute_dtype, args.attention, args.checkpoint)


def host_need(config: step_timing.BenchConfig) -> resources.HostMemoryNeed:
    """What ``config`` holds in host memory when it runs on the CPU (:mod:`cs336_harness.resources`)."""
    model = config.model_config
    backward = config.mode != "forward"
    activations = resources.activation_bytes(
        model, config.batch_size, dtype_bytes=DTYPES[config.dtype].itemsize, attention=config.attention,
        checkpoint=config.checkpoint, backward=backward, fused_loss=config.loss == "fused")
    peak = resources.step_peak(model.num_params, activations, backward=backward, adamw=config.mode == "train")
    return resources.HostMemoryNeed(f"{config.tag} (batch {config.batch_size})", peak)


def _run_what_fits(configs: list[step_timing.BenchConfig], progress: bool,
                   write: RowWriter | None) -> list[dict]:
    """Each config's row in order: CPU configs that cannot fit in host memory are not run, and their rows say
    ``oom`` as a CUDA out-of-memory error would (with the estimate), each said on stderr. ``write`` gets those rows
    first, then each row run as it finishes."""
    available = resources.available_host_bytes()
    refused = {}
    for i, config in enumerate(configs):
        need = host_need(config) if config.device == "cpu" else None
        reason = need.shortfall(available) if need else None
        if reason:
            print(f"cs336 bench: not run (its row says oom): {reason}", file=sys.stderr)
            refused[i] = {**step_timing.config_fields(config), "status": "oom",
                          "host_need_gib": need.total_bytes / GIB, "host_available_gib": available / GIB}
    if refused and write:
        write(list(refused.values()))
    runnable = [c for i, c in enumerate(configs) if i not in refused]
    ran = iter(step_timing.run_configs(runnable, progress=progress, write=write) if runnable else [])
    return [refused[i] if i in refused else next(ran) for i in range(len(configs))]


def run(args: argparse.Namespace) -> int:
    try:
        configs = configs_from_args(args)
        if args.out:
            check_writable(args.out)
        for folder in (args.profile, args.memory):
            if folder:
                check_writable_dir(folder)
    except ValueError as e:
        raise SystemExit(f"cs336 bench: {e}") from None
    rows = _run_what_fits(configs, progress=not args.quiet, write=RowWriter.to(args.out))
    print(format_table(rows, step_timing.table_columns(rows), floatfmt=".2f"))
    for row in rows:
        for key in ("profile", "memory"):
            if row.get(key):
                print(f"{row['size']} ctx {row['context_length']} {key}: {json.dumps(row[key], indent=None)}")
    if len({r["checkpoint"] for r in rows}) > 1:
        # Checkpointing changes the forward and backward peaks; the optimizer's is the same for all.
        ok = [r for r in rows if r["status"] == "ok" and "peak_backward_gib" in r]
        if ok:
            best = min(ok, key=lambda r: (max(r["peak_forward_gib"], r["peak_backward_gib"]), r["step_ms_median"]))
            peak = max(best["peak_forward_gib"], best["peak_backward_gib"])
            print(f"lowest forward/backward peak: checkpoint {best['checkpoint']} at {peak:.2f} GiB")
    ran, n = sum(r["status"] == "ok" for r in rows), len(rows)
    if ran == 0:
        raise SystemExit(f"cs336 bench: no configuration ran ({n} of {n} out of memory)")
    if ran < n:
        print(f"ran {ran} of {n} configurations ({n - ran} out of memory)")
    return 0
