"""A user's own pieces, defined outside the packages, for test_training.py: an attention and an optimizer of its own,
and what each spawned rank of its two-rank data-parallel step runs.

It lives outside the test module because spawned ranks import their entry point and the pieces a config holds by
module name, which pytest's importlib mode does not give test modules (conftest.py puts this folder on
``sys.path``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from cs336_harness.train_config import TrainConfig
from cs336_harness.training import build_training, rank_batch

# Calls of own_attention in this process.
CALLS = {"attention": 0}


def own_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """Softmax attention written out over (batch, heads, seq, head_dim): no fused operator, so the ``attention``
    checkpointing policies keep nothing of it, and its (seq, seq) scores are what its memory plan must count."""
    CALLS["attention"] += 1
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def sgd(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """Plain SGD, as an optimizer factory of one's own: its update is ``lr`` times the gradient, so parameters after
    a step compare as the gradients do."""
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)


def data_parallel_step(rank: int, world_size: int, config: TrainConfig) -> dict:
    """One training step of ``config`` on this rank's share of its batch: rank 0's parameters after it, whether every
    rank holds the same ones, and how often this rank ran ``own_attention``."""
    cpu = torch.device("cpu")
    training = build_training(config, cpu)
    training.step(*rank_batch(config, rank, cpu))
    params = {name: p.detach().clone() for name, p in training.model.module.named_parameters()}
    sums = torch.stack([p.sum(dtype=torch.float64) for p in params.values()])
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return {"params": params, "in_sync": bool(torch.equal(low, high)), "attention_calls": CALLS["attention"]}
