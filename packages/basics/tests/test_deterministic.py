"""Deterministic-mode layers: float64 references, batch invariance and the tree order, routing, bad input."""

from __future__ import annotations

import pytest
import torch
from cs336_basics import deterministic, model
from cs336_basics.model import BasicsTransformerLM, Embedding, Linear, RMSNorm
from cs336_basics.nn_utils import cross_entropy


@pytest.fixture
def deterministic_mode():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that starts 4 bytes into its storage, as a shard of a flat buffer may."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    return out.copy_(t)


def _tree(parts: list[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    mid = len(parts) // 2
    return _tree(parts[:mid]) + _tree(parts[mid:])


def _layers() -> dict[str, tuple]:
    """name -> (function of (input, weight), input, weight); odd sizes, batch of 8."""
    return {
        "linear": (deterministic.linear, torch.randn(8, 5, 7), torch.randn(3, 7)),
        "linear_rows": (deterministic.linear, torch.randn(8, 7), torch.randn(3, 7)),
        "embedding": (deterministic.embedding, torch.randint(0, 11, (8, 5)), torch.randn(11, 6)),
        "rms_norm": (lambda x, w: deterministic.rms_norm(x, w, 1e-5), torch.randn(8, 5, 7), torch.randn(7)),
    }


def _reference(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The plain formula, for float64 inputs."""
    if name.startswith("linear"):
        return x @ w.T
    if name == "embedding":
        return w[x]
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _forward_backward(fn, x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_(x.is_floating_point())
    w = w.detach().requires_grad_()
    out = fn(x, w)
    out.backward(grad)
    return out.detach(), (x.grad if x.is_floating_point() else None), w.grad


@pytest.mark.parametrize("name", list(_layers()))
def test_matches_float64_reference_and_finite_differences(name: str) -> None:
    fn, x, w = _layers()[name]
    x64 = x.double().requires_grad_() if x.is_floating_point() else x
    w64 = w.double().requires_grad_()
    torch.autograd.gradcheck(fn, (x64, w64))
    grad = torch.randn_like(_reference(name, x64.detach(), w64.detach()))
    got = _forward_backward(fn, x64, w64, grad)
    want = _forward_backward(lambda a, b: _reference(name, a, b), x64, w64, grad)
    for g, r in zip(got, want, strict=True):
        if r is not None:
            torch.testing.assert_close(g, r)
    # fp32 against the float64 reference of the same inputs, at fp32's tolerance.
    torch.testing.assert_close(fn(x, w), _reference(name, x64.detach(), w64.detach()).float())


@pytest.mark.parametrize("num_shards", [2, 4])
@pytest.mark.parametrize("name", list(_layers()))
def test_shards_reproduce_the_whole_batch_bit_for_bit(name: str, num_shards: int) -> None:
    # The property data parallelism relies on: each example's outputs and input gradients do not depend on the
    # batch around it, and the whole batch's weight gradient is the midpoint tree over the shards' ones, even
    # when a shard or the weight sits at a misaligned address.
    fn, x, w = _layers()[name]
    grad = torch.randn_like(fn(x, w))
    full_out, full_gx, full_gw = _forward_backward(fn, x, w, grad)
    m = x.shape[0] // num_shards
    shard_gw = []
    for r in range(num_shards):
        rows = slice(r * m, (r + 1) * m)
        for xs, ws in ((x[rows].clone(), w), (_misaligned(x[rows]), _misaligned(w))):
            out, gx, gw = _forward_backward(fn, xs, ws, grad[rows])
            assert torch.equal(out, full_out[rows])
            if gx is not None:
                assert torch.equal(gx, full_gx[rows])
        shard_gw.append(gw)
    assert torch.equal(full_gw, _tree(shard_gw))


def test_cross_entropy_gradient_scales_exactly_with_the_batch(deterministic_mode) -> None:
    # A shard's mean loss gives each example 4x (a power of two) the whole batch's gradient, bit for bit.
    logits = torch.randn(8, 5, 37, requires_grad=True)
    targets = torch.randint(0, 37, (8, 5))
    cross_entropy(logits, targets).backward()
    shard = logits.detach()[:2].clone().requires_grad_()
    cross_entropy(shard, targets[:2]).backward()
    assert torch.equal(shard.grad, logits.grad[:2] * 4)
    with torch.no_grad():
        torch.use_deterministic_algorithms(False)
        plain = cross_entropy(logits, targets)
        torch.use_deterministic_algorithms(True)
        torch.testing.assert_close(cross_entropy(logits, targets), plain)


def _lm() -> BasicsTransformerLM:
    torch.manual_seed(0)
    return BasicsTransformerLM(37, context_length=16, d_model=18, num_layers=2, num_heads=3, d_ff=23)


def test_layers_route_to_the_deterministic_functions_only_in_deterministic_mode(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("called outside deterministic mode")

    lm = _lm()
    ids = torch.randint(0, 37, (4, 16))
    for name in ("linear", "embedding", "rms_norm"):
        monkeypatch.setattr(deterministic, name, refuse)
    cross_entropy(lm(ids), ids).backward()  # the ordinary path calls none of them
    for layer, arg in ((Linear(7, 3), torch.randn(2, 7)), (Embedding(5, 3), torch.tensor([[1, 2]])),
                       (RMSNorm(7), torch.randn(2, 7))):
        torch.use_deterministic_algorithms(True)
        try:
            with pytest.raises(AssertionError, match="outside deterministic mode"):
                layer(arg)
        finally:
            torch.use_deterministic_algorithms(False)


def test_deterministic_lm_matches_the_ordinary_one(deterministic_mode) -> None:
    lm = _lm()
    ids = torch.randint(0, 37, (4, 16))
    loss = cross_entropy(lm(ids), ids)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad()
    torch.use_deterministic_algorithms(False)
    plain = cross_entropy(lm(ids), ids)
    plain.backward()
    torch.testing.assert_close(loss, plain)
    for n, p in lm.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)


def test_deterministic_lm_under_bf16_autocast(deterministic_mode) -> None:
    lm = _lm()
    ids = torch.randint(0, 37, (4, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = lm(ids)
    assert logits.dtype == torch.bfloat16
    cross_entropy(logits, ids).backward()
    for n, p in lm.named_parameters():
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), n


def test_single_vectors_take_the_ordinary_path(deterministic_mode, monkeypatch) -> None:
    monkeypatch.setattr(deterministic, "linear", None)  # a call would fail
    layer = model.Linear(7, 3)
    x = torch.randn(7)
    torch.testing.assert_close(layer(x), layer.weight @ x)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"got \(2, 5\) and \(3, 7\)"):
        deterministic.linear(torch.randn(2, 5), torch.randn(3, 7))
    with pytest.raises(ValueError, match="non-empty leading batch"):
        deterministic.linear(torch.randn(0, 7), torch.randn(3, 7))
    with pytest.raises(TypeError, match="int32 or int64, got torch.float32"):
        deterministic.embedding(torch.zeros(2, 3), torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"\(vocab, d_model\) weight"):
        deterministic.embedding(torch.zeros(2, 3, dtype=torch.long), torch.randn(5))
    with pytest.raises(ValueError, match=r"got \(2, 7\) and \(6,\)"):
        deterministic.rms_norm(torch.randn(2, 7), torch.randn(6), 1e-5)
