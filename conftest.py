"""Repo-wide pytest setup.

Without CUDA, Triton kernels run through the Triton interpreter on CPU tensors; the variable must be set
before any kernel module is imported, which is why it lives here. Tests marked ``gpu`` are skipped.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
