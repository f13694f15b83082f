"""An agent's close runs its last waiting steps (probe threads, deregistrations, bootstrap
clients, the control plane) each under a deadline of its own (trio_pd/agents/_close.py): a
step that hangs is given up with a warning, and the later steps still run, so the control
plane's sockets are closed; memory an engine may still hold registered is kept, not freed.

Real engines; the hang is injected around them (a deregistration that blocks, a probe thread
that never returns), with ``_close.STEP_TIMEOUT`` cut to a fraction of a second."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio

from trio_pd import DecodeConfig, PrefillConfig, open_decode, open_prefill
from trio_pd.agents import _chunks, _close, _dp_router
from trio_pd.core import _landing
from trio_pd.core._memory import Region
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.engines.fault import FaultEngine

from .helpers.agents import host_pool

STEP = 0.3


class HangingUnregister(FaultEngine):
    """A real engine whose ``unregister`` blocks (until :attr:`gate` opens, at most 30 s)
    when ``hangs(regions)`` says so; every call is recorded."""

    def __init__(self, inner: TransferEngine, hangs: Callable[[list[Region]], bool]) -> None:
        super().__init__(inner)
        self.hangs = hangs
        self.gate = threading.Event()
        self.unregistered: list[list[Region]] = []

    def unregister(self, regions: list[Region]) -> None:
        self.unregistered.append(list(regions))
        if self.hangs(regions):
            self.gate.wait(30.0)
        super().unregister(regions)


@pytest.fixture
def short_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_close, "STEP_TIMEOUT", STEP)


@pytest.fixture
def kept() -> Iterator[None]:
    """Leave the process-wide KEPT lists as they were."""
    landing, staging = list(_landing.KEPT), list(_chunks._KEPT)
    yield
    _landing.KEPT[:] = landing
    _chunks._KEPT[:] = staging


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def gave_up(caplog: pytest.LogCaptureFixture, what: str) -> bool:
    return any(
        r.levelno == logging.WARNING and what in r.getMessage() and "given up" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.usefixtures("short_steps", "kept")
async def test_a_hung_deregistration_skips_no_later_close_step(
    engine_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The pool's deregistration hangs: it is given up (warning), the landing area is still
    deregistered, and the control plane's sockets are closed: no descriptor is left open."""
    dst = host_pool()
    pool_bases = {r.base for r in dst.spec.regions()}
    engine = HangingUnregister(
        make_engine(engine_name), lambda regions: regions[0].base in pool_bases
    )
    try:
        # (a first agent, closed without a hang: what the engine opens once, on its first
        # registration, stays open with the engine and is not counted)
        hang, engine.hangs = engine.hangs, lambda regions: False
        async with open_decode(
            engine=engine, pool=dst.spec, config=DecodeConfig(landing_bytes=1 << 20)
        ):
            pass
        engine.hangs, engine.unregistered = hang, []
        before = open_fds()
        with caplog.at_level(logging.WARNING, "trio_pd"), trio.fail_after(10 * STEP + 10):
            async with open_decode(
                engine=engine, pool=dst.spec, config=DecodeConfig(landing_bytes=1 << 20)
            ) as agent:
                area = agent.landing
                assert area is not None
                control = agent.control
        assert len(engine.unregistered) == 2, "the landing area's turn was skipped"
        assert engine.unregistered[1] == [area.region]
        assert control._pull.closed and control._ping_pull.closed
        assert control._ctx.closed, "the control plane's ZeroMQ context was left open"
        assert open_fds() == before, "the close left descriptors open"
        assert gave_up(caplog, "deregistering decode rank 0's pool")
        assert any("may still be registered" in r.getMessage() for r in caplog.records)
        assert area not in _landing.KEPT  # (deregistered, nothing held: freed)
    finally:
        engine.gate.set()
        engine.close()


@pytest.mark.usefixtures("short_steps", "kept")
async def test_a_landing_area_whose_deregistration_hangs_is_kept(
    engine_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The landing area's deregistration hangs: the engine may still hold it registered, so
    its memory is kept for the life of the process although no room holds a range of it,
    and the control plane is closed all the same."""
    dst = host_pool()
    pool_bases = {r.base for r in dst.spec.regions()}
    engine = HangingUnregister(
        make_engine(engine_name), lambda regions: regions[0].base not in pool_bases
    )
    try:
        with caplog.at_level(logging.WARNING, "trio_pd"), trio.fail_after(10 * STEP + 10):
            async with open_decode(
                engine=engine, pool=dst.spec, config=DecodeConfig(landing_bytes=1 << 20)
            ) as agent:
                area = agent.landing
                assert area is not None and not area.reserved
                control = agent.control
        assert area in _landing.KEPT, "a landing area still registered was left to be freed"
        assert gave_up(caplog, "deregistering the landing area")
        assert control._pull.closed and control._ctx.closed
    finally:
        engine.gate.set()
        engine.close()


@pytest.mark.usefixtures("short_steps")
async def test_a_hung_probe_thread_skips_no_later_close_step(
    engine_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A probe thread that never returns holds a token of the agent's probe limiter; the close
    waits for it at most its step (not ``ack_timeout``, 60 s here), says so, and then still
    deregisters the pool and closes the control plane."""
    dst = host_pool()
    engine = HangingUnregister(make_engine(engine_name), lambda regions: False)
    stuck = threading.Event()
    try:
        with caplog.at_level(logging.WARNING, "trio_pd"), trio.fail_after(10 * STEP + 10):
            async with open_decode(
                engine=engine, pool=dst.spec, config=DecodeConfig(ack_timeout=60.0)
            ) as agent:
                limiter = agent.sources.probe_threads.limiter
                with trio.move_on_after(STEP):  # (abandoned: it keeps its token)
                    await trio.to_thread.run_sync(
                        stuck.wait, 30.0, limiter=limiter, abandon_on_cancel=True
                    )
                assert limiter.borrowed_tokens == 1
                control = agent.control
        assert engine.unregistered == [dst.spec.regions()], "the pool was not deregistered"
        assert control._pull.closed and control._ctx.closed
        assert gave_up(caplog, "waiting for the probe threads") or any(
            "probe thread is still inside the engine" in r.getMessage() for r in caplog.records
        )
    finally:
        stuck.set()
        engine.close()


@pytest.mark.usefixtures("short_steps", "kept")
async def test_a_prefill_close_with_hung_deregistrations_keeps_staging_and_closes(
    engine_name: str, bootstrap_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefill: the pool's deregistration and the staging area's both hang. Each is given
    up on its own; the staging area's memory is kept (the engine may still hold it), and the
    control plane's sockets are closed."""
    src = host_pool()
    engine = HangingUnregister(make_engine(engine_name), lambda regions: True)
    try:
        with caplog.at_level(logging.WARNING, "trio_pd"), trio.fail_after(10 * STEP + 20):
            async with open_prefill(
                engine=engine, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2,
                config=PrefillConfig(staging_bytes=1 << 20),
            ) as agent:
                planner = agent.runner.planner
                await planner.register_staging()
                assert planner.staging.registered and not planner.staging.held
                control = agent.control
        assert len(engine.unregistered) == 2, "the staging area's turn was skipped"
        assert planner.staging in _chunks._KEPT, "a staging area still registered was freed"
        assert gave_up(caplog, "deregistering prefill rank 0's pool")
        assert gave_up(caplog, "deregistering the staging area")
        assert control._pull.closed and control._ctx.closed
    finally:
        engine.gate.set()
        engine.close()


async def test_a_close_step_is_shielded_and_bounded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``bounded``: the caller's cancellation does not cut a step short (it comes at the
    caller's next checkpoint), a step past the deadline is given up (False, logged), one
    that raises is logged, not raised."""
    monkeypatch.setattr(_close, "STEP_TIMEOUT", STEP)
    ran: list[str] = []

    async def quick() -> None:
        await trio.sleep(STEP / 10)
        ran.append("quick")

    async def boom() -> None:
        await trio.lowlevel.checkpoint()
        raise OSError("boom")

    with caplog.at_level(logging.WARNING, "trio_pd"), trio.CancelScope() as scope:
        scope.cancel()
        assert await _close.bounded("quick", quick)
        assert not await _close.bounded("hang", trio.sleep_forever)
        assert not await _close.bounded("boom", boom)
        await trio.lowlevel.checkpoint()
        ran.append("not reached")
    assert scope.cancelled_caught and ran == ["quick"]
    assert gave_up(caplog, "hang") and gave_up(caplog, "boom")


async def test_a_cancelled_block_still_closes_every_socket(
    engine_name: str, bootstrap_url: str
) -> None:
    """Both agents left by a cancellation of the block (the usual way a server stops them):
    every close step still runs, the control planes' sockets and contexts are closed and
    both pools deregistered (a prefill agent without a staging area once skipped its control
    plane: the step before it checkpointed unshielded)."""
    src, dst = host_pool(), host_pool()
    pe = HangingUnregister(make_engine(engine_name), lambda regions: False)
    de = HangingUnregister(make_engine(engine_name), lambda regions: False)
    try:
        with trio.fail_after(30), trio.CancelScope() as scope:
            async with open_prefill(
                engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2
            ) as prefill, open_decode(
                engine=de, pool=dst.spec, config=DecodeConfig(landing_bytes=1 << 20)
            ) as decode:
                controls = [prefill.control, decode.control]
                scope.cancel()
                await trio.sleep_forever()
        assert scope.cancelled_caught
        for control in controls:
            assert control._pull.closed and control._ping_pull.closed and control._ctx.closed
        assert pe.unregistered == [src.spec.regions()]
        assert de.unregistered[0] == dst.spec.regions() and len(de.unregistered) == 2
    finally:
        pe.close()
        de.close()


async def test_a_cancelled_router_close_still_closes_every_client() -> None:
    """The DP router's close, cancelled (a close step past its deadline): every bootstrap
    client's connections are closed all the same, then the cancellation propagates."""
    from trio_pd.agents._dp_router import DpRouter, _Asker
    from trio_pd.bootstrap._bootstrap_client import BootstrapClient
    from trio_pd.core._stats import Counters

    router: DpRouter[object] = DpRouter(
        sources=None, timers=None, counters=Counters(), bootstrap_timeout=1.0,  # type: ignore[arg-type]
        token="t", on_routed=lambda *a: None, on_failed=lambda *a: None,
    )
    clients = [BootstrapClient(f"http://127.0.0.1:{9 + i}", token="t") for i in range(3)]
    for i, client in enumerate(clients):
        router._askers[f"u{i}"] = _Asker(client=client)
    try:
        with trio.CancelScope() as scope:
            scope.cancel()
            await router.aclose()
        assert all(c._transport.http.is_closed for c in clients), "a client was left open"
    finally:
        for c in clients:
            await c.aclose()


@pytest.mark.usefixtures("kept")
async def test_every_close_step_cut_at_its_first_schedule_point(
    engine_name: str, bootstrap_url: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``STEP_TIMEOUT`` 0: every step of both closes is cut at its first schedule point (a
    cancellation at every await of the close). The sockets are closed all the same (they
    close before it), each step given up is logged, and the landing and staging areas,
    whose deregistration never ran, are kept."""
    monkeypatch.setattr(_close, "STEP_TIMEOUT", 0.0)
    src, dst = host_pool(), host_pool()
    pe, de = make_engine(engine_name), make_engine(engine_name)
    try:
        with caplog.at_level(logging.WARNING, "trio_pd"), trio.fail_after(30):
            async with open_prefill(
                engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2,
                config=PrefillConfig(staging_bytes=1 << 20),
            ) as prefill, open_decode(
                engine=de, pool=dst.spec, config=DecodeConfig(landing_bytes=1 << 20)
            ) as decode:
                await prefill.runner.planner.register_staging()
                staging, landing = prefill.runner.planner.staging, decode.landing
                assert staging.registered and landing is not None
                controls = [prefill.control, decode.control]
        for control in controls:
            assert control._pull.closed and control._ping_pull.closed
        assert landing in _landing.KEPT and staging in _chunks._KEPT
        for what in ("deregistering decode rank 0's pool", "deregistering the landing area",
                     "deregistering prefill rank 0's pool", "deregistering the staging area",
                     "closing the control plane"):
            assert gave_up(caplog, what), what
    finally:
        # (the areas are still registered: the engines go with the process's memory)
        pe.close()
        de.close()


async def test_thousands_of_bootstrap_clients_close_in_a_loop_a_cancel_skipping_none() -> None:
    """The DP router closes one bootstrap client per route (up to 4,096 routes): every one is
    closed, also under a cancellation, which propagates after the last (a chain of
    ``finally`` blocks, the first version, raised RecursionError past ~1,000)."""
    closed: list[int] = []

    class Client:
        def __init__(self, k: int) -> None:
            self.k = k

        async def aclose(self) -> None:
            closed.append(self.k)  # (its connections go before its first schedule point)
            await trio.lowlevel.checkpoint()

    clients: list[Any] = [Client(k) for k in range(3000)]
    await _dp_router._close_all(clients)
    assert closed == list(range(3000))
    closed.clear()
    with trio.CancelScope() as scope:
        scope.cancel()
        await _dp_router._close_all(clients)
    assert scope.cancelled_caught and closed == list(range(3000))
