"""Model-size presets: the handout's table (small to 10B), a tiny CPU size, and the leaderboard 8B."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSize:
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")


MODEL_SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(d_model=64, d_ff=256, num_layers=2, num_heads=4),
    "small": ModelSize(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": ModelSize(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": ModelSize(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": ModelSize(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
    "10B": ModelSize(d_model=4608, d_ff=12288, num_layers=50, num_heads=36),
    "8B": ModelSize(d_model=4096, d_ff=11008, num_layers=34, num_heads=32),  # the leaderboard model
}

DEFAULT_VOCAB_SIZE = 10_000
DEFAULT_BATCH_SIZE = 4
DEFAULT_CONTEXT_LENGTH = 512


def num_params(size: ModelSize, vocab_size: int = DEFAULT_VOCAB_SIZE) -> int:
    """Parameters of a ``BasicsTransformerLM`` of this size (embeddings and untied head included)."""
    d = size.d_model
    per_block = 4 * d * d + 3 * d * size.d_ff + 2 * d  # q, k, v, out; w1, w2, w3; two RMSNorm weights
    return size.num_layers * per_block + 2 * vocab_size * d + d
