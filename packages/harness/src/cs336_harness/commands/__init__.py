"""Subcommands of ``cs336``: one module each, discovered by :mod:`cs336_harness.cli`."""
