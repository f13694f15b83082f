"""The docs' examples run as pasted and print what the pages show; the API reference shows
every configuration and statistics field and renders its cross-references.

A *program* is a ```python block of ``docs/*.md`` or ``README.md`` whose fence names a file
(```python title="abort.py"```). Each runs as that file would, ``python abort.py`` in a fresh
interpreter (in a folder of its own), under a :data:`BOUND`, and must exit 0. When an output
block (a fence without a language) follows it, with nothing but blank lines between, the
program's stdout must be that text, but for the port numbers of ``tcp://`` and ``http://``
addresses. A block that looks like a whole program (it defines ``async def main`` or runs an
event loop) must be one: pasted, it would otherwise do nothing. Other python blocks are
excerpts (paraphrases of the code) and are not run.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
#: seconds one program may take (each is meant to finish in a few)
BOUND = 60.0
#: the sections of each tutorial page (heading prefixes) that must hold a program
TUTORIAL_SECTIONS = {"docs/lifetimes.md": ["## 1.", "## 2.", "## 3.", "## 4.", "## 5."]}

#: a python fence: its info string, its code, and the output fence right after it, if any
_FENCE = re.compile(
    r"^```python(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*\n"
    r"(?:\s*^```(?:text)?[ \t]*\n(?P<output>.*?)^```)?",
    re.DOTALL | re.MULTILINE,
)
_TITLE = re.compile(r'\btitle="(?P<name>[\w.-]+\.py)"')
#: what makes a block look like a whole program
_WHOLE = re.compile(r"^async def main\b|^(?:trio|asyncio)\.run\(", re.MULTILINE)
_PORT = re.compile(r"((?:tcp|https?)://[\w.\[\]:-]+?):\d+")


def _blocks(path: Path) -> list[dict[str, Any]]:
    """Each python block of ``path``: its section heading, file name (None for an excerpt),
    code and expected output (None if none is shown)."""
    text = path.read_text(encoding="utf-8")
    headings = [(m.start(), m.group(0)) for m in re.finditer(r"^## .*$", text, re.MULTILINE)]
    out = []
    for m in _FENCE.finditer(text):
        title = _TITLE.search(m.group("info"))
        out.append({
            "section": next((h for at, h in reversed(headings) if at < m.start()), ""),
            "name": title.group("name") if title else None,
            "code": m.group("code"),
            "output": m.group("output"),
        })
    return out


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


PROGRAMS = [
    pytest.param(path, block, id=f"{_rel(path)}:{block['name']}")
    for path in FILES
    for block in _blocks(path)
    if block["name"] is not None
]


def _ports(text: str) -> str:
    return _PORT.sub(r"\1:PORT", text)


@pytest.mark.parametrize(("path", "block"), PROGRAMS)
def test_program_runs_as_pasted(path: Path, block: dict[str, Any], tmp_path: Path) -> None:
    script = tmp_path / block["name"]
    script.write_text(block["code"], encoding="utf-8")
    run = subprocess.run([sys.executable, script.name], cwd=tmp_path, capture_output=True,
                         text=True, timeout=BOUND)
    assert run.returncode == 0, f"{_rel(path)}: {block['name']} failed:\n{run.stderr[-4000:]}"
    if block["output"] is not None:
        assert _ports(run.stdout) == _ports(block["output"]), (
            f"{_rel(path)}: {block['name']} printed something else than the page shows:\n"
            f"{run.stdout}"
        )


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_whole_programs_are_marked_to_run(path: Path) -> None:
    """A block that defines ``async def main`` or starts an event loop names its file, so
    it is run; one that defines ``main`` also runs it (else, pasted, it does nothing)."""
    for block in _blocks(path):
        if _WHOLE.search(block["code"]):
            assert block["name"] is not None, (
                f"{_rel(path)}: a whole program without a file name (```python "
                f'title="....py"):\n{block["code"][:300]}'
            )
        if re.search(r"^async def main\b", block["code"], re.MULTILINE):
            assert re.search(r"^(?:trio|asyncio)\.run\(main", block["code"], re.MULTILINE), (
                f"{_rel(path)}: {block['name']} defines main but never runs it"
            )


@pytest.mark.parametrize("page", sorted(TUTORIAL_SECTIONS))
def test_every_tutorial_section_has_a_program(page: str) -> None:
    sections = [b["section"] for b in _blocks(ROOT / page) if b["name"] is not None]
    for prefix in TUTORIAL_SECTIONS[page]:
        count = sum(s.startswith(prefix) for s in sections)
        assert count > 0, f"{page}: section {prefix!r} has no program"


# ------------------------------------------------------------------ the API reference


def _reference() -> Any:
    """trio_pd as the API reference loads it: griffe, with the extensions mkdocs.yml names."""
    griffe = pytest.importorskip("griffe")
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    [handler] = [p["mkdocstrings"] for p in config["plugins"] if isinstance(p, dict)
                 and "mkdocstrings" in p]
    names = handler["handlers"]["python"]["options"].get("extensions", [])
    for name in names:
        if not name.startswith("tools/"):
            pytest.importorskip(name)
    extensions = griffe.load_extensions(
        *(str(ROOT / name) if name.startswith("tools/") else name for name in names)
    )
    return griffe.load("trio_pd", search_paths=[str(ROOT)], extensions=extensions,
                       resolve_aliases=True, resolve_external=False)


@pytest.mark.parametrize("name", ["PrefillConfig", "DecodeConfig", "AgentStatistics"])
def test_the_reference_shows_every_field_with_its_default_and_doc(name: str) -> None:
    """Each field of the configurations and of the statistics has a doc (a ``#:`` comment)
    and a default where the reference reads them (before: none of them appeared)."""
    import trio_pd

    loaded = _reference()[name]
    for field in dataclasses.fields(getattr(trio_pd, name)):
        member = loaded.members.get(field.name)
        assert member is not None, f"{name}.{field.name} is not in the reference"
        assert member.docstring is not None and member.docstring.value.strip(), (
            f"{name}.{field.name} has no doc (a #: comment above it)"
        )
        assert member.value is not None, f"{name}.{field.name} shows no default"


def test_the_reference_renders_no_sphinx_role() -> None:
    """No docstring the reference renders keeps a ``:class:``-style role as text (before:
    332 of them showed literally); each became a link (tools/docs_roles.py)."""
    role = re.compile(r":(?:py:)?(?:class|meth|func|attr|data|mod|exc|obj|const):`")
    left: list[str] = []

    def visit(obj: Any) -> None:
        if obj.docstring is not None and role.search(obj.docstring.value):
            left.append(obj.path)
        for member in obj.members.values():
            if not member.is_alias:
                visit(member)

    visit(_reference())
    assert not left, f"docstrings with raw Sphinx roles: {left[:20]}"
