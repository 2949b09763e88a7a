"""pytest setup of the kernels package, so that its tests run from the package alone.

Without CUDA the kernels run in Triton's interpreter on CPU tensors; ``TRITON_INTERPRET`` must be set
before ``cs336_kernels`` is imported, which is why it is set here. Tests marked ``gpu`` are skipped
without CUDA; ``slow`` marks tests that take more than a few seconds on CPU, and the GPU tests that the quick GPU
run (``-m "gpu and not slow"``) leaves out.

With CUDA, tests share the GPU under pytest-xdist (``-n 8``, ``-n auto``) through the plugin in ``gpu_share.py``:
a test marked ``gpu_exclusive`` runs alone, the others within a memory budget.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # shared test modules (attention_tolerances, gpu_share)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gpu_share  # noqa: E402  (from this folder, on sys.path above)


def pytest_configure(config: pytest.Config) -> None:
    gpu_share.register(config)
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on CPU (a gpu test: left out of the "
                            "quick GPU run, README)")
    config.addinivalue_line("markers", "interpreter: runs kernels on CPU tensors in Triton's interpreter (skipped "
                            "where CUDA is available, since the interpreter is then off)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs Triton's interpreter (no CUDA)" if cuda else "needs a CUDA GPU")
    for item in items:
        if ("interpreter" if cuda else "gpu") in item.keywords:
            item.add_marker(skip)
