"""The PyTorch-only leaderboard step a user would write, the baseline every ``cs336 leaderboard`` row is held to.

Nothing of ours but the model definition (``cs336_basics``, with its ``sdpa`` attention) and the checkpointing plan
(``cs336_sharding.checkpointing``, which only decides where ``torch.utils.checkpoint`` goes):

- FSDP2: ``torch.distributed.fsdp.fully_shard`` on every block and then on the root, with
  ``MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)``: fp32 master weights, compute and
  all-gathers in the compute dtype, gradients reduced in fp32;
- SDPA attention (``torch.nn.functional.scaled_dot_product_attention``, causal);
- :func:`chunked_cross_entropy`, the LM head's loss (the model's ``loss`` argument): the head's matmul and the
  cross-entropy over chunks of :data:`CHUNK_TOKENS` tokens, each chunk under ``torch.utils.checkpoint`` so that only
  one chunk's logits ever exist (in the forward, and again in the backward's recomputation); logits upcast to fp32
  for the cross-entropy;
- ``torch.optim.AdamW(fused=True)``.

Two recipes (``impl``): ``torch_native``, every block checkpointed and eager (the plain recipe); and
``torch_native_compiled``, each block's forward under ``torch.compile`` and as many blocks not checkpointed as fit
the memory cap (the strong recipe, what torchtitan-style users run). :func:`build_baseline` composes a model built
with that loss.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from cs336_sharding.checkpointing import CheckpointPolicySpec, apply_checkpointing
from cs336_sharding.parallelize import apply_compile
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 4096


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """The mean cross-entropy of ``hidden @ weight.T`` (hidden (N, d), weight (V, d)) against ``targets`` (N,), taken
    ``chunk_tokens`` tokens at a time under ``torch.utils.checkpoint``."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"need hidden (N, d) and targets (N,), got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    total = sum(checkpoint(_chunk_loss_sum, hidden[i : i + chunk_tokens], weight, targets[i : i + chunk_tokens],
                           use_reentrant=False)
                for i in range(0, hidden.shape[0], chunk_tokens))
    return total / hidden.shape[0]


def build_baseline(model: nn.Module, device: torch.device, world_size: int, *, checkpoint: str | CheckpointPolicySpec,
                   compute_dtype: torch.dtype, compile_blocks: bool) -> nn.Module:
    """Compose ``model`` (a ``BasicsTransformerLM`` with SDPA attention, :func:`chunked_cross_entropy` as its loss,
    fp32 weights) for the baseline step in place, inside an initialised process group of ``world_size`` ranks;
    returns it (now FSDP2's)."""
    apply_checkpointing(model, checkpoint)
    if compile_blocks:
        apply_compile(model)
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
