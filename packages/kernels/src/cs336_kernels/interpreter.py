"""Where the kernels of cs336_kernels can run: CUDA tensors, or CPU tensors in Triton's interpreter.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined, that is when ``cs336_kernels`` is
imported: with ``TRITON_INTERPRET=1`` every kernel runs in Triton's numpy interpreter on CPU tensors
(slow, for tests), otherwise it is compiled for a GPU. Setting the variable after the import changes
nothing, so the mode is read once here and :func:`check_device` names the fix.

numpy has no bfloat16: the interpreter holds bf16 values as their raw 16 bits, multiplies those integers in a bf16
``tl.dot`` (attention outputs off by 1e8), and truncates a cast to bf16 where a GPU rounds to nearest (one ulp).
The elementwise kernels take bf16 there at that cost; :func:`check_bf16` refuses it where the result is wrong.
"""

from __future__ import annotations

import os

import torch

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRET:
    try:
        import numpy  # noqa: F401  (Triton's interpreter runs every program in numpy)
    except ImportError as error:
        raise ImportError("TRITON_INTERPRET=1 runs the kernels in Triton's interpreter, which needs numpy < 2.4: "
                          "install cs336-kernels[cpu] (or numpy<2.4)") from error


def _fake_tensors() -> bool:
    """Whether this call runs on fake tensors outside torch.compile: the operators' fake implementations, no kernel
    (e.g. counting a step's memory), so no device or dtype is refused. Under torch.compile the traced tensors stand for
    the real ones the compiled code will get, on the same device, so the checks apply; Dynamo could not trace the
    dispatch-mode query anyway, and ``is_compiling()`` is a constant to it, so the query is never traced."""
    return not torch.compiler.is_compiling() and (
        torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None)


def check_device(device: torch.device, caller: str) -> None:
    """Raise ValueError unless the kernels can run on ``device`` in this process.

    Args:
        device: where the caller's tensors are.
        caller: what is asking, for the message (e.g. ``"flash_attention"``).
    """
    if device.type == "cuda" or (INTERPRET and device.type == "cpu") or _fake_tensors():
        return
    late = " (it is set now, but was not when cs336_kernels was imported)" if (
        os.environ.get("TRITON_INTERPRET") == "1" and not INTERPRET
    ) else ""
    raise ValueError(
        f"{caller} runs Triton kernels on CUDA tensors, or on CPU tensors in Triton's interpreter; got "
        f"tensors on {device}. To run on CPU, set TRITON_INTERPRET=1 before importing cs336_kernels{late}."
    )


def check_bf16(device: torch.device, dtype: torch.dtype, caller: str, wrong: str) -> None:
    """Raise ValueError for bf16 tensors on CPU in the interpreter, which ``caller`` computes wrongly there.

    Args:
        device, dtype: the caller's tensors'.
        caller: what is asking, for the message (e.g. ``"flash_attention"``).
        wrong: what goes wrong, for the message (e.g. ``"it multiplies bf16 matrices as raw bits"``).
    """
    if INTERPRET and device.type == "cpu" and dtype == torch.bfloat16 and not _fake_tensors():
        raise ValueError(f"{caller} got bfloat16 tensors on CPU, which Triton's interpreter computes wrongly "
                         f"({wrong}); use float32 or float16 there, or a CUDA GPU.")
