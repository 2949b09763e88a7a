"""pytest setup of the kernels package, so that its tests run from the package alone.

Without CUDA the kernels run in Triton's interpreter on CPU tensors; ``TRITON_INTERPRET`` must be set
before ``cs336_kernels`` is imported, which is why it is set here. Tests marked ``gpu`` are skipped
without CUDA; ``slow`` marks tests that take more than a few seconds on CPU.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # shared test modules (attention_tolerances)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on CPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
