"""One training step composed from its pieces: a :class:`~cs336_harness.train_config.TrainConfig` in sections goes in,
a :class:`Training` with ``step(token_ids, targets)`` comes out (:func:`build_training`). Every command that trains
(``cs336 bench``, ``ddp``, ``shard``, ``leaderboard``) builds its step here; what a study varies (the wrapper, the
compute dtype, checkpointing, compilation, the optimizer) is a field of the config, not a recipe of its own.

The composition, in one order (torchtitan's): :func:`~cs336_harness.train_config.build_model` (fp32 master weights,
seeded, the kernels as the model's constructor argument), activation checkpointing (the policy given, or the memory
plan's for ``budget``; the segments that keep ops' outputs keep the fused attention operators of
:func:`~cs336_harness.train_config.saved_ops`), each block's forward compiled if asked, then the wrapper (the model
itself, a DDP, ZeRO-1's DDP, our FSDP or FSDP2, the FSDPs with the compute dtype), the whole model compiled if asked,
and the optimizer over this rank's parameters (ZeRO-1: sharded around the optimizer). Under a wrapper that does not
cast the weights (all but the FSDPs), a compute dtype other than fp32 is autocast around the forward and its loss.

    config = TrainConfig(ModelConfig.from_preset("tiny", vocab_size=1000, context_length=32),
                         kernels=BlockKernels(attention=my_attention),
                         parallelism=Parallelism(checkpoint="budget", memory_cap_gib=1.0),
                         optimizer=OptimizerConfig(my_optimizer_factory))
    training = build_training(config, torch.device("cpu"))
    loss = training.step(token_ids, targets)    # (global_batch / world_size, context) each, this rank's rows

A study that times the phases calls them one by one: :meth:`Training.forward`, ``loss.backward()``,
:attr:`Training.finish_sync`, :meth:`Training.optimizer_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from cs336_comms.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP
from cs336_sharding.checkpointing import CheckpointPolicySpec, apply_checkpointing, parse_policy
from cs336_sharding.fsdp import FSDP
from cs336_sharding.optimizer import ShardedOptimizer
from cs336_sharding.parallelize import apply_compile

from cs336_harness.memory_plan import MemoryPlan, device_memory_bytes, memory_plan
from cs336_harness.registry import BUDGET
from cs336_harness.train_config import GROUP_WRAPPERS, TrainConfig, build_model, saved_ops


@dataclass
class Training:
    """What :func:`build_training` composed; :meth:`step` is one training step on this rank's batch."""

    model: nn.Module  # what the step calls: the model inside its wrapper (compiled, for compile "model")
    make_optimizer: Callable[[], torch.optim.Optimizer]
    finish_sync: Callable[[], None]  # after backward: every .grad the averaged local gradient
    policy: CheckpointPolicySpec  # the checkpointing that runs (budget resolved)
    config: TrainConfig
    device: torch.device
    _plan: MemoryPlan | None = None
    _optimizer: torch.optim.Optimizer | None = None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer, made when first asked for: a run that only times forward (and backward) passes never
        builds one (torch.optim's constructor alone imports torch._dynamo, about 90 MB of host memory)."""
        if self._optimizer is None:
            self._optimizer = self.make_optimizer()
        return self._optimizer

    @property
    def plan(self) -> MemoryPlan:
        """The step's :class:`~cs336_harness.memory_plan.MemoryPlan` (made when first asked for, unless ``budget``
        needed it to choose the policy)."""
        if self._plan is None:
            self._plan = memory_plan(self.config, device_memory_bytes(self.device))
        return self._plan

    def forward(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The forward and its loss (under autocast where the config's compute dtype asks for it); returns this
        rank's loss, not synchronised.

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
        autocast = (torch.autocast(self.device.type, dtype=self.config.compute_dtype)
                    if self.config.parallelism.autocast else contextlib.nullcontext())
        with autocast:
            return self.model(token_ids, targets)

    def forward_backward(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`forward`, backward and gradient sync (each ``.grad`` is then the averaged local gradient or shard
        gradient); returns this rank's loss (not synchronised)."""
        loss = self.forward(token_ids, targets)
        loss.backward()
        self.finish_sync()
        return loss.detach()

    def optimizer_step(self) -> None:
        """The optimizer's update, then the gradients set to None."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`forward_backward`, then :meth:`optimizer_step`; returns this rank's loss (not synchronised)."""
        loss = self.forward_backward(token_ids, targets)
        self.optimizer_step()
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


def _no_sync() -> None:
    """The gradient sync of a wrapper that has none to finish (none, or one that waits inside backward)."""


def _wrap(model: nn.Module, config: TrainConfig, device: torch.device) -> tuple[nn.Module, Callable[[], None]]:
    """``model`` inside ``config``'s wrapper (:class:`~cs336_harness.train_config.Parallelism`), and the call that
    finishes its gradient synchronisation after backward."""
    par = config.parallelism
    if par.wrapper == "none":
        return model, _no_sync
    if par.wrapper == "fsdp":
        fsdp = FSDP(model, compute_dtype=config.compute_dtype)
        return fsdp, fsdp.finish_gradient_synchronization
    if par.wrapper == "fsdp2":
        return fully_shard_blocks(model, device, par.world_size, config.compute_dtype), _no_sync
    if par.wrapper in ("torch_ddp", "zero1"):
        device_ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                                   bucket_cap_mb=par.bucket_size_mb), _no_sync
    if par.wrapper == "bucketed":
        ddp = BucketedDDP(model, bucket_size_mb=par.bucket_size_mb)
    else:
        ddp = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP}[par.wrapper](model)
    return ddp, ddp.finish_gradient_synchronization


def _check_process_group(config: TrainConfig) -> None:
    par = config.parallelism
    ranks = dist.get_world_size() if dist.is_initialized() else None
    if ranks is None and (par.world_size != 1 or par.wrapper in GROUP_WRAPPERS):
        raise ValueError(f"wrapper {par.wrapper!r} on world_size {par.world_size} needs an initialised process group "
                         f"of that many ranks; without one, world_size 1 runs with any wrapper but "
                         f"{', '.join(GROUP_WRAPPERS)}")
    if ranks is not None and ranks != par.world_size:
        raise ValueError(f"world_size is {par.world_size}, but the process group has {ranks} ranks")
    if ranks is not None and par.backend is not None and dist.get_backend() != par.backend:
        raise ValueError(f"backend is {par.backend!r}, but the process group runs {dist.get_backend()!r}")


def build_training(config: TrainConfig, device: torch.device) -> Training:
    """The step of the module docstring for ``config``, on ``device``.

    With ``world_size`` ranks, call it on every rank of an initialised process group of that size (the wrappers
    broadcast rank 0's weights). On one rank, all but PyTorch's wrappers also run without a process group.

    Raises:
        ValueError: if the process group (or its absence) does not match ``config`` (ranks, backend), or ``budget``
            has no memory cap (given, or a GPU's to take one from) or a wrapper the plan does not cover.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {type(device).__name__}")
    _check_process_group(config)
    par = config.parallelism
    plan = memory_plan(config, device_memory_bytes(device)) if par.checkpoint == BUDGET else None
    policy = parse_policy(par.checkpoint) if plan is None else plan.policy
    model = build_model(config.model, config.kernels, fused_qkv=config.fused_qkv, seed=config.seed, device=device)
    apply_checkpointing(model, policy, saved_ops(config.model))
    if par.compile == "blocks":
        apply_compile(model)
    wrapped, finish_sync = _wrap(model, config, device)
    if par.compile == "model":
        wrapped = torch.compile(wrapped)
    params = list(wrapped.parameters())  # this rank's: an FSDP's are its shards
    if par.wrapper == "zero1":
        make = config.optimizer.make

        def make_optimizer() -> torch.optim.Optimizer:
            return ShardedOptimizer(params, lambda groups, lr, weight_decay: make(groups, lr, weight_decay),
                                    lr=config.optimizer.lr, weight_decay=config.optimizer.weight_decay)
    else:
        def make_optimizer() -> torch.optim.Optimizer:
            return config.optimizer.build(params)
    return Training(wrapped, make_optimizer, finish_sync, policy, config, device, plan)


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
