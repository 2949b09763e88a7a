#!/usr/bin/env bash
# FlashAttention-2 on one GPU of the lent machine, in one call. Two modes:
#   explore: the kernels' GPU tests once, then the wide autotuning sweep (cs336 tune,
#            cs336_harness.studies.attention_tuning: every candidate config timed at the real shapes, then ours
#            against SDPA in one process).
#            Rows: $OUT/attention_tuning.jsonl (about 5 minutes).
#   final:   the attention GPU tests (Triton and Gluon) 5 times in a row, then `cs336 attention --part anchors`
#            (ours by each path, SDPA, its flash backend, FlexAttention at the three anchor shapes).
#            Rows: $OUT/attention_anchors.jsonl.
# Every step has its own timeout and no step starts after $ATTN_DEADLINE_S seconds (default 420), so
# rows written before a hang still come back. Log: $OUT/log.txt.
#   run (GPU machine, repo root): bash tools/gpu_attention.sh explore
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
mkdir -p "$OUT"
mode="${1:-explore}"
deadline=$(($(date +%s) + ${ATTN_DEADLINE_S:-420}))
left() { echo $((deadline - $(date +%s))); }
py=(bash tools/gpu.sh python3)
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
# Tests spread over processes when pytest-xdist is there: most of their time is Triton compiling.
xdist=()
"${py[@]}" -c "import xdist" 2>/dev/null && xdist=(-n 8)
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  case "$mode" in
    explore)
      timeout 150 "${py[@]}" -m pytest -m gpu packages/kernels -q -p no:cacheprovider "${xdist[@]}" \
        || echo "== gpu tests FAILED or timed out (rc $?)"
      timeout "$(left)" "${py[@]}" -m cs336_harness.cli tune --precompile-jobs 8 \
        --out "$OUT/attention_tuning.jsonl"
      ;;
    final)
      # The attention GPU tests 5 times (each pytest process autotunes afresh; compiled kernels come from
      # Triton's disk cache after the first run), keeping the last 100 s for the anchors.
      for run in 1 2 3 4 5; do
        if [ "$(left)" -lt 135 ]; then echo "[skip: deadline] test run $run"; continue; fi
        echo "== gpu test run $run"
        timeout $(($(left) - 100)) "${py[@]}" -m pytest -m gpu packages/kernels/tests/test_flash_attention.py \
          packages/kernels/tests/test_gluon_attention.py \
          -q -p no:cacheprovider "${xdist[@]}" || echo "== gpu test run $run FAILED or timed out (rc $?)"
      done
      timeout "$(left)" "${py[@]}" -m cs336_harness.cli attention --part anchors --precompile-jobs 6 \
        --out "$OUT/attention_anchors.jsonl"
      ;;
    *) echo "unknown mode $mode (explore or final)"; exit 2 ;;
  esac
  ls -la "$OUT"
} 2>&1 | tee "$OUT/log.txt"
