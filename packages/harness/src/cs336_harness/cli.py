"""The ``cs336`` command. Each subcommand lives in ``cs336_harness.commands.<name>``.

A command module defines ``HELP`` (one line) and ``add_arguments(parser)``, and ``run(args) -> int``.
The CLI only parses flags; each command turns them into a frozen config and calls library code.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from cs336_harness import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cs336", description="Measure and speed up Transformer training on one or more GPUs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        p = sub.add_parser(info.name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
