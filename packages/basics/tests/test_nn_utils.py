"""softmax, log_softmax, cross_entropy and clip_gradient against PyTorch."""

import pytest
import torch
import torch.nn.functional as F
from cs336_basics.nn_utils import clip_gradient, cross_entropy, log_softmax, softmax


def test_softmax_matches_torch_and_is_stable():
    x = torch.randn(4, 7, 13, dtype=torch.float64)
    torch.testing.assert_close(softmax(x, dim=-1), F.softmax(x, dim=-1))
    torch.testing.assert_close(softmax(x, dim=1), F.softmax(x, dim=1))
    big = torch.tensor([[1000.0, 1001.0, 999.0], [-1e4, 0.0, 1e4]])
    out = softmax(big)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.softmax(big.double(), dim=-1).float())
    torch.testing.assert_close(log_softmax(big), F.log_softmax(big.double(), dim=-1).float())


def test_cross_entropy_matches_torch_including_large_logits():
    logits = torch.randn(3, 5, 11, dtype=torch.float64) * 5
    targets = torch.randint(0, 11, (3, 5))
    torch.testing.assert_close(
        cross_entropy(logits, targets).double(),
        F.cross_entropy(logits.view(-1, 11), targets.view(-1)),
        atol=1e-6,
        rtol=1e-6,
    )
    huge = torch.tensor([[1e4, -1e4, 5e3], [3e4, 3e4, 0.0]])
    t = torch.tensor([2, 1])
    loss = cross_entropy(huge, t)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, F.cross_entropy(huge.double(), t).float())


def test_cross_entropy_gradient_matches_torch():
    a = torch.randn(6, 9, requires_grad=True)
    b = a.detach().clone().requires_grad_()
    t = torch.randint(0, 9, (6,))
    cross_entropy(a, t).backward()
    F.cross_entropy(b, t).backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_cross_entropy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="disagree"):
        cross_entropy(torch.randn(4, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="int"):
        cross_entropy(torch.randn(4, 5), torch.zeros(4))


def test_clip_gradient_matches_torch():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(3, 4), (7,), (2, 2, 2)]]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs, strict=True):
        g = torch.randn_like(p) * 3
        p.grad, q.grad = g.clone(), g.clone()
    frozen = torch.nn.Parameter(torch.randn(3))  # no grad: must be ignored
    norm = clip_gradient([*ps, frozen], max_norm=1.0)
    expected = torch.nn.utils.clip_grad_norm_(qs, max_norm=1.0)
    torch.testing.assert_close(norm, expected)
    for p, q in zip(ps, qs, strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    # Under the limit nothing changes.
    before = [p.grad.clone() for p in ps]
    clip_gradient(ps, max_norm=100.0)
    for p, b in zip(ps, before, strict=True):
        torch.testing.assert_close(p.grad, b)
