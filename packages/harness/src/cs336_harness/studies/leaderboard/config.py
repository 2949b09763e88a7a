"""A leaderboard run's configuration: :class:`LeaderboardConfig` (validated), the handout's run, the CPU try-out,
the one-GPU proxy of a rank (:data:`PROXY_DEFAULTS`) and the PyTorch-only baselines' recipes (:func:`recipe`).

A config names its pieces as the command line and the rows do (:mod:`cs336_harness.registry`), and holds the run's
control (warm-up, steps, profiling, time limit); :meth:`LeaderboardConfig.train_config` is the step it runs, a
:class:`cs336_harness.train_config.TrainConfig` of the named callables. Ours is our FSDP with the fused linear +
cross-entropy; the baselines (``impl`` of :data:`RECIPES`) are the PyTorch-only steps a user would write: FSDP2
(``fully_shard`` per block and on the root, fp32 master weights and gradient reduction), SDPA, the model's own glue,
the chunked loss :func:`cs336_harness.registry.chunked_cross_entropy` and ``torch.optim.AdamW(fused=True)``.
``torch_native`` checkpoints every block, keeping nothing (the plain recipe); ``torch_native_compiled`` (the strong
recipe, what torchtitan-style users run) compiles each block with its checkpoint and chooses per block, within the
memory cap, torchtitan's kinds of checkpointing by the budget's rule: none, selective (the matmuls' and SDPA's
outputs kept, the rest recomputed) or full, ``first:N+selective:M`` (N full, then M selective, the rest kept; the
row's ``checkpoint`` says which).

The proxy is world size 1, one sequence, the 8B block shape with :func:`proxy_num_layers` layers (14: unsharded,
they and the embeddings and head hold about the fp32 state of one of the two ranks), so that a step on one GPU does
a rank's work per layer and holds a rank's state; it lacks the communication and the other 20 layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cs336_basics.config import PRESETS, ModelConfig
from cs336_comms.process_group import default_backend
from cs336_sharding.checkpointing import plan_segments

from cs336_harness import registry
from cs336_harness.memory_plan import LEADERBOARD_MODEL, LEADERBOARD_WORLD_SIZE
from cs336_harness.train_config import COMPUTE_DTYPES, OptimizerConfig, Parallelism, TrainConfig

IMPLS: tuple[str, ...] = ("ours", "torch_native", "torch_native_compiled")

# The handout's leaderboard run, and the CPU try-out that `cs336 leaderboard` uses without CUDA.
LEADERBOARD_DEFAULTS: dict[str, Any] = dict(size="8B", vocab_size=LEADERBOARD_MODEL.vocab_size,
                                            context_length=LEADERBOARD_MODEL.context_length, global_batch=2,
                                            world_size=LEADERBOARD_WORLD_SIZE, compute_dtype="bf16")
CPU_DEFAULTS: dict[str, Any] = dict(size="tiny", vocab_size=1_000, context_length=32, global_batch=2, world_size=2,
                                    compute_dtype="fp32")
# What each recipe fixes; the baselines are PyTorch's pieces throughout (baselines.py).
_BASELINE_FIXED: dict[str, Any] = dict(attention="sdpa", optimizer="torch-adamw", glue="model", fused_qkv=False)
RECIPES: dict[str, dict[str, Any]] = {
    "torch_native": dict(_BASELINE_FIXED, checkpoint="all", compile_blocks=False),
    "torch_native_compiled": dict(_BASELINE_FIXED, checkpoint=registry.BUDGET, compile_blocks=True),
}


@dataclass(frozen=True)
class LeaderboardConfig:
    """One leaderboard run. Defaults are the handout's configuration (two GPUs) with our implementation."""

    size: str = LEADERBOARD_DEFAULTS["size"]
    vocab_size: int = LEADERBOARD_DEFAULTS["vocab_size"]
    context_length: int = LEADERBOARD_DEFAULTS["context_length"]
    global_batch: int = LEADERBOARD_DEFAULTS["global_batch"]
    world_size: int = LEADERBOARD_DEFAULTS["world_size"]
    num_layers: int | None = None  # None: the preset's
    backend: str | None = None  # nccl with GPUs, gloo without
    compute_dtype: str = LEADERBOARD_DEFAULTS["compute_dtype"]
    impl: str = "ours"
    attention: str = "triton"
    checkpoint: str = "all"  # a policy of cs336_sharding.checkpointing, or "budget"
    glue: str = "model"
    compile_blocks: bool = False
    fused_qkv: bool = False
    memory_cap_gib: float | None = None  # None: default_memory_cap_bytes on a GPU, no cap on CPU
    optimizer: str = "fused-adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 2
    steps: int = 3
    profile: bool = False
    handout_timing: bool = False
    time_limit_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size not in PRESETS:
            raise ValueError(f"size must be one of {', '.join(PRESETS)}, got {self.size!r}")
        for name in ("vocab_size", "context_length", "global_batch", "world_size", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_layers is not None and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise ValueError(f"num_layers must be a positive int or None (the preset's), got {self.num_layers!r}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {self.vocab_size}")
        if self.global_batch % self.world_size != 0:
            raise ValueError(f"global_batch ({self.global_batch}) must be a multiple of world_size ({self.world_size})")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a non-negative int, got {self.warmup!r}")
        choices = {"backend": (None, "gloo", "nccl"), "compute_dtype": COMPUTE_DTYPES, "impl": IMPLS,
                   "attention": registry.ATTENTIONS, "optimizer": registry.OPTIMIZERS, "glue": registry.GLUES}
        for name, allowed in choices.items():
            registry.check_name(name, getattr(self, name), allowed)
        for name in ("compile_blocks", "fused_qkv", "profile", "handout_timing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.checkpoint != registry.BUDGET:
            plan_segments(self.model_config.num_layers, self.checkpoint)  # the policy, and the blocks it names exist
        if self.memory_cap_gib is not None and not self.memory_cap_gib > 0:
            raise ValueError(f"memory_cap_gib must be positive or None, got {self.memory_cap_gib!r}")
        if self.impl in RECIPES:
            fixed = {k: v for k, v in RECIPES[self.impl].items() if k != "checkpoint"}
            wrong = {k: getattr(self, k) for k, v in fixed.items() if getattr(self, k) != v}
            if wrong:
                raise ValueError(f"impl {self.impl!r} is PyTorch's step with {fixed}; got {wrong} "
                                 "(recipe() makes a baseline's config)")
        if not self.lr > 0 or not self.weight_decay >= 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got {self.lr} and {self.weight_decay}")
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be positive, got {self.time_limit_s}")
        if self.resolved_backend == "gloo" and self.compute_dtype != "fp32":
            raise ValueError(f"compute_dtype {self.compute_dtype!r} needs GPUs: on CPU (gloo) the Triton kernels run "
                             "in the interpreter, whose bf16 dot products are wrong; use fp32")
        if self.checkpoint == registry.BUDGET and self.resolved_backend == "gloo" and self.memory_cap_gib is None:
            raise ValueError("checkpoint 'budget' on CPU needs memory_cap_gib (its default comes from the GPU's "
                             "memory)")

    @property
    def resolved_backend(self) -> str:
        return self.backend or default_backend()

    @property
    def model_config(self) -> ModelConfig:
        layers = {} if self.num_layers is None else {"num_layers": self.num_layers}
        return ModelConfig.from_preset(self.size, vocab_size=self.vocab_size, context_length=self.context_length,
                                       **layers)

    @property
    def batch_per_rank(self) -> int:
        return self.global_batch // self.world_size

    def train_config(self) -> TrainConfig:
        """The step this run times (module docstring), its pieces the callables the names stand for (imports the
        kernels: on CPU, choose the Triton interpreter first)."""
        ours = self.impl == "ours"
        kernels = registry.kernels(self.attention, self.glue, "fused" if ours else "chunked")
        parallelism = Parallelism(world_size=self.world_size, backend=self.backend, compute_dtype=self.compute_dtype,
                                  wrapper="fsdp" if ours else "fsdp2", checkpoint=self.checkpoint,
                                  budget_keeps_attention=ours, compile="blocks" if self.compile_blocks else "none",
                                  memory_cap_gib=self.memory_cap_gib)
        return TrainConfig(self.model_config, kernels=kernels, parallelism=parallelism,
                           optimizer=OptimizerConfig(self.optimizer, self.lr, self.weight_decay),
                           global_batch=self.global_batch, fused_qkv=self.fused_qkv, seed=self.seed)


def recipe(config: LeaderboardConfig, impl: str) -> LeaderboardConfig:
    """``config`` as ``impl`` runs it: itself for ``ours``, else with the baseline's settings (:data:`RECIPES`)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    return dataclasses.replace(config, impl=impl, **RECIPES.get(impl, {}))


def proxy_num_layers() -> int:
    """Layers of the 8B block shape whose fp32 state, unsharded with the embeddings and head, is nearest that of one
    rank of the two-GPU leaderboard run: the proxy's depth (14)."""
    full = LEADERBOARD_MODEL
    rest = 2 * full.vocab_size * full.d_model + full.d_model  # embeddings, head, final norm
    per_block = (full.num_params - rest) // full.num_layers
    return round((full.num_params / LEADERBOARD_DEFAULTS["world_size"] - rest) / per_block)


# The one-GPU proxy of a leaderboard rank (module docstring).
PROXY_DEFAULTS: dict[str, Any] = dict(LEADERBOARD_DEFAULTS, world_size=1, global_batch=1, num_layers=proxy_num_layers())
