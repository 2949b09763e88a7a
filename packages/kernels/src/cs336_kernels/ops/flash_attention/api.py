"""FlashAttention as registered operators and differentiable functions.

The two operators are what ``torch.compile``, selective activation checkpointing, ``opcheck`` and FlopCounter see
(each an opaque call with a fake implementation); both serve a dense batch (q (B, Hq, Tq, d)) and a packed one (q
(total_q, Hq, d) with ``cu_seqlens``), with the scores' parameters of :mod:`~cs336_kernels.ops.flash_attention.params`
as plain arguments:

- ``torch.ops.cs336.flash_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  softmax_scale, window_left, window_right, bottom_right, softcap, forward, backward, deterministic) -> (o, lse)``
  runs the Triton forward or the warp-specialised Gluon one (``forward="auto"``: Gluon where
  :func:`~cs336_kernels.ops.flash_attention.gluon_common.gluon_applies`); lse is (B, Hq, Tq), or (Hq, total_q)
  for a packed batch. Its autograd formula saves only q, k, v, ``o`` and ``lse`` and calls
- ``torch.ops.cs336.flash_attention_backward(q, k, v, o, do, lse, dlse, <the same parameters>) -> (dq, dk, dv)``,
  which runs the backward :func:`backward_impl` names: by default the Gluon one on sm_90 (five matmuls per tile
  pair, dQ by fp32 reduce-adds, which land in a fixed order in deterministic mode and in whatever order they come
  otherwise) and the two-kernel Triton one elsewhere (no atomics, always bitwise reproducible); or the compiled
  PyTorch recomputation. ``dlse``, the logsumexp's gradient (None when nothing used it), joins dS.

``auto`` is resolved when the operator runs, not when it is traced, so a compiled graph follows the GPU it runs
on and the deterministic-algorithms setting of the moment. :func:`flash_attention` and
:func:`flash_attention_varlen` are the public functions over them, with FlashAttention-2's argument names.
:class:`FlashAttentionTriton` and :class:`FlashAttentionPytorch` are the course's ``autograd.Function`` interface
(``.apply(q, k, v, is_causal)``, causal aligned top-left, with the logsumexp among the saved tensors of the
output's node): the first runs the same two operators, the second the tiled PyTorch forward and the compiled
PyTorch backward.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch

from cs336_kernels.interpreter import check_bf16, check_device
from cs336_kernels.ops._common import output_like, unit_stride
from cs336_kernels.ops.flash_attention.backward import flash_backward_triton
from cs336_kernels.ops.flash_attention.checks import check_inputs, check_varlen_inputs
from cs336_kernels.ops.flash_attention.forward import flash_forward_triton
from cs336_kernels.ops.flash_attention.gluon_backward import gluon_attention_backward
from cs336_kernels.ops.flash_attention.gluon_common import check_gluon, gluon_applies
from cs336_kernels.ops.flash_attention.gluon_forward import gluon_attention_forward
from cs336_kernels.ops.flash_attention.params import Params, make_params
from cs336_kernels.ops.flash_attention.reference import (
    as_4d,
    flash_backward_compiled,
    flash_forward_pytorch,
    pytorch_backward,
)

BackwardImpl = Literal["auto", "triton", "gluon", "pytorch"]
ForwardImpl = Literal["auto", "triton", "gluon"]
_FORWARDS = {"triton": flash_forward_triton, "gluon": gluon_attention_forward}
_BACKWARDS = {"triton": flash_backward_triton, "gluon": gluon_attention_backward, "pytorch": pytorch_backward}
FORWARD_IMPLS: tuple[str, ...] = ("auto", *_FORWARDS)
BACKWARD_IMPLS: tuple[str, ...] = ("auto", *_BACKWARDS)


def forward_impl(q: torch.Tensor, forward: ForwardImpl) -> str:
    """The forward that runs for queries like ``q``: ``forward`` itself unless it is ``"auto"``, which picks
    ``"gluon"`` where the Gluon kernels apply, else ``"triton"``."""
    if forward not in FORWARD_IMPLS:
        raise ValueError(f"forward must be one of {', '.join(FORWARD_IMPLS)}, got {forward!r}")
    if forward != "auto":
        return forward
    return "gluon" if gluon_applies(q, "forward") else "triton"


def backward_impl(q: torch.Tensor, backward: BackwardImpl) -> str:
    """The backward that runs for queries like ``q``: ``backward`` itself unless it is ``"auto"``, which picks
    ``"gluon"`` where the Gluon kernels apply, else ``"triton"``; also in deterministic mode, where both are bitwise
    reproducible and the Gluon one's deterministic mode is the faster at head dims 64 and 128."""
    if backward not in BACKWARD_IMPLS:
        raise ValueError(f"backward must be one of {', '.join(BACKWARD_IMPLS)}, got {backward!r}")
    if backward != "auto":
        return backward
    return "gluon" if gluon_applies(q, "backward") else "triton"


def _params(cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
            max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
            bottom_right: bool, softcap: float) -> Params:
    return Params(softmax_scale, window_left, window_right, bottom_right or cu_seqlens_q is not None, softcap,
                  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _as_dense(t: torch.Tensor) -> torch.Tensor:
    # A packed (total, H, d) tensor as the (1, H, total, d) view the kernels index; a dense (B, H, T, d) one as is.
    return t.transpose(0, 1).unsqueeze(0) if t.dim() == 3 else t


def _from_dense(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # The kernels' (1, H, total, d) result (or (1, H, total) logsumexp) back in the layout of a packed ``like``.
    if like.dim() != 3:
        return t
    return t[0].transpose(0, 1) if t.dim() == 4 else t[0]


@torch.library.custom_op("cs336::flash_attention_forward", mutates_args=())
def flash_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int,
    window_right: int, bottom_right: bool, softcap: float, forward: str, backward: str, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output laid out like ``q`` (:func:`~cs336_kernels.ops._common.output_like`) and contiguous fp32 logsumexp:
    (B, Hq, Tq, d) and (B, Hq, Tq) for a dense batch, (total_q, Hq, d) and (Hq, total_q) for a packed one, as
    ``torch.ops.cs336.flash_attention_forward``; ``backward`` and ``deterministic`` are what its gradient runs."""
    params = _params(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                     window_right, bottom_right, softcap)
    q4, k4, v4 = (_as_dense(unit_stride(t)) for t in (q, k, v))
    o, lse = _FORWARDS[forward_impl(q4, forward)](q4, k4, v4, params)
    return _from_dense(o, q), _from_dense(lse, q)


@flash_attention_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
      bottom_right, softcap, forward, backward, deterministic):
    rows = (q.shape[1], q.shape[0]) if q.dim() == 3 else q.shape[:-1]
    return output_like(q), q.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("cs336::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
    bottom_right: bool, softcap: float, backward: str, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (laid out like q, k, v: :func:`~cs336_kernels.ops._common.output_like`) from the forward's
    output and logsumexp (and the logsumexp's gradient ``dlse``, if any), as
    ``torch.ops.cs336.flash_attention_backward``."""
    params = _params(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                     window_right, bottom_right, softcap)
    q4, k4, v4, o4, do4 = (_as_dense(unit_stride(t)) for t in (q, k, v, o, do))
    lse4, dlse4 = (None if t is None else t.unsqueeze(0) if q.dim() == 3 else t for t in (lse, dlse))
    impl = _BACKWARDS[backward_impl(q4, backward)]
    with _deterministic(deterministic):
        grads = impl(q4, k4, v4, o4, do4, lse4, dlse4, params)
    return tuple(_from_dense(g, t) for g, t in zip(grads, (q, k, v), strict=True))


@flash_attention_backward_op.register_fake
def _(q, k, v, o, do, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
      window_right, bottom_right, softcap, backward, deterministic):
    return output_like(q), output_like(k), output_like(v)


@contextlib.contextmanager
def _deterministic(on: bool):
    # A call's deterministic=True turns on the Gluon backward's deterministic mode for that call alone; off, the
    # process-wide torch.use_deterministic_algorithms setting decides.
    if not on or torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False, warn_only=warn_only)


_PARAM_NAMES = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "window_left",
                "window_right", "bottom_right", "softcap")


def _setup(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, *rest = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.params = dict(zip(_PARAM_NAMES, rest[:len(_PARAM_NAMES)], strict=True))
    ctx.backward, ctx.deterministic = rest[-2], rest[-1]
    # A logsumexp nobody used has no gradient: leave it None rather than a tensor of zeros.
    ctx.set_materialize_grads(False)


def _backward(ctx, do: torch.Tensor | None, dlse: torch.Tensor | None):
    q, k, v, o, lse = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    p = ctx.params
    dq, dk, dv = flash_attention_backward_op(
        q, k, v, o, do, lse, dlse, p["cu_seqlens_q"], p["cu_seqlens_k"], p["max_seqlen_q"], p["max_seqlen_k"],
        p["softmax_scale"], p["window_left"], p["window_right"], p["bottom_right"], p["softcap"], ctx.backward,
        ctx.deterministic,
    )
    return dq, dk, dv, *(None,) * (len(_PARAM_NAMES) + 3)


flash_attention_op.register_autograd(_backward, setup_context=_setup)


def _check_impls(backward: str, forward: str) -> None:
    if backward not in BACKWARD_IMPLS:
        raise ValueError(f"backward must be one of {', '.join(BACKWARD_IMPLS)}, got {backward!r}")
    if forward not in FORWARD_IMPLS:
        raise ValueError(f"forward must be one of {', '.join(FORWARD_IMPLS)}, got {forward!r}")


def _check_runs_here(q: torch.Tensor, caller: str) -> None:
    check_device(q.device, caller)
    check_bf16(q.device, q.dtype, caller, "it multiplies bf16 matrices as raw bits")


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: Params, forward: str, backward: str,
          deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # A named Gluon kernel that cannot run says why, before any launch.
    if forward == "gluon":
        check_gluon(_as_dense(q), "forward")
    if backward == "gluon":
        check_gluon(_as_dense(q), "backward")
    return flash_attention_op(
        q, k, v, params.cu_seqlens_q, params.cu_seqlens_k, params.max_seqlen_q, params.max_seqlen_k,
        params.softmax_scale, params.window_left, params.window_right, params.bottom_right, params.softcap, forward,
        backward, deterministic,
    )


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
    softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    return_lse: bool = False, deterministic: bool = False, backward: BackwardImpl = "auto",
    forward: ForwardImpl = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T * scale) v`` without materialising the score matrix (kernels, differentiable), with
    FlashAttention-2's knobs (:mod:`~cs336_kernels.ops.flash_attention.params` has their exact meaning).

    Args:
        q: (batch, seq_q, d) or (batch, heads_q, seq_q, d); fp16, bf16 or fp32; d in [16, 256].
        k, v: (batch, seq_k, d) or (batch, heads_kv, seq_k, d) with heads_q a multiple of heads_kv.
        is_causal: mask keys after the query's diagonal, aligned bottom-right when seq_q != seq_k (query i sees keys
            up to i + seq_k - seq_q), as FlashAttention-2 >= 2.1; the same as ``window_size=(left, 0)``.
        softmax_scale: the scores' scale, default ``1 / sqrt(d)``.
        window_size: (left, right): query i sees keys diagonal - left .. diagonal + right; -1 for an unbounded side.
            Tiles outside every query's window are skipped, not masked.
        softcap: > 0 caps the scaled scores at ``softcap * tanh(s / softcap)`` (Gemma-2); 0 for none.
        return_lse: also return the logsumexp of the (scaled, capped) scores, (batch, heads_q, seq_q) fp32, natural
            log, ``-inf`` where a query sees no key; it is differentiable.
        deterministic: bitwise-reproducible gradients for this call (the Triton backward always is; the Gluon one
            is also under ``torch.use_deterministic_algorithms(True)``).
        backward: "auto" (the default: "gluon" where it applies, else "triton"; see :func:`backward_impl`),
            "gluon" (sm_90, fp16/bf16, d 64, 96 or 128: five matmuls per tile pair, dQ by fp32 reduce-adds; the
            faster one on an H200), "triton" (separate dK/dV and dQ kernels without atomics) or "pytorch" (compiled
            recomputation; plain causal or full attention only).
        forward: "auto" (the Gluon kernel where
            :func:`~cs336_kernels.ops.flash_attention.gluon_common.gluon_applies`, else Triton), "triton" or
            "gluon" (sm_90, fp16/bf16, d 64, 96, 128 or 256).

    Returns:
        The attention output, shaped and typed like ``q``; with ``return_lse``, ``(output, lse)``.
    """
    check_inputs(q, k, v, is_causal)
    _check_impls(backward, forward)
    params = make_params(q.shape[-1], is_causal, softmax_scale, window_size, softcap)
    if backward == "pytorch" and not (params.plain and (params.window_right == -1 or q.shape[-2] == k.shape[-2])):
        raise ValueError("backward='pytorch' runs plain causal attention with seq_q == seq_k or full attention only; "
                         "use 'triton' or 'auto' for windows, softcaps and causal seq_q != seq_k")
    _check_runs_here(q, "flash_attention")
    o, lse = _call(as_4d(q), as_4d(k), as_4d(v), params, forward, backward, deterministic)
    o = o.view(q.shape)
    return (o, lse.view(q.shape[:-1])) if return_lse else o


def flash_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False, softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, return_lse: bool = False,
    deterministic: bool = False, backward: BackwardImpl = "auto", forward: ForwardImpl = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a packed batch of sequences, FlashAttention-2's ``flash_attn_varlen_func``: sequence ``b``
    holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and
    v, and attends only within itself. A tile of one sequence never meets another's, so the batch costs what its
    sequences cost apart.

    Args:
        q: (total_q, heads_q, d); fp16, bf16 or fp32; d in [16, 256].
        k, v: (total_k, heads_kv, d) with heads_q a multiple of heads_kv.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device, cumulative lengths starting at 0 (a length
            of 0 is allowed), ending at total_q and total_k (not checked: reading them would wait for the GPU).
        max_seqlen_q, max_seqlen_k: the longest sequence's length (at least it: the launch grid covers this many).
        causal, softmax_scale, window_size, softcap, deterministic, backward, forward: as for
            :func:`flash_attention`, per sequence (causal aligned bottom-right in each).
        return_lse: also return the logsumexp, (heads_q, total_q) fp32.

    Returns:
        The output (total_q, heads_q, d), typed like q; with ``return_lse``, ``(output, lse)``.
    """
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_impls(backward, forward)
    if backward == "pytorch":
        raise ValueError("backward='pytorch' runs dense batches only; use 'auto', 'triton' or 'gluon' for packed "
                         "sequences")
    params = make_params(q.shape[-1], causal, softmax_scale, window_size, softcap, True, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k)
    _check_runs_here(q, "flash_attention_varlen")
    o, lse = _call(q, k, v, params, forward, backward, deterministic)
    return (o, lse) if return_lse else o


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention with the kernel operators, as an ``autograd.Function``: ``.apply(q, k, v, is_causal=False,
    backward="auto", forward="auto")``, causal aligned top-left (query i sees keys 0..i) as the course's tests and
    ``scaled_dot_product_attention`` have it."""

    @staticmethod
    def forward(
        ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False,
        backward: BackwardImpl = "auto", forward: ForwardImpl = "auto",
    ) -> torch.Tensor:
        check_inputs(Q, K, V, is_causal)
        _check_impls(backward, forward)
        _check_runs_here(Q, "flash_attention")
        params = make_params(Q.shape[-1], is_causal, None, (-1, -1), 0.0, bottom_right=False)
        o, lse = _call(as_4d(Q), as_4d(K), as_4d(V), params, forward, backward, False)
        o = o.view(Q.shape)
        ctx.save_for_backward(lse.view(Q.shape[:-1]), Q, K, V, o)
        ctx.window_right, ctx.scale, ctx.backward = params.window_right, params.softmax_scale, backward
        return o

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        lse, Q, K, V, O = ctx.saved_tensors
        q4 = as_4d(Q)
        dq, dk, dv = flash_attention_backward_op(
            q4, as_4d(K), as_4d(V), as_4d(O), as_4d(dO), lse.view(q4.shape[:-1]), None, None, None, 0, 0, ctx.scale,
            -1, ctx.window_right, False, 0.0, ctx.backward, False,
        )
        return dq.view(Q.shape), dk.view(K.shape), dv.view(V.shape), None, None, None


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttention-2 with a tiled PyTorch forward and a compiled PyTorch recomputation backward (causal aligned
    top-left, as :class:`FlashAttentionTriton`)."""

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
