"""Optimizer state sharding (ZeRO stage 1, Rajbhandari et al., 2020, "ZeRO-DP P_os").

:class:`ShardedOptimizer` wraps any ``torch.optim.Optimizer`` class (or a callable that makes one). Every rank
keeps the full model and full gradients (as in plain data parallel training), but each parameter is owned by
exactly one rank, and only the owner's inner optimizer holds state for it and updates it. After the local update
the owners broadcast the new values so that every rank again holds the same model::

    model = ...                                     # gradients averaged by DDP or an all-reduce
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Parameters are assigned greedily, largest first, to the rank that owns the fewest elements so far,
group by group, so a group added mid-training (``add_param_group``) is spread over the ranks too.
``state_dict()`` is this rank's shard in torch's usual layout (state keyed by the parameter's global
index, all groups with all indices); :meth:`ShardedOptimizer.consolidated_state_dict` merges the
shards on one rank into exactly the dict the unsharded optimizer would produce; ``load_state_dict``
takes either. Without a process group, or with one rank, it behaves exactly like the wrapped class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from cs336_comms.process_group import rank_and_world

# Parameters below this many bytes are packed into one flat buffer per owner before broadcasting, so a
# model with hundreds of norm weights does not pay hundreds of collective launches; larger ones are
# broadcast in place, which needs no extra memory.
SMALL_PARAM_BYTES = 1 << 20



class ShardedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer_cls`` so each rank keeps optimizer state only for the parameters it owns.

    Args:
        params: parameters or parameter groups (dicts with ``"params"`` and per-group hyperparameters).
        optimizer_cls: the optimizer to wrap, e.g. ``torch.optim.AdamW``, or any callable ``fn(param_groups,
            **kwargs) -> Optimizer`` that makes one; built once per rank over the parameters that rank owns.
        process_group: the ranks that share the state (default: the world); ranks are numbered within it.
        **kwargs: default hyperparameters, forwarded to ``optimizer_cls``.
    """

    def __init__(
        self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        *, process_group: dist.ProcessGroup | None = None, **kwargs: Any,
    ):
        if not callable(optimizer_cls) or (isinstance(optimizer_cls, type)
                                           and not issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError("optimizer_cls must be a torch.optim.Optimizer subclass or a callable that makes one, got "
                            f"{optimizer_cls!r}")
        self._optimizer_cls = optimizer_cls
        self._group = process_group
        self._rank, self._world_size = rank_and_world(process_group)
        self._owned_numel = [0] * self._world_size
        self._owner: dict[torch.Tensor, int] = {}
        self._inner: torch.optim.Optimizer | None = None
        self._broadcast_plan: list[tuple[int, list[torch.Tensor]]] | None = None
        # The base constructor validates the groups and calls self.add_param_group once per group.
        super().__init__(params, kwargs)

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The wrapped optimizer of this rank: one group per outer group, holding the owned parameters."""
        assert self._inner is not None, "the base constructor adds at least one group"
        return self._inner

    def owner_of(self, param: torch.Tensor) -> int:
        """The rank that updates ``param`` and keeps its optimizer state."""
        if param not in self._owner:
            raise ValueError("this parameter is not managed by the optimizer")
        return self._owner[param]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (during construction or later in training), spreading its parameters over ranks."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            # Sorting is stable and identical on every rank, so every rank computes the same owners.
            rank = min(range(self._world_size), key=lambda r: self._owned_numel[r])
            self._owner[p] = rank
            self._owned_numel[rank] += p.numel()
        local = {**group, "params": [p for p in group["params"] if self._owner[p] == self._rank]}
        if self._inner is None:
            self._inner = self._optimizer_cls([local], **self.defaults)
            # Users and tools that read ``optimizer.state[p]`` find the state of the parameters owned here.
            self.state = self._inner.state
        else:
            self._inner.add_param_group(local)
        # The inner optimizer fills in its own defaults (betas, eps, ...); show them on the outer group
        # too, so that schedulers and users read and write the full set of hyperparameters there.
        for key, value in self._inner.param_groups[-1].items():
            if key != "params":
                group.setdefault(key, value)
        self._broadcast_plan = None

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        """Update the owned parameters with the inner optimizer, then broadcast them from their owners."""
        self._sync_hyperparameters()
        loss = self.inner.step(closure, **kwargs)
        if self._world_size > 1:
            self._broadcast_parameters()
        return loss

    def _plan(self) -> list[tuple[int, list[torch.Tensor]]]:
        """(owner, tensors) messages: large parameters alone, small ones batched per owner, dtype, device."""
        if self._broadcast_plan is None:
            plan: list[tuple[int, list[torch.Tensor]]] = []
            small: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
            for group in self.param_groups:
                for p in group["params"]:
                    owner = self._owner[p]
                    if p.numel() * p.element_size() >= SMALL_PARAM_BYTES:
                        plan.append((owner, [p]))
                    else:
                        small.setdefault((owner, p.dtype, p.device), []).append(p)
            plan += [(owner, tensors) for (owner, _, _), tensors in small.items()]
            self._broadcast_plan = plan
        return self._broadcast_plan

    def _broadcast_parameters(self) -> None:
        pending = []
        for owner, tensors in self._plan():
            # A lone parameter is broadcast in place; small ones travel packed in one flat buffer.
            buffer = tensors[0].data if len(tensors) == 1 else torch.cat([t.data.reshape(-1) for t in tensors])
            work = dist.broadcast(buffer, group=self._group, group_src=owner, async_op=True)
            pending.append((work, owner, tensors, buffer))
        for work, owner, tensors, buffer in pending:
            work.wait()
            if len(tensors) > 1 and owner != self._rank:
                offset = 0
                for t in tensors:
                    t.data.copy_(buffer[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    # State dicts. Both layouts use the global parameter index (position over all outer groups), so a
    # shard, the consolidated dict and the unsharded optimizer's dict all mean the same thing.

    def _global_indices(self) -> dict[torch.Tensor, int]:
        return {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: state for the owned parameters, all groups with global indices."""
        index = self._global_indices()
        inner = self.inner.state_dict()
        local_params = [p for g in self.inner.param_groups for p in g["params"]]
        state = {index[local_params[i]]: s for i, s in inner["state"].items()}
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
            for g in self.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def consolidated_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """Gather every rank's shard on rank ``to``; returns the full dict there and None elsewhere.

        Collective: every rank must call it. State tensors travel through CPU memory.
        """
        if not 0 <= to < self._world_size:
            raise ValueError(f"to must be a rank in [0, {self._world_size}), got {to}")
        local = self.state_dict()
        if self._world_size == 1:
            return local
        cpu_state = {
            i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in local["state"].items()
        }
        shards: list[Any] = [None] * self._world_size if self._rank == to else []
        dist.gather_object(cpu_state, shards if self._rank == to else None, group=self._group, group_dst=to)
        if self._rank != to:
            return None
        merged: dict[int, Any] = {}
        for shard in shards:
            merged.update(shard)
        return {"state": dict(sorted(merged.items())), "param_groups": local["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shard saved by this rank or a consolidated dict; keeps the entries this rank owns."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or "state" not in state_dict:
            raise ValueError("state_dict must have 'state' and a list of 'param_groups'")
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                "state_dict's groups do not match this optimizer's: sizes "
                f"{[len(g['params']) for g in groups]} vs {[len(g['params']) for g in self.param_groups]}"
            )
        params = [p for g in self.param_groups for p in g["params"]]
        local_index = {p: i for i, p in enumerate(p for g in self.inner.param_groups for p in g["params"])}
        state = {
            local_index[params[int(i)]]: s
            for i, s in state_dict["state"].items()
            if self._owner[params[int(i)]] == self._rank
        }
        for outer, saved in zip(self.param_groups, groups, strict=True):
            outer.update({k: v for k, v in saved.items() if k != "params"})
        inner_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [local_index[p] for p in ig["params"]]}
            for g, ig in zip(self.param_groups, self.inner.param_groups, strict=True)
        ]
        self.inner.load_state_dict({"state": state, "param_groups": inner_groups})
