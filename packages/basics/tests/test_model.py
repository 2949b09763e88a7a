"""The basics Transformer against PyTorch references: layers, causality, autocast, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from cs336_basics.config import PRESETS, ModelConfig
from cs336_basics.model import (
    PYTORCH_KERNELS,
    BasicsTransformerLM,
    BlockKernels,
    CausalMultiHeadSelfAttention,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    TransformerBlock,
    scaled_dot_product_attention,
    sdpa_attention,
)

ATOL, RTOL = 1e-5, 1e-5


def small_lm(kernels: BlockKernels = PYTORCH_KERNELS, **overrides) -> BasicsTransformerLM:
    cfg = dict(vocab_size=37, context_length=19, d_model=24, num_layers=2, num_heads=3, d_ff=40)
    cfg.update(overrides)
    return BasicsTransformerLM(**cfg, kernels=kernels)


def test_linear_and_embedding_match_torch():
    lin = Linear(7, 5)
    assert lin.weight.shape == (5, 7)
    std = math.sqrt(2 / 12)
    assert lin.weight.abs().max() <= 3 * std + 1e-6
    x = torch.randn(3, 4, 7)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), atol=ATOL, rtol=RTOL)
    emb = Embedding(11, 6)
    ids = torch.randint(0, 11, (2, 9))
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight))


def test_rmsnorm_matches_reference():
    norm = RMSNorm(13)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(13))
    x = torch.randn(4, 5, 13, dtype=torch.float64)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm(x.float()).double(), expected, atol=1e-5, rtol=1e-5)
    assert norm(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_rope_relative_position_property():
    rope = RotaryEmbedding(context_length=64, dim=8)
    q, k = torch.randn(8, dtype=torch.float64).float(), torch.randn(8).float()

    def score(i: int, j: int) -> float:
        qi = rope(q.view(1, 8), torch.tensor([i]))
        kj = rope(k.view(1, 8), torch.tensor([j]))
        return (qi * kj).sum().item()

    # The rotated dot product depends only on the offset i - j.
    assert score(5, 2) == pytest.approx(score(40, 37), abs=1e-4)
    assert score(9, 9) == pytest.approx((q * k).sum().item(), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)
    # Rotation preserves norms.
    x = torch.randn(3, 10, 8)
    torch.testing.assert_close(rope(x, torch.arange(10)).norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_rope_rejects_odd_dim():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(8, 5)


def test_swiglu_matches_reference():
    ffn = SwiGLU(6, 10)
    x = torch.randn(2, 3, 6)
    expected = F.linear(F.silu(F.linear(x, ffn.w1.weight)) * F.linear(x, ffn.w3.weight), ffn.w2.weight)
    torch.testing.assert_close(ffn(x), expected, atol=ATOL, rtol=RTOL)


def test_attention_matches_torch_sdpa():
    q, k, v = (torch.randn(2, 3, 11, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(11, 11, dtype=torch.bool).tril()
    torch.testing.assert_close(
        scaled_dot_product_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    )
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))


def test_multihead_attention_matches_reference():
    torch.manual_seed(0)
    rope = RotaryEmbedding(16, 4)
    attn = CausalMultiHeadSelfAttention(12, 3, rope)
    x = torch.randn(2, 7, 12)
    pos = torch.arange(7)

    def split(t):  # (B, T, D) -> (B, H, T, Dh)
        return t.view(2, 7, 3, 4).transpose(1, 2)

    q = rope(split(F.linear(x, attn.q_proj.weight)), pos)
    k = rope(split(F.linear(x, attn.k_proj.weight)), pos)
    v = split(F.linear(x, attn.v_proj.weight))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 7, 12)
    torch.testing.assert_close(attn(x), F.linear(o, attn.output_proj.weight), atol=1e-5, rtol=1e-5)


def test_block_is_prenorm_residual():
    block = TransformerBlock(12, 3, 20, RotaryEmbedding(16, 4))
    x = torch.randn(2, 5, 12)
    h = x + block.attn(block.ln1(x))
    torch.testing.assert_close(block(x), h + block.ffn(block.ln2(h)))


def _block_pair(**kwargs) -> tuple[TransformerBlock, TransformerBlock]:
    """The same block (same weights, ln2's weight not all ones) without and with ``kwargs``, in float64."""
    torch.manual_seed(0)
    plain = TransformerBlock(12, 3, 20, RotaryEmbedding(16, 4))
    with torch.no_grad():
        plain.ln2.weight.copy_(1 + torch.randn(12))
    other = TransformerBlock(12, 3, 20, RotaryEmbedding(16, 4), kernels=BlockKernels(**kwargs))
    other.load_state_dict(plain.state_dict())
    return plain.double(), other.double()


def test_add_norm_gets_the_residual_and_ln2s_weight():
    seen = []

    def add_norm(x, delta, weight, eps):  # the add and RMSNorm's formula, as the block writes them
        seen.append((delta.shape, weight is block.ln2.weight, eps))
        h = x + delta
        return h, block.ln2(h)  # ln2 itself runs the model's code: the block calls add_norm instead of it

    plain, block = _block_pair(add_norm=add_norm)
    assert plain.add_norm is None
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    want, want_grads = _outputs_and_grads(plain, x)
    out, grads = _outputs_and_grads(block, x)
    assert seen == [((2, 5, 12), True, block.ln2.eps)]  # one call per forward, with ln2's own weight and eps
    assert [n for n, _ in block.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert torch.equal(out, want)
    for g, w in zip(grads, want_grads, strict=True):
        assert torch.equal(g, w)


def test_norm_runs_every_rmsnorm_with_its_own_weight():
    seen = []

    def norm(x, weight, eps):  # RMSNorm's formula
        seen.append(weight.shape)
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)

    torch.manual_seed(0)
    plain = small_lm()
    lm = small_lm(BlockKernels(norm=norm))
    lm.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 37, (2, 7))
    torch.testing.assert_close(lm(ids), plain(ids), atol=ATOL, rtol=RTOL)
    assert seen == [(24,)] * 5  # two per block and the final norm
    assert [n for n, _ in lm.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_lm_shapes_and_causality():
    torch.manual_seed(0)
    lm = small_lm()
    ids = torch.randint(0, 37, (3, 19))
    logits = lm(ids)
    assert logits.shape == (3, 19, 37) and logits.dtype == torch.float32
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 37
    new = lm(changed)
    torch.testing.assert_close(new[:, :12], logits[:, :12])
    assert not torch.allclose(new[:, 12:], logits[:, 12:])


def test_lm_under_bf16_autocast():
    lm = small_lm()
    ids = torch.randint(0, 37, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = lm(ids)
    assert logits.shape == (2, 9, 37) and logits.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in lm.parameters())
    torch.testing.assert_close(logits.float(), lm(ids), atol=0.15, rtol=0.05)


def test_attention_is_chosen_per_model():
    calls = []

    def spy(q, k, v, is_causal):
        calls.append((q.shape, is_causal))
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    torch.manual_seed(0)
    plain = small_lm()
    ids = torch.randint(0, 37, (2, 8))
    expected = plain(ids)
    for kernels in (BlockKernels(attention=spy), BlockKernels(attention=sdpa_attention)):
        lm = small_lm(kernels)
        lm.load_state_dict(plain.state_dict())
        torch.testing.assert_close(lm(ids), expected, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 and all(causal for _, causal in calls)  # the spy's model only, once per block
    torch.testing.assert_close(plain(ids), expected)  # a model with the same weights keeps its own attention
    assert len(calls) == 2


def test_bad_arguments_raise():
    for name in ("attention", "norm", "add_norm", "rotary", "gate", "loss"):
        with pytest.raises(TypeError, match=f"{name} must be"):
            BlockKernels(**{name: 3})
    with pytest.raises(TypeError, match="kernels must be a BlockKernels"):
        small_lm({"attention": sdpa_attention})
    with pytest.raises(ValueError, match="divisible"):
        small_lm(d_model=25)
    with pytest.raises(ValueError, match="divisible"):
        CausalMultiHeadSelfAttention(10, 3, None)
    lm = small_lm()
    with pytest.raises(ValueError, match="batch, seq"):
        lm(torch.randint(0, 37, (19,)))
    with pytest.raises(ValueError, match="token ids"):
        lm(torch.tensor([[0, 37]]))
    with pytest.raises(ValueError, match="token ids"):
        lm(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match="context_length"):
        lm(torch.zeros(1, 20, dtype=torch.long))
    with pytest.raises(TypeError, match="int"):
        lm(torch.zeros(1, 3))


def test_config_presets_and_parameter_count():
    for name in PRESETS:
        config = ModelConfig.from_preset(name, vocab_size=53, context_length=16)
        assert config.num_params == sum(s for s in (  # formula vs the shapes the model builds, without building it
            config.num_layers * (4 * config.d_model**2 + 3 * config.d_model * config.d_ff + 2 * config.d_model),
            2 * config.vocab_size * config.d_model + config.d_model))
    tiny = ModelConfig.from_preset("tiny", vocab_size=53, context_length=16)
    lm = BasicsTransformerLM.from_config(tiny)
    assert lm.config == tiny
    assert lm.get_num_params(non_embedding=False) == tiny.num_params
    with pytest.raises(ValueError, match="unknown model size"):
        ModelConfig.from_preset("huge")
    with pytest.raises(TypeError, match="no field"):
        ModelConfig.from_preset("tiny", d_modle=8)
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=10, d_ff=8, num_layers=1, num_heads=3)
    with pytest.raises(ValueError, match="even"):
        ModelConfig(d_model=9, d_ff=8, num_layers=1, num_heads=3)
    with pytest.raises(TypeError, match="ModelConfig"):
        BasicsTransformerLM.from_config({"d_model": 8})


def test_forward_with_targets_is_the_mean_cross_entropy():
    torch.manual_seed(0)
    lm = small_lm()
    ids, targets = torch.randint(0, 37, (3, 11)), torch.randint(0, 37, (3, 11))
    logits = lm(ids)
    assert logits.shape == (3, 11, 37)
    expected = F.cross_entropy(logits.double().reshape(-1, 37), targets.reshape(-1))
    torch.testing.assert_close(lm(ids, targets).double(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shape of token_ids"):
        lm(ids, targets[:, :5])


def test_loss_gets_the_flat_hidden_states_and_the_heads_weight():
    seen = []

    def loss(hidden, weight, targets):  # the logits' cross-entropy, as a fused kernel computes it
        seen.append((hidden.shape, weight is lm.lm_head.weight, targets.shape))
        return F.cross_entropy(hidden @ weight.T, targets)

    torch.manual_seed(0)
    plain = small_lm()
    lm = small_lm(BlockKernels(loss=loss))
    lm.load_state_dict(plain.state_dict())
    ids, targets = torch.randint(0, 37, (3, 11)), torch.randint(0, 37, (3, 11))
    torch.testing.assert_close(lm(ids, targets), plain(ids, targets), atol=ATOL, rtol=RTOL)
    assert seen == [((33, 24), True, (33,))]
    torch.testing.assert_close(lm(ids), plain(ids))  # without targets: the logits, the loss not called
    assert len(seen) == 1


def _attention_pair(fused_qkv: bool = False, rotary=None) -> tuple[CausalMultiHeadSelfAttention,
                                                                   CausalMultiHeadSelfAttention]:
    """The same attention (same weights) without and with one qkv matmul or ``rotary``, in float64."""
    torch.manual_seed(0)
    plain = CausalMultiHeadSelfAttention(12, 3, RotaryEmbedding(16, 4),
                                         kernels=BlockKernels(attention=sdpa_attention)).double()
    other = CausalMultiHeadSelfAttention(12, 3, RotaryEmbedding(16, 4), fused_qkv=fused_qkv,
                                         kernels=BlockKernels(attention=sdpa_attention, rotary=rotary)).double()
    other.load_state_dict(plain.state_dict())
    return plain, other


def _outputs_and_grads(attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_()
    out = attn(x)
    out.backward(torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(5)))
    return out.detach(), [x.grad, *(p.grad for p in attn.parameters())]


def test_fused_qkv_matches_three_projections():
    plain, fused = _attention_pair(fused_qkv=True)
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in plain.named_parameters()]
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    out, grads = _outputs_and_grads(fused, x)
    want, want_grads = _outputs_and_grads(plain, x)
    torch.testing.assert_close(out, want)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)
    with pytest.raises(TypeError, match="fused_qkv must be a bool"):
        CausalMultiHeadSelfAttention(12, 3, None, fused_qkv=1)


def test_rotary_gets_the_projections_layout():
    seen = []

    def rotary(q, k, cos, sin, positions):  # RotaryEmbedding's formula (fp32 inside) on (B, T, H, Dh)
        seen.append((q.shape, q.is_contiguous(), k.is_contiguous(), cos.dtype, positions.tolist()))
        c, s = cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)  # (T, 1, Dh/2)

        def rotate(t):
            even, odd = t[..., 0::2].float(), t[..., 1::2].float()
            return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2).to(t.dtype)

        return rotate(q), rotate(k)

    plain, hooked = _attention_pair(rotary=rotary)
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    out, grads = _outputs_and_grads(hooked, x)
    want, want_grads = _outputs_and_grads(plain, x)
    # One call per forward, q and k together, as views of the projections' outputs (B, T, H, Dh), no copy made;
    # the tables are the encoder's (cast to float64 with the module here).
    assert seen == [((2, 7, 3, 4), True, True, torch.float64, list(range(7)))]
    torch.testing.assert_close(out, want)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_attention_reads_strided_views_of_the_projections():
    shapes = []

    def spy(q, k, v, is_causal):
        shapes.append((q.shape, v.transpose(1, 2).is_contiguous()))
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    attn = CausalMultiHeadSelfAttention(12, 3, RotaryEmbedding(16, 4), kernels=BlockKernels(attention=spy))
    attn(torch.randn(2, 7, 12))
    assert shapes == [((2, 3, 7, 4), True)]  # v is the (B, T, H, Dh) projection output, transposed in place


def test_swiglu_gate_is_an_argument():
    calls = []

    def gate(a, b):
        calls.append(a.shape)
        return F.silu(a) * b

    torch.manual_seed(0)
    plain = SwiGLU(6, 10)
    ffn = SwiGLU(6, 10, gate=gate)
    ffn.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(ffn(x), plain(x), atol=ATOL, rtol=RTOL)
    assert calls == [(2, 3, 10)]
