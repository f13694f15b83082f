"""Fixtures: the real engines (``engine_name``), the real bootstrap server, a saved
environment. What tests share besides fixtures is in tests/helpers/."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import HealthCheck, settings

from trio_pd import open_bootstrap_server

from .helpers.engines import ENGINES

# Property tests check what comes out, not how fast: a per-example deadline (200 ms by default)
# measures the box, and the suite shares two cores with its own parallel workers.
settings.register_profile(
    "trio_pd", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("trio_pd")


@pytest.fixture(params=ENGINES)
def engine_name(request: pytest.FixtureRequest) -> str:
    """Every integration test that takes this runs once per real engine."""
    return str(request.param)


@pytest.fixture
def insecure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Security off, explicitly (``TRIO_PD_SECURE=0``), for every agent and bootstrap
    service the test opens without ``secure=``: for tests that drive raw, unauthenticated
    ZeroMQ input at an agent's listener (with security on, which is the default, the
    handshake refuses it before any handler sees it: tests/test_auth.py). Request it
    before any fixture that opens a service (``bootstrap_url``)."""
    monkeypatch.setenv("TRIO_PD_SECURE", "0")


@pytest.fixture
def cluster_token(monkeypatch: pytest.MonkeyPatch) -> str:
    """A cluster token in ``TRIO_PD_TOKEN``, for a test whose agents run in several
    processes (each would otherwise prove a token of its own making). Request it before any
    fixture that opens a service (``bootstrap_url``)."""
    token = "test-cluster-token-shared-by-processes"
    monkeypatch.setenv("TRIO_PD_TOKEN", token)
    return token


@pytest.fixture
def keep_environ() -> Iterator[None]:
    """Restore ``os.environ`` after the test (for code that sets process-wide variables)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
async def bootstrap_url() -> AsyncIterator[str]:
    async with open_bootstrap_server() as server:
        yield server.url
