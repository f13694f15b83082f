"""The control plane's listener: messages already waiting are handled in one scheduling step
(bounded), so an ABORT behind a burst of TRANSFERs does not pay a scheduling round per message
ahead of it while the loop is busy."""

from __future__ import annotations

import time

import trio
import zmq

from trio_pd import _wire
from trio_pd._control import ControlPlane
from trio_pd._stats import Counters

V = _wire.WIRE_VERSION


def _aborts(n: int, endpoint: str) -> list[list[bytes]]:
    return [
        _wire.encode(_wire.Abort(v=V, room=r, epoch=r, endpoint=endpoint)) for r in range(n)
    ]


async def _handled_rounds(waiting: list[list[bytes]]) -> tuple[list[int], Counters]:
    """Queue ``waiting`` on a ControlPlane's socket before its listener starts, then serve.
    Returns, for each message handled, how many times a busy sibling task had been scheduled
    by then (equal values: handled in the same step), and the plane's counters."""
    counters = Counters()
    cp = ControlPlane("127.0.0.1", counters)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(cp.endpoint)
    rounds = 0
    seen: list[int] = []
    good = sum(1 for f in waiting if f != [b"garbage"])
    done = trio.Event()

    def handle(_msg: _wire.Message, _pages: object) -> None:
        seen.append(rounds)
        if len(seen) == good:
            done.set()

    async def busy() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            await trio.lowlevel.checkpoint()

    try:
        for frames in waiting:
            push.send_multipart(frames)
        # all of them in the listener's socket before it first looks
        deadline = time.monotonic() + 10
        while cp._pull.zsock.get(zmq.EVENTS) & zmq.POLLIN == 0:
            assert time.monotonic() < deadline, "messages never arrived"
            time.sleep(0.001)
        time.sleep(0.05)  # the rest of the burst lands behind the first
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(busy)
                nursery.start_soon(cp.serve, handle)
                await done.wait()
                nursery.cancel_scope.cancel()
    finally:
        push.close(linger=0)
        ctx.term()
        with trio.CancelScope(shield=True):
            await cp.aclose(linger=0)
    return seen, counters


async def test_waiting_messages_are_handled_in_one_step() -> None:
    """Ten waiting messages, a malformed one among them: all handled with no scheduling round
    in between; the bad one is counted and does not end the batch."""
    waiting = _aborts(10, "tcp://127.0.0.1:1")
    waiting.insert(4, [b"garbage"])
    seen, counters = await _handled_rounds(waiting)
    assert len(seen) == 10
    assert len(set(seen)) == 1, f"handled across scheduling rounds: {seen}"
    assert counters["bad_messages"] == 1


async def test_a_long_burst_still_lets_other_tasks_run() -> None:
    """More than a batch waiting: the listener yields between batches, so other tasks run."""
    n = ControlPlane.BATCH * 2 + 5
    seen, _ = await _handled_rounds(_aborts(n, "tcp://127.0.0.1:1"))
    assert len(seen) == n
    assert len(set(seen)) >= 3, "one step handled more than a batch"
    assert max(seen.count(r) for r in set(seen)) <= ControlPlane.BATCH
