"""The SGLang conformance suite. Its tests read SGLang 0.5.23's source (installed, or
unpacked where ``TRIO_PD_SGLANG_SOURCE`` says: ``nox -s sglang_calls``), and those that
also run SGLang's code need its PD modules to import (``nox -s sglang`` makes such an
environment: the ``sglang_runtime`` fixture, and test_queues.py). Without SGLang every test
here is skipped, and without its runtime those; with ``TRIO_PD_REQUIRE_SGLANG=1`` (what
the nox sessions set) either is an error instead. A torchvision that cannot load beside
torch's CPU build is answered by a stand-in (tests/sglang/standins.py)."""

from __future__ import annotations

import os
import warnings

import pytest

from .callforms import sglang_root
from .standins import stand_in_torchvision

#: the nox sessions set it: what this suite needs must be there, not skipped
REQUIRE = os.environ.get("TRIO_PD_REQUIRE_SGLANG") == "1"
#: why SGLang's PD modules cannot be imported here (None: they can)
NO_RUNTIME: str | None = None

if sglang_root() is None:
    if REQUIRE:
        raise RuntimeError("TRIO_PD_REQUIRE_SGLANG=1, but SGLang is neither installed nor "
                           "unpacked where TRIO_PD_SGLANG_SOURCE says")
    collect_ignore_glob = ["test_*.py"]
else:
    try:
        stand_in_torchvision()
        # SGLang's and torch's import-time warnings (deprecations, "only CUDA
        # supports...") are theirs: import the modules the suite uses once, silenced
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import sglang.srt.disaggregation.decode
            import sglang.srt.disaggregation.prefill
            import sglang.srt.mem_cache.memory_pool  # noqa: F401
    except ImportError as exc:
        NO_RUNTIME = f"SGLang's PD modules do not import here ({exc})"
        if REQUIRE and not os.environ.get("TRIO_PD_SGLANG_SOURCE"):
            raise
        collect_ignore_glob = ["test_queues.py"]


@pytest.fixture(autouse=True)
def _cluster_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Security is on by default, and SGLang's processes share the cluster token through
    the environment (docs/sglang.md): so do these tests."""
    monkeypatch.setenv("TRIO_PD_TOKEN", "sglang-test-cluster-token")
    monkeypatch.delenv("TRIO_PD_SECURE", raising=False)


@pytest.fixture
def sglang_runtime() -> None:
    """The test runs SGLang's own code: skipped where it does not import (only its source
    is there)."""
    if NO_RUNTIME is not None:
        pytest.skip(NO_RUNTIME)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/sglang/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.sglang)
