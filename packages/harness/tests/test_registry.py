"""The registry of named pieces: attention implementations agree with a float64 reference, forward and backward, and
plug into the model; every name is known once and an unknown one is refused."""

from __future__ import annotations

import math

import pytest
import torch
from cs336_basics.model import BasicsTransformerLM, BlockKernels
from cs336_harness import registry

RTOL, ATOL = 1e-5, 1e-5  # fp32 against a float64 reference


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v.double()


# "compiled" spends most of a minute in the CPU inductor compiler; it is the same math as "eager".
@pytest.mark.parametrize("name", ["eager", "annotated", "sdpa", pytest.param("compiled", marks=pytest.mark.slow)])
def test_impl_matches_reference(name: str) -> None:
    gen = torch.Generator().manual_seed(3)
    b, h, t, d = 2, 3, 13, 8
    q, k, v = (torch.randn(b, h, t, d, generator=gen, requires_grad=True) for _ in range(3))
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    out = registry.attention(name)(q, k, v, True)
    ref = _reference(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    grad_out = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out.double())
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.double(), r.double(), rtol=RTOL, atol=ATOL)


def test_model_takes_an_impl_by_callable() -> None:
    sizes = dict(vocab_size=37, context_length=9, d_model=24, num_layers=2, num_heads=3, d_ff=40)
    torch.manual_seed(0)
    model = BasicsTransformerLM(**sizes)
    annotated = BasicsTransformerLM(**sizes, kernels=BlockKernels(attention=registry.attention("annotated")))
    annotated.load_state_dict(model.state_dict())
    ids = torch.randint(0, 37, (2, 9))
    torch.testing.assert_close(annotated(ids), model(ids), rtol=RTOL, atol=ATOL)


def test_names_resolve_to_the_pieces_and_unknown_ones_are_refused() -> None:
    assert set(registry.ATTENTIONS) == {"eager", "annotated", "compiled", "sdpa", "triton"}
    assert set(registry.GLUES) == {"model", "triton", "compiled"}
    assert set(registry.LOSSES) == {"standard", "fused", "chunked"}
    assert set(registry.OPTIMIZERS) == {"adamw", "torch-adamw", "fused-adamw"}
    assert registry.BUDGET in registry.CHECKPOINT_KINDS and "selective" in registry.CHECKPOINT_KINDS
    assert registry.kernels() == BlockKernels()  # the defaults are the model's own code
    assert registry.kernels("sdpa", loss_name="chunked") == BlockKernels(attention=registry.attention("sdpa"),
                                                                          loss=registry.chunked_cross_entropy)
    assert registry.glue("model") == {}  # the model's own code: its defaults
    for glue in ("triton", "compiled"):
        assert sorted(registry.glue(glue)) == ["add_norm", "gate", "norm", "rotary"]
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = registry.optimizer("torch-adamw")(params, 0.5, 0.0)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 0.5
    for what, lookup in (("attention", registry.attention), ("glue", registry.glue), ("loss", registry.loss),
                         ("optimizer", registry.optimizer)):
        with pytest.raises(ValueError, match=f"{what} must be one of .*, got 'flash3'"):
            lookup("flash3")


def test_pieces_of_ones_own_get_names_the_commands_take(own_registry) -> None:
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)

    def sgd(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)

    registry.register_attention("mine", attention)
    registry.register_glue("my-norm", norm=norm)
    registry.register_loss("my-chunks", registry.chunked_cross_entropy)
    registry.register_optimizer("my-sgd", sgd)
    assert registry.kernels("mine", "my-norm", "my-chunks") == BlockKernels(
        attention=attention, norm=norm, loss=registry.chunked_cross_entropy)
    assert registry.optimizer("my-sgd") is sgd
    # The configs that name pieces take the names (the command line builds these).
    from cs336_harness.studies.leaderboard import LeaderboardConfig
    from cs336_harness.studies.step_timing import BenchConfig

    assert BenchConfig(attention="mine", optimizer="my-sgd", loss="my-chunks", device="cpu").train_config().kernels \
        == BlockKernels(attention=attention, loss=registry.chunked_cross_entropy)
    assert LeaderboardConfig(attention="mine", glue="my-norm", optimizer="my-sgd", backend="gloo",
                             compute_dtype="fp32").train_config().kernels.norm is norm

    with pytest.raises(ValueError, match="attention 'mine' is already registered"):
        registry.register_attention("mine", attention)
    for name in ("", "a,b", "my attention", 3):
        with pytest.raises(ValueError, match="loss name must be a non-empty string without commas or spaces"):
            registry.register_loss(name, registry.chunked_cross_entropy)
    with pytest.raises(TypeError, match="optimizer factory must be callable, got str"):
        registry.register_optimizer("adam", "adam")
    with pytest.raises(TypeError, match="glue gate must be callable, got int"):
        registry.register_glue("gate", gate=3)
    assert "adam" not in registry.OPTIMIZERS and "gate" not in registry.GLUES  # a refused piece is not registered
