"""Fully sharded data parallel training (FSDP; ZeRO stage 3, Rajbhandari et al., 2020).

:class:`FSDP` shards every 2-D ``weight`` parameter (Linear and Embedding in our model) over the ranks
and keeps every other parameter (norm weights, biases) replicated::

    model = FSDP(model, compute_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())     # sees ordinary fp32 leaf params: the local shards
    loss_fn(model(x_local), y_local).backward()
    model.finish_gradient_synchronization()         # every .grad is now the averaged local shard gradient
    opt.step(); opt.zero_grad()

Units of communication (:func:`~cs336_sharding.fsdp_units.communication_units`): every child of an innermost
``nn.ModuleList`` (a Transformer block) is one unit holding all the 2-D weights inside it; a module outside any
``ModuleList`` that owns a 2-D weight (embedding, LM head) is a unit of its own. A model without a ``ModuleList``
therefore communicates weight by weight. Each unit moves as one flat buffer: one all-gather before its
forward, one re-gather for its backward and one reduce-scatter of its concatenated gradient, as FSDP2 does
per ``fully_shard`` call; per-weight collectives are many small ones whose fixed cost no compute can hide.
The flat layout of a unit's weights, its shard and its gathered buffer is :mod:`cs336_sharding.fsdp_units`'s.

Forward: a pre-hook on the unit's module all-gathers its shard (cast to ``compute_dtype`` first, so
communication is in the compute dtype too) into the unit's full buffer, swaps views of it in as the
module's weights, and after the forward frees the buffer's storage (``untyped_storage().resize_(0)``).
When unit ``i`` starts, the gather of unit ``i + 1`` starts, so at most two units' full weights are alive.
Backward (as FSDP2 does): autograd keeps the very views it was given, now without memory; the gradient
reaching the unit's outputs (an identity ``autograd.Function`` put on them after the forward) re-allocates
the storage and re-gathers into it, prefetching the next unit, before any of the unit's backward runs. The
gather writes through a ``.data`` alias, which does not bump the version counter autograd checks. Once
autograd has produced every gradient of the unit's weights, they are reduce-scattered together in fp32 and
the storage is freed again; replicated gradients are all-reduced as soon as they are accumulated. Execution
orders are recorded each iteration and predict the next gather in the following one, on every rank alike.

Activation checkpointing (:mod:`cs336_sharding.checkpointing`) composes with this in either order, since FSDP
installs no saved-tensor hook and checkpointing keeps the blocks, their names and their hooks in place
(``FSDP(apply_checkpointing(model, "all"))`` or ``apply_checkpointing(fsdp.module, "all")``). Units are the
children of the innermost ``ModuleList``, so the blocks stay units inside the checkpointed segments. The backward's
recomputation runs a unit's forward again: the pre-hook gathers it as usual, and the post-hook keeps it
gathered if the unit's own backward has begun (it needs the recomputed views), else frees it. A block compiled with
its checkpoint (:meth:`cs336_sharding.checkpointing.CheckpointedBlocks.compile_blocks`) recomputes inside its
compiled backward instead, from the weight views its graph saved, which the re-gather at the start of the unit's
backward has filled.

Limitations: a weight must be used through its module's forward; a weight tied between units must belong
to modules that each own it directly (embedding and LM head), not to the inside of a ``ModuleList`` child.

:meth:`FSDP.gather_full_params` returns every parameter unsharded, by its name in the original module;
:meth:`FSDP.state_tensor` gives a rank's piece as the DTensor that :mod:`cs336_sharding.state` (``save_state`` /
``load_state``) hands to ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from cs336_comms.process_group import rank_and_world
from cs336_comms.reduce import TreeReduction, tree_all_reduce, tree_reduce_scatter
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_flatten, tree_unflatten

from cs336_sharding.fsdp_units import Slot, Unit, allocate, communication_units

# Reduce-scatters left in flight while backward computes; the oldest is waited for (and its unit's full fp32
# gradient buffer freed) before the next unit's buffer is allocated. One (as in FSDP2) overlaps it with the
# next unit's backward, which at our sizes takes several times longer than the collective; every further one
# costs a unit's fp32 gradient in memory.
MAX_PENDING_REDUCE_SCATTERS = 1


class _UseFullWeights(torch.autograd.Function):
    """Identity from a unit's shards to its gathered full weights. Autograd calls the backward once every
    full weight's gradient exists, which hands them to one reduce-scatter. It returns no gradient for the
    shards: those arrive in ``finish_gradient_synchronization``, once the collective is done."""

    @staticmethod
    def forward(ctx: Any, fsdp: FSDP, unit: Unit, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.fsdp, ctx.unit = fsdp, unit
        ctx.set_materialize_grads(False)  # an unused weight's gradient stays None instead of a zero tensor
        fulls = tuple(unit.full_weight(s) for s in unit.slots)
        ctx.mark_non_differentiable(*(f for f, s in zip(fulls, unit.slots, strict=True) if not s.param.requires_grad))
        return fulls

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ctx.fsdp._reduce_scatter(ctx.unit, grads)
        return (None, None, *(None for _ in grads))


class _OnBackward(torch.autograd.Function):
    """Identity on a module's output tensors that calls ``callback()`` when their gradient arrives, before
    autograd runs anything that produced them."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        ctx.set_materialize_grads(False)
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        ctx.callback()
        return (None, *grads)


def _on_backward(output: Any, callback: Callable[[], None]) -> Any:
    """``output`` (any nesting of tensors) with its tensors that need a gradient passed through :class:`_OnBackward`."""
    leaves, spec = tree_flatten(output)
    needs_grad = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not needs_grad:
        return output
    for i, t in zip(needs_grad, _OnBackward.apply(callback, *(leaves[i] for i in needs_grad)), strict=True):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


class FSDP(nn.Module):
    """Fully sharded data parallel wrapper around ``module``.

    Args:
        module: the model; parameters and buffers are broadcast from the group's rank 0 first, so ranks agree.
        compute_dtype: if given, weights are cast to it before they are gathered and used; master
            weights, gradients handed to the optimizer and updates stay in the parameters' dtype.
        process_group: the ranks to shard over (default: the world). Without an initialised process group the
            wrapper runs as a single rank (no communication), as the DDP wrappers and ZeRO-1 do.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 process_group: dist.ProcessGroup | None = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        wrapped = next((f"its submodule {name!r}" if name else "the module itself" for name, m in module.named_modules()
                        if isinstance(m, FSDP)), None)
        if wrapped is not None:
            raise TypeError(f"module is already sharded by FSDP ({wrapped}); wrap the plain model once")
        floating = isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
        if compute_dtype is not None and not floating:
            raise TypeError(f"compute_dtype must be a floating torch.dtype or None, got {compute_dtype!r}")
        self.module = module
        self.compute_dtype = compute_dtype
        self._group = process_group
        self._rank, self._world_size = rank_and_world(process_group)
        names = {p: n for n, p in module.named_parameters()}
        for p, name in names.items():
            if not p.dtype.is_floating_point:
                raise TypeError(f"parameter {name} must be floating point, got {p.dtype}")
        if self._world_size > 1:
            with torch.no_grad():
                for t in [*names, *module.buffers()]:
                    dist.broadcast(t.data, group=process_group, group_src=0)

        self._units: list[Unit] = []
        self._unit_of_module: dict[nn.Module, Unit] = {}  # the modules whose forward gathers a unit
        by_param: dict[nn.Parameter, Unit] = {}
        for unit_name, root, owners in communication_units(module):
            if root in self._unit_of_module:  # a module reachable by two paths is hooked once
                continue
            weights = list(dict.fromkeys(m._parameters["weight"] for m in owners))  # tied weights once
            taken = {by_param[w] for w in weights if w in by_param}
            if taken:
                if len(owners) > 1 or len(taken) > 1:
                    raise ValueError(f"unit {unit_name} shares weights with unit(s) {sorted(u.name for u in taken)}; "
                                     "a weight tied across units must be owned directly by modules outside any "
                                     "ModuleList")
                unit = taken.pop()  # a weight tied between modules (embedding and head) is one unit
            else:
                unit = self._new_unit(unit_name, [(names[w], w) for w in weights])
                by_param.update(dict.fromkeys(weights, unit))
            index = {s.param: i for i, s in enumerate(unit.slots)}
            unit.uses += [(m, index[m._parameters["weight"]]) for m in owners]
            self._unit_of_module[root] = unit
            root.register_forward_pre_hook(self._pre_forward)
            root.register_forward_hook(self._post_forward, always_call=True)
        self._replicated = [p for p in names if p not in by_param]
        self._slot_of_name = {s.name: s for u in self._units for s in u.slots}
        self._replicated_by_name = {names[p]: p for p in self._replicated}
        # Gradient hooks live in C++, out of the garbage collector's sight: a bound method there would keep
        # this wrapper (and every shard) alive forever, so the hook holds only a weak reference.
        owner = weakref.ref(self)
        for p in self._replicated:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda param: owner()._all_reduce_grad(param))

        self._pending_reduce_scatters: list[tuple[Unit, dist.Work | TreeReduction | None, torch.Tensor,
                                                  torch.Tensor]] = []
        self._pending_all_reduces: dict[nn.Parameter, dist.Work | TreeReduction] = {}
        # The profiler range of each module forward in progress, exited after it.
        self._in_forward: dict[nn.Module, list[Any]] = {}
        # Set when the gradient reaches the model's output: unit forwards from then on are recomputations.
        self._in_backward = False
        # Orders of unit uses seen in the last iteration (the prediction) and in this one.
        self._forward_order: list[Unit] = list(self._units)
        self._backward_order: list[Unit] = []
        self._forward_seen: list[Unit] = []
        self._backward_seen: list[Unit] = []
        self._mesh = None

    # Sharding and gathering.

    def _new_unit(self, name: str, weights: list[tuple[str, nn.Parameter]]) -> Unit:
        first = weights[0][1]
        for weight_name, w in weights:
            if (w.dtype, w.device) != (first.dtype, first.device):
                raise ValueError(f"unit {name or weight_name} needs one dtype and device for its weights, got "
                                 f"{w.dtype} on {w.device} for {weight_name} and {first.dtype} on {first.device} "
                                 f"for {weights[0][0]}")
        slots, offset = [], 0
        for weight_name, w in weights:
            slots.append(Slot(weight_name, w, offset, self._rank, self._world_size))
            offset += slots[-1].shard_numel
        local = torch.zeros(sum(s.shard_numel for s in slots), dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for s in slots:
                start = self._rank * s.shard_numel
                local[s.offset : s.offset + s.valid] = s.param.data.reshape(-1)[start : start + s.valid]
                s.param.data = local[s.offset : s.offset + s.shard_numel]
        # A unit of one weight is named by the weight, as its module path may be empty (a bare Linear).
        unit = Unit(name if len(slots) > 1 else slots[0].name, slots, self._world_size, local,
                     self.compute_dtype or first.dtype)
        self._units.append(unit)
        return unit

    def _launch_gather(self, unit: Unit, local: torch.Tensor, out: torch.Tensor, async_op: bool) -> dist.Work | None:
        with torch.profiler.record_function(f"fsdp.all_gather.{unit.name}"):
            return dist.all_gather_into_tensor(out, local, group=self._group, async_op=async_op)

    def _layouts_coincide(self, unit: Unit) -> bool:
        """Whether the gathered (rank-major) layout is already slot-major."""
        return len(unit.slots) == 1 or self._world_size == 1

    def _slot_major(self, unit: Unit, gathered: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy a gathered (rank-major) unit into ``out`` so that each weight's pieces are contiguous."""
        sizes = [s.shard_numel for s in unit.slots]
        pieces = [out[self._world_size * s.offset :][: self._world_size * s.shard_numel].view(self._world_size, -1)
                  for s in unit.slots]
        torch.split_with_sizes_copy(gathered.view(self._world_size, unit.shard_numel), sizes, dim=1, out=pieces)
        return out

    def _start_gather(self, unit: Unit) -> None:
        if unit.gathered:
            return
        shard = unit.local.detach()
        full = unit.full_data
        if self._world_size == 1:
            allocate(full)
            full.copy_(shard)
            return
        # With a staging buffer, the full buffer gets its memory only when the gather has landed (as in
        # FSDP2), so a prefetched unit costs its staging buffer alone while in flight.
        out = allocate(full) if self._layouts_coincide(unit) else torch.empty_like(full)
        if full.dtype == shard.dtype:
            local = shard  # nothing writes to the shard between the forward and the optimizer step
        else:
            # Cast before communicating, so the gather moves compute-dtype bytes, and cast straight into this
            # rank's place in the output (an in-place gather, as FSDP2 does) rather than into a buffer of its own.
            local = out.view(self._world_size, unit.shard_numel)[self._rank]
            local.copy_(shard)
        work = self._launch_gather(unit, local, out, async_op=True)
        assert work is not None
        unit.gather = (work, out, local)

    def _wait_gather(self, unit: Unit) -> None:
        self._start_gather(unit)
        if unit.gather is not None:
            work, out, _ = unit.gather
            work.wait()
            unit.gather = None
            if out is not unit.full_data:
                self._slot_major(unit, out, allocate(unit.full_data))

    def _free(self, unit: Unit) -> None:
        if unit.gather is not None:  # never drop a buffer a collective may still write into
            unit.gather[0].wait()
            unit.gather = None
        unit.full.untyped_storage().resize_(0)
        unit.in_use = False
        unit.backward_uses = 0

    def _use(self, unit: Unit) -> None:
        """Gather ``unit`` now and, on its first use in this phase, start the gather that the last
        iteration's order says comes next."""
        if self._in_backward:
            order, seen = self._backward_order, self._backward_seen
        else:
            order, seen = self._forward_order, self._forward_seen
        if not unit.in_use:
            unit.in_use = True
            position = len(seen)
            seen.append(unit)
            self._start_gather(unit)
            if position + 1 < len(order) and order[position] is unit:
                self._start_gather(order[position + 1])
        self._wait_gather(unit)

    # Hooks.

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        unit = self._unit_of_module[module]
        self._use(unit)
        # Opened once the weights are ready, so the range holds exactly the unit's own compute.
        profile_range = torch.profiler.record_function(f"fsdp.forward.{unit.name}")
        profile_range.__enter__()
        params = [s.param for s in unit.slots]
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            fulls = _UseFullWeights.apply(self, unit, *params)
        else:
            fulls = tuple(unit.full_weight(s) for s in unit.slots)
        for owner, i in unit.uses:
            owner._parameters["weight"] = fulls[i]
        self._in_forward.setdefault(module, []).append(profile_range)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        unit = self._unit_of_module[module]
        self._in_forward[module].pop().__exit__(None, None, None)
        for owner, i in unit.uses:
            owner._parameters["weight"] = unit.slots[i].param
        # A recomputation (activation checkpointing) inside the unit's own backward keeps the weights: the
        # recomputed views are what that backward reads. Otherwise autograd's views wait, storage-less, for
        # the re-gather at the start of the unit's backward.
        if unit.backward_uses == 0:
            self._free(unit)
        if not torch.is_grad_enabled():
            return output
        return _on_backward(output, lambda: self._pre_backward(unit))

    def _pre_backward(self, unit: Unit) -> None:
        unit.backward_uses += 1
        self._use(unit)

    def _start_backward(self) -> None:
        self._in_backward = True

    def _reduce_scatter(self, unit: Unit, grads: tuple[torch.Tensor | None, ...]) -> None:
        unit.backward_uses -= 1
        if unit.backward_uses <= 0:
            self._free(unit)
        # Wait for the oldest reduce-scatter before allocating, so this unit's buffer can reuse its memory.
        while len(self._pending_reduce_scatters) >= MAX_PENDING_REDUCE_SCATTERS:
            self._retire_reduce_scatter()
        # Rank-major, the layout reduce_scatter_tensor splits: row r holds rank r's pieces of every weight.
        # Gradients are reduced in the master dtype: summing low-precision gradients over ranks loses bits.
        flat = torch.empty(self._world_size * unit.shard_numel, dtype=unit.local.dtype, device=unit.local.device)
        rows = flat.view(self._world_size, unit.shard_numel)
        for s, grad in zip(unit.slots, grads, strict=True):
            piece = rows[:, s.offset : s.offset + s.shard_numel]
            if grad is None:
                piece.zero_()
            elif s.numel == self._world_size * s.shard_numel:
                piece.copy_(grad.reshape(self._world_size, s.shard_numel))
            else:
                padded = torch.zeros(self._world_size * s.shard_numel, dtype=flat.dtype, device=flat.device)
                padded[: s.numel] = grad.reshape(-1)
                piece.copy_(padded.view(self._world_size, s.shard_numel))
        if self._world_size == 1:
            self._pending_reduce_scatters.append((unit, None, flat, flat))
            return
        out = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
        with torch.profiler.record_function(f"fsdp.reduce_scatter.{unit.name}"):
            if torch.are_deterministic_algorithms_enabled():
                # The ranks' gradients added in the batch tree's order (cs336_comms.reduce): with the
                # deterministic cs336_basics layers, bit-identical to one process on the whole batch.
                work = tree_reduce_scatter(out, flat, group=self._group)
            else:
                work = dist.reduce_scatter_tensor(out, flat, group=self._group, async_op=True)
        self._pending_reduce_scatters.append((unit, work, out, flat))

    def _retire_reduce_scatter(self) -> None:
        unit, work, out, _ = self._pending_reduce_scatters.pop(0)
        if work is not None:
            work.wait()
        unit.grad_parts.append(out)

    def _all_reduce_grad(self, param: nn.Parameter) -> None:
        if self._world_size == 1:
            return
        if param in self._pending_all_reduces:
            raise RuntimeError("call finish_gradient_synchronization() after each backward pass")
        if torch.are_deterministic_algorithms_enabled():
            self._pending_all_reduces[param] = tree_all_reduce(param.grad, group=self._group)
        else:
            self._pending_all_reduces[param] = dist.all_reduce(param.grad, group=self._group, async_op=True)

    # Public API.

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Weights gathered ahead for a backward that did not use them must not outlive an optimizer step.
        for unit in self._units:
            self._free(unit)
        if self._forward_seen:
            self._forward_order = self._forward_seen
        if self._backward_seen:
            self._backward_order = self._backward_seen
        self._forward_seen, self._backward_seen = [], []
        self._in_backward = False
        output = self.module(*args, **kwargs)
        return _on_backward(output, self._start_backward) if torch.is_grad_enabled() else output

    def finish_gradient_synchronization(self) -> None:
        """Wait for every gradient collective; leaves each sharded ``.grad`` as the averaged local shard
        gradient and each replicated ``.grad`` as the average over ranks, both in the parameter dtype."""
        while self._pending_reduce_scatters:
            self._retire_reduce_scatter()
        for unit in self._units:
            if not unit.grad_parts:
                continue
            grad = unit.grad_parts[0]
            for part in unit.grad_parts[1:]:
                grad += part
            unit.grad_parts = []
            if self._world_size > 1:
                grad.div_(self._world_size)
            for s in unit.slots:
                if not s.param.requires_grad:
                    continue
                piece = grad[s.offset : s.offset + s.shard_numel]
                if s.param.grad is None:
                    s.param.grad = piece
                else:
                    s.param.grad += piece
        for param, work in self._pending_all_reduces.items():
            work.wait()
            param.grad.div_(self._world_size)
        self._pending_all_reduces = {}
        for unit in self._units:
            self._free(unit)

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the wrapped module, unsharded and in the master dtype, by its original name.

        Collective: every rank must call it; every rank gets the full dict.
        """
        full: dict[str, torch.Tensor] = {}
        for unit in self._units:
            gathered = unit.local.detach().clone()
            if self._world_size > 1:
                out = torch.empty(self._world_size * unit.shard_numel, dtype=gathered.dtype, device=gathered.device)
                self._launch_gather(unit, gathered, out, async_op=False)
                gathered = out
            if not self._layouts_coincide(unit):
                gathered = self._slot_major(unit, gathered, torch.empty_like(gathered))
            for s in unit.slots:
                start = self._world_size * s.offset
                full[s.name] = gathered[start : start + s.numel].view(s.shape)
        return {name: full[name] if name in full else p.detach().clone() for name, p in self.module.named_parameters()}

    def sharded_parameters(self) -> dict[str, nn.Parameter]:
        """The sharded parameters by name; each holds this rank's padded flat piece."""
        return {name: s.param for name, s in self._slot_of_name.items()}

    def state_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``local``, shaped like this rank's piece of parameter ``name`` (the parameter's ``.data`` or optimizer
        state of its shape), as ``torch.distributed.checkpoint`` saves and loads it: for a sharded weight a DTensor
        of the unpadded piece over the flat (numel,) weight, so each rank writes and reads only its own part (a plain
        flat tensor without a process group); for a replicated parameter ``local`` itself.

        Raises:
            ValueError: if ``name`` is not a parameter of the wrapped module, or ``local`` is not shaped like it.
        """
        slot = self._slot_of_name.get(name)
        if slot is None:
            param = self._replicated_by_name.get(name)
            if param is None:
                raise ValueError(f"{name!r} is not a parameter of the wrapped module")
            expected = param.shape
        else:
            expected = torch.Size([slot.shard_numel])
        if local.shape != expected:
            raise ValueError(f"state of {name} must have this rank's shape {tuple(expected)}, got {tuple(local.shape)}")
        if slot is None:
            return local
        piece = local[: slot.valid]
        if not dist.is_initialized():
            return piece
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self._group or dist.group.WORLD, piece.device.type)
        return DTensor.from_local(
            piece, self._mesh, [Shard(0)], run_check=False, shape=torch.Size([slot.numel]), stride=(1,)
        )
