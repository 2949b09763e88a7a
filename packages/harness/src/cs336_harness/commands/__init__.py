"""Subcommands of ``cs336``: one module each; :data:`COMMANDS` gives each its one-line help."""

COMMANDS: dict[str, str] = {
    "attention": "benchmark attention: plain and compiled PyTorch, our FlashAttention-2 vs SDPA (needs a CUDA GPU)",
    "bench": "time forward/backward/optimizer of a Transformer LM (size tiny without CUDA, small with it)",
    "block": "one Transformer block's forward + backward, eager and compiled, ours vs PyTorch's (needs a CUDA GPU)",
    "collectives": "benchmark all-reduce / reduce-scatter / all-gather over sizes, world sizes and backends",
    "ddp": "time DDP training steps (naive, flat, overlapped, bucketed, torch DDP) with timelines",
    "fused": "benchmark our fused kernels against PyTorch, torch.compile and Liger-Kernel (needs a CUDA GPU)",
    "hf": "train Hugging Face Llama-3.2-1B / Qwen3-1.7B shapes: as they come, with Liger-Kernel, with our kernels",
    "leaderboard": "time one full training step of the leaderboard model (FSDP, Triton attention, fused loss, AdamW)",
    "precision": "mixed-precision experiments: four sums, toy-model dtypes under fp16 autocast, layer norm fp16/bf16",
    "residuals": "count tensors saved for backward (RMSNorm, one xl block, four blocks with checkpointing)",
    "shard": "peak memory and step time of DDP, ZeRO-1, our FSDP and FSDP2, with an FSDP timeline figure",
    "sizes": "print the model-size presets with parameter counts and training-state memory",
    "tune": "autotune our FlashAttention over wider config lists at real shapes, or build them for sm_90 (--builds)",
}
