"""Data-parallel wrappers: every rank holds the whole model and gradients are averaged by all-reduce.

Four strategies behind one interface, all built on :class:`_GradientSync`:

============== ============================================ ===================================
class          what is all-reduced                          when
============== ============================================ ===================================
NaiveDDP       each gradient on its own                     after backward, one by one
FlatDDP        all gradients concatenated into one buffer   after backward, one call per dtype
OverlappedDDP  each gradient on its own                     during backward, as each is ready
BucketedDDP    buckets of about ``bucket_size_mb`` MiB       during backward, as each bucket fills
============== ============================================ ===================================

Usage is the same for all four (the overlapping ones need ``finish_gradient_synchronization`` to
wait; for the others it is where the communication happens)::

    model = BucketedDDP(model, bucket_size_mb=25)     # over the world of an initialised process group
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()
    optimizer.step()

Each wrapper takes a ``process_group`` (default: the world). Without an initialised process group it runs as a
single rank and communicates nothing, as FSDP and ZeRO-1 (cs336-sharding) do, so a script runs with and without
``torchrun``.

Unused parameters: a parameter without a gradient on some rank contributes zeros to its bucket, so every rank
issues the same collectives. By default (as torch's DDP) every trainable parameter is assumed to get a gradient
in every step, and one no rank used ends with a zero gradient. With ``find_unused_parameters=True`` one more small
all-reduce per step counts the ranks that had each gradient, and a parameter no rank used keeps ``.grad = None``,
as in single-process training.

Gradient accumulation: backward passes run inside ``with model.no_sync():`` only accumulate locally;
the next backward outside it reduces the accumulated sum.

At construction every rank checks that all ranks hold parameters and buffers of the same names, shapes
and dtypes (a ``ValueError`` on every rank otherwise, instead of a hang in a mismatched collective),
then copies rank 0's parameters and buffers to the others. Parameters with ``requires_grad=False`` are
never communicated; a shared (tied) parameter is one ``nn.Parameter`` and is reduced once.

The collectives are issued in bucket order on every rank, whatever order the backward pass makes
gradients ready in (a ready bucket waits for the buckets before it), because NCCL matches collectives
by issue order; this is the same rule torch's DistributedDataParallel follows.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from cs336_comms.process_group import rank_and_world
from cs336_comms.reduce import TreeReduction, tree_all_reduce

__all__ = ["NaiveDDP", "FlatDDP", "OverlappedDDP", "BucketedDDP"]


def _check_same_layout(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError`` on every rank if any rank's parameters or buffers differ from rank 0's."""
    layout = [("param", n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    layout += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    layouts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(layouts, layout, group=group)
    for rank, other in enumerate(layouts[1:], start=1):
        if other == layouts[0]:
            continue
        diff = next(((a, b) for a, b in zip(layouts[0], other, strict=False) if a != b), None)
        detail = (
            f"rank 0 has {diff[0]}, rank {rank} has {diff[1]}" if diff is not None
            else f"rank 0 has {len(layouts[0])} tensors, rank {rank} has {len(other)}"
        )
        raise ValueError(f"data-parallel ranks must hold the same parameters and buffers: {detail}")


class _Bucket:
    """Parameters whose gradients are reduced by one collective, and the state of that collective."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.ready: set[int] = set()  # ids of params whose gradient is final for this step
        self.work: dist.Work | TreeReduction | None = None
        self.flat: torch.Tensor | None = None  # the buffer being reduced when the bucket has several params


class _GradientSync(nn.Module):
    """Shared machinery: layout check, broadcast, buckets, hooks, ``no_sync`` and the final wait.

    Subclasses choose the buckets (``_bucket_params``) and whether buckets are launched from
    post-accumulate-grad hooks during backward (``overlap = True``) or all at the end.
    """

    overlap: bool = False

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None,
                 find_unused_parameters: bool = False):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self._group = process_group
        _, self.world_size = rank_and_world(process_group)
        self.find_unused_parameters = find_unused_parameters
        # parameters() yields a shared parameter once, so tied weights land in one bucket once. A single rank
        # has nothing to exchange: no buckets, no hooks.
        trainable = [p for p in module.parameters() if p.requires_grad] if self.world_size > 1 else []
        if self.world_size > 1:
            self._average_in_collective = dist.get_backend(process_group) == "nccl"
            _check_same_layout(module, process_group)
            with torch.no_grad():
                for t in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(t, group=process_group, group_src=0)
        # Reverse registration order approximates the order backward produces gradients in.
        self._buckets = [_Bucket(ps) for ps in self._bucket_params(trainable[::-1]) if ps]
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b.params}
        self._trainable = [p for b in self._buckets for p in b.params]
        # Kept on the parameters' device so building the per-step flags needs no host-to-device copy.
        self._ones = torch.ones(len(self._trainable), device=trainable[0].device) if trainable else None
        self._next_launch = 0
        self._zero_filled: list[nn.Parameter] = []
        self._sync = True
        if self.overlap:
            # The hooks are stored with the parameters. Were they to hold the wrapper strongly, the wrapper,
            # the model and its gradients would stay alive after the user drops them: a reference cycle
            # through autograd's hook storage, which the garbage collector cannot see.
            wrapper = weakref.ref(self)

            def on_grad_ready(param: nn.Parameter) -> None:
                sync = wrapper()
                if sync is not None:
                    sync._on_grad_ready(param)

            for p in trainable:
                p.register_post_accumulate_grad_hook(on_grad_ready)

    def _bucket_params(self, params: list[nn.Parameter]) -> Sequence[list[nn.Parameter]]:
        raise NotImplementedError

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients locally; the next one outside reduces."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        i = self._bucket_of[id(param)]
        bucket = self._buckets[i]
        if id(param) in bucket.ready:
            raise RuntimeError(
                "a gradient was accumulated twice in one step: call finish_gradient_synchronization() "
                "after each backward, or accumulate inside no_sync()"
            )
        bucket.ready.add(id(param))
        while self._next_launch < len(self._buckets):
            nxt = self._buckets[self._next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        grads = []
        for p in bucket.params:
            if p.grad is None:
                # No gradient on this rank (parameter unused here): it contributes zeros, so every
                # rank issues the same collective; finish decides afterwards whether to keep it.
                p.grad = torch.zeros_like(p)
                self._zero_filled.append(p)
            grads.append(p.grad)
        if len(grads) == 1:
            target = grads[0]
        else:
            bucket.flat = target = torch.cat([g.reshape(-1) for g in grads])
        if torch.are_deterministic_algorithms_enabled():
            # The ranks' gradients are added in the batch tree's order (cs336_comms.reduce), which makes the
            # step bit-identical to one process on the whole batch; dividing first is exact for 2^k ranks.
            target.div_(self.world_size)
            bucket.work = tree_all_reduce(target, group=self._group)
            return
        if self._average_in_collective:
            # NCCL averages inside the collective: no extra kernel launch per bucket on the backward
            # thread, whose launch rate bounds a bf16 step.
            bucket.work = dist.all_reduce(target, op=dist.ReduceOp.AVG, group=self._group, async_op=True)
            return
        # gloo has no AVG. Dividing before the sum keeps values in range for large world sizes; for a
        # power-of-two world size it is exact, so the result is bit-identical to dividing the sum.
        target.div_(self.world_size)
        bucket.work = dist.all_reduce(target, op=dist.ReduceOp.SUM, group=self._group, async_op=True)

    def finish_gradient_synchronization(self) -> None:
        """Launch what backward has not, wait for all reductions, and leave averaged ``.grad`` behind.

        A no-op inside :meth:`no_sync`. With ``find_unused_parameters``, parameters that received no gradient on
        any rank keep ``.grad = None``, as they would in single-process training.
        """
        if not self._sync:
            return
        while self._next_launch < len(self._buckets):
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1
        if self._ones is None:
            return
        missing = {id(p) for p in self._zero_filled}
        flag_work = None
        if self.find_unused_parameters:
            # One small extra reduction counts the ranks that had each gradient, so a gradient missing
            # here but present elsewhere is kept; every rank issues it, keeping the collectives aligned.
            had_grad = self._ones.clone()
            for i, p in enumerate(self._trainable):
                if id(p) in missing:
                    had_grad[i] = 0.0
            flag_work = dist.all_reduce(had_grad, group=self._group, async_op=True)
        for bucket in self._buckets:
            assert bucket.work is not None
            bucket.work.wait()
            if bucket.flat is not None:
                # The reduced bucket becomes the gradients' storage: views, not copies back, so no kernel
                # per parameter after the backward (the pre-reduction gradients are freed).
                offset = 0
                for p in bucket.params:
                    n = p.grad.numel()
                    p.grad = bucket.flat[offset:offset + n].view_as(p.grad)
                    offset += n
            bucket.work, bucket.flat = None, None
            bucket.ready.clear()
        if flag_work is not None:
            flag_work.wait()
        if flag_work is not None and missing:
            counts = had_grad.tolist()
            for p, count in zip(self._trainable, counts, strict=True):
                if id(p) in missing and count == 0:
                    p.grad = None
        self._zero_filled = []
        self._next_launch = 0


class NaiveDDP(_GradientSync):
    """All-reduce every gradient separately after the backward pass."""

    def _bucket_params(self, params: list[nn.Parameter]) -> Sequence[list[nn.Parameter]]:
        return [[p] for p in params]


class FlatDDP(_GradientSync):
    """One all-reduce of all gradients concatenated (one per dtype) after the backward pass."""

    def _bucket_params(self, params: list[nn.Parameter]) -> Sequence[list[nn.Parameter]]:
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        return list(by_dtype.values())


class OverlappedDDP(_GradientSync):
    """An asynchronous all-reduce per gradient, launched from its post-accumulate-grad hook."""

    overlap = True

    def _bucket_params(self, params: list[nn.Parameter]) -> Sequence[list[nn.Parameter]]:
        return [[p] for p in params]


class BucketedDDP(_GradientSync):
    """Gradients grouped into buckets in reverse registration order, a bucket closed once it holds at least
    ``bucket_size_mb`` MiB (torch DDP's rule: a small tensor rides with the large one after it rather than
    costing a collective of its own); a bucket is all-reduced asynchronously once all its gradients exist.
    """

    overlap = True

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, *,
                 process_group: dist.ProcessGroup | None = None, find_unused_parameters: bool = False):
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        self.bucket_size_bytes = bucket_size_mb * 2**20
        super().__init__(module, process_group=process_group, find_unused_parameters=find_unused_parameters)

    def _bucket_params(self, params: list[nn.Parameter]) -> Sequence[list[nn.Parameter]]:
        buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in params:
            current = buckets[-1]
            if current and (size >= self.bucket_size_bytes or current[0].dtype != p.dtype):
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += p.numel() * p.element_size()
        return buckets
