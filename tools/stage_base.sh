#!/usr/bin/env bash
# Stage the code of another revision as `.base/` (git-ignored), so that one GPU call can time the working tree's
# kernels against it (tools/gpu_attention_ab.sh): `.base` holds that revision's packages and tools and a `.commit`
# naming it, so the rows its runs write name the revision they ran. Carry `.base` in the call.
#   run (here, repo root): bash tools/stage_base.sh main
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
rev="${1:?usage: bash tools/stage_base.sh REVISION}"
commit="$(git rev-parse --short=12 --verify "$rev^{commit}")"
rm -rf .base
mkdir .base
git archive "$commit" packages tools | tar -x -C .base
echo "$commit" > .base/.commit
echo "staged $rev ($commit) in .base: $(du -sh .base | cut -f1)"
