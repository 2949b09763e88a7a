# Call s10b (session 10): what is alive at the allocator's peak (scratch/memprobe2.py: ours at the GPU memory test's
# config, the strong baseline at first:7 and first:8), then the kernels' GPU tests with -n 8 five runs in a row
# (issue 27 item 8).
set -uo pipefail
export CUDA_VISIBLE_DEVICES=0
deadline=$(($(date +%s) + 575))
left() { echo $((deadline - $(date +%s))); }
{
  echo "call id $CS336_CALL_ID commit $(cat .commit)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  timeout 200 bash tools/gpu.sh python3 scratch/memprobe2.py 2>&1 | grep -v Warning | tail -30
  for run in 1 2 3 4 5; do
    if [ "$(left)" -lt 60 ]; then echo "[skip: deadline] run $run"; continue; fi
    echo "== kernels GPU tests run $run, -n 8 ($(left) s left)"
    timeout $(($(left) - 5)) bash tools/gpu.sh python3 -m pytest -m gpu packages/kernels tests/test_kernel_modules.py \
      -n 8 -q -rf -p no:cacheprovider > "$OUT/kernels_run$run.txt" 2>&1; tail -2 "$OUT/kernels_run$run.txt"
  done
  echo "== done ($(left) s left)"
} 2>&1 | tee "$OUT/log.txt"
