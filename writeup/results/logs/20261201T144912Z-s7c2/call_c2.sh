# Call C2 (session 7): the glue bench (SiLU-mul flat grid, add + RMSNorm) with Liger-Kernel, the proxy with the
# folded residual add and its baselines, the new kernels' GPU tests 5 times (serial), the proxy's and the
# deterministic-training GPU tests once.
set -uo pipefail
export CS336_CALL_ID=$(date -u +%Y%m%dT%H%M%SZ)-s7c2
export CUDA_VISIBLE_DEVICES=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
deadline=$(($(date +%s) + 500))
left() { echo $((deadline - $(date +%s))); }
cs336=(bash tools/gpu.sh python3 -m cs336_harness.cli)
rows="$OUT/leaderboard_proxy.jsonl"
proxy() {
  local name="$1" max="$2"; shift 2
  if [ "$(left)" -lt 75 ]; then echo "[skip: deadline] $name"; return; fi
  local limit=$(($(left) - 15)); [ "$limit" -gt "$max" ] && limit=$max
  echo "== $name (time limit ${limit} s, $(left) s left)"
  timeout $((limit + 20)) "${cs336[@]}" leaderboard --proxy --memory-cap-gib 92 --time-limit-s "$limit" \
    --out "$rows" "$@" 2>&1 | grep -v "step/s\|s/ step" | tail -4 || echo "== $name FAILED or timed out (rc $?)"
}
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  echo "call id $CS336_CALL_ID commit $(cat .commit)"
  echo "== fused glue bench ($(left) s left)"
  timeout 150 "${cs336[@]}" fused --bench swiglu --bench rms-norm --bench add-rms-norm --out "$OUT/fused.jsonl" 2>&1 | tail -30
  proxy "ours: default attention, triton glue (add folded into ln2), budget" 200 --glue triton --checkpoint budget --profile
  proxy "strong baseline" 200 --impl torch_native_compiled --profile
  proxy "plain baseline" 100 --impl torch_native
  for run in 1 2 3 4 5; do
    if [ "$(left)" -lt 110 ]; then echo "[skip: deadline] kernel test run $run"; continue; fi
    echo "== new kernels gpu test run $run ($(left) s left)"
    timeout 60 bash tools/gpu.sh python3 -m pytest -m gpu packages/kernels/tests/test_rms_norm.py \
      packages/kernels/tests/test_swiglu.py -q -p no:cacheprovider 2>&1 | tail -3
  done
  echo "== proxy + determinism gpu tests ($(left) s left)"
  timeout $(($(left) - 5)) bash tools/gpu.sh python3 -m pytest -m gpu packages/harness/tests/test_leaderboard_proxy.py \
    tests/test_determinism.py packages/kernels/tests/test_fused_linear_cross_entropy.py -q -p no:cacheprovider 2>&1 | tail -8
} 2>&1 | tee "$OUT/log.txt"
