"""Saving and loading an :class:`~cs336_sharding.fsdp.FSDP` model's training state (model and optimizer), sharded.

    save_state("ckpt/step_100", fsdp_model, optimizer)     # collective: each rank writes only its own shards
    load_state("ckpt/step_100", fsdp_model, optimizer)     # into the same model, at any world size

The state is a flat dict for ``torch.distributed.checkpoint`` whose keys are ``model.<param>``,
``optim.<param>.<state key>`` and ``optim.groups`` (the parameter groups, parameters by name). Sharded weights, and
optimizer state of their shape, are DTensors over the flat unpadded weight (:meth:`FSDP.state_tensor`), so a rank
reads and writes its own piece and a save loads at another world size. "State", not "checkpoint": in this package
a checkpoint is activation checkpointing (:mod:`cs336_sharding.checkpointing`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from cs336_sharding.fsdp import FSDP


def _check(fsdp_model: FSDP, optimizer: torch.optim.Optimizer | None) -> None:
    if not isinstance(fsdp_model, FSDP):
        raise TypeError(f"expected an FSDP model, got {type(fsdp_model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


@contextlib.contextmanager
def _naming_the_path(what: str, path: str | Path) -> Iterator[None]:
    """torch.distributed.checkpoint's failures as one error that names ``path``: an OSError (of the cause's errno) when
    every rank failed on the file system, else a ValueError. Its CheckpointException is a BaseException, which an
    ``except Exception`` misses, and its message lists the failed ranks, not what failed."""
    try:
        yield
    except dcp.api.CheckpointException as error:
        causes = {rank: failure[0] for rank, failure in error.failures.items()}
        rank, cause = next(iter(causes.items()))
        where = f"rank {rank}" if len(causes) == 1 else f"ranks {', '.join(map(str, causes))}"
        if all(isinstance(c, OSError) and c.errno for c in causes.values()):
            raise OSError(cause.errno, f"{what} {path}: {cause.strerror} (on {where})") from cause
        raise ValueError(f"{what} {path}: {type(cause).__name__}: {cause} (on {where})") from cause
    except OSError as error:
        raise OSError(error.errno, f"{what} {path}: {error.strerror or error}") from error


def _param_names(optimizer: torch.optim.Optimizer, fsdp_model: FSDP) -> list[list[str]]:
    names = {p: n for n, p in fsdp_model.module.named_parameters()}
    try:
        return [[names[p] for p in g["params"]] for g in optimizer.param_groups]
    except KeyError:
        raise ValueError("the optimizer must be built over the FSDP model's parameters") from None


def _model_state(fsdp_model: FSDP) -> dict[str, torch.Tensor]:
    return {f"model.{name}": fsdp_model.state_tensor(name, p.data) for name, p in fsdp_model.module.named_parameters()}


def save_state(path: str | Path, fsdp_model: FSDP, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write the model's (and the optimizer's) sharded state under directory ``path``; collective.

    Raises:
        OSError: ``path`` cannot be written (naming it and the cause); ValueError for any other failure of the save.
    """
    _check(fsdp_model, optimizer)
    state: dict[str, Any] = _model_state(fsdp_model)
    if optimizer is not None:
        groups = _param_names(optimizer, fsdp_model)
        for group, names in zip(optimizer.param_groups, groups, strict=True):
            for param, name in zip(group["params"], names, strict=True):
                for key, value in optimizer.state.get(param, {}).items():
                    if torch.is_tensor(value) and value.shape == param.shape:
                        value = fsdp_model.state_tensor(name, value)
                    state[f"optim.{name}.{key}"] = value
        # A tuple, because torch.distributed.checkpoint would flatten a list into one entry per element.
        state["optim.groups"] = tuple(
            {**{k: v for k, v in g.items() if k != "params"}, "params": names}
            for g, names in zip(optimizer.param_groups, groups, strict=True)
        )
    with _naming_the_path("save_state could not write", path):
        dcp.save(state, checkpoint_id=str(path))


def load_state(path: str | Path, fsdp_model: FSDP, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Restore what :func:`save_state` wrote into the same model (at any world size); collective.

    Raises:
        OSError: ``path`` cannot be read (naming it and the cause); ValueError when what it holds does not fit.
    """
    _check(fsdp_model, optimizer)
    with _naming_the_path("load_state could not read", path):
        _load(path, fsdp_model, optimizer)


def _load(path: str | Path, fsdp_model: FSDP, optimizer: torch.optim.Optimizer | None) -> None:
    # Read first, also without an optimizer: for a missing folder it is the one read that names the cause.
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state: dict[str, Any] = _model_state(fsdp_model)  # loaded in place into the parameters
    padded: dict[str, torch.Tensor] = {}  # optimizer state shaped like a shard, at full padded size
    if optimizer is not None:
        sharded = fsdp_model.sharded_parameters()
        params = dict(fsdp_model.module.named_parameters())
        for fqn, meta in metadata.items():
            if not fqn.startswith("optim.") or fqn == "optim.groups":
                continue
            name, key = fqn[len("optim.") :].rsplit(".", 1)
            param = params[name]
            if not isinstance(meta, dcp.metadata.TensorStorageMetadata):
                state[fqn] = None  # a Python value; loading replaces it
            elif name in sharded and tuple(meta.size) == tuple(state[f"model.{name}"].shape):
                padded[fqn] = torch.zeros_like(param.data, dtype=meta.properties.dtype)
                state[fqn] = fsdp_model.state_tensor(name, padded[fqn])
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
