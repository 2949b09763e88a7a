"""``writeup/results/`` holds data and logs only: no code (experiment code is a patch in ``experiments/``), no
archives, and every row's command is what a user types from the repository root, naming no folder of the machine
that ran it."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "writeup" / "results"
# An absolute path: a slash opening a shell word or the value of --flag=.
ABSOLUTE = re.compile(r"(?:^|[\s=(])(/[^\s)]*)")


def code_or_archives(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and any(s in p.name for s in (".py", ".sh", ".tgz")))


def absolute_commands(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            command = json.loads(line).get("command") if line.strip() else None
            if command is not None and ABSOLUTE.search(command):
                found.append(f"{path.relative_to(folder)}:{number}: {command}")
    return found


def test_results_hold_no_code_and_no_archives() -> None:
    assert code_or_archives(RESULTS) == []


def test_no_row_names_a_folder_of_the_machine_that_ran_it() -> None:
    assert absolute_commands(RESULTS) == []


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    for name in ("probe.py.txt", "call.sh", "s11a.sh.txt", "ncu.tgz", "notes.md", "rows.jsonl", "smi.csv"):
        (tmp_path / "logs").mkdir(exist_ok=True)
        (tmp_path / "logs" / name).write_text("")
    assert code_or_archives(tmp_path) == ["logs/call.sh", "logs/ncu.tgz", "logs/probe.py.txt", "logs/s11a.sh.txt"]
    rows = [{"command": "cs336 bench --out writeup/results/x.jsonl --plot $OUT/a.png"}, {"value": 1},
            {"command": "/work/main/packages/harness/src/cs336_harness/cli.py bench"},
            {"command": "cs336 ddp --trace-dir=/tmp/tr"}, {"command": "uv run python tools/x.py --out /root/out/x"},
            {"command": "bash tools/gpu.sh python3 scratch/p.py (scratch/ from experiments/p.patch on abc1234)"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert [hit.split(":")[1] for hit in absolute_commands(tmp_path)] == ["3", "4", "5"]
