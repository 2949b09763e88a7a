"""Process-group helpers: start ranks locally with ``torch.multiprocessing`` or join from
``torchrun``'s environment (``env://``), always with a timeout so a mismatched collective raises
instead of hanging, and always torn down.

    from cs336_comms.process_group import spawn
    result = spawn(train, world_size=2)   # train(rank, world_size, *args) runs in each rank; rank 0's return

A spawned rank that stops running (stopped by a signal, hung in the kernel, swapped out) cannot answer, and its
peers would wait in their next collective for the whole timeout, which gloo counts from the collective's start.
So each spawned rank beats a heartbeat (a file touched every second by a thread of its own, which runs whatever
the rank's main thread is doing) and the parent ends the run, every rank killed, once one has not beaten for half
the timeout or :data:`STALL_TIMEOUT_S`, whichever is shorter (so before a peer's collective times out and hides the
cause): :class:`RankStalledError` names it.

Under torchrun (any number of nodes) call :func:`init_from_env` at the top of the script instead, or
use :func:`run_ranks`, which spawns when run as a plain script and joins torchrun's group otherwise,
so one command works both ways. torchrun sees a rank that dies, not one that stops, so under it :func:`run_ranks`
has the ranks watch each other: each beats a counter in the group's store, and once one has not beaten for the same
limit the others print one line naming it, kill it if it runs on their host, and exit. Every rank (spawned or
torchrun's) asks Linux to kill it when its launcher dies, so killing the launcher, even with SIGKILL, leaves no rank
running. Inside a group, :func:`rank_and_world` says where this process stands.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0
# A rank whose heartbeat thread has not run for this long is not running at all: a busy rank's thread still gets
# the GIL within milliseconds, since torch's ops and collectives release it.
STALL_TIMEOUT_S = 60.0
_HEARTBEAT_S = 1.0
_PR_SET_PDEATHSIG = 1  # prctl's option (linux/prctl.h)


class RankDiedError(RuntimeError):
    """A spawned rank ended without raising a Python exception: killed by a signal or exited with a code.

    SIGKILL is what the kernel's out-of-memory killer sends, so the message says so; callers that know what the
    run asked for (a model size, a tensor size) add it.
    """

    def __init__(self, rank: int, signal_name: str | None, exit_code: int):
        self.rank, self.signal_name, self.exit_code = rank, signal_name, exit_code
        if signal_name == "SIGKILL":
            message = f"rank {rank} died (signal SIGKILL), most likely out of host memory"
        elif signal_name is not None:
            message = f"rank {rank} died (signal {signal_name})"
        else:
            message = f"rank {rank} exited with code {exit_code} without raising an exception"
        super().__init__(message)


class RankStalledError(RankDiedError):
    """A spawned rank stopped answering (no heartbeat for ``stalled_s`` seconds), so the parent killed every rank
    (SIGKILL, the one signal a stopped process acts on)."""

    def __init__(self, rank: int, stalled_s: float):
        super().__init__(rank, "SIGKILL", -signal.SIGKILL)
        self.stalled_s = stalled_s
        self.args = (f"rank {rank} stopped answering (no heartbeat for {stalled_s:g} s: stopped, hung or swapped "
                     "out); every rank was ended",)


def _die_with_parent() -> None:
    """Have Linux SIGKILL this process when its parent (torchrun's agent, or the spawning process or forkserver)
    dies: a rank whose launcher was killed, even with SIGKILL, would otherwise run on (or wait in a collective)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def default_backend() -> str:
    """NCCL when CUDA GPUs are present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _validate_backend(backend: str) -> None:
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA GPUs; use 'gloo' on CPU")


def device_for_rank(backend: str, local_rank: int, local_world_size: int = 1) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL, the CPU under gloo.

    Under gloo the ``local_world_size`` ranks of one machine share its cores, so each gets an equal share
    of threads: more threads than cores makes OpenMP's spinning workers fight.
    """
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    return torch.device("cpu")


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """This process's rank in ``group`` (default: the world) and the group's size; ``(0, 1)`` when no process
    group is initialised, so a wrapper built outside one runs as a single rank.

    Raises:
        TypeError: if ``group`` is neither None nor a ``torch.distributed.ProcessGroup`` (checked with or without an
            initialised group, so a wrong value never passes silently as a single rank).
    """
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None (the world), got "
                        f"{type(group).__name__} {group!r}")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def current_device() -> torch.device:
    """This rank's device inside an initialised group (the one :func:`device_for_rank` chose)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the group described by torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*); this process
    dies with its launcher.

    Returns:
        This rank's device.
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"init_from_env needs torchrun's environment; missing {', '.join(missing)}")
    backend = backend or default_backend()
    _validate_backend(backend)
    _die_with_parent()
    device = device_for_rank(
        backend, int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    )
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return device


def _beat(path: Path) -> None:
    while True:
        path.touch()
        time.sleep(_HEARTBEAT_S)


def _spawned(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str, timeout_s: float, run_dir: str,
    args: tuple,
) -> None:
    _die_with_parent()
    threading.Thread(target=_beat, args=(Path(run_dir) / f"heartbeat{rank}",), daemon=True).start()
    device_for_rank(backend, rank, world_size)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        (Path(run_dir) / "rank0.pickle").write_bytes(pickle.dumps(result))
    # A rank whose work succeeded leaves without running C++ static destructors: after FSDP2
    # (fully_shard) on gloo, one of them aborts the process at exit in about one run in five
    # ("terminate called without an active exception", no Python frame), failing a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def stalled_rank(run_dir: Path, world_size: int, since: float, now: float, stall_s: float,
                 first_beat_s: float) -> tuple[int, float] | None:
    """The first rank that stopped answering and the limit it passed: its heartbeat file in ``run_dir`` is older than
    ``stall_s``, or, before its first beat, ``since`` (when the watch started or resumed) is older than
    ``first_beat_s``; None while every rank answers. Times are ``time.time()`` seconds, as file times are."""
    for rank in range(world_size):
        try:
            last, limit = max((run_dir / f"heartbeat{rank}").stat().st_mtime, since), stall_s
        except FileNotFoundError:
            last, limit = since, first_beat_s
        if now - last > limit:
            return rank, limit
    return None


def _watch(context: mp.ProcessContext, run_dir: Path, world_size: int, stall_s: float, first_beat_s: float) -> None:
    """Join the ranks of ``context``; kill them all and raise :class:`RankStalledError` when one stops answering."""
    since = last_poll = time.time()
    try:
        while not context.join(timeout=_HEARTBEAT_S):
            now = time.time()
            if now - last_poll > 5 * _HEARTBEAT_S:
                # This process did not run either (the whole job was stopped, as ^Z does, or the machine slept): the
                # ranks' silence says nothing about them, so their clocks start again.
                since = now
            last_poll = now
            stalled = stalled_rank(run_dir, world_size, since, now, stall_s, first_beat_s)
            if stalled is not None:
                raise RankStalledError(*stalled)
    except BaseException:
        # A stalled rank, a failed one (torch has then ended the others) or ^C: no rank may outlive the run.
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
        raise


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    preload: Sequence[str] = (),
) -> Any:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined in one process group.

    ``fn`` must be importable (a module-level function) and its result on rank 0 picklable. A failing rank
    raises in the caller. ``timeout_s`` bounds a collective's wait for its peers; a rank that stops answering ends
    the run after ``min(timeout_s / 2, STALL_TIMEOUT_S)`` (``timeout_s`` before its first heartbeat: it may still
    be importing torch).

    Each rank is a fresh interpreter that imports torch and ``fn``'s module (seconds on a CPU), unless ``preload``
    names installed modules: then the ranks are forks of one server process that imported those once
    (multiprocessing's ``forkserver``), so a process that spawns many times (a test session) pays the imports once.
    The server starts at the first call with a ``preload``, with that call's modules and this process's environment
    at that moment, and serves every later such call. A fork cannot use a CUDA that its parent initialised, so for
    CUDA ranks preload nothing that touches CUDA when imported.

    Returns:
        What ``fn`` returned on rank 0.

    Raises:
        RankDiedError: if a rank was killed (SIGKILL: most likely out of host memory) or exited without raising.
        RankStalledError: if a rank stopped answering (a :class:`RankDiedError` too).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    backend = backend or default_backend()
    _validate_backend(backend)
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"world_size {world_size} exceeds the {torch.cuda.device_count()} visible GPUs")
    if preload:
        mp.get_context("forkserver").set_forkserver_preload(list(preload))  # no effect once the server runs
    # The group's store lives here, on a port the system picks when it binds: a port chosen free and bound later by
    # rank 0 can be taken in between (the ranks import torch for seconds first) by another run's store or sockets,
    # and then ranks of two runs meet in one store.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        context = mp.start_processes(_spawned, args=(fn, world_size, store.port, backend, timeout_s, tmp, args),
                                     nprocs=world_size, join=False, start_method="forkserver" if preload else "spawn")
        try:
            _watch(context, run_dir, world_size, min(timeout_s / 2, STALL_TIMEOUT_S), timeout_s)
        except mp.ProcessExitedException as e:
            raise RankDiedError(e.error_index, e.signal_name, e.exit_code) from None
        return pickle.loads((run_dir / "rank0.pickle").read_bytes())


def launched_by_torchrun() -> bool:
    """Whether this process is one of torchrun's ranks (its environment names a rank and a world size)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def check_world_size(world_size: int) -> None:
    """That torchrun, if it started this process, started ``world_size`` ranks (a spawned run starts as many as it
    is asked for).

    Raises:
        ValueError: naming both counts.
    """
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"asked for world size {world_size}, but torchrun started {os.environ['WORLD_SIZE']} ranks; "
                         f"give --nproc-per-node and the world size the same number")


class _PeerWatch:
    """Under torchrun: this rank's heartbeat in the group's store and its watch over the other ranks' (the spawned
    ranks' watch is :func:`_watch`, in their parent).

    A thread adds 1 to this rank's counter every second and reads every other rank's; a counter that has not moved
    for ``stall_s`` (by this process's clock: the ranks' clocks need not agree) is a rank that stopped. The first
    rank to see it (the one whose add to the ``reported`` key returns 1) prints one line; every rank that sees it
    SIGKILLs it if it runs on this host (a stopped process acts on no other signal) and exits with status 1, which
    makes torchrun end the rest. A rank that finished its work says so (``done``) and waits in :meth:`finish` until
    every rank has, so a rank that stops after its peers finished is seen too.
    """

    _generation = 0  # groups this process joined: each group's keys get their own prefix

    def __init__(self, rank: int, world_size: int, stall_s: float):
        _PeerWatch._generation += 1
        self.store = dist.distributed_c10d._get_default_store()
        self.prefix = f"cs336_watch/{_PeerWatch._generation}"
        self.rank, self.world_size, self.stall_s = rank, world_size, stall_s
        self.store.set(f"{self.prefix}/pid/{rank}", f"{socket.gethostname()} {os.getpid()}")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _done(self, rank: int) -> bool:
        return self.store.check([f"{self.prefix}/done/{rank}"])

    def _run(self) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        counts = dict.fromkeys(peers, -1)
        changed = dict.fromkeys(peers, time.monotonic())
        last_poll = time.monotonic()
        try:
            while not self.stop.wait(_HEARTBEAT_S):
                self.store.add(f"{self.prefix}/beat/{self.rank}", 1)
                now = time.monotonic()
                if now - last_poll > 5 * _HEARTBEAT_S:
                    changed = dict.fromkeys(peers, now)  # this process did not run either: the silence says nothing
                last_poll = now
                for peer in peers:
                    count = self.store.add(f"{self.prefix}/beat/{peer}", 0)
                    if count != counts[peer]:
                        counts[peer], changed[peer] = count, now
                    elif now - changed[peer] > self.stall_s and not self._done(peer):
                        self._end(peer)
        except (RuntimeError, OSError):
            return  # the store is gone (its host ended): nothing is left to watch

    def _end(self, peer: int) -> None:
        if self.store.add(f"{self.prefix}/reported", 1) == 1:
            print(RankStalledError(peer, self.stall_s).args[0], file=sys.stderr, flush=True)
        key = f"{self.prefix}/pid/{peer}"
        host, pid = self.store.get(key).decode().split() if self.store.check([key]) else (None, "0")
        if host == socket.gethostname():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        sys.stdout.flush()
        os._exit(1)

    def finish(self) -> None:
        """Say this rank is done, wait (still watching) until every rank is, then stop the thread."""
        self.store.set(f"{self.prefix}/done/{self.rank}", "1")
        while not all(self._done(r) for r in range(self.world_size)):
            time.sleep(_HEARTBEAT_S / 10)
        self.stop.set()
        self.thread.join()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Run ``fn(rank, world_size, *args)`` in every rank: spawned here, or in this process under torchrun.

    A rank that stops answering ends the run after ``min(timeout_s / 2, STALL_TIMEOUT_S)``, spawned
    (:func:`spawn`) or under torchrun (:class:`_PeerWatch`: one line names it, every rank exits with status 1).

    Returns:
        What ``fn`` returned on rank 0, in the one process that should report it: the spawning parent, or
        rank 0 under torchrun (where every rank runs the caller's code); None on torchrun's other ranks.
    """
    if not launched_by_torchrun():
        return spawn(fn, world_size, *args, backend=backend, timeout_s=timeout_s)
    check_world_size(world_size)
    init_from_env(backend, timeout_s)
    rank = dist.get_rank()
    watch = _PeerWatch(rank, world_size, min(timeout_s / 2, STALL_TIMEOUT_S))
    try:
        result = fn(rank, world_size, *args)
        watch.finish()
    finally:
        watch.stop.set()
        dist.destroy_process_group()
    return result if rank == 0 else None
