"""The handout's leaderboard training step (section 9), composed from this repo's pieces, and its baselines.

One step (:mod:`cs336_harness.training`) is forward, loss, backward, gradient synchronisation and AdamW update of a
``BasicsTransformerLM`` on ``world_size`` ranks, each holding ``global_batch / world_size`` sequences. The leaderboard
configuration is the 8B preset at vocabulary 151,936, context 32,768, global batch 2, bf16 compute, causal,
on two GPUs. One job per module:

- :mod:`~cs336_harness.studies.leaderboard.config`: :class:`LeaderboardConfig`, the handout's run, the CPU try-out,
  the one-GPU proxy of a rank (:data:`PROXY_DEFAULTS`, ``cs336 leaderboard --proxy``) and the baselines' recipes;
- :mod:`~cs336_harness.studies.leaderboard.memory_trace`: :func:`traced_peak`, the step's peak counted on fake
  tensors (no GPU), which checks the memory plan (:mod:`cs336_harness.memory_plan`);
- :mod:`~cs336_harness.studies.leaderboard.flops`: model FLOPs of a step;
- :mod:`~cs336_harness.studies.leaderboard.runner`: :func:`run_leaderboard`, the timed steps on their ranks and
  the row;
- :mod:`~cs336_harness.studies.leaderboard.tables`: the printed and writeup tables.

From Python, a leaderboard config names its pieces as the command line does and gives the step it runs
(:meth:`LeaderboardConfig.train_config`, a :class:`cs336_harness.train_config.TrainConfig` whose pieces are callables;
the harness README runs this on CPU)::

    config = LeaderboardConfig(size="tiny", vocab_size=1000, context_length=32, global_batch=1, world_size=1,
                               compute_dtype="fp32", attention="sdpa", glue="triton", checkpoint="attention")
    train = config.train_config()
    training = build_training(train, torch.device("cpu"))
    loss = training.step(*make_batch(train))

From the shell::

    uv run cs336 leaderboard                      # CPU: tiny model, two gloo ranks, seconds
    uv run cs336 leaderboard --out rows.jsonl     # two GPUs: the leaderboard configuration
    uv run cs336 leaderboard --proxy --impl ours,torch_native,torch_native_compiled --profile   # one GPU
"""

from cs336_harness.studies.leaderboard.config import (
    CPU_DEFAULTS,
    IMPLS,
    LEADERBOARD_DEFAULTS,
    PROXY_DEFAULTS,
    RECIPES,
    LeaderboardConfig,
    proxy_num_layers,
    recipe,
)
from cs336_harness.studies.leaderboard.flops import step_flops
from cs336_harness.studies.leaderboard.memory_trace import traceable, traced_peak
from cs336_harness.studies.leaderboard.runner import (
    TimeLimitExceeded,
    check_runs_here,
    process_age_s,
    run_leaderboard,
)
from cs336_harness.studies.leaderboard.tables import TABLE_COLUMNS, proxy_rows, writeup_tables

__all__ = [
    "CPU_DEFAULTS",
    "IMPLS",
    "LEADERBOARD_DEFAULTS",
    "PROXY_DEFAULTS",
    "RECIPES",
    "TABLE_COLUMNS",
    "LeaderboardConfig",
    "TimeLimitExceeded",
    "check_runs_here",
    "process_age_s",
    "proxy_num_layers",
    "proxy_rows",
    "recipe",
    "run_leaderboard",
    "step_flops",
    "traceable",
    "traced_peak",
    "writeup_tables",
]
