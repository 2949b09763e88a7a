"""cs336_comms.reduce in one process: the tree order, input checks, and a one-rank group.

The sums over two ranks run in the spawn of test_ddp.py; four ranks' tree order is checked in
tests/test_determinism.py, whose spawn has four ranks anyway.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cs336_comms.reduce import _tree_sum_, tree_all_reduce, tree_reduce_scatter


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_tree_sum_splits_at_midpoints(n: int) -> None:
    parts = torch.randn(n, 7, dtype=torch.float64)

    def reference(lo: int, hi: int) -> torch.Tensor:
        if hi - lo == 1:
            return parts[lo].clone()
        mid = lo + (hi - lo) // 2
        return reference(lo, mid) + reference(mid, hi)

    want = reference(0, n)
    assert torch.equal(_tree_sum_(parts.clone(), 0, n), want)
    torch.testing.assert_close(want, parts.sum(0))


def test_tree_order_differs_from_a_sum_from_the_left() -> None:
    e = 2.0**-24
    parts = torch.tensor([1.0, e, e, -1.0])
    assert _tree_sum_(parts.clone(), 0, 4).item() == e  # (1 + e) + (e - 1)
    assert ((parts[0] + parts[1]) + parts[2] + parts[3]).item() == 0.0


def test_one_rank_leaves_the_tensor_as_it_is(one_rank_group) -> None:
    t = torch.randn(3, 4)
    want = t.clone()
    tree_all_reduce(t).wait()
    assert torch.equal(t, want)
    out = torch.empty(5)
    source = torch.randn(5)
    tree_reduce_scatter(out, source).wait()
    assert torch.equal(out, source)


def test_bad_arguments(one_rank_group) -> None:
    with pytest.raises(TypeError, match="torch.Tensor"):
        tree_all_reduce([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contiguous"):
        tree_all_reduce(torch.randn(4, 3).T)
    with pytest.raises(ValueError, match=r"world_size \(1\) x output \(3\) elements, got 4"):
        tree_reduce_scatter(torch.empty(3), torch.empty(4))
