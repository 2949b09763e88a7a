# Call B (session 7): the proxy with the new default attention backward, its baselines, the anchors, one test run.
set -uo pipefail
export CS336_CALL_ID=$(date -u +%Y%m%dT%H%M%SZ)-s7b
export CUDA_VISIBLE_DEVICES=0
deadline=$(($(date +%s) + 540))
left() { echo $((deadline - $(date +%s))); }
cs336=(bash tools/gpu.sh python3 -m cs336_harness.cli)
rows="$OUT/leaderboard_proxy.jsonl"
proxy() {
  local name="$1" max="$2"; shift 2
  if [ "$(left)" -lt 75 ]; then echo "[skip: deadline] $name"; return; fi
  local limit=$(($(left) - 15)); [ "$limit" -gt "$max" ] && limit=$max
  echo "== $name (time limit ${limit} s, $(left) s left)"
  timeout $((limit + 20)) "${cs336[@]}" leaderboard --proxy --memory-cap-gib 92 --time-limit-s "$limit" \
    --out "$rows" "$@" || echo "== $name FAILED or timed out (rc $?)"
}
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  echo "call id $CS336_CALL_ID commit $(cat .commit 2>/dev/null) $(git rev-parse --short HEAD 2>/dev/null)"
  proxy "ours: gluon backward (default), triton glue, budget" 200 --glue triton --checkpoint budget --profile
  proxy "strong baseline" 200 --impl torch_native_compiled --profile
  proxy "plain baseline" 100 --impl torch_native
  proxy "ablation: sdpa attention, triton glue, budget" 100 --attention sdpa --glue triton --checkpoint budget
  echo "== anchors ($(left) s left)"
  timeout $(($(left) - 90)) "${cs336[@]}" attention --part anchors --precompile-jobs 6 --out "$OUT/attention_anchors.jsonl" \
    || echo "== anchors FAILED (rc $?)"
  echo "== attention gpu tests ($(left) s left)"
  timeout $(($(left) - 5)) bash tools/gpu.sh python3 -m pytest -m gpu packages/kernels/tests/test_flash_attention.py \
    packages/kernels/tests/test_gluon_attention.py -q -p no:cacheprovider -n 8 || echo "== tests FAILED (rc $?)"
  ls -la "$OUT"
} 2>&1 | tee "$OUT/log.txt"
