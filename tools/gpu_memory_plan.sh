#!/usr/bin/env bash
# The memory plan against the CUDA allocator on one GPU: for each loss (standard, chunked, fused) and each kind of
# checkpointing, the proxy's step (8B blocks with our attention and glue, bf16, three layers at context 8192), run in
# a process of its own, must peak within 0.1 GiB of the plan (offload: at most 1.5 GiB under it, a bound), and the
# plan must be the step's peak counted on fake tensors to the byte (packages/harness/tests/test_live_memory.py: 21
# steps, all but one marked slow: the quick GPU run keeps that one).
# One pytest run per loss, all three within one call's 10 minutes (the first compiles the kernels), or the losses named,
# for a call with less time (standard about 240 s, fused and chunked about 150 s each); the log in $OUT/log.txt (or
# log-<losses>.txt when named), with each step's planned and measured peak.
#   run (GPU machine, repo root): bash tools/gpu_memory_plan.sh [standard|fused|chunked ...]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
declare -A cap=([standard]=240 [fused]=150 [chunked]=150)
losses=("$@")
[ $# -gt 0 ] || losses=(standard fused chunked)
for loss in "${losses[@]}"; do
  [ -n "${cap[$loss]:-}" ] || { echo "tools/gpu_memory_plan.sh: a loss is standard, fused or chunked; got '$loss'" >&2; exit 2; }
done
OUT="${OUT:-$root/gpu_out}"
mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
log="$OUT/log.txt"
[ $# -eq 0 ] || log="$OUT/log-$(IFS=-; echo "$*").txt"
{
  for loss in "${losses[@]}"; do
    echo "== the plan against the allocator: the $loss loss"
    timeout "${cap[$loss]}" bash tools/gpu.sh python3 -m pytest -m gpu packages/harness/tests/test_live_memory.py \
      -k "planned_peak and $loss" -q -s -p no:cacheprovider || echo "== $loss FAILED or timed out (rc $?)"
  done
} 2>&1 | tee "$log"
