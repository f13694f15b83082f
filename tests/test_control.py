"""The control plane's listener: messages already waiting are handled in one scheduling step
(bounded), so an ABORT behind a burst of TRANSFERs does not pay a scheduling round per message
ahead of it while the loop is busy."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import zmq

from trio_pd.core import _wire
from trio_pd.core._stats import Counters
from trio_pd.io._control import ControlPlane

V = _wire.WIRE_VERSION


def _aborts(n: int, endpoint: str) -> list[list[bytes]]:
    return [
        _wire.encode(_wire.Abort(v=V, room=r, epoch=r, endpoint=endpoint)) for r in range(n)
    ]


@asynccontextmanager
async def _queued(waiting: list[list[bytes]]) -> AsyncIterator[tuple[ControlPlane, Counters]]:
    """A ControlPlane with ``waiting`` already queued on its socket, none of it read yet."""
    counters = Counters()
    cp = ControlPlane("127.0.0.1", counters)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(cp.endpoint)
    try:
        for frames in waiting:
            push.send_multipart(frames)
        deadline = time.monotonic() + 10
        while cp._pull.zsock.get(zmq.EVENTS) & zmq.POLLIN == 0:
            assert time.monotonic() < deadline, "messages never arrived"
            await trio.sleep(0.001)
        await trio.sleep(0.05)  # the rest of them land behind the first
        yield cp, counters
    finally:
        push.close(linger=0)
        ctx.term()
        with trio.CancelScope(shield=True):
            await cp.aclose(linger=0)


async def _between_steps(waiting: list[list[bytes]]) -> tuple[set[int], Counters]:
    """Queue ``waiting`` on a ControlPlane's socket before its listener starts, then serve.
    A busy sibling task, scheduled once per scheduling round, records how many messages had
    been handled each time it ran: a count strictly between 0 and all of them means the
    listener yielded there. Returns those counts and the plane's counters."""
    seen: list[_wire.Message] = []
    counts: set[int] = set()
    good = sum(1 for f in waiting if f != [b"garbage"])
    done = trio.Event()

    def handle(msg: _wire.Message, _pages: object) -> None:
        seen.append(msg)
        if len(seen) == good:
            done.set()

    async def busy() -> None:
        while True:
            counts.add(len(seen))
            await trio.lowlevel.checkpoint()

    async with _queued(waiting) as (cp, counters):
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(busy)
                nursery.start_soon(cp.serve, handle)
                await done.wait()
                nursery.cancel_scope.cancel()
    assert len(seen) == good
    return counts, counters


async def test_waiting_messages_are_handled_in_one_step() -> None:
    """Ten waiting messages, a malformed one among them: all handled with no scheduling round
    in between; the bad one is counted and does not end the batch."""
    waiting = _aborts(10, "tcp://127.0.0.1:1")
    waiting.insert(4, [b"garbage"])
    counts, counters = await _between_steps(waiting)
    assert counts <= {0, 10}, f"other tasks ran after {sorted(counts)} messages"
    assert counters["bad_messages"] == 1


async def test_a_long_burst_still_lets_other_tasks_run() -> None:
    """More than a batch waiting: the listener yields after each batch, so other tasks run."""
    batch = ControlPlane.BATCH
    n = batch * 2 + 5
    counts, _ = await _between_steps(_aborts(n, "tcp://127.0.0.1:1"))
    assert counts - {0, n}, "the whole burst was handled in one step"
    assert counts <= {0, batch, 2 * batch, n}, f"yielded after {sorted(counts)} messages"


async def test_a_closing_agent_handles_what_its_listener_left_unread() -> None:
    """drain_nowait: every message already waiting is handed to the handler at once, with
    no checkpoint, a malformed one counted and skipped; a socket with nothing waiting gives
    none. A closing prefill agent answers the TRANSFERs it finds this way instead of
    dropping them with its socket (tests/test_sync.py::
    test_close_fails_open_rooms_and_stops_the_thread failed 3 runs in 6 without it: decode
    held the room's pages, as nothing proves a closed agent's live engine quiet)."""
    seen: list[_wire.Message] = []
    waiting = _aborts(5, "tcp://127.0.0.1:1")
    waiting.insert(2, [b"garbage"])
    async with _queued(waiting) as (cp, counters):
        assert cp.drain_nowait(lambda msg, _pages: seen.append(msg)) == 6
        assert [m.room for m in seen if isinstance(m, _wire.Abort)] == list(range(5))
        assert counters["bad_messages"] == 1
        assert cp.drain_nowait(lambda msg, _pages: seen.append(msg)) == 0


async def test_a_frame_larger_than_any_message_is_refused_at_the_socket() -> None:
    """A frame one byte over the wire's largest legal frame (``MAX_FRAME_BYTES``) is refused
    by libzmq as it arrives: the sender's connection is dropped, nothing reaches the
    listener, and what comes later on a new connection is handled. (Before: no bound at the
    socket; libzmq read any frame whole first, and one of 256 MiB grew the process from 62 to
    575 MB before the decoder refused it.)"""
    counters = Counters()
    cp = ControlPlane("127.0.0.1", counters)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    big = ctx.socket(zmq.PUSH)
    events = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    good = ctx.socket(zmq.PUSH)
    seen: list[_wire.Message] = []
    try:
        big.connect(cp.endpoint)
        big.send(b"\0" * (_wire.MAX_FRAME_BYTES + 1))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cp.serve, lambda msg, _pages: seen.append(msg))
            with trio.fail_after(10):
                while not events.poll(0):  # noqa: ASYNC110 - a zmq socket, polled
                    await trio.sleep(0.02)
            good.connect(cp.endpoint)
            good.send_multipart(_aborts(1, cp.endpoint)[0])
            with trio.fail_after(10):
                while not seen:  # noqa: ASYNC110 - the listener's doing
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
        assert len(seen) == 1 and counters["bad_messages"] == 0
    finally:
        big.disable_monitor()
        for sock in (events, big, good):
            sock.close(linger=0)
        ctx.term()
        await cp.aclose()
