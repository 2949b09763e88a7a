"""Model FLOPs of a leaderboard step, for its model FLOPs utilisation (:func:`cs336_harness.device.mfu`)."""

from __future__ import annotations

from cs336_basics.config import ModelConfig


def step_flops(config: ModelConfig, global_batch: int) -> float:
    """Model FLOPs of one training step (forward and backward): what the model needs, not what the kernels run, so
    neither checkpointing's recomputation nor FlashAttention's recomputed scores count.

    matmuls: 6 * tokens * non-embedding matmul parameters, where per block 4 d^2 (q, k, v, out) + 3 d d_ff
             (SwiGLU) and the LM head V d (the embedding is a lookup, not a matmul);
    attention: per layer 4 * b * h * s^2 * d_head (Q K^T and P V, 2 FLOPs per multiply-add), halved for the
             causal mask, times 3 for forward plus backward (the backward's four products against the forward's
             two).
    """
    d, s, b = config.d_model, config.context_length, global_batch
    matmul_params = config.num_layers * (4 * d * d + 3 * d * config.d_ff) + config.vocab_size * d
    attention_per_layer = 4 * b * config.num_heads * s**2 * config.head_dim / 2 * 3
    return 6 * b * s * matmul_params + config.num_layers * attention_per_layer
