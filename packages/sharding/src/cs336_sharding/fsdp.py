"""Fully sharded data parallel training (FSDP; ZeRO stage 3, Rajbhandari et al., 2020).

:class:`FSDP` shards the weight of every module that owns a 2-D ``weight`` (Linear and Embedding in our
model) over the ranks and keeps every other parameter (norm weights, biases) replicated::

    model = FSDP(model, compute_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())     # sees ordinary fp32 leaf params: the local shards
    loss_fn(model(x_local), y_local).backward()
    model.finish_gradient_synchronization()         # every .grad is now the averaged local shard gradient
    opt.step(); opt.zero_grad()

Sharding is flat: a weight of ``n`` elements is flattened, zero-padded to ``world_size * ceil(n /
world_size)`` and split into equal pieces, so any shape works. ``param.data`` is replaced by the local
piece, which keeps names, ``requires_grad`` and the optimizer's view of the model unchanged; the padding
has zero gradient, so it stays zero under SGD and AdamW and is never gathered back.

Forward: a pre-hook all-gathers the module's weight (cast to ``compute_dtype`` first, so communication is
in the compute dtype too), swaps it in for the module's forward and frees it afterwards. While layer ``i``
runs, only layer ``i + 1`` is being gathered, so a gather starts after the layer two before it finished.
Backward: the full weight is not kept for backward; a saved-tensor hook records a reference instead and
re-gathers the weight when autograd needs it, prefetching the next layer's weight. The gradient of the
full weight is reduce-scattered in fp32 as soon as autograd produces it; replicated gradients are
all-reduced as soon as they are accumulated. Execution orders are recorded each iteration and used to
predict the next gather in the following one, identically on every rank.

Limitation: the saved-tensor hook is active inside each sharded module's forward, so an outer
``saved_tensors_hooks`` user (e.g. non-reentrant activation checkpointing) does not see the tensors saved
inside those modules.

:func:`gather_full_params` returns every parameter unsharded, by its name in the original module;
:func:`save_checkpoint` / :func:`load_checkpoint` write and read sharded model and optimizer state with
``torch.distributed.checkpoint``, each rank writing only its own shards.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

# Reduce-scatters kept in flight during backward before the oldest is waited for; each holds a full fp32
# gradient buffer until then, so this bounds gradient memory to a few layers.
MAX_PENDING_REDUCE_SCATTERS = 2


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shards_weight(module: nn.Module) -> bool:
    """The sharding policy: a module whose own ``weight`` parameter is 2-D (Linear, Embedding)."""
    weight = module._parameters.get("weight")
    return isinstance(weight, nn.Parameter) and weight.dim() == 2


class _Unit:
    """One sharded weight: the parameter (holding the local padded shard), the gathered full weight while
    it is in use, and the gradient pieces reduce-scattered to this rank."""

    def __init__(self, name: str, param: nn.Parameter, rank: int, world_size: int):
        self.name, self.param = name, param
        self.shape = param.shape
        self.numel = param.numel()
        self.shard_numel = math.ceil(self.numel / world_size)
        # Real (unpadded) elements in this rank's shard; the same split as torch.chunk over the flat weight.
        self.valid = max(0, min(self.shard_numel, self.numel - rank * self.shard_numel))
        self.full: torch.Tensor | None = None  # (world_size * shard_numel,) in the compute dtype
        self.gather: tuple[dist.Work, torch.Tensor] | None = None  # in flight: work and its input
        self.grad_parts: list[torch.Tensor] = []

    def full_weight(self) -> torch.Tensor:
        assert self.full is not None and self.gather is None, f"{self.name} is not gathered"
        return self.full[: self.numel].view(self.shape)


class _WeightRef:
    """What a saved-tensor hook keeps instead of a gathered weight (or a view of it)."""

    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit: _Unit, t: torch.Tensor):
        self.unit, self.size, self.stride, self.offset = unit, t.size(), t.stride(), t.storage_offset()


class _UseFullWeight(torch.autograd.Function):
    """Identity from the shard to the gathered full weight; its backward hands the full weight's gradient
    to the reduce-scatter. It returns no gradient for the shard: that arrives in
    ``finish_gradient_synchronization``, once the collective is done."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, fsdp: FSDP, unit: _Unit) -> torch.Tensor:
        ctx.fsdp, ctx.unit = fsdp, unit
        return unit.full_weight()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.fsdp._reduce_scatter(ctx.unit, grad)
        return None, None, None


class FSDP(nn.Module):
    """Fully sharded data parallel wrapper around ``module``.

    Args:
        module: the model; parameters and buffers are broadcast from rank 0 first, so ranks agree.
        compute_dtype: if given, weights are cast to it before they are gathered and used; master
            weights, gradients handed to the optimizer and updates stay in the parameters' dtype.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        floating = isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
        if compute_dtype is not None and not floating:
            raise TypeError(f"compute_dtype must be a floating torch.dtype or None, got {compute_dtype!r}")
        self.module = module
        self.compute_dtype = compute_dtype
        self._rank, self._world_size = _rank_and_world()
        names = {p: n for n, p in module.named_parameters()}
        for p, name in names.items():
            if not p.dtype.is_floating_point:
                raise TypeError(f"parameter {name} must be floating point, got {p.dtype}")
        if self._world_size > 1:
            with torch.no_grad():
                for t in [*names, *module.buffers()]:
                    dist.broadcast(t.data, src=0)

        self._units: list[_Unit] = []
        self._unit_of_module: dict[nn.Module, _Unit] = {}
        by_param: dict[nn.Parameter, _Unit] = {}
        for mod in module.modules():
            if not shards_weight(mod):
                continue
            weight = mod._parameters["weight"]
            if weight not in by_param:  # a weight tied between modules is one unit
                unit = _Unit(names[weight], weight, self._rank, self._world_size)
                self._shard(unit)
                by_param[weight] = unit
                self._units.append(unit)
            self._unit_of_module[mod] = by_param[weight]
            mod.register_forward_pre_hook(self._pre_forward)
            mod.register_forward_hook(self._post_forward, always_call=True)
        self._replicated = [p for p in names if p not in by_param]
        # Gradient hooks live in C++, out of the garbage collector's sight: a bound method there would keep
        # this wrapper (and every shard) alive forever, so the hook holds only a weak reference.
        owner = weakref.ref(self)
        for p in self._replicated:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda param: owner()._all_reduce_grad(param))

        self._pending_reduce_scatters: list[tuple[_Unit, dist.Work | None, torch.Tensor, torch.Tensor]] = []
        self._pending_all_reduces: dict[nn.Parameter, dist.Work] = {}
        # Per-call state of a module's forward: saved-tensor hooks and the profiler range, exited after it.
        self._in_forward: dict[nn.Module, list[Any]] = {}
        # Orders of weight uses seen in the last iteration (the prediction) and in this one.
        self._forward_order: list[_Unit] = list(self._units)
        self._backward_order: list[_Unit] = []
        self._forward_seen: list[_Unit] = []
        self._backward_seen: list[_Unit] = []
        self._mesh = None

    # Sharding and gathering.

    def _shard(self, unit: _Unit) -> None:
        with torch.no_grad():
            flat = unit.param.data.reshape(-1)
            start = self._rank * unit.shard_numel
            shard = torch.zeros(unit.shard_numel, dtype=flat.dtype, device=flat.device)
            shard[: unit.valid] = flat[start : start + unit.valid]
        unit.param.data = shard

    def _start_gather(self, unit: _Unit) -> None:
        if unit.full is not None:
            return
        shard = unit.param.detach()
        # Cast before communicating: the gather moves compute-dtype bytes, not fp32 ones.
        local = shard.clone() if self.compute_dtype in (None, shard.dtype) else shard.to(self.compute_dtype)
        if self._world_size == 1:
            unit.full = local
            return
        unit.full = torch.empty(self._world_size * unit.shard_numel, dtype=local.dtype, device=local.device)
        with torch.profiler.record_function(f"fsdp.all_gather.{unit.name}"):
            work = dist.all_gather_into_tensor(unit.full, local, async_op=True)
        unit.gather = (work, local)

    def _wait_gather(self, unit: _Unit) -> None:
        self._start_gather(unit)
        if unit.gather is not None:
            unit.gather[0].wait()
            unit.gather = None

    def _free(self, unit: _Unit) -> None:
        if unit.gather is not None:  # never drop a buffer a collective may still write into
            unit.gather[0].wait()
            unit.gather = None
        unit.full = None

    def _use(self, unit: _Unit, order: list[_Unit], seen: list[_Unit]) -> None:
        """Gather ``unit`` now, and start the gather that the last iteration's order says comes next."""
        position = len(seen)
        seen.append(unit)
        self._start_gather(unit)
        if position + 1 < len(order) and order[position] is unit:
            self._start_gather(order[position + 1])
        self._wait_gather(unit)

    # Hooks.

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        unit = self._unit_of_module[module]
        self._use(unit, self._forward_order, self._forward_seen)
        # Opened once the weight is ready, so the range holds exactly the layer's own compute.
        profile_range = torch.profiler.record_function(f"fsdp.forward.{unit.name}")
        profile_range.__enter__()
        contexts: list[Any] = [profile_range]
        if torch.is_grad_enabled() and unit.param.requires_grad:
            module._parameters["weight"] = _UseFullWeight.apply(unit.param, self, unit)
            saved = torch.autograd.graph.saved_tensors_hooks(*self._saved_tensor_hooks(unit))
            saved.__enter__()
            contexts.append(saved)
        else:
            module._parameters["weight"] = unit.full_weight()
        self._in_forward.setdefault(module, []).append(contexts)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        unit = self._unit_of_module[module]
        for context in reversed(self._in_forward[module].pop()):
            context.__exit__(None, None, None)
        module._parameters["weight"] = unit.param
        self._free(unit)

    def _saved_tensor_hooks(self, unit: _Unit) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
        def pack(t: torch.Tensor) -> Any:
            full = unit.full
            if full is not None and t.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
                return _WeightRef(unit, t)
            return t

        def unpack(saved: Any) -> torch.Tensor:
            if not isinstance(saved, _WeightRef):
                return saved
            self._use(saved.unit, self._backward_order, self._backward_seen)
            assert saved.unit.full is not None
            return saved.unit.full.as_strided(saved.size, saved.stride, saved.offset)

        return pack, unpack

    def _reduce_scatter(self, unit: _Unit, grad: torch.Tensor) -> None:
        self._free(unit)
        # Gradients are reduced in the master dtype: summing low-precision gradients over ranks loses bits.
        flat = grad.reshape(-1).to(unit.param.dtype)
        padded_numel = self._world_size * unit.shard_numel
        if flat.numel() != padded_numel:
            padded = torch.zeros(padded_numel, dtype=flat.dtype, device=flat.device)
            padded[: unit.numel] = flat
            flat = padded
        if self._world_size == 1:
            self._pending_reduce_scatters.append((unit, None, flat, flat))
            return
        out = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
        with torch.profiler.record_function(f"fsdp.reduce_scatter.{unit.name}"):
            work = dist.reduce_scatter_tensor(out, flat, async_op=True)
        self._pending_reduce_scatters.append((unit, work, out, flat))
        while len(self._pending_reduce_scatters) > MAX_PENDING_REDUCE_SCATTERS:
            self._retire_reduce_scatter()

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
        self._pending_all_reduces[param] = dist.all_reduce(param.grad, async_op=True)

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
        return self.module(*args, **kwargs)

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
            if unit.param.grad is None:
                unit.param.grad = grad
            else:
                unit.param.grad += grad
        for param, work in self._pending_all_reduces.items():
            work.wait()
            param.grad.div_(self._world_size)
        self._pending_all_reduces = {}
        for unit in self._units:
            self._free(unit)

    def sharded_parameters(self) -> dict[str, nn.Parameter]:
        """The sharded parameters by name; each holds this rank's padded flat piece."""
        return {u.name: u.param for u in self._units}

    def _global(self, unit: _Unit, local_padded: torch.Tensor) -> torch.Tensor:
        """This rank's unpadded piece as a DTensor over the flat (numel,) weight, for checkpointing."""
        local = local_padded[: unit.valid]
        if not dist.is_initialized():
            return local
        if self._mesh is None:
            self._mesh = init_device_mesh(local.device.type, (self._world_size,))
        return DTensor.from_local(
            local, self._mesh, [Shard(0)], run_check=False, shape=torch.Size([unit.numel]), stride=(1,)
        )


def gather_full_params(fsdp_model: FSDP) -> dict[str, torch.Tensor]:
    """Every parameter of the wrapped module, unsharded and in the master dtype, by its original name.

    Collective: every rank must call it; every rank gets the full dict.
    """
    if not isinstance(fsdp_model, FSDP):
        raise TypeError(f"expected an FSDP model, got {type(fsdp_model).__name__}")
    units = {u.param: u for u in fsdp_model._units}
    out = {}
    for name, p in fsdp_model.module.named_parameters():
        unit = units.get(p)
        if unit is None:
            out[name] = p.detach().clone()
            continue
        full = torch.empty(fsdp_model._world_size * unit.shard_numel, dtype=p.dtype, device=p.device)
        if fsdp_model._world_size == 1:
            full.copy_(p.detach())
        else:
            dist.all_gather_into_tensor(full, p.detach())
        out[name] = full[: unit.numel].view(unit.shape)
    return out


# Checkpoints: flat dicts whose keys are "model.<param>", "optim.<param>.<state key>" and "optim.groups".
# Sharded weights, and optimizer state of their shape, are saved as DTensors over the flat unpadded weight,
# so each rank writes and reads only its own piece.


def _param_names(optimizer: torch.optim.Optimizer, fsdp_model: FSDP) -> list[list[str]]:
    names = {p: n for n, p in fsdp_model.module.named_parameters()}
    try:
        return [[names[p] for p in g["params"]] for g in optimizer.param_groups]
    except KeyError:
        raise ValueError("the optimizer must be built over the FSDP model's parameters") from None


def _model_state(fsdp_model: FSDP) -> dict[str, torch.Tensor]:
    units = {u.name: u for u in fsdp_model._units}
    return {
        f"model.{name}": fsdp_model._global(units[name], p.data) if name in units else p.data
        for name, p in fsdp_model.module.named_parameters()
    }


def save_checkpoint(path: str | Path, fsdp_model: FSDP, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write the model's (and the optimizer's) sharded state under directory ``path``; collective."""
    state: dict[str, Any] = _model_state(fsdp_model)
    if optimizer is not None:
        units = {u.name: u for u in fsdp_model._units}
        groups = _param_names(optimizer, fsdp_model)
        for group, names in zip(optimizer.param_groups, groups, strict=True):
            for param, name in zip(group["params"], names, strict=True):
                for key, value in optimizer.state.get(param, {}).items():
                    if name in units and torch.is_tensor(value) and value.shape == param.shape:
                        value = fsdp_model._global(units[name], value)
                    state[f"optim.{name}.{key}"] = value
        # A tuple, because torch.distributed.checkpoint would flatten a list into one entry per element.
        state["optim.groups"] = tuple(
            {**{k: v for k, v in g.items() if k != "params"}, "params": names}
            for g, names in zip(optimizer.param_groups, groups, strict=True)
        )
    dcp.save(state, checkpoint_id=str(path))


def load_checkpoint(path: str | Path, fsdp_model: FSDP, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Restore what :func:`save_checkpoint` wrote into the same model (at any world size); collective."""
    state: dict[str, Any] = _model_state(fsdp_model)  # loaded in place into the parameters
    padded: dict[str, torch.Tensor] = {}  # optimizer state shaped like a shard, at full padded size
    if optimizer is not None:
        units = {u.name: u for u in fsdp_model._units}
        params = dict(fsdp_model.module.named_parameters())
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        for fqn, meta in metadata.items():
            if not fqn.startswith("optim.") or fqn == "optim.groups":
                continue
            name, key = fqn[len("optim.") :].rsplit(".", 1)
            param = params[name]
            if not isinstance(meta, dcp.metadata.TensorStorageMetadata):
                state[fqn] = None  # a Python value; loading replaces it
            elif name in units and tuple(meta.size) == (units[name].numel,):
                padded[fqn] = torch.zeros_like(param.data, dtype=meta.properties.dtype)
                state[fqn] = fsdp_model._global(units[name], padded[fqn])
            else:
                state[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype, device=param.device)
        state["optim.groups"] = None
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        return
    groups = _param_names(optimizer, fsdp_model)
    index = {name: i for i, name in enumerate(n for names in groups for n in names)}
    optim_state: dict[int, dict[str, Any]] = {}
    for fqn, value in state.items():
        if fqn.startswith("optim.") and fqn != "optim.groups":
            name, key = fqn[len("optim.") :].rsplit(".", 1)
            optim_state.setdefault(index[name], {})[key] = padded.get(fqn, value)
    saved_groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["optim.groups"]]
    optimizer.load_state_dict({"state": optim_state, "param_groups": saved_groups})
