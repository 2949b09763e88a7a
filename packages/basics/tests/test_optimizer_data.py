"""AdamW against torch.optim.AdamW, the cosine schedule, and get_batch."""

import math

import numpy as np
import pytest
import torch
from cs336_basics.data import get_batch
from cs336_basics.optimizer import AdamW, get_cosine_lr


def _train(opt_cls, steps: int = 8, **kw) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    groups = [
        {"params": model[0].parameters()},
        {"params": model[2].parameters(), "lr": 3e-3, "weight_decay": 0.1},
    ]
    opt = opt_cls(groups, **kw)
    for _ in range(steps):
        x = torch.randn(5, 7)
        loss = model(x).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_adamw_matches_torch():
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    ours = _train(AdamW, **kw)
    theirs = _train(torch.optim.AdamW, **kw)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    initial = _train(AdamW, steps=0, **kw)
    assert any(not torch.allclose(a, b) for a, b in zip(ours, initial, strict=True))


def test_adamw_rejects_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.randn(2))]
    with pytest.raises(ValueError, match="lr"):
        AdamW(p, lr=-1)
    with pytest.raises(ValueError, match="betas"):
        AdamW(p, betas=(0.9, 1.0))


def test_cosine_schedule():
    kw = dict(max_learning_rate=1.0, min_learning_rate=0.1, warmup_iters=10, cosine_cycle_iters=30)
    assert get_cosine_lr(0, **kw) == 0.0
    assert get_cosine_lr(5, **kw) == pytest.approx(0.5)
    assert get_cosine_lr(10, **kw) == pytest.approx(1.0)
    assert get_cosine_lr(20, **kw) == pytest.approx(0.1 + 0.5 * 0.9 * (1 + math.cos(math.pi / 2)))
    assert get_cosine_lr(30, **kw) == pytest.approx(0.1)
    assert get_cosine_lr(100, **kw) == pytest.approx(0.1)


def test_get_batch_windows_are_consecutive(tmp_path):
    data = np.arange(1000, dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    data.tofile(path)
    mm = np.memmap(path, dtype=np.uint16, mode="r")
    x, y = get_batch(mm, batch_size=6, context_length=17, device="cpu")
    assert x.shape == y.shape == (6, 17) and x.dtype == torch.int64
    torch.testing.assert_close(y, x + 1)
    torch.testing.assert_close(x[:, 1:], x[:, :-1] + 1)
    assert int(x.min()) >= 0 and int(y.max()) <= 999


def test_get_batch_rejects_bad_input():
    with pytest.raises(ValueError, match="1-D"):
        get_batch(np.zeros((4, 4)), 2, 2, "cpu")
    with pytest.raises(ValueError, match="too short"):
        get_batch(np.arange(5), 2, 5, "cpu")
