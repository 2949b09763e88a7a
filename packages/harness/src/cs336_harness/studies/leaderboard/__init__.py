"""The handout's leaderboard training step (section 9), composed from this repo's pieces, and its baselines.

One step is forward, loss, backward, gradient synchronisation and AdamW update of a ``BasicsTransformerLM``
on ``world_size`` ranks, each holding ``global_batch / world_size`` sequences. The leaderboard
configuration is the 8B preset at vocabulary 151,936, context 32,768, global batch 2, bf16 compute, causal,
on two GPUs. One job per module:

- :mod:`~cs336_harness.studies.leaderboard.config`: :class:`LeaderboardConfig`, the handout's run, the CPU try-out,
  the one-GPU proxy of a rank (:data:`PROXY_DEFAULTS`, ``cs336 leaderboard --proxy``) and the baselines' recipes;
- :mod:`~cs336_harness.studies.leaderboard.memory`: what a block keeps with the run's kernels, the step's expected
  peak, the memory cap and the checkpointing policy they choose (``checkpoint="budget"``);
- :mod:`~cs336_harness.studies.leaderboard.memory_trace`: :func:`traced_peak`, the step's peak counted on fake
  tensors (no GPU), which checks the plan;
- :mod:`~cs336_harness.studies.leaderboard.training`: :func:`build_training` composes the step (the model with its
  kernels, ``parallelize``, the optimizer) and :class:`Training` runs it;
- :mod:`~cs336_harness.studies.leaderboard.baselines`: the PyTorch-only steps (FSDP2, SDPA, chunked loss);
- :mod:`~cs336_harness.studies.leaderboard.flops`: model FLOPs of a step;
- :mod:`~cs336_harness.studies.leaderboard.runner`: :func:`run_leaderboard`, the timed steps on their ranks and
  the row;
- :mod:`~cs336_harness.studies.leaderboard.tables`: the printed and writeup tables.

From Python, a config goes in and a :class:`Training` with ``step(inputs, targets)`` comes out; each piece
(``attention``, ``glue``, ``checkpoint``, ``optimizer``) is a field of the config (the harness README runs this on
CPU)::

    config = LeaderboardConfig(size="tiny", vocab_size=1000, context_length=32, global_batch=1, world_size=1,
                               compute_dtype="fp32", attention="sdpa", glue="triton", checkpoint="attention")
    training = build_training(config, torch.device("cpu"))
    loss = training.step(*make_batch(config))

From the shell::

    uv run cs336 leaderboard                      # CPU: tiny model, two gloo ranks, seconds
    uv run cs336 leaderboard --out rows.jsonl     # two GPUs: the leaderboard configuration
    uv run cs336 leaderboard --proxy --impl ours,torch_native,torch_native_compiled --profile   # one GPU
"""

from cs336_harness.studies.leaderboard.config import (
    ATTENTIONS,
    BUDGET,
    COMPUTE_DTYPES,
    CPU_DEFAULTS,
    IMPLS,
    LEADERBOARD_DEFAULTS,
    OPTIMIZERS,
    PROXY_DEFAULTS,
    RECIPES,
    LeaderboardConfig,
    proxy_num_layers,
    recipe,
)
from cs336_harness.studies.leaderboard.flops import step_flops
from cs336_harness.studies.leaderboard.memory import (
    MemoryPlan,
    block_memory,
    default_memory_cap_bytes,
    expected_peak_bytes,
    memory_plan,
    reserved_bytes,
)
from cs336_harness.studies.leaderboard.memory_trace import traceable, traced_peak
from cs336_harness.studies.leaderboard.runner import (
    TimeLimitExceeded,
    check_runs_here,
    process_age_s,
    run_leaderboard,
)
from cs336_harness.studies.leaderboard.tables import TABLE_COLUMNS, proxy_rows, writeup_tables
from cs336_harness.studies.leaderboard.training import (
    Training,
    build_model,
    build_training,
    make_batch,
    rank_batch,
)

__all__ = [
    "ATTENTIONS",
    "BUDGET",
    "COMPUTE_DTYPES",
    "CPU_DEFAULTS",
    "IMPLS",
    "LEADERBOARD_DEFAULTS",
    "OPTIMIZERS",
    "PROXY_DEFAULTS",
    "RECIPES",
    "TABLE_COLUMNS",
    "LeaderboardConfig",
    "MemoryPlan",
    "TimeLimitExceeded",
    "Training",
    "block_memory",
    "build_model",
    "build_training",
    "check_runs_here",
    "default_memory_cap_bytes",
    "expected_peak_bytes",
    "make_batch",
    "memory_plan",
    "process_age_s",
    "proxy_num_layers",
    "proxy_rows",
    "rank_batch",
    "recipe",
    "reserved_bytes",
    "run_leaderboard",
    "step_flops",
    "traceable",
    "traced_peak",
    "writeup_tables",
]
