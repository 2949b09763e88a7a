#!/usr/bin/env bash
# Everything the writeup's sections 2 and 3 need from a GPU, in one call on a two-GPU machine.
# GPU 0: size sweep (fp32, bf16, 10B forward), warm-up study (fresh processes), eager vs compiled.
# GPU 1: mixed-precision checks, profiles (2 sizes x 3 contexts), xl memory timelines, the
#        checkpointing sweep (xl, batch 4, ctx 2048), residual counts.
# No job starts after $HARNESS_DEADLINE_S seconds (default 170) and running ones get SIGINT 30 s
# later, so the call ends inside its limit with what it has. HARNESS_ONLY=REGEX runs only the job
# lines that match (for a second call that fills gaps). Results: $OUT/gpu{0,1}.tar.gz (rows, PNGs,
# small traces and snapshots) and $OUT/log{0,1}.txt.
#   run: bash tools/gpu_harness.sh                          (on the GPU machine, from the repo root)
#        HARNESS_ONLY='residuals|compile' bash tools/gpu_harness.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
work="$(mktemp -d)"
start=$(date +%s)
export HARNESS_DEADLINE=$((start + ${HARNESS_DEADLINE_S:-170}))
hard_deadline=$((HARNESS_DEADLINE + 30))
mkdir -p "$OUT" "$work/gpu0" "$work/gpu1"

# Runs `cs336 ...` job lines from stdin in one process (imports and CUDA start-up paid once);
# a failing job is logged and skipped; no job starts after HARNESS_DEADLINE.
cat >"$work/driver.py" <<'PY'
import os, re, shlex, sys, time, traceback
from cs336_harness import cli
only = re.compile(os.environ.get("HARNESS_ONLY", ""))
lines = [l.strip() for l in sys.stdin if l.strip() and only.search(l)]
for line in lines:
    if time.time() > int(os.environ["HARNESS_DEADLINE"]):
        print(f"[skip: deadline] {line}", flush=True)
        continue
    argv = shlex.split(line)
    sys.argv = ["cs336", *argv]  # provenance records this command
    t0 = time.time()
    print(f"[job] cs336 {line}", flush=True)
    try:
        cli.main(argv)
    except BaseException:  # one broken job must not stop the others
        traceback.print_exc()
    print(f"[done {time.time() - t0:.1f}s] {line}", flush=True)
PY
run_jobs() {
  local left=$((hard_deadline - $(date +%s)))
  ((left > 0)) || return 0
  timeout -s INT -k 15 "$left" bash tools/gpu.sh python3 "$work/driver.py"
}

gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  local r="$work/gpu0"
  # Warm-up study: each in a fresh process, so the first size also pays CUDA/cuBLAS start-up.
  for w in 0 1 2; do
    echo "bench --size small,large --warmup $w --steps 10 --out $r/bench_warmup.jsonl" | run_jobs
  done
  run_jobs <<EOF
bench --size small,medium,large,xl --warmup 5 --steps 10 --compute-dtype fp32,bf16 --out $r/bench_sizes.jsonl
bench --size 10B --mode forward --warmup 2 --steps 3 --compute-dtype fp32,bf16 --out $r/bench_sizes.jsonl
bench --size 10B --mode forward-backward --warmup 1 --steps 2 --compute-dtype bf16 --out $r/bench_sizes.jsonl
bench --size small,medium --compile --warmup 3 --steps 10 --out $r/bench_compile.jsonl
bench --size small,medium --compile --warmup 3 --steps 10 --compute-dtype bf16 --out $r/bench_compile.jsonl
EOF
}

gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  local r="$work/gpu1"
  run_jobs <<EOF
precision --device cuda --out $r/precision.jsonl
bench --size small,medium --context-length 256,512,1024 --attention annotated --warmup 2 --steps 2 --profile $r/profile --out $r/bench_profile.jsonl
bench --size small --mode forward --attention annotated --warmup 2 --steps 2 --profile $r/profile_fwd --out $r/bench_profile.jsonl
bench --size xl --context-length 128,2048 --mode forward --compute-dtype fp32,bf16 --warmup 1 --steps 1 --memory $r/memory --out $r/bench_memory.jsonl
bench --size xl --context-length 128 --mode train --compute-dtype fp32,bf16 --warmup 1 --steps 1 --memory $r/memory --out $r/bench_memory.jsonl
# Without checkpointing this runs out of memory; no warm-up, so the snapshot holds the step that fails.
bench --size xl --context-length 2048 --mode train --compute-dtype fp32,bf16 --warmup 0 --steps 1 --memory $r/memory_oom --out $r/bench_memory.jsonl
bench --size xl --context-length 2048 --checkpoint group:1 --warmup 0 --steps 1 --memory $r/memory_ckpt --out $r/bench_memory.jsonl
bench --size xl --context-length 2048 --checkpoint none,groups,nested:2,selective --warmup 0 --steps 1 --out $r/bench_checkpoint.jsonl
residuals --device cuda --out $r/residuals.jsonl
residuals --device cuda --experiment block --num-heads 16 --out $r/residuals.jsonl
EOF
}

gpu0 >"$OUT/log0.txt" 2>&1 &
p0=$!
gpu1 >"$OUT/log1.txt" 2>&1 &
p1=$!
wait $p0 $p1

# Keep every row and figure; keep traces and snapshots only while small (8 files, 16 MiB each come back).
for g in gpu0 gpu1; do
  (cd "$work/$g" && find . -type f \( -size -4M -o -name '*.jsonl' -o -name '*.png' \) | tar -czf "$OUT/$g.tar.gz" -T -)
done
ls -la "$OUT"
grep -h -E '^\[(done|skip)|Error|error' "$OUT"/log*.txt | tail -40
echo "total $(($(date +%s) - start)) s"
