"""What each spawned rank runs for test_determinism.py: data-parallel training against true full-batch training.

In deterministic mode (``torch.use_deterministic_algorithms(True)``) FSDP, ZeRO-1 over DDP gradients and the
DDP wrappers must leave fp32 parameters bit-identical to one process training on the whole batch, after every
step, when the global batch is split into equal contiguous rank shards (cs336_basics.deterministic says why).
Every rank trains each wrapper on its shard and, in the same process and with the same threads, the plain
model on the whole batch; the tests compare the two with ``torch.equal``.

It lives outside the test module because spawned ranks unpickle the entry point by module name (conftest.py
puts this folder on ``sys.path``, which spawn passes on to the ranks).

Shapes: on CPU an elementwise kernel computes a tensor's last ``n mod 16`` elements (AVX2) with scalar code,
and ``torch.sigmoid``'s scalar code rounds differently from its vector code; so the Transformer's per-example
activation sizes (``SEQ * d``) are multiples of 16, or SwiGLU's sigmoid would depend on where an example sits.
Parameter sizes are odd wherever the model allows, so FSDP pads its shards.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import adapters
import cs336_basics.deterministic
import cs336_comms.ddp
import cs336_sharding.fsdp
import torch
import torch.distributed as dist
import torch.nn as nn
from cs336_basics.model import BasicsTransformerLM, Embedding, Linear, RMSNorm
from cs336_basics.nn_utils import cross_entropy
from cs336_basics.optimizer import AdamW
from cs336_comms.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP
from cs336_comms.reduce import tree_all_reduce, tree_reduce_scatter
from cs336_kernels import FusedAdamW
from cs336_sharding.optimizer import ShardedOptimizer

STEPS = 3
SEQ = 16


class CourseToy(nn.Module):
    """The course's FSDP test model: vocab 100, d_model 64, d_ff 128; its loss reads the last position."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = Embedding(100, 64)
        self.norm = RMSNorm(64)
        self.linear1 = Linear(64, 128)
        self.linear2 = Linear(128, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear2(torch.relu(self.linear1(self.norm(self.embedding(ids)))))


class OddToy(nn.Module):
    """Every weight has an odd number of elements, so FSDP pads every shard at any world size."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = Embedding(37, 15)
        self.norm1 = RMSNorm(15)
        self.up = Linear(15, 23)
        self.norm2 = RMSNorm(23)
        self.down = Linear(23, 37)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm2(torch.relu(self.up(self.norm1(self.embedding(ids))))))


class TiedToy(nn.Module):
    """An LM head tied to the embedding: FSDP reduce-scatters each use's gradient and adds them in finish."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = Embedding(37, 15)
        self.norm = RMSNorm(15)
        self.up = Linear(15, 23)
        self.down = Linear(23, 15)
        self.lm_head = Linear(15, 37)
        self.lm_head.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.down(torch.relu(self.up(self.norm(self.embedding(ids))))))


# name -> (model factory, vocab, global batch of sequences, whether the loss reads only the last position)
MODELS: dict[str, tuple[Callable[[], nn.Module], int, int, bool]] = {
    "course": (CourseToy, 100, 20, True),
    "odd": (OddToy, 37, 8, False),
    "tied": (TiedToy, 37, 8, False),
    # d_model 18 and d_ff 23: the embedding, head and FFN weights need padding on four ranks.
    "lm": (lambda: BasicsTransformerLM(37, SEQ, d_model=18, num_layers=2, num_heads=3, d_ff=23), 37, 8, False),
}
COURSE_SEQ = 8  # the course model's ids are (20, 8)

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.01}),
    "basics_adamw": (AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "torch_adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "fused_adamw": (FusedAdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}

DDP_WRAPPERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    # A 4 KiB cap, so every model spans several buckets and some hold several gradients.
    "bucketed": lambda m: BucketedDDP(m, bucket_size_mb=4 / 1024),
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlapped": OverlappedDDP,
}

DDP_CLASSES = {"bucketed": BucketedDDP, "naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP}

# (wrapper, model, optimizer) trained on every world size. FusedAdamW runs in the Triton interpreter on CPU,
# seconds per step, so only on the smallest model there. The tied model runs under FSDP only: DDP reduces the
# sum of a tied weight's uses, which is not the whole batch's order (cs336_basics.deterministic, Limits).
UNTIED = ("course", "odd", "lm")
RUNS = (
    [(w, k, o) for w in ("fsdp", "zero1") for k in UNTIED for o in ("sgd", "basics_adamw", "torch_adamw")]
    + [("fsdp", "tied", o) for o in ("sgd", "torch_adamw")]
    + [(w, "odd", "fused_adamw") for w in ("fsdp", "zero1")]
    + [("bucketed", k, "sgd") for k in UNTIED]
    + [("bucketed", "lm", "torch_adamw")]
    + [(w, "lm", "sgd") for w in ("naive", "flat", "overlapped")]
)
# The quick run's share of RUNS: every wrapper, model and optimizer at least once.
QUICK_RUNS = [("fsdp", "tied", "torch_adamw"), ("fsdp", "course", "basics_adamw"), ("zero1", "odd", "fused_adamw"),
              ("bucketed", "lm", "sgd"), ("naive", "lm", "sgd"), ("flat", "lm", "sgd"), ("overlapped", "lm", "sgd")]
GPU_RUNS = [(w, k, o) for w in ("fsdp", "zero1", "bucketed") for k in UNTIED for o in ("sgd", "fused_adamw")]
GPU_RUNS += [("fsdp", "tied", "sgd")]


def new_model(kind: str, seed: int, device: torch.device) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind][0]().to(device)


def batches(kind: str, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch, shuffled anew for each step (identical on every rank)."""
    _, vocab, batch, last_only = MODELS[kind]
    g = torch.Generator().manual_seed(1234)
    seq = COURSE_SEQ if kind == "course" else SEQ
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch,) if last_only else (batch, seq), generator=g)
    out = []
    for _ in range(STEPS):
        order = torch.randperm(batch, generator=g)
        out.append((ids[order].to(device), targets[order].to(device)))
    return out


def loss_of(kind: str, model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return cross_entropy(logits[:, -1] if MODELS[kind][3] else logits, targets)


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = t.shape[0] // world_size
    return t[rank * per_rank : (rank + 1) * per_rank]


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def full_batch(kind: str, optimizer: str, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Plain single-process training on the whole batch: the parameters after each step."""
    model = new_model(kind, seed=0, device=device)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kwargs)
    out = []
    for ids, targets in batches(kind, device):
        opt.zero_grad(set_to_none=True)
        loss_of(kind, model, ids, targets).backward()
        opt.step()
        out.append(params_of(model))
    return out


def data_parallel(wrapper: str, kind: str, optimizer: str, rank: int, world_size: int,
                  device: torch.device, group: dist.ProcessGroup | None = None) -> list[dict[str, torch.Tensor]]:
    """``wrapper`` training on this rank's contiguous shard: the full parameters after each step. With a
    ``group``, ``rank`` and ``world_size`` are this process's place in it, and the wrappers are built over it."""
    model = new_model(kind, seed=rank, device=device)  # ranks differ: the wrapper must broadcast rank 0's
    cls, kwargs = OPTIMIZERS[optimizer]
    if wrapper == "fsdp":
        wrapped = adapters.get_fsdp(model) if group is None else cs336_sharding.fsdp.FSDP(model, process_group=group)
        opt = cls(wrapped.parameters(), **kwargs)
    elif wrapper == "zero1":
        wrapped = BucketedDDP(model, bucket_size_mb=4 / 1024, process_group=group)
        opt = ShardedOptimizer(model.parameters(), cls, process_group=group, **kwargs)
    else:
        wrapped = DDP_WRAPPERS[wrapper](model) if group is None else DDP_CLASSES[wrapper](model, process_group=group)
        opt = cls(model.parameters(), **kwargs)
    out = []
    for ids, targets in batches(kind, device):
        opt.zero_grad(set_to_none=True)
        loss_of(kind, wrapped, shard(ids, rank, world_size), shard(targets, rank, world_size)).backward()
        if wrapper == "fsdp":
            adapters.fsdp_on_after_backward(wrapped, opt)
        else:
            wrapped.finish_gradient_synchronization()
        opt.step()
        if wrapper == "fsdp":
            out.append({n: p.cpu() for n, p in adapters.fsdp_gather_full_params(wrapped).items()})
        else:
            out.append(params_of(model))
    return out


@contextlib.contextmanager
def deterministic_mode(enabled: bool) -> Iterator[None]:
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def count_deterministic_calls(rank: int, world_size: int, device: torch.device) -> dict[str, int]:
    """Calls of every deterministic-mode function during one FSDP and one BucketedDDP step of the Transformer."""
    targets = [(cs336_basics.deterministic, "linear"), (cs336_basics.deterministic, "embedding"),
               (cs336_basics.deterministic, "rms_norm"), (cs336_comms.ddp, "tree_all_reduce"),
               (cs336_sharding.fsdp, "tree_all_reduce"), (cs336_sharding.fsdp, "tree_reduce_scatter")]
    counts = {f"{m.__name__}.{name}": 0 for m, name in targets}
    originals = [getattr(m, name) for m, name in targets]

    def counting(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    try:
        for (m, name), fn in zip(targets, originals, strict=True):
            setattr(m, name, counting(f"{m.__name__}.{name}", fn))
        for wrapper in ("fsdp", "bucketed"):
            data_parallel(wrapper, "lm", "sgd", rank, world_size, device)
    finally:
        for (m, name), fn in zip(targets, originals, strict=True):
            setattr(m, name, fn)
    return counts


def tree_order(rank: int, world_size: int, device: torch.device) -> dict[str, list[float]]:
    """Sums of 1, 2^-24, 2^-24, -1 (one value per rank, rank order): ``((1 + e) + (e - 1)) = e`` in tree order,
    while a sum from the left gives 0."""
    e = 2.0**-24
    value = [1.0, e, e, -1.0][rank]
    reduced = torch.full((3,), value, device=device)
    tree_all_reduce(reduced).wait()
    scattered = torch.empty(2, device=device)
    tree_reduce_scatter(scattered, torch.full((2 * world_size,), value, device=device)).wait()
    return {"all_reduce": reduced.tolist(), "reduce_scatter": scattered.tolist()}


PAIR_RUNS = [("fsdp", "odd", "torch_adamw"), ("zero1", "course", "basics_adamw"), ("bucketed", "lm", "sgd")]


def pairs(rank: int, device: torch.device) -> dict[tuple[str, str, str], list[dict[str, torch.Tensor]]]:
    """Four ranks as two independent pairs, {0, 1} and {2, 3}, each a process group training the whole batch on
    its own: every wrapper's collectives stay inside its group, so each pair equals full-batch training."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in one order
    group = groups[rank // 2]
    return {run: data_parallel(*run, rank % 2, 2, device, group=group) for run in PAIR_RUNS}


def run_checks(rank: int, world_size: int, out_dir: str, runs: list, device: torch.device, others: bool) -> None:
    """Every run of ``runs`` against full-batch training; with ``others`` (on 4 ranks), the checks that are not such
    a run: the deterministic functions called, the tree order of sums, pairs of ranks, the ordinary mode."""
    torch.set_num_threads(1)  # the same kernels in the ranks and the full-batch runs
    record: dict[str, Any] = {"runs": {}, "full_batch": {}}
    with deterministic_mode(True):
        # What the runs and the pairs are compared with, once per (model, optimizer).
        for kind, optimizer in dict.fromkeys(run[1:] for run in runs + (PAIR_RUNS if others else [])):
            record["full_batch"][kind, optimizer] = full_batch(kind, optimizer, device)
        for wrapper, kind, optimizer in runs:
            record["runs"][wrapper, kind, optimizer] = data_parallel(wrapper, kind, optimizer, rank, world_size, device)
        if others:
            record["calls_deterministic"] = count_deterministic_calls(rank, world_size, device)
            record["tree_order"] = tree_order(rank, world_size, device)
            record["pairs"] = pairs(rank, device)
    if others:
        # The failing case, run without deterministic mode: shows the comparison sees summation order.
        with deterministic_mode(False):
            record["plain"] = (data_parallel("fsdp", "course", "sgd", rank, world_size, device),
                               full_batch("course", "sgd", device))
            record["calls_plain"] = count_deterministic_calls(rank, world_size, device)
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(record, f)
    dist.barrier()


def quick_checks(rank: int, world_size: int, out_dir: str) -> None:
    run_checks(rank, world_size, out_dir, QUICK_RUNS, torch.device("cpu"), others=True)


def cpu_checks(rank: int, world_size: int, out_dir: str) -> None:
    run_checks(rank, world_size, out_dir, RUNS, torch.device("cpu"), others=False)


def gpu_checks(rank: int, world_size: int, out_dir: str) -> None:
    """Both gloo ranks on cuda:0, so one GPU suffices. cuBLAS needs a fixed workspace for deterministic mode."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_checks(rank, world_size, out_dir, GPU_RUNS, torch.device("cuda", 0), others=False)
