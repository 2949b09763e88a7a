"""The handout's leaderboard training step (section 9), composed from this repo's pieces, and its baselines.

One step is forward, loss, backward, gradient synchronisation and AdamW update of a ``BasicsTransformerLM``
on ``world_size`` ranks, each holding ``global_batch / world_size`` sequences. The leaderboard
configuration is the 8B preset at vocabulary 151,936, context 32,768, global batch 2, bf16 compute, causal,
on two GPUs. For ``impl="ours"``, :func:`build_training` composes:

1. ``BasicsTransformerLM`` with fp32 master weights on the rank's device, built with its pieces: its attention
   (``triton``, our FlashAttention-2 kernel, or ``sdpa``), its glue (``glue``, :mod:`cs336_harness.studies.glue`:
   the model's code, our Triton RMSNorm (with the residual add before ``ln2`` folded in) / RoPE / SiLU-mul kernels,
   or torch.compile of their references), the LM head's loss ``cs336_kernels.fused_linear_cross_entropy`` (the
   (tokens, vocab) logits never exist) and, with ``fused_qkv``, one (3d, d) matmul for q, k and v;
2. :func:`cs336_sharding.parallelize.parallelize`: activation checkpointing of the blocks (``checkpoint``),
   optionally each block's forward compiled (``compile_blocks``), and our FSDP with ``compute_dtype``;
   ``finish_gradient_synchronization()`` after each backward;
3. AdamW over the FSDP model's parameters (this rank's fp32 shards), by the names of
   :mod:`cs336_harness.studies.optimizers`: our Triton ``fused-adamw`` or ``torch-adamw`` (fused).

``impl="torch_native"`` and ``"torch_native_compiled"`` are the PyTorch-only steps of
:mod:`cs336_harness.studies.leaderboard_baselines` (FSDP2, SDPA, a chunked checkpointed LM head + CE, fused torch
AdamW), plain and strong: :func:`recipe` gives a config's baseline.

**The one-GPU proxy of a rank** (:data:`PROXY_DEFAULTS`, ``cs336 leaderboard --proxy``): world size 1, one
sequence, the 8B block shape with :func:`proxy_num_layers` layers (14: unsharded, they and the embeddings and head
hold about the fp32 state of one of the two ranks), so that a step on one GPU does a rank's work per layer and
holds a rank's state; it lacks the communication and the other 20 layers. Its memory cap
(:func:`default_memory_cap_bytes`) gives it the activation memory a rank has for 14 of its 34 layers.

**Checkpointing** ``checkpoint`` is a policy of :mod:`cs336_sharding.checkpointing` or ``budget``: the policy
that recomputes least within the memory cap (``memory_cap_gib``, default :func:`default_memory_cap_bytes` on a
GPU), by :func:`cs336_sharding.checkpointing.policy_for_budget` with :func:`reserved_bytes` set aside for what is
not the blocks' activations; the row says which policy that was (``checkpoint``) and the peak it expected.

:func:`run_leaderboard` runs ``warmup`` untimed and ``steps`` timed steps (devices synchronised and the
ranks at a barrier before and after each) and returns one row: step time (the maximum over ranks of each
rank's median, and the maximum of all), tokens per second, model FLOPs utilisation (:func:`step_flops`
against the H200's measured bf16 matmul rate) and peak memory per rank. With ``profile``, one more step runs under
torch.profiler and the row gets its GPU time by kind of kernel (``breakdown``,
:func:`cs336_harness.analysis.kernel_kinds.step_breakdown`; GPU only). Past ``time_limit_s`` no new step starts
and :class:`TimeLimitExceeded` is raised. On CPU (gloo) the Triton kernels run in the Triton interpreter,
so only fp32 compute is allowed there (bf16 ``tl.dot`` is wrong in the interpreter).

    uv run cs336 leaderboard                      # CPU: tiny model, two gloo ranks, seconds
    uv run cs336 leaderboard --out rows.jsonl     # two GPUs: the leaderboard configuration
    uv run cs336 leaderboard --proxy --impl ours,torch_native,torch_native_compiled --profile   # one GPU
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from cs336_basics.config import PRESETS, ModelConfig
from cs336_basics.model import BasicsTransformerLM
from cs336_comms.process_group import current_device, default_backend, run_ranks
from cs336_sharding.checkpointing import (
    BlockMemory,
    CheckpointPolicySpec,
    activation_peak_bytes,
    parse_policy,
    policy_for_budget,
)
from cs336_sharding.parallelize import parallelize

from cs336_harness import instrument
from cs336_harness.analysis import kernel_kinds, trace
from cs336_harness.analysis.tables import markdown_table
from cs336_harness.device import DTYPES, GIB, H200_BF16_MATMUL_FLOPS
from cs336_harness.progress import progress_bar
from cs336_harness.studies.attention_impls import get_attention
from cs336_harness.studies.glue import GLUES, glue_kernels
from cs336_harness.studies.leaderboard_baselines import CHUNK_TOKENS, build_baseline, chunked_cross_entropy
from cs336_harness.studies.optimizers import build_optimizer

ATTENTIONS: tuple[str, ...] = ("triton", "sdpa")
OPTIMIZERS: tuple[str, ...] = ("fused-adamw", "torch-adamw")
COMPUTE_DTYPES: tuple[str, ...] = ("bf16", "fp32")
IMPLS: tuple[str, ...] = ("ours", "torch_native", "torch_native_compiled")
BUDGET = "budget"  # the checkpoint setting sized from the memory cap

# The handout's leaderboard run, and the CPU try-out that `cs336 leaderboard` uses without CUDA.
LEADERBOARD_DEFAULTS: dict[str, Any] = dict(size="8B", vocab_size=151_936, context_length=32_768, global_batch=2,
                                            world_size=2, compute_dtype="bf16")
CPU_DEFAULTS: dict[str, Any] = dict(size="tiny", vocab_size=1_000, context_length=32, global_batch=2, world_size=2,
                                    compute_dtype="fp32")
# What each recipe fixes; the baselines are PyTorch's pieces throughout (leaderboard_baselines).
_BASELINE_FIXED: dict[str, Any] = dict(attention="sdpa", optimizer="torch-adamw", glue="model", fused_qkv=False)
RECIPES: dict[str, dict[str, Any]] = {
    "torch_native": dict(_BASELINE_FIXED, checkpoint="all", compile_blocks=False),
    "torch_native_compiled": dict(_BASELINE_FIXED, checkpoint=BUDGET, compile_blocks=True),
}
# Bytes of state per parameter through the step: fp32 weight, gradient and AdamW's two moments; the weight and the
# moments alone are what lives at the start of the backward (the gradients of the previous step were freed).
STATE_BYTES_PER_PARAM = 16
STATE_AT_BACKWARD_BYTES_PER_PARAM = 12


class TimeLimitExceeded(RuntimeError):
    """The run passed its ``time_limit_s`` before all its steps were done."""


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
                   "attention": ATTENTIONS, "optimizer": OPTIMIZERS, "glue": GLUES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {getattr(self, name)!r}")
        for name in ("compile_blocks", "fused_qkv", "profile", "handout_timing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.checkpoint != BUDGET:
            parse_policy(self.checkpoint)
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
        if self.resolved_backend == "nccl" and self.world_size > torch.cuda.device_count():
            raise ValueError(f"world_size {self.world_size} needs that many GPUs for nccl; "
                             f"{torch.cuda.device_count()} visible")
        if self.resolved_backend == "gloo" and self.compute_dtype != "fp32":
            raise ValueError(f"compute_dtype {self.compute_dtype!r} needs GPUs: on CPU (gloo) the Triton kernels run "
                             "in the interpreter, whose bf16 dot products are wrong; use fp32")
        if self.checkpoint == BUDGET and self.resolved_backend == "gloo" and self.memory_cap_gib is None:
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


def recipe(config: LeaderboardConfig, impl: str) -> LeaderboardConfig:
    """``config`` as ``impl`` runs it: itself for ``ours``, else with the baseline's settings (:data:`RECIPES`)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    return dataclasses.replace(config, impl=impl, **RECIPES.get(impl, {}))


def _leaderboard_rank_config() -> ModelConfig:
    return ModelConfig.from_preset(LEADERBOARD_DEFAULTS["size"], vocab_size=LEADERBOARD_DEFAULTS["vocab_size"],
                                   context_length=LEADERBOARD_DEFAULTS["context_length"])


def proxy_num_layers() -> int:
    """Layers of the 8B block shape whose fp32 state, unsharded with the embeddings and head, is nearest that of one
    rank of the two-GPU leaderboard run: the proxy's depth (14)."""
    full = _leaderboard_rank_config()
    rest = 2 * full.vocab_size * full.d_model + full.d_model  # embeddings, head, final norm
    per_block = (full.num_params - rest) // full.num_layers
    return round((full.num_params / LEADERBOARD_DEFAULTS["world_size"] - rest) / per_block)


# The one-GPU proxy of a leaderboard rank (module docstring).
PROXY_DEFAULTS: dict[str, Any] = dict(LEADERBOARD_DEFAULTS, world_size=1, global_batch=1, num_layers=proxy_num_layers())


def default_memory_cap_bytes(config: LeaderboardConfig, device_bytes: int) -> float:
    """The memory a run may use to stand for a leaderboard rank on a device of ``device_bytes``: its own state plus
    the share of a rank's activation memory that its layers would have there,

        cap = state(run) + (device_bytes - state(leaderboard rank)) * num_layers / 34,
        state = 16 bytes * parameters / world_size   (fp32 weights, gradients, AdamW's two moments)

    (on an H200, about 92 GiB for the 14-layer proxy; ``device_bytes`` itself for the leaderboard run)."""
    rank = _leaderboard_rank_config()
    own = STATE_BYTES_PER_PARAM * config.model_config.num_params / config.world_size
    rank_state = STATE_BYTES_PER_PARAM * rank.num_params / LEADERBOARD_DEFAULTS["world_size"]
    return own + (device_bytes - rank_state) * config.model_config.num_layers / rank.num_layers


def reserved_bytes(config: LeaderboardConfig) -> float:
    """What the step holds at the start of the backward (its peak) besides the blocks' activations: an estimate.

    - weights and AdamW moments of this rank's shard, 12 bytes per parameter / world size (last step's gradients
      were freed; the new ones grow while the backward frees activations);
    - the current and the next block's weights gathered in the compute dtype (2 * block parameters * e);
    - embedding and LM head: their gathered weights and the head's weight gradient in the compute dtype and in
      fp32 (the reduction's input), (2 e + e + 4) V d;
    - per token: the embedding output, the final norm's saved tensors (fp32 x and x * rstd) and the head's gradient
      for the hidden states, (e + 8 + e) N d;
    - the loss head's logits: ours one fused chunk (``cs336_kernels.CHUNK_BYTES``, 640 MiB); the baselines one chunk
      of 4096 tokens recomputed in the backward with its fp32 copy and that copy's gradient, (e + 4 + 4) * 4096 * V.
    """
    # Imported here: on CPU the Triton interpreter must be chosen before the kernels load.
    from cs336_kernels import CHUNK_BYTES

    m = config.model_config
    e = DTYPES[config.compute_dtype].itemsize
    n, d, v = config.batch_per_rank * config.context_length, m.d_model, m.vocab_size
    block_params = (m.num_params - 2 * v * d - d) // m.num_layers  # all but the embeddings, head and final norm
    head = CHUNK_BYTES if config.impl == "ours" else (e + 4 + 4) * min(CHUNK_TOKENS, n) * v
    return (STATE_AT_BACKWARD_BYTES_PER_PARAM * m.num_params / config.world_size + 2 * e * block_params
            + (3 * e + 4) * v * d + (2 * e + 8) * n * d + head)


class BlockShape(Protocol):
    """The dimensions :func:`block_memory` needs (a ``cs336_basics.config.ModelConfig`` has them)."""

    d_model: int
    d_ff: int
    num_heads: int


def block_memory(shape: BlockShape, batch: int, seq: int, *, dtype_bytes: int = 2, glue: str = "model",
                 fused_qkv: bool = False) -> BlockMemory:
    """:class:`~cs336_sharding.checkpointing.BlockMemory` of one ``cs336_basics`` block (RMSNorm, RoPE attention
    with a fused attention op, RMSNorm, SwiGLU) on ``batch`` sequences of ``seq`` tokens with 16-bit
    (``dtype_bytes=2``) or fp32 compute, its glue ``glue`` (:data:`~cs336_harness.studies.glue.GLUES`), its weights
    gathered by FSDP (views whose memory is freed after the forward, so they count nothing).

    With N = batch * seq tokens, d = d_model, f = d_ff, h = heads, e = dtype_bytes, what autograd keeps:

    - both norms: ``glue="model"`` upcasts x and keeps it and ``x * rstd`` in fp32 (8 N d; the first norm's
      upcast of an fp32 block input is the input itself) and rstd (4 N); the kernels keep their input (the block
      input for the first, free here; the residual sum h for the second, which the residual add folded into it
      writes and keeps: e N d) and rstd (4 N);
    - the q / k / v projections keep the normed input (e N d); RoPE keeps its tables' rows (the model's own:
      cos and sin gathered at the positions for q and for k, 4 * 4 * seq * d / (2 h)) or the positions (the
      kernel: 8 seq, int64); the attention op keeps rotated q and k, v and its output (4 e N d) and the fp32
      log-sum-exp (4 N h); with ``fused_qkv`` v is a view of the (N, 3 d) projection output, which it keeps
      whole (2 e N d more), and the matmul keeps the concatenated (3 d, d) weight (3 e d^2);
    - the output projection keeps the heads' outputs in (N, d) layout (e N d, a copy of the attention output);
    - SwiGLU: w1 and w3 keep the normed input (e N d); the gate keeps a = w1 x, sigmoid(a), a * sigmoid(a) and
      b = w3 x (4 e N f) in the model's code, a and b (2 e N f) in the kernel; w2 keeps the gate's output (e N f);
    - the block's output (e N d).

    ``attention`` is the output plus the attention op's output and log-sum-exp; ``checkpointed`` the output.
    ``glue="compiled"`` (torch.compile of the kernels' PyTorch references) is counted as the kernels.
    """
    if glue not in GLUES:
        raise ValueError(f"glue must be one of {', '.join(GLUES)}, got {glue!r}")
    for name, value in (("batch", batch), ("seq", seq), ("dtype_bytes", dtype_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    d, f, h = shape.d_model, shape.d_ff, shape.num_heads
    n, e = batch * seq, dtype_bytes
    out, lse = e * n * d, 4 * n * h
    if glue == "model":
        upcast = 4 * n * d if e < 4 else 0  # the first norm's fp32 copy of the block input (fp32: the input itself)
        norms = upcast + 3 * 4 * n * d + 2 * 4 * n
        rope = 4 * 4 * seq * (d // h // 2)
        gate = 4 * e * n * f
    else:
        norms = e * n * d + 2 * 4 * n
        rope = 8 * seq
        gate = 2 * e * n * f
    # input, q k v o, the (N, d) copy; fused: q and k stay alive in the (N, 3d) output, and the (3d, d) weight
    attention = (1 + 4 + 1) * e * n * d + lse + ((2 * n + 3 * d) * e * d if fused_qkv else 0)
    ffn = e * n * d + gate + e * n * f
    return BlockMemory(kept=norms + rope + attention + ffn + out, attention=out + e * n * d + lse, checkpointed=out)


@dataclass(frozen=True)
class MemoryPlan:
    """The checkpointing a run uses and the memory it expects: ``cap_bytes`` (None without one), ``block`` (what a
    block keeps, :func:`block_memory`), ``policy`` and ``expected_peak_bytes``
    (:func:`reserved_bytes` plus :func:`~cs336_sharding.checkpointing.activation_peak_bytes`; None for a policy it
    does not cover)."""

    cap_bytes: float | None
    block: BlockMemory
    policy: CheckpointPolicySpec
    expected_peak_bytes: float | None


def memory_plan(config: LeaderboardConfig, device_bytes: int | None) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``config`` on a device of ``device_bytes`` (None on CPU). A compiled block is
    counted as the compiled glue (``glue="compiled"``): Inductor's partitioner keeps the inputs of the norms and of
    the gate and recomputes the rest, as it does for the compiled glue alone."""
    m = config.model_config
    if config.memory_cap_gib is not None:
        cap = config.memory_cap_gib * GIB
    else:
        cap = None if device_bytes is None else default_memory_cap_bytes(config, device_bytes)
    block = block_memory(m, config.batch_per_rank, config.context_length,
                         dtype_bytes=DTYPES[config.compute_dtype].itemsize,
                         glue="compiled" if config.compile_blocks else config.glue,
                         fused_qkv=config.fused_qkv)
    reserved = reserved_bytes(config)
    if config.checkpoint == BUDGET:
        assert cap is not None, "LeaderboardConfig checks that a budget has a cap"
        policy = policy_for_budget(block, m.num_layers, cap - reserved, keep_attention=config.impl == "ours")
    else:
        policy = parse_policy(config.checkpoint)
    try:
        expected = reserved + activation_peak_bytes(block, m.num_layers, policy)
    except ValueError:
        expected = None
    return MemoryPlan(cap, block, policy, expected)


def step_flops(config: ModelConfig, global_batch: int) -> float:
    """Model FLOPs of one training step (forward and backward), without checkpointing's recomputation.

    matmuls: 6 * tokens * non-embedding matmul parameters, where per block 4 d^2 (q, k, v, out) + 3 d d_ff
             (SwiGLU) and the LM head V d (the embedding is a lookup, not a matmul);
    attention: per layer 4 * b * h * s^2 * d_head (Q K^T and P V, 2 FLOPs per multiply-add), halved for the
             causal mask, times 3.5 for forward plus backward (the backward's five matmuls against the
             forward's two, counting FlashAttention's recomputation of the scores).
    """
    d, s, b = config.d_model, config.context_length, global_batch
    matmul_params = config.num_layers * (4 * d * d + 3 * d * config.d_ff) + config.vocab_size * d
    attention_per_layer = 4 * b * config.num_heads * s**2 * config.head_dim / 2 * 3.5
    return 6 * b * s * matmul_params + config.num_layers * attention_per_layer


def build_model(config: LeaderboardConfig, device: torch.device) -> BasicsTransformerLM:
    """The run's model with fp32 weights and its pieces: attention, glue and the LM head's loss (ours
    ``cs336_kernels.fused_linear_cross_entropy``, the baselines'
    :func:`~cs336_harness.studies.leaderboard_baselines.chunked_cross_entropy`); seeded, so every rank and a
    reference build the same weights."""
    if config.impl == "ours":
        # Imported here: on CPU the Triton interpreter must be chosen before the kernels load.
        from cs336_kernels import fused_linear_cross_entropy as loss
    else:
        loss = chunked_cross_entropy
    torch.manual_seed(config.seed)
    return BasicsTransformerLM.from_config(config.model_config, attention=get_attention(config.attention),
                                           **glue_kernels(config.glue), loss=loss, fused_qkv=config.fused_qkv,
                                           device=device)


@dataclass
class Training:
    """What :func:`build_training` composed; :meth:`step` is one training step on this rank's batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    finish_sync: Callable[[], None]  # after backward: every .grad the averaged local gradient
    plan: MemoryPlan

    def forward_backward(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward, loss, backward and gradient sync (each ``.grad`` is then the averaged local shard gradient);
        returns this rank's loss (not synchronised)."""
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


def build_training(config: LeaderboardConfig, device: torch.device) -> Training:
    """The steps of the module docstring for ``config.impl``. Call it on every rank of an initialised process group
    (FSDP broadcasts rank 0's weights)."""
    cuda = device.type == "cuda"
    plan = memory_plan(config, torch.cuda.get_device_properties(device).total_memory if cuda else None)
    model = build_model(config, device)
    compute = DTYPES[config.compute_dtype]
    if config.impl == "ours":
        fsdp = parallelize(model, checkpoint=plan.policy, compute_dtype=compute, compile_blocks=config.compile_blocks)
        optimizer = build_optimizer(config.optimizer, fsdp.parameters(), config.lr, config.weight_decay)
        return Training(fsdp, optimizer, fsdp.finish_gradient_synchronization, plan)
    model = build_baseline(model, device, config.world_size, checkpoint=plan.policy, compute_dtype=compute,
                           compile_blocks=config.compile_blocks)
    optimizer = build_optimizer(config.optimizer, model.parameters(), config.lr, config.weight_decay)
    return Training(model, optimizer, lambda: None, plan)


def make_batch(config: LeaderboardConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Random input and target token ids of the whole global batch, each (global_batch, context_length), on CPU;
    rank r trains on rows ``[r * B / n, (r + 1) * B / n)``."""
    g = torch.Generator().manual_seed(1000 + config.seed)
    shape = (config.global_batch, config.context_length)
    return (torch.randint(0, config.vocab_size, shape, generator=g),
            torch.randint(0, config.vocab_size, shape, generator=g))


def rank_batch(config: LeaderboardConfig, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of :func:`make_batch`, on ``device``."""
    per_rank = config.batch_per_rank
    inputs, targets = make_batch(config)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return inputs[rows].to(device), targets[rows].to(device)


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    packed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return packed.tolist()


def _profiled_step(training: Training, inputs: torch.Tensor, targets: torch.Tensor, device: torch.device,
                   sync: Callable[[], None]) -> dict[str, Any] | None:
    """One more step under torch.profiler, inside a ``step`` range that ends after a device synchronisation; its
    GPU time by kind (None on CPU, which has no GPU kernels to sort)."""
    with instrument.profile(device) as prof, instrument.annotate("step"):
        training.step(inputs, targets)
        sync()
    if device.type != "cuda":
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return kernel_kinds.step_breakdown(trace.load_trace(path))


def _handout_ms(training: Training, inputs: torch.Tensor, targets: torch.Tensor, device: torch.device,
                fastest_s: float) -> float | None:
    """The handout's measurement: ``triton.testing.do_bench`` (its defaults) around the whole step on each rank,
    the maximum over ranks; None where a step is too short for it to be safe with several ranks.

    do_bench picks its warm-up and repeat counts from its own estimate of one call; with steps longer than its
    100 ms budget on every rank both counts are 1, so every rank runs the same steps and their collectives match.
    """
    fastest_everywhere = -_max_over_ranks([-fastest_s], device)[0]
    if fastest_everywhere <= 0.1:
        return None
    from triton.testing import do_bench

    def step() -> None:
        training.optimizer.zero_grad(set_to_none=True)
        training.step(inputs, targets)

    return _max_over_ranks([do_bench(step)], device)[0]


def _rank_main(rank: int, world_size: int, config: LeaderboardConfig, show_progress: bool) -> dict[str, Any]:
    start = time.perf_counter()
    device = current_device()
    cuda = device.type == "cuda"
    if not cuda:
        # Before any kernel module is imported in this (fresh) process; see the module docstring.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # triton.testing.do_bench runs a step 8 times when each takes over its 100 ms budget (1 + 5 to estimate,
    # 1 warm-up, 1 timed); see _handout_ms.
    total_steps = config.warmup + config.steps + int(config.profile) + 8 * int(config.handout_timing)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()

    def check_time(done: int) -> None:
        # Every rank must take the same decision, or one would wait forever in the next step's collectives.
        over = _max_over_ranks([time.perf_counter() - start], device)[0] > config.time_limit_s
        if over:
            raise TimeLimitExceeded(
                f"time limit of {config.time_limit_s:g} s reached after {done} of {total_steps} "
                "steps (model build included); raise --time-limit-s or lower --steps/--warmup")

    bar = progress_bar(total=total_steps, desc=f"leaderboard {config.impl}", enabled=show_progress and rank == 0,
                       unit="step")
    bar.set_postfix_str("building the model")
    training = build_training(config, device)
    inputs, targets = rank_batch(config, rank, device)
    sync()
    peak_init = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    times: list[float] = []
    breakdown = None
    try:
        bar.set_postfix_str("warm-up")
        for i in range(config.warmup):
            check_time(i)
            training.step(inputs, targets)
            bar.update()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        bar.set_postfix_str("timed steps")
        for i in range(config.steps):
            check_time(config.warmup + i)
            sync()
            t0 = time.perf_counter()
            loss = training.step(inputs, targets)
            sync()
            times.append(time.perf_counter() - t0)
            bar.update()
        peak_step = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
        if config.profile:
            bar.set_postfix_str("profiled step")
            check_time(config.warmup + config.steps)
            breakdown = _profiled_step(training, inputs, targets, device, sync)
            bar.update()
        handout_ms = None
        if config.handout_timing and cuda:
            check_time(total_steps - 8)
            bar.set_postfix_str("do_bench")
            handout_ms = _handout_ms(training, inputs, targets, device, min(times))
            bar.update(8)
    except TimeLimitExceeded as e:
        # Every rank stops here together; the caller raises the message again.
        bar.close()
        return {"time_limit_exceeded": str(e)}
    bar.close()
    loss_sum = loss.float().reshape(1)
    dist.all_reduce(loss_sum)  # gloo has no AVG
    step_s, step_max_s = _max_over_ranks([statistics.median(times), max(times)], device)
    peaks = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(peaks, torch.tensor([peak_init or 0.0, peak_step or 0.0], dtype=torch.float64, device=device))
    plan = training.plan
    result = {"loss": loss_sum.item() / world_size, "step_s": step_s, "step_max_s": step_max_s,
              "step_s_all_rank0": [round(t, 6) for t in times], "checkpoint": str(plan.policy),
              "memory_cap_gib": None if plan.cap_bytes is None else plan.cap_bytes / GIB,
              "expected_peak_gib": None if plan.expected_peak_bytes is None else plan.expected_peak_bytes / GIB,
              "block_memory_gib": {k: v / GIB for k, v in asdict(plan.block).items()}, "breakdown": breakdown,
              "handout_do_bench_s": None if handout_ms is None else handout_ms / 1e3}
    if cuda:
        result["peak_init_gib_per_rank"] = [p[0].item() for p in peaks]
        result["peak_step_gib_per_rank"] = [p[1].item() for p in peaks]
    return result


def run_leaderboard(config: LeaderboardConfig, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run ``config`` on its ranks; one row (config, timings, throughput, MFU, memory, the breakdown when profiled),
    or [] on a torchrun rank other than 0. The row's ``checkpoint`` is the policy that ran (``budget`` resolved;
    ``checkpoint_requested`` is the config's).

    Raises:
        TimeLimitExceeded: if a step would start after ``time_limit_s`` (every rank stops before it).
    """
    if progress is not None:
        progress(f"leaderboard {config.impl}: {config.size} ({config.model_config.num_layers} layers), context "
                 f"{config.context_length}, global batch {config.global_batch}, {config.world_size} ranks "
                 f"({config.resolved_backend}), {config.compute_dtype}, attention {config.attention}, glue "
                 f"{config.glue}, checkpoint {config.checkpoint}, optimizer {config.optimizer}"
                 + (", compiled blocks" if config.compile_blocks else "") + (", fused qkv" if config.fused_qkv else ""))
    # The group's timeout bounds a hung collective; the time limit is checked between steps.
    result = run_ranks(_rank_main, config.world_size, config, progress is not None,
                       backend=config.resolved_backend, timeout_s=config.time_limit_s + 60)
    if result is None:  # a torchrun rank other than 0
        return []
    if "time_limit_exceeded" in result:
        raise TimeLimitExceeded(result["time_limit_exceeded"])
    model_config = config.model_config
    flops = step_flops(model_config, config.global_batch)
    tokens = config.global_batch * config.context_length
    on_gpu = config.resolved_backend == "nccl"
    dims = {k: getattr(model_config, k) for k in ("d_model", "d_ff", "num_layers", "num_heads")}
    row: dict[str, Any] = {**asdict(config), "checkpoint_requested": config.checkpoint, **dims,
                           "backend": config.resolved_backend, "params": model_config.num_params,
                           "tokens_per_step": tokens, "model_flops_per_step": flops, **result}
    row["tokens_per_s"] = tokens / row["step_s"]
    row["mfu"] = flops / (row["step_s"] * config.world_size * H200_BF16_MATMUL_FLOPS) if on_gpu else None
    if on_gpu:
        row["peak_step_gib"] = max(row["peak_step_gib_per_rank"])
        row["peak_init_gib"] = max(row["peak_init_gib_per_rank"])
        row["within_cap"] = row["memory_cap_gib"] is None or row["peak_step_gib"] <= row["memory_cap_gib"]
    row["wall_s_since_process_start"] = process_age_s()
    row["status"] = "ok"
    return [row]


def process_age_s() -> float:
    """Seconds since this process started (Linux's /proc), model builds, compiles and autotuning included: what the
    handout's 10-minute rule for a run from empty caches counts."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # the 22nd field of stat, counting from the pid
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


TABLE_COLUMNS = ("impl", "num_layers", "world_size", "compute_dtype", "attention", "glue", "checkpoint", "optimizer",
                 "loss", "step_s", "step_max_s", "tokens_per_s", "mfu", "peak_step_gib", "memory_cap_gib")

_WRITEUP_COLUMNS = ("attention", "checkpoint", "optimizer", "step_s", "step_max_s", "tokens_per_s", "mfu",
                    "peak_init_gib", "peak_step_gib", "commit")
_WRITEUP_HEADERS = ("attention", "checkpointing", "AdamW", "step (s)", "slowest step (s)", "tokens/s", "MFU",
                    "peak at init (GiB)", "peak in step (GiB)", "commit")
_PROXY_COLUMNS = (("impl", "impl"), ("attention", "attention"), ("glue", "glue"), ("compile_blocks", "compiled blocks"),
                  ("fused_qkv", "one qkv matmul"), ("checkpoint", "checkpointing"), ("step_s", "step (s)"),
                  ("vs_strong", "vs strong"), ("vs_plain", "vs plain"), ("peak_step_gib", "peak (GiB)"),
                  ("memory_cap_gib", "cap (GiB)"), ("expected_peak_gib", "expected peak (GiB)"),
                  ("glue_share", "glue share"), ("call_id", "call"))


def _is_proxy(row: dict[str, Any]) -> bool:
    return (row.get("status") == "ok" and row["world_size"] == 1 and row["size"] == "8B"
            and row["context_length"] == 32768 and row["compute_dtype"] == "bf16")


def proxy_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The one-GPU proxy rows (8B blocks, world size 1, context 32768, bf16), each with its step time over the same
    call's strong and plain baselines (``vs_strong``, ``vs_plain``; None without that baseline in the call) and its
    glue share when profiled; by call, fastest first."""
    by_call: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if _is_proxy(r):
            by_call[r.get("call_id")].append(r)
    out = []
    for call in sorted(by_call, key=str):
        call_rows = sorted(by_call[call], key=lambda r: r["step_s"])
        baseline = {impl: min((r["step_s"] for r in call_rows if r.get("impl") == impl), default=None)
                    for impl in ("torch_native", "torch_native_compiled")}
        for r in call_rows:
            strong, plain = baseline["torch_native_compiled"], baseline["torch_native"]
            out.append({**r, "vs_strong": r["step_s"] / strong if strong else None,
                        "vs_plain": r["step_s"] / plain if plain else None,
                        "glue_share": (r.get("breakdown") or {}).get("glue_share")})
    return out


def _label(row: dict[str, Any]) -> str:
    if row.get("impl", "ours") != "ours":
        return row["impl"]
    extras = [row["glue"], row["checkpoint"], *(["compiled"] if row.get("compile_blocks") else []),
              *(["qkv"] if row.get("fused_qkv") else [])]
    return f"ours ({row['attention']}, {', '.join(extras)})"


def writeup_tables(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The writeup's tables by marker name: ``leaderboard``, our rows of the leaderboard configuration (8B, context
    32768, batch 2, two ranks, bf16) fastest first; ``leaderboard_proxy``, the one-GPU proxy rows against their
    call's baselines (:func:`proxy_rows`); ``leaderboard_breakdown``, the GPU time by kind of the latest profiled
    proxy row of each configuration: the latest call's first, then older ones (so a "before" stays in the table),
    each of those labelled with its call. A table without rows is left out (its marker keeps what it has)."""
    chosen = [r for r in rows if (r["size"], r["context_length"], r["global_batch"], r["world_size"],
                                  r["compute_dtype"]) == ("8B", 32768, 2, 2, "bf16") and r.get("status") == "ok"
              and r.get("impl", "ours") == "ours"]
    chosen.sort(key=lambda r: r["step_s"])
    proxy = proxy_rows(rows)
    by_label: dict[str, dict[str, Any]] = {}
    for r in sorted((r for r in proxy if r.get("breakdown")), key=lambda r: str(r.get("call_id"))):
        by_label[_label(r)] = r
    latest = max((str(r.get("call_id")) for r in by_label.values()), default=None)
    profiled = sorted(by_label.items(), key=lambda item: str(item[1].get("call_id")) != latest)
    tables = {}
    if chosen:
        tables["leaderboard"] = markdown_table(chosen, list(zip(_WRITEUP_COLUMNS, _WRITEUP_HEADERS, strict=True)),
                                               floatfmt=".4g")
    if proxy:
        # Spaces for underscores, so that a narrow PDF column can wrap the baselines' names.
        shown = [{**r, "impl": r["impl"].replace("_", " ")} for r in proxy]
        tables["leaderboard_proxy"] = markdown_table(shown, _PROXY_COLUMNS, floatfmt=".4g")
    if profiled:
        labels = [label if str(r.get("call_id")) == latest else f"{label}, call {r.get('call_id')}"
                  for label, r in profiled]
        tables["leaderboard_breakdown"] = kernel_kinds.breakdown_markdown([r for _, r in profiled], labels)
    return tables
