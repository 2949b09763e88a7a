"""One place that composes a training model: the glue's implementation, checkpointing, block compilation, the
fused LM-head loss and FSDP, in one order.

    model = BasicsTransformerLM.from_config(config, attention=flash_attention_fn, device=device)
    model = parallelize(model, checkpoint="attention", compute_dtype=torch.bfloat16, fused_loss=True, glue="triton")
    loss = model(token_ids, targets)      # FSDP over the model; the head returns the fused loss
    loss.backward(); model.finish_gradient_synchronization(); optimizer.step()

The order, and why:

1. with ``glue`` other than ``"model"`` (:func:`apply_glue`), the blocks' memory-bound glue computed by kernels
   with the model's numerics: every RMSNorm (each block's ``ln1`` and ``ln2``, the model's ``ln_final``) replaced
   by a :class:`GlueRMSNorm` that owns the same weight, each block's ``add_norm`` (its first residual add and
   ``ln2`` in one op, with ``ln2``'s weight), each attention's ``rotary`` and each SwiGLU's ``gate`` set
   (``cs336_basics.model``); first, since it swaps modules inside the blocks that later steps wrap;
2. activation checkpointing of ``model.layers`` (:func:`cs336_sharding.checkpointing.apply_checkpointing`), in
   place, so parameter names do not change;
3. with ``compile_blocks``, each block's forward under ``torch.compile`` (:func:`apply_compile`): inside the
   checkpoint, which then recomputes the compiled forward; outside FSDP's hooks, which stay eager;
4. with ``fused_loss``, the model's ``lm_head`` replaced by :class:`FusedLossHead` (:func:`apply_fused_loss`),
   which owns the same weight and returns ``cs336_kernels.fused_linear_cross_entropy`` when called with targets,
   so the (tokens, vocab) logits never exist. The head stays a module of its own because FSDP gathers a weight
   inside its owner's forward;
5. :class:`cs336_sharding.fsdp.FSDP` with ``compute_dtype`` over the process group (a single rank without one).

Glue implementations (:data:`GLUES`): ``model`` (the model's own PyTorch code), ``triton`` (our kernels
``cs336_kernels.rms_norm``, ``add_rms_norm``, ``rope`` and ``silu_mul``: RMSNorm statistics in fp32 inside the
kernel, the residual add folded into the second norm (bit for bit the add, the norm and autograd's sum of their
gradients), RoPE on q and k in the projections' (batch, seq, heads, head_dim) layout writing the layout the
attention reads, the SwiGLU gate in one pass each way) and ``compiled`` (``torch.compile`` of the same PyTorch
references the kernels are tested against), so a run can measure the kernels against the compiler on the same step.
The folded add is an ``autograd.Function``, not a registered operator, so checkpointing policies recompute it as
they recompute ``ln2`` (no policy names an RMSNorm op).

The attention implementation is the model's own choice, made when it is built (``attention=``). Each step is also
a public function that changes the model in place, for a single-process run that wants some of them without FSDP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from cs336_sharding.checkpointing import GLUES, CheckpointPolicySpec, apply_checkpointing
from cs336_sharding.fsdp import FSDP

NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
AddNormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


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
        from cs336_kernels import fused_linear_cross_entropy

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


class GlueRMSNorm(nn.Module):
    """An RMSNorm that owns a model norm's ``weight`` (d,) and ``eps`` and computes ``norm_fn(x, weight, eps)``:
    ``cs336_kernels.rms_norm`` or a compiled ``rms_norm_reference``, both with ``cs336_basics.model.RMSNorm``'s
    numerics (statistics in fp32, the result rounded once to x's dtype)."""

    def __init__(self, weight: nn.Parameter, eps: float, norm_fn: NormFn):
        super().__init__()
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise TypeError(f"weight must be a 1-D nn.Parameter, got {type(weight).__name__} of shape "
                            f"{tuple(getattr(weight, 'shape', ()))}")
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative float, got {eps!r}")
        self.weight = weight
        self.eps = float(eps)
        self._norm = norm_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"hidden_size={self.weight.shape[0]}, eps={self.eps}"


def glue_functions(glue: str) -> tuple[NormFn, AddNormFn, Callable, Callable]:
    """(norm, add_norm, rotary, gate) functions of a glue implementation other than ``model``: see the module
    docstring."""
    if glue not in GLUES or glue == "model":
        raise ValueError(f"glue functions exist for {', '.join(g for g in GLUES if g != 'model')}, got {glue!r}")
    # Imported here: on CPU the Triton interpreter must be chosen before the kernels load.
    from cs336_kernels import (
        add_rms_norm,
        add_rms_norm_reference,
        rms_norm,
        rms_norm_reference,
        rope,
        rope_reference,
        silu_mul,
        silu_mul_reference,
    )

    if glue == "triton":
        return rms_norm, add_rms_norm, rope, silu_mul
    return (torch.compile(rms_norm_reference), torch.compile(add_rms_norm_reference), torch.compile(rope_reference),
            torch.compile(silu_mul_reference))


def _norm_weight(norm: nn.Module, where: str) -> tuple[nn.Parameter, float]:
    weight, eps = getattr(norm, "weight", None), getattr(norm, "eps", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
        raise TypeError(f"{where} must be an RMSNorm with a 1-D weight parameter and a float eps, got "
                        f"{type(norm).__name__}")
    return weight, eps


def apply_glue(model: nn.Module, glue: str) -> nn.Module:
    """Compute ``model``'s glue with ``glue`` (:data:`GLUES`) in place; returns ``model`` (names unchanged).

    ``model`` is a ``cs336_basics`` LM (``layers`` of blocks with ``ln1``, ``attn``, ``ln2``, ``ffn`` and the
    ``add_norm`` hook, and ``ln_final``) or a single such block. The norms become :class:`GlueRMSNorm` owning the
    same weights; each block's ``add_norm`` is set to the implementation's residual add + RMSNorm (which reads
    ``ln2.weight`` and ``ln2.eps``, so ``ln2`` still owns its weight), its ``attn.rotary`` and ``ffn.gate`` to its
    RoPE and ``silu(a) * b``.

    Raises:
        TypeError: if ``model`` is not built that way.
    """
    if glue not in GLUES:
        raise ValueError(f"glue must be one of {', '.join(GLUES)}, got {glue!r}")
    if glue == "model":
        return model
    layers = getattr(model, "layers", None)
    blocks = list(layers) if isinstance(layers, nn.ModuleList) else [model]
    for i, block in enumerate(blocks):
        parts = [getattr(block, name, None) for name in ("ln1", "attn", "ln2", "ffn")]
        if (any(p is None for p in parts) or not hasattr(parts[1], "rotary") or not hasattr(parts[3], "gate")
                or not hasattr(block, "add_norm")):
            raise TypeError(f"apply_glue needs blocks with ln1, attn (with rotary), ln2, ffn (with gate) and add_norm, "
                            f"as cs336_basics' TransformerBlock; block {i} is {type(block).__name__}")
    norm_fn, add_norm_fn, rotary_fn, gate_fn = glue_functions(glue)
    for block in blocks:
        for name in ("ln1", "ln2"):
            setattr(block, name, GlueRMSNorm(*_norm_weight(getattr(block, name), name), norm_fn))
        block.add_norm = add_norm_fn
        block.attn.rotary = rotary_fn
        block.ffn.gate = gate_fn
    if blocks[0] is not model:
        model.ln_final = GlueRMSNorm(*_norm_weight(getattr(model, "ln_final", None), "ln_final"), norm_fn)
    return model


def apply_compile(model: nn.Module) -> nn.Module:
    """Put each block's ``forward`` (``model.layers``) under ``torch.compile`` in place; returns ``model``.

    Only the forward is compiled, not the module call: hooks on a block (our FSDP's gathers, FSDP2's) stay eager
    around it, and names and the blocks' identities do not change. The blocks share one compiled graph (the same
    code on the same shapes), so the compile cost is paid once.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TypeError(f"apply_compile needs model.layers, a non-empty nn.ModuleList, got {type(layers).__name__}")
    for block in layers:
        block.forward = torch.compile(block.forward)
    return model


def parallelize(
    model: nn.Module,
    *,
    checkpoint: str | CheckpointPolicySpec = "none",
    compute_dtype: torch.dtype | None = None,
    fused_loss: bool = False,
    glue: str = "model",
    compile_blocks: bool = False,
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
        glue: how RMSNorm (with the residual add before ``ln2``), RoPE and SwiGLU's gate run (:data:`GLUES`).
        compile_blocks: compile each block's forward (:func:`apply_compile`).
        process_group: the ranks to shard over (default: the world, or a single rank without a process group).
    """
    apply_glue(model, glue)
    apply_checkpointing(model, checkpoint)
    if compile_blocks:
        apply_compile(model)
    if fused_loss:
        apply_fused_loss(model)
    return FSDP(model, compute_dtype=compute_dtype, process_group=process_group)
