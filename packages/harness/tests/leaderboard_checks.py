"""What each spawned rank runs for test_leaderboard.py: one leaderboard training step per config (ours on our FSDP,
the baselines on FSDP2), with the mean loss over ranks, every gradient before the update and every parameter after
it, gathered to full size.

It lives outside the test module because spawned ranks import their entry point by module name, which
pytest's importlib mode does not give test modules (the test puts this folder on ``sys.path``).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed as dist
from cs336_harness.studies.leaderboard import LeaderboardConfig
from cs336_harness.training import Training, build_training, rank_batch
from cs336_sharding.fsdp import FSDP
from torch.distributed.tensor import DTensor


def _full_grads(training: Training, shapes: dict[str, torch.Size], world_size: int) -> dict[str, torch.Tensor]:
    """Each parameter's averaged gradient at full size: a sharded one is this rank's zero-padded flat piece of
    the flattened weight, so the pieces of all ranks, concatenated and cut to the weight's size, are it."""
    grads = {}
    for name, p in training.model.module.named_parameters():
        grad = p.grad
        if p.shape != shapes[name]:
            pieces = [torch.empty_like(grad) for _ in range(world_size)]
            dist.all_gather(pieces, grad)
            grad = torch.cat(pieces)[: shapes[name].numel()].view(shapes[name])
        grads[name] = grad.cpu()
    return grads


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def _grads_and_params(training: Training, world_size: int) -> tuple:
    """(full gradients by name, a callable giving the full parameters by name), for our FSDP or FSDP2."""
    if isinstance(training.model, FSDP):
        shapes = {n: p.shape for n, p in training.model.gather_full_params().items()}
        return (lambda: _full_grads(training, shapes, world_size),
                lambda: {name: p.cpu() for name, p in training.model.gather_full_params().items()})
    params = dict(training.model.named_parameters())
    return (lambda: {name: _full(p.grad) for name, p in params.items()},
            lambda: {name: _full(p) for name, p in params.items()})


def one_step_each(rank: int, world_size: int, configs: list[LeaderboardConfig], out_dir: str) -> None:
    """Per config: the mean loss over ranks of one step and the full parameters after it (pickled by rank 0)."""
    device = torch.device("cuda", rank) if configs[0].resolved_backend == "nccl" else torch.device("cpu")
    records = []
    for config in configs:
        train = config.train_config()
        training = build_training(train, device)
        inputs, targets = rank_batch(train, rank, device)
        full_grads, full_params = _grads_and_params(training, world_size)
        loss = training.forward_backward(inputs, targets).float().reshape(1)
        grads = full_grads()
        training.optimizer.step()
        dist.all_reduce(loss)  # gloo has no AVG
        records.append({"loss": loss.item() / world_size, "grads": grads, "params": full_params(),
                        "checkpoint": str(training.policy)})
    if rank == 0:
        (Path(out_dir) / "records.pkl").write_bytes(pickle.dumps(records))
