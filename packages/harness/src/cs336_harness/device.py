"""The one home of device facts the studies share: dtype names, synchronisation, the measured ceilings of a GPU and
the model FLOPs utilisation against them.

A dtype name means one thing everywhere: ``fp32`` is float32 compute, ``bf16`` and ``fp16`` the 16-bit types
(as autocast or FSDP compute dtype, whichever the study uses).
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GIB = 2**30
# Without CUDA a command's defaults are a try-out that finishes in seconds: this context length (and the tiny preset).
CPU_CONTEXT_LENGTH = 128

# Ceilings measured on one NVIDIA H200 (torch 2.11, triton 3.6): a bf16 8192^3 matmul on random data, and a
# device-to-device copy (bytes read plus written). Utilisation figures divide by these; the data sheet's peaks are
# higher, so utilisation against them would be lower.
H200_BF16_MATMUL_FLOPS = 772e12
H200_COPY_BYTES_PER_S = 4.24e12
# The measured bf16 matmul ceiling of each GPU, by its torch.cuda.get_device_name(): what MFU divides by.
BF16_MATMUL_FLOPS: dict[str, float] = {"NVIDIA H200": H200_BF16_MATMUL_FLOPS}


def mfu(model_flops: float, seconds: float, num_gpus: int, gpu_name: str) -> float | None:
    """Model FLOPs utilisation: ``model_flops`` done in ``seconds`` on ``num_gpus`` GPUs named ``gpu_name``, over
    their measured bf16 matmul ceiling (:data:`BF16_MATMUL_FLOPS`); None for a GPU whose ceiling was not measured
    (another GPU's ceiling would make the ratio meaningless)."""
    peak = BF16_MATMUL_FLOPS.get(gpu_name)
    return None if peak is None else model_flops / (seconds * num_gpus * peak)


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a name of :data:`DTYPES`."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def default_device() -> str:
    """``cuda`` when a GPU is present, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(name: str) -> str:
    """``name`` if it is a device a study can run on here: ``cpu``, or ``cuda`` / ``cuda:N`` with that GPU present.

    Raises:
        ValueError: naming what was expected and what was given.
    """
    index = name.removeprefix("cuda:")
    if name not in ("cpu", "cuda") and not (name.startswith("cuda:") and index.isdigit()):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but CUDA is not available here")
        if name != "cuda" and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} asked for, but only {torch.cuda.device_count()} GPUs are visible")
    return name


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
