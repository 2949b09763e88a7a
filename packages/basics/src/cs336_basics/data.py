"""Random language-model batches from a 1-D token array (an ``np.ndarray`` or ``np.memmap``)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch


def get_batch(
    dataset: npt.NDArray, batch_size: int, context_length: int, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` windows; returns inputs and next-token targets, each (batch, context) int64.

    Only the sampled windows are read, so a memory-mapped dataset is never loaded whole.
    """
    if dataset.ndim != 1:
        raise ValueError(f"dataset must be a 1-D token array, got shape {dataset.shape}")
    if batch_size <= 0 or context_length <= 0:
        raise ValueError(f"batch_size and context_length must be positive, got {batch_size}, {context_length}")
    if len(dataset) <= context_length:
        raise ValueError(f"dataset of {len(dataset)} tokens is too short for context_length {context_length}")
    starts = np.random.randint(0, len(dataset) - context_length, size=batch_size)
    windows = np.stack([np.asarray(dataset[s : s + context_length + 1], dtype=np.int64) for s in starts])
    x = torch.from_numpy(windows[:, :-1]).to(device)
    y = torch.from_numpy(windows[:, 1:]).to(device)
    return x, y
