"""A griffe extension for the API reference (mkdocs.yml): Sphinx roles become links.

trio_pd's docstrings cross-reference with Sphinx roles (``:class:`~trio_pd.PoolSpec```,
``:meth:`close```, ``:meth:`send <trio_pd.PrefillSender.send>```), which read well in
``help()`` and editors. mkdocstrings renders Markdown, where a role is literal text; this
rewrites each role, once the package is loaded, into an mkdocs-autorefs link. The name is
resolved the way Python would resolve it where the docstring is (the object, then its
parents and their imports), and the link goes to the public name the reference shows it
under (``trio_pd.core._memory.PoolSpec`` is shown as ``trio_pd.PoolSpec``). ``~`` keeps only
the last part of the name as the link's text, as in Sphinx.

A public object with a docstring is one the reference must show: its link is required,
so the strict build fails if no page renders it. Anything else (``ValueError``,
``trio.Cancelled``, a private helper) becomes an *optional* link: the name in code type,
linked only if some page shows it.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import griffe

#: ``:role:`target```, ``:role:`~target``` or ``:role:`text <target>```
_ROLE = re.compile(
    r":(?:py:)?(?:class|meth|func|attr|data|mod|exc|obj|const):`(~?)(?:([^`<]*?)\s*<)?([^`<>]+)>?`"
)


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring in the loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        public = _public_paths(pkg)
        for obj in _defined(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _ROLE.sub(
                    partial(_link, pkg, public, obj), obj.docstring.value
                )


def _defined(obj: griffe.Object) -> list[griffe.Object]:
    """``obj`` and every object defined in it, depth first (aliases left out: their
    targets are visited where they are defined)."""
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            found.extend(_defined(member))  # type: ignore[arg-type]
    return found


def _public_paths(pkg: griffe.Module) -> dict[str, str]:
    """Canonical path -> the public path it is shown under, for every public module and
    every object a public module defines or re-exports (its ``__all__`` where it has one,
    else every name without a leading underscore; the shortest such path wins)."""
    modules = [m for m in _defined(pkg) if m.is_module and not _private(m.path)]
    public = {m.path: m.path for m in modules}
    for module in sorted(modules, key=lambda m: m.path.count(".")):
        for name, member in module.members.items():
            # (an alias's target may be outside trio_pd, where it cannot be resolved)
            canonical = member.target_path if member.is_alias else member.path  # type: ignore[union-attr]
            if not canonical.startswith("trio_pd.") or member.is_module:
                continue
            if name.startswith("_") or (module.exports is not None and name not in module.exports):
                continue
            public.setdefault(canonical, f"{module.path}.{name}")
    return public


def _link(
    pkg: griffe.Module, public: dict[str, str], obj: griffe.Object, role: re.Match[str]
) -> str:
    short, text, target = role.group(1), role.group(2), role.group(3).strip()
    text = f"`{text or (target.rsplit('.', 1)[-1] if short else target)}`"
    path = _shown_as(pkg, public, _canonical(obj, target))
    if path is None:
        return f'<autoref identifier="{target}" optional>{text}</autoref>'
    return f"[{text}][{path}]"


def _canonical(obj: griffe.Object, target: str) -> str | None:
    """The full path of what ``target`` names in ``obj``'s scope, or None."""
    head, _, rest = target.partition(".")
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            base = scope.resolve(head)
        except griffe.NameResolutionError:
            scope = scope.parent
            continue
        return f"{base}.{rest}" if rest else base
    return target if target.startswith("trio_pd.") else None


def _shown_as(pkg: griffe.Module, public: dict[str, str], path: str | None) -> str | None:
    """The public path the reference shows ``path`` under, if it must show it (a public
    object, or a documented public member of one); None otherwise."""
    if path is None or not path.startswith("trio_pd"):
        return None
    try:
        target: Any = pkg[path.removeprefix("trio_pd").lstrip(".")] if path != "trio_pd" else pkg
        while target.is_alias:
            target = target.final_target
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    canonical = target.path
    prefix, suffix = canonical, ""
    while prefix and prefix not in public:
        prefix, _, last = prefix.rpartition(".")
        suffix = f".{last}{suffix}"
    if not prefix or _private(suffix) or target.docstring is None:
        return None
    return public[prefix] + suffix


def _private(path: str) -> bool:
    return any(part.startswith("_") for part in path.split("."))
