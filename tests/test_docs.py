"""The runnable examples in the docs run, and every tutorial section has one.

A runnable example is a ```python block of ``docs/*.md`` or ``README.md`` that defines
``async def main``. Each runs as its own test: executed in a fresh namespace, then
``trio.run(main)`` under a :data:`BOUND` deadline. Other python blocks (excerpts, paraphrases of
the code) are not run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import trio

ROOT = Path(__file__).resolve().parent.parent
FILES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
#: seconds one example may take (each is meant to finish in a few)
BOUND = 30.0
#: the sections of each tutorial page (heading prefixes) that must hold a runnable example
TUTORIAL_SECTIONS = {"docs/lifetimes.md": ["## 1.", "## 2.", "## 3.", "## 4.", "## 5."]}

_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _examples(path: Path) -> list[tuple[str, str]]:
    """``(section heading, code)`` of each runnable example in ``path``, in order."""
    text = path.read_text(encoding="utf-8")
    headings = [(m.start(), m.group(0)) for m in re.finditer(r"^## .*$", text, re.MULTILINE)]
    out = []
    for m in _FENCE.finditer(text):
        code = m.group(1)
        if "async def main" not in code:
            continue
        section = next((h for at, h in reversed(headings) if at < m.start()), "")
        out.append((section, code))
    return out


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


EXAMPLES = [
    pytest.param(path, i, code, id=f"{_rel(path)}[{i}]")
    for path in FILES
    for i, (_section, code) in enumerate(_examples(path))
]


@pytest.mark.parametrize(("path", "index", "code"), EXAMPLES)
def test_example_runs(path: Path, index: int, code: str) -> None:
    namespace: dict[str, Any] = {"__name__": f"docs_example_{index}"}
    exec(compile(code, f"{_rel(path)}[{index}]", "exec"), namespace)
    main = namespace["main"]
    finished: list[bool] = []

    async def bounded() -> None:
        with trio.fail_after(BOUND):
            await main()
        finished.append(True)

    trio.run(bounded)
    assert finished == [True]


@pytest.mark.parametrize("page", sorted(TUTORIAL_SECTIONS))
def test_every_tutorial_section_has_an_example(page: str) -> None:
    sections = [section for section, _code in _examples(ROOT / page)]
    for prefix in TUTORIAL_SECTIONS[page]:
        count = sum(s.startswith(prefix) for s in sections)
        assert count > 0, f"{page}: section {prefix!r} has no runnable example"


def test_examples_are_collected() -> None:
    """Every tutorial page's examples are among the parametrised tests (none skipped by the
    extraction), and there are some."""
    collected = {(p.values[0], p.values[1]) for p in EXAMPLES}
    for page in TUTORIAL_SECTIONS:
        found = _examples(ROOT / page)
        assert found
        assert {(ROOT / page, i) for i in range(len(found))} <= collected
