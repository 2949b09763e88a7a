#!/usr/bin/env bash
# Run a command on the GPU machine with the image's python3 and our packages on PYTHONPATH.
# Nothing can be installed there, so we never `uv sync`; the packages are imported from source.
# Run tools/install-hooks.sh once per checkout so results rows made there still name the commit.
#   bash tools/gpu.sh python3 -m pytest -m gpu packages/kernels
#   bash tools/gpu.sh python3 -m cs336_harness.cli bench --size xl
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
paths=""
for src in "$root"/packages/*/src; do paths="$paths:$src"; done
export PYTHONPATH="${paths#:}:$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
# One id for every row written during this call on the GPU machine (a script calling gpu.sh many times sets it
# once, before the first call).
export CS336_CALL_ID="${CS336_CALL_ID:-$(date -u +%Y%m%dT%H%M%SZ)-$$}"
exec "$@"
