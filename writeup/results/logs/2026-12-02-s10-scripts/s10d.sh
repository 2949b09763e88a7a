# Call s10d (session 10): the proxy with every recipe's default budget at 92 GiB (the strong recipe's plan now picks
# first:7), then the GPU tests of the proxy and of the memory plan in one process (as in s10a).
set -uo pipefail
export CUDA_VISIBLE_DEVICES=0
export PROXY_DEADLINE_S=400
deadline=$(($(date +%s) + 400))
left() { echo $((deadline - $(date +%s))); }
cs336=(bash tools/gpu.sh python3 -m cs336_harness.cli)
rows="$OUT/leaderboard_proxy.jsonl"
{
  echo "call id $CS336_CALL_ID commit $(cat .commit)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  for args in "--glue triton --checkpoint budget --handout-timing" "--impl torch_native_compiled" "--impl torch_native"; do
    echo "== $args ($(left) s left)"
    timeout 150 "${cs336[@]}" leaderboard --proxy --memory-cap-gib 92 --time-limit-s 130 --out "$rows" $args 2>&1 \
      | grep -v "step/s\|Warning\|warn\|return func" | tail -4
  done
  timeout 60 "${cs336[@]}" leaderboard --markdown "$rows" > "$OUT/tables.md"; cat "$OUT/tables.md"
  echo "== gpu tests ($(left) s left)"
  timeout $(($(left) - 5)) bash tools/gpu.sh python3 -m pytest -m gpu packages/harness/tests/test_leaderboard_proxy.py \
    packages/harness/tests/test_live_memory.py -q -p no:cacheprovider 2>&1 | tail -4
  echo "== done ($(left) s left)"
} 2>&1 | tee "$OUT/log.txt"
