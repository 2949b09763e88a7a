"""AdamW (Loshchilov and Hutter, 2019) and the cosine learning-rate schedule with linear warm-up.

The update follows ``torch.optim.AdamW`` exactly (decoupled decay ``p -= lr * wd * p`` first, then
``p -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)``), so the two are interchangeable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch


class AdamW(torch.optim.Optimizer):
    """AdamW with fp32 moments ``exp_avg`` and ``exp_avg_sq`` and an integer ``step`` per parameter."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"eps and weight_decay must be >= 0, got eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                g = p.grad.float()
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v / (1 - beta2**t)).sqrt_().add_(eps)
                update = m / denom
                if p.dtype == torch.float32:
                    p.mul_(1 - lr * wd).add_(update, alpha=-lr / (1 - beta1**t))
                else:
                    p.copy_(p.float().mul_(1 - lr * wd).add_(update, alpha=-lr / (1 - beta1**t)))
        return loss


def get_cosine_lr(
    it: int, max_learning_rate: float, min_learning_rate: float, warmup_iters: int, cosine_cycle_iters: int
) -> float:
    """Linear warm-up to ``max_learning_rate``, cosine decay to ``min_learning_rate`` at ``cosine_cycle_iters``."""
    if warmup_iters < 0 or cosine_cycle_iters < warmup_iters:
        raise ValueError(f"need 0 <= warmup_iters <= cosine_cycle_iters, got {warmup_iters}, {cosine_cycle_iters}")
    if it < warmup_iters:
        return max_learning_rate * it / warmup_iters
    if it > cosine_cycle_iters:
        return min_learning_rate
    progress = (it - warmup_iters) / max(1, cosine_cycle_iters - warmup_iters)
    return min_learning_rate + 0.5 * (1 + math.cos(math.pi * progress)) * (max_learning_rate - min_learning_rate)
