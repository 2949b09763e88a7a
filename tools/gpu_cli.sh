#!/usr/bin/env bash
# The `cs336` CLI on a GPU machine in one call (a few minutes; one GPU is enough, the ddp run needs two): the
# CLI's GPU tests, then short runs of the commands whose progress bars and quiet stderr only a GPU exercises
# (bench, fused, attention, and ddp on nccl). Each run's stdout and stderr go to their own files; a run with
# --quiet must leave its stderr empty, a run without it must show its bar there. No run starts after
# $CLI_DEADLINE_S seconds (default 400).
# Results in $OUT: log.txt (ends with one "ok" or "FAIL" line per check, then the stderr of each failed check) and
# runs.tar (every run's <run>.out and <run>.err; one file, since a call brings back at most 8).
#   run (GPU machine, repo root): bash tools/gpu_cli.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
mkdir -p "$OUT"
deadline=$(($(date +%s) + ${CLI_DEADLINE_S:-400}))
left() { echo $((deadline - $(date +%s))); }
cs336=(bash tools/gpu.sh python3 -m cs336_harness.cli)
checks=()
# run NAME EXPECT ARGS...: EXPECT is "quiet" (stderr must be empty) or the text its progress bar must show.
run() {
  local name="$1" expect="$2"
  shift 2
  if [ "$(left)" -lt 30 ]; then checks+=("FAIL $name: skipped at the deadline"); return; fi
  timeout "$(left)" "${cs336[@]}" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  if [ "$rc" -ne 0 ]; then checks+=("FAIL $name: exit $rc"); return; fi
  if [ "$expect" = quiet ]; then
    if [ -s "$OUT/$name.err" ]; then checks+=("FAIL $name: stderr not empty"); else checks+=("ok $name"); fi
  elif grep -q "$expect" "$OUT/$name.err"; then checks+=("ok $name"); else checks+=("FAIL $name: no '$expect' bar"); fi
}
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  timeout 120 bash tools/gpu.sh python3 -m pytest -m gpu packages/harness/tests/test_cli.py \
    packages/harness/tests/test_bench.py -q -p no:cacheprovider
  run bench_quiet quiet bench --size small --warmup 1 --steps 3 --quiet
  run bench_bar "bench:" bench --size small --attention sdpa,triton --warmup 1 --steps 3
  run fused_bar "fused:" fused --bench rms-norm --bench swiglu --warmup-ms 20 --rep-ms 50
  run attention_bar "attention:" attention --part flash --flash-dtypes bf16 --flash-head-dims 64 \
    --flash-seq-lens 1024 --warmup-ms 5 --rep-ms 20
  run residuals_quiet quiet residuals --experiment block --quiet
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    run ddp_quiet quiet ddp --size small --context-length 128 --variants nocomm,bucketed --warmup 1 --steps 2 --quiet
    run ddp_bar "ddp:" ddp --size small --context-length 128 --variants nocomm,bucketed --warmup 1 --steps 2
  fi
  printf '%s\n' "${checks[@]}"
  for check in "${checks[@]}"; do
    case "$check" in FAIL*) name="${check#FAIL }"; name="${name%%:*}"
      [ -s "$OUT/$name.err" ] && { echo "== $name stderr:"; head -c 2000 "$OUT/$name.err"; echo; } ;;
    esac
  done
} 2>&1 | tee "$OUT/runs.log"
(cd "$OUT" && tar -cf runs.tar ./*.out ./*.err 2>/dev/null && rm -f ./*.out ./*.err)
mv "$OUT/runs.log" "$OUT/log.txt"
