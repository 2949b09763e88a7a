"""FlashAttention as registered operators and differentiable functions.

The two operators are what ``torch.compile``, selective activation checkpointing, ``opcheck`` and FlopCounter see
(each an opaque call with a fake implementation):

- ``torch.ops.cs336.flash_attention_forward(q, k, v, is_causal, forward, backward) -> (o, lse)`` runs the
  Triton forward or the warp-specialised Gluon one (``forward="auto"``: Gluon where
  :func:`~cs336_kernels.ops.flash_attention.gluon_common.gluon_applies`); its autograd formula saves only q, k, v,
  ``o`` and the logsumexp ``lse`` and calls
- ``torch.ops.cs336.flash_attention_backward(q, k, v, o, do, lse, is_causal, backward) -> (dq, dk, dv)``, which
  runs the backward :func:`backward_impl` names: by default the Gluon one on sm_90 (five matmuls per tile pair,
  dQ by fp32 reduce-adds, which land in a fixed order under ``torch.use_deterministic_algorithms(True)`` and in
  whatever order they come otherwise) and the two-kernel Triton one elsewhere (no atomics, always bitwise
  reproducible); or the compiled PyTorch recomputation.

``auto`` is resolved when the operator runs, not when it is traced, so a compiled graph follows the GPU it runs
on and the deterministic-algorithms setting of the moment. :func:`flash_attention` is the public function over
them. :class:`FlashAttentionTriton` and :class:`FlashAttentionPytorch` are the course's ``autograd.Function``
interface (``.apply(q, k, v, is_causal)``, with the logsumexp among the saved tensors of the output's node):
the first runs the same two operators, the second the tiled PyTorch forward and the compiled PyTorch backward.
"""

from __future__ import annotations

from typing import Literal

import torch

from cs336_kernels.interpreter import check_bf16, check_device
from cs336_kernels.ops._common import output_like, unit_stride
from cs336_kernels.ops.flash_attention.backward import flash_backward_triton
from cs336_kernels.ops.flash_attention.checks import check_inputs
from cs336_kernels.ops.flash_attention.forward import flash_forward_triton
from cs336_kernels.ops.flash_attention.gluon_backward import gluon_attention_backward
from cs336_kernels.ops.flash_attention.gluon_common import gluon_applies
from cs336_kernels.ops.flash_attention.gluon_forward import gluon_attention_forward
from cs336_kernels.ops.flash_attention.reference import as_4d, flash_backward_compiled, flash_forward_pytorch

BackwardImpl = Literal["auto", "triton", "gluon", "pytorch"]
ForwardImpl = Literal["auto", "triton", "gluon"]
_FORWARDS = {"triton": flash_forward_triton, "gluon": gluon_attention_forward}
_BACKWARDS = {"triton": flash_backward_triton, "gluon": gluon_attention_backward, "pytorch": flash_backward_compiled}
FORWARD_IMPLS: tuple[str, ...] = ("auto", *_FORWARDS)
BACKWARD_IMPLS: tuple[str, ...] = ("auto", *_BACKWARDS)


def forward_impl(q: torch.Tensor, forward: ForwardImpl) -> str:
    """The forward that runs for queries like ``q``: ``forward`` itself unless it is ``"auto"``, which picks
    ``"gluon"`` where the Gluon kernels apply, else ``"triton"``."""
    if forward not in FORWARD_IMPLS:
        raise ValueError(f"forward must be one of {', '.join(FORWARD_IMPLS)}, got {forward!r}")
    if forward != "auto":
        return forward
    return "gluon" if gluon_applies(q) else "triton"


def backward_impl(q: torch.Tensor, backward: BackwardImpl) -> str:
    """The backward that runs for queries like ``q``: ``backward`` itself unless it is ``"auto"``, which picks
    ``"gluon"`` where the Gluon kernels apply, else ``"triton"``; also under
    ``torch.use_deterministic_algorithms(True)``, where both are bitwise reproducible and the Gluon one's
    deterministic mode is the faster at head dims 64 and 128."""
    if backward not in BACKWARD_IMPLS:
        raise ValueError(f"backward must be one of {', '.join(BACKWARD_IMPLS)}, got {backward!r}")
    if backward != "auto":
        return backward
    return "gluon" if gluon_applies(q) else "triton"


@torch.library.custom_op("cs336::flash_attention_forward", mutates_args=())
def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, forward: str,
                       backward: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, Hq, Tq, d), laid out like ``q`` (:func:`~cs336_kernels.ops._common.output_like`), and contiguous
    fp32 logsumexp (B, Hq, Tq) of (B, H, T, d) inputs, as ``torch.ops.cs336.flash_attention_forward``;
    ``backward`` is the implementation its gradient runs."""
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    return _FORWARDS[forward_impl(q, forward)](q, k, v, is_causal)


@flash_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, forward: str,
      backward: str) -> tuple[torch.Tensor, torch.Tensor]:
    return output_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("cs336::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                                do: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                                backward: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (laid out like q, k, v: :func:`~cs336_kernels.ops._common.output_like`) of (B, H, T, d) tensors
    from the forward's output and logsumexp, as ``torch.ops.cs336.flash_attention_backward``."""
    q, k, v, o, do = (unit_stride(t) for t in (q, k, v, o, do))
    return _BACKWARDS[backward_impl(q, backward)](q, k, v, o, do, lse, is_causal)


@flash_attention_backward_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
      is_causal: bool, backward: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return output_like(q), output_like(k), output_like(v)


def _setup(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, is_causal, _, backward = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.is_causal, ctx.backward = is_causal, backward


def _backward(ctx, do: torch.Tensor, _dlse: torch.Tensor):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward_op(q, k, v, o, do, lse, ctx.is_causal, ctx.backward)
    return dq, dk, dv, None, None, None


flash_attention_op.register_autograd(_backward, setup_context=_setup)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, backward: str, forward: str) -> None:
    check_inputs(q, k, v, is_causal)
    if backward not in BACKWARD_IMPLS:
        raise ValueError(f"backward must be one of {', '.join(BACKWARD_IMPLS)}, got {backward!r}")
    if forward not in FORWARD_IMPLS:
        raise ValueError(f"forward must be one of {', '.join(FORWARD_IMPLS)}, got {forward!r}")
    check_device(q.device, "flash_attention")
    check_bf16(q.device, q.dtype, "flash_attention", "it multiplies bf16 matrices as raw bits")


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
    backward: BackwardImpl = "auto", forward: ForwardImpl = "auto",
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) v`` without materialising the score matrix (kernels, differentiable).

    Args:
        q: (batch, seq_q, d) or (batch, heads_q, seq_q, d); fp16, bf16 or fp32; d in [16, 256].
        k, v: (batch, seq_k, d) or (batch, heads_kv, seq_k, d) with heads_q a multiple of heads_kv.
        is_causal: mask keys after the query, aligned top-left (query i sees keys 0..i).
        backward: "auto" (the default: "gluon" where it applies, else "triton"; see :func:`backward_impl`),
            "gluon" (sm_90, fp16/bf16, d 64 or 128: five matmuls per tile pair, dQ by fp32 reduce-adds, which land
            in a fixed order, so that dQ is reproducible bit for bit, only under
            ``torch.use_deterministic_algorithms(True)``; the faster one on an H200), "triton" (separate dK/dV and
            dQ kernels without atomics, bitwise-reproducible gradients) or "pytorch" (compiled recomputation).
        forward: "auto" (the Gluon kernel where
            :func:`~cs336_kernels.ops.flash_attention.gluon_common.gluon_applies`, else Triton), "triton" or
            "gluon".

    Returns:
        The attention output, shaped and typed like ``q``.
    """
    _check(q, k, v, is_causal, backward, forward)
    o, _ = flash_attention_op(as_4d(q), as_4d(k), as_4d(v), is_causal, forward, backward)
    return o.view(q.shape)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention with the kernel operators, as an ``autograd.Function``: ``.apply(q, k, v, is_causal=False,
    backward="auto", forward="auto")`` (the arguments of :func:`flash_attention`, positional)."""

    @staticmethod
    def forward(
        ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False,
        backward: BackwardImpl = "auto", forward: ForwardImpl = "auto",
    ) -> torch.Tensor:
        _check(Q, K, V, is_causal, backward, forward)
        o, lse = flash_attention_op(as_4d(Q), as_4d(K), as_4d(V), is_causal, forward, backward)
        o = o.view(Q.shape)
        ctx.save_for_backward(lse.view(Q.shape[:-1]), Q, K, V, o)
        ctx.is_causal, ctx.backward = is_causal, backward
        return o

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        lse, Q, K, V, O = ctx.saved_tensors
        q4 = as_4d(Q)
        dq, dk, dv = flash_attention_backward_op(q4, as_4d(K), as_4d(V), as_4d(O), as_4d(dO),
                                                 lse.view(q4.shape[:-1]), ctx.is_causal, ctx.backward)
        return dq.view(Q.shape), dk.view(K.shape), dv.view(V.shape), None, None, None


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
