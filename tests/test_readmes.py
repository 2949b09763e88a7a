"""Every code block of every README runs in a test, read from the README itself.

Python blocks run as scripts in a fresh interpreter: on a CPU in their CPU form (the kernels README's rule: ``"cpu"``
for ``"cuda"``, ``.cpu()`` for ``.cuda()``, float16 for bfloat16, in Triton's interpreter), on a GPU as written. A
bare expression whose comment is a number (``memory_plan(...) / 2**30   # 89.04``) must print that number.

Each command line of a bash block is of one kind in :data:`COMMANDS` (a line of no kind fails the test, so a new
example must say how it is checked): ``cpu`` runs it on this machine (``uv run X`` as this interpreter's X);
``gpu`` runs it in the GPU tests (each alone on the GPU, in a process of its own; ``long`` ones, more than a few
seconds of work, also marked slow, out of the quick GPU run; ``2gpus`` ones skipped with fewer GPUs); ``suite``
is a pytest run of this repo's tests (its paths and markers are checked; CI and the GPU calls run the suites);
``ci`` is a line that ``.ci/run`` runs; ``gpu-call`` is one of the lent machine's scripts (``tools/gpu*.sh``: it
must exist and parse, and the command it wraps must parse); ``nsys`` is a Nsight command (our GPU machine has no
working nsys: the cs336 command it profiles must parse); ``experiment`` re-runs a patch of ``writeup/experiments/``
(the patch must apply on the commit named, and the script run must be one the patches create).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
READMES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("packages/*/README.md")),
           "tools/README.md", "writeup/README.md", "writeup/experiments/README.md"]
CUDA = torch.cuda.is_available()
MARKERS = {"gpu", "slow", "interpreter", "gpu_exclusive"}

# How each README command line is checked (see the module docstring).
COMMANDS: dict[str, str] = {
    "uv sync --locked --compile-bytecode": "ci",
    "uv run cs336 --help": "cpu",
    "uv run cs336 bench": "cpu",
    'uv run pytest -m "not slow" -n 2': "suite",
    "uv run pytest -n 2": "suite",
    'uv run pytest -m "gpu and not slow" -n 8': "suite",
    "uv run pytest -m gpu -n 8": "suite",
    "uv run cs336 bench --size xl --compute-dtype fp32,bf16 --out rows.jsonl": "gpu long",
    "uv run cs336 ddp --world-size 2 --out ddp.jsonl": "gpu long 2gpus",
    "uv run cs336 attention --quick --part flash": "gpu long",
    "uv run --isolated --package cs336-sharding --all-extras python -m pytest packages/sharding/tests -n 2": "suite",
    "uv run cs336 collectives": "cpu",
    "uv run cs336 collectives --backends nccl --world-sizes 1,2 --sizes-mb 1,10,100,1024 --plot c.png":
        "gpu long 2gpus",
    "uv run cs336 ddp": "cpu",
    "torchrun --nproc-per-node 2 -m cs336_harness.cli ddp --size xl --world-size 2": "gpu long 2gpus",
    "bash tools/gpu_ddp.sh": "gpu-call",
    "bash tools/gpu_ddp_bf16.sh": "gpu-call",
    "for i in 1 2 3 4 5; do uv run pytest packages/comms -q || break; done": "suite",
    "uv run cs336 bench --sweep --warmup 5 --steps 10": "gpu long",
    "uv run cs336 bench --size small --mode forward --attention sdpa": "gpu",
    "uv run cs336 bench --size medium --compile": "gpu long",
    "uv run cs336 bench --size xl --context-length 2048 --checkpoint none,groups --warmup 0 --steps 1": "gpu long",
    "nsys profile -o bench_small --trace=cuda,nvtx,osrt --pytorch=autograd-nvtx uv run cs336 bench --size small "
    "--attention annotated --warmup 5 --steps 10": "nsys",
    "nsys stats --report cuda_gpu_kern_sum --filter-nvtx=forward bench_small.nsys-rep": "nsys",
    "nsys stats --report cuda_gpu_kern_sum --filter-nvtx=attention/softmax bench_small.nsys-rep": "nsys",
    "uv run cs336 residuals": "cpu",
    "uv run cs336 residuals --experiment rmsnorm": "cpu",
    "uv run cs336 residuals --out residuals.jsonl": "gpu long",
    "uv run cs336 precision --device cuda": "gpu",
    "uv run cs336 hf": "cpu",
    "bash tools/gpu.sh python3 -m cs336_harness.cli hf --out writeup/results/hf_step.jsonl": "gpu-call",
    "uv run cs336 leaderboard": "cpu",
    "uv run cs336 leaderboard --out rows.jsonl": "gpu long 2gpus",
    "uv run cs336 leaderboard --attention sdpa": "cpu",
    "bash tools/gpu_leaderboard.sh": "gpu-call",
    "uv run cs336 leaderboard --proxy --impl ours,torch_native,torch_native_compiled --glue triton --checkpoint budget "
    "--profile --out writeup/results/leaderboard_proxy.jsonl": "gpu long",
    "uv run cs336 leaderboard --proxy --impl ours,torch_native,torch_native_compiled --glue triton --checkpoint budget "
    "--memory-cap-gib 92 --memory-plan": "cpu",
    'uv run pytest packages/harness -q -m "not slow"': "suite",
    "uv run pytest packages/harness -q": "suite",
    "uv run pytest packages/sharding -q": "suite",
    "for i in 1 2 3 4 5; do uv run pytest packages/sharding -q || break; done": "suite",
    "bash tools/gpu.sh python3 -m pytest -m gpu packages/sharding": "gpu-call",
    "bash tools/gpu.sh python3 -m cs336_harness.cli bench --size xl": "gpu-call",
    'bash tools/gpu.sh python3 -m pytest -m "gpu and not slow" -n 8': "gpu-call",
    "git switch --detach 7b59342 && git apply writeup/experiments/s11a_attention_pieces.patch": "experiment",
    "bash tools/gpu.sh python3 scratch/attn_probe.py": "experiment",
}


@dataclass(frozen=True)
class Block:
    readme: str
    line: int  # of the opening fence
    lang: str
    text: str

    def __str__(self) -> str:
        return f"{self.readme}:{self.line}"


def _blocks() -> list[Block]:
    blocks = []
    for readme in READMES:
        text = (ROOT / readme).read_text()
        for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            blocks.append(Block(readme, text[: match.start()].count("\n") + 1, match.group(1), match.group(2)))
    return blocks


def _commands(block: Block) -> list[str]:
    """The block's command lines: continuations joined, comments and blank lines dropped, spaces collapsed."""
    lines = block.text.replace("\\\n", " ").splitlines()
    stripped = (re.sub(r"(^|\s)#.*$", "", line) for line in lines)
    return [" ".join(line.split()) for line in stripped if line.strip()]


BLOCKS = _blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]
BASH = [(b, c) for b in BLOCKS if b.lang == "bash" for c in _commands(b)]


def test_every_block_is_python_or_bash_and_every_command_has_a_kind() -> None:
    assert {b.lang for b in BLOCKS} <= {"python", "bash"}, [str(b) for b in BLOCKS if b.lang not in ("python", "bash")]
    unknown = [f"{block}: {command}" for block, command in BASH if command not in COMMANDS]
    assert not unknown, "add these README commands to COMMANDS: " + "; ".join(unknown)
    stale = set(COMMANDS) - {command for _, command in BASH}
    assert not stale, f"COMMANDS lists lines no README has: {sorted(stale)}"


def _cpu_form(code: str) -> str:
    """The kernels README's CPU form of ``code``."""
    for gpu, cpu in (('"cuda"', '"cpu"'), (".cuda()", ".cpu()"), ("torch.bfloat16", "torch.float16"),
                     (".bfloat16()", ".half()")):
        code = code.replace(gpu, cpu)
    return code


_NUMBER_COMMENT = re.compile(r"^(?P<expr>\S.*?)\s+#\s*(?P<number>-?\d+\.\d+|-?\d+)\s*$")


def _with_printed_numbers_checked(code: str) -> str:
    """``code`` with each bare expression commented with a number turned into an assertion that it rounds to it."""
    tree = ast.parse(code)
    bare = {node.lineno for node in tree.body if isinstance(node, ast.Expr) and node.lineno == node.end_lineno}
    lines = code.splitlines()
    for i, line in enumerate(lines):
        match = _NUMBER_COMMENT.match(line)
        if match and i + 1 in bare:
            number = match["number"]
            decimals = len(number.split(".")[1]) if "." in number else 0
            lines[i] = (f"assert f'{{({match['expr']}):.{decimals}f}}' == '{number}', "
                        f"f'{{({match['expr']})}} where the README says {number}'")
    return "\n".join(lines) + "\n"


def _run_script(code: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    script = cwd / "readme_block.py"
    script.write_text(code)
    env = {**os.environ, **({} if CUDA else {"TRITON_INTERPRET": "1"})}
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.gpu_exclusive
@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    code = _with_printed_numbers_checked(block.text if CUDA else _cpu_form(block.text))
    done = _run_script(code, tmp_path)
    assert done.returncode == 0, f"{block}:\n{done.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in PYTHON if b.readme == "packages/kernels/README.md"], ids=str)
def test_kernels_block_on_cpu_without_the_interpreter_says_to_set_it(block: Block, tmp_path: Path) -> None:
    """Eager or compiled (``fullgraph=True``, where Dynamo wraps a raise in its own error), the CPU form without
    ``TRITON_INTERPRET`` fails with the kernels' device check."""
    script = tmp_path / "readme_block.py"
    script.write_text(_cpu_form(block.text))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    assert ("runs Triton kernels on CUDA tensors, or on CPU tensors in Triton's interpreter; got tensors on cpu. "
            "To run on CPU, set TRITON_INTERPRET=1 before importing cs336_kernels.") in done.stderr, done.stderr[-3000:]


def test_printed_numbers_are_checked() -> None:
    """The rewrite that checks a commented number catches a wrong one."""
    checked = _with_printed_numbers_checked("x = 2\nx / 3   # 0.67\nx / 3   # 0.66\ny = x   # 2\n")
    assert checked.splitlines()[3] == "y = x   # 2"  # an assignment prints nothing
    namespace: dict = {}
    exec(compile("\n".join(checked.splitlines()[:2]), "<ok>", "exec"), namespace)
    with pytest.raises(AssertionError, match="where the README says 0.66"):
        exec(compile(checked, "<wrong>", "exec"), {})


def _argv(command: str) -> list[str]:
    """``command`` as this interpreter runs it: ``uv run cs336``/``python3 -m``/``torchrun`` through sys.executable."""
    words = shlex.split(command)
    if words[:2] == ["uv", "run"]:
        words = words[2:]
    if words[0] == "cs336":
        return [sys.executable, "-m", "cs336_harness.cli", *words[1:]]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    if words[0] in ("python", "python3"):
        return [sys.executable, *words[1:]]
    raise ValueError(f"not a command this test runs: {command!r}")


def _run_command(command: str, cwd: Path) -> None:
    env = {**os.environ, **({} if CUDA else {"TRITON_INTERPRET": "1"})}
    done = subprocess.run(_argv(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, f"{command}:\n{done.stderr[-3000:]}"


def _kind(command: str) -> str:
    return COMMANDS.get(command, "").split()[0] if command in COMMANDS else ""


def _params(*kinds: str) -> list:
    """One case per distinct command of these kinds (two READMEs may show the same one), with its marks."""
    chosen, seen = [], set()
    for block, command in BASH:
        if _kind(command) in kinds and command not in seen:
            seen.add(command)
            marks = [pytest.mark.slow] if "long" in COMMANDS[command] or _kind(command) == "cpu" else []
            marks += [pytest.mark.gpu] if _kind(command) == "gpu" else []
            marks += [pytest.mark.gpu_exclusive] if _kind(command) in ("cpu", "gpu") else []  # its own process
            chosen.append(pytest.param(block, command, marks=marks, id=f"{block} {command}"))
    return chosen


@pytest.mark.parametrize(("block", "command"), _params("cpu", "gpu"))
def test_command_runs(block: Block, command: str, tmp_path: Path) -> None:
    if "2gpus" in COMMANDS[command] and torch.cuda.device_count() < 2:
        pytest.skip("runs on two GPUs")
    _run_command(command, tmp_path)


def _pytest_args(command: str) -> list[str]:
    """The pytest arguments of a ``suite`` line (a plain run, an isolated package's, or a loop of them)."""
    words = shlex.split(command.split("; do ", 1)[1].split(" ||", 1)[0] if command.startswith("for ") else command)
    start = words.index("pytest") + 1
    return words[start:]


@pytest.mark.parametrize(("block", "command"), _params("suite"))
def test_suite_line_names_tests_and_markers_that_exist(block: Block, command: str) -> None:
    args = _pytest_args(command)
    paths = [a for a in args if not a.startswith("-") and "/" in a or a.startswith("packages")]
    assert all((ROOT / p).exists() for p in paths), paths
    for i, arg in enumerate(args):
        if arg == "-m":
            names = set(re.findall(r"[a-z_]+", args[i + 1])) - {"not", "and", "or"}
            assert names <= MARKERS, names
    if "--isolated" in command:  # CI's per-package run, in the same form
        package = re.search(r"--package cs336-(\w+)", command)[1]
        ci = (ROOT / ".ci/run").read_text()
        assert "uv run --locked --isolated --package \"cs336-$package\" --all-extras" in ci
        assert f'python -m pytest "packages/$package/tests" {" ".join(args[1:])}' in ci
        assert package in ci.split("for package in", 1)[1].split(";", 1)[0]


@pytest.mark.parametrize(("block", "command"), _params("ci"))
def test_ci_line_is_what_ci_runs(block: Block, command: str) -> None:
    ci = (ROOT / ".ci/run").read_text().splitlines()
    assert command in [" ".join(re.sub(r"(^|\s)#.*$", "", line).split()) for line in ci]


@pytest.mark.parametrize(("block", "command"), _params("gpu-call"))
def test_gpu_call_script_exists_and_parses(block: Block, command: str) -> None:
    words = shlex.split(command)
    assert words[0] == "bash" and words[1].startswith("tools/gpu")
    assert subprocess.run(["bash", "-n", str(ROOT / words[1])], capture_output=True).returncode == 0
    if len(words) > 2:  # tools/gpu.sh COMMAND: the wrapped command is a cs336 or pytest command line too
        inner = " ".join(words[2:])
        if "cs336_harness.cli" in inner:
            from cs336_harness import cli

            cli.parse_args(words[words.index("cs336_harness.cli") + 1 :])
        else:
            assert words[2:5] == ["python3", "-m", "pytest"], inner


@pytest.mark.parametrize(("block", "command"), _params("nsys"))
def test_nsys_line_profiles_a_command_that_parses(block: Block, command: str) -> None:
    from cs336_harness import cli

    words = shlex.split(command)
    if words[1] == "profile":
        cli.parse_args(words[words.index("cs336") + 1 :])
    else:
        assert words[1] == "stats" and words[-1] == "bench_small.nsys-rep"


@pytest.mark.parametrize(("block", "command"), _params("experiment"))
def test_experiment_line_applies_its_patch_or_runs_a_script_a_patch_makes(block: Block, command: str,
                                                                           tmp_path: Path) -> None:
    words = shlex.split(command)
    if words[0] == "git":
        commit, patch = words[3], words[-1]
        index = {**os.environ, "GIT_INDEX_FILE": str(tmp_path / "index")}
        subprocess.run(["git", "read-tree", commit], cwd=ROOT, env=index, check=True, capture_output=True)
        applied = subprocess.run(["git", "apply", "--cached", "--check", patch], cwd=ROOT, env=index,
                                 capture_output=True, text=True)
        assert applied.returncode == 0, f"{patch} does not apply on {commit}: {applied.stderr}"
    else:
        script = words[-1]
        assert words[:3] == ["bash", "tools/gpu.sh", "python3"] and script.startswith("scratch/")
        patches = (ROOT / "writeup" / "experiments").glob("*.patch")
        assert any(f"+++ b/{script}\n" in p.read_text() for p in patches), script
