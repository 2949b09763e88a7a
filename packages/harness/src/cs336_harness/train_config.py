"""What a training step is made of: :class:`TrainConfig` in sections, and the model it describes (:func:`build_model`,
:func:`build_block`, :func:`saved_ops`). :mod:`cs336_harness.training` composes the step from these
(``build_training``); :mod:`cs336_harness.memory_plan` measures the same blocks and loss to plan its memory. Both
import this module and neither imports the other's caller, so the step's composition and its plan stay one
direction: config -> plan -> training.

The sections (run control, the warm-up and timed steps, profiling, time limits, is the runner's, not the config's):

- ``model``: a :class:`cs336_basics.config.ModelConfig` (sizes, vocabulary, context), with ``fused_qkv`` (one matmul
  for q, k and v), the weights' ``seed`` and ``global_batch``, the sequences of a step over all ranks;
- ``kernels``: one :class:`cs336_basics.model.BlockKernels`, every piece a callable: ``attention`` ``fn(q, k, v,
  is_causal) -> out`` over (batch, heads, seq, head_dim) tensors, ``norm``, ``add_norm``, ``rotary``, ``gate`` and the
  LM head's ``loss`` (their signatures in :mod:`cs336_basics.model`); :mod:`cs336_harness.registry` has the ones the
  command line names;
- ``parallelism`` (:class:`Parallelism`): ranks and backend, the compute dtype, the wrapper that keeps the ranks'
  gradients in step (none, our four DDPs, torch's DDP, ZeRO-1, our FSDP, FSDP2), the activation checkpointing policy
  (or ``budget``, sized from the memory cap by :mod:`cs336_harness.memory_plan`), what is compiled;
- ``optimizer`` (:class:`OptimizerConfig`): a factory ``fn(params, lr, weight_decay) -> Optimizer`` or a name of
  :data:`cs336_harness.registry.OPTIMIZERS`, with its learning rate and weight decay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from cs336_basics.config import ModelConfig
from cs336_basics.model import PYTORCH_KERNELS, BasicsTransformerLM, BlockKernels, RotaryEmbedding, TransformerBlock
from cs336_sharding.checkpointing import SavedOps, parse_policy

from cs336_harness.device import DTYPES
from cs336_harness.registry import BUDGET, OPTIMIZERS, OptimizerFactory, check_name

COMPUTE_DTYPES: tuple[str, ...] = ("fp32", "bf16")
# What keeps the ranks' gradients in step (Parallelism's docstring).
WRAPPERS: tuple[str, ...] = ("none", "naive", "flat", "overlapped", "bucketed", "torch_ddp", "zero1", "fsdp", "fsdp2")
# The wrappers that run the blocks in the compute dtype themselves (they cast the weights they gather); under the
# others a compute dtype other than fp32 is autocast.
CASTING_WRAPPERS: tuple[str, ...] = ("fsdp", "fsdp2")
# PyTorch's wrappers, which need a process group even on one rank.
GROUP_WRAPPERS: tuple[str, ...] = ("torch_ddp", "zero1", "fsdp2")
COMPILES: tuple[str, ...] = ("none", "blocks", "model")


@dataclass(frozen=True)
class Parallelism:
    """How the step runs over its ranks: ``world_size`` ranks on ``backend`` (the process group's, which whoever
    runs the step starts; None: any) and ``wrapper``, what keeps their gradients in step:

    - ``none``: the bare model, gradients not exchanged (one process, or the compute-only reference of several);
    - ``naive``, ``flat``, ``overlapped``, ``bucketed``: :mod:`cs336_comms.ddp` (``bucketed`` by ``bucket_size_mb``);
    - ``torch_ddp``: ``torch.nn.parallel.DistributedDataParallel`` with buckets of ``bucket_size_mb``;
    - ``zero1``: torch's DDP with the optimizer's state sharded (:class:`cs336_sharding.optimizer.ShardedOptimizer`
      around the optimizer);
    - ``fsdp``: ours, :class:`cs336_sharding.fsdp.FSDP`; ``fsdp2``: ``fully_shard`` per block and on the root.

    ``compute_dtype`` (``fp32`` or ``bf16``; master weights, gradients and optimizer state stay fp32) is the FSDPs'
    compute and gather dtype, and autocast under the other wrappers. ``checkpoint`` is a policy of
    :mod:`cs336_sharding.checkpointing`, or ``budget``: the least recomputation within ``memory_cap_gib`` (None: on a
    GPU a leaderboard rank's share, :func:`cs336_harness.memory_plan.default_memory_cap_bytes`); with
    ``budget_keeps_attention`` False a block that recomputes its matmuls keeps nothing: no ``attention`` tier, as in
    torchtitan's full and selective checkpointing. ``compile``: ``blocks`` puts each block's forward under
    ``torch.compile``, ``model`` the whole bare model (wrapper ``none``). PyTorch's wrappers (``torch_ddp``,
    ``zero1``, ``fsdp2``) need a process group even on one rank."""

    world_size: int = 1
    backend: str | None = None
    compute_dtype: str = "fp32"
    wrapper: str = "fsdp"
    bucket_size_mb: float = 25.0
    checkpoint: str = "none"
    budget_keeps_attention: bool = True
    compile: str = "none"
    memory_cap_gib: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        check_name("backend", self.backend, (None, "gloo", "nccl"))
        check_name("compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        check_name("wrapper", self.wrapper, WRAPPERS)
        if not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive, got {self.bucket_size_mb!r}")
        if self.checkpoint != BUDGET:
            parse_policy(self.checkpoint)
        if not isinstance(self.budget_keeps_attention, bool):
            raise TypeError(f"budget_keeps_attention must be a bool, got {self.budget_keeps_attention!r}")
        check_name("compile", self.compile, COMPILES)
        if self.compile == "model" and self.wrapper != "none":
            raise ValueError(f"compile 'model' compiles the bare model (wrapper 'none'), got wrapper {self.wrapper!r}; "
                             "under a wrapper, compile 'blocks'")
        if self.memory_cap_gib is not None and not self.memory_cap_gib > 0:
            raise ValueError(f"memory_cap_gib must be positive or None, got {self.memory_cap_gib!r}")

    @property
    def autocast(self) -> bool:
        """Whether the step runs under autocast: a compute dtype other than fp32 that the wrapper does not cast to."""
        return self.compute_dtype != "fp32" and self.wrapper not in CASTING_WRAPPERS


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer: ``factory`` ``fn(params, lr, weight_decay) -> torch.optim.Optimizer``, or a name of
    :data:`cs336_harness.registry.OPTIMIZERS`; called with this rank's (sharded) parameters."""

    factory: str | OptimizerFactory = "fused-adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if isinstance(self.factory, str):
            check_name("optimizer", self.factory, OPTIMIZERS)
        elif not callable(self.factory):
            raise TypeError(f"optimizer factory must be a name of {', '.join(OPTIMIZERS)} or a callable "
                            f"fn(params, lr, weight_decay), got {type(self.factory).__name__}")
        if not self.lr > 0 or not self.weight_decay >= 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got {self.lr} and {self.weight_decay}")

    @property
    def make(self) -> OptimizerFactory:
        """The factory: the callable given, or the registered one of that name."""
        return OPTIMIZERS[self.factory] if isinstance(self.factory, str) else self.factory

    def build(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over ``params`` (this rank's parameters, sharded or whole)."""
        return self.make(params, self.lr, self.weight_decay)


@dataclass(frozen=True)
class TrainConfig:
    """A training step in sections (module docstring); ``global_batch`` sequences of ``model.context_length`` tokens
    a step, ``global_batch / world_size`` on each rank."""

    model: ModelConfig
    kernels: BlockKernels = PYTORCH_KERNELS
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    global_batch: int = 1
    fused_qkv: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name, kind in (("model", ModelConfig), ("kernels", BlockKernels), ("parallelism", Parallelism),
                           ("optimizer", OptimizerConfig)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}")
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise ValueError(f"global_batch must be a positive int, got {self.global_batch!r}")
        if self.global_batch % self.parallelism.world_size != 0:
            raise ValueError(f"global_batch ({self.global_batch}) must be a multiple of world_size "
                             f"({self.parallelism.world_size})")
        if not isinstance(self.fused_qkv, bool):
            raise TypeError(f"fused_qkv must be a bool, got {self.fused_qkv!r}")

    @property
    def batch_per_rank(self) -> int:
        return self.global_batch // self.parallelism.world_size

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.parallelism.compute_dtype]


def build_model(model: ModelConfig, kernels: BlockKernels = PYTORCH_KERNELS, *, fused_qkv: bool = False,
                seed: int = 0, device: torch.device | None = None, dtype: torch.dtype | None = None,
                ) -> BasicsTransformerLM:
    """The ``BasicsTransformerLM`` of ``model`` run by ``kernels`` (its loss among them), its weights drawn from
    ``seed`` (every rank and a reference build the same ones), in ``dtype`` (None: fp32) on ``device``."""
    torch.manual_seed(seed)
    return BasicsTransformerLM.from_config(model, kernels=kernels, fused_qkv=fused_qkv, device=device, dtype=dtype)


def build_block(model: ModelConfig, kernels: BlockKernels = PYTORCH_KERNELS, *, fused_qkv: bool = False,
                seed: int = 0, device: torch.device | None = None, dtype: torch.dtype | None = None,
                ) -> TransformerBlock:
    """One block of :func:`build_model`'s model alone, with its own RoPE tables (fp32, as the model keeps them)."""
    torch.manual_seed(seed)
    rope = RotaryEmbedding(model.context_length, model.head_dim, model.rope_theta, device=device)
    return TransformerBlock(model.d_model, model.num_heads, model.d_ff, rope, device=device, dtype=dtype,
                            kernels=kernels, fused_qkv=fused_qkv)


def saved_ops(model: ModelConfig) -> SavedOps:
    """What the ``attention`` and ``selective`` checkpointing segments of ``model``'s blocks keep: the fused
    attention operators SDPA dispatches to and, once ``cs336_kernels`` has registered it (a model using our kernel
    has imported it), our FlashAttention forward; ``selective`` recomputes the down projection, whose output feeds
    only the residual add (its (d_ff, d_model) weight operand tells it apart unless d_ff == d_model)."""
    aten = torch.ops.aten
    ops = {aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default}
    if hasattr(torch.ops.cs336, "flash_attention_forward"):
        ops.add(torch.ops.cs336.flash_attention_forward.default)
    skipped = None if model.d_ff == model.d_model else (model.d_ff, model.d_model)
    return SavedOps(attention=frozenset(ops), skipped_operand=skipped)
