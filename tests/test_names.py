"""Host names are resolved off every I/O thread, bounded in time, before any ZeroMQ socket
sees them (``trio_pd.io._names``). The real thing, a resolver that never answers in a network
namespace, is in the chaos session (tests/chaos/test_dns.py)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
import trio

from trio_pd import ConfigurationError, open_decode
from trio_pd.engines import make_engine
from trio_pd.io import _names
from trio_pd.testing.pools import HostKVPool


async def test_a_name_resolves_to_the_numeric_address_sockets_get() -> None:
    assert await _names.resolve_host("localhost") in ("127.0.0.1", "::1")
    assert await _names.resolve_host("10.1.2.3") == "10.1.2.3"
    assert await _names.resolve_endpoint("tcp://[::1]:5") == "tcp://[::1]:5"
    got = await _names.resolve_endpoint("tcp://localhost:5555")
    assert got in ("tcp://127.0.0.1:5555", "tcp://[::1]:5555")


async def test_a_resolver_that_never_answers_times_out_without_blocking_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lookup runs in a thread of its own and is given up at its deadline; the event
    loop runs meanwhile."""
    release = threading.Event()

    def hung(*_args: Any, **_kwargs: Any) -> Any:
        release.wait(30)
        raise socket.gaierror(socket.EAI_AGAIN, "gave up")

    monkeypatch.setattr(socket, "getaddrinfo", hung)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0.01)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            with pytest.raises(TimeoutError, match=r"did not resolve within 0\.3 s"):
                await _names.resolve_endpoint("tcp://stall.invalid:1", within=0.3)
            with pytest.raises(ConfigurationError, match=r"host=.stall\.invalid. does not resolve"):
                await _names.bind_address("stall.invalid", "decode rank 0", within=0.3)
            nursery.cancel_scope.cancel()
        assert ticks >= 10
    finally:
        release.set()


async def test_an_agent_given_a_host_name_binds_and_publishes_its_address() -> None:
    """``host="localhost"``: resolved at start; the control plane binds the address, never
    the name."""
    pool = HostKVPool(layout="mha", num_pages=8, num_layers=1, page_size=4, head_bytes=8,
                      heads=2)
    engine = make_engine("mooncake")
    try:
        async with open_decode(engine=engine, pool=pool.spec, host="localhost") as decode:
            assert decode.control.endpoint.startswith(("tcp://127.0.0.1:", "tcp://[::1]:"))
    finally:
        engine.close()
