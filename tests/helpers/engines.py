"""The real engines the suite runs on, and what a test needs to drive one directly."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import pytest

from trio_pd import EngineError
from trio_pd.engines import TransferEngine

HAVE_NIXL = importlib.util.find_spec("nixl_cu12") is not None
#: the engines an integration test runs on (the ``engine_name`` fixture's parameters)
ENGINES = [
    "mooncake",
    pytest.param(
        "nixl", marks=pytest.mark.skipif(not HAVE_NIXL, reason="nixl-cu12 not installed")
    ),
]


def write_again(engine: TransferEngine, peer: str, *blocks: Any, within: float = 5.0) -> int:
    """``engine.write(peer, *blocks)`` right after something cut or refused that engine's
    calls to ``peer``: the link must work again. Mooncake, with its one TCP connection per
    peer (the adapter's default, so that a call's completion proves what was queued before it
    gone): a refused block resets that connection, the next call fails at once (-1) and the
    one after reconnects, about 1 s later (measured); a fence that cut the connection leaves
    the same. So at most two such failures are allowed, within ``within`` s. Returns how many
    there were; AssertionError, with them, past that."""
    errors: list[EngineError] = []
    deadline = time.monotonic() + within
    while True:
        try:
            engine.write(peer, *blocks)
            return len(errors)
        except EngineError as exc:
            errors.append(exc)
            assert len(errors) < 3 and time.monotonic() < deadline, errors
            time.sleep(0.2)
