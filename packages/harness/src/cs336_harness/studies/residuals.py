"""Count the tensors autograd saves for the backward pass ("residuals"), by module and by operation.

:func:`count_residuals` runs a function under ``torch.autograd.graph.saved_tensors_hooks`` and records
every tensor packed for backward: its shape, dtype and bytes, the module that was running (module
forward hooks keep a stack of qualified names), the torch function that saved it (a
``TorchFunctionMode`` notes the outermost torch call in progress) and the op that produced it
(``grad_fn``). Parameters, and tensors that share a parameter's storage (``weight.T``), are skipped;
a storage saved more than once is counted once, since it occupies memory once.

Inside ``torch.compile``'d code autograd sees one ``CompiledFunction``, so there the module and op
trackers are off (``track=False``) and only sizes are recorded.

The experiments of the handout's section 3 (RMSNorm eager vs compiled; one xl TransformerBlock; four
blocks with and without checkpointing pairs of them) are :func:`rmsnorm_experiment`,
:func:`block_experiment` and :func:`four_blocks_experiment`; ``uv run cs336 residuals`` runs them.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from cs336_basics.config import PRESETS
from cs336_basics.model import RMSNorm, RotaryEmbedding, TransformerBlock
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from cs336_harness.device import CPU_CONTEXT_LENGTH, check_device, default_device
from cs336_harness.progress import progress_bar

MIB = 2**20


@dataclass(frozen=True)
class SavedRecord:
    """One tensor handed to autograd for the backward pass."""

    module: str
    saved_by: str
    produced_by: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    duplicate: bool


@dataclass
class ResidualReport:
    """Everything saved during one call; ``total_bytes`` counts each storage once."""

    records: list[SavedRecord] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.records if not r.duplicate)

    @property
    def total_mib(self) -> float:
        return self.total_bytes / MIB

    def by(self, key: str) -> dict[str, int]:
        """Bytes per value of ``key`` (``module``, ``saved_by`` or ``produced_by``), largest first."""
        totals: dict[str, int] = defaultdict(int)
        for r in self.records:
            if not r.duplicate:
                totals[getattr(r, key)] += r.nbytes
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def rows(self) -> list[dict[str, Any]]:
        return [
            {"module": r.module, "saved_by": r.saved_by, "produced_by": r.produced_by, "shape": list(r.shape),
             "dtype": r.dtype, "mib": r.nbytes / MIB, "duplicate": r.duplicate}
            for r in self.records
        ]


class _OpTracker(TorchFunctionMode):
    """Remembers the outermost torch function in progress (the mode is off inside its own handler)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = "?"

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        previous, self.current = self.current, getattr(func, "__name__", str(func))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = previous


@contextlib.contextmanager
def _module_stack(root: nn.Module | None, stack: list[str]) -> Iterator[None]:
    if root is None:
        yield
        return
    names = {id(m): name or type(m).__name__ for name, m in root.named_modules()}

    def pre(module: nn.Module, args: Any) -> None:
        stack.append(names.get(id(module), type(module).__name__))

    def post(module: nn.Module, args: Any, output: Any) -> None:
        stack.pop()

    handles = [nn.modules.module.register_module_forward_pre_hook(pre),
               nn.modules.module.register_module_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def count_residuals(
    fn: Callable[..., Any], *args: Any, params: nn.Module | None = None, track: bool = True
) -> tuple[Any, ResidualReport]:
    """Run ``fn(*args)`` and record what autograd saves for backward.

    Args:
        fn: the forward computation; its output keeps the saved tensors alive until the caller drops it.
        params: a module whose parameters (and tensors sharing their storage) are not counted; with
            ``track``, also the root for module names.
        track: note module and torch-function names (eager code only).

    Returns:
        ``(fn(*args), report)``.
    """
    report = ResidualReport()
    param_storages = {_storage_key(p) for p in params.parameters()} if params is not None else set()
    seen: set[tuple[str, int]] = set()
    stack: list[str] = []
    ops = _OpTracker()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if isinstance(t, nn.Parameter) or key in param_storages:
            return t
        # Memory is held per storage: a view saved beside its base costs nothing extra.
        report.records.append(SavedRecord(
            module=stack[-1] if stack else "(top)",
            saved_by=ops.current if track else "?",
            produced_by=type(t.grad_fn).__name__ if t.grad_fn is not None else "(leaf or no-grad)",
            shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
            nbytes=t.untyped_storage().nbytes(), duplicate=key in seen,
        ))
        seen.add(key)
        return t

    with contextlib.ExitStack() as stack_ctx:
        stack_ctx.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        if track:
            stack_ctx.enter_context(_module_stack(params, stack))
            stack_ctx.enter_context(ops)
        out = fn(*args)
    return out, report


def rmsnorm_experiment(
    shape: tuple[int, ...] = (4, 512, 2560), compiled: bool = False, device: str = "cpu"
) -> ResidualReport:
    """Residuals of our RMSNorm on an fp32 input of ``shape``, eager or ``torch.compile``'d."""
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], device=torch.device(device))
    x = torch.randn(shape, device=device, requires_grad=True)
    fn = torch.compile(norm) if compiled else norm
    out, report = count_residuals(fn, x, params=norm, track=not compiled)
    out.sum().backward()
    return report


def make_block(
    d_model: int, d_ff: int, num_heads: int, context_length: int, device: str = "cpu"
) -> TransformerBlock:
    rope = RotaryEmbedding(context_length, d_model // num_heads, device=torch.device(device))
    return TransformerBlock(d_model, num_heads, d_ff, rope, device=torch.device(device))


def block_experiment(
    d_model: int = 2560, d_ff: int = 10240, num_heads: int = 32, batch_size: int = 4, context_length: int = 2048,
    compiled: bool = False, device: str = "cpu",
) -> ResidualReport:
    """Residuals of one TransformerBlock (xl sizes by default), eager or compiled with ``fullgraph``."""
    torch.manual_seed(0)
    block = make_block(d_model, d_ff, num_heads, context_length, device)
    x = torch.randn(batch_size, context_length, d_model, device=device, requires_grad=True)
    fn = torch.compile(block, fullgraph=True) if compiled else block
    out, report = count_residuals(fn, x, params=block, track=not compiled)
    del out
    return report


def four_blocks_experiment(
    d_model: int = 2560, d_ff: int = 10240, num_heads: int = 32, batch_size: int = 4, context_length: int = 2048,
    checkpointed: bool = False, compiled: bool = True, device: str = "cpu",
) -> ResidualReport:
    """One (compiled) block applied four times, plainly or as two checkpointed pairs."""
    torch.manual_seed(0)
    block = make_block(d_model, d_ff, num_heads, context_length, device)
    fn_block = torch.compile(block, fullgraph=True) if compiled else block
    x = torch.randn(batch_size, context_length, d_model, device=device, requires_grad=True)

    def two(h: torch.Tensor) -> torch.Tensor:
        return fn_block(fn_block(h))

    def four(h: torch.Tensor) -> torch.Tensor:
        if checkpointed:
            h = checkpoint(two, h, use_reentrant=False)
            return checkpoint(two, h, use_reentrant=False)
        return two(two(h))

    out, report = count_residuals(four, x, params=block, track=False)
    del out
    return report


def block_gradient_bytes(d_model: int = 2560, d_ff: int = 10240, bytes_per_param: int = 4) -> int:
    """Bytes of the gradients of one block's parameters: q, k, v, out; w1, w2, w3; two norm weights."""
    return (4 * d_model * d_model + 3 * d_model * d_ff + 2 * d_model) * bytes_per_param


EXPERIMENTS = ("rmsnorm", "block", "four-blocks")


# With CUDA the defaults are the handout's: the xl block, batch 4, context 2048.
GPU_SIZE, GPU_CONTEXT_LENGTH = "xl", 2048


@dataclass(frozen=True)
class ResidualsConfig:
    """Which experiments to run, on what device and at what sizes.

    Sizes left None follow the device: on CUDA the handout's xl block at context 2048, on CPU the tiny block at
    context :data:`cs336_harness.device.CPU_CONTEXT_LENGTH` (the xl one outgrows most machines' host memory there).
    ``d_model``, ``d_ff`` and ``num_heads`` override the ``size`` preset's.
    """

    experiments: tuple[str, ...] = EXPERIMENTS
    device: str = field(default_factory=default_device)
    size: str | None = None
    d_model: int | None = None
    d_ff: int | None = None
    num_heads: int | None = None
    batch_size: int = 4
    context_length: int | None = None
    rmsnorm_tokens: int = 512

    def __post_init__(self) -> None:
        unknown = [e for e in self.experiments if e not in EXPERIMENTS]
        if unknown or not self.experiments:
            raise ValueError(f"experiments must be drawn from {', '.join(EXPERIMENTS)}, got {self.experiments}")
        check_device(self.device)
        cuda = self.device.startswith("cuda")
        size = self.size or (GPU_SIZE if cuda else "tiny")
        if size not in PRESETS:
            raise ValueError(f"size must be one of {', '.join(PRESETS)}, got {size!r}")
        resolved = {name: PRESETS[size][name] if getattr(self, name) is None else getattr(self, name)
                    for name in ("d_model", "d_ff", "num_heads")}
        resolved["context_length"] = self.context_length or (GPU_CONTEXT_LENGTH if cuda else CPU_CONTEXT_LENGTH)
        for name, value in {"size": size, **resolved}.items():
            object.__setattr__(self, name, value)
        for name in ("d_model", "d_ff", "num_heads", "batch_size", "context_length", "rmsnorm_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ValueError(f"d_model / num_heads must be an even integer, got {self.d_model} / {self.num_heads}")

    @property
    def dims(self) -> dict[str, Any]:
        """The block's sizes and device, as the experiment functions take them."""
        return dict(d_model=self.d_model, d_ff=self.d_ff, num_heads=self.num_heads, batch_size=self.batch_size,
                    context_length=self.context_length, device=self.device)


def _rmsnorm_unit(config: ResidualsConfig, compiled: bool) -> tuple[list[dict[str, Any]], list[str]]:
    shape = (config.batch_size, config.rmsnorm_tokens, config.d_model)
    report = rmsnorm_experiment(shape, compiled=compiled, device=config.device)
    label = "compiled" if compiled else "eager"
    lines = [f"RMSNorm {label} on {shape}: {len(report.records)} saved, {report.total_mib:.2f} MiB unique"]
    lines += [f"  {r.shape} {r.dtype} saved by {r.saved_by}, produced by {r.produced_by}"
              f"{' (same storage as an earlier one)' if r.duplicate else ''}" for r in report.records]
    row = {"experiment": "rmsnorm", "variant": label, "shape": list(shape), "device": config.device,
           "num_saved": len(report.records), "saved_mib": report.total_mib}
    return [row], lines


def _block_unit(config: ResidualsConfig, compiled: bool) -> tuple[list[dict[str, Any]], list[str]]:
    report = block_experiment(compiled=compiled, **config.dims)
    label = "compiled" if compiled else "eager"
    lines = [f"TransformerBlock {label}: {report.total_mib:.2f} MiB saved for backward"]
    row = {"experiment": "block", "variant": label, **config.dims, "saved_mib": report.total_mib,
           "num_saved": len(report.records)}
    rows = [row]
    if not compiled:
        by_op = {f"{r.module}: {r.saved_by}": 0 for r in report.records}
        for r in report.records:
            if not r.duplicate:
                by_op[f"{r.module}: {r.saved_by}"] += r.nbytes
        top = sorted(by_op.items(), key=lambda kv: -kv[1])[:5]
        row["top5"] = [{"op": k, "mib": v / MIB, "share": v / report.total_bytes} for k, v in top]
        row["by_module"] = {k: v / MIB for k, v in report.by("module").items()}
        lines += [f"  {k}: {v / MIB:.1f} MiB ({v / report.total_bytes:.1%})" for k, v in top]
    else:  # the experiment's last measurement also reports the gradient bytes its residuals compare with
        grad = block_gradient_bytes(config.d_model, config.d_ff)
        lines.append(f"gradients of one block (fp32): {grad / MIB:.1f} MiB")
        rows.append({"experiment": "block-gradients", **config.dims, "grad_mib": grad / MIB})
    return rows, lines


def _four_blocks_unit(config: ResidualsConfig, checkpointed: bool) -> tuple[list[dict[str, Any]], list[str]]:
    report = four_blocks_experiment(checkpointed=checkpointed, **config.dims)
    label = "checkpointed pairs" if checkpointed else "plain"
    lines = [f"four compiled blocks, {label}: {report.total_mib:.2f} MiB saved for backward"]
    return [{"experiment": "four-blocks", "variant": label, **config.dims, "saved_mib": report.total_mib,
             "num_saved": len(report.records)}], lines


_UNITS: dict[str, tuple[tuple[str, Callable[[ResidualsConfig], tuple[list[dict[str, Any]], list[str]]]], ...]] = {
    "rmsnorm": (("RMSNorm eager", lambda c: _rmsnorm_unit(c, False)),
                ("RMSNorm compiled", lambda c: _rmsnorm_unit(c, True))),
    "block": (("block eager", lambda c: _block_unit(c, False)), ("block compiled", lambda c: _block_unit(c, True))),
    "four-blocks": (("four blocks plain", lambda c: _four_blocks_unit(c, False)),
                    ("four blocks checkpointed", lambda c: _four_blocks_unit(c, True))),
}


def run_experiments(config: ResidualsConfig, progress: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """Run the chosen experiments; returns result rows and printable lines. With ``progress``, a bar on stderr
    counts the measurements (each experiment has two: eager and compiled, or plain and checkpointed)."""
    units = [unit for experiment in EXPERIMENTS if experiment in config.experiments for unit in _UNITS[experiment]]
    rows: list[dict[str, Any]] = []
    lines: list[str] = []
    bar = progress_bar(total=len(units), desc="residuals", enabled=progress, unit="measurement")
    for name, measure in units:
        bar.set_postfix_str(name)
        unit_rows, unit_lines = measure(config)
        rows += unit_rows
        lines += unit_lines
        bar.update()
    bar.close()
    return rows, lines
