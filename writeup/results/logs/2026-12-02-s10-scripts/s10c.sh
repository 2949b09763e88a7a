# Call s10c (session 10): (1) ours at the GPU memory test's config without a process group, steps 1-3 peaks and what
# is alive at each; (2) the strong baseline at first:7, what is alive at its peak (fresh process; without stacks if
# python stacks fail); (3) the GPU memory test (now after two warm-up steps, as the runner); (4) eager PyTorch
# attention with 100 passes (issue 26: the handout's count).
set -uo pipefail
export CUDA_VISIBLE_DEVICES=0
deadline=$(($(date +%s) + 580))
left() { echo $((deadline - $(date +%s))); }
{
  echo "call id $CS336_CALL_ID commit $(cat .commit)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  echo "== ours steps ($(left) s left)"
  timeout 90 bash tools/gpu.sh python3 scratch/probe_ours_steps.py 2>&1 | grep -v Warning | tail -45
  echo "== strong, python stacks ($(left) s left)"
  timeout 120 bash tools/gpu.sh python3 scratch/probe_strong.py python 2>&1 | grep -v Warning | tail -30
  if [ ! -s "$OUT/probe_strong_python.json" ]; then
    echo "== strong, no stacks ($(left) s left)"
    timeout 120 bash tools/gpu.sh python3 scratch/probe_strong.py none 2>&1 | grep -v Warning | tail -30
  fi
  echo "== gpu memory test ($(left) s left)"
  timeout 90 bash tools/gpu.sh python3 -m pytest -m gpu packages/harness/tests/test_live_memory.py -q \
    -p no:cacheprovider 2>&1 | tail -15
  echo "== eager attention, 100 passes ($(left) s left)"
  timeout $(($(left) - 5)) bash tools/gpu.sh python3 -m cs336_harness.cli attention --part pytorch --passes 100 \
    --out "$OUT/attention_pytorch.jsonl" 2>&1 | grep -v "it/s\|Warning" | tail -40
  echo "== done ($(left) s left)"
} 2>&1 | tee "$OUT/log.txt"
