"""The pure core imports no I/O: not trio, not zmq, not an engine, not the agents (SPEC §5).

``trio_pd/__init__.py`` imports the agents, so a plain ``import trio_pd.core._rooms`` runs it and
pulls trio in whatever ``_rooms`` does. The check therefore runs in a fresh interpreter that
installs an empty stand-in for the ``trio_pd`` package (its ``__path__`` the real directory,
its ``__init__`` never run) and imports the core modules through it: whatever lands in
``sys.modules`` then came from those modules alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import trio_pd

CORE = sorted(  # every module of the pure core package
    "core." + p.stem for p in (Path(trio_pd.__file__).parent / "core").glob("_*.py")
    if p.stem != "__init__"
)
assert CORE, "trio_pd/core/ holds no module: is this the checkout's trio_pd?"
#: the bootstrap service's pure parts: the records it and its clients exchange, the rank
#: table and the DP-attention records (the HTTP around them is elsewhere)
BOOTSTRAP_PURE = [
    "bootstrap._bootstrap_records",
    "bootstrap._bootstrap_ranks",
    "bootstrap._bootstrap_dp",
]
FORBIDDEN = [
    "trio",
    "zmq",
    "hypercorn",
    "httpx",
    "prometheus_client",
    "trio_pd.engines",
    "trio_pd.agents._prefill",
    "trio_pd.agents._decode",
    "trio_pd.io._control",
]

PROBE = """
import importlib, json, sys, types
package = types.ModuleType("trio_pd")
package.__path__ = [sys.argv[1]]
sys.modules["trio_pd"] = package
for name in json.loads(sys.argv[2]):
    importlib.import_module("trio_pd." + name)
print(json.dumps(sorted(sys.modules)))
"""


def _loaded(modules: list[str]) -> list[str]:
    package_dir = str(Path(trio_pd.__file__).parent)
    out = subprocess.run(
        [sys.executable, "-I", "-c", PROBE, package_dir, json.dumps(modules)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def _offenders(loaded: list[str]) -> list[str]:
    return [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]


def test_pure_core_imports_no_io() -> None:
    loaded = _loaded(CORE)
    assert {f"trio_pd.{name}" for name in CORE} <= set(loaded)
    assert _offenders(loaded) == []


def test_bootstrap_tables_import_no_io() -> None:
    """The rank table and the DP records decide without HTTP: importing them pulls in
    neither trio, nor hypercorn, nor httpx."""
    loaded = _loaded(BOOTSTRAP_PURE)
    assert {f"trio_pd.{name}" for name in BOOTSTRAP_PURE} <= set(loaded)
    assert _offenders(loaded) == []


def test_the_probe_sees_an_impure_import() -> None:
    """The probe itself works: importing an agent module through it does show trio."""
    assert "trio" in _offenders(_loaded(["agents._prefill"]))


def test_no_class_is_over_300_lines() -> None:
    """Issue 28's structure target: a class that grows past 300 lines is doing two jobs
    (split it by concern, as the room tables, fences and DP routes were)."""
    import ast

    root = Path(trio_pd.__file__).parent
    long = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 300:
                    long.append(f"{path.relative_to(root)}:{node.name} ({lines} lines)")
    assert long == []
