"""Cross-rank sums in one fixed order: every rank's tensor added as a balanced pairwise tree over ranks.

An all-reduce or reduce-scatter adds the ranks' contributions in an order of its own (a ring visits them
in a rotation that differs per chunk; NCCL picks rings or trees by message size), so four ranks' gradients
are not summed as ``((r0 + r1) + (r2 + r3))``. Here each rank receives every rank's contribution (an
all-gather, or an all-to-all for a reduce-scatter) and adds them itself, splitting ``[lo, hi)`` at
``mid = lo + (hi - lo) // 2``: the order in which cs336_basics' deterministic mode adds a batch's examples,
so with equal contiguous shards per rank and a power-of-two number of ranks, the sum over ranks continues
each rank's local tree into the whole batch's tree (see ``cs336_basics.deterministic``)::

    work = tree_all_reduce(grad)      # the gather is in flight
    work.wait()                       # grad now holds the sum over ranks, on every rank

Cost against a ring all-reduce: each rank receives ``(W - 1) * n`` elements instead of ``2 (W - 1) / W * n``
and holds a ``W * n`` buffer while adding; a reduce-scatter's all-to-all moves what the ring does and holds
one full-size buffer. For two ranks the bytes moved are the same. The DDP and FSDP wrappers use these only
in deterministic mode (``torch.are_deterministic_algorithms_enabled()``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["TreeReduction", "tree_all_reduce", "tree_reduce_scatter"]


def _tree_sum_(parts: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``parts[lo] + ... + parts[hi - 1]`` as a midpoint-split pairwise tree, accumulated into ``parts[lo]``."""
    if hi - lo > 1:
        mid = lo + (hi - lo) // 2
        _tree_sum_(parts, lo, mid).add_(_tree_sum_(parts, mid, hi))
    return parts[lo]


class TreeReduction:
    """A collective in flight whose received contributions (one row per rank) are added on :meth:`wait`."""

    def __init__(self, work: dist.Work, received: torch.Tensor, out: torch.Tensor):
        self._work, self._received, self._out = work, received, out

    def wait(self) -> None:
        """Wait for the collective, then write the tree sum over ranks into the output tensor."""
        self._work.wait()
        self._out.copy_(_tree_sum_(self._received, 0, self._received.shape[0]).view_as(self._out))


def _check(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} with strides {t.stride()}")


def tree_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> TreeReduction:
    """Start summing ``tensor`` over the ranks of ``group`` in tree order; after ``wait()`` it holds the sum."""
    _check("tensor", tensor)
    world_size = dist.get_world_size(group)
    received = torch.empty(world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    work = dist.all_gather_into_tensor(received, tensor.view(-1), group=group, async_op=True)
    return TreeReduction(work, received.view(world_size, -1), tensor)


def tree_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None
) -> TreeReduction:
    """Start ``output = sum over ranks r of chunk(input_r)[this rank]`` in tree order, as
    ``reduce_scatter_tensor`` does (``input`` holds ``world_size`` equal chunks, one per destination rank)."""
    _check("output", output)
    _check("input", input)
    world_size = dist.get_world_size(group)
    if input.numel() != world_size * output.numel():
        raise ValueError(f"input must hold world_size ({world_size}) x output ({output.numel()}) elements, "
                         f"got {input.numel()}")
    received = torch.empty((world_size, output.numel()), dtype=input.dtype, device=input.device)
    work = dist.all_to_all_single(received, input.view(world_size, -1), group=group, async_op=True)
    return TreeReduction(work, received, output)
