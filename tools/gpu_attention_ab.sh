#!/usr/bin/env bash
# The attention kernels of the working tree against those of another revision (`.base`, staged here by
# tools/stage_base.sh and carried) on one H200, in one call of at most 9 minutes:
#   1. the attention GPU tests of the tree once (-n 8; a kernel that hangs or fails shows here first);
#   2. `cs336 attention --part anchors` (ours by default and in deterministic mode, cuDNN; bf16, causal) at
#      $AB_SHAPES, the tree and `.base` in turns, twice, so that each is timed beside the other;
#   3. the tests again, up to four more times, in the time left (issue 40's five runs in a row).
# Rows: $OUT/attention_anchors.jsonl (the tree's) and $OUT/attention_anchors_base.jsonl (the base's, which name its
# commit); both go to writeup/results/attention_anchors.jsonl, the rows of a change that is not kept with a
# `variant` saying so (the writeup's tables leave those out). Every step has its own timeout and none starts past the
# deadline ($AB_DEADLINE_S seconds, default 520; a test run may take $AB_TEST_S seconds, default 150, more when
# new kernels compile). Log: $OUT/log.txt.
#   run (GPU machine, repo root): bash tools/gpu_attention_ab.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
mkdir -p "$OUT"
deadline=$(($(date +%s) + ${AB_DEADLINE_S:-520}))
source tools/gpu_steps.sh
export CS336_CALL_ID="${CS336_CALL_ID:-$(date -u +%Y%m%dT%H%M%SZ)-ab-$$}"  # one id for every row of this call
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
read -r -a shapes <<< "${AB_SHAPES:-1,32,32768,128 4,32,4096,128 1,16,16384,64 1,32,16384,128}"
[ -f .base/.commit ] || { echo "no .base: run 'bash tools/stage_base.sh REVISION' here and carry .base"; exit 2; }
anchors=(-m cs336_harness.cli attention --part anchors --quiet --anchor-impls "${AB_IMPLS:-ours,ours_deterministic,sdpa}"
         --anchor-shapes "${shapes[@]}")

tests() {  # tests RUN: the attention GPU tests of the tree
  step "attention GPU tests, run $1" 60 "${AB_TEST_S:-150}" bash tools/gpu.sh python3 -m pytest -m gpu \
    packages/kernels/tests/test_flash_attention.py packages/kernels/tests/test_gluon_attention.py \
    packages/kernels/tests/test_attention_knobs.py -q \
    -p no:cacheprovider -n 8
}
{
  nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv
  echo "call id $CS336_CALL_ID; tree $(cat .commit 2>/dev/null || echo unknown); base $(cat .base/.commit)"
  tests 1
  for pass in 1 2; do
    step "anchors, tree, pass $pass" 40 150 bash tools/gpu.sh python3 "${anchors[@]}" \
      --out "$OUT/attention_anchors.jsonl"
    step "anchors, base, pass $pass" 40 150 bash -c 'cd .base && exec bash tools/gpu.sh python3 "$@"' _ \
      "${anchors[@]}" --out "$OUT/attention_anchors_base.jsonl"
  done
  for run in 2 3 4 5; do tests "$run" || true; done
  nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv
  ls -la "$OUT"
} 2>&1 | tee "$OUT/log.txt"
