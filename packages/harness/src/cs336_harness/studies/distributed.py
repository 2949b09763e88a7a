"""What every multi-rank training study shares: its config (a preset model, a global batch split over the ranks,
dtypes and wrapper variants) and the folder its traces go to."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from cs336_basics.config import DEFAULT_CONTEXT_LENGTH, DEFAULT_VOCAB_SIZE, PRESETS, ModelConfig
from cs336_comms.process_group import default_backend, launched_by_torchrun

from cs336_harness.device import GIB
from cs336_harness.train_config import COMPUTE_DTYPES


@contextlib.contextmanager
def trace_folder(keep: str | Path | None) -> Iterator[Path]:
    """Where rank 0 writes its profiler traces: ``keep`` (created if missing, and kept), or a temporary folder that is
    deleted on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        yield folder


def check_backend(backend: str, world_size: int) -> None:
    """That ``backend`` can run ``world_size`` ranks here: gloo anywhere, nccl with one visible GPU per rank (under
    torchrun, whose ranks may span machines, with a GPU at all).

    Raises:
        ValueError: naming what was expected and what was given.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA GPUs and none is visible here; use gloo on CPU")
    if backend == "nccl" and not launched_by_torchrun() and world_size > torch.cuda.device_count():
        raise ValueError(f"backend 'nccl' needs one GPU per rank: {world_size} ranks asked for, "
                         f"{torch.cuda.device_count()} GPUs visible")


@dataclass(frozen=True)
class DistributedRunConfig:
    """What every multi-rank training benchmark takes: a preset model, a global batch split over the
    ranks, dtypes, and wrapper variants from the subclass's ``VARIANTS``."""

    VARIANTS: ClassVar[tuple[str, ...]] = ()
    MIN_WARMUP: ClassVar[int] = 0

    size: str = "xl"
    context_length: int = DEFAULT_CONTEXT_LENGTH
    global_batch: int = 4
    world_size: int = 2
    backend: str | None = None  # nccl with GPUs, gloo without
    dtypes: tuple[str, ...] = ("fp32",)
    variants: tuple[str, ...] = ()  # empty: all of VARIANTS
    warmup: int = 2
    steps: int = 5
    vocab_size: int = DEFAULT_VOCAB_SIZE
    lr: float = 1e-4

    def __post_init__(self) -> None:
        if not self.variants:
            object.__setattr__(self, "variants", self.VARIANTS)
        if self.size not in PRESETS:
            raise ValueError(f"size must be one of {', '.join(PRESETS)}, got {self.size!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size}")
        if self.global_batch < 1 or self.context_length < 1 or self.vocab_size < 2:
            raise ValueError("global_batch and context_length must be positive and vocab_size at least 2, got "
                             f"{self.global_batch}, {self.context_length}, {self.vocab_size}")
        if self.global_batch % self.world_size != 0:
            raise ValueError(f"global_batch ({self.global_batch}) must be a multiple of world_size ({self.world_size})")
        if not self.dtypes or any(d not in COMPUTE_DTYPES for d in self.dtypes):
            raise ValueError(f"dtypes must be a non-empty subset of {list(COMPUTE_DTYPES)}, got {self.dtypes}")
        if any(v not in self.VARIANTS for v in self.variants):
            raise ValueError(f"variants must be a non-empty subset of {list(self.VARIANTS)}, got {self.variants}")
        if self.warmup < self.MIN_WARMUP or self.steps < 1:
            raise ValueError(f"need warmup >= {self.MIN_WARMUP} and steps >= 1; got {self.warmup}, {self.steps}")
        # Last: the values above are wrong anywhere, the backend only on this machine.
        check_backend(self.resolved_backend, self.world_size)

    @property
    def resolved_backend(self) -> str:
        return self.backend or default_backend()

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_preset(self.size, vocab_size=self.vocab_size, context_length=self.context_length)

    def describe(self) -> str:
        """What the run asked for, in words, for messages (a rank that died names it)."""
        params = self.model_config.num_params
        return (f"size {self.size} ({params / 1e6:.0f}M parameters, {16 * params / GIB:.2f} GiB of fp32 weights, "
                f"gradients and AdamW moments unsharded), context {self.context_length}, global batch "
                f"{self.global_batch} over {self.world_size} {self.resolved_backend} ranks")
