"""Proof that a writer is gone is made at the target (SPEC §5.6): each engine's fence, and the
decode and prefill agents around it.

A refused connect says that nothing listens where the writer did; it never says that no byte
of it is still on its way. Two ways that was seen to lose pages (late writes after release):
a prefill agent that closes while its engine, which outlives it, still delivers a failed
call's bytes; and a killed process whose kernel delivers what its sockets held once a
partition heals (tests/chaos/test_netns.py). Here: what Mooncake's TCP transport and NIXL do
at the receiving end, measured on the real engines, and the agents' answer to the first way.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import trio

from trio_pd import DecodeConfig, KVPoll, PrefillConfig, open_decode, open_prefill
from trio_pd.core._memory import HOST, Region
from trio_pd.engines import EngineError, Fence, FenceOutcome, make_engine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.engines.mooncake import MooncakeEngine
from trio_pd.testing.pools import DEST_POISON, PageAllocator

from .helpers.agents import host_pool, poll_until
from .helpers.engines import HAVE_NIXL, write_again

BOUND = 15.0

#: Mooncake's TCP transport frames each block as this header (size, destination address,
#: opcode; 24 bytes as the C struct lays it out), then the bytes. Opcode 1 is a WRITE in
#: the protocol's first version (no acknowledgment).
_HEADER = struct.Struct("<QQB7x")
_WRITE = 1


def _refusing_session() -> str:
    """A ``host:port`` where nothing listens (a writer whose engine is gone)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


@contextlib.contextmanager
def mooncake_target(nbytes: int) -> Iterator[tuple[MooncakeEngine, np.ndarray]]:
    engine = make_engine("mooncake")
    assert isinstance(engine, MooncakeEngine)
    buf = np.zeros(nbytes, dtype=np.uint8)
    try:
        engine.register([Region(int(buf.ctypes.data), buf.nbytes, HOST)])
        yield engine, buf
    finally:
        engine.close()


def _send_all(sock: socket.socket, data: bytes) -> OSError | None:
    """Send ``data``; the error the kernel gave instead, if any (a reset: EPIPE/ECONNRESET)."""
    try:
        sock.sendall(data)
        time.sleep(0.2)  # a reset comes back with the next segment
        sock.sendall(b"\0" * 64)
    except OSError as exc:
        return exc
    return None


def test_mooncake_fence_refuses_what_a_gone_writer_still_sends() -> None:
    """A block half written when its writer goes: the second half, sent after the fence
    (as a dead writer's kernel sends what its socket held), meets a reset and lands nowhere.
    Without the fence (before: a refused connect was taken for proof) it lands in full."""
    half = 64 << 10
    with mooncake_target(1 << 20) as (target, buf):
        port = target._data_port
        assert port is not None, "the TCP data port of the engine was not found"
        base = int(buf.ctypes.data)
        with socket.create_connection(("127.0.0.1", port)) as writer:
            writer.sendall(_HEADER.pack(2 * half, base, _WRITE) + b"\x11" * half)
            deadline = time.monotonic() + BOUND
            while int((buf[:half] == 0x11).sum()) < half and time.monotonic() < deadline:
                time.sleep(0.01)  # (the engine's thread copies it in)
            assert int((buf[:half] == 0x11).sum()) == half  # the first half landed

            fence = target.fence_writer(_refusing_session(), ["127.0.0.1"])
            assert fence.outcome is FenceOutcome.PROVEN, fence
            assert fence.connections == 1

            error = _send_all(writer, b"\x22" * half)
            assert error is not None and error.errno in (errno.EPIPE, errno.ECONNRESET), error
            assert int((buf == 0x22).sum()) == 0  # not one byte of the second half landed

        # The engine serves the next connection as before.
        with socket.create_connection(("127.0.0.1", port)) as writer:
            writer.sendall(_HEADER.pack(4096, base + half * 4, _WRITE) + b"\x33" * 4096)
            deadline = time.monotonic() + BOUND
            while int((buf == 0x33).sum()) < 4096 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert int((buf == 0x33).sum()) == 4096


def test_mooncake_fence_proves_nothing_while_the_writer_engine_listens() -> None:
    """The writer's engine still accepts connections (its agent may have closed): what it
    queued could come on a new connection, so no fence is proven and none is made: its
    connections stay up and its next write needs no reconnect."""
    with mooncake_target(1 << 20) as (target, buf), make_engine("mooncake") as writer:
        src = np.full(4096, 5, dtype=np.uint8)
        writer.register([Region(int(src.ctypes.data), src.nbytes, HOST)])
        one = (np.array([src.ctypes.data], np.uint64), np.array([buf.ctypes.data], np.uint64),
               np.array([4096], np.uint64))
        writer.write(target.session_id, *one)
        fence = target.fence_writer(writer.session_id, ["127.0.0.1"])
        assert fence.outcome is FenceOutcome.UNPROVEN, fence
        assert fence.connections == 0 and "still accepts" in fence.detail
        writer.write(target.session_id, *one)  # (raises if its connections were cut)


@pytest.mark.serial
def test_mooncake_fence_costs_other_writers_on_the_host_their_call_in_flight() -> None:
    """What the fence does to another writer on the same host (measured for the docs): its
    connections are cut too, so a call of it in flight fails (outcome unknown), and its next
    call reconnects and lands whole."""
    size, block = 32 << 20, 16 << 10
    with mooncake_target(size) as (target, dst), make_engine("mooncake") as writer:
        src = np.full(size, 7, dtype=np.uint8)
        writer.register([Region(int(src.ctypes.data), src.nbytes, HOST)])
        n = size // block
        offs = np.arange(n, dtype=np.uint64) * np.uint64(block)
        args = (np.uint64(src.ctypes.data) + offs, np.uint64(dst.ctypes.data) + offs,
                np.full(n, block, np.uint64))
        writer.write(target.session_id, args[0][:4], args[1][:4], args[2][:4])  # (connect)
        outcome: list[BaseException | None] = []

        def call() -> None:
            try:
                writer.write(target.session_id, *args)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.005)
        fence = target.fence_writer(_refusing_session(), ["127.0.0.1"])
        thread.join(BOUND)
        assert fence.outcome is FenceOutcome.PROVEN and fence.connections >= 1, fence
        assert len(outcome) == 1
        if outcome[0] is not None:  # (cut in flight, as it nearly always is: -1)
            assert isinstance(outcome[0], EngineError), outcome[0]
        dst[:] = 0
        write_again(writer, target.session_id, *args)
        assert int((dst == 7).sum()) == size


@pytest.mark.skipif(not HAVE_NIXL, reason="nixl-cu12 not installed")
def test_nixl_has_no_fence_at_the_target() -> None:
    """NIXL over UCX writes into our memory whatever we register (cma: the writer's own
    process_vm_writev; tcp: our progress thread): nothing to fence with, so UNPROVEN."""
    with make_engine("nixl") as engine:
        fence = engine.fence_writer("trio-pd-some-writer", ["127.0.0.1"])
        assert fence.outcome is FenceOutcome.UNPROVEN, fence


# -- the agents ------------------------------------------------------------------------------

#: the failed call's bytes land this long after the call gave up (within the quarantine fence)
LATE = 1.5
FENCE = 2.5


async def test_a_prefill_agent_closed_with_its_engine_alive_leaves_no_late_write(
    engine_name: str, bootstrap_url: str
) -> None:
    """A write gives up with an engine error while its bytes are still queued (they land
    ``LATE`` s later); then the prefill agent closes, its engine kept (the application
    keeps it for its next agent). Decode must keep the pages until those bytes are in: the
    closing agent keeps answering until the quarantine's fence ends and acks; decode
    releases on that ack. Every page released is checked by the sanitizer.

    Before, the closed agent's control port refused a connect, decode took that for proof
    that the writer was gone (``released_peer_gone``), released at once, and the queued
    bytes landed in the released pages (Mooncake and NIXL alike)."""
    src, dst = host_pool(), host_pool()
    pages_alloc = PageAllocator(dst.page_rows(), DEST_POISON)
    aux_alloc = PageAllocator(dst.aux_rows(), DEST_POISON)
    inner, de = make_engine(engine_name), make_engine(engine_name)
    fault = FaultEngine(inner, lambda i, _p, _n: Fault("late", delay_s=LATE) if i == 0 else None)
    n = 4
    try:
        async with open_decode(
            engine=de, pool=dst.spec,
            config=DecodeConfig(ack_timeout=0.3, heartbeat_interval=0.2, heartbeat_misses=2),
        ) as decode:
            pages, aux = pages_alloc.alloc_nowait(n), aux_alloc.alloc_nowait(1)
            assert pages is not None and aux is not None

            def release() -> None:
                pages_alloc.free(pages)
                aux_alloc.free(aux)

            async with open_prefill(
                engine=fault, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2,
                config=PrefillConfig(quarantine_fence=FENCE),
            ) as prefill:
                src.fill(np.arange(n), 9)
                src.fill_aux(0, 9)
                sender = prefill.sender(9, num_pages=n, aux_slot=0)
                receiver = decode.receiver(9, bootstrap_url=bootstrap_url)
                receiver.init(pages, int(aux[0]), on_release=release)
                sender.send(np.arange(n), last=True)
                with trio.fail_after(BOUND):
                    assert await sender.wait() is KVPoll.Failed
                    assert await receiver.wait() is KVPoll.Failed
                assert isinstance(sender.failure, EngineError)
            # The prefill agent is closed here; its engine (and this process) lives on.
            assert prefill.statistics().rooms_unacked_at_close == 0
            assert prefill.statistics().acks_sent == 1
            with trio.fail_after(BOUND):
                await receiver.wait_released()
            assert await trio.to_thread.run_sync(fault.wait_late, BOUND)
            await trio.sleep(0.2)  # (a write after release would have landed by now)
            assert fault.statistics().late_blocks > 0
            assert pages_alloc.late_in_free_rows() == 0, "a queued byte landed after release"
            assert aux_alloc.late_in_free_rows() == 0, "the aux row landed after release"
            stats = decode.statistics()
            assert stats.acks_received == 1  # released on the writer's own drain ack
            assert stats.released_peer_gone == 0
    finally:
        fault.close()
        de.close()


async def test_a_writer_that_cannot_be_fenced_keeps_its_pages_held(bootstrap_url: str) -> None:
    """The prefill rank goes without a word (its agent and engine closed) mid-room; decode's
    probe is refused, but its engine has no fence here (``fence_override``: as NIXL, or
    Mooncake over RDMA): the pages stay held, and that is counted (``writers_unfenced``) and
    visible (``pages_held``). (Before: the refused connect released them as "gone".)"""
    src, dst = host_pool(), host_pool()
    de = FaultEngine(make_engine("mooncake"),
                     fence_override=Fence(FenceOutcome.UNPROVEN, "no fence in this test"))
    pe = make_engine("mooncake")
    released: list[str] = []
    try:
        async with open_decode(
            engine=de, pool=dst.spec,
            config=DecodeConfig(ack_timeout=0.3, heartbeat_interval=0.2, heartbeat_misses=2,
                                close_timeout=0.5),
        ) as decode:
            with trio.CancelScope() as scope:
                async with open_prefill(
                    engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2
                ) as prefill:
                    sender = prefill.sender(11, num_pages=4, aux_slot=0)
                    receiver = decode.receiver(11, bootstrap_url=bootstrap_url)
                    receiver.init(np.arange(4), 0, on_release=lambda: released.append("x"))
                    sender.send(np.arange(2))  # one chunk moves; the room waits for more
                    with trio.fail_after(BOUND):
                        await poll_until(lambda: prefill.statistics().engine_calls >= 1)
                    prefill._shutdown_rooms = lambda: None  # type: ignore[method-assign]
                    prefill._say_goodbye = lambda: None  # type: ignore[method-assign]
                    scope.cancel()  # a crash says nothing: no STATUS, no ack
            with trio.fail_after(BOUND):
                assert await receiver.wait() is KVPoll.Failed
                await poll_until(lambda: decode.statistics().writers_unfenced >= 2)
            stats = decode.statistics()
            assert released == [] and stats.pages_held == 4
            assert stats.released_peer_gone == 0 and stats.writers_fenced == 0
            assert de.statistics().fences_overridden >= 2
        assert released == []  # closed unproven: never handed back
        assert decode.statistics().rooms_unproven_at_close == 1
    finally:
        pe.close()
        de.close()


async def test_a_closing_prefill_agent_waits_for_its_quarantines_within_its_bound(
    bootstrap_url: str,
) -> None:
    """A quarantine that cannot end (every probe of the peer hangs: UNKNOWN) holds a closing
    agent for ``close_timeout`` only; the room is then counted ``rooms_unacked_at_close``
    and decode gets no ack for it (its pages stay held)."""

    class Hangs(FaultEngine):
        def probe(self, peer: str) -> bool:
            time.sleep(0.5)
            return False

    src, dst = host_pool(), host_pool()
    inner, de = make_engine("mooncake"), make_engine("mooncake")
    pe = Hangs(inner, lambda i, _p, _n: Fault("fail") if i == 0 else None)
    try:
        async with open_decode(engine=de, pool=dst.spec,
                               config=DecodeConfig(close_timeout=0.5)) as decode:
            async with open_prefill(
                engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2,
                config=PrefillConfig(quarantine_fence=0.2, close_timeout=1.0),
            ) as prefill:
                sender = prefill.sender(12, num_pages=2, aux_slot=0)
                receiver = decode.receiver(12, bootstrap_url=bootstrap_url)
                receiver.init(np.arange(2), 0)
                sender.send(np.arange(2), last=True)
                with trio.fail_after(BOUND):
                    assert await receiver.wait() is KVPoll.Failed
                t0 = trio.current_time()
            took = trio.current_time() - t0
            stats = prefill.statistics()
            assert 0.9 <= took < 5.0, took
            assert stats.rooms_unacked_at_close == 1 and stats.acks_sent == 0
            assert stats.quarantine_unknown >= 1
            assert decode.statistics().pages_held == 2
    finally:
        pe.close()
        de.close()
