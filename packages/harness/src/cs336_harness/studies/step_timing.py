"""End-to-end timing of a Transformer LM's forward, backward and optimizer step, with memory and profiles.

:func:`run_bench` builds the training step of a ``BasicsTransformerLM`` with random weights
(:meth:`BenchConfig.train_config`, composed by :func:`cs336_harness.training.build_training`), draws one random
batch, runs ``warmup`` untimed steps and then ``steps`` timed ones. The device is synchronised after every phase
and each phase is timed with ``timeit.default_timer``; a row reports mean, standard deviation and median per
phase (forward includes the loss), the peak memory allocated in each phase, and, on request, a
torch.profiler trace with its kernel table and timeline figure (``profile_dir``) or a CUDA memory
snapshot with its active-memory figure (``memory_dir``). Every step is inside an NVTX/record_function
range (``warmup`` or ``step``), as is every phase.

Run it as ``uv run cs336 bench`` (see ``--help``); :func:`run_configs` runs a list of configs (with a
progress bar of their steps on request) and turns an out-of-memory error into a row with ``status == "oom"``.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import statistics
import timeit
from collections.abc import Callable, Iterator, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from cs336_basics.config import DEFAULT_CONTEXT_LENGTH, DEFAULT_VOCAB_SIZE, PRESETS, ModelConfig
from cs336_sharding.checkpointing import GROUP_SWEEP, plan_segments

from cs336_harness import instrument, registry
from cs336_harness.analysis import figures, memory, trace
from cs336_harness.device import GIB, check_device, default_device, sync
from cs336_harness.instrument import annotate
from cs336_harness.progress import progress_bar
from cs336_harness.results import append_rows, portable_path
from cs336_harness.train_config import COMPUTE_DTYPES, OptimizerConfig, Parallelism, TrainConfig
from cs336_harness.training import build_training

MODES = ("forward", "forward-backward", "train")
DEFAULT_BATCH_SIZE = 4
PHASE_NAMES = instrument.PHASES


def default_size() -> str:
    """``small`` with CUDA, ``tiny`` without, so a bare ``cs336 bench`` finishes in seconds on a CPU."""
    return "small" if torch.cuda.is_available() else "tiny"


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. Model dimensions default to the ``size`` preset; any given one overrides it."""

    size: str = field(default_factory=default_size)
    d_model: int | None = None
    d_ff: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    vocab_size: int = DEFAULT_VOCAB_SIZE
    batch_size: int = DEFAULT_BATCH_SIZE
    context_length: int = DEFAULT_CONTEXT_LENGTH
    mode: str = "train"
    warmup: int = 5
    steps: int = 10
    dtype: str = "fp32"
    compile: bool = False
    attention: str = "eager"
    optimizer: str = "adamw"
    loss: str = "standard"
    checkpoint: str = "none"
    device: str = field(default_factory=default_device)
    profile_dir: str | None = None
    memory_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size not in PRESETS:
            raise ValueError(f"size must be one of {', '.join(PRESETS)}, got {self.size!r}")
        for name in ("d_model", "d_ff", "num_layers", "num_heads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("vocab_size", "batch_size", "context_length", "steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.dims["d_model"] % self.dims["num_heads"] != 0:
            dims = self.dims
            raise ValueError(f"d_model ({dims['d_model']}) must be divisible by num_heads ({dims['num_heads']})")
        choices = {"mode": MODES, "dtype": COMPUTE_DTYPES, "attention": registry.ATTENTIONS,
                   "optimizer": registry.OPTIMIZERS, "loss": registry.LOSSES}
        for name, allowed in choices.items():
            registry.check_name(name, getattr(self, name), allowed)
        plan_segments(self.dims["num_layers"], self.checkpoint)  # the policy, and the blocks it names exist
        check_device(self.device)
        triton_in_step = [name for name, used in (("--attention triton", self.attention == "triton"),
                                                  ("--loss fused", self.loss == "fused")) if used]
        if self.device == "cpu" and self.dtype != "fp32" and triton_in_step:
            raise ValueError(f"{' and '.join(triton_in_step)} with dtype {self.dtype} needs a GPU: on CPU the Triton "
                             "kernels run in the interpreter, whose bf16 dot products are wrong; use fp32")
        if self.profile_dir is not None and not self.device.startswith("cuda"):
            raise ValueError("--profile needs a CUDA device: its kernel table and timeline are built from GPU kernels")
        if self.memory_dir is not None and not self.device.startswith("cuda"):
            raise ValueError("--memory needs a CUDA device: it records the CUDA caching allocator")
        if self.checkpoint != "none" and self.mode == "forward":
            raise ValueError("--checkpoint only matters with a backward pass; use --mode forward-backward or train")

    @property
    def dims(self) -> dict[str, int]:
        """The preset's d_model, d_ff, num_layers and num_heads, with the ones given replacing the preset's."""
        preset = PRESETS[self.size]
        return {k: preset[k] if getattr(self, k) is None else getattr(self, k) for k in preset}

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.dims, vocab_size=self.vocab_size, context_length=self.context_length)

    @property
    def tag(self) -> str:
        """A short file-name-safe label for outputs of this run."""
        parts = [self.size, f"ctx{self.context_length}", self.mode, self.dtype]
        if self.compile:
            parts.append("compiled")
        if self.attention != "eager":
            parts.append(self.attention)
        if self.checkpoint != "none":
            parts.append("ckpt-" + self.checkpoint.replace(":", ""))
        return "_".join(parts)

    def train_config(self) -> TrainConfig:
        """The step this config times (:mod:`cs336_harness.training`): the model with its attention and its LM head's
        loss by their registry names (``fused`` is ``cs336_kernels.fused_linear_cross_entropy``, which never
        materialises the (tokens, vocab) logits), on one process without a wrapper, checkpointed, the whole model
        compiled if asked, under autocast for bf16; the optimizer used in ``train`` mode."""
        return TrainConfig(
            self.model_config, kernels=registry.kernels(self.attention, loss_name=self.loss),
            parallelism=Parallelism(compute_dtype=self.dtype, wrapper="none", checkpoint=self.checkpoint,
                                    compile="model" if self.compile else "none"),
            optimizer=OptimizerConfig(self.optimizer, lr=1e-4, weight_decay=0.01), global_batch=self.batch_size,
            seed=self.seed)


@dataclass
class _Recorder:
    """Per-phase wall times (ms) and peak memory (bytes) of the measured steps."""

    device: str
    times: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in (*PHASE_NAMES, "step")})
    peaks: dict[str, int] = field(default_factory=dict)
    measuring: bool = False

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time ``name``; for the three phases also record the peak memory allocated inside it."""
        track_peak = self.measuring and self.device.startswith("cuda") and name in PHASE_NAMES
        if track_peak:
            torch.cuda.reset_peak_memory_stats(self.device)
        with annotate(name):
            t0 = timeit.default_timer()
            yield
            sync(self.device)
            elapsed = timeit.default_timer() - t0
        if self.measuring:
            self.times[name].append(elapsed * 1e3)
        if track_peak:
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated(self.device))


def _summary(name: str, values: list[float]) -> dict[str, Any]:
    if not values:
        return {}
    return {
        f"{name}_ms_mean": statistics.fmean(values),
        f"{name}_ms_std": statistics.stdev(values) if len(values) > 1 else 0.0,
        f"{name}_ms_median": statistics.median(values),
        f"{name}_ms_all": [round(v, 4) for v in values],
    }


def config_fields(config: BenchConfig) -> dict[str, Any]:
    """The row fields that say what was run (model dims resolved, output folders left out)."""
    row = {k: v for k, v in asdict(config).items() if k not in ("profile_dir", "memory_dir", "seed")}
    row.update(config.dims)
    return row


def run_bench(config: BenchConfig, on_step: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run one config and return its row (timings, peaks, parameters; no provenance); ``on_step`` is called after
    every step, warm-up ones included."""
    training = build_training(config.train_config(), torch.device(config.device))
    gen = torch.Generator(device=config.device).manual_seed(config.seed)
    shape = (config.batch_size, config.context_length)
    tokens = torch.randint(0, config.vocab_size, shape, device=config.device, generator=gen)
    targets = torch.randint(0, config.vocab_size, shape, device=config.device, generator=gen)
    rec = _Recorder(config.device)

    def one_step() -> None:
        grad_ctx = torch.no_grad() if config.mode == "forward" else contextlib.nullcontext()
        with rec.phase("forward"), grad_ctx:
            loss = training.forward(tokens, targets)
        if config.mode == "forward":
            return
        with rec.phase("backward"):
            loss.backward()
            training.finish_sync()
        if config.mode != "train":
            training.model.zero_grad(set_to_none=True)
            return
        with rec.phase("optimizer"):
            training.optimizer_step()

    row: dict[str, Any] = {**config_fields(config), "params": sum(p.numel() for p in training.model.parameters())}
    for _ in range(config.warmup):
        with annotate("warmup"):
            one_step()
        if on_step is not None:
            on_step()
    sync(config.device)
    rec.measuring = True
    with contextlib.ExitStack() as stack:
        if config.memory_dir is not None:
            snap = Path(config.memory_dir) / f"memory_{config.tag}.pickle"
            stack.enter_context(memory.record_memory_history(snap))
        prof = stack.enter_context(instrument.profile(config.device)) if config.profile_dir is not None else None
        for _ in range(config.steps):
            with rec.phase("step"):
                one_step()
            if on_step is not None:
                on_step()
    if prof is not None:
        row["profile"] = _write_profile(prof, config)
    if config.memory_dir is not None:
        row["memory"] = _write_memory(config)
    row["status"] = "ok"
    for name in (*PHASE_NAMES, "step"):
        row.update(_summary(name, rec.times[name]))
    for name, peak in rec.peaks.items():
        row[f"peak_{name}_gib"] = peak / GIB
    if rec.peaks:
        row["peak_step_gib"] = max(rec.peaks.values()) / GIB
    return row


def _write_profile(prof: torch.profiler.profile, config: BenchConfig) -> dict[str, Any]:
    out = Path(config.profile_dir or ".")
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / f"trace_{config.tag}.json.gz"
    prof.export_chrome_trace(str(trace_path))
    events = trace.load_trace(trace_path)
    kernels = trace.kernel_table(events, num_steps=config.steps)
    append_rows(out / "kernels.jsonl", [{**config_fields(config), **k} for k in kernels])
    png = figures.plot_timeline(events, out / f"timeline_{config.tag}.png", title=config.tag)
    shares = {f"share_{k}": v for k, v in trace.class_shares(events, "forward").items()}
    return {"trace": portable_path(trace_path), "timeline": portable_path(png), "forward_kernel_classes": shares,
            "step_kernel_classes": trace.class_shares(events, "step")}


def _write_memory(config: BenchConfig) -> dict[str, Any]:
    snap_path = Path(config.memory_dir or ".") / f"memory_{config.tag}.pickle"
    snapshot = memory.load_snapshot(snap_path)
    png = figures.plot_active_memory(snapshot, snap_path.with_suffix(".png"), title=config.tag)
    return {"snapshot": portable_path(snap_path), "timeline": portable_path(png),
            "largest": memory.largest_allocations(snapshot)}


def _free_device_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_one(config: BenchConfig, on_step: Callable[[], None] | None = None) -> dict[str, Any]:
    """:func:`run_bench`, with an out-of-memory error turned into a row instead of an exception."""
    try:
        return run_bench(config, on_step)
    except torch.OutOfMemoryError:
        pass
    finally:
        # After the handler: only then are the failed run's frames, and the tensors they hold, gone.
        _free_device_memory(config.device)
    row: dict[str, Any] = {**config_fields(config), "status": "oom"}
    snap = Path(config.memory_dir or ".") / f"memory_{config.tag}.pickle"
    if config.memory_dir is not None and snap.exists():
        row["memory"] = _write_memory(config)
    return row


def run_configs(configs: Sequence[BenchConfig], progress: bool = False,
                write: Callable[[list[dict[str, Any]]], Any] | None = None) -> list[dict[str, Any]]:
    """Run each config in turn; OOM configs give ``status == 'oom'`` rows. With ``progress``, a bar on stderr
    counts the steps of all configs (warm-up included) and names the config running; ``write`` (e.g. a
    :class:`~cs336_harness.results.RowWriter`) gets each config's row as soon as it has run."""
    bar = progress_bar(total=sum(c.warmup + c.steps for c in configs), desc="bench", enabled=progress,
                       unit="step")
    rows, done = [], 0
    for i, config in enumerate(configs):
        bar.set_postfix_str(f"config {i + 1}/{len(configs)}: {config.tag}")
        rows.append(run_one(config, bar.update))
        if write:
            write(rows[-1:])
        done += config.warmup + config.steps
        bar.update(done - bar.n)  # the steps an out-of-memory config did not run
    bar.close()
    return rows


# Always in the printed table: what a row is and whether it ran; then the measurements.
_ROW_COLUMNS = ("size", "context_length", "mode", "dtype")
# Shown when they differ between the rows or from the defaults, so that no two rows look alike.
_SETTING_COLUMNS = ("batch_size", "vocab_size", "attention", "optimizer", "loss", "compile", "checkpoint", "warmup",
                    "steps", "device")
_DIM_COLUMNS = ("d_model", "d_ff", "num_layers", "num_heads")
_MEASURED_COLUMNS = (
    "status", "forward_ms_mean", "forward_ms_std", "backward_ms_mean", "backward_ms_std",
    "optimizer_ms_mean", "optimizer_ms_std", "step_ms_median", "peak_step_gib",
)


def table_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The printed table's columns for ``rows``: what each row is, every setting that differs between the rows or
    from :class:`BenchConfig`'s default, model dimensions where they differ from the size's preset, and the
    measurements present."""
    defaults = {f.name: f.default_factory() if f.default is MISSING else f.default for f in fields(BenchConfig)}
    settings = [c for c in _SETTING_COLUMNS
                if len({repr(r.get(c)) for r in rows}) > 1 or any(r.get(c) != defaults[c] for r in rows)]
    dims = [c for c in _DIM_COLUMNS if any(r.get(c) != PRESETS[r["size"]][c] for r in rows)]
    measured = [c for c in _MEASURED_COLUMNS if any(c in r for r in rows)]
    return [*_ROW_COLUMNS, *settings, *dims, *measured]


SWEEP_SIZES = ("small", "medium", "large", "xl", "10B")
SWEEP_CONTEXT_LENGTHS = (128, 256, 512, 1024)


def expand_configs(
    base: BenchConfig,
    sizes: Sequence[str] = (),
    context_lengths: Sequence[int] = (),
    dtypes: Sequence[str] = (),
    attentions: Sequence[str] = (),
    checkpoints: Sequence[str] = (),
) -> list[BenchConfig]:
    """Every combination of the given values (an empty sequence keeps ``base``'s value).

    A checkpoint value of ``groups`` stands for ``group:K`` for each K in
    :data:`cs336_sharding.checkpointing.GROUP_SWEEP` up to the model's number of layers.
    """
    configs = []
    for size, ctx, dtype, attn, ckpt in itertools.product(
        sizes or (base.size,), context_lengths or (base.context_length,), dtypes or (base.dtype,),
        attentions or (base.attention,), checkpoints or (base.checkpoint,),
    ):
        config = replace(base, size=size, context_length=ctx, dtype=dtype, attention=attn)
        if ckpt == "groups":
            n = config.dims["num_layers"]
            configs += [replace(config, checkpoint=f"group:{k}") for k in GROUP_SWEEP if k <= n]
        else:
            configs.append(replace(config, checkpoint=ckpt))
    return configs
