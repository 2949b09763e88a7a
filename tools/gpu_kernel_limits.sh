#!/usr/bin/env bash
# The glue kernels at the bandwidth limit (issue 44) on one H200, in one call of under 6 minutes. Three modes:
#   explore: RMSNorm's GPU tests once (-n 8: test_rms_norm.py, test_compile.py's RMSNorm cases, and the benchmark's
#            GPU tests of all four glue ops), the RMSNorm launch sweep (tools/glue_sweep.py: candidate launches of
#            the forward and backward, the norm and the folded add, at 32768 x 4096 bf16; the fastest again in turns
#            beside a copy; the dw reduction alone), then `cs336 fused --bench` for rms-norm, add-rms-norm, rope and
#            swiglu (ours, torch.compile, eager, Liger and QuACK where they import, and a copy of the same bytes, five
#            do_bench medians each, in turns; the norms' parts alone beside copies of their bytes).
#   final:   the benchmarks first, then the four glue kernels' GPU tests up to five times in a row in the time left
#            (KL_DEADLINE_S=560, a call of under 10 minutes, leaves room for all five).
#   profile: Nsight Compute on one forward + backward of each glue op (ours and QuACK's) and
#            of our LM-head loss, clocks unlocked (tools/kernel_limits_profile.py): kernel_profile.jsonl (a row per
#            kernel and per case: copy them to writeup/results/kernel_limits.jsonl), kernel_profile_raw.csv.gz.
# Peers: QuACK and Liger from $PEERS (default /tmp/peers, laid out there with CuTe DSL by ../shared/peers/install.sh)
# go on PYTHONPATH when it exists; without them their rows say why. Every step has its own timeout and none starts after the
# deadline ($KL_DEADLINE_S seconds, default 345), so the rows written before a hang come back. Results in $OUT:
# kernel_limits.jsonl (the benchmark rows: copy them to writeup/results/kernel_limits.jsonl), glue_sweep.jsonl
# (explore), tables.md (the benchmark's tables), log.txt.
#   run (GPU machine, repo root): bash tools/gpu_kernel_limits.sh explore
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
mkdir -p "$OUT"
mode="${1:-explore}"
deadline=$(($(date +%s) + ${KL_DEADLINE_S:-345}))
source tools/gpu_steps.sh
export CS336_CALL_ID="${CS336_CALL_ID:-$(date -u +%Y%m%dT%H%M%SZ)-limits-$$}"  # one id for every row of this call
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
PEERS="${PEERS:-/tmp/peers}"
if [ -d "$PEERS" ]; then
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PEERS:$PEERS/nvidia_cutlass_dsl/dsl_packages"
fi
py=(bash tools/gpu.sh python3)
rows="$OUT/kernel_limits.jsonl"
xdist=()
"${py[@]}" -c "import xdist" 2>/dev/null && xdist=(-n 8)

tests() {  # tests RUN all|rms: the glue kernels' tests (whole files on the GPU and test_compile's glue cases; rms:
  # RMSNorm's alone), then the benchmark's GPU tests (the four glue ops against the model's modules, proxy shapes)
  local files=(packages/kernels/tests/test_rms_norm.py) select="rms"
  if [ "$2" = all ]; then
    files+=(packages/kernels/tests/test_rope.py packages/kernels/tests/test_swiglu.py)
    select="rms or rope or silu or swiglu"
  fi
  step "glue kernels' GPU tests ($2), run $1" 40 70 "${py[@]}" -m pytest "${files[@]}" \
    packages/kernels/tests/test_compile.py -k "$select" -q -p no:cacheprovider "${xdist[@]}"
  step "benchmark GPU tests, run $1" 20 35 "${py[@]}" -m pytest -m gpu packages/harness/tests/test_fused_bench.py \
    -q -p no:cacheprovider
}
bench() {  # bench OP MAX_S: one glue op's rows, appended to $rows
  step "cs336 fused --bench $1" 30 "$2" "${py[@]}" -m cs336_harness.cli fused --bench "$1" --warmup-ms 30 \
    --rep-ms 150 --repeats 5 --quiet --out "$rows"
}
benches() {
  bench rms-norm 70
  bench add-rms-norm 70
  bench rope 50
  bench swiglu 50
  if [ -s "$rows" ]; then
    timeout 30 "${py[@]}" -m cs336_harness.cli fused --markdown "$rows" > "$OUT/tables.md" \
      || echo "== tables FAILED (rc $?)"
  fi
}
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  echo "call id $CS336_CALL_ID; peers: $(timeout 60 "${py[@]}" -c 'import quack.rmsnorm, liger_kernel; print("ok")' \
    2>&1 | tail -1)"
  case "$mode" in
    explore)
      tests 1 rms
      # The sweep keeps 185 s for the benchmarks; its own clock starts after its imports, hence the 15 s margin.
      sweep_s=$(($(left) - 185)); [ "$sweep_s" -gt 90 ] && sweep_s=90
      step "glue_sweep" 50 "$sweep_s" "${py[@]}" tools/glue_sweep.py --time-limit-s $((sweep_s - 15)) \
        --out "$OUT/glue_sweep.jsonl"
      benches
      ;;
    final)
      benches
      for run in 1 2 3 4 5; do tests "$run" all; done
      ;;
    profile)
      step "ncu: glue and LM-head kernels" 60 300 bash tools/gpu.sh ncu --clock-control none --profile-from-start off \
        --metrics "$("${py[@]}" tools/kernel_limits_profile.py --print-metrics)" -f -o "$OUT/kernel_profile" \
        python3 tools/kernel_limits_profile.py --order "$OUT/kernel_profile_order.json" \
        && ncu -i "$OUT/kernel_profile.ncu-rep" --page raw --csv > "$OUT/kernel_profile_raw.csv" \
        && "${py[@]}" tools/kernel_limits_profile.py --order "$OUT/kernel_profile_order.json" \
          --join "$OUT/kernel_profile_raw.csv" --out "$OUT/kernel_profile.jsonl"
      rm -f "$OUT/kernel_profile.ncu-rep"
      [ -f "$OUT/kernel_profile_raw.csv" ] && gzip -f "$OUT/kernel_profile_raw.csv"
      ;;
    *) echo "unknown mode $mode (explore, final or profile)"; exit 2 ;;
  esac
  ls -la "$OUT"
} 2>&1 | tee "$OUT/log.txt"
