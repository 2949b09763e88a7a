# Call C1 (session 7): every kernels GPU test 5 times in a row, then the anchors (every path, one call).
set -uo pipefail
export CS336_CALL_ID=$(date -u +%Y%m%dT%H%M%SZ)-s7c1
export CUDA_VISIBLE_DEVICES=0
deadline=$(($(date +%s) + 560))
left() { echo $((deadline - $(date +%s))); }
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  echo "call id $CS336_CALL_ID commit $(cat .commit)"
  for run in 1 2 3 4 5; do
    if [ "$(left)" -lt 200 ]; then echo "[skip: deadline] test run $run"; continue; fi
    echo "== kernels gpu test run $run ($(left) s left)"
    timeout $(($(left) - 160)) bash tools/gpu.sh python3 -m pytest -m gpu packages/kernels -q -p no:cacheprovider -n 8 \
      2>&1 | tail -15 || echo "== run $run FAILED (rc $?)"
  done
  echo "== anchors ($(left) s left)"
  timeout $(($(left) - 5)) bash tools/gpu.sh python3 -m cs336_harness.cli attention --part anchors --precompile-jobs 6 \
    --out "$OUT/attention_anchors.jsonl" 2>&1 | tail -5 || echo "== anchors FAILED (rc $?)"
} 2>&1 | tee "$OUT/log.txt"
