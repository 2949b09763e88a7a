"""The PyTorch-only leaderboard step a user would write, the baseline every ``cs336 leaderboard`` row is held to.

Nothing of ours but the model definition (``cs336_basics``, with its ``sdpa`` attention) and the checkpointing plan
(``cs336_sharding.checkpointing``, which only decides where ``torch.utils.checkpoint`` goes):

- FSDP2: ``torch.distributed.fsdp.fully_shard`` on every block and then on the root, with
  ``MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)``: fp32 master weights, compute and
  all-gathers in the compute dtype, gradients reduced in fp32;
- SDPA attention (``torch.nn.functional.scaled_dot_product_attention``, causal);
- :class:`ChunkedLossHead`: the LM head and cross-entropy over chunks of :data:`CHUNK_TOKENS` tokens, each chunk
  under ``torch.utils.checkpoint`` so that only one chunk's logits ever exist (in the forward, and again in the
  backward's recomputation); logits upcast to fp32 for the cross-entropy;
- ``torch.optim.AdamW(fused=True)``.

Two recipes (``impl``): ``torch_native``, every block checkpointed and eager (the plain recipe); and
``torch_native_compiled``, each block's forward under ``torch.compile`` and as many blocks not checkpointed as fit
the memory cap (the strong recipe, what torchtitan-style users run). :func:`build_baseline` composes them.
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


class ChunkedLossHead(nn.Module):
    """An LM head (``weight`` (vocab, d_model)) whose ``forward(hidden, targets)`` is the mean cross-entropy, taken
    ``chunk_tokens`` tokens at a time under ``torch.utils.checkpoint``; without targets, the logits."""

    def __init__(self, weight: nn.Parameter, chunk_tokens: int = CHUNK_TOKENS):
        super().__init__()
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            raise ValueError(f"weight must be a (vocab, d_model) nn.Parameter, got {type(weight).__name__} of shape "
                             f"{tuple(getattr(weight, 'shape', ()))}")
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        self.weight = weight
        self.chunk_tokens = chunk_tokens

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return F.linear(hidden, self.weight)  # (..., V)
        hidden, targets = hidden.flatten(0, -2), targets.flatten()  # (N, d), (N,)
        total = sum(checkpoint(_chunk_loss_sum, hidden[i : i + self.chunk_tokens], self.weight,
                               targets[i : i + self.chunk_tokens], use_reentrant=False)
                    for i in range(0, hidden.shape[0], self.chunk_tokens))
        return total / hidden.shape[0]

    def extra_repr(self) -> str:
        vocab, d_model = self.weight.shape
        return f"vocab={vocab}, d_model={d_model}, chunk_tokens={self.chunk_tokens}"


def build_baseline(model: nn.Module, device: torch.device, world_size: int, *, checkpoint: str | CheckpointPolicySpec,
                   compute_dtype: torch.dtype, compile_blocks: bool, chunk_tokens: int = CHUNK_TOKENS) -> nn.Module:
    """Compose ``model`` (a ``BasicsTransformerLM`` with SDPA attention, fp32 weights) for the baseline step in place,
    inside an initialised process group of ``world_size`` ranks; returns it (now FSDP2's)."""
    model.lm_head = ChunkedLossHead(model.lm_head.weight, chunk_tokens)
    apply_checkpointing(model, checkpoint)
    if compile_blocks:
        apply_compile(model)
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
