"""The plugin that shares one GPU between pytest-xdist workers (``gpu_share.py``), checked on a CPU: the lock itself
(a waiting exclusive taker first), the exclusive tests sorted last, and a pytest run of three workers in which an
exclusive test overlaps no other and runs after the shared ones while shared tests overlap, and a shared test past
the memory budget fails with the fix (the CUDA memory calls stood in for)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import gpu_share
import pytest


def _try(lock: Path, kind: int) -> bool:
    """Whether another holder could take ``lock`` as ``kind`` now."""
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_exclusive_excludes_all_and_shared_excludes_exclusive(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(gpu_share, "LOCK", tmp_path / "lock")
    with gpu_share.hold(exclusive=False):
        assert _try(gpu_share.LOCK, fcntl.LOCK_SH) and not _try(gpu_share.LOCK, fcntl.LOCK_EX)
    with gpu_share.hold(exclusive=True):
        assert not _try(gpu_share.LOCK, fcntl.LOCK_SH) and not _try(gpu_share.LOCK, fcntl.LOCK_EX)
    assert _try(gpu_share.LOCK, fcntl.LOCK_EX)


def test_a_waiting_exclusive_taker_goes_before_later_shared_ones(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(gpu_share, "LOCK", tmp_path / "lock")
    order: list[str] = []

    def take(name: str, exclusive: bool) -> None:
        with gpu_share.hold(exclusive):
            order.append(name)

    with gpu_share.hold(exclusive=False):
        writer = threading.Thread(target=take, args=("exclusive", True))
        writer.start()
        gate = tmp_path / "lock.gate"
        deadline = time.monotonic() + 10
        while (not gate.exists() or _try(gate, fcntl.LOCK_EX)) and time.monotonic() < deadline:
            time.sleep(0.01)  # until the exclusive taker waits at the lock, the turnstile in hand
        reader = threading.Thread(target=take, args=("shared", False))
        reader.start()
        reader.join(timeout=0.3)
        assert order == []  # the later shared taker waits behind the exclusive one, not beside this shared holder
    writer.join(timeout=10)
    reader.join(timeout=10)
    assert order == ["exclusive", "shared"]


_CONFTEST = """
import os, sys
import torch
sys.path.insert(0, {here!r})
import gpu_share

gpu_share.ACTIVE = True
gpu_share.LOCK = gpu_share.Path({lock!r})
# What a test reserved on the GPU, as the test says (this machine has none), from 0 at each test's setup.
torch.cuda.is_initialized = lambda: True
torch.cuda.synchronize = torch.cuda.empty_cache = lambda: None
torch.cuda.reset_peak_memory_stats = lambda: os.environ.update(RESERVED_GIB="0")
torch.cuda.memory_reserved = lambda: 0
torch.cuda.max_memory_reserved = lambda: float(os.environ.get("RESERVED_GIB", "0")) * 2**30

def pytest_configure(config):
    gpu_share.register(config)
"""

_TESTS = """
import json, os, time
import pytest

def _record(name, exclusive, seconds):
    start = time.time()
    time.sleep(seconds)
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"name": name, "exclusive": exclusive, "start": start, "end": time.time()}}) + "\\n")

@pytest.mark.gpu_exclusive
@pytest.mark.parametrize("i", range(2))
def test_exclusive(i):
    _record(f"exclusive{{i}}", True, 0.3)
    os.environ["RESERVED_GIB"] = "30"  # within an exclusive test's rights

@pytest.mark.parametrize("i", range(6))
def test_shared(i):
    _record(f"shared{{i}}", False, 0.6)

def test_shared_past_the_budget():
    os.environ["RESERVED_GIB"] = "5"
"""


@pytest.mark.slow
def test_three_workers_run_an_exclusive_test_alone(tmp_path: Path):
    log = tmp_path / "log.jsonl"
    (tmp_path / "conftest.py").write_text(_CONFTEST.format(here=str(Path(__file__).parent),
                                                           lock=str(tmp_path / "lock")))
    (tmp_path / "test_share.py").write_text(_TESTS.format(log=str(log)))
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "3", "-p", "no:cacheprovider", "-q",
                           "--rootdir", str(tmp_path), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert "9 passed, 1 error" in done.stdout, done.stdout[-3000:]
    assert ("test_share.py::test_shared_past_the_budget reserved 5.0 GiB of GPU memory, more than a test that shares "
            "the GPU may (4 GiB): mark it gpu_exclusive") in done.stdout
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 8

    def overlap(a: dict, b: dict) -> bool:
        return a["start"] < b["end"] and b["start"] < a["end"]

    for a in runs:
        for b in runs:
            if a is not b and a["exclusive"]:
                assert not overlap(a, b), (a, b)
    shared = [r for r in runs if not r["exclusive"]]
    assert any(overlap(a, b) for a in shared for b in shared if a is not b)  # the workers did run side by side
    # Collected first, the exclusive tests ran last: after every shared test had ended.
    assert min(r["start"] for r in runs if r["exclusive"]) >= max(r["end"] for r in shared)


def test_exclusive_tests_are_sorted_last_in_their_order(monkeypatch: pytest.MonkeyPatch):
    class Item:
        def __init__(self, name: str, exclusive: bool):
            self.name, self.exclusive = name, exclusive

        def get_closest_marker(self, name: str):
            return object() if name == "gpu_exclusive" and self.exclusive else None

    items = [Item("x1", True), Item("s1", False), Item("x2", True), Item("s2", False)]
    monkeypatch.setattr(gpu_share, "ACTIVE", True)
    gpu_share.pytest_collection_modifyitems(items)
    assert [item.name for item in items] == ["s1", "s2", "x1", "x2"]
    monkeypatch.setattr(gpu_share, "ACTIVE", False)  # without CUDA the order is pytest's
    items.reverse()
    gpu_share.pytest_collection_modifyitems(items)
    assert [item.name for item in items] == ["x2", "x1", "s2", "s1"]
