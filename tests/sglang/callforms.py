"""Every call SGLang's own scheduler code makes on the connector objects, read from the
installed SGLang's source (never copied): the list the conformance tests compare with the
adapter's table (:data:`tests.sglang.calls.CALLS`), so that a new SGLang version's drift
shows as a failing list rather than as an AttributeError in the middle of a request.

A *call form* is one line: the object's role (``manager``, ``sender``, ``receiver``,
``bootstrap_server``), the attribute, and how it is used: ``(2, num_kv_tokens=)`` for a
call with two positional arguments and that keyword, ``[read]`` for an attribute read,
``[getattr]`` / ``[hasattr]`` for a guarded look-up, ``[write]`` for an assignment, and
``<class>(...)`` for the construction of the class itself.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

#: the modules whose calls count (as the issue lists them): the prefill and decode queues,
#: the shared polling helpers, the scheduler and the bootstrap-service start-up
SOURCES = (
    "sglang/srt/disaggregation/prefill.py",
    "sglang/srt/disaggregation/decode.py",
    "sglang/srt/disaggregation/utils.py",
    "sglang/srt/managers/scheduler.py",
    "sglang/srt/managers/disagg_service.py",
)

#: how SGLang names each connector object (the last part of the expression it is read
#: through) -> its role
_ROLES = {
    "kv_manager": "manager", "kv_mgr": "manager",
    "disagg_kv_sender": "sender", "sender": "sender",
    "kv_receiver": "receiver",
    # the polling helpers take senders or receivers alike
    "poller": "sender/receiver",
}
#: the class variables SGLang's scheduler constructs connector objects from
_CLASSES = {
    "kv_manager_class": "manager", "kv_sender_class": "sender",
    "kv_receiver_class": "receiver", "kv_bootstrap_server_class": "bootstrap_server",
}


#: where SGLang's source is read from when it is not installed (``nox -s sglang_calls``
#: unpacks the wheel there): the folder that holds the ``sglang`` package
SOURCE_ENV = "TRIO_PD_SGLANG_SOURCE"


def sglang_root() -> Path | None:
    """The folder holding SGLang's ``sglang`` package: :data:`SOURCE_ENV` if set, else where
    it is installed (found, not imported); None if neither."""
    given = os.environ.get(SOURCE_ENV)
    if given:
        return Path(given)
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def _root(root: Path | None) -> Path:
    found = root or sglang_root()
    assert found is not None, "sglang is not installed"
    return found


def _parse(rel: str, root: Path | None = None) -> ast.Module:
    return ast.parse((_root(root) / rel).read_text(encoding="utf-8"), filename=rel)


def _role(node: ast.expr) -> str | None:
    """The role of the object an expression names, by its last name."""
    if isinstance(node, ast.Attribute):
        return _ROLES.get(node.attr)
    if isinstance(node, ast.Name):
        return _ROLES.get(node.id)
    return None


def _shape(call: ast.Call) -> str:
    kws = sorted(f"{k.arg}=" if k.arg else "**" for k in call.keywords)
    parts = [str(len(call.args)), *kws]
    return "(" + ", ".join(parts) + ")"


def call_forms_in(tree: ast.AST) -> set[str]:
    """The call forms in one module's syntax tree."""
    forms: set[str] = set()
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in _CLASSES:
                forms.add(f"{_CLASSES[func.id]}: <class>{_shape(node)}")
            if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(
                node.args
            ) >= 2 and isinstance(node.args[1], ast.Constant):
                role = _role(node.args[0])
                if role is not None:
                    forms.add(f"{role}: {node.args[1].value} [{func.id}]")
        if not isinstance(node, ast.Attribute):
            continue
        role = _role(node.value)
        if role is None or node.attr in _ROLES:
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Call) and parent.func is node:
            forms.add(f"{role}: {node.attr}{_shape(parent)}")
        elif isinstance(node.ctx, ast.Store):
            forms.add(f"{role}: {node.attr} [write]")
        elif isinstance(parent, ast.Attribute) and node.attr in ("get",):
            forms.add(f"{role}: {node.attr} [read]")
        else:
            forms.add(f"{role}: {node.attr} [read]")
    return forms


def call_forms(root: Path | None = None) -> dict[str, set[str]]:
    """Every call form in :data:`SOURCES`, with the modules it appears in."""
    found: dict[str, set[str]] = {}
    for rel in SOURCES:
        for form in call_forms_in(_parse(rel, root)):
            found.setdefault(form, set()).add(rel.rsplit("/", 1)[-1])
    return found


# ---------------------------------------------------------------------------------- names
# What else the adapter and its plugin rely on by name, read from the source the same way.


def server_arg_fields(root: Path | None = None) -> set[str]:
    """Every server argument (``ServerArgs`` field): the annotated names of the field
    namespaces ``ServerArgs`` is assembled from (``sglang/srt/arg_groups/fields/``)."""
    names: set[str] = set()
    for path in sorted((_root(root) / "sglang/srt/arg_groups/fields").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                names |= {
                    item.target.id for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                }
    return names


def environment_variables(root: Path | None = None) -> set[str]:
    """Every environment variable SGLang declares (the attributes of ``sglang.srt.environ``'s
    ``Envs`` classes)."""
    names: set[str] = set()
    for node in ast.walk(_parse("sglang/srt/environ.py", root)):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.Assign):
                    names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    return names


def module_functions(rel: str, root: Path | None = None) -> set[str]:
    """The functions defined at the top of module ``rel`` (a path under the root)."""
    return {n.name for n in _parse(rel, root).body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def class_constants(rel: str, cls: str, root: Path | None = None) -> dict[str, object]:
    """The constant class attributes of class ``cls`` in module ``rel`` (an enum's
    members and values), by name."""
    for node in ast.walk(_parse(rel, root)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                t.id: item.value.value
                for item in node.body if isinstance(item, ast.Assign)
                and isinstance(item.value, ast.Constant)
                for t in item.targets if isinstance(t, ast.Name)
            }
    raise AssertionError(f"class {cls} not found in {rel}")


def module_constants(rel: str, root: Path | None = None) -> dict[str, object]:
    """The constant assignments at the top of module ``rel``, by name."""
    return {
        t.id: node.value.value
        for node in _parse(rel, root).body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets if isinstance(t, ast.Name)
    }
