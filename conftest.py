"""Repo-wide pytest setup.

Without CUDA, Triton kernels run through the Triton interpreter on CPU tensors; the variable must be set
before any kernel module is imported, which is why it lives here. Tests marked ``gpu`` are skipped.

With CUDA, every test of the workspace shares the GPU under pytest-xdist (the quick GPU run: ``uv run pytest -m
"gpu and not slow" -n 8``; ``-n auto``) through the kernels tests' plugin ``packages/kernels/tests/gpu_share.py``
(kept there so that the kernels package's tests run alone): a test marked ``gpu_exclusive`` runs alone, the others
within a memory budget.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The kernels tests' conftest puts this folder on sys.path too: one module, so one plugin.
sys.path.insert(0, str(Path(__file__).parent / "packages" / "kernels" / "tests"))

import gpu_share  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    gpu_share.register(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
