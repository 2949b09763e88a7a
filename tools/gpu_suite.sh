#!/usr/bin/env bash
# The quick GPU run (every package's tests and tests/ marked gpu and not slow: every kernel and path once) under
# pytest-xdist, several runs in a row: the workers share the GPU through packages/kernels/tests/gpu_share.py (tests
# marked gpu_exclusive run alone, after the others), so every run must pass. A run took 268 s at -n 8 on a fresh H100
# (Triton and Inductor compiling), 85-130 s on the same machine after (logs/2026-12-08-s32/). Arguments: the workers
# (default 8; `auto` is one per core) and the runs (default 5). No run starts after $SUITE_DEADLINE_S seconds (default 570) less the longest
# run so far, so the runs that do not fit are skipped, and the next call runs them (`bash tools/gpu_suite.sh 8 N`).
# Log: $OUT/gpu_suite_log.txt, its failures and one summary line per run; each run's whole output (every test's
# outcome as it ends, every test phase over a second) in $OUT/gpu_suite_runN.txt; a row per finished run (wall time,
# pytest's summary, provenance) in $OUT/quick_suite.jsonl (tools/time_quick_suite.py; for writeup/results/). The slow GPU tests run in their
# sections' calls (tools/README.md).
#   run (GPU machine, repo root): bash tools/gpu_suite.sh 8 5; bash tools/gpu_suite.sh auto 1
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
mkdir -p "$OUT"
workers="${1:-8}"
runs="${2:-5}"
deadline=$(($(date +%s) + ${SUITE_DEADLINE_S:-570}))
left() { echo $((deadline - $(date +%s))); }
py=(bash tools/gpu.sh python3)
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  "${py[@]}" -c "import xdist" || { echo "pytest-xdist is not installed here"; exit 1; }
  summary=()
  longest=60  # seconds; a run that could not finish before the deadline is not started
  for run in $(seq 1 "$runs"); do
    if [ "$(left)" -lt "$longest" ]; then summary+=("run $run: skipped (deadline)"); continue; fi
    echo "== gpu suite run $run of $runs, -n $workers"
    start=$(date +%s)
    # Every test's outcome as it ends (-v), so that a run the deadline stops still says what ran and failed; at the
    # end of a run that finishes, every test phase that took a second or more (the costs the quick run is cut by).
    timeout "$(left)" "${py[@]}" tools/time_quick_suite.py --out "$OUT/quick_suite.jsonl" \
      --log "$OUT/gpu_suite_run$run.txt" -- -m "gpu and not slow" -n "$workers" -v -rfE --durations=0 \
      --durations-min=1 > /dev/null 2>&1
    rc=$?
    took=$(($(date +%s) - start))
    [ "$took" -gt "$longest" ] && longest=$took
    grep -E "(FAILED|ERROR)( |$)|^=+ .*(passed|failed|error)" "$OUT/gpu_suite_run$run.txt" | tail -20
    summary+=("run $run, -n $workers: rc $rc in $took s, $(grep -c " PASSED " \
      "$OUT/gpu_suite_run$run.txt") passed ($OUT/gpu_suite_run$run.txt)")
  done
  printf '%s\n' "${summary[@]}"
} 2>&1 | tee "$OUT/gpu_suite_log.txt"
