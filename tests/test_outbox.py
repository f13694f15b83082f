"""trio_pd.io._outbox: one retry policy for every control message that must arrive.

Most tests give the outbox a scripted ``send_nowait`` (no sockets) and the real ``Timers``
running under ``autojump_clock``, and assert what was asked to be sent, and when. The last one
uses the real ``ControlPlane`` over loopback, on the real clock."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager

import numpy as np
import numpy.typing as npt
import pytest
import trio
import zmq

from trio_pd.core import _wire
from trio_pd.core._stats import Counters
from trio_pd.io._control import ControlPlane
from trio_pd.io._outbox import Outbox
from trio_pd.io._timers import Timers
from trio_pd.io._zmq import open_socket

V = _wire.WIRE_VERSION
A, B = "tcp://127.0.0.1:1001", "tcp://127.0.0.1:1002"
ME = "tcp://127.0.0.1:1000"


def abort(room: int, epoch: int = 1) -> _wire.Abort:
    return _wire.Abort(v=V, room=room, epoch=epoch, endpoint=ME)


class ScriptedPeers:
    """A ``send_nowait`` whose sockets refuse as scripted: ``refusals[endpoint]`` is how many
    more attempts to that endpoint are refused (``math.inf``: full until changed). Records
    every attempt and what was accepted, and the most timers ever pending at an attempt."""

    def __init__(self, timers: Timers) -> None:
        self.timers = timers
        self.refusals: dict[str, float] = {}
        self.raise_for: set[int] = set()  # rooms whose message makes the send raise
        self.attempts: dict[str, int] = {}
        self.accepted: list[tuple[str, _wire.Message]] = []
        self.max_timers = 0

    def __call__(
        self, endpoint: str, msg: _wire.Message, pages: npt.NDArray[np.int32] | None
    ) -> bool:
        self.attempts[endpoint] = self.attempts.get(endpoint, 0) + 1
        self.max_timers = max(self.max_timers, len(self.timers))
        if isinstance(msg, _wire.Abort) and msg.room in self.raise_for:
            raise RuntimeError("cannot encode")
        if self.refusals.get(endpoint, 0) > 0:
            self.refusals[endpoint] -= 1
            return False
        self.accepted.append((endpoint, msg))
        return True

    def delivered(self, endpoint: str) -> list[_wire.Message]:
        return [msg for ep, msg in self.accepted if ep == endpoint]


@asynccontextmanager
async def running_timers() -> AsyncIterator[Timers]:
    timers = Timers()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        yield timers
        nursery.cancel_scope.cancel()


async def test_accepted_at_once(autojump_clock: trio.abc.Clock) -> None:
    async with running_timers() as timers:
        peers, counters = ScriptedPeers(timers), Counters()
        outbox = Outbox(peers, timers, counters)
        assert outbox.send(A, ("abort", 1), abort(1)) is True
        assert peers.accepted == [(A, abort(1))]
        assert outbox.pending() == 0 and len(timers) == 0
        assert counters["outbox_retried"] == 0


async def test_refused_then_delivered_on_retry_in_order(autojump_clock: trio.abc.Clock) -> None:
    """The socket refuses three tries; the first message is queued, the next two join the
    queue behind it without being tried ahead of it, and all arrive in send order."""
    async with running_timers() as timers:
        peers, counters = ScriptedPeers(timers), Counters()
        peers.refusals[A] = 3
        outbox = Outbox(peers, timers, counters, retry_interval=0.05)
        assert outbox.send(A, 1, abort(1)) is False
        assert outbox.send(A, 2, abort(2)) is False
        assert outbox.send(A, 3, abort(3)) is False
        assert peers.attempts[A] == 1, "a later message was tried ahead of a queued one"
        assert outbox.pending(A) == 3 and len(timers) == 1
        await trio.sleep(0.12)  # two rounds, both refused
        assert peers.accepted == [] and peers.attempts[A] == 3
        await trio.sleep(0.05)  # the third round: the socket takes everything
        assert peers.delivered(A) == [abort(1), abort(2), abort(3)]
        assert outbox.pending() == 0 and len(timers) == 0
        assert counters["outbox_retried"] == 5  # two refused, three delivered
        assert counters["outbox_dropped"] == 0


async def test_same_key_is_replaced_not_multiplied(autojump_clock: trio.abc.Clock) -> None:
    """Sending under a pending key replaces the message in place: one delivery, the newest,
    at the old one's place in the queue."""
    async with running_timers() as timers:
        peers = ScriptedPeers(timers)
        peers.refusals[A] = 1
        outbox = Outbox(peers, timers, Counters())
        outbox.send(A, "x", abort(1, epoch=1))
        outbox.send(A, "y", abort(2))
        outbox.send(A, "x", abort(1, epoch=2))
        outbox.send(A, "x", abort(1, epoch=3))
        assert outbox.pending(A) == 2
        await trio.sleep(1)
        assert peers.delivered(A) == [abort(1, epoch=3), abort(2)]


async def test_full_sockets_cost_linear_work_not_doubling(autojump_clock: trio.abc.Clock) -> None:
    """The old decode policy: a room aborted towards two ranks whose sockets are both full
    re-aborted the whole room per failing rank, doubling the timers every 50 ms. Through the
    outbox, even with the room aborted again on every round, half a second costs at most one
    try per endpoint per round and never more than one timer per endpoint."""
    async with running_timers() as timers:
        peers = ScriptedPeers(timers)
        peers.refusals = {A: math.inf, B: math.inf}
        outbox = Outbox(peers, timers, Counters(), retry_interval=0.05)

        def abort_room() -> None:
            for endpoint in (A, B):
                outbox.send(endpoint, ("abort", 7), abort(7))

        abort_room()
        with trio.move_on_after(0.5):
            while True:
                await trio.sleep(0.05)
                abort_room()
        assert len(timers) <= 2 and peers.max_timers <= 2
        assert peers.attempts[A] <= 11 and peers.attempts[B] <= 11
        assert outbox.pending() == 2


async def test_give_up_after_deadline(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Past give_up_after the messages are dropped, counted, reported, and no longer tried;
    the warning is logged once for the endpoint, not once per message."""
    async with running_timers() as timers:
        peers, counters = ScriptedPeers(timers), Counters()
        peers.refusals[A] = math.inf
        dropped: list[tuple[str, Hashable]] = []
        outbox = Outbox(
            peers, timers, counters, give_up_after=1.0,
            on_drop=lambda ep, key: dropped.append((ep, key)),
        )
        with caplog.at_level(logging.WARNING, logger="trio_pd.outbox"):
            for room in range(3):
                outbox.send(A, room, abort(room))
            await trio.sleep(0.9)
            assert dropped == [] and outbox.pending(A) == 3
            # A replacement keeps the original deadline.
            outbox.send(A, 0, abort(0, epoch=2))
            await trio.sleep(0.2)
        assert dropped == [(A, 0), (A, 1), (A, 2)]
        assert counters["outbox_dropped"] == 3 and outbox.pending() == 0
        assert len(timers) == 0
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        tries = peers.attempts[A]
        await trio.sleep(1)
        assert peers.attempts[A] == tries, "still retrying after giving up"
        assert peers.accepted == []


async def test_max_per_peer_drops_the_oldest(autojump_clock: trio.abc.Clock) -> None:
    async with running_timers() as timers:
        peers, counters = ScriptedPeers(timers), Counters()
        peers.refusals[A] = 1
        dropped: list[Hashable] = []
        outbox = Outbox(
            peers, timers, counters, max_per_peer=3, on_drop=lambda ep, key: dropped.append(key)
        )
        for room in range(5):
            outbox.send(A, room, abort(room))
        assert outbox.pending(A) == 3 and dropped == [0, 1]
        assert counters["outbox_dropped"] == 2
        await trio.sleep(1)
        assert peers.delivered(A) == [abort(2), abort(3), abort(4)]


async def test_forget_and_cancel(autojump_clock: trio.abc.Clock) -> None:
    """forget drops an endpoint's messages silently and stops its retries; other endpoints go
    on. cancel drops one message. A forgotten endpoint used again still has one timer."""
    async with running_timers() as timers:
        peers, counters = ScriptedPeers(timers), Counters()
        peers.refusals = {A: math.inf, B: 2}
        dropped: list[Hashable] = []
        outbox = Outbox(peers, timers, counters, on_drop=lambda ep, key: dropped.append(key))
        outbox.send(A, 1, abort(1))
        outbox.send(A, 2, abort(2))
        outbox.send(B, 3, abort(3))
        outbox.send(B, 4, abort(4))
        outbox.cancel(B, 3)
        outbox.cancel(B, 99)  # nothing under it: no effect
        outbox.forget(A)
        assert outbox.pending(A) == 0 and outbox.pending() == 1
        tries = peers.attempts[A]
        await trio.sleep(1)
        assert peers.attempts[A] == tries, "a forgotten endpoint was tried again"
        assert peers.delivered(B) == [abort(4)]
        assert dropped == [] and counters["outbox_dropped"] == 0
        # Used again right after a forget (its old timer may still be pending): one timer.
        outbox.send(A, 5, abort(5))
        outbox.forget(A)
        outbox.send(A, 6, abort(6))
        assert len(timers) <= 1
        await trio.sleep(0.2)
        assert peers.max_timers <= 2 and outbox.pending(A) == 1


async def test_on_drop_and_send_errors_do_not_break_the_outbox(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """An on_drop that raises, and a queued message whose send raises, are logged; neither
    escapes send() or the timer action, and the rest is still delivered."""
    async with running_timers() as timers:
        peers, counters = ScriptedPeers(timers), Counters()
        peers.refusals[A] = 3
        peers.raise_for = {2}

        def on_drop(endpoint: str, key: Hashable) -> None:
            raise RuntimeError(f"on_drop {key}")

        outbox = Outbox(peers, timers, counters, max_per_peer=3, on_drop=on_drop)
        for room in range(5):  # room 0 and 1 overflow: on_drop raises inside send()
            outbox.send(A, room, abort(room))
        await trio.sleep(1)
        # room 2's send raises in a round: dropped, on_drop raises again, the round goes on
        assert peers.delivered(A) == [abort(3), abort(4)]
        assert counters["outbox_dropped"] == 3 and outbox.pending() == 0
        assert len(timers) == 0
    assert not [r for r in caplog.records if r.name == "trio_pd.timers"], "a timer action raised"
    assert sum("on_drop" in r.getMessage() for r in caplog.records) == 3


async def test_queued_behind_a_full_socket_is_delivered_once_the_peer_reads() -> None:
    """Real ControlPlane, real clock, loopback: a peer that does not read fills its socket
    (large TRANSFERs, small high-water marks); an ABORT sent then is queued, and arrives,
    after everything sent before it, once the peer reads."""
    counters = Counters()
    cp = ControlPlane("127.0.0.1", counters, sndhwm=1)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    n = 16384
    filler = _wire.Transfer(
        v=V, room=1, epoch=1, endpoint=ME, decode_rank=0, aux_slot=0, required=1, num_pages=n
    )
    pages = np.arange(n, dtype=np.int32)
    try:
        with trio.fail_after(3):
            async with open_socket(ctx, zmq.PULL, rcvhwm=1) as pull, running_timers() as timers:
                endpoint = pull.bind("tcp://127.0.0.1:*")
                outbox = Outbox(cp.send_nowait, timers, counters, retry_interval=0.02)
                sent = 0
                for room in range(1, 10_000):
                    while cp.send_nowait(endpoint, filler, pages):
                        sent += 1
                        assert sent < 10_000, "the peer's socket never filled up"
                    if not outbox.send(endpoint, ("abort", room), abort(room)):
                        break
                    sent += 1  # taken at once after all: fill again and retry
                assert outbox.pending(endpoint) == 1
                received = 0
                while True:
                    msg, _ = _wire.decode(await pull.recv_multipart())
                    if isinstance(msg, _wire.Abort) and msg.room == room:
                        break
                    received += 1
                assert received == sent, "the queued ABORT overtook earlier messages"
                assert outbox.pending() == 0 and counters["outbox_retried"] >= 1
                pull.zsock.setsockopt(zmq.LINGER, 0)
    finally:
        with trio.CancelScope(shield=True):
            await cp.aclose(linger=0)
        ctx.term()
