"""What each spawned rank runs for the sharding tests: toy models, single-process references, checks.

It lives outside the test modules because spawned ranks unpickle the entry point by module name, and
pytest's importlib mode gives test modules names the ranks cannot import (conftest.py puts this folder
on ``sys.path``, which spawn passes on to the ranks). One spawn runs every check; each rank pickles what
it saw and the tests assert on those records.

Why FSDP can match single-process training bit for bit in fp32 with two ranks: every rank multiplies
by the same gathered weights, each shard's gradient is computed by the same operations as in the
reference (which runs the shards one after another), and ``(g0 + g1) / 2`` is what gradient
accumulation followed by halving gives (a sum of two is order-free, halving is exact). The reference
itself is compared with plain full-batch training under a tolerance, so it cannot drift from what
training on the global batch means.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from cs336_basics.model import BasicsTransformerLM, Embedding, Linear, RMSNorm
from cs336_basics.nn_utils import cross_entropy
from cs336_basics.optimizer import AdamW
from cs336_sharding.fsdp import FSDP
from cs336_sharding.optimizer import ShardedOptimizer
from cs336_sharding.state import load_state, save_state

WORLD_SIZE = 2
VOCAB = 37  # odd, and 37 x 15 is odd too, so the embedding and head shards need padding
STEPS = 3
SEQ = 7
PER_RANK = 3  # sequences per rank per step


class ToyLM(nn.Module):
    """Embedding, norms and three projections of awkward sizes, all from cs336_basics."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = Embedding(VOCAB, 15)
        self.norm1 = RMSNorm(15)
        self.up = Linear(15, 22)
        self.norm2 = RMSNorm(22)
        self.down = Linear(22, 15)
        self.lm_head = Linear(15, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm1(self.embedding(x)))
        return self.lm_head(self.down(self.norm2(torch.relu(h))))


def new_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "toy":
        return ToyLM()
    return BasicsTransformerLM(VOCAB, context_length=SEQ, d_model=16, num_layers=2, num_heads=2, d_ff=24)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "basics_adamw": lambda params: AdamW(params, lr=1e-2, weight_decay=0.1),
    "torch_adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "torch_adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
}


def batches(num_steps: int, seed: int = 1234) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """batches[step][rank] = (tokens, targets), identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    tokens = lambda: torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=g, device="cpu")  # noqa: E731
    return [[(tokens(), tokens()) for _ in range(WORLD_SIZE)] for _ in range(num_steps)]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device  # batches are made on the CPU, models may live on a GPU
    return cross_entropy(model(x.to(device)).float(), y.to(device))


def cast_weights_like_fsdp(model: nn.Module, dtype: torch.dtype) -> None:
    """Make a plain model compute with its 2-D weights cast to ``dtype`` (through autograd, so the
    gradient comes back in fp32), as FSDP with ``compute_dtype`` does."""
    for m in model.modules():
        if isinstance(m, Linear | Embedding):
            weight = m.weight
            m.register_forward_pre_hook(lambda mod, args, w=weight: mod._parameters.update(weight=w.to(dtype)))
            m.register_forward_hook(lambda mod, args, out, w=weight: mod._parameters.update(weight=w))


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.named_parameters()}


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, step: list) -> None:
    """Each rank's shard of the batch in turn, gradients accumulated, then averaged: what FSDP computes."""
    opt.zero_grad(set_to_none=True)
    for x, y in step:
        loss_of(model, x, y).backward()
    for p in model.parameters():
        p.grad.div_(WORLD_SIZE)
    opt.step()


def full_batch_step(model: nn.Module, opt: torch.optim.Optimizer, step: list) -> None:
    opt.zero_grad(set_to_none=True)
    x = torch.cat([x for x, _ in step])
    y = torch.cat([y for _, y in step])
    loss_of(model, x, y).backward()
    opt.step()


def fsdp_step(model: FSDP, opt: torch.optim.Optimizer, step: list, rank: int) -> None:
    opt.zero_grad(set_to_none=True)
    x, y = step[rank]
    loss_of(model, x, y).backward()
    model.finish_gradient_synchronization()
    opt.step()


def fsdp_training(rank: int, kind: str, optimizer: str, compute_dtype: torch.dtype | None) -> dict[str, Any]:
    """Per step: FSDP's gathered params, the mirrored reference's and plain full-batch training's."""
    data = batches(STEPS)
    ref = new_model(kind, seed=0)
    full = copy.deepcopy(ref)
    if compute_dtype is not None:
        cast_weights_like_fsdp(ref, compute_dtype)
        cast_weights_like_fsdp(full, compute_dtype)
    # Ranks start from different weights: FSDP must broadcast rank 0's before sharding.
    fsdp = FSDP(new_model(kind, seed=rank), compute_dtype=compute_dtype)
    ref_opt, full_opt, fsdp_opt = (OPTIMIZERS[optimizer](m.parameters()) for m in (ref, full, fsdp))
    out: dict[str, Any] = {"fsdp": [], "reference": [], "full_batch": []}
    for step in data:
        reference_step(ref, ref_opt, step)
        full_batch_step(full, full_opt, step)
        fsdp_step(fsdp, fsdp_opt, step, rank)
        out["fsdp"].append({k: v.cpu() for k, v in fsdp.gather_full_params().items()})
        out["reference"].append(params_of(ref))
        out["full_batch"].append(params_of(full))
    return out


def fsdp_gradients(rank: int, compute_dtype: torch.dtype | None) -> dict[str, Any]:
    """After sync: each grad's shape and dtype against its param's, and every rank's replicated grads."""
    model = FSDP(new_model("transformer", seed=0), compute_dtype=compute_dtype)
    x, y = batches(1, seed=rank)[0][rank]  # different data on each rank
    loss_of(model, x, y).backward()
    model.finish_gradient_synchronization()
    sharded = set(model.sharded_parameters())
    grads = {}
    for name, p in model.module.named_parameters():
        grads[name] = {
            "grad_shape": tuple(p.grad.shape), "shape": tuple(p.shape), "grad_dtype": p.grad.dtype,
            "dtype": p.dtype, "sharded": name in sharded, "grad": p.grad.clone(),
        }
    return grads


def fsdp_gathered_weights(rank: int) -> dict[str, Any]:
    """How many units are gathered when each unit's module starts its forward (two iterations, so the
    second runs on the recorded order), and how many are left after each phase."""
    model = FSDP(new_model("transformer", seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts: list[int] = []
    gathered = lambda: sum(u.gathered for u in model._units)  # noqa: E731
    for m in model._unit_of_module:  # registered after FSDP's own pre-hook, so it sees the unit gathered
        m.register_forward_pre_hook(lambda mod, args: counts.append(gathered()))
    left = []
    for step in batches(2, seed=5):
        loss = loss_of(model, *step[rank])
        left.append(gathered())
        loss.backward()
        model.finish_gradient_synchronization()
        left.append(gathered())
        opt.step()
        opt.zero_grad()
    return {"counts": counts, "left": left, "num_units": len(model._units)}


def fsdp_collectives(rank: int) -> dict[str, Any]:
    """Collectives issued per phase of two training iterations, counted by wrapping torch.distributed's."""
    model = FSDP(new_model("transformer", seed=0), compute_dtype=torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "reduce_scatter_tensor")}

    def counting(name: str) -> Callable[..., Any]:
        return lambda *args, **kwargs: (calls.append(name), originals[name](*args, **kwargs))[1]

    phases: list[dict[str, int]] = []
    try:
        for name in originals:
            setattr(dist, name, counting(name))
        for step in batches(2, seed=11):
            loss = loss_of(model, *step[rank])
            phases.append({name: calls.count(name) for name in originals})
            calls.clear()
            loss.backward()
            model.finish_gradient_synchronization()
            phases.append({name: calls.count(name) for name in originals})
            calls.clear()
            opt.step()
            opt.zero_grad()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"phases": phases, "units": [(u.name, [s.name for s in u.slots]) for u in model._units]}


def fsdp_save_load(rank: int, out_dir: str, optimizer: str) -> dict[str, Any]:
    """Train 2 steps, save, train 2 more; a fresh model and optimizer load the save and train the same 2."""
    data = batches(4, seed=7)
    model = FSDP(new_model("transformer", seed=0))
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in data[:2]:
        fsdp_step(model, opt, step, rank)
    path = f"{out_dir}/ckpt_{optimizer}"
    save_state(path, model, opt)
    for step in data[2:]:
        fsdp_step(model, opt, step, rank)
    resumed = FSDP(new_model("transformer", seed=99))
    resumed_opt = OPTIMIZERS[optimizer](resumed.parameters())
    load_state(path, resumed, resumed_opt)
    for step in data[2:]:
        fsdp_step(resumed, resumed_opt, step, rank)
    return {"uninterrupted": model.gather_full_params(), "resumed": resumed.gather_full_params()}


# ShardedOptimizer: every rank sees the same data (the gradient average of DDP is not what is tested).


class TiedToy(nn.Module):
    """An embedding that doubles as the output projection, layers of unequal sizes, norms, and a
    layer that starts frozen (unfrozen and added as a new group mid-training)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = Embedding(VOCAB, 12)
        self.norm = RMSNorm(12)
        self.big = Linear(12, 40)
        self.small = Linear(40, 12)
        self.late = Linear(12, 12)
        self.late.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.small(torch.relu(self.big(self.norm(self.embedding(x)))))
        h = h + self.late(h)
        return h @ self.embedding.weight.T  # tied output projection


def _groups(model: TiedToy) -> list[dict[str, Any]]:
    return [
        {"params": [model.embedding.weight, model.big.weight, model.small.weight], "lr": 2e-2},
        {"params": [model.norm.weight], "weight_decay": 0.0},
    ]


SHARDED_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "torch_adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "basics_adamw": (AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9}),
}


def _train_tied(model: TiedToy, opt: torch.optim.Optimizer, data: list, start: int, stop: int) -> None:
    """Steps [start, stop): at step 2 the frozen layer joins as a new group; at step 3 the lr is halved."""
    for i in range(start, stop):
        if i == 2:
            model.late.weight.requires_grad_(True)
            opt.add_param_group({"params": [model.late.weight], "lr": 3e-3})
        if i == 3:
            for g in opt.param_groups:
                g["lr"] *= 0.5
        opt.zero_grad(set_to_none=True)
        x, y = data[i][0]
        loss_of(model, x, y).backward()
        opt.step()


def sharded_optimizer_training(rank: int, name: str) -> dict[str, Any]:
    cls, kwargs = SHARDED_OPTIMIZERS[name]
    data = batches(6, seed=3)
    torch.manual_seed(0)
    ref = TiedToy()
    model = copy.deepcopy(ref)
    ref_opt = cls(_groups(ref), **kwargs)
    opt = ShardedOptimizer(_groups(model), cls, **kwargs)
    steps = []
    for i in range(5):
        _train_tied(ref, ref_opt, data, i, i + 1)
        _train_tied(model, opt, data, i, i + 1)
        steps.append((params_of(model), params_of(ref)))
    owned = {n: opt.owner_of(p) for n, p in model.named_parameters()}
    return {
        "steps": steps,
        "owners": owned,
        "numel": {n: p.numel() for n, p in model.named_parameters()},
        "local_state": sorted(n for n, p in model.named_parameters() if p in opt.inner.state),
        "consolidated": opt.consolidated_state_dict(to=0),
        "reference_state": ref_opt.state_dict(),
    }


def sharded_optimizer_resume(rank: int, name: str, consolidated: bool) -> dict[str, Any]:
    """State dict taken after 3 steps (this rank's shard, or the consolidated one); both runs go on 3."""
    cls, kwargs = SHARDED_OPTIMIZERS[name]
    data = batches(6, seed=4)
    torch.manual_seed(0)
    model = TiedToy()
    opt = ShardedOptimizer(_groups(model), cls, **kwargs)
    _train_tied(model, opt, data, 0, 3)
    if consolidated:
        saved = [opt.consolidated_state_dict(to=0)]
        dist.broadcast_object_list(saved, src=0)
        saved_state = saved[0]
    else:
        saved_state = copy.deepcopy(opt.state_dict())
    saved_params = params_of(model)
    _train_tied(model, opt, data, 3, 6)

    torch.manual_seed(0)
    resumed = TiedToy()
    resumed.late.weight.requires_grad_(True)  # unfrozen before the save, as the group list says
    groups = [*_groups(resumed), {"params": [resumed.late.weight], "lr": 3e-3}]
    resumed_opt = ShardedOptimizer(groups, cls, **kwargs)
    resumed_opt.load_state_dict(saved_state)
    with torch.no_grad():
        for n, p in resumed.named_parameters():
            p.copy_(saved_params[n])
    _train_tied(resumed, resumed_opt, data, 3, 6)
    return {"uninterrupted": params_of(model), "resumed": params_of(resumed)}


# (model, optimizer) pairs trained with fp16 compute. With SGD the mirrored reference stays within 1e-4 of
# full-batch training; AdamW divides by the gradient's running RMS, which magnifies the rounding of fp16
# partial sums far beyond that, so for it only the bitwise comparison with the mirrored reference counts.
FP16_RUNS = (("toy", "sgd"), ("transformer", "sgd"), ("transformer", "basics_adamw"))


def all_checks(rank: int, world_size: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # the same kernels and reduction order in the ranks and the references
    warnings.simplefilter("error")  # a wrapper that warns during ordinary training is a defect here
    record: dict[str, Any] = {"fsdp": {}, "grads": {}, "state": {}, "sharded": {}, "resume": {}}
    for kind in ("toy", "transformer"):
        for optimizer in OPTIMIZERS:
            record["fsdp"][kind, optimizer, "fp32"] = fsdp_training(rank, kind, optimizer, None)
    for kind, optimizer in FP16_RUNS:
        record["fsdp"][kind, optimizer, "fp16"] = fsdp_training(rank, kind, optimizer, torch.float16)
    for dtype in (None, torch.float16):
        record["grads"][str(dtype)] = fsdp_gradients(rank, dtype)
    record["gathered"] = fsdp_gathered_weights(rank)
    record["collectives"] = fsdp_collectives(rank)
    for optimizer in ("torch_adamw", "basics_adamw"):
        record["state"][optimizer] = fsdp_save_load(rank, out_dir, optimizer)
    for name in SHARDED_OPTIMIZERS:
        record["sharded"][name] = sharded_optimizer_training(rank, name)
        for consolidated in (False, True):
            record["resume"][name, consolidated] = sharded_optimizer_resume(rank, name, consolidated)
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(record, f)
    dist.barrier()


def gpu_checks(rank: int, world_size: int, out_dir: str) -> None:
    """The same training checks on NCCL with the models on each rank's GPU."""
    torch.set_default_device(torch.device("cuda", rank))
    record = {
        "fsdp_fp32": fsdp_training(rank, "transformer", "torch_adamw_fused", None),
        "fsdp_bf16": fsdp_training(rank, "transformer", "torch_adamw_fused", torch.bfloat16),
        "sharded": sharded_optimizer_training(rank, "torch_adamw")["steps"],
    }
    with open(f"{out_dir}/gpu_rank{rank}.pkl", "wb") as f:
        pickle.dump(record, f)
    dist.barrier()
