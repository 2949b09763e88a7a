"""How pytest workers share one GPU: a pytest plugin, registered once by whichever conftest loads first (the
repository's, for a run of the whole workspace; the kernels tests', for the kernels package alone).

Under pytest-xdist (``-n 8``, ``-n auto``) every worker runs its tests on the same GPU. Each test holds a
cross-process lock from its setup to its teardown (module fixtures included, which are made in their first test's
setup): shared by default, exclusive for a test marked ``gpu_exclusive``, which then finds the GPU to itself (and,
while it waits for the shared tests running, goes before those that ask after it). A shared test may reserve at most
:data:`SHARED_BUDGET_GIB` of GPU memory beyond what its process held when it started, so that sixteen workers (``-n
auto`` on the lent 16-core machines) fit on an 80 GiB GPU beside their CUDA contexts; one that reserves more fails
at its teardown with the fix: mark it ``gpu_exclusive``. Mark one so too if it starts processes that use the GPU
(their memory is not counted here). The exclusive tests run last. After each test the worker hands its cached GPU
memory back to the driver.

Without CUDA the plugin does nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

NAME = "cs336-gpu-share"
# One lock file for every pytest process on this machine.
LOCK = Path(tempfile.gettempdir()) / "cs336-gpu-tests.lock"
SHARED_BUDGET_GIB = 4.0
MARKER = ("gpu_exclusive: needs more than {budget:g} GiB of GPU memory, or starts processes that use the GPU: "
          "runs alone on the GPU under pytest-xdist")

ACTIVE = torch.cuda.is_available()  # on with CUDA (test_gpu_share.py switches it on to test the plugin on a CPU)

_held: list[contextlib.ExitStack] = []  # the lock of the running test, once its setup took it
_reserved_before = [0]  # what this process held on the GPU when the running test started


def register(config: pytest.Config) -> None:
    """Register this plugin (once per pytest process) and its marker."""
    if not config.pluginmanager.has_plugin(NAME):
        config.addinivalue_line("markers", MARKER.format(budget=SHARED_BUDGET_GIB))
        config.pluginmanager.register(sys.modules[__name__], NAME)


def _exclusive(item: pytest.Item) -> bool:
    return item.get_closest_marker("gpu_exclusive") is not None


@contextlib.contextmanager
def hold(exclusive: bool) -> Iterator[None]:
    """Hold the lock, alone or shared, until the block ends (flock: released when its file closes).

    Every taker first passes a turnstile (a second lock file beside it), which an exclusive taker keeps until it holds
    the lock: flock alone lets shared takers pass an exclusive one that waits for as long as shared tests keep
    coming, and the waiting worker's queued tests with it, to the end of the run."""
    gate = os.open(LOCK.with_name(LOCK.name + ".gate"), os.O_RDWR | os.O_CREAT, 0o666)
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            os.close(gate)
        yield
    finally:
        os.close(fd)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The exclusive tests last (a stable sort: each group keeps its order). An exclusive test waits for every
    shared test running to end, so every worker but its own idles while the GPU drains: at the end, one after
    another, they drain it once, where spread through the run each drained it again."""
    if ACTIVE:
        items.sort(key=_exclusive)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not ACTIVE:
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(hold(_exclusive(item)))
        _held.append(stack.pop_all())
    if torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
        _reserved_before[0] = torch.cuda.memory_reserved()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if not _held:
        return  # another plugin's setup stopped the test before this one's: nothing held, nothing measured
    with _held.pop():
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            peak_gib = (torch.cuda.max_memory_reserved() - _reserved_before[0]) / 2**30
            torch.cuda.empty_cache()
            _reserved_before[0] = 0
            if peak_gib > SHARED_BUDGET_GIB and not _exclusive(item):
                pytest.fail(f"{item.nodeid} reserved {peak_gib:.1f} GiB of GPU memory, more than a test that "
                            f"shares the GPU may ({SHARED_BUDGET_GIB:g} GiB): mark it gpu_exclusive", pytrace=False)
