"""Rotary position embedding (Su et al., 2021) on queries and keys together, in Triton.

Each (even, odd) feature pair (x[2i], x[2i+1]) of a head is rotated by the angle of its position p, with the
fp32 tables cos[p, i] and sin[p, i] of ``cs336_basics.model.RotaryEmbedding``:

    out[2i]   = x[2i] * cos - x[2i+1] * sin
    out[2i+1] = x[2i] * sin + x[2i+1] * cos

in fp32, rounded back to the input dtype: the module's numerics. The layout is the one the projections
produce: q and k are (batch, seq, heads, head_dim) views of the (batch, seq, d_model) projection outputs (any
strides, unit stride on head_dim), and the outputs are written contiguous in that layout, so ``out.transpose(1, 2)``
is the (batch, heads, seq, head_dim) strided view the attention kernel reads, with no copy; the module instead
works on the transposed heads and stacks the halves, which costs copies. One program handles one token: it
loads the token's table rows once and rotates every head of q and of k. The backward is the inverse rotation
(the same kernel with sin negated); only the tables and positions are saved.

    q_rot, k_rot = rope(q, k, cos, sin, positions)   # q (b, s, hq, d), k (b, s, hk, d), cos/sin (context, d/2)

``rope_reference`` is the module's formula in plain PyTorch (any dtype); tests and benchmarks import it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cs336_kernels.interpreter import check_device
from cs336_kernels.ops._common import device_context, unit_stride

X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
POSITION_DTYPES = (torch.int32, torch.int64)
# Elements of one head block: a program loops over blocks of heads of at most this many values.
_BLOCK_ELEMENTS = 4096


@triton.jit
def _rotate_heads(
    X, Y,  # one token's heads: X at X + h * stride_xh + d (unit d stride), Y contiguous (heads, D)
    stride_xh, heads, cos, sin,  # cos, sin: (BLOCK_HALF,) fp32 rows of the tables
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_D)[None, :]
    for h0 in range(0, heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (h < heads) & (cols < D)
        x = tl.load(X + h * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D // 2, 2)))  # pairs (2i, 2i + 1)
        out_even = x_even * cos[None, :] - x_odd * sin[None, :]
        out_odd = x_even * sin[None, :] + x_odd * cos[None, :]
        out = tl.reshape(tl.join(out_even, out_odd), (BLOCK_H, BLOCK_D))
        tl.store(Y + h * D + cols, out.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO,  # q (B, S, HQ, D), k (B, S, HK, D) strided; qo, ko contiguous in the same shapes
    COS, SIN, POS,  # tables (context, D // 2) fp32; positions (S,) or (B, S)
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_ct, stride_cf, stride_pb, stride_ps,
    S, HQ, HK,
    D: tl.constexpr, INVERSE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b * stride_pb + s * stride_ps).to(tl.int64)
    half = tl.arange(0, BLOCK_D // 2)
    table_mask = half < D // 2
    cos = tl.load(COS + pos * stride_ct + half * stride_cf, mask=table_mask, other=0.0)
    sin = tl.load(SIN + pos * stride_ct + half * stride_cf, mask=table_mask, other=0.0)
    if INVERSE:  # the transpose of a rotation is the rotation by minus the angle
        sin = -sin
    token = b * S + s
    _rotate_heads(Q + b * stride_qb + s * stride_qs, QO + token * HQ * D, stride_qh, HQ, cos, sin,
                  D, BLOCK_HQ, BLOCK_D)
    _rotate_heads(K + b * stride_kb + s * stride_ks, KO + token * HK * D, stride_kh, HK, cos, sin,
                  D, BLOCK_HK, BLOCK_D)


def launch_settings(head_dim: int, heads_q: int, heads_k: int) -> dict[str, int]:
    """Tile sizes and warps: a head block of at most 4,096 values, the head dim padded to a power of two."""
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, _BLOCK_ELEMENTS // block_d)
    block_hq = min(block_h, triton.next_power_of_2(max(heads_q, 1)))
    block_hk = min(block_h, triton.next_power_of_2(max(heads_k, 1)))
    return {"BLOCK_HQ": block_hq, "BLOCK_HK": block_hk, "BLOCK_D": block_d,
            "num_warps": 4 if max(block_hq, block_hk) * block_d <= 2048 else 8}


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = unit_stride(q), unit_stride(k)
    batch, seq, heads_q, head_dim = q.shape
    heads_k = k.shape[2]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.numel() == 0 and k.numel() == 0:
        return q_out, k_out
    stride_pb = positions.stride(0) if positions.dim() == 2 else 0
    with device_context(q):
        _rope_kernel[(seq, batch)](
            q, k, q_out, k_out, cos, sin, positions,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            cos.stride(0), cos.stride(1), stride_pb, positions.stride(-1),
            seq, heads_q, heads_k, D=head_dim, INVERSE=inverse, **launch_settings(head_dim, heads_q, heads_k),
        )
    return q_out, k_out


@torch.library.custom_op("cs336::rope", mutates_args=())
def rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by the angles of ``positions`` (by minus them with ``inverse``: the backward), contiguous
    (batch, seq, heads, d), as ``torch.ops.cs336.rope``."""
    return _rotate(q, k, cos, sin, positions, inverse)


@rope_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
      inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup(ctx, inputs: tuple, output: tuple) -> None:
    _, _, cos, sin, positions, inverse = inputs
    ctx.save_for_backward(cos, sin, positions)  # only the tables and positions: a rotation's transpose is its inverse
    ctx.inverse = inverse


def _backward(ctx, dq_out: torch.Tensor, dk_out: torch.Tensor):
    cos, sin, positions = ctx.saved_tensors
    dq, dk = rope_op(dq_out, dk_out, cos, sin, positions, not ctx.inverse)
    return dq, dk, None, None, None, None


rope_op.register_autograd(_backward, setup_context=_setup)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin), ("positions", positions)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must be (batch, seq, heads, head_dim) with the same batch, seq and head_dim; "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    batch, seq, _, head_dim = q.shape
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even and positive, got {head_dim}")
    if q.dtype not in X_DTYPES or k.dtype != q.dtype:
        raise TypeError(f"q and k must share a dtype in {X_DTYPES}, got {q.dtype} and {k.dtype}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"cos and sin must be float32 tables, got {cos.dtype} and {sin.dtype}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim // 2:
        raise ValueError(f"cos and sin must be (context, head_dim / 2 = {head_dim // 2}), got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if (cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled():
        raise ValueError("cos and sin are constant tables: rope computes no gradient for them, so they must not "
                         "require grad")
    if positions.dtype not in POSITION_DTYPES:
        raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
    if tuple(positions.shape) not in ((seq,), (batch, seq)):
        raise ValueError(f"positions must be (seq,) = ({seq},) or (batch, seq) = ({batch}, {seq}), got "
                         f"{tuple(positions.shape)}")
    if not q.device == k.device == cos.device == sin.device == positions.device:
        raise ValueError(f"q, k, cos, sin and positions must be on one device, got {q.device}, {k.device}, "
                         f"{cos.device}, {sin.device}, {positions.device}")
    check_device(q.device, "rope")
    # An index outside the tables would read another tensor's memory. The check reads the positions: free on
    # CPU, a host sync on a GPU, so it runs on CPU only (the model's positions are an arange), and not while
    # torch.compile traces (a value read from a tensor would break the graph).
    if (positions.device.type == "cpu" and positions.numel() and not torch.compiler.is_compiling()
            and ((positions < 0) | (positions >= cos.shape[0])).any()):
        raise ValueError(f"positions must lie in [0, {cos.shape[0]}) (the tables' context length), got values in "
                         f"[{positions.min().item()}, {positions.max().item()}]")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the angles of their tokens' positions (Triton, differentiable in q and k).

    Args:
        q: (batch, seq, heads_q, head_dim) in fp32, fp16 or bf16, any strides; head_dim even.
        k: (batch, seq, heads_k, head_dim), same dtype (heads_k may differ from heads_q).
        cos, sin: (context, head_dim / 2) fp32 tables (``RotaryEmbedding.cos`` / ``.sin``), constants.
        positions: (seq,) or (batch, seq) int32/int64 in [0, context) (checked for CPU tensors; on a GPU the check
            would be a host sync, so it is the caller's).

    Returns:
        (q_rot, k_rot), contiguous (batch, seq, heads, head_dim) in the input dtype.
    """
    _check_inputs(q, k, cos, sin, positions)
    return rope_op(q, k, cos, sin, positions, False)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding.forward`` on (batch, seq, heads, head_dim) q and k: pairs rotated in fp32 (float64 for
    float64 inputs and tables), cast back to the input dtype."""
    c = cos[positions].unsqueeze(-2)  # (..., seq, 1, d/2): broadcast over heads
    s = sin[positions].unsqueeze(-2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        x_even, x_odd = x[..., 0::2].to(acc), x[..., 1::2].to(acc)
        out = torch.stack((x_even * c - x_odd * s, x_even * s + x_odd * c), dim=-1)  # (b, s, h, d/2, 2)
        return out.flatten(-2).to(x.dtype)

    return rotate(q), rotate(k)


