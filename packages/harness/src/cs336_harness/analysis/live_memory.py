"""The peak memory of a piece of PyTorch code counted from its tensors' storages, on any device or on fake tensors.

:class:`LiveMemory` is a ``TorchDispatchMode``: every operator's output whose storage it has not seen adds that
storage's bytes, and a weak reference on the storage takes them off when autograd, the caller or a cache lets it go.
Storages resized in place (FSDP frees a gathered weight with ``untyped_storage().resize_(0)`` and regathers into
the same storage) are counted at their new size. So what it reports is what the CUDA caching allocator's
``memory_allocated`` would, less the allocator's rounding and the libraries' workspaces (cuBLAS' tens of MiB).

Inside :func:`fake_tensors` no operator computes anything, so the peak of a whole training step at the leaderboard's
shape takes seconds on a laptop's CPU. Host reads of fake values (an input check's ``.item()``) get 0, what a
check that passes sees, or the value given (an optimizer's count of steps taken must not be 0); code whose memory
depends on tensor values cannot be counted this way. Some of PyTorch's derivative formulas work in place on a
temporary of their own, but out of place on a tensor subclass or under a dispatch mode such as this one (gather's
backward: zeros, then ``scatter_add_``); inside those backward nodes the in-place operator runs, so what is counted
is what a run without the mode holds (:data:`_IN_PLACE_ON_DEVICE`).

    with fake_tensors(), LiveMemory() as live:
        model = build(...); loss = model(x); loss.backward()
    live.peak_bytes, live.peak_sites()[:5]
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

_SITE_FRAMES = 3  # innermost frames of our packages that name where a storage was made
# Out-of-place operators that a backward node's formula calls under a dispatch mode or on fake tensors where it
# otherwise writes its own zeros in place (counted as made, they would be a second full-size gradient): the operator,
# the node, the in-place operator.
_IN_PLACE_ON_DEVICE = {torch.ops.aten.scatter_add.default: ("GatherBackward0", torch.ops.aten.scatter_add_.default)}


@dataclass(frozen=True)
class Site:
    """Storages alive at the peak that one operator made at one place: ``what`` (operator, shape, dtype), ``where``
    (the innermost frames in ``cs336`` packages), their ``count`` and ``bytes``."""

    what: str
    where: str
    count: int
    bytes: int


class LiveMemory(TorchDispatchMode):
    """Counts the bytes of live tensor storages made inside it (module docstring); ``peak_bytes`` is the most
    held at once, ``live_bytes`` what is held now. Storages made before it are not counted.

    Args:
        sites: also record where each storage was made, for :meth:`peak_sites` (a Python stack per new storage:
            several times slower).
        host_read: what a host read of a fake value gets (module docstring).
    """

    def __init__(self, sites: bool = False, host_read: int = 0) -> None:
        super().__init__()
        self.sites = sites
        self.host_read = host_read
        self.live_bytes = 0
        self.peak_bytes = 0
        self._ids: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> id
        self._held: dict[int, tuple[int, str]] = {}  # id -> (bytes now, where it was made)
        self._next_id = 0
        self._at_peak: dict[int, tuple[int, str]] = {}
        self._resize: Callable[..., Any] | None = None

    def __enter__(self) -> LiveMemory:
        # Storage resizes do not pass the dispatcher: count them where Python calls them.
        self._resize = original = torch.UntypedStorage.resize_

        def resize(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            out = original(storage, size)
            self._resized(storage, size)
            return out

        torch.UntypedStorage.resize_ = resize
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)

    def reset_peak(self) -> None:
        """Start a new peak from what is held now (as ``torch.cuda.reset_peak_memory_stats``)."""
        self.peak_bytes = self.live_bytes
        self._at_peak = dict(self._held) if self.sites else {}

    def peak_sites(self) -> list[Site]:
        """What was alive at the peak, by the operator and place that made it, most bytes first (needs
        ``sites=True``)."""
        if not self.sites:
            raise ValueError("peak_sites needs LiveMemory(sites=True)")
        total: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for nbytes, site in self._at_peak.values():
            total[site] += nbytes
            count[site] += 1
        return [Site(*site.split(" @ ", 1), count=count[site], bytes=n) for site, n in total.most_common()]

    def _note_peak(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            if self.sites:
                self._at_peak = dict(self._held)

    def _resized(self, storage: torch.UntypedStorage, size: int) -> None:
        key = self._ids.get(storage)
        if key is None or key not in self._held:
            return
        before, site = self._held[key]
        self._held[key] = (size, site)
        self.live_bytes += size - before
        self._note_peak()

    def _freed(self, key: int) -> None:
        self.live_bytes -= self._held.pop(key)[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return self.host_read  # a host read of a fake value (module docstring)
        if func in _IN_PLACE_ON_DEVICE:
            node_name, in_place = _IN_PLACE_ON_DEVICE[func]
            node = torch._C._current_autograd_node()
            if node is not None and node.name() == node_name:
                func = in_place
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (a view, an in-place op) is not new, even when made before the mode.
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage in self._ids or storage._cdata in inputs:
                continue
            key = self._next_id = self._next_id + 1
            self._ids[storage] = key
            site = f"{func} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} @ {_where()}" if self.sites else ""
            self._held[key] = (storage.nbytes(), site)
            self.live_bytes += storage.nbytes()
            weakref.finalize(storage, self._freed, key)
            self._note_peak()
        return out


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if "cs336" in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-_SITE_FRAMES:]))


@contextlib.contextmanager
def fake_tensors() -> Iterator[FakeTensorMode]:
    """Every tensor made inside is fake: shapes, dtypes and aliasing without memory or compute."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode
