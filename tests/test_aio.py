"""trio_pd hosted in asyncio (trio_pd.aio): real agents, a real Mooncake engine per side, the
real bootstrap service, all in a trio guest run on an asyncio loop.

Plain pytest tests: each drives ``asyncio.run(...)`` itself (pytest-trio has nothing to run).
Pages come from allocators with the lifetime sanitizer (trio_pd.testing.pools), so a page
handed back too early and written later is counted. Waits are bounded with
``asyncio.timeout``; a condition with no event is polled under that bound.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import numpy as np
import pytest
import trio

from trio_pd import AdmissionClosed, KVPoll, ProtocolError, TransferAborted
from trio_pd.aio import AioReceiver, AioSender, open_trio_host

from .helpers.aio import Agents, Ticker, open_agents

#: the asyncio loop may never be held longer than this by the trio side
MAX_GAP = 0.2


async def poll_until(pred: Callable[[], bool]) -> None:
    """For a condition with no event to wait on; callers bound it with asyncio.timeout."""
    while not pred():  # noqa: ASYNC110 - a room's status has no asyncio.Event
        await asyncio.sleep(0.005)


async def bound_room(
    a: Agents, room: int, released: asyncio.Event
) -> tuple[AioSender, AioReceiver]:
    """A room whose receiver has sent its TRANSFER (the prefill rank holds the room), with
    two destination pages given to ``init``; their release sets ``released``."""
    dst = a.dst_pages.alloc_nowait(2)
    assert dst is not None

    def on_release() -> None:
        a.dst_pages.free(dst)
        released.set()

    sender = await a.prefill.sender(room, num_pages=2, aux_slot=1)
    receiver = await a.decode.receiver(room, bootstrap_url=a.url)
    await receiver.init(dst, 2, on_release=on_release)
    async with asyncio.timeout(10):
        await poll_until(lambda: sender.poll() is KVPoll.WaitingForInput)
    return sender, receiver


# ------------------------------------------------------------------------ the tests


@pytest.mark.serial
def test_twenty_verified_transfers_while_asyncio_keeps_ticking() -> None:
    """20 rooms from asyncio, five at a time, each in two chunks: every byte arrives, no page
    is written after its release, and an asyncio task ticks throughout, never held up more
    than MAX_GAP."""
    ticker = Ticker()
    verified: list[int] = []

    async def one(a: Agents, gate: asyncio.Semaphore, room: int) -> None:
        n = 1 + room % 5
        async with gate:
            src = a.src_pages.alloc_nowait(n)
            dst = a.dst_pages.alloc_nowait(n)
            assert src is not None and dst is not None
            a.src.fill(src, room)
            a.src.fill_aux(room, room)
            released = asyncio.Event()

            def on_release() -> None:
                a.src_pages.free(src)
                released.set()

            sender = await a.prefill.sender(room, num_pages=n, aux_slot=room, on_release=on_release)
            receiver = await a.decode.receiver(room, bootstrap_url=a.url)
            await receiver.init(dst, room)
            await sender.send(src[:1])
            await sender.send(src[1:], last=True)
            assert await receiver.wait() is KVPoll.Success
            assert await sender.wait() is KVPoll.Success
            await released.wait()
            assert (a.dst.kv[:, dst, :] == a.src.expected(room, n)).all()
            assert a.dst.aux_ok(room, room)
            verified.append(room)
            a.dst_pages.free(dst)

    async def scenario() -> None:
        async with open_agents(ticker) as a:
            gate = asyncio.Semaphore(5)
            async with asyncio.timeout(20):
                await asyncio.gather(*(one(a, gate, room) for room in range(20)))
            assert a.src_pages.late_writes == a.dst_pages.late_writes == 0
            assert a.src_pages.late_in_free_rows() == a.dst_pages.late_in_free_rows() == 0
            assert a.src_pages.outstanding == a.dst_pages.outstanding == 0
            p, d = a.prefill.statistics(), a.decode.statistics()
            assert p.succeeded == d.succeeded == 20 and p.rooms_active == d.rooms_active == 0

    asyncio.run(scenario())
    assert sorted(verified) == list(range(20))
    # it ran from before the host started until the host had closed, never held up long:
    # Ticker.stop, after the close, counts the gap since the last tick too, so a close that
    # held the loop shows here (a tick *during* the close is not required: it may take <10 ms)
    assert ticker.longest < MAX_GAP, f"the asyncio loop was held {ticker.longest:.3f} s"
    assert ticker.ticks >= ticker.span / 0.01 / 4, (ticker.ticks, ticker.span)


def test_room_calls_never_suspend_and_raise_at_the_call() -> None:
    """``sender()``, ``receiver()``, ``init()`` and ``send()`` make their trio-side call at
    once, between trio's ticks: driven by hand, the coroutine making a whole request's calls
    finishes on its first step (none suspends the asyncio task: no round trip to trio), a bad
    chunk's ProtocolError comes out of that very call, and the request then succeeds."""

    async def calls(a: Agents) -> tuple[AioSender, AioReceiver]:
        src = a.src_pages.alloc_nowait(2)
        dst = a.dst_pages.alloc_nowait(2)
        assert src is not None and dst is not None
        a.src.fill(src, 5)
        a.src.fill_aux(3, 5)
        sender = await a.prefill.sender(
            5, num_pages=2, aux_slot=3, on_release=lambda: a.src_pages.free(src)
        )
        receiver = await a.decode.receiver(5, bootstrap_url=a.url)
        await receiver.init(dst, 4, on_release=lambda: a.dst_pages.free(dst))
        with pytest.raises(ProtocolError):
            await sender.send([10**6])  # (a page id outside the pool)
        await sender.send(src[:1])
        await sender.send(src[1:], last=True)
        return sender, receiver

    async def scenario() -> None:
        async with open_agents() as a:
            steps = calls(a)
            try:
                steps.send(None)
            except StopIteration as stop:
                sender, receiver = stop.value
            else:
                steps.close()
                pytest.fail("a room call suspended the asyncio task")
            async with asyncio.timeout(10):
                assert await receiver.wait() is KVPoll.Success
                assert await sender.wait() is KVPoll.Success
            assert a.dst.aux_ok(4, 5)

    asyncio.run(scenario())


def test_abort_from_asyncio() -> None:
    """``abort()`` called from asyncio code fails the room on both sides; the decode pages
    come back after the prefill rank's drain ack, and the sender refuses more chunks."""

    async def scenario() -> None:
        async with open_agents() as a:
            released = asyncio.Event()
            sender, receiver = await bound_room(a, 7, released)
            receiver.abort("the client went away")
            async with asyncio.timeout(10):
                with pytest.raises(TransferAborted, match="the client went away"):
                    await receiver.wait()
                await released.wait()
                with pytest.raises(TransferAborted, match="aborted by decode"):
                    await sender.wait()
            with pytest.raises(AdmissionClosed):
                await sender.send(np.arange(2), last=True)
            assert a.dst_pages.outstanding == 0 and a.dst_pages.late_writes == 0
            assert a.decode.statistics().aborted == 1

    asyncio.run(scenario())


def test_an_abort_from_asyncio_is_final_once_it_returns() -> None:
    """The room has succeeded inside trio, unseen on the asyncio side, when the client goes
    away: ``abort()`` decides there and then, although the agent acts on trio's next tick.
    The room reads Failed from that call on, and its pages come back through ``on_release``,
    once. Before, the abort only landed on trio's next tick, ``poll()`` said Success right
    after it and Success stood: ``on_release`` never ran, and a handler that counted on it
    lost the pages."""

    async def scenario() -> None:
        async with open_agents() as a:
            released = asyncio.Event()
            sender, receiver = await bound_room(a, 11, released)
            await sender.send(np.arange(2), last=True)
            async with asyncio.timeout(10):
                await poll_until(lambda: a.decode.statistics().succeeded == 1)  # (unseen)
            receiver.abort("the client went away")
            assert receiver.poll() is KVPoll.Failed
            assert isinstance(receiver.failure, TransferAborted)
            async with asyncio.timeout(10):
                await released.wait()
                with pytest.raises(TransferAborted, match="the client went away"):
                    await receiver.wait()
            assert a.dst_pages.outstanding == 0 and a.dst_pages.late_writes == 0
            assert a.decode.statistics().released_unclaimed == 1

    asyncio.run(scenario())


def test_cancelled_asyncio_task_awaiting_a_room_aborts_it() -> None:
    """A request handler awaiting ``receiver.wait()`` is cancelled: the room is aborted (not
    left open until its deadline), the prefill rank hears of it, and the pages come back
    through the decode's release path (``on_release``, after the drain ack)."""

    async def scenario() -> None:
        async with open_agents() as a:
            released = asyncio.Event()
            sender, receiver = await bound_room(a, 9, released)
            waiting = asyncio.Event()

            async def handle_request() -> KVPoll:
                waiting.set()
                return await receiver.wait()  # (runs to its first suspension in this step)

            handler = asyncio.create_task(handle_request())
            async with asyncio.timeout(10):
                await waiting.wait()
                await a.host.run(trio.lowlevel.checkpoint)  # the trio-side wait has started
                handler.cancel()
                # (bounded without cancelling it again: its wait for trio outlasts that)
                await asyncio.wait({handler}, timeout=5)
                assert handler.cancelled(), "the cancelled wait did not end"
                await released.wait()
                with pytest.raises(TransferAborted, match="aborted by decode"):
                    await sender.wait()
            assert receiver.poll() is KVPoll.Failed
            assert isinstance(receiver.failure, TransferAborted)
            assert "cancelled" in str(receiver.failure)
            assert a.dst_pages.outstanding == 0 and a.dst_pages.late_writes == 0
            d = a.decode.statistics()
            assert d.aborted == 1 and d.rooms_active == 0 and d.pages_held == 0

    asyncio.run(scenario())


def test_trio_side_error_comes_out_of_the_host() -> None:
    """A trio function's exception reaches its ``host.run`` caller as it is; a background
    trio task's ends the host: calls in flight raise RuntimeError, and the host's exit
    raises the ExceptionGroup, as trio.run would."""

    async def twice(x: int) -> int:
        await trio.lowlevel.checkpoint()
        return 2 * x

    async def fails(text: str) -> None:
        await trio.lowlevel.checkpoint()
        raise ValueError(text)

    async def scenario() -> None:
        async with open_trio_host() as host:
            assert await host.run(twice, 21) == 42
            with pytest.raises(ValueError, match="to the caller"):
                await host.run(fails, "to the caller")
            host.start_soon(fails, "in the background")
            async with asyncio.timeout(5):
                with pytest.raises(RuntimeError, match="host is closed"):
                    await host.run(trio.sleep_forever)

    with pytest.raises(ExceptionGroup) as info:
        asyncio.run(scenario())
    assert info.group_contains(ValueError, match="in the background")


def test_cancelling_host_run_cancels_the_trio_task() -> None:
    """``asyncio.timeout`` around ``host.run`` cancels the trio task, and waits for it: its
    cleanup has run by the time TimeoutError comes out."""
    cleaned: list[bool] = []

    async def forever() -> None:
        try:
            await trio.sleep_forever()
        finally:
            cleaned.append(True)

    async def scenario() -> None:
        async with open_trio_host() as host:

            async def bounded() -> None:
                async with asyncio.timeout(0.1):
                    await host.run(forever)

            task = asyncio.create_task(bounded())
            # (bounded without cancelling it again: its wait for trio outlasts that)
            await asyncio.wait({task}, timeout=5)
            assert task.done(), "the cancelled host.run did not return"
            with pytest.raises(TimeoutError):
                task.result()
            assert cleaned == [True]

    asyncio.run(scenario())


def test_asyncio_keeps_its_signal_handlers() -> None:
    """asyncio's ``add_signal_handler`` (servers use it for SIGTERM) takes
    ``signal.set_wakeup_fd``; the host leaves it there: no RuntimeWarning from trio about a
    collision, and asyncio's handler still runs while the host is open and after."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        got: list[asyncio.Event] = []
        loop.add_signal_handler(signal.SIGUSR1, lambda: got[-1].set())
        try:
            async with open_trio_host() as host:
                await host.run(trio.lowlevel.checkpoint)
                for _ in range(2):
                    got.append(asyncio.Event())
                    os.kill(os.getpid(), signal.SIGUSR1)
                    async with asyncio.timeout(5):
                        await got[-1].wait()
            got.append(asyncio.Event())
            os.kill(os.getpid(), signal.SIGUSR1)
            async with asyncio.timeout(5):
                await got[-1].wait()
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)

    asyncio.run(scenario())
