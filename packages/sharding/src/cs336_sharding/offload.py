"""A block's saved activations moved to host memory in its forward and brought back for its backward.

Offloading is the other way than recomputation (:mod:`cs336_sharding.checkpointing`) to keep a block's activations
out of device memory between its forward and its backward: the block runs whole, and every tensor autograd saves for
its backward (through ``torch.autograd.graph.saved_tensors_hooks``) is copied to a pinned host buffer on a side
stream while the following blocks compute, then copied back on that stream while a later block's backward runs.
It trades the recomputation's FLOPs for two PCIe transfers of the block's saved bytes, so it wins where the
transfers hide under the compute and the recomputation does not::

    offload = BlockOffload(block)
    with offload.saving():
        y = block(x)                       # saved tensors leave for pinned host memory
    y.register_hook(offload.prefetch_hook)  # or call offload.prefetch() before the block's backward
    ...backward...                         # each saved tensor comes back once, waited for by the stream using it

Rules, and why:

- Tensors under :data:`MIN_BYTES` stay where they are: a copy's fixed cost buys nothing for them.
- The block's weights stay (tensors whose storage is that of one of the block's parameters when the forward runs):
  FSDP (:mod:`cs336_sharding.fsdp`) frees and re-gathers its gathered weights itself, and plain parameters live
  through the step anyway.
- A tensor saved several times (one normed input feeding three projections) is copied once: views with the same
  storage, offset, shape, strides and dtype share one host copy. The forward holds each saved tensor until the
  block's forward ends, so no new tensor can take its address and be mistaken for it.
- One side stream per device does both directions, in order: a host buffer's next forward copy waits for the
  previous backward's read of it. A device tensor being copied out is marked used by the side stream
  (``record_stream``), so the caching allocator reuses its memory only once the copy is done; a tensor brought back
  is marked used by the stream that reads it.
- Host buffers are pinned once and reused step after step (same pack order, same shapes); a changed shape gets a
  new buffer. On CPU tensors the "host" copy is a plain copy, with no streams: the logic runs, nothing is saved.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

MIN_BYTES = 1 << 20

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


@dataclass(eq=False)
class _Saved:
    """One offloaded tensor: its host copy, the device it came from, the copy back once fetched (with the event that
    says it is there), the device tensor itself while the block's forward runs, and unpacks still to come."""

    host: torch.Tensor
    device: torch.device
    source: torch.Tensor | None
    uses: int = 1
    fetched: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


class BlockOffload:
    """Offloads the tensors one block saves for its backward (the module docstring's rules). ``block`` names the
    weights that stay; :meth:`saving` wraps the block's forward; :meth:`prefetch` (or :meth:`prefetch_hook`, as a
    tensor hook) starts bringing them back. Reusable step after step; one forward's tensors at a time."""

    def __init__(self, block: nn.Module):
        if not isinstance(block, nn.Module):
            raise TypeError(f"BlockOffload needs the block (an nn.Module), got {type(block).__name__}")
        self.block = block
        self._saved: list[_Saved] = []
        self._by_view: dict[tuple, _Saved] = {}
        self._weights: set[int] | None = None
        self._host: list[tuple[tuple, torch.Tensor]] = []  # (shape, strides and dtype copied, pinned buffer)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of the last forward's tensors held in host memory."""
        return sum(s.host.numel() * s.host.element_size() for s in self._saved)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Run the block's forward inside this: what autograd saves goes to host memory."""
        self._saved, self._by_view, self._weights = [], {}, None
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._by_view, self._weights = {}, None
            for saved in self._saved:
                saved.source = None

    def prefetch(self) -> None:
        """Start copying the last forward's tensors back to their device (on the side stream; each unpack waits for
        its own copy)."""
        for saved in self._saved:
            if saved.fetched is None and saved.uses > 0:
                self._fetch(saved)

    def prefetch_hook(self, grad: torch.Tensor) -> None:
        """:meth:`prefetch` as a tensor hook: on the output of the block after this one, it starts when that
        block's backward does."""
        self.prefetch()

    def _weight_storages(self) -> set[int]:
        if self._weights is None:  # read once the forward runs, when FSDP has swapped its gathered weights in
            self._weights = {p.untyped_storage().data_ptr() for p in self.block.parameters()}
        return self._weights

    def _host_buffer(self, index: int, t: torch.Tensor) -> torch.Tensor:
        key = (tuple(t.shape), t.stride(), t.dtype)
        if index < len(self._host) and self._host[index][0] == key:
            return self._host[index][1]
        # empty_like keeps t's strides when they are dense (a transposed view), so the copy back has them too;
        # otherwise it is contiguous.
        host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
        if index < len(self._host):
            self._host[index] = (key, host)
        else:
            self._host.append((key, host))
        return host

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Saved:
        if t.numel() * t.element_size() < MIN_BYTES or t.untyped_storage().data_ptr() in self._weight_storages():
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        saved = self._by_view.get(key)
        if saved is not None:
            saved.uses += 1
            return saved
        host = self._host_buffer(len(self._saved), t)
        if t.is_cuda:
            side = _side_stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
            t.record_stream(side)
        else:
            host.copy_(t)
        saved = _Saved(host, t.device, source=t)
        self._saved.append(saved)
        self._by_view[key] = saved
        return saved

    def _fetch(self, saved: _Saved) -> None:
        if saved.device.type != "cuda":
            saved.fetched = saved.host
            return
        side = _side_stream(saved.device)
        with torch.cuda.stream(side):
            saved.fetched = torch.empty_like(saved.host, device=saved.device)
            saved.fetched.copy_(saved.host, non_blocking=True)
            saved.ready = side.record_event()

    def _unpack(self, packed: torch.Tensor | _Saved) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.fetched is None:
            self._fetch(packed)
        tensor = packed.fetched
        if packed.ready is not None:
            current = torch.cuda.current_stream(packed.device)
            current.wait_event(packed.ready)
            tensor.record_stream(current)
        packed.uses -= 1
        if packed.uses <= 0:  # the last unpack: the device copy is autograd's alone from here
            packed.fetched, packed.ready = None, None
        return tensor
