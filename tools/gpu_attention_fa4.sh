#!/usr/bin/env bash
# Our attention against FlashAttention-4 (issue 40) on one H200, in one call of at most 8 minutes (call s17c took under
# 3, FA4's compiles included), most important first:
#   1. `cs336 attention --part anchors`, bf16, causal: ours, cuDNN (sdpa) and FA4 in one process, forward, backward
#      and forward + backward at (1, 32, 32768, 128), (4, 32, 4096, 128), (1, 16, 16384, 64), (1, 32, 16384, 128);
#   2. the same at (1, 32, 32768, 128) for ours and FA4, each by default and deterministic, in one process;
#   3. Nsight Compute (--set full, --clock-control none) on one launch of each backward kernel, ours
#      (_attn_bwd_kernel) and FA4's (FlashAttentionBackwardSm90), at (1, 32, 16384, 128): warp-state stalls, scheduler
#      and pipe statistics, instruction mix, shared-memory wavefronts and bank conflicts, occupancy, launch stats;
#   4. every kernel of one forward + backward of ours, FA4 and cuDNN at (1, 32, 16384, 128), timed by torch.profiler;
#   5. Nsight Compute on both forward kernels at (1, 16, 16384, 64).
# FA4 comes from $PEERS (default /tmp/peers, laid out there by ../shared/peers/install.sh); where it does not import,
# its rows say why and its profiles are skipped. Its compiled kernels are cached on disk, so steps 2-5 reuse step 1's.
# Each step is its own process with its own timeout, none starts after $FA4_DEADLINE_S seconds (default 470) or
# without the time it needs, so what finished comes back. Results in $OUT (at most 8 files):
#   attention_anchors.jsonl (steps 1-2; append to writeup/results/attention_anchors.jsonl),
#   attention_kernels.jsonl (step 4), ncu_bwd_details.csv, ncu_bwd_raw.csv (every metric of both launches),
#   ncu_bwd_source.tgz (per-instruction SASS counters and stall samples of both), ncu_fwd.tgz (the same three for the
#   forward), ncu_reports.tgz (the two backward .ncu-rep files, if under 16 MiB), log.txt.
# `deterministic` instead (issue 55: what the deterministic backward's extra time is spent on): step 2, then Nsight
# Compute as in step 3 on one launch of our backward by default and deterministic and of FA4's deterministic one at
# (1, 32, 16384, 128): ncu_det_details.csv, ncu_det_raw.csv, ncu_det_source.tgz.
# `varlen` instead (issue 53: what separates our packed forward and windowed backward from FA4's): `cs336 attention
# --part varlen --part window` for ours and FA4 (attention_varlen.jsonl), Nsight Compute as in step 3 on one launch of
# each forward on the varlen part's packed batch, then of each backward under its 4,096-key window at (1, 32, 32768,
# 128) (ncu_varlen_details.csv, ncu_varlen_raw.csv, ncu_varlen_source.tgz), and every kernel of one packed forward +
# backward of both timed (attention_kernels.jsonl).
#   run (GPU machine, repo root): bash tools/gpu_attention_fa4.sh [deterministic | varlen]
set -uo pipefail
mode="${1:-all}"
[[ "$mode" == all || "$mode" == deterministic || "$mode" == varlen ]] \
  || { echo "usage: bash tools/gpu_attention_fa4.sh [deterministic | varlen]" >&2; exit 2; }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
mkdir -p "$OUT"
work="$(mktemp -d)"
deadline=$(($(date +%s) + ${FA4_DEADLINE_S:-470}))
source tools/gpu_steps.sh
export CS336_CALL_ID="${CS336_CALL_ID:-$(date -u +%Y%m%dT%H%M%SZ)-fa4-$$}"  # one id for every row of this call
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
use_fa4 "$work/fa4_cache"
py=(bash tools/gpu.sh python3)
shapes=(1,32,32768,128 4,32,4096,128 1,16,16384,64 1,32,16384,128)


ncu_launch() {  # ncu_launch NAME REGEX IMPL ARGS...: the second launch of kernel REGEX (-s 1 skips the warm-up's)
  local name="$1" regex="$2" impl="$3"
  shift 3
  step "ncu $name" 60 150 bash tools/gpu.sh ncu --clock-control none --set full -k "regex:$regex" -s 1 -c 1 -f \
    -o "$work/$name" python3 tools/attention_peers_profile.py --impls "$impl" "$@"
}

export_ncu() {  # export_ncu NAME...: details, raw metrics and per-instruction SASS pages of each report that exists
  local name
  for name in "$@"; do
    [ -f "$work/$name.ncu-rep" ] || continue
    ncu -i "$work/$name.ncu-rep" --page details --csv --print-details all > "$work/$name.details.csv" 2>/dev/null \
      || ncu -i "$work/$name.ncu-rep" --page details --csv > "$work/$name.details.csv"
    ncu -i "$work/$name.ncu-rep" --page raw --csv --print-metric-instances values > "$work/$name.raw.csv" 2>/dev/null \
      || ncu -i "$work/$name.ncu-rep" --page raw --csv > "$work/$name.raw.csv"
    ncu -i "$work/$name.ncu-rep" --page source --csv --print-source sass > "$work/$name.source.csv" \
      || echo "== source page of $name FAILED"
  done
}

join_csv() {  # join_csv DEST PART...: the parts that exist, one after another (each keeps its header line)
  local dest="$1"; shift
  local part
  for part in "$@"; do [ -s "$part" ] && cat "$part"; done > "$dest"
  [ -s "$dest" ] || rm -f "$dest"
}

deterministic_anchors() {  # step 2
  step "2. anchors: default and deterministic at 32k" 90 150 "${py[@]}" -m cs336_harness.cli attention --part anchors \
    --anchor-impls ours,ours_deterministic,fa4,fa4_deterministic --anchor-shapes 1,32,32768,128 --quiet \
    --out "$OUT/attention_anchors.jsonl"
}

pack() {  # pack DEST FILE...: a gzipped tar of the files that exist, named without their folder
  local dest="$1"; shift
  local present=() f
  for f in "$@"; do [ -s "$f" ] && present+=("$(basename "$f")"); done
  [ ${#present[@]} -gt 0 ] && tar czf "$dest" -C "$work" "${present[@]}"
}

{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
  echo "call id $CS336_CALL_ID commit $(cat .commit 2>/dev/null || echo unknown)"
  "${py[@]}" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  fa4_versions
  ncu --version | tail -1

  if [ "$mode" = varlen ]; then
    step "varlen and window: ours, FA4" 90 180 "${py[@]}" -m cs336_harness.cli attention --part varlen --part window \
      --varlen-impls ours,fa4 --window-impls ours,fa4 --quiet --out "$OUT/attention_varlen.jsonl"
    ncu_launch vfwd_ours '^_attn_fwd_kernel' ours --case varlen
    ncu_launch vfwd_fa4 'FlashAttentionForwardSm90' fa4 --case varlen
    step "kernel times of one packed forward + backward" 45 90 "${py[@]}" tools/attention_peers_profile.py \
      --case varlen --impls ours,fa4 --out "$OUT/attention_kernels.jsonl"
    ncu_launch wbwd_ours '^_attn_bwd_kernel' ours --case window --shape 1,32,32768,128
    ncu_launch wbwd_fa4 'FlashAttentionBackwardSm90' fa4 --case window --shape 1,32,32768,128
    export_ncu vfwd_ours vfwd_fa4 wbwd_ours wbwd_fa4
    join_csv "$OUT/ncu_varlen_details.csv" "$work"/{vfwd_ours,vfwd_fa4,wbwd_ours,wbwd_fa4}.details.csv
    join_csv "$OUT/ncu_varlen_raw.csv" "$work"/{vfwd_ours,vfwd_fa4,wbwd_ours,wbwd_fa4}.raw.csv
    pack "$OUT/ncu_varlen_source.tgz" "$work"/{vfwd_ours,vfwd_fa4,wbwd_ours,wbwd_fa4}.source.csv
  elif [ "$mode" = deterministic ]; then
    deterministic_anchors
    ncu_launch det_ours_default '^_attn_bwd_kernel' ours --shape 1,32,16384,128
    ncu_launch det_ours '^_attn_bwd_kernel' ours_deterministic --shape 1,32,16384,128
    ncu_launch det_fa4 'FlashAttentionBackwardSm90' fa4_deterministic --shape 1,32,16384,128
    export_ncu det_ours_default det_ours det_fa4
    join_csv "$OUT/ncu_det_details.csv" "$work"/det_{ours_default,ours,fa4}.details.csv
    join_csv "$OUT/ncu_det_raw.csv" "$work"/det_{ours_default,ours,fa4}.raw.csv
    pack "$OUT/ncu_det_source.tgz" "$work"/det_{ours_default,ours,fa4}.source.csv
  else
    step "1. anchors: ours, cuDNN, FA4 at four shapes" 120 330 "${py[@]}" -m cs336_harness.cli attention --part anchors \
      --anchor-impls ours,sdpa,fa4 --anchor-shapes "${shapes[@]}" --quiet --out "$OUT/attention_anchors.jsonl"
    deterministic_anchors

    ncu_launch bwd_ours '^_attn_bwd_kernel' ours --shape 1,32,16384,128
    ncu_launch bwd_fa4 'FlashAttentionBackwardSm90' fa4 --shape 1,32,16384,128
    export_ncu bwd_ours bwd_fa4
    join_csv "$OUT/ncu_bwd_details.csv" "$work/bwd_ours.details.csv" "$work/bwd_fa4.details.csv"
    join_csv "$OUT/ncu_bwd_raw.csv" "$work/bwd_ours.raw.csv" "$work/bwd_fa4.raw.csv"
    pack "$OUT/ncu_bwd_source.tgz" "$work/bwd_ours.source.csv" "$work/bwd_fa4.source.csv"

    step "4. kernel times of one forward + backward" 45 90 "${py[@]}" tools/attention_peers_profile.py \
      --impls ours,fa4,sdpa --shape 1,32,16384,128 --out "$OUT/attention_kernels.jsonl"

    ncu_launch fwd_ours '^_attn_fwd_kernel' ours --shape 1,16,16384,64
    ncu_launch fwd_fa4 'FlashAttentionForwardSm90' fa4 --shape 1,16,16384,64
    export_ncu fwd_ours fwd_fa4
    pack "$OUT/ncu_fwd.tgz" "$work"/fwd_ours.{details,raw,source}.csv "$work"/fwd_fa4.{details,raw,source}.csv

    pack "$OUT/ncu_reports.tgz" "$work"/bwd_{ours,fa4}.ncu-rep
  fi
  for f in "$OUT"/*; do  # what comes back is at most 16 MiB a file
    if [ "$(stat -c %s "$f")" -gt $((16 * 1024 * 1024)) ]; then
      echo "== $(basename "$f") is over 16 MiB: removed"; rm -f "$f"
    fi
  done
  if [ -s "$OUT/attention_varlen.jsonl" ]; then
    echo "== varlen and window"
    "${py[@]}" -m cs336_harness.cli attention --markdown "$OUT/attention_varlen.jsonl" 2>&1 | tail -20
  fi
  if [ -s "$OUT/attention_anchors.jsonl" ]; then
    echo "== anchors"
    "${py[@]}" -m cs336_harness.cli attention --markdown "$OUT/attention_anchors.jsonl" 2>&1 | tail -30
  fi
  echo "== done ($(left) s left)"
  ls -la "$OUT"
} 2>&1 | tee "$OUT/log.txt"
rm -rf "$work"
