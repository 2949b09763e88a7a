"""One place that composes a model for distributed training: activation checkpointing, block compilation and FSDP,
in one order (torchtitan's ``parallelize_llama``: ``apply_ac -> apply_compile -> apply_fsdp``).

    model = BasicsTransformerLM.from_config(config, kernels=kernels, device=device)   # its kernels
    model = parallelize(model, checkpoint="attention", saved=SavedOps(attention=attention_ops),
                        compute_dtype=torch.bfloat16)
    loss = model(token_ids, targets)      # FSDP over the model
    loss.backward(); model.finish_gradient_synchronization(); optimizer.step()

The order, and why:

1. activation checkpointing of ``model.layers`` (:func:`cs336_sharding.checkpointing.apply_checkpointing`), in
   place, so parameter names do not change; the caller names the ops its selective policies keep (``saved``);
2. with ``compile_blocks``, each block's forward under ``torch.compile`` (:func:`apply_compile`), a block
   checkpointed on its own together with its checkpoint, so that Inductor sees the selective policies (torchtitan's
   ``apply_compile`` wraps each block's checkpoint wrapper too); inside FSDP's hooks, which stay eager;
3. :class:`cs336_sharding.fsdp.FSDP` with ``compute_dtype`` over the process group (a single rank without one),
   last, since it hooks the blocks the steps before it keep in place.

What runs inside the model (its attention, norms, RoPE, SwiGLU gate and LM-head loss) is the model's own choice,
made when it is built. Each step is also a public function that changes the model in place, for a single-process
run that wants some of them without FSDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from cs336_sharding.checkpointing import (
    NO_SAVED_OPS,
    CheckpointedBlocks,
    CheckpointPolicySpec,
    SavedOps,
    apply_checkpointing,
)
from cs336_sharding.fsdp import FSDP


def apply_compile(model: nn.Module) -> nn.Module:
    """Put each block's ``forward`` (``model.layers``) under ``torch.compile`` in place; returns ``model``. Blocks
    checkpointed by :func:`~cs336_sharding.checkpointing.apply_checkpointing` (call it first) are compiled by
    :meth:`~cs336_sharding.checkpointing.CheckpointedBlocks.compile_blocks`: a block that is a segment of its own
    with its checkpoint inside the compiled code.

    Only the forward is compiled, not the module call: hooks on a block (our FSDP's gathers, FSDP2's) stay eager
    around it, and names and the blocks' identities do not change. The blocks share compiled graphs (the same code
    on the same shapes; one for each kind of checkpointed segment), so the compile cost is paid once for each.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TypeError(f"apply_compile needs model.layers, a non-empty nn.ModuleList, got {type(layers).__name__}")
    if isinstance(layers, CheckpointedBlocks):
        layers.compile_blocks()
        return model
    for block in layers:
        block.forward = torch.compile(block.forward)
    return model


def parallelize(
    model: nn.Module,
    *,
    checkpoint: str | CheckpointPolicySpec = "none",
    saved: SavedOps = NO_SAVED_OPS,
    compute_dtype: torch.dtype | None = None,
    compile_blocks: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> FSDP:
    """Compose ``model`` for training in the order of the module docstring; returns the FSDP-wrapped model.

    Args:
        model: a model with ``layers`` (its blocks, an ``nn.ModuleList`` that its forward runs in order).
        checkpoint: an activation-checkpointing policy (see :mod:`cs336_sharding.checkpointing`).
        saved: the ops whose outputs its segments that keep ops' outputs keep (``attention``, ``selective``).
        compute_dtype: FSDP's compute (and all-gather) dtype; master weights and gradients stay in the
            parameters' dtype.
        compile_blocks: compile each block's forward (:func:`apply_compile`).
        process_group: the ranks to shard over (default: the world, or a single rank without a process group).
    """
    if not isinstance(compile_blocks, bool):
        raise TypeError(f"compile_blocks must be a bool, got {compile_blocks!r}")
    apply_checkpointing(model, checkpoint, saved)
    if compile_blocks:
        apply_compile(model)
    return FSDP(model, compute_dtype=compute_dtype, process_group=process_group)
