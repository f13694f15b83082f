"""Input that used to kill an agent, and closing that used to hang (issue 14, item 1).

Seen on the main of the day: a PING or ABORT whose reply endpoint libzmq cannot connect to
(``"garbage"``, ``"tcp://"``) raised ``ZMQError`` out of the listener, and the PUSH socket made
before the failed connect was never closed, so ``Context.term`` then hung the process; a
REGISTER with a ``decode_tp`` the prefill cannot pair with raised ``ValueError`` out of the
handler; a raw wire fuzz killed prefill within 525 messages.

Here the same input goes, as raw frames from a plain PUSH socket, to live agents on loopback
(real engines, real ZeroMQ, the real bootstrap): each agent must count it, stay alive (a real
request through it afterwards succeeds with verified bytes) and close within a few seconds.
The raw peer of ``tests/helpers/peers.py`` sends them; ``tests/test_bad_input.py``'s cases are
not repeated.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import trio
import zmq

from trio_pd import DecodeAgent, KVPoll, PrefillAgent, ProtocolError, open_decode, open_prefill
from trio_pd.core import _wire
from trio_pd.core._stats import AgentStatistics, Counters
from trio_pd.core._wire import validate_endpoint
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.io._control import ControlPlane
from trio_pd.io._zmq import Socket
from trio_pd.testing.pools import HostKVPool

from .helpers.agents import Pair, host_pool, open_pair, poll_until
from .helpers.peers import (
    as_dict,
    barrier,
    enc,
    fake_decode,
    finish_good_room,
    good_room,
    raw_push,
    register,
    transfer,
)

# Raw, unauthenticated input at the listeners: security off, explicitly (with it on, the
# default, a stranger gets nowhere: tests/test_auth.py)
pytestmark = pytest.mark.usefixtures("insecure")


V = _wire.WIRE_VERSION

#: an agent must be closed within this many seconds, whatever it was sent
CLOSE_BOUND = 8.0

BAD_ENDPOINT_FRAMES: dict[str, list[bytes]] = {
    "ping garbage": [enc({"t": "ping", "v": V, "nonce": 1, "endpoint": "garbage"})],
    "ping tcp://": [enc({"t": "ping", "v": V, "nonce": 2, "endpoint": "tcp://"})],
    "abort tcp://": [enc({"t": "abort", "v": V, "room": 3, "epoch": 3, "endpoint": "tcp://"})],
    "abort garbage": [enc({"t": "abort", "v": V, "room": 4, "epoch": 4, "endpoint": "garbage"})],
    "ping wildcard": [enc({"t": "ping", "v": V, "nonce": 5, "endpoint": "tcp://*:5555"})],
    "abort ipc": [enc({"t": "abort", "v": V, "room": 6, "epoch": 6, "endpoint": "ipc:///x"})],
}


def stats_delta(after: AgentStatistics, before: AgentStatistics, *names: str) -> int:
    return sum(getattr(after, n) - getattr(before, n) for n in names)


def live_sockets(cp: ControlPlane) -> int:
    """zmq sockets of the plane's context still open (pyzmq's own list, as destroy uses)."""
    return sum(1 for s in list(cp._ctx._sockets) if s is not None and not s.closed)


# ------------------------------------------------------------------------ validate_endpoint

GOOD_ENDPOINTS = [
    "tcp://127.0.0.1:1",
    "tcp://10.0.0.2:65535",
    "tcp://0.0.0.0:5000",
    "tcp://[::1]:5555",
    "tcp://[fe80::1%eth0]:7",
    "tcp://[::ffff:10.1.2.3]:9",
]

#: well-formed, but naming a host: configuration may give these (``_names`` resolves them),
#: a control message may not (libzmq would resolve them on its I/O thread)
NAMED_ENDPOINTS = [
    "tcp://localhost:80",
    "tcp://prefill-0.cluster.local:31000",
    "tcp://x:1",
    "tcp://9front:2",
    "tcp://" + ".".join(["a" * 62, "b" * 61, "c" * 61, "d" * 61]) + ":1",  # 256 characters
]

BAD_ENDPOINTS = [
    "",
    "garbage",
    "tcp://",
    "tcp://:5",
    "tcp://127.0.0.1",
    "tcp://127.0.0.1:",
    "tcp://127.0.0.1:*",
    "tcp://*:5",
    "tcp://127.0.0.1:0",
    "tcp://127.0.0.1:65536",
    "tcp://127.0.0.1:05",
    "tcp://127.0.0.1:+5",
    "tcp://127.0.0.1:5 ",
    " tcp://127.0.0.1:5",
    "tcp://127.0.0.1:5\n",
    "tcp://127.0.0.1:\u0665",  # an Arabic-Indic digit
    "TCP://127.0.0.1:5",
    "ipc:///tmp/x",
    "inproc://x",
    "udp://127.0.0.1:5",
    "pgm://eth0;239.1.1.1:5",
    "tcp://eth0;127.0.0.1:5",  # a source address
    "tcp://127.0.0.1:5:6",
    "tcp://[::1:5",
    "tcp://[::1]:",
    "tcp://[zz::1]:5",
    "tcp://[]:5",
    "tcp://[fe80::1%]:5",
    "tcp://[fe80::1%e th0]:5",
    "tcp://::1:5",
    "tcp://1.2.3:5",  # all-numeric last label: not a hostname, not IPv4
    "tcp://256.1.1.1:5",
    "tcp://-a:5",
    "tcp://a-:5",
    "tcp://a..b:5",
    "tcp://a.:5",
    "tcp://a_b:5",
    "tcp://h\u00e9:5",
    "tcp://" + "a" * 64 + ":5",  # a label over 63
    "tcp://" + ".".join(["a" * 63] * 4) + ":1",  # over MAX_ENDPOINT_CHARS
    "tcp://127.0.0.1:5" + "0" * 300,
]


@pytest.mark.parametrize("endpoint", GOOD_ENDPOINTS)
def test_validate_endpoint_accepts(endpoint: str) -> None:
    assert validate_endpoint(endpoint) == endpoint
    ping = _wire.Ping(v=V, nonce=1, endpoint=endpoint)
    assert _wire.decode(_wire.encode(ping))[0] == ping


@pytest.mark.parametrize("endpoint", NAMED_ENDPOINTS)
def test_a_control_message_naming_a_host_is_refused(endpoint: str) -> None:
    """A name is a well-formed endpoint, but no control message may carry one: decode and
    encode refuse it, and so does the control plane's send (counted ``bad_endpoints``, no
    socket made). (Before: it reached libzmq, which resolved it on its I/O thread; with a
    resolver that never answers, one PING naming such a host stalled every peer's control
    traffic: tests/chaos/test_dns.py.)"""
    assert validate_endpoint(endpoint) == endpoint
    ping = {"t": "ping", "v": V, "nonce": 1, "endpoint": endpoint}
    with pytest.raises(ProtocolError, match="names a host"):
        _wire.decode([enc(ping)])
    with pytest.raises(ProtocolError, match="names a host"):
        _wire.encode(_wire.Ping(v=V, nonce=1, endpoint=endpoint))


@pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
def test_validate_endpoint_refuses(endpoint: str) -> None:
    """Refused by the check itself, and as a field of every message that names a reply
    endpoint, by decode (a malformed message) and by encode."""
    with pytest.raises(ProtocolError, match="endpoint"):
        validate_endpoint(endpoint)
    abort = {"t": "abort", "v": V, "room": 1, "epoch": 1, "endpoint": endpoint}
    ping = {"t": "ping", "v": V, "nonce": 1, "endpoint": endpoint}
    t = {**as_dict(transfer(1, 1, "tcp://127.0.0.1:1", 1)), "endpoint": endpoint}
    spec = host_pool().spec
    reg = {
        **as_dict(
            _wire.Register(
                v=V,
                endpoint="tcp://127.0.0.1:1",
                decode_rank=0,
                decode_tp=1,
                engine="mooncake",
                session="s",
                engine_meta=b"",
                pool=_wire.PoolWire.from_spec(spec),
            )
        ),
        "endpoint": endpoint,
    }
    page = np.zeros(1, "<i4").tobytes()
    for frames in ([enc(abort)], [enc(ping)], [enc(t), page], [enc(reg)]):
        with pytest.raises(ProtocolError):
            _wire.decode(frames)
    with pytest.raises(ProtocolError):
        _wire.encode(_wire.Ping(v=V, nonce=1, endpoint=endpoint))


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0"])
async def test_every_endpoint_a_control_plane_reports_is_valid(host: str) -> None:
    cp = ControlPlane(host, Counters())
    try:
        assert validate_endpoint(cp.endpoint) == cp.endpoint
        assert validate_endpoint(cp.heartbeat_endpoint) == cp.heartbeat_endpoint
    finally:
        await cp.aclose(linger=0)


# ------------------------------------------------------------------------ ControlPlane units


async def test_send_nowait_refuses_a_bad_endpoint_and_makes_no_socket() -> None:
    counters = Counters()
    cp = ControlPlane("127.0.0.1", counters)
    try:
        pong = _wire.Pong(v=V, nonce=1, rank=0)
        for bad in ("garbage", "tcp://", "tcp://*:1", "inproc://x", "tcp://stall.invalid:1"):
            with pytest.raises(ProtocolError):
                cp.send_nowait(bad, pong)
        assert counters["bad_endpoints"] == 5
        assert not cp.senders._push
        assert live_sockets(cp) == 2  # the two PULL sockets, nothing else
    finally:
        with trio.fail_after(3):
            await cp.aclose(linger=0)
    assert cp._ctx.closed


async def test_send_nowait_closes_the_socket_when_connect_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Should libzmq refuse an address the check let through, the new socket is closed at
    once: nothing is left open for Context.term to wait on."""

    def refuse(self: Socket, addr: str) -> None:
        raise zmq.ZMQError(zmq.EINVAL)

    counters = Counters()
    cp = ControlPlane("127.0.0.1", counters)
    try:
        monkeypatch.setattr(Socket, "connect", refuse)
        with pytest.raises(ProtocolError, match="cannot connect"):
            cp.send_nowait("tcp://127.0.0.1:9", _wire.Pong(v=V, nonce=1, rank=0))
        monkeypatch.undo()
        assert not cp.senders._push and live_sockets(cp) == 2
        assert counters["bad_endpoints"] == 1
    finally:
        with trio.fail_after(3):
            await cp.aclose(linger=0)
    assert cp._ctx.closed


async def test_aclose_is_bounded_with_messages_queued_for_an_unreachable_peer() -> None:
    """A thousand messages queued for a peer nobody listens at (port 1): they get their linger,
    no more, and the listener's cancellation leaves nothing open."""
    cp = ControlPlane("127.0.0.1", Counters())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cp.serve, lambda _m, _p: None)
        for i in range(1000):
            assert cp.send_nowait("tcp://127.0.0.1:1", _wire.Pong(v=V, nonce=i, rank=0))
        nursery.cancel_scope.cancel()
    start = trio.current_time()
    with trio.fail_after(10):
        await cp.aclose(linger=0.3)
    assert trio.current_time() - start < 0.3 + ControlPlane.TERM_GRACE
    assert cp._ctx.closed and live_sockets(cp) == 0


async def test_aclose_is_bounded_even_with_a_socket_left_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The socket old code left behind after a failed connect, made worse: open, LINGER -1
    (wait for ever), messages queued for an unreachable peer. Context.term alone would never
    return; aclose closes it with LINGER 0 past the deadline, and returns."""
    cp = ControlPlane("127.0.0.1", Counters())
    leaked: zmq.Socket[bytes] = cp._ctx.socket(zmq.PUSH)
    leaked.setsockopt(zmq.LINGER, -1)
    leaked.connect("tcp://127.0.0.1:1")
    for _ in range(10):
        leaked.send(b"never delivered", zmq.DONTWAIT)
    assert cp.send_nowait("tcp://127.0.0.1:1", _wire.Pong(v=V, nonce=1, rank=0))
    start = trio.current_time()
    with trio.fail_after(10), caplog.at_level(logging.WARNING, "trio_pd.control"):
        await cp.aclose(linger=0.2)
    took = trio.current_time() - start
    assert 0.2 + ControlPlane.TERM_GRACE - 0.1 < took < 0.2 + 2 * ControlPlane.TERM_GRACE
    assert leaked.closed and cp._ctx.closed
    assert "left open" in caplog.text
    with trio.fail_after(1):
        await cp.aclose()  # again: nothing to do


async def test_handler_errors_are_contained_counted_and_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whatever a handler raises ends with its message: TransferErrors count as refused,
    anything else as a handler error; one WARNING per kind per interval, then one that says
    how many were not logged."""
    counters = Counters()
    cp = ControlPlane("127.0.0.1", counters)
    done = trio.Event()
    seen: list[int] = []

    def handle(msg: _wire.Message, _pages: Any) -> None:
        assert isinstance(msg, _wire.Pong)
        seen.append(msg.nonce)
        if msg.nonce == 999:
            done.set()
        elif msg.nonce % 3 == 0:
            raise RuntimeError("a bug")
        elif msg.nonce % 3 == 1:
            raise KeyError("another bug")
        else:
            raise ProtocolError("refused")

    async def burst(sock: Socket, nonces: range) -> None:
        nonlocal done
        done = trio.Event()
        for n in [*nonces, 999]:
            await sock.send_multipart(_wire.encode(_wire.Pong(v=V, nonce=n, rank=0)))
        with trio.fail_after(10):
            await done.wait()

    try:
        async with trio.open_nursery() as nursery, raw_push(cp.endpoint) as sock:
            nursery.start_soon(cp.serve, handle)
            with caplog.at_level(logging.WARNING, "trio_pd.control"):
                await burst(sock, range(30))
                assert counters["handler_errors"] == 20 and counters["refused_messages"] == 10
                records = [r for r in caplog.records if r.name == "trio_pd.control"]
                assert len(records) == 3  # RuntimeError, KeyError, ProtocolError: once each
                assert any("Pong" in r.getMessage() and "a bug" in r.getMessage() for r in records)
                caplog.clear()
                cp.LOG_INTERVAL = 0.0  # the interval has passed
                await burst(sock, range(3))
                # ten of each kind came in the first burst, one of each was logged
                lines = [r.getMessage() for r in caplog.records if r.name == "trio_pd.control"]
                assert len(lines) == 3
                assert all(line.endswith("(and 9 more like it not logged)") for line in lines)
            nursery.cancel_scope.cancel()
        assert len(seen) == 35
    finally:
        with trio.CancelScope(shield=True), trio.fail_after(5):
            await cp.aclose(linger=0)


# ------------------------------------------------------------------------ live agents


@asynccontextmanager
async def closes_in_time() -> AsyncIterator[AsyncExitStack]:
    """An exit stack for the agents of a test; leaving the block closes them, and that must
    take less than :data:`CLOSE_BOUND` seconds (old code hung there, in Context.term)."""
    async with AsyncExitStack() as stack:
        yield stack
        start = trio.current_time()
    assert trio.current_time() - start < CLOSE_BOUND


async def one_good_room(pair: Pair, room: int) -> None:
    sender, receiver, src = await good_room(pair, pair.url, room)
    await finish_good_room(pair, room, sender, receiver, src)


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_bad_reply_endpoints_are_bad_messages(
    engine_name: str, bootstrap_url: str, side: str
) -> None:
    """PING and ABORT naming endpoints libzmq cannot connect to (the ones that killed prefill)
    are malformed messages on either side: counted, no socket made, the agent serves on and
    closes in time."""
    async with closes_in_time() as stack:
        pair = await stack.enter_async_context(open_pair(engine_name, bootstrap_url))
        agent = pair.prefill if side == "prefill" else pair.decode
        before = agent.statistics()
        sockets_before = live_sockets(agent.control)
        async with raw_push(agent.endpoint) as sock:
            for frames in BAD_ENDPOINT_FRAMES.values():
                await sock.send_multipart(frames)
            with trio.fail_after(10):
                await poll_until(
                    lambda: (
                        agent.statistics().bad_messages - before.bad_messages
                        >= len(BAD_ENDPOINT_FRAMES)
                    )
                )
        after = agent.statistics()
        assert after.bad_messages - before.bad_messages == len(BAD_ENDPOINT_FRAMES)
        assert stats_delta(after, before, "refused_messages", "handler_errors") == 0
        assert live_sockets(agent.control) == sockets_before  # no socket for any of them
        await one_good_room(pair, 1)


async def test_unpairable_register_is_contained(engine_name: str, bootstrap_url: str) -> None:
    """A REGISTER whose decode_tp cannot pair with this prefill (TP 1, two KV heads over three
    decode ranks) is that message's error only; real rooms go on."""
    async with closes_in_time() as stack:
        pair = await stack.enter_async_context(open_pair(engine_name, bootstrap_url))
        fake = await stack.enter_async_context(fake_decode())
        p = pair.prefill
        before = p.statistics()
        async with raw_push(p.endpoint) as sock:
            for rank in range(3):
                msg = register(
                    fake.endpoint, pair.prefill_engine, pair.dst.spec, decode_rank=rank, decode_tp=3
                )
                await sock.send_multipart(_wire.encode(msg))
            await barrier(sock, fake)
        after = p.statistics()
        assert stats_delta(after, before, "handler_errors", "refused_messages") == 3
        assert after.bad_messages == before.bad_messages
        await one_good_room(pair, 2)


# ------------------------------------------------------- TRANSFERs a room must not take


@pytest.mark.parametrize("forged_rank", [0, 5], ids=["second", "other-rank"])
async def test_a_forged_transfer_changes_no_room(
    engine_name: str, bootstrap_url: str, forged_rank: int
) -> None:
    """A TRANSFER for a room that already has decode rank 0's: a second one from rank 0 (a
    replay, a bug, a forgery from the decode endpoint), or one that names a rank the endpoint
    did not register as. It used to replace (or join) the room's target: prefill wrote the
    request into pages, an aux row and a state slot decode never gave the room, and both
    sides reported Success. Now it is refused and counted, and the room writes what decode
    asked for, once."""
    from trio_pd.testing.pools import DEST_POISON, StateShape

    shape = StateShape("mamba", (32,))
    src = host_pool(states=(shape,), state_slots=(8,))
    dst = host_pool(states=(shape,), state_slots=(8,))
    for arr in dst.state_arrays[0]:
        arr[...] = DEST_POISON
    async with closes_in_time() as stack:
        pair = await stack.enter_async_context(
            open_pair(engine_name, bootstrap_url, src=src, dst=dst)
        )
        p, room = pair.prefill, 31
        src.fill(np.arange(4), room)
        src.fill_aux(0, room)
        src.fill_state(0, np.array([2]), room)
        sender = p.sender(room, num_pages=4, aux_slot=0)
        receiver = pair.decode.receiver(room, bootstrap_url=bootstrap_url)
        receiver.init(np.arange(10, 14), 1, state_slots=[[1]])
        await poll_until(lambda: sender.poll() is KVPoll.WaitingForInput)
        before = p.statistics()
        forged = transfer(
            room, receiver.epoch, pair.decode.endpoint, 4, decode_rank=forged_rank,
            aux_slot=7, state_slots=((5,),),
        )
        async with raw_push(p.endpoint) as sock:
            await sock.send_multipart(_wire.encode(forged, np.arange(200, 204)))
            await poll_until(lambda: p.statistics().refused_messages > before.refused_messages)
        sender.send(np.arange(4), last=True, state_slots=[[2]])
        with trio.fail_after(10):
            assert await receiver.wait() is KVPoll.Success, receiver.failure
            assert await sender.wait() is KVPoll.Success, sender.failure
        assert (dst.kv[:, 10:14] == src.expected(room, 4)).all()
        assert (dst.kv[:, 200:204] == 0).all()  # never given to the room: untouched
        assert dst.aux_ok(1, room) and not dst.aux_ok(7, room)
        assert dst.bad_state_slots(0, np.array([1]), room) == 0
        assert (dst.state_arrays[0][0][5] == DEST_POISON).all()
        assert stats_delta(p.statistics(), before, "refused_messages") == 1


@pytest.mark.parametrize(
    ("registered", "named"), [(2, 2), (0, 1)], ids=["not-served", "not-its-rank"]
)
async def test_a_transfer_naming_a_rank_this_rank_must_not_write_is_refused(
    engine_name: str, bootstrap_url: str, registered: int, named: int
) -> None:
    """Prefill rank 0 of TP 2 writes to decode ranks 0 and 1 of TP 4. A TRANSFER from a
    decode registered as rank 2 (its REGISTER pairs), or one from rank 0 that names rank 1,
    is refused, not parked as a target rank 0 would write to (with rank 1's heads, in the
    second case, into rank 0's memory); real rooms go on."""
    async with closes_in_time() as stack:
        tp2 = await stack.enter_async_context(open_tp2(engine_name, bootstrap_url))
        fake = await stack.enter_async_context(fake_decode())
        p = tp2.prefills[0]
        # decode rank r of TP 4, two KV heads: it holds head r // 2
        pool = host_pool(heads=1, first_head=registered // 2)
        async with raw_push(p.endpoint) as sock:
            await sock.send_multipart(_wire.encode(register(
                fake.endpoint, tp2.engines[2], pool.spec, decode_rank=registered, decode_tp=4,
            )))
            await barrier(sock, fake)
            assert p.peers.get(fake.endpoint) is not None  # registered: it pairs
            before = p.statistics()
            msg = transfer(77, 1, fake.endpoint, 2, decode_rank=named, required=2)
            await sock.send_multipart(_wire.encode(msg, np.array([1, 2])))
            await barrier(sock, fake)
        assert stats_delta(p.statistics(), before, "refused_messages") == 1
        assert 77 not in p.table.parked
        await tp2.room(bootstrap_url, 4)


# --------------------------------------------------------------- a TP 2 prefill instance


@dataclass
class Tp2:
    """Two prefill ranks (TP 2, one KV head each) and one decode rank that reads both."""

    prefills: list[PrefillAgent]
    decode: DecodeAgent
    srcs: list[HostKVPool]
    dst: HostKVPool
    engines: list[TransferEngine]

    async def room(self, url: str, room: int) -> None:
        src, dst = np.array([5, 6, 7]), np.array([40, 3, 41])
        for pool in self.srcs:
            pool.fill(src, room)
            pool.fill_aux(2, room)
        senders = [p.sender(room, num_pages=3, aux_slot=2) for p in self.prefills]
        receiver = self.decode.receiver(room, bootstrap_url=url)
        receiver.init(dst, 9)
        for s in senders:
            s.send(src, last=True)
        with trio.fail_after(15):
            assert await receiver.wait() is KVPoll.Success, receiver.failure
            for s in senders:
                assert await s.wait() is KVPoll.Success, s.failure
        assert (self.dst.kv[:, dst, :] == self.dst.expected(room, 3)).all()
        assert self.dst.aux_ok(9, room)


@asynccontextmanager
async def open_tp2(engine_name: str, url: str) -> AsyncIterator[Tp2]:
    srcs = [host_pool(heads=1, first_head=r) for r in range(2)]
    dst = host_pool(heads=2)
    engines = [make_engine(engine_name) for _ in range(3)]
    try:
        async with AsyncExitStack() as stack:
            prefills = [
                await stack.enter_async_context(
                    open_prefill(
                        engine=engines[r],
                        pool=srcs[r].spec,
                        bootstrap_url=url,
                        tp_rank=r,
                        tp_size=2,
                        kv_heads=2,
                    )
                )
                for r in range(2)
            ]
            decode = await stack.enter_async_context(open_decode(engine=engines[2], pool=dst.spec))
            yield Tp2(prefills, decode, srcs, dst, engines)
    finally:
        for e in engines:
            e.close()


async def test_register_with_unpairable_decode_tp_against_prefill_tp2(
    engine_name: str, bootstrap_url: str
) -> None:
    """decode_tp 3 against prefill TP 2 (neither divides the other): it raised ValueError out
    of the handler and killed the rank in milliseconds. Now each rank counts it and serves."""
    async with closes_in_time() as stack:
        tp2 = await stack.enter_async_context(open_tp2(engine_name, bootstrap_url))
        fake = await stack.enter_async_context(fake_decode())
        befores = [p.statistics() for p in tp2.prefills]
        for p in tp2.prefills:
            async with raw_push(p.endpoint) as sock:
                msg = register(fake.endpoint, tp2.engines[0], tp2.dst.spec, decode_tp=3)
                await sock.send_multipart(_wire.encode(msg))
                await barrier(sock, fake)
        for p, before in zip(tp2.prefills, befores, strict=True):
            after = p.statistics()
            assert stats_delta(after, before, "handler_errors", "refused_messages") == 1
        await tp2.room(bootstrap_url, 3)


# ------------------------------------------------------------------------ wire fuzz

FUZZ_MESSAGES = 2000
HOSTILE_VALUES: list[Any] = [
    -1,
    0,
    1,
    3,
    2**16,
    2**31,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    1.5,
    None,
    True,
    "",
    "garbage",
    "tcp://",
    "tcp://*:1",
    "tcp://127.0.0.1:0",
    "x" * 5000,
    b"",
    b"\x00" * 300,
    [],
    [1, 2],
    {"t": "ping"},
    [[[[[]]]]],
    "mha",
    "mla",
    "register",
    "transfer",
    "status",
    "abort",
    "abort_ack",
    "ping",
    "pong",
]


def fuzz_frames(rng: random.Random, bases: list[list[bytes]], seq: int) -> list[bytes]:
    """One mutation (or a few) of a valid message: flipped, inserted or dropped bytes, a
    truncated header, a field set to a hostile value or removed, frames dropped, duplicated,
    swapped or added, now and then a frame past the header limit."""
    frames = list(rng.choice(bases))
    for _ in range(rng.randint(1, 3)):
        how = rng.randrange(10)
        if how <= 2:  # flip bytes
            i = rng.randrange(len(frames))
            b = bytearray(frames[i])
            for _ in range(rng.randint(1, 4)):
                if b:
                    b[rng.randrange(len(b))] = rng.randrange(256)
            frames[i] = bytes(b)
        elif how == 3:  # truncate or extend the header
            h = frames[0]
            cut = rng.randrange(len(h)) if h and rng.random() < 0.5 else None
            frames[0] = h[:cut] if cut is not None else h + rng.randbytes(8)
        elif how <= 5:  # a hostile field value, or one field fewer
            try:
                d = _wire_dict(frames[0])
            except ValueError:
                continue
            key = rng.choice(sorted(d))
            if rng.random() < 0.2:
                del d[key]
            elif key == "pool" and isinstance(d[key], dict):
                d[key] = {**d[key], rng.choice(sorted(d[key])): rng.choice(HOSTILE_VALUES)}
            else:
                d[key] = rng.choice(HOSTILE_VALUES)
            frames[0] = enc(d)
        elif how == 6 and len(frames) > 1:  # drop a frame
            del frames[rng.randrange(len(frames))]
        elif how == 7 and len(frames) < 4:  # duplicate a frame
            frames.insert(rng.randrange(len(frames) + 1), rng.choice(frames))
        elif how == 8:  # swap or add a frame
            if len(frames) > 1:
                frames.reverse()
            else:
                frames.append(rng.randbytes(rng.choice([0, 4, 7, 8, 64])))
        elif seq % 100 == 0:  # at most one message in a hundred carries a huge frame
            size = rng.choice([_wire.MAX_HEADER_BYTES + 1, 3 << 20])
            frames[rng.randrange(len(frames))] = b"\x00" * size
    return frames


def _wire_dict(header: bytes) -> dict[str, Any]:
    try:
        d = msgspec.msgpack.decode(header)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise ValueError("not a map of str")
    return d


FUZZ_ROOM = 7_000_000  # far from the rooms of the real requests


def prefill_bases(fake_ep: str, engine: TransferEngine, pool: Any) -> list[list[bytes]]:
    r = FUZZ_ROOM
    pages = np.array([1, 2, 3], dtype=np.int32)
    return [
        _wire.encode(register(fake_ep, engine, pool)),
        _wire.encode(register(fake_ep, engine, pool, decode_tp=3)),
        _wire.encode(transfer(r, 1, fake_ep, 3), pages),
        _wire.encode(transfer(r + 1, 2, fake_ep, 0), np.zeros(0, np.int32)),
        _wire.encode(_wire.Abort(v=V, room=r + 2, epoch=5, endpoint=fake_ep)),
        _wire.encode(_wire.Ping(v=V, nonce=77, endpoint=fake_ep)),
        _wire.encode(_wire.Status(v=V, room=r, epoch=1, rank=0, ok=False, reason="x")),
        _wire.encode(_wire.AbortAck(v=V, room=r, epoch=1, rank=0)),
    ]


def decode_bases(fake_ep: str, engine: TransferEngine, pool: Any) -> list[list[bytes]]:
    """No PONG: every message decode can take is then counted once, exactly (a PONG for an
    unknown nonce is ignored uncounted, and no mutation of these bases can make one)."""
    r = FUZZ_ROOM
    return [
        _wire.encode(_wire.Status(v=V, room=r, epoch=1, rank=0, ok=True)),
        _wire.encode(_wire.Status(v=V, room=r, epoch=1, rank=1, ok=False, reason="no")),
        _wire.encode(_wire.AbortAck(v=V, room=r, epoch=1, rank=0)),
        _wire.encode(_wire.Ping(v=V, nonce=77, endpoint=fake_ep)),
        _wire.encode(_wire.Abort(v=V, room=r, epoch=5, endpoint=fake_ep)),
        _wire.encode(register(fake_ep, engine, pool)),
        _wire.encode(transfer(r, 1, fake_ep, 2), np.array([1, 2], dtype=np.int32)),
    ]


COUNTED = ("bad_messages", "refused_messages", "late_messages", "handler_errors")


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_raw_wire_fuzz_does_not_kill_the_listener(
    engine_name: str, bootstrap_url: str, side: str
) -> None:
    """2,000 seeded mutations of valid messages, half on the agent's main socket and half on
    its heartbeat socket (the fuzz that killed prefill within 525): the agent lives, counts
    them, serves a real request with the right bytes, and closes in time."""
    rng = random.Random(f"issue-14-{side}")
    async with closes_in_time() as stack:
        pair = await stack.enter_async_context(open_pair(engine_name, bootstrap_url))
        fake = await stack.enter_async_context(fake_decode())
        engine = make_engine(engine_name)  # a third engine: the forged REGISTERs' session
        stack.callback(engine.close)
        agent = pair.prefill if side == "prefill" else pair.decode
        make = prefill_bases if side == "prefill" else decode_bases
        bases = make(fake.endpoint, engine, pair.dst.spec)
        before = agent.statistics()
        async with (
            raw_push(agent.endpoint) as main,
            raw_push(agent.control.heartbeat_endpoint) as beat,
        ):
            socks = (main, beat)
            with trio.fail_after(60):
                for seq in range(FUZZ_MESSAGES):
                    await socks[seq % 2].send_multipart(fuzz_frames(rng, bases, seq))
                if side == "prefill":  # each socket's messages are handled in order
                    await barrier(main, fake)
                    await barrier(beat, fake)
                else:  # decode counts every one of these exactly once
                    await poll_until(
                        lambda: stats_delta(agent.statistics(), before, *COUNTED) >= FUZZ_MESSAGES
                    )
        after = agent.statistics()
        bad = after.bad_messages - before.bad_messages
        assert bad > FUZZ_MESSAGES // 2
        if side == "decode":
            assert stats_delta(after, before, *COUNTED) == FUZZ_MESSAGES
        else:
            assert stats_delta(after, before, "refused_messages", "handler_errors") > 0
        assert after.engine_calls == before.engine_calls  # the fuzz wrote nothing
        await one_good_room(pair, 4)


# ------------------------------------------------------- landing fields (trio_pd.core._landing)


def _landing_registers(fake: Any, pair: Pair) -> dict[str, _wire.Register]:
    """REGISTERs from ``fake`` whose landing area makes no sense for decode's pool."""
    spec = pair.dst.spec
    n = spec.num_buffers
    bases = tuple(1 << 40 | b << 30 for b in range(n))

    def reg(**kw: Any) -> _wire.Register:
        return register(fake.endpoint, pair.prefill_engine, spec, **kw)

    return {
        "one base too few": reg(landing_bases=bases[:-1], landing_pages=4),
        "bases, no pages": reg(landing_bases=bases, landing_pages=0),
        "pages, no bases": reg(landing_pages=4),
        "past the 64-bit space": reg(
            landing_bases=(*bases[:-1], (1 << 64) - spec.item_lens[-1]), landing_pages=2
        ),
    }


async def test_a_register_with_a_landing_area_that_makes_no_sense_is_refused(
    engine_name: str, bootstrap_url: str
) -> None:
    """REGISTERs whose landing area has a base too few, bases without pages, pages without
    bases, or a buffer running past the 64-bit address space: each is refused and counted
    (the endpoint is not registered), and real rooms go on."""
    async with closes_in_time() as stack:
        pair = await stack.enter_async_context(open_pair(engine_name, bootstrap_url))
        fake = await stack.enter_async_context(fake_decode())
        p = pair.prefill
        bad = _landing_registers(fake, pair)
        before = p.statistics()
        async with raw_push(p.endpoint) as sock:
            for msg in bad.values():
                await sock.send_multipart(_wire.encode(msg))
            await barrier(sock, fake)
        after = p.statistics()
        # typed refusals (IncompatiblePeer), none an unexpected error of the handler
        assert stats_delta(after, before, "refused_messages") == len(bad)
        assert after.handler_errors == before.handler_errors
        assert after.bad_messages == before.bad_messages
        assert p.peers.get(fake.endpoint) is None
        await one_good_room(pair, 2)


async def test_landing_transfers_a_registration_does_not_allow_are_refused(
    engine_name: str, bootstrap_url: str
) -> None:
    """TRANSFERs naming landing pages: from a peer that advertised no landing area, or
    with landing page ids out of its area's range or repeated, are refused and counted,
    never parked (prefill would write them into memory decode never advertised, or twice
    into one landing page); one naming a run of its area is taken. Real rooms go on."""
    spec_pages = 4
    async with closes_in_time() as stack:
        pair = await stack.enter_async_context(open_pair(engine_name, bootstrap_url))
        plain = await stack.enter_async_context(fake_decode())
        landed = await stack.enter_async_context(fake_decode())
        p, spec = pair.prefill, pair.dst.spec
        bases = tuple(1 << 40 | b << 30 for b in range(spec.num_buffers))
        async with raw_push(p.endpoint) as sock:
            await sock.send_multipart(_wire.encode(register(
                plain.endpoint, pair.prefill_engine, spec)))
            await sock.send_multipart(_wire.encode(register(
                landed.endpoint, pair.prefill_engine, spec, landing_bases=bases,
                landing_pages=spec_pages,
            )))
            await barrier(sock, plain)
            await barrier(sock, landed)
            peer = p.peers.get(landed.endpoint)
            assert p.peers.get(plain.endpoint) is not None and peer is not None
            assert peer.landing is not None and peer.landing.num_pages == spec_pages
            before = p.statistics()
            bad = [
                (plain, np.array([0, 1])),  # no landing area
                (landed, np.array([2, spec_pages])),  # past the area
                (landed, np.array([1, 1])),  # one landing page twice
            ]
            for room, (fake, ids) in enumerate(bad, start=90):
                msg = transfer(room, 1, fake.endpoint, len(ids), landing=True)
                await sock.send_multipart(_wire.encode(msg, ids))
            good = transfer(99, 1, landed.endpoint, 3, landing=True)
            await sock.send_multipart(_wire.encode(good, np.array([1, 2, 3])))
            await barrier(sock, landed)
        assert stats_delta(p.statistics(), before, "refused_messages") == len(bad)
        assert not set(range(90, 90 + len(bad))) & set(p.table.parked)
        assert 99 in p.table.parked  # (within the area: taken)
        await one_good_room(pair, 2)
