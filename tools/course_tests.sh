#!/usr/bin/env bash
# The course's own tests (stanford-cs336/assignment2-systems at 26.1.1, commit 9d95f3b) with our tests/adapters.py in
# place of theirs: 14 tests, of which the 4 Triton ones need a GPU. Their files stay out of this repo, in .course/
# (git-ignored), with einops (their tests import it) beside them.
#   here:        bash tools/course_tests.sh prepare CLONE   # CLONE: a git clone (or mirror) of that repository
#   then:        bash tools/course_tests.sh run             # on this machine, through uv
#   GPU machine: carry [".course"]; bash tools/course_tests.sh run   # the image's python3 through tools/gpu.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$root/.course"
case "${1:-}" in
  prepare)
    clone="${2:?usage: course_tests.sh prepare CLONE (a git clone of stanford-cs336/assignment2-systems)}"
    rm -rf "$dir" && mkdir -p "$dir"
    git -C "$clone" archive 9d95f3b tests | tar -x -C "$dir"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir/wheel" einops
    python3 -m zipfile -e "$dir"/wheel/einops-*.whl "$dir" && rm -rf "$dir/wheel"
    echo "prepared $dir: $(ls "$dir/tests" | wc -l) files in tests/, einops beside them" ;;
  run)
    [ -d "$dir/tests" ] || { echo "no $dir/tests: run 'bash tools/course_tests.sh prepare CLONE' first" >&2; exit 2; }
    cp "$root/tests/adapters.py" "$dir/tests/adapters.py"
    cd "$dir"  # python -m pytest puts this folder, with einops, on sys.path
    if command -v uv > /dev/null; then py=(uv run --project "$root" python); else py=(bash "$root/tools/gpu.sh" python3); fi
    exec "${py[@]}" -m pytest -v -rs -p no:cacheprovider tests ;;
  *) echo "usage: course_tests.sh prepare CLONE | run" >&2; exit 2 ;;
esac
