"""The model's configuration and the size presets (the handout's table, a tiny CPU size, the leaderboard 8B).

    from cs336_basics.config import ModelConfig
    config = ModelConfig.from_preset("xl", context_length=2048)
    config.num_params            # parameters of BasicsTransformerLM(config), embeddings and head included

Run ``uv run cs336 sizes`` to print the table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DEFAULT_VOCAB_SIZE = 10_000
DEFAULT_CONTEXT_LENGTH = 512

# name -> the dimensions that define a size; vocabulary and context are chosen per run.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=64, d_ff=256, num_layers=2, num_heads=4),
    "small": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": dict(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
    "10B": dict(d_model=4608, d_ff=12288, num_layers=50, num_heads=36),
    "8B": dict(d_model=4096, d_ff=11008, num_layers=34, num_heads=32),  # the leaderboard model
}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a ``BasicsTransformerLM``: pre-norm blocks of RoPE attention and a SwiGLU feed-forward."""

    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    vocab_size: int = DEFAULT_VOCAB_SIZE
    context_length: int = DEFAULT_CONTEXT_LENGTH
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "num_layers", "num_heads", "vocab_size", "context_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.num_heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if (self.d_model // self.num_heads) % 2 != 0:
            raise ValueError(f"the head dimension d_model / num_heads must be even for RoPE, got "
                             f"{self.d_model} / {self.num_heads} = {self.d_model // self.num_heads}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """The preset ``name`` of :data:`PRESETS`, with any field replaced by ``overrides``."""
        if name not in PRESETS:
            raise ValueError(f"unknown model size {name!r}; expected one of {', '.join(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"ModelConfig has no field(s) {', '.join(unknown)}; fields are {', '.join(sorted(fields))}")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def num_params(self) -> int:
        """Parameters of the model, counted from the shapes: embeddings and the untied head included."""
        d = self.d_model
        per_block = 4 * d * d + 3 * d * self.d_ff + 2 * d  # q, k, v, out; w1, w2, w3; two RMSNorm weights
        return self.num_layers * per_block + 2 * self.vocab_size * d + d
