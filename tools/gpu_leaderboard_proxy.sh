#!/usr/bin/env bash
# The one-GPU proxy of a leaderboard rank (issue 19) on one H200, in one call of under 9 minutes: the proxy step
# (8B blocks, 14 layers, one sequence of 32768 tokens, bf16, world size 1, memory cap 92 GiB) ours and the two
# PyTorch-only baselines, as rows of one call (one CS336_CALL_ID), most important first:
#   1. ours: our attention (the Gluon kernels on sm_90), our glue kernels, the budget policy (the exact memory plan:
#      selective:13 at 92 GiB, no block recomputing a matmul), profiled, with the handout's do_bench timing;
#   2. the strong baseline (each block compiled with its checkpoint; per block none, selective (matmul and SDPA
#      outputs kept) or full checkpointing by the budget's rule: first:4+selective:8 in its plan at 92 GiB), profiled;
#   3. the plain baseline (every block checkpointed, eager);
#   4. ours with offload:4 (the first four blocks' saved activations in pinned host memory, the other ten kept whole:
#      nothing recomputed), profiled, with do_bench: offloading against the budget's recomputation;
#   5. ours with two blocks recomputing their matmuls (attention:2+selective:10, the budget's pick while selective
#      blocks kept w2's output too): what the lighter selective blocks buy;
#   6. ours with nothing recomputed (checkpoint none, about 110 GiB under a 130 GiB cap): what the cap still costs;
# then the markdown tables from the rows, then the GPU tests of the proxy and of the memory plan (block memory, the
# strong baseline's compiled selective block and the step's peak against the allocator, the glue kernels' step
# against the model's code in bf16, a small profiled run of all three impls). Every run is its own process with its own timeout and --time-limit-s, none starts with
# under 75 s left, so rows written before a hang or an out-of-memory come back. Results in $OUT (3 files):
# leaderboard_proxy.jsonl (copy it to writeup/results/leaderboard_proxy.jsonl), tables.md, log.txt.
#   run (GPU machine, repo root): bash tools/gpu_leaderboard_proxy.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
mkdir -p "$OUT"
deadline=$(($(date +%s) + ${PROXY_DEADLINE_S:-520}))
left() { echo $((deadline - $(date +%s))); }
export CS336_CALL_ID="${CS336_CALL_ID:-$(date -u +%Y%m%dT%H%M%SZ)-proxy-$$}"  # one id for every row of this call
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
cs336=(bash tools/gpu.sh python3 -m cs336_harness.cli)
rows="$OUT/leaderboard_proxy.jsonl"
proxy() {  # proxy NAME MAX_S [FLAGS...]: one cs336 leaderboard --proxy run, skipped when under 75 s are left
  local name="$1" max="$2"; shift 2
  if [ "$(left)" -lt 75 ]; then echo "[skip: deadline] $name"; return; fi
  local limit=$(($(left) - 15))
  [ "$limit" -gt "$max" ] && limit=$max
  echo "== $name (time limit ${limit} s, $(left) s left)"
  timeout $((limit + 20)) "${cs336[@]}" leaderboard --proxy --memory-cap-gib 92 --time-limit-s "$limit" \
    --out "$rows" "$@" || echo "== $name FAILED or timed out (rc $?)"
}
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  echo "call id $CS336_CALL_ID"
  proxy "ours: triton glue, budget checkpointing" 200 --glue triton --checkpoint budget --profile --handout-timing
  proxy "strong baseline: compiled blocks, budget" 200 --impl torch_native_compiled --profile
  proxy "plain baseline: every block checkpointed" 100 --impl torch_native
  proxy "ours: offload:4" 100 --glue triton --checkpoint offload:4 --profile --handout-timing
  proxy "ours: attention:2+selective:10" 100 --glue triton --checkpoint attention:2+selective:10
  proxy "ours: no checkpointing, cap 130 GiB" 100 --glue triton --checkpoint none --memory-cap-gib 130
  if [ -s "$rows" ]; then
    timeout 60 "${cs336[@]}" leaderboard --markdown "$rows" > "$OUT/tables.md" || echo "== tables FAILED (rc $?)"
  fi
  if [ "$(left)" -gt 45 ]; then
    echo "== gpu tests ($(left) s left)"
    # Of the step's peak against the allocator, ours (the fused loss) only: every loss and checkpointing kind is
    # tools/gpu_memory_plan.sh's call.
    timeout "$(left)" bash tools/gpu.sh python3 -m pytest -m gpu packages/harness/tests/test_leaderboard_proxy.py \
      packages/harness/tests/test_live_memory.py -k "not planned_peak or fused-attention" -q -p no:cacheprovider \
      || echo "== gpu tests FAILED or timed out (rc $?)"
  else
    echo "[skip: deadline] gpu tests"
  fi
  ls -la "$OUT"
} 2>&1 | tee "$OUT/log.txt"
