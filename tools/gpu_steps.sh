# Sourced by the GPU-call scripts that run timed steps (tools/gpu_attention_fa4.sh, tools/gpu_kernel_limits.sh,
# tools/gpu_attention_ab.sh, tools/gpu_attention_varlen.sh):
# each step under its own timeout, none started past the caller's $deadline (epoch seconds), so that what finished
# before a hang or the call's end comes back; and FlashAttention-4 from the peers install for those that time it.
left() { echo $((deadline - $(date +%s))); }

step() {  # step NAME MIN_S MAX_S CMD...: CMD with a timeout of at most MAX_S, skipped if it would get under MIN_S
  local name="$1" min="$2" max="$3"; shift 3
  local limit=$(($(left) - 5))
  [ "$limit" -gt "$max" ] && limit=$max
  if [ "$limit" -lt "$min" ]; then echo "[skip: deadline] $name ($(left) s left)"; return 1; fi
  echo "== $name (limit ${limit} s, $(left) s left)"
  timeout "$limit" "$@" || { echo "== $name FAILED or timed out (rc $?)"; return 1; }
}

use_fa4() {  # use_fa4 CACHE_DIR: FlashAttention-4 from $PEERS (default /tmp/peers, laid out there by
  # ../shared/peers/install.sh) on the path, its compiled kernels cached in CACHE_DIR for the rest of the call
  PEERS="${PEERS:-/tmp/peers}"
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PEERS:$PEERS/nvidia_cutlass_dsl/dsl_packages"
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="$1"
}

fa4_versions() {  # the versions of FA4 and CuTe DSL, or why FA4 does not import
  timeout 120 bash tools/gpu.sh python3 -c "import importlib.metadata as m, flash_attn.cute; \
print('FA4', m.version('flash-attn-4'), 'cutlass-dsl', m.version('nvidia-cutlass-dsl'))" 2>&1 | tail -2
}
