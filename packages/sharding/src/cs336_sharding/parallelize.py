"""One place that composes a training model: checkpointing, the fused LM-head loss and FSDP, in one order.

    model = BasicsTransformerLM.from_config(config, attention=flash_attention_fn, device=device)
    model = parallelize(model, checkpoint="attention", compute_dtype=torch.bfloat16, fused_loss=True)
    loss = model(token_ids, targets)      # FSDP over the model; the head returns the fused loss
    loss.backward(); model.finish_gradient_synchronization(); optimizer.step()

The order, and why:

1. activation checkpointing of ``model.layers`` (:func:`cs336_sharding.checkpointing.apply_checkpointing`), in
   place, so parameter names do not change;
2. with ``fused_loss``, the model's ``lm_head`` replaced by :class:`FusedLossHead` (:func:`apply_fused_loss`),
   which owns the same weight and returns ``cs336_kernels.fused_linear_cross_entropy`` when called with targets,
   so the (tokens, vocab) logits never exist. The head stays a module of its own because FSDP gathers a weight
   inside its owner's forward;
3. :class:`cs336_sharding.fsdp.FSDP` with ``compute_dtype`` over the process group (a single rank without one).

The attention implementation is the model's own choice, made when it is built (``attention=``). Each step is also
a public function that changes the model in place, for a single-process run that wants some of them without FSDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from cs336_sharding.checkpointing import CheckpointPolicySpec, apply_checkpointing
from cs336_sharding.fsdp import FSDP


class FusedLossHead(nn.Module):
    """An LM head (``weight`` (vocab, d_model)) whose ``forward(hidden, targets)`` is the mean cross-entropy of
    ``hidden @ weight.T`` against ``targets`` computed without materialising the logits; without targets it
    returns the logits, as the plain head does."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            raise ValueError(f"weight must be a (vocab, d_model) nn.Parameter, got {type(weight).__name__} of shape "
                             f"{tuple(getattr(weight, 'shape', ()))}")
        # Imported here, not at module level: on CPU the Triton interpreter must be chosen before the kernels load.
        from cs336_kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

        self.weight = weight
        self._loss = fused_linear_cross_entropy

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return hidden @ self.weight.T  # (..., V)
        return self._loss(hidden.flatten(0, -2), self.weight, targets.flatten())  # (N, d), (N,) -> scalar

    def extra_repr(self) -> str:
        vocab, d_model = self.weight.shape
        return f"vocab={vocab}, d_model={d_model}"


def apply_fused_loss(model: nn.Module) -> nn.Module:
    """Replace ``model.lm_head`` in place by a :class:`FusedLossHead` that owns the same weight; returns ``model``."""
    head = getattr(model, "lm_head", None)
    if not isinstance(getattr(head, "weight", None), nn.Parameter):
        raise TypeError(f"the fused loss needs model.lm_head with a weight parameter, got {type(head).__name__}")
    model.lm_head = FusedLossHead(head.weight)
    return model


def parallelize(
    model: nn.Module,
    *,
    checkpoint: str | CheckpointPolicySpec = "none",
    compute_dtype: torch.dtype | None = None,
    fused_loss: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> FSDP:
    """Compose ``model`` for training in the order of the module docstring; returns the FSDP-wrapped model.

    Args:
        model: a model with ``layers`` (its blocks) and, for ``fused_loss``, an ``lm_head`` with a 2-D ``weight``
            that the model calls as ``lm_head(hidden, targets)``.
        checkpoint: an activation-checkpointing policy (see :mod:`cs336_sharding.checkpointing`).
        compute_dtype: FSDP's compute (and all-gather) dtype; master weights and gradients stay in the
            parameters' dtype.
        fused_loss: replace the LM head by :class:`FusedLossHead`.
        process_group: the ranks to shard over (default: the world, or a single rank without a process group).
    """
    apply_checkpointing(model, checkpoint)
    if fused_loss:
        apply_fused_loss(model)
    return FSDP(model, compute_dtype=compute_dtype, process_group=process_group)
