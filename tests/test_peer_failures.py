"""One failed engine call fails the rooms in that call and nothing else while its peer answers;
a peer is marked failed only while it does not answer (SPEC §5.7). Peer events are logged
once each and counted.

Real engines (both), real ZeroMQ, the real bootstrap service. The prefill engine is wrapped
in a :class:`~trio_pd.engines.fault.FaultEngine`: a ``stall`` fault holds the first write so
that the next rooms' chunks queue behind it and share one engine call, a ``fail`` fault makes
that shared call raise. The peer's probe is held (:class:`HeldProbes`) while more rooms are
sent: the window in which a peer whose write just failed is being probed, made as long as
the test needs, without sleeping.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import pytest
import trio
from prometheus_client import CollectorRegistry

from trio_pd import (
    DecodeConfig,
    EngineError,
    KVPoll,
    PeerLost,
    PrefillConfig,
    open_decode,
    open_prefill,
)
from trio_pd.core._state import Liveness
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.engines.fault import Fault, FaultEngine, Policy
from trio_pd.metrics import AgentMetrics

from .helpers.agents import Pair, host_pool, open_pair, poll_until

BOUND = 15.0


class HeldProbes:
    """Holds every probe ``fault.probe`` answers, in the probe's thread, until
    :meth:`release`; counts the probes that got there (:meth:`wait_entered`)."""

    def __init__(self, fault: FaultEngine) -> None:
        self.entered = 0
        self._go = threading.Event()
        self._changed = trio.Event()
        token = trio.lowlevel.current_trio_token()
        inner = fault.probe

        def probe(peer: str) -> bool:
            token.run_sync_soon(self._enter)
            self._go.wait(BOUND)
            return inner(peer)

        fault.probe = probe  # type: ignore[method-assign]

    def _enter(self) -> None:
        self.entered += 1
        self._changed.set()
        self._changed = trio.Event()

    async def wait_entered(self, n: int = 1) -> None:
        with trio.fail_after(BOUND):
            while self.entered < n:
                await self._changed.wait()

    def release(self) -> None:
        self._go.set()


class Entered:
    """Counts the chunks that entered ``agent.runner._transfer``. A chunk runs from there,
    without a schedule point, to its peer's failed mark: it has met the mark (failed fast,
    or waits for the probe) once the test task runs again after the count went up."""

    def __init__(self, pair: Pair) -> None:
        self.count = 0
        runner: Any = pair.prefill.runner
        inner = runner._transfer

        async def transfer(*args: Any) -> None:
            self.count += 1
            await inner(*args)

        runner._transfer = transfer


def fault_pair(
    engine_name: str, url: str, policy: Policy, config: PrefillConfig,
    probe_override: bool | None = None, decode_config: DecodeConfig | None = None,
) -> tuple[list[FaultEngine], Any]:
    made: list[FaultEngine] = []

    def wrap(inner: TransferEngine) -> TransferEngine:
        made.append(FaultEngine(inner, policy, probe_override=probe_override))
        return made[-1]

    return made, open_pair(engine_name, url, wrap=wrap, prefill_config=config,
                           decode_config=decode_config)


class Rooms:
    """Rooms of two pages each: room ``r`` sends source pages ``2r, 2r+1`` into destination
    pages ``100 + 2r, 101 + 2r``, aux slot ``r``."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.senders: dict[int, Any] = {}
        self.receivers: dict[int, Any] = {}
        self.released: list[int] = []

    @staticmethod
    def pages(room: int) -> np.ndarray:
        return np.array([2 * room, 2 * room + 1])

    async def open(self, rooms: range) -> None:
        """Both handles of each room, and wait until prefill has decode's metadata."""
        for room in rooms:
            self.pair.src.fill(self.pages(room), room=room)
            self.pair.src.fill_aux(room, room=room)
            self.senders[room] = self.pair.prefill.sender(
                room, num_pages=2, aux_slot=room,
                on_release=lambda room=room: self.released.append(room),  # type: ignore[misc]
            )
            self.receivers[room] = self.pair.decode.receiver(room, bootstrap_url=self.pair.url)
            self.receivers[room].init(self.pages(room) + 100, room)
        with trio.fail_after(BOUND):
            await poll_until(lambda: all(
                self.senders[r].poll() is KVPoll.WaitingForInput for r in rooms))

    def send(self, room: int) -> None:
        self.senders[room].send(self.pages(room), last=True)

    async def outcome(self, room: int) -> KVPoll:
        """The room's outcome on both sides (the same); a Success is verified byte for byte."""
        with trio.fail_after(BOUND):
            status: KVPoll = await self.receivers[room].wait()
            assert await self.senders[room].wait() is status, room
        if status is KVPoll.Success:
            assert self.pair.verify(room, self.pages(room) + 100, room), f"room {room}"
        return status


def messages(caplog: pytest.LogCaptureFixture, level: int, has: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and has in r.getMessage()]


async def test_a_failed_call_fails_only_the_rooms_in_it(
    engine_name: str, bootstrap_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Room 0's write is held in the engine; rooms 1..3 queue behind it and share one engine
    call, which fails. While the peer is being probed (held here), rooms 4..6 send their
    chunks. The peer answers: rooms 1..3 (the call) fail with the engine's error and
    quarantine; room 0 and rooms 4..6 succeed, verified, and the peer is never marked failed.
    (Before the fix the error marked the peer failed at once and rooms 4..6 failed with
    PeerLost 'is marked failed'.)"""
    caplog.set_level(logging.INFO, logger="trio_pd")

    def policy(i: int, _peer: str, _n: int) -> Fault | None:
        return Fault("stall") if i == 0 else Fault("fail") if i == 1 else None

    # (the fence is also how long a probe may take: longer than the test holds it. The
    # failed call's rooms are still quarantined when the test ends: decode does not wait
    # for them)
    config = PrefillConfig(batch_blocks=1024, coalesce_pages=1, quarantine_fence=BOUND)
    made, opened = fault_pair(engine_name, bootstrap_url, policy, config,
                              decode_config=DecodeConfig(close_timeout=0.1))
    async with opened as pair:
        fault = made[0]
        held = HeldProbes(fault)
        entered = Entered(pair)
        rooms = Rooms(pair)
        await rooms.open(range(7))
        rooms.send(0)
        with trio.fail_after(BOUND):
            await fault.stalls.wait_stalled_async(1)
        for room in (1, 2, 3):
            rooms.send(room)
        with trio.fail_after(BOUND):
            await poll_until(lambda: entered.count == 4)
        fault.stalls.release_all()
        await held.wait_entered()  # the shared call failed: its peer is being probed
        for room in (4, 5, 6):
            rooms.send(room)
        with trio.fail_after(BOUND):
            await poll_until(lambda: entered.count == 7)
        await trio.lowlevel.checkpoint()  # (each of them has met the peer's state)
        held.release()
        outcomes = {room: await rooms.outcome(room) for room in range(7)}
        stats = pair.prefill.statistics()
        failures = {r: rooms.senders[r].failure for r in range(7)}
        calls = fault.statistics()
    failed = sorted(r for r, s in outcomes.items() if s is not KVPoll.Success)
    assert calls.errors == 1, calls  # one engine call raised
    assert failed and set(failed) <= {1, 2, 3}, (outcomes, failures)
    assert all(isinstance(failures[r], EngineError) for r in failed), failures
    assert stats.rooms_in_failed_calls == len(failed) == stats.quarantined, stats
    assert stats.engine_calls + stats.chunks_batched == 7 - len(failed), stats
    assert stats.peers_failed == 0 and stats.peers_back == 0, stats
    # logged once, by the write that led the call; no peer event
    failed_calls = messages(caplog, logging.WARNING, "failed (")
    assert len(failed_calls) == 1, caplog.text
    assert f"({len(failed)} chunk writes" in failed_calls[0], failed_calls
    assert "only the rooms in that call fail" in failed_calls[0]
    assert not messages(caplog, logging.WARNING, " lost: "), caplog.text
    assert len(messages(caplog, logging.INFO, "pages quarantined after a failed engine call")) \
        == len(failed), caplog.text


async def test_a_peer_that_does_not_answer_is_lost_until_a_probe_answers(
    engine_name: str, bootstrap_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A write fails and the peer's probe gets no answer (the engine's probe says no): the
    room of that call fails with PeerLost (not the engine's 'outcome unknown' alone), the
    peer is marked failed (one WARNING) and the next room fails fast without an engine call,
    its pages back at once. Once the peer answers again, a probe (a chunk that meets the
    mark starts one) ends the mark (one INFO line, ``peers_back``), the quarantine of the
    failed call ends (logged), and the next room succeeds."""
    caplog.set_level(logging.INFO, logger="trio_pd")

    def policy(i: int, _peer: str, _n: int) -> Fault | None:
        return Fault("fail") if i == 0 else None

    config = PrefillConfig(quarantine_fence=0.5)
    made, opened = fault_pair(engine_name, bootstrap_url, policy, config, probe_override=False)
    registry = CollectorRegistry()
    async with opened as pair:
        AgentMetrics(registry, role="prefill", rank=0).attach(pair.prefill)
        fault = made[0]
        rooms = Rooms(pair)
        await rooms.open(range(4))
        rooms.send(0)
        assert await rooms.outcome(0) is KVPoll.Failed
        first = rooms.senders[0].failure
        assert isinstance(first, PeerLost), repr(first)
        assert "no answer to a probe" in str(first) and "a write to it failed" in str(first)
        lost = messages(caplog, logging.WARNING, f"decode peer {pair.decode.endpoint} lost: ")
        assert len(lost) == 1 and "no answer to a probe" in lost[0], caplog.text
        assert pair.prefill.statistics().peers_failed == 1

        rooms.send(1)  # fails fast: never reaches the engine, its pages go back at once
        assert await rooms.outcome(1) is KVPoll.Failed
        assert isinstance(rooms.senders[1].failure, PeerLost)
        assert "fail fast" in str(rooms.senders[1].failure)
        with trio.fail_after(BOUND):
            await rooms.senders[1].wait_released()
        assert fault.statistics().calls == 1
        assert 0 not in rooms.released  # (the failed call's pages stay quarantined)

        fault.probe_override = None  # the peer answers again
        # Room 2 meets the mark (fails fast, and probes the peer) unless a probe already
        # ended it (the quarantine's, every fence): either way the mark ends on that answer
        rooms.send(2)
        await rooms.outcome(2)
        with trio.fail_after(BOUND):
            await poll_until(lambda: pair.prefill.statistics().peers_back == 1)
        rooms.send(3)
        assert await rooms.outcome(3) is KVPoll.Success
        with trio.fail_after(BOUND):
            await rooms.senders[0].wait_released()  # its quarantine ended: the peer answers
        stats = pair.prefill.statistics()
    assert stats.peers_failed == 1 and stats.peers_back == 1, stats
    assert stats.rooms_in_failed_calls == stats.quarantined == 1, stats
    # the metrics name the reason: rooms 0 and 1 (and 2 if it met the mark) lost their peer
    labels = {"role": "prefill", "rank": "0"}
    lost = registry.get_sample_value("trio_pd_failures_total", {**labels, "reason": "PeerLost"})
    assert lost == stats.failed >= 2, (lost, stats)
    assert registry.get_sample_value("trio_pd_agent_peers_back_total", labels) == 1
    back = messages(caplog, logging.INFO, "answers a probe again")
    assert len(back) == 1, caplog.text
    assert len(messages(caplog, logging.WARNING, " lost: ")) == 1, caplog.text
    assert len(messages(caplog, logging.INFO, "pages quarantined")) == 1, caplog.text
    assert len(messages(caplog, logging.INFO, "quarantine of 2 pages ended")) == 1, caplog.text


async def test_decode_logs_each_change_of_a_prefill_ranks_liveness_once(
    engine_name: str, bootstrap_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Decode probes the writers of every room it holds at each ack timeout: a prefill rank
    that does not answer is logged once (WARNING), not once a probe, and once more (INFO)
    when it answers again."""
    caplog.set_level(logging.INFO, logger="trio_pd")
    src, dst = host_pool(), host_pool()
    pe, de = make_engine(engine_name), FaultEngine(make_engine(engine_name))
    try:
        async with (
            open_prefill(engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2),
            open_decode(engine=de, pool=dst.spec) as decode,
        ):
            receiver = decode.receiver(1, bootstrap_url=bootstrap_url)
            receiver.init(np.array([0, 1]), 0)
            with trio.fail_after(BOUND):
                await poll_until(lambda: bool(decode.sources.ranks))
            (rank,) = decode.sources.ranks.values()
            de.probe_override = False  # its engine's probe gets no answer
            for _ in range(3):
                assert await decode.sources.liveness(rank) is Liveness.UNKNOWN
            de.probe_override = None
            assert await decode.sources.liveness(rank) is Liveness.ALIVE
            receiver.abort("done")
    finally:
        pe.close()
        de.close()
    where = f"prefill rank 0 at {rank.endpoint}"
    unknown = messages(caplog, logging.WARNING, f"{where}: no answer to a probe")
    assert len(unknown) == 1 and "liveness is unknown" in unknown[0], caplog.text
    assert len(messages(caplog, logging.INFO, f"{where} answers a probe again")) == 1
