"""FlashAttention-2 as differentiable PyTorch functions: two ``torch.autograd.Function`` classes and
:func:`flash_attention`.

:class:`FlashAttentionTriton` runs the kernel forward (through the custom op
``torch.ops.cs336.flash_attention_forward``: Triton, or Gluon on sm_90, see
:func:`~cs336_kernels.flash_attention.forward.gluon_forward_applies`) and a kernel backward: by default the
Gluon one on sm_90 (five matmuls per tile pair, dQ by fp32 reduce-adds, so dQ is not bitwise reproducible) and the
deterministic two-kernel Triton one elsewhere or under ``torch.use_deterministic_algorithms(True)`` (see
:func:`backward_impl`); either can be asked for, as can the compiled PyTorch recomputation.
:class:`FlashAttentionPytorch` runs the tiled PyTorch forward and the compiled PyTorch backward. Both save only
``O`` and the logsumexp ``L`` for the backward.
"""

from __future__ import annotations

from typing import Literal

import torch

from cs336_kernels.flash_attention.backward import flash_backward_triton
from cs336_kernels.flash_attention.checks import check_inputs, unit_stride
from cs336_kernels.flash_attention.forward import FORWARD_IMPLS, flash_forward_op, gluon_forward_applies
from cs336_kernels.flash_attention.gluon_backward import gluon_attention_backward
from cs336_kernels.flash_attention.reference import as_4d, flash_backward_compiled, flash_forward_pytorch
from cs336_kernels.interpreter import check_device

BackwardImpl = Literal["auto", "triton", "gluon", "pytorch"]
ForwardImpl = Literal["auto", "triton", "gluon"]
_BACKWARDS = {"triton": flash_backward_triton, "gluon": gluon_attention_backward, "pytorch": flash_backward_compiled}
BACKWARD_IMPLS: tuple[str, ...] = ("auto", *_BACKWARDS)


def backward_impl(q: torch.Tensor, backward: BackwardImpl) -> str:
    """The backward that runs for queries like ``q``: ``backward`` itself unless it is ``"auto"``, which picks
    ``"gluon"`` where the Gluon kernels apply (:func:`~cs336_kernels.flash_attention.forward.gluon_forward_applies`:
    the backward supports the same GPUs, dtypes and head dims) and deterministic algorithms are off, else the
    bitwise-reproducible ``"triton"``."""
    if backward not in BACKWARD_IMPLS:
        raise ValueError(f"backward must be one of {', '.join(BACKWARD_IMPLS)}, got {backward!r}")
    if backward != "auto":
        return backward
    return "gluon" if gluon_forward_applies(q) and not torch.are_deterministic_algorithms_enabled() else "triton"


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttention-2 with a tiled PyTorch forward and a compiled PyTorch recomputation backward."""

    @staticmethod
    def forward(ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        check_inputs(Q, K, V, is_causal)
        o, lse = flash_forward_pytorch(as_4d(Q), as_4d(K), as_4d(V), is_causal)
        o = o.view(Q.shape)
        ctx.save_for_backward(lse.view(Q.shape[:-1]), Q, K, V, o)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        lse, Q, K, V, O = ctx.saved_tensors
        q4 = as_4d(Q)
        dq, dk, dv = flash_backward_compiled(
            q4, as_4d(K), as_4d(V), as_4d(O), as_4d(dO), lse.view(q4.shape[:-1]), ctx.is_causal
        )
        return dq.view(Q.shape), dk.view(K.shape), dv.view(V.shape), None


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 with a kernel forward and a kernel (or compiled PyTorch) backward."""

    @staticmethod
    def forward(
        ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False,
        backward: BackwardImpl = "auto", forward: ForwardImpl = "auto",
    ) -> torch.Tensor:
        check_inputs(Q, K, V, is_causal)
        impl = backward_impl(Q, backward)
        if forward not in FORWARD_IMPLS:
            raise ValueError(f"forward must be one of {', '.join(FORWARD_IMPLS)}, got {forward!r}")
        check_device(Q.device, "flash_attention")
        Q, K, V = unit_stride(Q), unit_stride(K), unit_stride(V)
        o, lse = flash_forward_op(as_4d(Q), as_4d(K), as_4d(V), is_causal, forward)
        o = o.view(Q.shape)
        ctx.save_for_backward(lse.view(Q.shape[:-1]), Q, K, V, o)
        ctx.is_causal = is_causal
        ctx.backward_impl = impl
        return o

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        lse, Q, K, V, O = ctx.saved_tensors
        q4 = as_4d(Q)
        args = (q4, as_4d(K), as_4d(V), as_4d(O), as_4d(unit_stride(dO)), lse.view(q4.shape[:-1]), ctx.is_causal)
        dq, dk, dv = _BACKWARDS[ctx.backward_impl](*args)
        return dq.view(Q.shape), dk.view(K.shape), dv.view(V.shape), None, None, None


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
    backward: BackwardImpl = "auto", forward: ForwardImpl = "auto",
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) v`` without materialising the score matrix (kernels, differentiable).

    Args:
        q: (batch, seq_q, d) or (batch, heads_q, seq_q, d); fp16, bf16 or fp32; d in [16, 256].
        k, v: (batch, seq_k, d) or (batch, heads_kv, seq_k, d) with heads_q a multiple of heads_kv.
        is_causal: mask keys after the query, aligned top-left (query i sees keys 0..i).
        backward: "auto" (the default: "gluon" where it applies and deterministic algorithms are off, else
            "triton"; see :func:`backward_impl`), "gluon" (sm_90, fp16/bf16, d 64 or 128: five matmuls per tile
            pair, dQ by fp32 reduce-adds, so dQ is not reproducible bit for bit; the faster one on an H200),
            "triton" (separate dK/dV and dQ kernels without atomics, bitwise-reproducible gradients) or "pytorch"
            (compiled recomputation).
        forward: "auto" (the Gluon kernel where
            :func:`~cs336_kernels.flash_attention.forward.gluon_forward_applies`, else Triton), "triton" or
            "gluon".

    Returns:
        The attention output, shaped and typed like ``q``.
    """
    return FlashAttentionTriton.apply(q, k, v, is_causal, backward, forward)
