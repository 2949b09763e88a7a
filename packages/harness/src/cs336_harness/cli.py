"""The ``cs336`` command. Each subcommand lives in ``cs336_harness.commands.<name>``.

A command module defines ``add_arguments(parser)`` and ``run(args) -> int``; it parses flags into a frozen config
and calls a study (:mod:`cs336_harness.studies`). The one-line help of every command is listed in
:data:`cs336_harness.commands.COMMANDS`, so ``cs336 --help`` imports no command (and no torch); a command's module
is imported only when it runs or its own ``--help`` is asked for.

Without CUDA the Triton kernels run in the Triton interpreter, which must be chosen before any kernel module is
imported: the CLI sets ``TRITON_INTERPRET=1`` then, before it imports the command, and silences what torch prints
about the missing GPU (see :func:`_prepare_cpu`).

Under ``torchrun`` every rank runs the command; a command's one-line error is printed by rank 0 alone (see
:func:`main`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from collections.abc import Sequence

from cs336_harness.commands import COMMANDS

# Longer than ranks started together take to reach the same check, even on a loaded machine.
_OTHER_RANKS_WAIT_S = 5.0


def _parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cs336", description="Measure and speed up Transformer training on one or more GPUs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_line in COMMANDS.items():
        p = sub.add_parser(name, help=help_line, description=help_line)
        if name == chosen:
            module = _load(name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def _load(name: str):  # noqa: ANN202 (a command module)
    import torch

    if not torch.cuda.is_available():
        _prepare_cpu()
    return importlib.import_module(f"cs336_harness.commands.{name}")


def _prepare_cpu() -> None:
    """Without CUDA: the Triton interpreter, and none of the messages torch prints about the missing GPU on runs
    that work. Environment variables reach the ranks a command spawns as well."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # torch.profiler's kineto logs "gpuGetDeviceCount failed" as an ERROR in every process it runs in; 5 is above
    # its ERROR level (4).
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    # torch.compile's C++ builder warns "No CUDA runtime is found" where a CUDA toolkit is installed without a GPU.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed flags of ``cs336 ARGV...`` (the command's module imported only for the command named)."""
    argv = list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    return _parser(chosen if chosen in COMMANDS else None).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args._run(args)
    except SystemExit as e:
        rank = os.environ.get("RANK", "0")
        if isinstance(e.code, str) and rank != "0" and "WORLD_SIZE" in os.environ:
            # Under torchrun every rank runs the command and meets the same mistake, and torchrun ends every rank once
            # one has failed: rank 0 says it. A mistake of this rank alone is said after a pause, in which torchrun
            # ends this process first if rank 0 failed too.
            time.sleep(_OTHER_RANKS_WAIT_S)
            raise SystemExit(f"{e.code} (rank {rank})") from None
        raise


if __name__ == "__main__":
    sys.exit(main())
