"""Handles and engines as context managers (issue 15, item 2).

``async with prefill.sender(...)`` / ``async with decode.receiver(...)`` abort the room when
the block is left before the room ended, so a request handler that is cancelled or raises
leaves no room open; the pages then go back by the usual rules. ``with make_engine(...)``
closes the engine. Real engines, real ZeroMQ, the real bootstrap service.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from trio_pd import DecodeReceiver, KVPoll, TransferAborted
from trio_pd.engines import make_engine
from trio_pd.engines.fault import FaultEngine

from .helpers.agents import open_pair, poll_until

BOUND = 15.0


async def test_a_cancelled_handler_inside_a_receiver_block_leaves_no_room_open(
    engine_name: str, bootstrap_url: str
) -> None:
    """The decode handler is cancelled while it waits for the KV: the room is aborted on
    the way out, prefill hears of it, and the destination pages go back only after
    prefill's drain ack."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        released: list[int] = []
        sender = pair.prefill.sender(5, num_pages=4, aux_slot=0)  # never sends a chunk

        async def handler(*, task_status: trio.TaskStatus[object]) -> None:
            async with pair.decode.receiver(5, bootstrap_url=bootstrap_url) as receiver:
                receiver.init(
                    np.arange(8, 12), 1,
                    on_release=lambda: released.append(pair.decode.statistics().acks_received),
                )
                task_status.started(receiver)
                await receiver.wait()

        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                receiver = await nursery.start(handler)
                while sender.poll() is not KVPoll.WaitingForInput:  # noqa: ASYNC110
                    await trio.sleep(0.005)  # (prefill has the TRANSFER: decode may be written)
                nursery.cancel_scope.cancel("the client went away")
            assert receiver.poll() is KVPoll.Failed
            assert isinstance(receiver.failure, TransferAborted)
            assert "Cancelled" in str(receiver.failure)
            assert await sender.wait() is KVPoll.Failed  # the ABORT reached prefill
            await receiver.wait_released()
            await sender.wait_released()
        assert released == [1]  # after the drain ack, once
        p, d = pair.prefill.statistics(), pair.decode.statistics()
        assert d.rooms_active == 0 and d.pages_held == 0 and d.aborted == 1
        assert p.rooms_active == 0


@pytest.mark.parametrize("how", ["cancelled", "raises", "returns early"])
async def test_a_sender_block_left_early_aborts_the_room(
    engine_name: str, bootstrap_url: str, how: str
) -> None:
    """The prefill handler has sent half the room when its block is left (cancelled, by an
    exception, or by returning before the room ended): the room is aborted, decode fails
    and drains, and both sides' pages go back once."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        released: list[str] = []
        receiver = pair.decode.receiver(6, bootstrap_url=bootstrap_url)
        receiver.init(np.arange(4), 0, on_release=lambda: released.append("dst"))

        async def handler(*, task_status: trio.TaskStatus[object]) -> None:
            async with pair.prefill.sender(
                6, num_pages=4, aux_slot=0, on_release=lambda: released.append("src")
            ) as sender:
                sender.send(np.arange(2))
                task_status.started(sender)
                if how == "raises":
                    raise ValueError("the handler failed")
                if how == "cancelled":
                    await trio.sleep_forever()

        with trio.fail_after(BOUND):
            try:
                async with trio.open_nursery() as nursery:
                    sender = await nursery.start(handler)
                    if how == "cancelled":
                        nursery.cancel_scope.cancel()
            except* ValueError:
                assert how == "raises"
            assert await sender.wait() is KVPoll.Failed
            assert isinstance(sender.failure, TransferAborted)
            said = {"cancelled": "(Cancelled)", "raises": "(ValueError)"}.get(how, "room ended")
            assert said in str(sender.failure)
            assert await receiver.wait() is KVPoll.Failed
            await receiver.wait_released()
            while len(released) < 2:  # noqa: ASYNC110 - the src release has no event here
                await trio.sleep(0.005)
        assert sorted(released) == ["dst", "src"]
        p, d = pair.prefill.statistics(), pair.decode.statistics()
        assert p.rooms_active == d.rooms_active == 0 and d.pages_held == 0
        assert p.aborted == 1


async def test_a_block_entered_already_cancelled_still_aborts_its_room(
    engine_name: str, bootstrap_url: str
) -> None:
    """Entering the blocks is never what raises Cancelled (the handle would never get to its
    exit): the first checkpoint inside does, and the exits abort both rooms."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        sender = pair.prefill.sender(8, num_pages=2, aux_slot=0)
        receiver = pair.decode.receiver(8, bootstrap_url=bootstrap_url)
        with trio.CancelScope() as scope:
            scope.cancel()
            async with sender, receiver:
                receiver.init(np.arange(2), 0)
                await receiver.wait()
        assert scope.cancelled_caught
        assert sender.poll() is receiver.poll() is KVPoll.Failed
        with trio.fail_after(BOUND):
            await receiver.wait_released()
            await sender.wait_released()


async def test_a_room_that_ended_inside_its_block_is_left_alone(
    engine_name: str, bootstrap_url: str
) -> None:
    """Waiting for the outcome inside the blocks: leaving them aborts nothing."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        pair.src.fill(np.arange(3), 9)
        pair.src.fill_aux(2, 9)
        with trio.fail_after(BOUND):
            async with (
                pair.prefill.sender(9, num_pages=3, aux_slot=2) as sender,
                pair.decode.receiver(9, bootstrap_url=bootstrap_url) as receiver,
            ):
                receiver.init(np.arange(10, 13), 3)
                sender.send(np.arange(3), last=True)
                assert await receiver.wait() is KVPoll.Success
                assert await sender.wait() is KVPoll.Success
        assert receiver.poll() is sender.poll() is KVPoll.Success
        assert pair.verify(9, np.arange(10, 13), 3)
        p, d = pair.prefill.statistics(), pair.decode.statistics()
        assert p.aborted == d.aborted == 0 and p.succeeded == d.succeeded == 1


@pytest.mark.parametrize("where", ["awaiting something else", "in wait()"])
async def test_a_success_the_block_never_saw_comes_back_through_on_release(
    engine_name: str, bootstrap_url: str, where: str
) -> None:
    """The KV arrives while the decode handler is elsewhere (awaiting its client), or just
    as it calls ``wait()``; then it is cancelled (the client went away), and ``wait()``, if
    it got there, raises Cancelled while the room has succeeded. Success was never delivered
    to the block, so leaving it hands the pages back through ``on_release``, once and at
    once (no write can land after Success), and the room reads Failed from then on. Before,
    ``on_release`` never ran and nothing freed the pages."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        pair.src.fill(np.arange(3), 11)
        pair.src.fill_aux(2, 11)
        released: list[int] = []
        sender = pair.prefill.sender(11, num_pages=3, aux_slot=2)
        proceed = trio.Event()

        async def handler(*, task_status: trio.TaskStatus[DecodeReceiver]) -> None:
            async with pair.decode.receiver(11, bootstrap_url=bootstrap_url) as receiver:
                receiver.init(np.arange(10, 13), 3, on_release=lambda: released.append(1))
                task_status.started(receiver)
                with trio.CancelScope(shield=where == "in wait()"):
                    await proceed.wait()  # the handler's client, say
                await receiver.wait()
                raise AssertionError("not reached: the handler was cancelled")

        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                receiver = await nursery.start(handler)
                sender.send(np.arange(3), last=True)
                assert await sender.wait() is KVPoll.Success
                await poll_until(lambda: pair.decode.statistics().succeeded == 1)
                nursery.cancel_scope.cancel("the client went away")
                proceed.set()
        assert released == [1]
        assert receiver.poll() is KVPoll.Failed
        assert isinstance(receiver.failure, TransferAborted)
        assert "before Success was delivered (Cancelled)" in str(receiver.failure)
        assert pair.verify(11, np.arange(10, 13), 3)  # (what came, came whole)
        d = pair.decode.statistics()
        assert d.released_unclaimed == 1 and d.pages_held == d.rooms_active == 0
        receiver.abort()  # idempotent: nothing more
        assert released == [1]


def test_leaving_an_engine_block_closes_the_engine(engine_name: str) -> None:
    with make_engine(engine_name) as engine:
        assert engine.session_id
        assert "closed" not in repr(engine)
    assert "closed" in repr(engine)
    with pytest.raises(ValueError), make_engine(engine_name) as failing:  # errors pass through
        raise ValueError("boom")
    assert "closed" in repr(failing)
    with FaultEngine(make_engine(engine_name)) as wrapped:
        pass
    assert "closed" in repr(wrapped.inner)
    engine.close()  # still idempotent
