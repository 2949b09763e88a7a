"""What each spawned rank runs for test_fsdp_checkpointing.py: FSDP over a model checkpointed by
:func:`cs336_sharding.checkpointing.apply_checkpointing`, against single-process training without
checkpointing, and what each variant saves for backward.

It lives outside the test module because spawned ranks import their entry point by module name, which
pytest's importlib mode does not give test modules (conftest.py puts this folder on ``sys.path``).

Exact equality holds for the same reason as in sharding_spawn_checks.py: each rank
multiplies by the same gathered weights, a sum of two gradients is order-free and halving is exact; the
recomputation re-runs the same operations on the same inputs, so it reproduces the saved values bitwise.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import torch
import torch.distributed as dist
from cs336_basics.model import BasicsTransformerLM
from cs336_basics.nn_utils import cross_entropy
from cs336_sharding.checkpointing import apply_checkpointing
from cs336_sharding.fsdp import FSDP

WORLD_SIZE = 2
VOCAB = 37
SEQ = 9
PER_RANK = 3  # sequences per rank per step
STEPS = 3
POLICIES = ("all", "group:2", "first:1", "nested", "selective")


def new_model() -> BasicsTransformerLM:
    torch.manual_seed(0)
    return BasicsTransformerLM(VOCAB, context_length=SEQ, d_model=16, num_layers=3, num_heads=2, d_ff=24)


def batches(num_steps: int, seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """batches[step][rank] = (tokens, targets), identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    tokens = lambda: torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=g)  # noqa: E731
    return [[(tokens(), tokens()) for _ in range(WORLD_SIZE)] for _ in range(num_steps)]


def checkpointed(model: BasicsTransformerLM, policy: str) -> tuple[BasicsTransformerLM, dict[str, str]]:
    """``model`` with ``policy`` applied, and each new parameter name's name in the unwrapped model."""
    old = {id(p): n for n, p in model.named_parameters()}
    model = apply_checkpointing(model, policy)
    return model, {n: old[id(p)] for n, p in model.named_parameters()}


def training(rank: int, policy: str, checkpoint_first: bool = True) -> dict[str, Any]:
    """Per step: FSDP over the checkpointed model (renamed back), or checkpointing applied in place to the model
    FSDP already wraps, and the plain single-process reference, which runs each rank's batch in turn and averages
    the accumulated gradients."""
    ref = new_model()
    if checkpoint_first:
        model, names = checkpointed(copy.deepcopy(ref), policy)
        fsdp = FSDP(model)
    else:
        fsdp = FSDP(copy.deepcopy(ref))
        names = checkpointed(fsdp.module, policy)[1]
    ref_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ref, fsdp))
    out: dict[str, Any] = {"fsdp": [], "reference": []}
    for step in batches(STEPS, seed=5):
        ref_opt.zero_grad(set_to_none=True)
        for x, y in step:
            cross_entropy(ref(x), y).backward()
        for p in ref.parameters():
            p.grad.div_(WORLD_SIZE)
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        cross_entropy(fsdp(step[rank][0]), step[rank][1]).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
        out["fsdp"].append({names[n]: t for n, t in fsdp.gather_full_params().items()})
        out["reference"].append({n: p.detach().clone() for n, p in ref.named_parameters()})
    return out


def saved_for_backward(rank: int, policy: str, sharded: bool) -> dict[str, Any]:
    """Bytes that autograd's outermost saved-tensor hook sees during one forward (each storage once, the
    parameters' own storages left out); what stays allocated of saved views of FSDP's gathered buffers and
    of the buffers themselves once the forward is over; and the backward's all-gathers."""
    model = new_model()
    if policy != "none":
        model = checkpointed(model, policy)[0]
    fsdp = FSDP(model) if sharded else None
    run = fsdp or model
    x, y = batches(1, seed=rank)[0][rank]
    gathered_views: list[torch.Tensor] = []
    other: dict[int, int] = {}  # storage address -> bytes

    def pack(t: torch.Tensor) -> torch.Tensor:
        address = t.untyped_storage().data_ptr()
        buffers = {u.full.untyped_storage().data_ptr() for u in fsdp._units if u.gathered} if fsdp else set()
        if address in buffers:
            gathered_views.append(t)
        elif address not in {p.untyped_storage().data_ptr() for p in model.parameters()}:
            other[address] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy(run(x), y)
    record = {
        "activation_bytes": sum(other.values()),
        "gathered_views": len(gathered_views),
        "gathered_view_bytes_after_forward": sum(t.untyped_storage().nbytes() for t in gathered_views),
        "gathered_after_forward": sum(u.gathered for u in fsdp._units) if fsdp is not None else 0,
    }
    gathers: list[int] = []
    original = dist.all_gather_into_tensor
    dist.all_gather_into_tensor = lambda *args, **kwargs: (gathers.append(1), original(*args, **kwargs))[1]
    try:
        loss.backward()
    finally:
        dist.all_gather_into_tensor = original
    if fsdp is not None:
        fsdp.finish_gradient_synchronization()
        record["backward_gathers"], record["num_units"] = len(gathers), len(fsdp._units)
    return record


def all_checks(rank: int, world_size: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # the same kernels and reduction order in the ranks and the reference
    warnings.simplefilter("error")
    record: dict[str, Any] = {"training": {}, "saved": {}}
    for policy in POLICIES:
        record["training"][policy] = training(rank, policy)
    record["training"]["all, after FSDP"] = training(rank, "all", checkpoint_first=False)
    for policy in ("none", "all"):
        for sharded in (False, True):
            record["saved"][policy, sharded] = saved_for_backward(rank, policy, sharded)
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(record, f)
    dist.barrier()
