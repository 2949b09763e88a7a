"""What each spawned rank runs for test_ddp.py: toy models, the single-process reference, and the checks.

It lives outside the test module because spawned ranks unpickle the entry point by module name,
and pytest's importlib mode gives test modules names the ranks cannot import (conftest.py puts this
folder on ``sys.path``, which spawn passes on to the ranks).

Why exact equality holds: with two ranks each gradient is ``g0/2 + g1/2`` (halving is exact and a
sum of two is order-free), and the single-process reference computes each shard's gradient with
the same operations, then combines them the same way. The reference itself is checked against
plain full-batch training with a tolerance, so it cannot drift from what "the larger batch" means.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from cs336_comms.collectives import benchmark_collectives
from cs336_comms.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP
from cs336_comms.reduce import tree_all_reduce, tree_reduce_scatter

WORLD_SIZE = 2
INIT_SEED = 100  # rank r initialises with INIT_SEED + r; the wrappers must make every rank hold rank 0's
STEPS = 4
BUCKET_CAP_FLOATS = 50

# The toy model has a parameter no rank uses and one only rank 0 uses: the wrappers count who had a gradient.
VARIANTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "naive": lambda m: NaiveDDP(m, find_unused_parameters=True),
    "flat": lambda m: FlatDDP(m, find_unused_parameters=True),
    "overlapped": lambda m: OverlappedDDP(m, find_unused_parameters=True),
    # A 50-float cap so the toy models span several buckets, some holding several tensors (see
    # test_buckets_close_once_they_reach_the_cap).
    "bucketed": lambda m: BucketedDDP(m, bucket_size_mb=BUCKET_CAP_FLOATS * 4 / 2**20, find_unused_parameters=True),
}


class ToyModel(nn.Module):
    """Two linear layers, a frozen scale, a buffer, a parameter no step uses and one that only
    shard 0 uses (so gradients are missing on some ranks and on all ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 11)
        self.fc2 = nn.Linear(11, 5)
        self.scale = nn.Parameter(torch.rand(11) + 0.5, requires_grad=False)
        self.extra = nn.Parameter(torch.randn(5))
        self.unused = nn.Parameter(torch.randn(3, 2))
        self.register_buffer("shift", torch.randn(11))

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = F.gelu(self.fc1(x) * self.scale + self.shift)
        out = self.fc2(h)
        return out + self.extra if use_extra else out


class TiedModel(nn.Module):
    """Embedding whose weight is also the output projection (one shared parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 17, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(x))))


def _batches(kind: str, num_steps: int, num_micro: int) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """batches[step][rank][micro] = (inputs, targets), identical on every rank; 3 examples each."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(num_steps):
        per_rank = []
        for _ in range(WORLD_SIZE):
            micro = []
            for _ in range(num_micro):
                if kind == "toy":
                    micro.append((torch.randn(3, 13, generator=g), torch.randint(0, 5, (3,), generator=g)))
                else:
                    micro.append((torch.randint(0, 17, (3, 7), generator=g), torch.randint(0, 17, (3, 7), generator=g)))
            per_rank.append(micro)
        out.append(per_rank)
    return out


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, use_extra: bool) -> torch.Tensor:
    logits = model(x, use_extra=use_extra)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def new_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return ToyModel() if kind == "toy" else TiedModel()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Weight decay makes a zero gradient differ from a missing one, so those cases are visible.
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def _reference(kind: str, batches: list, num_micro: int) -> dict[str, torch.Tensor]:
    """Single process: each shard's gradient as a rank computes it, then ``sum(g / world_size)``."""
    model = new_model(kind, seed=INIT_SEED)  # rank 0's initialisation, which the wrappers broadcast
    opt = _optimizer(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for step in batches:
        shard_grads = []
        for r, micro in enumerate(step):
            model.zero_grad(set_to_none=True)
            for x, y in micro:
                (_loss(model, x, y, use_extra=r == 0) / num_micro).backward()
            shard_grads.append([None if p.grad is None else p.grad.clone() for p in params])
        for i, p in enumerate(params):
            grads = [g[i] for g in shard_grads]
            if all(g is None for g in grads):
                p.grad = None
                continue
            total = None
            for g in grads:
                part = (torch.zeros_like(p) if g is None else g).div(WORLD_SIZE)
                total = part if total is None else total + part
            p.grad = total
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _full_batch(kind: str, batches: list) -> dict[str, torch.Tensor]:
    """Plain single-process training on the concatenated global batch (rank 0's shard uses ``extra``)."""
    model = new_model(kind, seed=INIT_SEED)
    opt = _optimizer(model)
    for step in batches:
        model.zero_grad(set_to_none=True)
        losses = [_loss(model, x, y, use_extra=r == 0) for r, micro in enumerate(step) for x, y in micro]
        (sum(losses) / len(losses)).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _train_ddp(variant: str, kind: str, rank: int, batches: list, num_micro: int) -> dict[str, torch.Tensor]:
    model = new_model(kind, seed=INIT_SEED + rank)  # different on each rank: the wrapper must broadcast
    ddp = VARIANTS[variant](model)
    opt = _optimizer(model)
    for step in batches:
        micro = step[rank]
        opt.zero_grad(set_to_none=True)
        with ddp.no_sync():
            for x, y in micro[:-1]:
                (_loss(ddp, x, y, use_extra=rank == 0) / num_micro).backward()
        x, y = micro[-1]
        (_loss(ddp, x, y, use_extra=rank == 0) / num_micro).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    return {k.removeprefix("module."): v.clone() for k, v in ddp.state_dict().items()}


def _mismatch_error(rank: int) -> str | None:
    model = nn.Sequential(nn.Linear(4, 5 + rank))
    try:
        NaiveDDP(model)
    except ValueError as e:
        return str(e)
    return None


def _double_backward_error(rank: int) -> str | None:
    ddp = OverlappedDDP(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    ddp(x).sum().backward()
    try:
        ddp(x).sum().backward()
    except RuntimeError as e:
        return str(e)
    finally:
        ddp.finish_gradient_synchronization()
    return None


def _freed_with_wrapper() -> dict[str, bool]:
    """Per variant: whether a trained model's memory is freed once the wrapper and the model are dropped
    (hooks that held the wrapper strongly kept the whole model and its gradients alive)."""
    freed = {}
    for variant, cls in VARIANTS.items():
        model = ToyModel()
        ddp = cls(model)
        _loss(ddp, *_batches("toy", 1, 1)[0][0][0], use_extra=True).backward()
        ddp.finish_gradient_synchronization()
        alive = weakref.ref(model.fc1.weight)
        del ddp, model
        gc.collect()
        freed[variant] = alive() is None
    return freed


def _bucket_layout() -> list[list[str]]:
    """BucketedDDP's buckets (parameter names) for the toy model, as the training checks build it."""
    model = ToyModel()
    names = {p: n for n, p in model.named_parameters()}
    ddp = VARIANTS["bucketed"](model)
    return [[names[p] for p in b.params] for b in ddp._buckets]


def _tree_reductions(rank: int) -> dict[str, list[float]]:
    """cs336_comms.reduce on rank-dependent inputs: rank r all-reduces [r + 1, 10 (r + 1)] and reduce-scatters
    [r + 1, 2 (r + 1), 3 (r + 1), 4 (r + 1)] (two elements per destination rank)."""
    reduced = torch.tensor([1.0, 10.0]) * (rank + 1)
    tree_all_reduce(reduced).wait()
    scattered = torch.empty(2)
    tree_reduce_scatter(scattered, torch.tensor([1.0, 2.0, 3.0, 4.0]) * (rank + 1)).wait()
    try:
        tree_reduce_scatter(torch.empty(3), torch.empty(4))
    except ValueError as e:
        size_error = str(e)
    return {"all_reduce": reduced.tolist(), "reduce_scatter": scattered.tolist(), "size_error": size_error}


def _default_unused(rank: int) -> dict:
    """Without find_unused_parameters: the collectives one step issues (no flag all-reduce), and the gradients of
    a parameter no rank uses (zero, not None) and of one only rank 0 uses (the average of its gradient and zero)."""
    model = new_model("toy", seed=INIT_SEED)
    ddp = NaiveDDP(model)
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(args[0].numel())
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        x, y = _batches("toy", 1, 1)[0][rank][0]
        _loss(ddp, x, y, use_extra=rank == 0).backward()
        ddp.finish_gradient_synchronization()
    finally:
        dist.all_reduce = original
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"all_reduces": len(calls), "trainable": len(trainable), "unused_grad": model.unused.grad.clone(),
            "extra_grad": model.extra.grad.clone()}


def all_checks(rank: int, world_size: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # the same kernels and reduction order in the ranks and the reference
    record: dict = {"train": {}, "reference_vs_full": {}}
    for kind in ("toy", "tied"):
        for num_micro in (1, 2):
            batches = _batches(kind, STEPS, num_micro)
            ref = _reference(kind, batches, num_micro)
            full = _full_batch(kind, batches)
            record["reference_vs_full"][kind, num_micro] = (ref, full)
            for variant in VARIANTS:
                record["train"][variant, kind, num_micro] = (_train_ddp(variant, kind, rank, batches, num_micro), ref)
    record["buckets"] = _bucket_layout()
    record["freed"] = _freed_with_wrapper()
    record["mismatch"] = _mismatch_error(rank)
    record["double_backward"] = _double_backward_error(rank)
    record["collectives"] = benchmark_collectives(sizes_bytes=[4096, 40_000], warmup=1, iters=3)
    record["tree"] = _tree_reductions(rank)
    record["default_unused"] = _default_unused(rank)
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(record, f)
    dist.barrier()


def rank_one_killed(rank: int, world_size: int) -> None:
    """Rank 1 is killed as the kernel's out-of-memory killer would kill it; rank 0 waits for it at a barrier."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def rank_one_stops(rank: int, world_size: int) -> None:
    """Rank 1 stops (SIGSTOP), as a hung or swapped-out process would; rank 0 waits for it at a barrier."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier()


def parent_pid(rank: int, world_size: int) -> int:
    """The process this rank was started by: the spawning process, or the fork server under spawn's ``preload``."""
    return os.getppid()
