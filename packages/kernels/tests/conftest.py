"""pytest setup of the kernels package, so that its tests run from the package alone.

Without CUDA the kernels run in Triton's interpreter on CPU tensors; ``TRITON_INTERPRET`` must be set
before ``cs336_kernels`` is imported, which is why it is set here. Tests marked ``gpu`` are skipped
without CUDA; ``slow`` marks tests that take more than a few seconds on CPU.

With CUDA, tests share the GPU under pytest-xdist (``-n 8``) through a file lock: every test holds it shared, a
test marked ``gpu_exclusive`` (one that needs tens of GiB) holds it alone, and each test hands its cached memory
back to the driver when it ends, so an exclusive test finds the GPU empty.
"""

import fcntl
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # shared test modules (attention_tolerances)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on CPU")
    config.addinivalue_line("markers", "gpu_exclusive: needs the GPU's memory to itself (run alone under xdist)")
    config.addinivalue_line("markers", "interpreter: runs kernels on CPU tensors in Triton's interpreter (skipped "
                            "where CUDA is available, since the interpreter is then off)")


# One lock for every pytest worker on this machine.
_GPU_LOCK = Path(tempfile.gettempdir()) / "cs336-kernels-gpu-tests.lock"


@pytest.fixture(autouse=True)
def _share_the_gpu(request: pytest.FixtureRequest):
    if not torch.cuda.is_available():
        yield
        return
    with open(_GPU_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if "gpu_exclusive" in request.keywords else fcntl.LOCK_SH)
        try:
            yield
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs Triton's interpreter (no CUDA)" if cuda else "needs a CUDA GPU")
    for item in items:
        if ("interpreter" if cuda else "gpu") in item.keywords:
            item.add_marker(skip)
