"""The ``cs336`` command. Each subcommand lives in ``cs336_harness.commands.<name>``.

A command module defines ``add_arguments(parser)`` and ``run(args) -> int``; it parses flags into a frozen config
and calls a study (:mod:`cs336_harness.studies`). The one-line help of every command is listed in
:data:`cs336_harness.commands.COMMANDS`, so ``cs336 --help`` imports no command (and no torch); a command's module
is imported only when it runs or its own ``--help`` is asked for.

Without CUDA the Triton kernels run in the Triton interpreter, which must be chosen before any kernel module is
imported: the CLI sets ``TRITON_INTERPRET=1`` then, before it imports the command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from cs336_harness.commands import COMMANDS


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
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return importlib.import_module(f"cs336_harness.commands.{name}")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed flags of ``cs336 ARGV...`` (the command's module imported only for the command named)."""
    argv = list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    return _parser(chosen if chosen in COMMANDS else None).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
