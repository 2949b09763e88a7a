"""Activation checkpointing for a model's blocks, applied from outside the model.

The model runs ``for layer in model.layers: x = layer(x)``. :func:`apply_checkpointing` replaces
``model.layers`` (an ``nn.ModuleList``) with a list whose entries run one or more of the original blocks
under ``torch.utils.checkpoint.checkpoint`` (non-reentrant): the forward keeps only each segment's
input, and the backward re-runs the segment to get its residuals back (Chen et al., 2016, "Training
deep nets with sublinear memory cost"). Blocks are still called as modules, so hooks on them (FSDP's,
say) fire on the recomputation too. Parameter names gain the segment path, e.g. ``layers.0.blocks.1.``.
With FSDP, checkpoint first and then wrap: ``FSDP(apply_checkpointing(model, policy))``.

Policies (strings, as given to ``cs336 bench --checkpoint``):

- ``none``: leave the model alone.
- ``all``: each block its own segment (``group:1``).
- ``group:K``: consecutive segments of K blocks (the last may be shorter). Peak activation memory is
  about ``N/K`` segment inputs plus ``K`` blocks' residuals during one segment's backward.
- ``first:N``: checkpoint only the first N blocks, one each; the rest keep their residuals.
- ``sqrt``: ``group:ceil(sqrt(num_layers))``, the single-level choice that balances the two terms
  when a segment input costs about as much as one block's residuals.
- ``nested:B``: recursive segments, each split into B sub-segments down to single blocks; with B=2,
  peak memory is O(log N) segment inputs plus one block's residuals, at O(N log N) block forwards.
- ``selective``: each block its own segment, but matmul outputs (and fused attention outputs) are
  saved, so the backward recomputes only the cheap elementwise and normalisation ops.
- ``attention``: each block its own segment, saving only the fused attention's outputs (SDPA's kernels or
  our Triton FlashAttention-2; output and log-sum-exp, about ``b * T * d_model`` elements per block), so
  the backward's recomputation skips the one op whose cost grows as ``T^2``; the matmuls are recomputed.
  The model's own unfused attention is not an op of this kind: pair it with ``--attention sdpa`` or
  ``--attention triton``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

POLICY_KINDS: tuple[str, ...] = ("none", "all", "group", "first", "sqrt", "nested", "selective", "attention")
# Group sizes tried by ``cs336 bench --checkpoint groups`` (those up to the model's depth).
GROUP_SWEEP: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 16, 32)
_NEEDS_ARG = {"group", "first"}
_TAKES_ARG = {"group", "first", "nested"}

# Outputs kept by the ``attention`` policy, by operator name: the fused attention kernels SDPA dispatches to
# and our Triton FlashAttention-2 forward (cs336_kernels.flash_attention.flash_forward_op; named, not
# imported, so that importing this module does not import Triton).
_ATTENTION_OPS = frozenset({
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "cs336::flash_attention_forward",
})
# Outputs kept by the ``selective`` policy: the expensive ones to redo.
_MATMUL_AND_ATTENTION_OPS = _ATTENTION_OPS | {"aten::mm", "aten::bmm", "aten::addmm"}
_SAVED_OPS = {"selective": _MATMUL_AND_ATTENTION_OPS, "attention": _ATTENTION_OPS}


@dataclass(frozen=True)
class CheckpointPolicySpec:
    """A parsed policy: ``kind`` from :data:`POLICY_KINDS` and its integer argument, if any."""

    kind: str
    arg: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"unknown checkpoint policy {self.kind!r}; expected one of {', '.join(POLICY_KINDS)}")
        if self.kind in _NEEDS_ARG and self.arg is None:
            raise ValueError(f"checkpoint policy {self.kind!r} needs a count, e.g. '{self.kind}:4'")
        if self.kind not in _TAKES_ARG and self.arg is not None:
            raise ValueError(f"checkpoint policy {self.kind!r} takes no count, got {self.arg}")
        if self.arg is not None and self.arg < (2 if self.kind == "nested" else 1):
            raise ValueError(f"checkpoint policy {self.kind!r} needs a count >= {2 if self.kind == 'nested' else 1}, "
                             f"got {self.arg}")

    def __str__(self) -> str:
        return self.kind if self.arg is None else f"{self.kind}:{self.arg}"


def parse_policy(text: str) -> CheckpointPolicySpec:
    """Parse ``'none'``, ``'all'``, ``'group:4'``, ``'first:8'``, ``'sqrt'``, ``'nested:2'``, ``'selective'``,
    ``'attention'``."""
    kind, sep, count = text.strip().partition(":")
    if not sep:
        return CheckpointPolicySpec(kind, 2 if kind == "nested" else None)
    try:
        arg = int(count)
    except ValueError:
        raise ValueError(f"checkpoint policy {text!r}: expected an integer after ':', got {count!r}") from None
    return CheckpointPolicySpec(kind, arg)


def _save_ops(saved: frozenset, ctx: object, op: torch._ops.OpOverload, *args: object,
              **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op.name() in saved else CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedSegment(nn.Module):
    """Runs ``blocks`` in order inside one non-reentrant checkpoint; outputs of the ops in ``saved_ops``
    (if any) are kept from the forward instead of recomputed."""

    def __init__(self, blocks: list[nn.Module], saved_ops: frozenset = frozenset()):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.saved_ops = saved_ops

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.saved_ops:
            policy_fn = functools.partial(_save_ops, self.saved_ops)
            context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)
            return checkpoint(self._run, x, use_reentrant=False, context_fn=context_fn)
        return checkpoint(self._run, x, use_reentrant=False)

    def extra_repr(self) -> str:
        return f"num_blocks={len(self.blocks)}, saved_ops={len(self.saved_ops)}"


def _nested(blocks: list[nn.Module], branching: int) -> CheckpointedSegment:
    if len(blocks) == 1:
        return CheckpointedSegment(blocks)
    size = math.ceil(len(blocks) / branching)
    return CheckpointedSegment([_nested(blocks[i : i + size], branching) for i in range(0, len(blocks), size)])


def segments_for(blocks: list[nn.Module], policy: CheckpointPolicySpec) -> list[nn.Module]:
    """The new contents of ``model.layers`` for ``policy`` (``blocks`` themselves are reused, not copied)."""
    n = len(blocks)
    if policy.kind == "none":
        return list(blocks)
    if policy.kind in _SAVED_OPS:
        return [CheckpointedSegment([b], saved_ops=_SAVED_OPS[policy.kind]) for b in blocks]
    if policy.kind == "first":
        k = min(policy.arg or 0, n)
        return [CheckpointedSegment([b]) for b in blocks[:k]] + list(blocks[k:])
    if policy.kind == "nested":
        return [_nested(list(blocks), policy.arg or 2)]
    size = {"all": 1, "sqrt": math.ceil(math.sqrt(n))}.get(policy.kind, policy.arg)
    return [CheckpointedSegment(blocks[i : i + size]) for i in range(0, n, size)]


def apply_checkpointing(model: nn.Module, policy: str | CheckpointPolicySpec) -> nn.Module:
    """Wrap ``model.layers`` in place according to ``policy``; returns ``model``.

    Raises:
        TypeError: if ``model.layers`` is not an ``nn.ModuleList`` or was already wrapped.
    """
    spec = parse_policy(policy) if isinstance(policy, str) else policy
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"apply_checkpointing needs model.layers to be an nn.ModuleList, got {type(layers).__name__}")
    if any(isinstance(m, CheckpointedSegment) for m in layers):
        raise TypeError("model.layers is already checkpointed; apply a policy to a fresh model")
    model.layers = nn.ModuleList(segments_for(list(layers), spec))
    return model
