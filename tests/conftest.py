"""Shared fixtures: real engines, the real bootstrap server, host pools, agent pairs."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, settings

from trio_pd import (
    DecodeAgent,
    DecodeConfig,
    PrefillAgent,
    PrefillConfig,
    open_bootstrap_server,
    open_decode,
    open_prefill,
)
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.testing.pools import HostKVPool

# Property tests check what comes out, not how fast: a per-example deadline (200 ms by default)
# measures the box, and the suite shares two cores with its own parallel workers.
settings.register_profile(
    "trio_pd", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("trio_pd")

HAVE_NIXL = importlib.util.find_spec("nixl_cu12") is not None
ENGINES = [
    "mooncake",
    pytest.param(
        "nixl", marks=pytest.mark.skipif(not HAVE_NIXL, reason="nixl-cu12 not installed")
    ),
]


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


async def poll_until(pred: Callable[[], bool]) -> None:
    """Wait for a condition that has no event to wait on (a statistics counter, an agent's
    private table) by polling it. Callers bound every use with ``trio.fail_after``."""
    while not pred():  # noqa: ASYNC110 - counters and private tables have no trio.Event
        await trio.sleep(0.005)


def host_pool(layout: str = "mha", *, num_pages: int = 256, **kw: Any) -> HostKVPool:
    args: dict[str, Any] = dict(
        layout=layout, num_pages=num_pages, num_layers=2, page_size=4, head_bytes=16,
        heads=2 if layout == "mha" else 1, aux_slots=32,
    )
    args.update(kw)
    return HostKVPool(**args)


@dataclass
class Pair:
    """One prefill rank and one decode rank on loopback, with their host pools."""

    prefill: PrefillAgent
    decode: DecodeAgent
    src: HostKVPool
    dst: HostKVPool
    url: str
    prefill_engine: TransferEngine
    released: list[int] = field(default_factory=list)

    def verify(self, room: int, dst_pages: np.ndarray, aux_slot: int) -> bool:
        """The destination holds exactly the source's bytes for ``room``."""
        return verify_room(self.src, self.dst, room, dst_pages, aux_slot)


def verify_room(
    src: HostKVPool, dst: HostKVPool, room: int, dst_pages: np.ndarray, aux_slot: int
) -> bool:
    """``dst`` holds exactly ``src``'s bytes for ``room`` in ``dst_pages`` and ``aux_slot``."""
    want = src.expected(room, len(dst_pages))
    return bool((dst.kv[:, dst_pages, :] == want).all()) and dst.aux_ok(aux_slot, room)


@asynccontextmanager
async def open_pair(
    engine_name: str,
    url: str,
    *,
    layout: str = "mha",
    wrap: Callable[[TransferEngine], TransferEngine] | None = None,
    prefill_config: PrefillConfig | None = None,
    decode_config: DecodeConfig | None = None,
    src: HostKVPool | None = None,
    dst: HostKVPool | None = None,
) -> AsyncIterator[Pair]:
    """One prefill and one decode rank on loopback, each with a host pool (``src`` and
    ``dst``, or :func:`host_pool` of ``layout``)."""
    src = src or host_pool(layout)
    dst = dst or host_pool(layout)
    pe: TransferEngine = make_engine(engine_name)
    de = make_engine(engine_name)
    if wrap is not None:
        pe = wrap(pe)
    try:
        async with open_prefill(
            engine=pe, pool=src.spec, bootstrap_url=url, kv_heads=2 if layout == "mha" else 1,
            config=prefill_config,
        ) as prefill, open_decode(engine=de, pool=dst.spec, config=decode_config) as decode:
            yield Pair(prefill, decode, src, dst, url, pe)
    finally:
        pe.close()
        de.close()
