"""Put this folder on ``sys.path``: spawned ranks import their check modules by name (spawn hands the parent's
``sys.path`` to each child), and tests share :mod:`figure_checks`. ``own_registry``: a test may register pieces of
its own, and the next test sees the registry as it was."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def own_registry():
    """The registry's tables as they were before the test, whatever it registers."""
    from cs336_harness import registry

    tables = [registry.ATTENTIONS, registry.GLUES, registry.LOSSES, registry.OPTIMIZERS]
    saved = [dict(table) for table in tables]
    yield
    for table, entries in zip(tables, saved, strict=True):
        table.clear()
        table.update(entries)
