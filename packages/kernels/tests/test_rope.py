"""rope against its float64 reference: both outputs, both gradients, layouts, positions, errors; the half layout
also against Hugging Face's ``apply_rotary_pos_emb`` formula written out here.

CPU tests run the kernel in the Triton interpreter (root conftest) in fp32 and fp16, on contiguous and strided
(batch, seq, heads, head_dim) views; GPU tests run bf16 at (1, 32768, 32, 128) and compare with the reference
evaluated in bf16, which is the model's ``RotaryEmbedding.forward`` (``packages/harness/tests/test_fused_bench.py``
checks that they are the same computation).
"""

from __future__ import annotations

import math

import pytest
import torch
from cs336_kernels.ops.rope import rope, rope_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# ||ours - float64|| / ||float64|| allowed, by dtype: one rounding of an fp32 rotation. Against the module's
# formula evaluated by PyTorch in the same dtype, only fused multiply-adds in the rotation differ (a rare
# one-ulp flip after rounding to bf16).
REL_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 5e-3}
SAME_FORMULA_TOL = {torch.bfloat16: 2e-4}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _tables(context: int, head_dim: int, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding's tables: angles in float64, stored fp32, (context, head_dim / 2)."""
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.arange(context, dtype=torch.float64, device=device)[:, None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def _projection_views(batch, seq, heads, head_dim, dtype, seed, fused_qkv=False, device=DEVICE):
    """q, k as (batch, seq, heads, head_dim) views of projection outputs, and upstream gradients."""
    gen = torch.Generator(device=device).manual_seed(seed)
    d_model = heads * head_dim
    width = 3 * d_model if fused_qkv else d_model
    q_proj = torch.randn(batch, seq, width, generator=gen, device=device).to(dtype).requires_grad_()
    k_proj = torch.randn(batch, seq, width, generator=gen, device=device).to(dtype).requires_grad_()
    q = q_proj[..., :d_model].view(batch, seq, heads, head_dim) if fused_qkv else q_proj.view(
        batch, seq, heads, head_dim)
    k = k_proj[..., d_model:2 * d_model].view(batch, seq, heads, head_dim) if fused_qkv else k_proj.view(
        batch, seq, heads, head_dim)
    dq = torch.randn(q.shape, generator=gen, device=device).to(dtype)
    dk = torch.randn(k.shape, generator=gen, device=device).to(dtype)
    return (q_proj, k_proj), (q, k), (dq, dk)


def _forward_backward(fn, leaves, q, k, cos, sin, positions, dq, dk):
    q_out, k_out = fn(q, k, cos, sin, positions)
    torch.autograd.backward((q_out, k_out), (dq, dk))
    grads = tuple(leaf.grad for leaf in leaves)
    for leaf in leaves:
        leaf.grad = None
    return (q_out.detach(), k_out.detach(), *grads)


def _float64_twin(leaves, q, k):
    """Float64 copies of the leaves and the same views of them."""
    leaves64 = tuple(leaf.detach().double().requires_grad_() for leaf in leaves)
    views = []
    for leaf, leaf64, view in zip(leaves, leaves64, (q, k), strict=True):
        offset = view.storage_offset() - leaf.storage_offset()
        views.append(leaf64.as_strided(view.shape, view.stride(), leaf64.storage_offset() + offset))
    return leaves64, views


def _check(batch, seq, heads, head_dim, dtype, positions, context, fused_qkv=False, seed=0):
    leaves, (q, k), (dq, dk) = _projection_views(batch, seq, heads, head_dim, dtype, seed, fused_qkv)
    cos, sin = _tables(context, head_dim)
    ours = _forward_backward(rope, leaves, q, k, cos, sin, positions, dq, dk)
    leaves64, (q64, k64) = _float64_twin(leaves, q, k)
    ref = _forward_backward(rope_reference, leaves64, q64, k64, cos.double(), sin.double(), positions,
                            dq.double(), dk.double())
    assert ours[0].is_contiguous() and ours[0].transpose(1, 2).shape == (batch, heads, seq, head_dim)
    for name, out, expected in zip(("q_rot", "k_rot", "dq_proj", "dk_proj"), ours, ref, strict=True):
        assert out.dtype == dtype and out.shape == expected.shape, name
        err = _rel_err(out, expected)
        assert err < REL_TOL[dtype], (name, err)


@pytest.mark.parametrize(
    ("batch", "seq", "heads", "head_dim"),
    [(2, 7, 3, 16), (1, 5, 2, 6), (1, 1, 1, 2), (3, 4, 5, 128)],
    ids=["small", "head-dim-not-power-of-2", "one-token", "odd-heads-d-128"],
)
def test_matches_float64_reference_fp32(batch, seq, heads, head_dim):
    _check(batch, seq, heads, head_dim, torch.float32, torch.arange(seq, device=DEVICE), context=seq)


def test_fp16_strided_views_of_a_fused_projection_with_batched_positions():
    # q and k are column slices of (batch, seq, 3 d_model) tensors; positions differ per sequence.
    batch, seq = 2, 9
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    positions = torch.randint(0, 40, (batch, seq), generator=gen, device=DEVICE)
    _check(batch, seq, 4, 32, torch.float16, positions, context=40, fused_qkv=True, seed=2)


def test_int32_positions_and_gqa_heads():
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q = torch.randn(2, 6, 8, 64, generator=gen, device=DEVICE)
    k = torch.randn(2, 6, 2, 64, generator=gen, device=DEVICE)
    cos, sin = _tables(10, 64)
    positions = torch.tensor([9, 0, 3, 3, 1, 7], dtype=torch.int32, device=DEVICE)
    ours = rope(q, k, cos, sin, positions)
    ref = rope_reference(q.double(), k.double(), cos.double(), sin.double(), positions.long())
    for out, expected in zip(ours, ref, strict=True):
        assert _rel_err(out, expected) < REL_TOL[torch.float32]


def test_rotation_keeps_norms_and_position_zero_is_identity():
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    q = torch.randn(1, 3, 2, 8, generator=gen, device=DEVICE)
    cos, sin = _tables(3, 8)
    q_rot, k_rot = rope(q, q, cos, sin, torch.arange(3, device=DEVICE))
    torch.testing.assert_close(q_rot[:, 0], q[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1), rtol=1e-6, atol=0)
    # The angle of pair i at position 1 is 10000^(-2i/8).
    pair = q[0, 1, 0, 2:4]
    angle = 10000.0 ** (-2 / 8)
    expected = torch.stack((pair[0] * math.cos(angle) - pair[1] * math.sin(angle),
                            pair[0] * math.sin(angle) + pair[1] * math.cos(angle)))
    torch.testing.assert_close(q_rot[0, 1, 0, 2:4], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(q_rot, k_rot)


def _bad(change: dict):
    args = {"q": torch.randn(1, 4, 2, 8), "k": torch.randn(1, 4, 2, 8), "cos": torch.randn(6, 4),
            "sin": torch.randn(6, 4), "positions": torch.arange(4)}
    args.update(change)
    return args


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"q": torch.randn(4, 2, 8)}, ValueError, r"\(batch, seq, heads, head_dim\)"),
        ({"k": torch.randn(1, 5, 2, 8)}, ValueError, "same batch, seq and head_dim"),
        ({"q": torch.randn(1, 4, 2, 7), "k": torch.randn(1, 4, 2, 7)}, ValueError, "head_dim must be even"),
        ({"k": torch.randn(1, 4, 2, 8, dtype=torch.float16)}, TypeError, "share a dtype"),
        ({"q": torch.randn(1, 4, 2, 8).double(), "k": torch.randn(1, 4, 2, 8).double()}, TypeError, "share a dtype"),
        ({"cos": torch.randn(6, 4).double()}, TypeError, "float32 tables"),
        ({"cos": torch.randn(6, 3), "sin": torch.randn(6, 3)}, ValueError, r"head_dim / 2 = 4"),
        ({"cos": torch.randn(6, 4, requires_grad=True)}, ValueError, "must not require grad"),
        ({"positions": torch.arange(4.0)}, TypeError, "int32 or int64"),
        ({"positions": torch.arange(5)}, ValueError, r"\(seq,\) = \(4,\)"),
        # (batch, heads, seq, head_dim) views: named as the wrong layout, not as wrong positions.
        ({"q": torch.randn(1, 2, 4, 8), "k": torch.randn(1, 2, 4, 8)}, ValueError, r"transpose\(1, 2\)"),
        ({"positions": None}, ValueError, "layout='half'"),
        ({"layout": "rotate_half"}, ValueError, "layout must be one of"),
        # The range check reads the positions: on CPU tensors only (a host sync on a GPU).
        pytest.param({"positions": torch.tensor([0, 1, 6, 2])}, ValueError, r"\[0, 6\).*\[0, 6\]",
                     marks=pytest.mark.interpreter),
        pytest.param({"positions": torch.tensor([0, -1, 2, 3])}, ValueError, r"\[0, 6\)",
                     marks=pytest.mark.interpreter),
        ({"sin": [0.0]}, TypeError, "sin must be a torch.Tensor"),
    ],
)
def test_rejects_bad_inputs(change, error, message):
    args = _bad(change)
    layout = args.pop("layout", "interleaved")
    with pytest.raises(error, match=message):
        rope(**args, layout=layout)


# The half layout: Hugging Face's rotate_half on per-token (batch or 1, seq, rotary_dim) angles.
def _hf_angles(batch, seq, rotary, dtype, positions, theta=10000.0, device=DEVICE):
    """cos and sin as Hugging Face's rotary embedding returns them: cat(freqs, freqs), cast to the model's dtype."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float32, device=device) / rotary)
    freqs = positions.to(device)[..., None].float() * inv_freq  # (b, seq, r/2)
    emb = torch.cat((freqs, freqs), dim=-1).expand(batch, seq, rotary)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _hf_apply_rotary(q, k, cos, sin):
    """HF's apply_rotary_pos_emb (with partial rotary as Phi / GPT-NeoX apply it) on (batch, seq, heads, d)."""
    def rotate(x):
        rotary = cos.shape[-1]
        x_rot, x_pass = x[..., :rotary], x[..., rotary:]
        x1, x2 = x_rot[..., : rotary // 2], x_rot[..., rotary // 2:]
        rotated = x_rot * cos.unsqueeze(2) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(2)
        return torch.cat((rotated, x_pass), dim=-1)
    return rotate(q), rotate(k)


def _check_half(batch, seq, heads_q, heads_k, head_dim, rotary, dtype, angle_batch, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q_proj = torch.randn(batch, seq, heads_q * head_dim, generator=gen, device=DEVICE).to(dtype).requires_grad_()
    k_proj = torch.randn(batch, seq, heads_k * head_dim, generator=gen, device=DEVICE).to(dtype).requires_grad_()
    q, k = q_proj.view(batch, seq, heads_q, head_dim), k_proj.view(batch, seq, heads_k, head_dim)
    positions = torch.randint(0, 50, (angle_batch, seq), generator=gen, device=DEVICE)
    cos, sin = _hf_angles(angle_batch, seq, rotary, dtype, positions)
    dq = torch.randn(q.shape, generator=gen, device=DEVICE).to(dtype)
    dk = torch.randn(k.shape, generator=gen, device=DEVICE).to(dtype)
    leaves = (q_proj, k_proj)
    ours = _forward_backward(lambda *a: rope(*a[:4], layout="half"), leaves, q, k, cos, sin, None, dq, dk)
    leaves64, (q64, k64) = _float64_twin(leaves, q, k)
    hf = _forward_backward(lambda q_, k_, c, s, _: _hf_apply_rotary(q_, k_, c, s), leaves64, q64, k64,
                           cos.double(), sin.double(), None, dq.double(), dk.double())
    ref = _forward_backward(lambda *a: rope_reference(*a[:4], layout="half"), leaves64, q64, k64, cos.double(),
                            sin.double(), None, dq.double(), dk.double())
    for name, out, expected, reference in zip(("q_rot", "k_rot", "dq_proj", "dk_proj"), ours, hf, ref, strict=True):
        assert out.dtype == dtype and out.shape == expected.shape, name
        assert _rel_err(out, expected) < REL_TOL[dtype], (name, _rel_err(out, expected))
        torch.testing.assert_close(reference, expected, rtol=1e-12, atol=1e-12)
    if rotary < head_dim:  # the features past rotary_dim pass through, and so do their gradients
        assert torch.equal(ours[0][..., rotary:], q.detach()[..., rotary:])
        assert torch.equal(ours[2].view(q.shape)[..., rotary:], dq[..., rotary:])


@pytest.mark.parametrize(
    ("batch", "seq", "heads_q", "heads_k", "head_dim", "rotary", "dtype", "angle_batch"),
    [(2, 7, 3, 1, 16, 16, torch.float32, 1), (2, 5, 4, 2, 12, 12, torch.float32, 2),
     (1, 9, 2, 2, 24, 8, torch.float32, 1), (3, 4, 5, 5, 128, 64, torch.float16, 3),
     (1, 1, 1, 1, 2, 2, torch.float32, 1)],
    ids=["gqa-shared-angles", "head-dim-12-batched-angles", "partial-rotary-8-of-24", "fp16-partial-d-128",
         "one-token-d-2"],
)
def test_half_layout_matches_hugging_face(batch, seq, heads_q, heads_k, head_dim, rotary, dtype, angle_batch):
    _check_half(batch, seq, heads_q, heads_k, head_dim, rotary, dtype, angle_batch)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"positions": torch.arange(4)}, ValueError, "no positions"),
        ({"cos": torch.randn(1, 4, 10), "sin": torch.randn(1, 4, 10)}, ValueError, "at most head_dim = 8"),
        ({"cos": torch.randn(1, 4, 6)[..., :5], "sin": torch.randn(1, 4, 5)}, ValueError, "rotary_dim even"),
        ({"cos": torch.randn(3, 4, 8), "sin": torch.randn(3, 4, 8)}, ValueError, r"batch = 1 or 1"),
        ({"cos": torch.randn(1, 4, 8).double(), "sin": torch.randn(1, 4, 8).double()}, TypeError, "share a dtype"),
        ({"cos": torch.randn(1, 8, 4).transpose(1, 2)}, ValueError, "unit stride"),
    ],
)
def test_half_layout_rejects_bad_inputs(change, error, message):
    args = {"q": torch.randn(1, 4, 2, 8), "k": torch.randn(1, 4, 2, 8), "cos": torch.randn(1, 4, 8),
            "sin": torch.randn(1, 4, 8), "positions": None}
    args.update(change)
    with pytest.raises(error, match=message):
        rope(**args, layout="half")


@pytest.mark.gpu
def test_half_layout_bf16_on_gpu():
    # Llama-3.2-1B's attention at 8,192 tokens: 32 query heads, 8 key heads of 64, bf16 angles as HF passes them.
    _check_half(1, 8192, 32, 8, 64, 64, torch.bfloat16, 1, seed=7)


@pytest.mark.gpu
@pytest.mark.gpu_exclusive
def test_leaderboard_shape_bf16_on_gpu():
    batch, seq, heads, head_dim = 1, 32768, 32, 128
    positions = torch.arange(seq, device=DEVICE)
    _check(batch, seq, heads, head_dim, torch.bfloat16, positions, context=seq, seed=5)
    leaves, (q, k), (dq, dk) = _projection_views(batch, seq, heads, head_dim, torch.bfloat16, seed=6)
    cos, sin = _tables(seq, head_dim)
    ours = _forward_backward(rope, leaves, q, k, cos, sin, positions, dq, dk)
    same = _forward_backward(rope_reference, leaves, q, k, cos, sin, positions, dq, dk)
    leaves64, (q64, k64) = _float64_twin(leaves, q, k)
    exact = _forward_backward(rope_reference, leaves64, q64, k64, cos.double(), sin.double(), positions,
                              dq.double(), dk.double())
    for name, out, pytorch, expected in zip(("q_rot", "k_rot", "dq_proj", "dk_proj"), ours, same, exact,
                                            strict=True):
        assert _rel_err(out, pytorch) < SAME_FORMULA_TOL[torch.bfloat16], (name, _rel_err(out, pytorch))
        assert _rel_err(out, expected) < REL_TOL[torch.bfloat16], (name, _rel_err(out, expected))
