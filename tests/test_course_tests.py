"""tools/course_tests.sh (the course's own tests with our adapters): its wrong invocations end with the usage and a
non-zero status before touching anything. The run itself needs the course's files (not in this repo, prepared from a
clone of theirs)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "tools" / "course_tests.sh"


@pytest.mark.parametrize("args", [[], ["check"], ["prepare"]])
def test_a_wrong_invocation_prints_the_usage_and_fails(args: list[str]):
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "usage: course_tests.sh" in done.stderr, done.stderr
