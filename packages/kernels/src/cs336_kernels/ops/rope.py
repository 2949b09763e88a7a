"""Rotary position embedding (Su et al., 2021) on queries and keys together, in Triton, in two layouts.

``layout="interleaved"`` (``cs336_basics``): each (even, odd) feature pair (x[2i], x[2i+1]) of a head is rotated by
the angle of its position p, with the fp32 tables cos[p, i] and sin[p, i] of ``cs336_basics.model.RotaryEmbedding``:

    out[2i]   = x[2i] * cos - x[2i+1] * sin
    out[2i+1] = x[2i] * sin + x[2i+1] * cos

``layout="half"`` (Hugging Face Llama, Qwen, Mistral: ``q * cos + rotate_half(q) * sin``): the pairs are
(x[i], x[i + r/2]) of the first ``r`` features (``r``, the rotary dim, is the tables' width; features from r on pass
through unrotated: partial rotary), and cos and sin are per token, (batch or 1, seq, r), as HF's rotary embedding
returns them, in any float dtype. HF builds them as ``cat(freqs, freqs)``, so both halves hold the pair's angle: the
kernel reads the first half.

Both rotate in fp32 and round once to the input dtype (HF rounds each product and the sum in the model's dtype,
within a few ulps of this). The layout is the one the projections produce: q and k are (batch, seq, heads,
head_dim) views of the (batch, seq, d_model) projection outputs (any strides, unit stride on head_dim), and the
outputs are written contiguous in that layout, so ``out.transpose(1, 2)`` is the (batch, heads, seq, head_dim)
strided view the attention kernel reads, with no copy; the module instead works on the transposed heads and stacks
the halves, which costs copies. One program handles one token: it loads the token's table row once and rotates
every head of q and of k. The backward is the inverse rotation (the same kernel with sin negated); only the tables
(and positions) are saved.

    q_rot, k_rot = rope(q, k, cos, sin, positions)   # q (b, s, hq, d), k (b, s, hk, d), cos/sin (context, d/2)
    q_rot, k_rot = rope(q, k, cos, sin, layout="half")   # cos/sin (b or 1, s, r), r <= d

``rope_reference`` is both formulas in plain PyTorch (any dtype); tests and benchmarks import it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cs336_kernels.interpreter import check_device
from cs336_kernels.ops._common import device_context, unit_stride

X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
POSITION_DTYPES = (torch.int32, torch.int64)
LAYOUTS = ("interleaved", "half")
# Elements of one head block: a program loops over blocks of heads of at most this many values.
_BLOCK_ELEMENTS = 4096


@triton.jit
def _rotate_heads(
    X, Y,  # one token's heads: X at X + h * stride_xh + d (unit d stride), Y contiguous (heads, D)
    stride_xh, heads, cos, sin,  # cos, sin: (BLOCK_HALF,) fp32 angles of the token's pairs
    D: tl.constexpr, ROTARY: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_D)[None, :]
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    for h0 in range(0, heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        if HALF:
            # Pairs (i, i + ROTARY / 2); features from ROTARY on are copied (partial rotary).
            mask = (h < heads) & (pairs < ROTARY // 2)
            x1 = tl.load(X + h * stride_xh + pairs, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(X + h * stride_xh + pairs + ROTARY // 2, mask=mask, other=0.0).to(tl.float32)
            tl.store(Y + h * D + pairs, (x1 * cos[None, :] - x2 * sin[None, :]).to(Y.dtype.element_ty), mask=mask)
            tl.store(Y + h * D + pairs + ROTARY // 2, (x2 * cos[None, :] + x1 * sin[None, :]).to(Y.dtype.element_ty),
                     mask=mask)
            if ROTARY < D:
                rest = (h < heads) & (cols >= ROTARY) & (cols < D)
                tl.store(Y + h * D + cols, tl.load(X + h * stride_xh + cols, mask=rest), mask=rest)
        else:
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
    COS, SIN, POS,  # angles: row r of batch b at COS + b * stride_cb + r * stride_ct; positions (S,) or (B, S)
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_cb, stride_ct, stride_cf, stride_pb, stride_ps,
    S, HQ, HK,
    D: tl.constexpr, ROTARY: tl.constexpr, HALF: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    INVERSE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    row = s  # per-token angles: one row per token
    if HAS_POSITIONS:  # tables: the row of the token's position
        row = tl.load(POS + b * stride_pb + s * stride_ps).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    table_mask = half < ROTARY // 2
    cos = tl.load(COS + b * stride_cb + row * stride_ct + half * stride_cf, mask=table_mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + b * stride_cb + row * stride_ct + half * stride_cf, mask=table_mask, other=0.0).to(tl.float32)
    if INVERSE:  # the transpose of a rotation is the rotation by minus the angle
        sin = -sin
    token = b * S + s
    _rotate_heads(Q + b * stride_qb + s * stride_qs, QO + token * HQ * D, stride_qh, HQ, cos, sin,
                  D, ROTARY, HALF, BLOCK_HQ, BLOCK_D, BLOCK_HALF)
    _rotate_heads(K + b * stride_kb + s * stride_ks, KO + token * HK * D, stride_kh, HK, cos, sin,
                  D, ROTARY, HALF, BLOCK_HK, BLOCK_D, BLOCK_HALF)


def launch_settings(head_dim: int, heads_q: int, heads_k: int) -> dict[str, int]:
    """Tile sizes and warps: a head block of at most 4,096 values, the head dim padded to a power of two."""
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, _BLOCK_ELEMENTS // block_d)
    block_hq = min(block_h, triton.next_power_of_2(max(heads_q, 1)))
    block_hk = min(block_h, triton.next_power_of_2(max(heads_k, 1)))
    return {"BLOCK_HQ": block_hq, "BLOCK_HK": block_hk, "BLOCK_D": block_d,
            "num_warps": 4 if max(block_hq, block_hk) * block_d <= 2048 else 8}


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor | None, inverse: bool, half: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = unit_stride(q), unit_stride(k)
    batch, seq, heads_q, head_dim = q.shape
    heads_k = k.shape[2]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.numel() == 0 and k.numel() == 0:
        return q_out, k_out
    if half:  # per-token angles (batch or 1, seq, rotary)
        rotary = cos.shape[-1]
        stride_cb = cos.stride(0) if cos.shape[0] > 1 else 0
        table_strides = (stride_cb, cos.stride(1), cos.stride(2))
    else:  # tables (context, head_dim / 2) indexed by position
        rotary = head_dim
        table_strides = (0, cos.stride(0), cos.stride(1))
    if positions is None:
        position_strides = (0, 0)
    else:
        position_strides = (positions.stride(0) if positions.dim() == 2 else 0, positions.stride(-1))
    with device_context(q):
        _rope_kernel[(seq, batch)](
            q, k, q_out, k_out, cos, sin, positions,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            *table_strides, *position_strides,
            seq, heads_q, heads_k, D=head_dim, ROTARY=rotary, HALF=half, HAS_POSITIONS=positions is not None,
            INVERSE=inverse, BLOCK_HALF=triton.next_power_of_2(max(rotary // 2, 1)),
            **launch_settings(head_dim, heads_q, heads_k),
        )
    return q_out, k_out


@torch.library.custom_op("cs336::rope", mutates_args=())
def rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
            inverse: bool, half: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by their tokens' angles (by minus them with ``inverse``: the backward), contiguous
    (batch, seq, heads, d), as ``torch.ops.cs336.rope``: pairs (2i, 2i + 1) from (context, d/2) tables at
    ``positions``, or with ``half`` pairs (i, i + r/2) from per-token (batch or 1, seq, r) angles."""
    return _rotate(q, k, cos, sin, positions, inverse, half)


@rope_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
      inverse: bool, half: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup(ctx, inputs: tuple, output: tuple) -> None:
    _, _, cos, sin, positions, inverse, half = inputs
    ctx.save_for_backward(cos, sin, positions)  # only the angles: a rotation's transpose is its inverse
    ctx.inverse, ctx.half = inverse, half


def _backward(ctx, dq_out: torch.Tensor, dk_out: torch.Tensor):
    cos, sin, positions = ctx.saved_tensors
    dq, dk = rope_op(dq_out, dk_out, cos, sin, positions, not ctx.inverse, ctx.half)
    return dq, dk, None, None, None, None, None


rope_op.register_autograd(_backward, setup_context=_setup)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor | None, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    named = [("q", q), ("k", k), ("cos", cos), ("sin", sin)] + ([] if positions is None else [("positions", positions)])
    for name, t in named:
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
    if (cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled():
        raise ValueError("cos and sin are constants: rope computes no gradient for them, so they must not require "
                         "grad")
    if layout == "half":
        _check_half_angles(q, cos, sin, positions)
    else:
        _check_tables(q, cos, sin, positions)
    devices = [t.device for _, t in named]
    if any(device != q.device for device in devices):
        raise ValueError(f"q, k, cos, sin{'' if positions is None else ' and positions'} must be on one device, got "
                         f"{', '.join(str(device) for device in devices)}")
    check_device(q.device, "rope")


def _check_half_angles(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None) -> None:
    batch, seq, _, head_dim = q.shape
    if positions is not None:
        raise ValueError("layout='half' takes per-token cos and sin (batch or 1, seq, rotary_dim), as Hugging Face's "
                         "rotary embedding returns them, and no positions; got positions")
    if cos.dtype not in X_DTYPES or sin.dtype != cos.dtype:
        raise TypeError(f"cos and sin must share a dtype in {X_DTYPES}, got {cos.dtype} and {sin.dtype}")
    if (cos.dim() != 3 or cos.shape != sin.shape or cos.shape[0] not in (1, batch) or cos.shape[1] != seq
            or not 2 <= cos.shape[2] <= head_dim or cos.shape[2] % 2):
        raise ValueError(f"with layout='half', cos and sin must be (batch = {batch} or 1, seq = {seq}, rotary_dim) "
                         f"with rotary_dim even and at most head_dim = {head_dim}; got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"cos and sin must have unit stride on their last dim and equal strides, got {cos.stride()} "
                         f"and {sin.stride()}")


def _check_tables(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None) -> None:
    batch, seq, heads, head_dim = q.shape
    if positions is None:
        raise ValueError("layout='interleaved' takes (context, head_dim / 2) tables and the tokens' positions; got "
                         "positions=None (per-token cos and sin as Hugging Face returns them take layout='half')")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"cos and sin must be float32 tables, got {cos.dtype} and {sin.dtype}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim // 2:
        raise ValueError(f"cos and sin must be (context, head_dim / 2 = {head_dim // 2}), got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if positions.dtype not in POSITION_DTYPES:
        raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
    if tuple(positions.shape) not in ((seq,), (batch, seq)):
        # The usual cause: q and k in the attention's (batch, heads, seq, head_dim) layout, not the projections'.
        if positions.shape[-1] == heads != seq:
            raise ValueError(f"q and k must be (batch, seq, heads, head_dim), the projections' layout; got q "
                             f"{tuple(q.shape)}, whose dim 2 matches the {heads} positions: (batch, heads, seq, "
                             f"head_dim) views take .transpose(1, 2) first")
        raise ValueError(f"positions must be (seq,) = ({seq},) or (batch, seq) = ({batch}, {seq}), got "
                         f"{tuple(positions.shape)}")
    # An index outside the tables would read another tensor's memory. The check reads the positions: free on
    # CPU, a host sync on a GPU, so it runs on CPU only (the model's positions are an arange), and not while
    # torch.compile traces (a value read from a tensor would break the graph).
    if (positions.device.type == "cpu" and positions.numel() and not torch.compiler.is_compiling()
            and ((positions < 0) | (positions >= cos.shape[0])).any()):
        raise ValueError(f"positions must lie in [0, {cos.shape[0]}) (the tables' context length), got values in "
                         f"[{positions.min().item()}, {positions.max().item()}]")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         positions: torch.Tensor | None = None, *, layout: str = "interleaved") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the angles of their tokens (Triton, differentiable in q and k).

    Args:
        q: (batch, seq, heads_q, head_dim) in fp32, fp16 or bf16, any strides; head_dim even.
        k: (batch, seq, heads_k, head_dim), same dtype (heads_k may differ from heads_q).
        cos, sin: constants. ``layout="interleaved"``: (context, head_dim / 2) fp32 tables
            (``RotaryEmbedding.cos`` / ``.sin``). ``layout="half"``: (batch or 1, seq, rotary_dim) per-token angles
            in any of q's dtypes, both halves of the last dim equal (Hugging Face's ``cat(freqs, freqs)``);
            rotary_dim even, at most head_dim (the features past it are not rotated).
        positions: ``layout="interleaved"`` only: (seq,) or (batch, seq) int32/int64 in [0, context) (checked for CPU
            tensors; on a GPU the check would be a host sync, so it is the caller's).
        layout: ``"interleaved"`` rotates pairs (2i, 2i + 1) (``cs336_basics``); ``"half"`` rotates pairs
            (i, i + rotary_dim / 2) (``rotate_half``: Hugging Face Llama, Qwen, Mistral).

    Returns:
        (q_rot, k_rot), contiguous (batch, seq, heads, head_dim) in the input dtype.
    """
    _check_inputs(q, k, cos, sin, positions, layout)
    return rope_op(q, k, cos, sin, positions, False, layout == "half")


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor | None = None, *,
                   layout: str = "interleaved") -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding.forward`` (interleaved) or Hugging Face's ``apply_rotary_pos_emb`` on the first rotary_dim
    features (half) of (batch, seq, heads, head_dim) q and k: rotated in fp32 (float64 for float64 inputs and
    tables), cast back to the input dtype."""
    if layout == "half":
        acc = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), torch.float32)
        c, s = cos.to(acc).unsqueeze(-2), sin.to(acc).unsqueeze(-2)  # (b, seq, 1, r): broadcast over heads
        rotary = cos.shape[-1]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x_rot, x_pass = x[..., :rotary].to(acc), x[..., rotary:]
            x1, x2 = x_rot.chunk(2, dim=-1)
            rotated = x_rot * c + torch.cat((-x2, x1), dim=-1) * s  # rotate_half
            return torch.cat((rotated.to(x.dtype), x_pass), dim=-1)

        return rotate(q), rotate(k)
    c = cos[positions].unsqueeze(-2)  # (..., seq, 1, d/2): broadcast over heads
    s = sin[positions].unsqueeze(-2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        x_even, x_odd = x[..., 0::2].to(acc), x[..., 1::2].to(acc)
        out = torch.stack((x_even * c - x_odd * s, x_even * s + x_odd * c), dim=-1)  # (b, s, h, d/2, 2)
        return out.flatten(-2).to(x.dtype)

    return rotate(q), rotate(k)
