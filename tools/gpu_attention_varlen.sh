#!/usr/bin/env bash
# Packed documents and sliding windows (issue 53, point 5) on one H100/H200, in one call of at most 5 minutes, most
# important first:
#   1. `cs336 attention --part varlen`: 32,768 tokens in documents of seeded random lengths (256-8,192), 32 query and
#      8 key/value heads, d 128, causal, bf16; ours (flash_attention_varlen), the sum of our dense calls on each
#      document alone, FlexAttention's document mask (compiled), torch.nn.attention.varlen and FA4's varlen, in one
#      process: forward, backward and forward + backward;
#   2. `cs336 attention --part window`: a 4,096-key sliding window at (1, 32, 32768, 128), bf16: ours, FA4's window
#      and FlexAttention's sliding-window mask, in one process;
#   3. the GPU tests of both parts (each implementation's output and gradients against a float64 reference at a
#      small size), in the time left.
# FA4 comes from $PEERS (default /tmp/peers, laid out there by ../shared/peers/install.sh); where it does not import,
# its rows say why (status "skipped") and its tests skip. Each step is its own process with its own timeout, none
# starts after $VARLEN_DEADLINE_S seconds (default 290) or without the time it needs, so what finished comes back.
# Results in $OUT: attention_varlen.jsonl (rows of both parts, one call id: append to
# writeup/results/attention_varlen.jsonl), log.txt (ending with the tables of the rows).
#   run (GPU machine, repo root): bash tools/gpu_attention_varlen.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
mkdir -p "$OUT"
work="$(mktemp -d)"
deadline=$(($(date +%s) + ${VARLEN_DEADLINE_S:-290}))
source tools/gpu_steps.sh
export CS336_CALL_ID="${CS336_CALL_ID:-$(date -u +%Y%m%dT%H%M%SZ)-varlen-$$}"  # one id for every row of this call
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
use_fa4 "$work/fa4_cache"
py=(bash tools/gpu.sh python3)
rows="$OUT/attention_varlen.jsonl"

{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
  echo "call id $CS336_CALL_ID commit $(cat .commit 2>/dev/null || echo unknown)"
  "${py[@]}" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  fa4_versions

  step "1. varlen: ours, per document, flex, sdpa_varlen, FA4 at 32k tokens" 90 170 "${py[@]}" -m cs336_harness.cli \
    attention --part varlen --quiet --out "$rows"
  step "2. window: ours, FA4, flex, window 4096 at (1, 32, 32768, 128)" 60 110 "${py[@]}" -m cs336_harness.cli \
    attention --part window --quiet --out "$rows"
  step "3. GPU tests of the varlen and window parts" 45 120 "${py[@]}" -m pytest -m gpu \
    packages/harness/tests/test_attention_varlen.py -q -p no:cacheprovider -n 4

  if [ -s "$rows" ]; then
    echo "== tables"
    "${py[@]}" -m cs336_harness.cli attention --markdown "$rows" 2>&1 | tail -30
  fi
  echo "== done ($(left) s left)"
  ls -la "$OUT"
} 2>&1 | tee "$OUT/log.txt"
rm -rf "$work"
