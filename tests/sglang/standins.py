"""What stands in for the parts of SGLang's import tree this machine cannot load, for the
conformance suite (tests/sglang/conftest.py) and the SGLang bench (tools/sglang_bench.py).

SGLang's scheduler modules import its multimodal code, which imports torchvision at import
time. PyPI's torchvision wheels need a CUDA build of torch; beside the CPU build ``nox -s
sglang`` installs, ``import torchvision`` fails. Nothing on the PD paths uses it, so where
it cannot be imported an empty stand-in module answers for it (only for the import)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _Anything:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def __call__(self, *a: Any, **k: Any) -> _Anything:
        return _Anything()

    def __getattr__(self, name: str) -> _Anything:
        return _Anything()


class _NoTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # (transformers asks; too old for it to use)
        module.__getattr__ = lambda attr: _Anything()  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def stand_in_torchvision() -> None:
    """Import torchvision; if it cannot load, answer its imports with an empty module."""
    if any(isinstance(f, _NoTorchvision) for f in sys.meta_path):
        return
    try:
        import torchvision  # noqa: F401
    except Exception:  # (RuntimeError: operator torchvision::nms does not exist)
        for mod in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[mod]
        sys.meta_path.insert(0, _NoTorchvision())
