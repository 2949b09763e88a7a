"""Mistakes and failures a user meets first: a wrapper given something that is not a module, a rank the OS kills, a
rank that stops answering (spawned or under torchrun), torchrun started with another world size or killed; and ranks
forked from a preloaded server."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from comms_spawn_checks import parent_pid, rank_one_killed, rank_one_stops
from cs336_comms.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP
from cs336_comms.process_group import (
    RankDiedError,
    RankStalledError,
    check_world_size,
    run_ranks,
    spawn,
    stalled_rank,
)


@pytest.mark.parametrize("wrapper", [NaiveDDP, FlatDDP, OverlappedDDP, BucketedDDP])
def test_wrappers_reject_what_is_not_a_module(wrapper: type) -> None:
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got str"):
        wrapper("hello")


@pytest.mark.parametrize("wrapper", [NaiveDDP, FlatDDP, OverlappedDDP, BucketedDDP])
def test_wrappers_reject_a_group_that_is_not_one_without_a_process_group(wrapper: type) -> None:
    """Without an initialised group a wrapper runs as one rank; a wrong value must not pass silently as that."""
    with pytest.raises(TypeError, match=r"^process_group must be a torch.distributed.ProcessGroup or None \(the "
                                        r"world\), got str 'world'$"):
        wrapper(torch.nn.Linear(2, 2), process_group="world")


def test_rank_death_messages() -> None:
    assert str(RankDiedError(1, "SIGKILL", -9)) == "rank 1 died (signal SIGKILL), most likely out of host memory"
    assert str(RankDiedError(0, "SIGSEGV", -11)) == "rank 0 died (signal SIGSEGV)"
    assert str(RankDiedError(2, None, 3)) == "rank 2 exited with code 3 without raising an exception"


@pytest.mark.slow
def test_a_killed_rank_is_reported_as_likely_out_of_memory() -> None:
    with pytest.raises(RankDiedError, match=r"rank 1 died \(signal SIGKILL\), most likely out of host memory") as e:
        spawn(rank_one_killed, 2, backend="gloo", timeout_s=60)
    assert (e.value.rank, e.value.signal_name) == (1, "SIGKILL")


def test_a_stalled_rank_is_the_first_whose_heartbeat_is_too_old(tmp_path: Path) -> None:
    now = time.time()
    for rank, age in ((0, 1.0), (1, 30.0), (2, 50.0)):
        (tmp_path / f"heartbeat{rank}").touch()
        os.utime(tmp_path / f"heartbeat{rank}", (now - age, now - age))
    assert stalled_rank(tmp_path, 3, since=now - 100, now=now, stall_s=60, first_beat_s=600) is None
    assert stalled_rank(tmp_path, 3, since=now - 100, now=now, stall_s=20, first_beat_s=600) == (1, 20)
    # The watch resumed 10 s ago (its own process had been stopped): no heartbeat counts as older than that.
    assert stalled_rank(tmp_path, 3, since=now - 10, now=now, stall_s=20, first_beat_s=600) is None
    # Rank 3 has not beaten yet: it has until first_beat_s from the start of the watch.
    assert stalled_rank(tmp_path, 4, since=now - 100, now=now, stall_s=60, first_beat_s=120) is None
    assert stalled_rank(tmp_path, 4, since=now - 100, now=now, stall_s=60, first_beat_s=90) == (3, 90)


def test_a_stalled_rank_message_names_it_and_says_the_run_ended() -> None:
    error = RankStalledError(1, 60.0)
    assert isinstance(error, RankDiedError) and error.rank == 1
    assert str(error) == ("rank 1 stopped answering (no heartbeat for 60 s: stopped, hung or swapped out); every "
                          "rank was ended")


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_within_half_the_timeout() -> None:
    with pytest.raises(RankStalledError, match="rank 1 stopped answering") as e:
        spawn(rank_one_stops, 2, backend="gloo", timeout_s=20)
    # Ended by the watch (10 s without a heartbeat), not by rank 0's barrier timing out after 20 s.
    assert e.value.rank == 1 and e.value.stalled_s == 10
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_preloaded_ranks_fork_from_one_server_for_every_call() -> None:
    servers = [spawn(parent_pid, 2, backend="gloo", preload=("torch",)) for _ in range(2)]
    assert servers[0] == servers[1] != os.getpid()
    assert spawn(parent_pid, 2, backend="gloo") == os.getpid()  # without a preload, this process starts each rank


def test_torchrun_with_another_world_size_is_one_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    check_world_size(2)
    message = "asked for world size 3, but torchrun started 2 ranks"
    with pytest.raises(ValueError, match=message):
        check_world_size(3)
    with pytest.raises(ValueError, match=message):
        run_ranks(rank_one_stops, 3, backend="gloo")


_TORCHRUN_RANKS = Path(__file__).parent / "torchrun_ranks.py"


def _torchrun(folder: Path, timeout_s: float, stop_at: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(_TORCHRUN_RANKS),
               str(folder), str(timeout_s), str(stop_at)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ranks_pids(folder: Path, deadline_s: float) -> list[int]:
    """The two ranks' pids once both wrote them."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        files = [folder / f"rank{rank}.pid" for rank in (0, 1)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not start within {deadline_s} s")


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie, ended but not reaped, counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_stopped_rank_under_torchrun_ends_the_run_with_one_line(tmp_path: Path) -> None:
    """Rank 1 stops itself (SIGSTOP); the group's timeout is 10 s, so its peer sees it after 5 s, prints one line,
    kills it and exits; torchrun then ends."""
    start = time.monotonic()
    launcher = _torchrun(tmp_path, timeout_s=10, stop_at=20)
    pids = _ranks_pids(tmp_path, deadline_s=120)
    _, stderr = launcher.communicate(timeout=200 - (time.monotonic() - start))
    assert launcher.returncode != 0
    lines = [line for line in stderr.splitlines() if "stopped answering" in line]
    assert lines == ["rank 1 stopped answering (no heartbeat for 5 s: stopped, hung or swapped out); every rank was "
                     "ended"], stderr
    assert "[rank" not in stderr  # no rank's traceback (torchrun's own failure report follows the line)
    assert not any(_running(pid) for pid in pids)


@pytest.mark.slow
def test_killing_torchrun_ends_its_ranks(tmp_path: Path) -> None:
    """SIGKILL to torchrun, which can forward nothing: each rank asked Linux to kill it with its launcher."""
    launcher = _torchrun(tmp_path, timeout_s=60, stop_at=0)
    pids = _ranks_pids(tmp_path, deadline_s=120)
    launcher.kill()
    launcher.communicate()
    end = time.monotonic() + 10
    while any(_running(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids)
