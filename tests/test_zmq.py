"""trio_pd.io._zmq: the trio adapter for ZeroMQ sockets, over real sockets (tcp and inproc)."""

from __future__ import annotations

import itertools
import random
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
import zmq

from trio_pd.io._zmq import Socket, open_socket, serve

Ctx = zmq.Context[zmq.Socket[bytes]]

_ids = itertools.count()


def inproc() -> str:
    return f"inproc://test-zmq-{next(_ids)}"


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    # Hangs (and pytest-timeout fails the test) if a test leaked a socket.
    context.term()


@asynccontextmanager
async def tcp_pair(ctx: Ctx, hwm: int) -> AsyncIterator[tuple[Socket, Socket]]:
    """A PULL and a PUSH connected to it over tcp on loopback, both with high-water mark
    ``hwm``: (pull, push)."""
    async with (
        open_socket(ctx, zmq.PULL, rcvhwm=hwm) as pull,
        open_socket(ctx, zmq.PUSH, sndhwm=hwm) as push,
    ):
        push.connect(pull.bind("tcp://127.0.0.1:*"))
        yield pull, push


def fill(sock: Socket, frames: list[bytes], bound: int = 100_000) -> int:
    """send_multipart_nowait until WouldBlock; return how many were accepted."""
    for sent in range(bound):
        try:
            sock.send_multipart_nowait(frames)
        except trio.WouldBlock:
            return sent
    raise AssertionError(f"no back-pressure after {bound} messages")


# --------------------------------------------------------------------------- basics


async def test_bind_resolves_wildcard_and_roundtrip_tcp(ctx: Ctx) -> None:
    with trio.fail_after(10):
        async with open_socket(ctx, zmq.PULL) as pull, open_socket(ctx, zmq.PUSH) as push:
            endpoint = pull.bind("tcp://127.0.0.1:*")
            assert endpoint.startswith("tcp://127.0.0.1:")
            assert not endpoint.endswith("*")
            assert int(endpoint.rsplit(":", 1)[1]) > 0
            push.connect(endpoint)
            await push.send_multipart([b"hello"])
            assert await pull.recv_multipart() == [b"hello"]


async def test_multipart_is_atomic_and_accepts_memoryview(
    ctx: Ctx,
) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB
    buf = bytearray(b"reused buffer")
    msg: list[bytes | memoryview] = [b"head", b"", memoryview(big), memoryview(buf)]
    with trio.fail_after(10):
        async with open_socket(ctx, zmq.PULL) as pull, open_socket(ctx, zmq.PUSH) as push:
            push.connect(pull.bind("tcp://127.0.0.1:*"))
            await push.send_multipart(msg)
            buf[:] = b"X" * len(buf)  # frames were copied: reuse is safe at once
            await push.send_multipart([b"second"])
            assert await pull.recv_multipart() == [b"head", b"", big, b"reused buffer"]
            assert await pull.recv_multipart() == [b"second"]


async def test_empty_message_is_refused(ctx: Ctx) -> None:
    async with open_socket(ctx, zmq.PUSH) as push:
        with pytest.raises(ValueError):
            push.send_multipart_nowait([])
        with pytest.raises(ValueError):
            await push.send_multipart([])


async def test_open_socket_sets_hwm_and_linger(ctx: Ctx) -> None:
    async with open_socket(ctx, zmq.DEALER, sndhwm=3, rcvhwm=7) as s:
        assert s.zsock.get(zmq.SNDHWM) == 3
        assert s.zsock.get(zmq.RCVHWM) == 7
        assert s.zsock.get(zmq.LINGER) == 0
    zs: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    zs.set(zmq.LINGER, 250)
    async with Socket(zs) as s:
        assert s.zsock is zs
        assert zs.get(zmq.LINGER) == 250  # a linger the caller chose is kept
    assert zs.closed


async def test_nowait_never_checkpoints_and_async_always_does(
    ctx: Ctx,
) -> None:
    with trio.fail_after(10):
        async with open_socket(ctx, zmq.PAIR) as a, open_socket(ctx, zmq.PAIR) as b:
            a.connect(b.bind(inproc()))
            with trio.testing.assert_no_checkpoints():
                a.send_multipart_nowait([b"1"])
                assert b.recv_multipart_nowait() == [b"1"]
                with pytest.raises(trio.WouldBlock):
                    b.recv_multipart_nowait()
            # Both succeed without waiting, and still checkpoint.
            with trio.testing.assert_checkpoints():
                await a.send_multipart([b"2"])
            with trio.testing.assert_checkpoints():
                assert await b.recv_multipart() == [b"2"]


# --------------------------------------------------------------------------- back-pressure


async def test_nowait_send_raises_wouldblock_on_hwm_to_unbound_endpoint(
    ctx: Ctx,
) -> None:
    # Nobody binds this endpoint: messages queue up to the HWM, then EAGAIN.
    async with open_socket(ctx, zmq.PUSH, sndhwm=1) as push:
        push.connect(inproc())
        sent = fill(push, [b"x"], bound=100)
        assert 1 <= sent <= 10  # HWMs are approximate


async def test_nowait_send_raises_wouldblock_when_peer_never_reads_tcp(
    ctx: Ctx,
) -> None:
    async with tcp_pair(ctx, 1) as (_pull, push):
        # Kernel buffers absorb a lot over tcp; big frames keep the bound small.
        fill(push, [b"x" * 65536], bound=100_000)


async def test_push_without_peer_blocks_until_peer_appears(
    ctx: Ctx,
) -> None:
    # A PUSH that binds has no pipe until a peer connects: POLLOUT appears only then,
    # announced through the fd.
    with trio.fail_after(10):
        async with open_socket(ctx, zmq.PUSH) as push, open_socket(ctx, zmq.PULL) as pull:
            endpoint = push.bind("tcp://127.0.0.1:*")
            with pytest.raises(trio.WouldBlock):
                push.send_multipart_nowait([b"early"])
            async with trio.open_nursery() as nursery:
                nursery.start_soon(push.send_multipart, [b"waited"])
                await trio.testing.wait_all_tasks_blocked()
                pull.connect(endpoint)
            assert await pull.recv_multipart() == [b"waited"]


# --------------------------------------------------------------------------- cancellation


async def test_cancelled_blocked_send_is_never_transmitted(
    ctx: Ctx,
) -> None:
    with trio.fail_after(20):
        async with (
            open_socket(ctx, zmq.PULL, rcvhwm=1) as pull,
            open_socket(ctx, zmq.PUSH, sndhwm=1) as push,
        ):
            push.connect(pull.bind(inproc()))
            queued = fill(push, [b"filler"])
            assert queued >= 1

            cancelled = False

            async def blocked_send(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
                nonlocal cancelled
                with trio.CancelScope() as cs:
                    task_status.started(cs)
                    await push.send_multipart([b"cancelled"])
                cancelled = cs.cancelled_caught

            async with trio.open_nursery() as nursery:
                scope = await nursery.start(blocked_send)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
            assert cancelled

            # Drain everything; a sentinel queued after the cancel, then another one, come
            # through, and the cancelled message never does.
            received: list[list[bytes]] = []
            async with trio.open_nursery() as nursery:

                async def sender() -> None:
                    await push.send_multipart([b"after"])
                    await push.send_multipart([b"end"])

                nursery.start_soon(sender)
                while not received or received[-1] != [b"end"]:
                    received.append(await pull.recv_multipart())
            assert received == [[b"filler"]] * queued + [[b"after"], [b"end"]]
            with pytest.raises(trio.WouldBlock):
                pull.recv_multipart_nowait()


async def test_cancelled_recv_consumes_nothing(ctx: Ctx) -> None:
    with trio.fail_after(10):
        async with open_socket(ctx, zmq.PAIR) as a, open_socket(ctx, zmq.PAIR) as b:
            a.connect(b.bind(inproc()))
            # Blocked, then cancelled.
            with trio.move_on_after(0.05) as cs:
                await b.recv_multipart()
            assert cs.cancelled_caught
            # Already cancelled while a message is waiting: raises, takes nothing.
            a.send_multipart_nowait([b"kept", b"whole"])
            with trio.CancelScope() as cs:
                cs.cancel()
                await b.recv_multipart()
            assert cs.cancelled_caught
            # Already cancelled send: sends nothing.
            with trio.CancelScope() as cs:
                cs.cancel()
                await a.send_multipart([b"never"])
            assert cs.cancelled_caught
            assert await b.recv_multipart() == [b"kept", b"whole"]
            with pytest.raises(trio.WouldBlock):
                b.recv_multipart_nowait()


@pytest.mark.parametrize("how", ["recv_multipart", "serve"])
async def test_receiving_under_random_cancellation_loses_nothing(ctx: Ctx, how: str) -> None:
    """recv_multipart() and serve() cancelled at random points (and the sender too): each
    message is handed over or left on the socket, never lost, never twice."""
    n = 2000
    rng = random.Random(1234)
    with trio.fail_after(60):
        async with tcp_pair(ctx, 4) as (pull, push):
            got: list[int] = []
            cancels = 0

            async def receive() -> None:
                if how == "serve":
                    await serve(pull, lambda msg: got.append(int(msg[0])), rng.choice([1, 3]))
                else:
                    got.append(int((await pull.recv_multipart())[0]))

            async def receiver() -> None:
                nonlocal cancels
                while len(got) < n:
                    with trio.move_on_after(rng.choice([0, 0, 1e-5, 1e-4, 1e-3])) as cs:
                        await receive()
                    cancels += cs.cancelled_caught

            async def sender() -> None:
                for i in range(n):
                    with trio.move_on_after(rng.choice([0, 1e-5, 1e-3])):
                        await push.send_multipart([b"%d" % i, b"tail"])
                        continue
                    # Cancelled: nothing was queued, so resending keeps order and count.
                    await push.send_multipart([b"%d" % i, b"tail"])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                nursery.start_soon(sender)
            assert got == list(range(n))
            assert cancels > 0


# --------------------------------------------------------------------------- shared sockets


async def test_two_senders_and_two_receivers_share_sockets(ctx: Ctx) -> None:
    """Two tasks send on one PUSH and two tasks receive on one PULL: every message arrives
    exactly once, whole, and in each sender's order; nobody hangs."""
    n = 1500
    with trio.fail_after(60):
        async with tcp_pair(ctx, 8) as (pull, push):
            got: dict[str, list[tuple[bytes, int]]] = {"r1": [], "r2": []}

            async def receiver(name: str) -> None:
                while True:
                    msg = await pull.recv_multipart()
                    if msg == [b"stop"]:
                        return  # each receiver takes exactly one stop, then leaves
                    sender, i, payload = msg
                    assert payload == sender * (int(i) % 100)
                    got[name].append((sender, int(i)))

            async def sender(name: bytes) -> None:
                for i in range(n):
                    await push.send_multipart([name, b"%d" % i, name * (i % 100)])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver, "r1")
                nursery.start_soon(receiver, "r2")
                async with trio.open_nursery() as senders:
                    senders.start_soon(sender, b"a")
                    senders.start_soon(sender, b"b")
                await push.send_multipart([b"stop"])
                await push.send_multipart([b"stop"])
            everything = got["r1"] + got["r2"]
            assert sorted(everything) == sorted((s, i) for s in (b"a", b"b") for i in range(n))
            for received in got.values():
                for s in (b"a", b"b"):
                    mine = [i for sender, i in received if sender == s]
                    assert mine == sorted(mine)


async def test_one_socket_sending_and_receiving_from_two_tasks(
    ctx: Ctx,
) -> None:
    """One task sends and another receives on the same socket, both sides, over tcp with
    small HWMs so that both directions block often. Every message is echoed back."""
    n = 3000
    with trio.fail_after(60):
        async with (
            open_socket(ctx, zmq.DEALER, sndhwm=2, rcvhwm=2) as a,
            open_socket(ctx, zmq.DEALER, sndhwm=2, rcvhwm=2) as b,
        ):
            a.connect(b.bind("tcp://127.0.0.1:*"))
            echoed: list[int] = []
            send_ch, recv_ch = trio.open_memory_channel[list[bytes]](0)

            async def a_sender() -> None:
                for i in range(n):
                    await a.send_multipart([b"%d" % i, b"p" * 1000])

            async def a_receiver() -> None:
                while len(echoed) < n:
                    msg = await a.recv_multipart()
                    assert msg[1] == b"p" * 1000
                    echoed.append(int(msg[0]))

            async def b_receiver() -> None:
                async with send_ch:
                    for _ in range(n):
                        await send_ch.send(await b.recv_multipart())

            async def b_sender() -> None:
                async with recv_ch:
                    async for msg in recv_ch:
                        await b.send_multipart(msg)

            async with trio.open_nursery() as nursery:
                for fn in (a_receiver, b_sender, b_receiver, a_sender):
                    nursery.start_soon(fn)
            assert echoed == list(range(n))


async def test_waiting_receiver_is_woken_when_another_call_drains_the_fd(ctx: Ctx) -> None:
    """The lost wake-up, made deterministic: a task sleeps on the fd in recv; a message
    arrives (inproc signals the mailbox synchronously) and, before the event loop runs, a
    send from another task on the same socket processes the mailbox and drains the fd."""
    with trio.fail_after(10):
        async with open_socket(ctx, zmq.PAIR) as a, open_socket(ctx, zmq.PAIR) as b:
            a.connect(b.bind(inproc()))
            got: list[list[bytes]] = []
            async with trio.open_nursery() as nursery:

                async def receiver() -> None:
                    got.append(await b.recv_multipart())

                nursery.start_soon(receiver)
                await trio.testing.wait_all_tasks_blocked()
                # No checkpoint from here on until the nursery waits.
                a.send_multipart_nowait([b"ping"])
                b.send_multipart_nowait([b"pong"])
            assert got == [[b"ping"]]
            assert await a.recv_multipart() == [b"pong"]


async def test_parked_receiver_takes_over_when_fd_task_leaves(ctx: Ctx) -> None:
    """Two receivers wait; only one sleeps on the fd. It takes a message and leaves (or is
    cancelled): the other, parked, must now watch the fd itself."""
    with trio.fail_after(10):
        async with open_socket(ctx, zmq.PAIR) as a, open_socket(ctx, zmq.PAIR) as b:
            a.connect(b.bind(inproc()))
            got: list[list[bytes]] = []

            async def receiver() -> None:
                got.append(await b.recv_multipart())

            # The first to wait leaves with a message.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                nursery.start_soon(receiver)
                await trio.testing.wait_all_tasks_blocked()
                await a.send_multipart([b"1"])
                await trio.testing.wait_all_tasks_blocked()
                assert got == [[b"1"]]
                await a.send_multipart([b"2"])
            assert got == [[b"1"], [b"2"]]

            # The first to wait (the one on the fd) is cancelled while the other is parked.
            cancel_me = trio.CancelScope()

            async def cancelled_receiver() -> None:
                with cancel_me:
                    await b.recv_multipart()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancelled_receiver)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(receiver)
                await trio.testing.wait_all_tasks_blocked()
                cancel_me.cancel()
                await trio.testing.wait_all_tasks_blocked()
                await a.send_multipart([b"3"])
            assert cancel_me.cancelled_caught
            assert got == [[b"1"], [b"2"], [b"3"]]


async def test_sender_and_receiver_waiting_on_one_socket_both_woken(
    ctx: Ctx,
) -> None:
    """A receive and a send wait on the same socket at once (only one of them can sleep on
    the fd); each is woken by its own event."""
    with trio.fail_after(10):
        async with (
            open_socket(ctx, zmq.PAIR, sndhwm=1, rcvhwm=1) as a,
            open_socket(ctx, zmq.PAIR, sndhwm=1, rcvhwm=1) as b,
        ):
            a.connect(b.bind(inproc()))
            queued = fill(a, [b"fill"])
            results: list[object] = []
            async with trio.open_nursery() as nursery:

                async def a_recv() -> None:
                    results.append(await a.recv_multipart())

                async def a_send() -> None:
                    await a.send_multipart([b"blocked"])
                    results.append("sent")

                nursery.start_soon(a_recv)
                nursery.start_soon(a_send)
                await trio.testing.wait_all_tasks_blocked()
                assert results == []
                # Wake the receiver first: b sends to a.
                b.send_multipart_nowait([b"to-a"])
                await trio.testing.wait_all_tasks_blocked()
                # inproc is synchronous: the receiver has its message, the sender waits.
                assert results == [[b"to-a"]]
                # Now make room for the sender.
                for _ in range(queued):
                    assert await b.recv_multipart() == [b"fill"]
            assert results == [[b"to-a"], "sent"]
            assert await b.recv_multipart() == [b"blocked"]


# --------------------------------------------------------------------------- close


async def test_close_wakes_every_waiting_task(ctx: Ctx) -> None:
    with trio.fail_after(10):
        async with open_socket(ctx, zmq.PAIR, sndhwm=1) as a:
            a.connect(inproc())  # nobody binds: sends fill to the HWM, nothing to receive
            fill(a, [b"fill"], bound=100)
            errors: list[str] = []

            async def expect_closed(name: str) -> None:
                with pytest.raises(trio.ClosedResourceError):
                    if name.startswith("recv"):
                        await a.recv_multipart()
                    else:
                        await a.send_multipart([b"never"])
                errors.append(name)

            async with trio.open_nursery() as nursery:
                # One of them sleeps on the fd, the others park: all must wake.
                for name in ("recv1", "recv2", "send1", "send2"):
                    nursery.start_soon(expect_closed, name)
                await trio.testing.wait_all_tasks_blocked()
                assert errors == []
                a.close()
            assert sorted(errors) == ["recv1", "recv2", "send1", "send2"]
            assert a.closed


async def test_closed_socket_refuses_everything(ctx: Ctx) -> None:
    s = open_socket(ctx, zmq.DEALER)
    await s.aclose()
    s.close()  # idempotent
    await s.aclose()
    assert s.zsock.closed
    with pytest.raises(trio.ClosedResourceError):
        s.send_multipart_nowait([b"x"])
    with pytest.raises(trio.ClosedResourceError):
        await s.send_multipart([b"x"])
    with pytest.raises(trio.ClosedResourceError):
        s.recv_multipart_nowait()
    with pytest.raises(trio.ClosedResourceError):
        await s.recv_multipart()
    with pytest.raises(trio.ClosedResourceError):
        s.bind(inproc())
    with pytest.raises(trio.ClosedResourceError):
        s.connect(inproc())
    with pytest.raises(ValueError):
        Socket(s.zsock)


async def test_aclose_closes_even_when_cancelled(ctx: Ctx) -> None:
    s = open_socket(ctx, zmq.DEALER)
    with trio.CancelScope() as cs:
        cs.cancel()
        await s.aclose()
    assert cs.cancelled_caught
    assert s.closed and s.zsock.closed


# --------------------------------------------------------------------------- serve


async def _serve_until_closed(sock: Socket, got: list[list[bytes]], batch: int = 64) -> None:
    with pytest.raises(trio.ClosedResourceError):
        await serve(sock, got.append, batch)


async def _until(done: Callable[[], bool]) -> None:
    """Wait until ``done()`` (what other tasks append to, polled: no event to wait on)."""
    while not done():  # noqa: ASYNC110 - a condition other tasks' handlers make true
        await trio.sleep(0.001)


async def test_serve_hands_over_every_message_whole_and_in_order(ctx: Ctx) -> None:
    """serve() over tcp, with bursts and pauses: every message once, whole, in order; the
    loop ends with ClosedResourceError when its socket is closed."""
    n = 600
    rng = random.Random(7)
    expected = [[b"%d" % i, b"x" * rng.randrange(0, 300)][: 1 + i % 2] for i in range(n)]
    got: list[list[bytes]] = []
    with trio.fail_after(30):
        async with open_socket(ctx, zmq.PULL) as pull, open_socket(ctx, zmq.PUSH) as push:
            push.connect(pull.bind("tcp://127.0.0.1:*"))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_serve_until_closed, pull, got, 5)
                for frames in expected:
                    await push.send_multipart(frames)
                    if rng.random() < 0.1:
                        await trio.sleep(rng.choice([0, 1e-4, 1e-3]))
                await _until(lambda: len(got) == n)
                pull.close()
    assert got == expected


async def test_serve_sleeping_is_woken_when_another_call_drains_the_fd(ctx: Ctx) -> None:
    """serve()'s lost wake-up, made deterministic: having handled a message, it sleeps on
    the fd (on the EVENTS read that followed that message); a message arrives (inproc signals
    the mailbox synchronously) and, before the event loop runs, a send from another task on
    the same socket processes the mailbox and drains the fd: the send must wake it."""
    got: list[list[bytes]] = []
    with trio.fail_after(10):
        async with open_socket(ctx, zmq.PAIR) as a, open_socket(ctx, zmq.PAIR) as b:
            a.connect(b.bind(inproc()))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_serve_until_closed, b, got)
                a.send_multipart_nowait([b"first"])
                await trio.testing.wait_all_tasks_blocked()
                assert got == [[b"first"]]
                # No checkpoint from here on until the loop below.
                a.send_multipart_nowait([b"ping"])
                b.send_multipart_nowait([b"pong"])
                await _until(lambda: len(got) == 2)
                b.close()
            assert got == [[b"first"], [b"ping"]]
            assert await a.recv_multipart() == [b"pong"]


async def test_serve_shares_its_socket_with_other_receivers(ctx: Ctx) -> None:
    """serve() and two recv_multipart() tasks take from one PULL fed by two senders (only one
    task can sleep on the fd; the others park, and every receive hands readiness on):
    every message arrives exactly once, whole, and nobody hangs."""
    n = 1500
    with trio.fail_after(60):
        async with tcp_pair(ctx, 8) as (pull, push):
            served: list[list[bytes]] = []
            received: list[list[bytes]] = []

            async def receiver() -> None:
                while True:
                    received.append(await pull.recv_multipart())

            async def sender(name: bytes) -> None:
                for i in range(n):
                    await push.send_multipart([name, b"%d" % i, name * (i % 100)])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(_serve_until_closed, pull, served, 3)
                nursery.start_soon(receiver)
                nursery.start_soon(receiver)
                async with trio.open_nursery() as senders:
                    senders.start_soon(sender, b"a")
                    senders.start_soon(sender, b"b")
                await _until(lambda: len(served) + len(received) == 2 * n)
                nursery.cancel_scope.cancel()
            everything = served + received
            assert served and received
            assert sorted((s, int(i)) for s, i, _ in everything) == sorted(
                (s, i) for s in (b"a", b"b") for i in range(n)
            )
            assert all(payload == s * (int(i) % 100) for s, i, payload in everything)


async def test_serve_refuses_a_batch_below_one(ctx: Ctx) -> None:
    async with open_socket(ctx, zmq.PULL) as pull:
        with pytest.raises(ValueError):
            await serve(pull, lambda msg: None, 0)


async def test_serve_ends_at_once_when_its_handler_closes_the_socket(ctx: Ctx) -> None:
    """A handler that closes the socket (after an EVENTS read said more was waiting): serve
    raises ClosedResourceError at once, takes nothing more, and never sleeps on the
    descriptor of a closed socket (before: it went to sleep there)."""
    got: list[list[bytes]] = []
    with trio.fail_after(10):
        async with open_socket(ctx, zmq.PAIR) as a, open_socket(ctx, zmq.PAIR) as b:
            a.connect(b.bind(inproc()))
            for i in range(3):
                a.send_multipart_nowait([b"%d" % i])

            def handle(msg: list[bytes]) -> None:
                got.append(msg)
                if len(got) == 2:
                    b.close()

            with pytest.raises(trio.ClosedResourceError):
                await serve(b, handle, 64)
    assert got == [[b"0"], [b"1"]]
