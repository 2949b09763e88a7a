"""One training step composed from its pieces: a :class:`TrainConfig` in sections goes in, a :class:`Training` with
``step(token_ids, targets)`` comes out (:func:`build_training`).

The sections (run control, the warm-up and timed steps, profiling, time limits, is the runner's, not the config's):

- ``model``: a :class:`cs336_basics.config.ModelConfig` (sizes, vocabulary, context), with ``fused_qkv`` (one matmul
  for q, k and v), the weights' ``seed`` and ``global_batch``, the sequences of a step over all ranks;
- ``kernels``: one :class:`cs336_basics.model.BlockKernels`, every piece a callable: ``attention`` ``fn(q, k, v,
  is_causal) -> out`` over (batch, heads, seq, head_dim) tensors, ``norm``, ``add_norm``, ``rotary``, ``gate`` and the
  LM head's ``loss`` (their signatures in :mod:`cs336_basics.model`); :mod:`cs336_harness.registry` has the ones the
  command line names;
- ``parallelism`` (:class:`Parallelism`): ranks and backend, the compute dtype, which FSDP, the activation
  checkpointing policy (or ``budget``, sized from the memory cap by :mod:`cs336_harness.memory_plan`), compiled
  blocks;
- ``optimizer`` (:class:`OptimizerConfig`): a factory ``fn(params, lr, weight_decay) -> Optimizer`` or a name of
  :data:`cs336_harness.registry.OPTIMIZERS`, with its learning rate and weight decay.

The composition, in one order (torchtitan's): :func:`build_model` (fp32 master weights, seeded, the kernels as the
model's constructor argument), activation checkpointing (the plan's policy; the segments that keep ops' outputs keep
the fused attention operators of :func:`saved_ops`), each block's forward compiled if asked, then FSDP with the
compute dtype (ours, :class:`cs336_sharding.fsdp.FSDP`, or PyTorch's ``fully_shard`` per block and on the root), and
the optimizer over the sharded parameters. :func:`build_block` is the same block alone, for what measures one.

    config = TrainConfig(ModelConfig.from_preset("tiny", vocab_size=1000, context_length=32),
                         kernels=BlockKernels(attention=my_attention),
                         parallelism=Parallelism(checkpoint="budget", memory_cap_gib=1.0),
                         optimizer=OptimizerConfig(my_optimizer_factory))
    training = build_training(config, torch.device("cpu"))
    loss = training.step(token_ids, targets)    # (global_batch / world_size, context) each, this rank's rows
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from cs336_basics.config import ModelConfig
from cs336_basics.model import PYTORCH_KERNELS, BasicsTransformerLM, BlockKernels, RotaryEmbedding, TransformerBlock
from cs336_sharding.checkpointing import SavedOps, apply_checkpointing, parse_policy
from cs336_sharding.parallelize import apply_compile, parallelize

from cs336_harness.device import DTYPES
from cs336_harness.registry import BUDGET, OPTIMIZERS, OptimizerFactory, check_name

if TYPE_CHECKING:
    from cs336_harness.memory_plan import MemoryPlan

FSDP_IMPLS: tuple[str, ...] = ("ours", "fsdp2")
COMPUTE_DTYPES: tuple[str, ...] = ("fp32", "bf16")


@dataclass(frozen=True)
class Parallelism:
    """How the step runs over its ranks: ``world_size`` ranks on ``backend`` (the process group's, which whoever
    runs the step starts; None: any), ``compute_dtype`` (``fp32`` or ``bf16``; master weights, gradients and
    optimizer state stay fp32), ``fsdp`` (``ours``, :class:`cs336_sharding.fsdp.FSDP`, or ``fsdp2``, ``fully_shard``
    per block and on the root, which needs a process group even on one rank), ``checkpoint`` (a policy of
    :mod:`cs336_sharding.checkpointing`, or ``budget``: the least recomputation within ``memory_cap_gib``; with
    ``budget_keeps_attention`` False a block that recomputes its matmuls keeps nothing: no ``attention`` tier, as in
    torchtitan's full and selective checkpointing), ``compile_blocks`` (each block's forward under
    ``torch.compile``) and ``memory_cap_gib`` (None: on a GPU a leaderboard rank's share,
    :func:`cs336_harness.memory_plan.default_memory_cap_bytes`)."""

    world_size: int = 1
    backend: str | None = None
    compute_dtype: str = "fp32"
    fsdp: str = "ours"
    checkpoint: str = "none"
    budget_keeps_attention: bool = True
    compile_blocks: bool = False
    memory_cap_gib: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        check_name("backend", self.backend, (None, "gloo", "nccl"))
        check_name("compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        check_name("fsdp", self.fsdp, FSDP_IMPLS)
        if self.checkpoint != BUDGET:
            parse_policy(self.checkpoint)
        for name in ("budget_keeps_attention", "compile_blocks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.memory_cap_gib is not None and not self.memory_cap_gib > 0:
            raise ValueError(f"memory_cap_gib must be positive or None, got {self.memory_cap_gib!r}")


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

    def build(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        factory = OPTIMIZERS[self.factory] if isinstance(self.factory, str) else self.factory
        return factory(params, self.lr, self.weight_decay)


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


@dataclass
class Training:
    """What :func:`build_training` composed; :meth:`step` is one training step on this rank's batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    finish_sync: Callable[[], None]  # after backward: every .grad the averaged local gradient
    plan: MemoryPlan
    config: TrainConfig

    def forward_backward(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward, loss, backward and gradient sync (each ``.grad`` is then the averaged local shard gradient);
        returns this rank's loss (not synchronised).

        Raises:
            ValueError: for a batch other than (at most ``batch_per_rank``, at most ``context_length``) token ids,
                the sizes its memory plan and checkpointing were made for, or targets of another shape.
        """
        most = (self.config.batch_per_rank, self.config.model.context_length)
        if token_ids.dim() != 2 or any(n > m for n, m in zip(token_ids.shape, most, strict=True)):
            raise ValueError(f"token_ids must be (batch, seq) with at most {most[0]} sequences of at most {most[1]} "
                             f"tokens (this rank's share of the config's batch, which its memory plan and "
                             f"checkpointing were made for), got {tuple(token_ids.shape)}")
        if targets.shape != token_ids.shape:
            raise ValueError(f"targets must be shaped like token_ids {tuple(token_ids.shape)}, got "
                             f"{tuple(targets.shape)}")
        loss = self.model(token_ids, targets)
        loss.backward()
        self.finish_sync()
        return loss.detach()

    def step(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`forward_backward`, then the optimizer update; returns this rank's loss (not synchronised)."""
        loss = self.forward_backward(token_ids, targets)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def fully_shard_blocks(model: nn.Module, device: torch.device, world_size: int,
                      compute_dtype: torch.dtype) -> nn.Module:
    """PyTorch's FSDP2 over ``model`` in place: ``fully_shard`` on every block, then on the root, with fp32 master
    weights, compute and all-gathers in ``compute_dtype`` and gradients reduced in fp32 (inside an initialised process
    group of ``world_size`` ranks); returns ``model``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build_training(config: TrainConfig, device: torch.device) -> Training:
    """The step of the module docstring for ``config``, on ``device``.

    With ``world_size`` ranks, call it on every rank of an initialised process group of that size (FSDP broadcasts
    rank 0's weights). Our FSDP on one rank also runs without a process group, in this process.

    Raises:
        ValueError: if the process group (or its absence) does not match ``config`` (ranks, backend), or ``budget``
            has no memory cap (given, or a GPU's to take one from).
    """
    # Imported here: the plan measures blocks that this module builds, so it imports this module.
    from cs336_harness.memory_plan import memory_plan

    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {type(device).__name__}")
    par = config.parallelism
    ranks = dist.get_world_size() if dist.is_initialized() else None
    if ranks is None and (par.world_size != 1 or par.fsdp != "ours"):
        raise ValueError(f"fsdp {par.fsdp!r} on world_size {par.world_size} needs an initialised process group of "
                         "that many ranks; without one, only our FSDP on world_size 1 runs")
    if ranks is not None and ranks != par.world_size:
        raise ValueError(f"world_size is {par.world_size}, but the process group has {ranks} ranks")
    if ranks is not None and par.backend is not None and dist.get_backend() != par.backend:
        raise ValueError(f"backend is {par.backend!r}, but the process group runs {dist.get_backend()!r}")
    cuda = device.type == "cuda"
    plan = memory_plan(config, torch.cuda.get_device_properties(device).total_memory if cuda else None)
    model = build_model(config.model, config.kernels, fused_qkv=config.fused_qkv, seed=config.seed, device=device)
    saved = saved_ops(config.model)
    if par.fsdp == "ours":
        fsdp = parallelize(model, checkpoint=plan.policy, saved=saved, compute_dtype=config.compute_dtype,
                           compile_blocks=par.compile_blocks)
        return Training(fsdp, config.optimizer.build(list(fsdp.parameters())), fsdp.finish_gradient_synchronization,
                        plan, config)
    apply_checkpointing(model, plan.policy, saved)
    if par.compile_blocks:
        apply_compile(model)
    model = fully_shard_blocks(model, device, par.world_size, config.compute_dtype)
    return Training(model, config.optimizer.build(list(model.parameters())), lambda: None, plan, config)


def make_batch(config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Random input and target token ids of the whole global batch, each (global_batch, context_length), on CPU;
    rank r trains on rows ``[r * B / n, (r + 1) * B / n)``."""
    g = torch.Generator().manual_seed(1000 + config.seed)
    shape = (config.global_batch, config.model.context_length)
    vocab = config.model.vocab_size
    return torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g)


def rank_batch(config: TrainConfig, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of :func:`make_batch`, on ``device``."""
    per_rank = config.batch_per_rank
    inputs, targets = make_batch(config)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return inputs[rows].to(device), targets[rows].to(device)
