"""Numerically stable softmax, log-softmax and cross-entropy, and global-norm gradient clipping."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along ``dim``; subtracting the max first keeps ``exp`` from overflowing."""
    shifted = x - x.amax(dim=dim, keepdim=True)
    e = shifted.exp()
    return e / e.sum(dim=dim, keepdim=True)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Log-softmax along ``dim`` as ``x - max - log(sum(exp(x - max)))``."""
    shifted = x - x.amax(dim=dim, keepdim=True)
    return shifted - shifted.exp().sum(dim=dim, keepdim=True).log()


def cross_entropy(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of ``targets`` (...) under logits ``inputs`` (..., vocab), in fp32.

    Raises:
        ValueError: if the leading shapes differ or a target lies outside [0, vocab).
    """
    if inputs.shape[:-1] != targets.shape:
        raise ValueError(
            f"inputs (..., vocab) and targets (...) disagree: {tuple(inputs.shape)} vs {tuple(targets.shape)}"
        )
    if targets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"targets must be int32 or int64, got {targets.dtype}")
    if torch.are_deterministic_algorithms_enabled() and inputs.dim() > 1:
        # One example at a time, so the row sums' kernels cannot depend on the batch size (a CUDA row sum
        # over fewer than 16 rows splits each row differently): see cs336_basics.deterministic.
        logp = torch.stack([log_softmax(x.float(), dim=-1) for x in inputs])
    else:
        logp = log_softmax(inputs.float(), dim=-1)  # (..., V)
    return -logp.gather(-1, targets.long().unsqueeze(-1)).mean()


def clip_gradient(parameters: Iterable[torch.nn.Parameter], max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients in place so their joint L2 norm is at most ``max_norm``; returns the norm before."""
    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    scale = torch.clamp(max_norm / (total + eps), max=1.0)  # no host sync: scale by 1 when under the limit
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return total
