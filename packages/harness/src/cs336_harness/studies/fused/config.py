"""The fused-kernel benchmarks' configuration (:class:`FusedBenchConfig`) and the names of the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BENCHES: tuple[str, ...] = ("adamw", "linear-ce", "rms-norm", "add-rms-norm", "rope", "swiglu")


@dataclass(frozen=True)
class FusedBenchConfig:
    benches: tuple[str, ...] = BENCHES
    adamw_params: int = 10**9
    adamw_tensors: int = 16
    tokens: int = 32768
    d_model: int = 4096
    vocab_size: int = 151936
    d_ff: int = 11008
    num_heads: int = 32
    warmup_ms: int = 200
    rep_ms: int = 1000
    # The glue benchmarks time every implementation this many times (each a do_bench median), in turns.
    repeats: int = 5
    # FusedAdamW launch granularities timed besides the default.
    adamw_elements_per_program: tuple[int, ...] = (2048, 262144)
    # Fused variants with these token chunk sizes are timed besides the default (which fits the memory budget).
    extra_chunk_sizes: tuple[int, ...] = (1024, 4096)

    def __post_init__(self) -> None:
        if not torch.cuda.is_available():
            raise ValueError("the fused-kernel benchmarks measure GPU kernels and need a CUDA GPU")
        if not self.benches or any(b not in BENCHES for b in self.benches):
            raise ValueError(f"benches must be a non-empty subset of {BENCHES}, got {self.benches}")
        if self.adamw_tensors < 1 or self.adamw_params < self.adamw_tensors:
            raise ValueError(f"need 1 <= adamw_tensors <= adamw_params, got {self.adamw_tensors} tensors "
                             f"for {self.adamw_params} params")
        for name in ("tokens", "d_model", "vocab_size", "d_ff", "num_heads", "warmup_ms", "rep_ms", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ValueError(f"d_model must be num_heads times an even head_dim, got d_model {self.d_model} and "
                             f"{self.num_heads} heads")
        if any(n < 1 or n % 2048 for n in self.adamw_elements_per_program):
            raise ValueError(f"adamw elements per program must be positive multiples of 2048, "
                             f"got {self.adamw_elements_per_program}")
        if any(c < 1 for c in self.extra_chunk_sizes):
            raise ValueError(f"extra chunk sizes must be positive, got {self.extra_chunk_sizes}")
