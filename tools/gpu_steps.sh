# Sourced by the GPU-call scripts that run timed steps (tools/gpu_attention_fa4.sh, tools/gpu_kernel_limits.sh,
# tools/gpu_attention_ab.sh):
# each step under its own timeout, none started past the caller's $deadline (epoch seconds), so that what finished
# before a hang or the call's end comes back.
left() { echo $((deadline - $(date +%s))); }

step() {  # step NAME MIN_S MAX_S CMD...: CMD with a timeout of at most MAX_S, skipped if it would get under MIN_S
  local name="$1" min="$2" max="$3"; shift 3
  local limit=$(($(left) - 5))
  [ "$limit" -gt "$max" ] && limit=$max
  if [ "$limit" -lt "$min" ]; then echo "[skip: deadline] $name ($(left) s left)"; return 1; fi
  echo "== $name (limit ${limit} s, $(left) s left)"
  timeout "$limit" "$@" || { echo "== $name FAILED or timed out (rc $?)"; return 1; }
}
