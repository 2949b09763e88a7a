# Call C3 (session 7): the norm rows again with the GPU warm (AdamW first), Liger-Kernel beside them.
set -uo pipefail
export CS336_CALL_ID=$(date -u +%Y%m%dT%H%M%SZ)-s7c3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
timeout 140 bash tools/gpu.sh python3 -m cs336_harness.cli fused --bench adamw --bench rms-norm --bench add-rms-norm \
  --out "$OUT/fused.jsonl" 2>&1 | tail -14 | tee "$OUT/log.txt"
