"""The Transformer block's glue by name: how RMSNorm, the residual add before each block's second norm, RoPE and
SwiGLU's gate run inside a ``BasicsTransformerLM``, handed to the model as constructor arguments::

    model = BasicsTransformerLM.from_config(config, attention=get_attention("triton"), **glue_kernels("triton"))

Names (:data:`GLUES`): ``model`` (the model's own PyTorch code), ``triton`` (our kernels
``cs336_kernels.rms_norm``, ``add_rms_norm``, ``rope`` and ``silu_mul``: RMSNorm statistics in fp32 inside the
kernel, the residual add folded into the second norm (bit for bit the add, the norm and autograd's sum of their
gradients), RoPE on q and k in the projections' (batch, seq, heads, head_dim) layout writing the layout the
attention reads, the SwiGLU gate in one pass each way) and ``compiled`` (``torch.compile`` of the same PyTorch
references the kernels are tested against), so a run can measure the kernels against the compiler on the same step.
No checkpointing policy names the norm operators, so a checkpointed block recomputes the folded add as it recomputes
``ln2``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GLUES: tuple[str, ...] = ("model", "triton", "compiled")


def glue_kernels(name: str) -> dict[str, Callable]:
    """The model's ``norm``, ``add_norm``, ``rotary`` and ``gate`` arguments for the glue ``name`` of :data:`GLUES`
    (none for ``model``: the model's defaults)."""
    if name not in GLUES:
        raise ValueError(f"glue must be one of {', '.join(GLUES)}, got {name!r}")
    if name == "model":
        return {}
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

    if name == "triton":
        return dict(norm=rms_norm, add_norm=add_rms_norm, rotary=rope, gate=silu_mul)
    return dict(norm=torch.compile(rms_norm_reference), add_norm=torch.compile(add_rms_norm_reference),
                rotary=torch.compile(rope_reference), gate=torch.compile(silu_mul_reference))
