"""The harness README's Python example (composing a leaderboard step without the command line) runs as written."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _example(heading: str) -> str:
    """The first ```python block after ``heading`` in the README."""
    text = README.read_text()
    start = text.index("```python\n", text.index(heading)) + len("```python\n")
    return text[start : text.index("```", start)]


def test_python_example_composes_and_trains_a_step() -> None:
    code = _example("### From Python")
    namespace: dict = {}
    exec(compile(code, f"{README}:From Python", "exec"), namespace)
    assert namespace["loss"] < namespace["first"]
    assert type(namespace["training"]).__name__ == "Training"
