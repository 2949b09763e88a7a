"""Mistakes and failures a user meets first: a wrapper given something that is not a module, a rank the OS kills."""

from __future__ import annotations

import pytest
from comms_spawn_checks import rank_one_killed
from cs336_comms.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP
from cs336_comms.process_group import RankDiedError, spawn


@pytest.mark.parametrize("wrapper", [NaiveDDP, FlatDDP, OverlappedDDP, BucketedDDP])
def test_wrappers_reject_what_is_not_a_module(wrapper: type) -> None:
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got str"):
        wrapper("hello")


def test_rank_death_messages() -> None:
    assert str(RankDiedError(1, "SIGKILL", -9)) == "rank 1 died (signal SIGKILL), most likely out of host memory"
    assert str(RankDiedError(0, "SIGSEGV", -11)) == "rank 0 died (signal SIGSEGV)"
    assert str(RankDiedError(2, None, 3)) == "rank 2 exited with code 3 without raising an exception"


@pytest.mark.slow
def test_a_killed_rank_is_reported_as_likely_out_of_memory() -> None:
    with pytest.raises(RankDiedError, match=r"rank 1 died \(signal SIGKILL\), most likely out of host memory") as e:
        spawn(rank_one_killed, 2, backend="gloo", timeout_s=60)
    assert (e.value.rank, e.value.signal_name) == (1, "SIGKILL")
