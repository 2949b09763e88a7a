"""FSDP's units of communication (:mod:`cs336_sharding.fsdp`): which weights move together
(:func:`communication_units`), and a unit's flat layout: each weight's padded piece in a rank's flat shard
(:class:`Slot`) and the buffer the full weights are gathered into (:class:`Unit`).

Sharding is per weight inside the unit: a weight of ``n`` elements is flattened, zero-padded to
``world_size * ceil(n / world_size)`` and split into equal pieces, so any shape works, and a rank's flat
unit shard is its pieces of the unit's weights one after another. ``param.data`` is replaced by a view of
its piece in that shard, which keeps names, ``requires_grad`` and the optimizer's view of the model
unchanged; the padding has zero gradient, so it stays zero under SGD and AdamW and is never gathered back.
The gathered buffer is rank-major (every rank's whole shard in turn), so one copy (``split_with_sizes_copy``)
puts each weight's pieces side by side; gradients take the reverse copy before the reduce-scatter.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


def allocate(full: torch.Tensor) -> torch.Tensor:
    """Give a freed full buffer its memory back (a no-op when it has it) and return it."""
    full.untyped_storage().resize_(full.numel() * full.element_size())
    return full


def shards_weight(module: nn.Module) -> bool:
    """Which weights are sharded: a module's own ``weight`` parameter when it is 2-D (Linear, Embedding)."""
    weight = module._parameters.get("weight")
    return isinstance(weight, nn.Parameter) and weight.dim() == 2


def communication_units(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Module]]]:
    """The grouping policy: ``(module name, module, modules whose weight the unit shards)`` in module order.

    A child of an ``nn.ModuleList`` with sharded weights anywhere inside it and no ``ModuleList`` of its own
    is one unit holding all of them (a child holding a list, such as a checkpointed segment of blocks, is
    looked into); elsewhere, each module that shards its own weight is a unit of that weight alone.
    """
    units: list[tuple[str, nn.Module, list[nn.Module]]] = []

    def visit(name: str, module: nn.Module, in_list: bool) -> None:
        owners = [m for m in module.modules() if shards_weight(m)]
        if in_list and owners and not any(isinstance(m, nn.ModuleList) for m in module.modules()):
            units.append((name, module, owners))
            return
        if shards_weight(module):
            units.append((name, module, [module]))
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, isinstance(module, nn.ModuleList))

    visit("", model, False)
    return units


class Slot:
    """One sharded weight inside its unit: its padded piece of ``shard_numel`` elements starts at ``offset``
    in the unit's local shard, and its full weight at ``world_size * offset`` in the gathered unit."""

    def __init__(self, name: str, param: nn.Parameter, offset: int, rank: int, world_size: int):
        self.name, self.param, self.offset = name, param, offset
        self.shape = param.shape
        self.numel = param.numel()
        self.shard_numel = math.ceil(self.numel / world_size)
        # Real (unpadded) elements in this rank's piece; the same split as torch.chunk over the flat weight.
        self.valid = max(0, min(self.shard_numel, self.numel - rank * self.shard_numel))


class Unit:
    """The weights communicated together: their local flat shard (which the parameters view), the buffer
    their full weights are gathered into (its storage allocated only while in use), and the gradient shards
    reduce-scattered to this rank."""

    def __init__(self, name: str, slots: list[Slot], world_size: int, local: torch.Tensor, dtype: torch.dtype):
        self.name, self.slots, self.world_size = name, slots, world_size
        self.shard_numel = sum(s.shard_numel for s in slots)
        self.local = local  # (shard_numel,) in the master dtype
        self.uses: list[tuple[nn.Module, int]] = []  # (module, index of the slot holding its weight)
        # (world_size * shard_numel,) in the compute dtype, slot-major. One tensor for the model's lifetime:
        # autograd saves views of it, so a re-gather into its storage restores what they see.
        self.full = torch.empty(world_size * self.shard_numel, dtype=dtype, device=local.device)
        self.full.untyped_storage().resize_(0)
        self.full_data = self.full.data  # writes through this alias leave autograd's version counter alone
        self.gather: tuple[dist.Work, torch.Tensor, torch.Tensor] | None = None  # in flight: work, output, input
        self.in_use = False  # counted in this phase's execution order; cleared when freed
        self.backward_uses = 0  # backward passes through the unit's module begun and not yet reduce-scattered
        self.grad_parts: list[torch.Tensor] = []

    @property
    def gathered(self) -> bool:
        """Whether the unit's gather has started (it may still be in flight)."""
        return self.gather is not None or self.full.untyped_storage().size() > 0

    def full_weight(self, slot: Slot) -> torch.Tensor:
        assert self.gather is None and self.full.untyped_storage().size() > 0, f"{self.name} is not gathered"
        start = self.world_size * slot.offset
        return self.full[start : start + slot.numel].view(slot.shape)
