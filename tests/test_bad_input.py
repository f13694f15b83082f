"""Malformed and hostile control input against live agents (SPEC §6, §8 item 13, I7, I8).

Bad messages go through a raw ZeroMQ PUSH socket connected to ``agent.endpoint``, so they
reach the real listener exactly as a broken or hostile peer would send them. Replies to a
fake decode land on a real :class:`~trio_pd.io._control.ControlPlane` (tests/helpers/peers.py,
with the barrier that orders them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio

from trio_pd import (
    AdmissionClosed,
    BootstrapError,
    EngineError,
    IncompatiblePeer,
    KVPoll,
    ProtocolError,
    TransferAborted,
)
from trio_pd.core import _wire
from trio_pd.engines import TransferEngine, make_engine
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


# ------------------------------------------------------------------------ helpers


def malformed(pool: HostKVPool, engine: TransferEngine) -> dict[str, list[bytes]]:
    """One multipart message per way of being malformed; each must count one bad message."""
    reg = as_dict(register("tcp://127.0.0.1:1", engine, pool.spec))
    reg_header = enc(reg)
    t = as_dict(transfer(1, 1, "tcp://127.0.0.1:1", 2))
    abort = {"t": "abort", "v": V, "room": 1, "epoch": 1, "endpoint": "tcp://127.0.0.1:1"}

    def reg_with(**pool_kw: Any) -> list[bytes]:
        return [enc({**reg, "pool": {**reg["pool"], **pool_kw}})]

    return {
        "garbage": [b"\xc1\xc1 not msgpack at all"],
        "empty frame": [b""],
        "no frames of substance": [b"\x00"],
        "truncated msgpack": [reg_header[: len(reg_header) // 2]],
        "wrong version": [enc({"t": "ping", "v": V + 1, "nonce": 1, "endpoint": "tcp://x:1"})],
        "version zero": [enc({**abort, "v": 0})],
        "unknown tag": [enc({"t": "format_disk", "v": V})],
        "no tag": [enc({k: v for k, v in abort.items() if k != "t"})],
        "missing field": [enc({"t": "abort", "v": V, "room": 1})],
        "extra field": [enc({**abort, "extra": 1})],
        "wrong field type": [enc({**abort, "room": "one"})],
        "negative room": [enc({**abort, "room": -1})],
        "room past int64": [enc({**abort, "epoch": 1 << 63})],
        "endpoint too long": [enc({**abort, "endpoint": "x" * 10_000})],
        "too many frames": [enc(abort), b"", b""],
        "pages on a non-transfer": [enc(abort), b"\x00" * 8],
        "transfer without pages": [enc(t)],
        "transfer short page frame": [enc(t), b"\x00" * 7],
        "transfer negative page": [enc(t), np.array([-1, 0], dtype="<i4").tobytes()],
        "transfer absurd page id": [enc(t), np.array([0, 1 << 30], dtype="<i4").tobytes()],
        "transfer too many pages": [enc({**t, "num_pages": _wire.MAX_TRANSFER_PAGES + 1}), b""],
        "transfer required 0": [enc({**t, "required": 0}), b"\x00" * 8],
        "huge header": [b"\xc4" + b"\x00" * (_wire.MAX_HEADER_BYTES + 16)],
        "huge page frame": [enc(t), b"\x00" * (16 << 20)],
        "deeply nested": [b"\x91" * 100_000 + b"\x00"],
        "register rank >= tp": [enc({**reg, "decode_rank": 4, "decode_tp": 2})],
        "register buffer count": reg_with(buffer_bases=reg["pool"]["buffer_bases"][:1]),
        "register zero pages": reg_with(num_pages=0),
        "register buffer past 2**64": reg_with(buffer_bases=[(1 << 64) - 64] * 4),
        "register aux past 2**64": reg_with(aux_base=(1 << 64) - 8),
        "register absurd sizes": reg_with(page_size=1 << 40, head_bytes=1 << 40,
                                          num_pages=1 << 29),
        "register mla with heads": reg_with(layout="mla", buffer_bases=[4096] * 2, heads=2),
        "register unknown layout": reg_with(layout="gqa"),
        "register huge engine meta": [enc({**reg, "engine_meta": b"\x00" * (2 << 20)})],
    }


# ------------------------------------------------------------------------ malformed input


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_malformed_messages_are_counted_and_harmless(
    engine_name: str, bootstrap_url: str, side: str
) -> None:
    """Every malformed message counts one bad message; the listener lives on; a room that was
    in flight meanwhile succeeds with the right bytes; nothing is refused or written."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        agent = pair.prefill if side == "prefill" else pair.decode
        bad = malformed(pair.dst, pair.prefill_engine)
        sender, receiver, src = await good_room(pair, bootstrap_url, 1)
        before = agent.statistics()
        async with raw_push(agent.endpoint) as sock:
            for frames in bad.values():
                await sock.send_multipart(frames)
            with trio.fail_after(10):
                await poll_until(
                    lambda: agent.statistics().bad_messages - before.bad_messages >= len(bad)
                )
        after = agent.statistics()
        assert after.bad_messages - before.bad_messages == len(bad)
        assert after.refused_messages == before.refused_messages
        assert after.engine_calls == before.engine_calls
        await finish_good_room(pair, 1, sender, receiver, src)
        # the listener still answers after all that: a second room succeeds too
        sender2, receiver2, src2 = await good_room(pair, bootstrap_url, 2)
        await finish_good_room(pair, 2, sender2, receiver2, src2)


# ------------------------------------------------------------------------ refused input: prefill


async def test_prefill_refuses_wellformed_nonsense(engine_name: str, bootstrap_url: str) -> None:
    """Well-formed messages that make no sense here are refused and counted; rooms they name
    fail with a ProtocolError; other rooms are untouched; nothing is written."""
    async with open_pair(engine_name, bootstrap_url) as pair, fake_decode() as fake:
        p = pair.prefill
        decode_ep = pair.decode.endpoint
        sender, receiver, src = await good_room(pair, bootstrap_url, 1)
        with trio.fail_after(10):
            await poll_until(lambda: sender.poll() >= KVPoll.WaitingForInput)
        victims = {room: p.sender(room, num_pages=2, aux_slot=1) for room in (11, 12, 13, 14)}
        before = p.statistics()
        refused: list[tuple[_wire.Message, np.ndarray | None]] = [
            # REGISTER for another engine, another layout
            (register(fake.endpoint, pair.prefill_engine, pair.dst.spec, engine="nosuch"), None),
            (register(fake.endpoint, pair.prefill_engine,
                      host_pool("mla").spec), None),
            # TRANSFER from an endpoint that never registered, for an existing room
            (transfer(11, 5, "tcp://127.0.0.1:9", 2), np.array([1, 2], dtype=np.int32)),
            # TRANSFERs from the registered decode endpoint that its pool cannot take
            (transfer(12, 5, decode_ep, 2), np.array([0, 10_000], dtype=np.int32)),  # range
            (transfer(13, 5, decode_ep, 2), np.array([3, 3], dtype=np.int32)),  # repeated
            (transfer(14, 5, decode_ep, 2, aux_slot=10_000), np.array([1, 2], dtype=np.int32)),
            # messages only decode takes
            (_wire.Status(v=V, room=1, epoch=1, rank=0, ok=False, reason="forged"), None),
            (_wire.AbortAck(v=V, room=1, epoch=1, rank=0), None),
            (_wire.Pong(v=V, nonce=1, rank=0), None),
        ]
        async with raw_push(p.endpoint) as sock:
            for msg, pages in refused:
                await sock.send_multipart(_wire.encode(msg, pages))
            await barrier(sock, fake)
        after = p.statistics()
        assert after.refused_messages - before.refused_messages == len(refused)
        assert after.bad_messages == before.bad_messages
        for room in (12, 13, 14):
            assert victims[room].poll() is KVPoll.Failed
            assert isinstance(victims[room].failure, ProtocolError), victims[room].failure
        assert after.engine_calls == before.engine_calls  # nothing was written for them
        assert not fake.statuses(1)  # nobody but the real decode hears about room 1
        await finish_good_room(pair, 1, sender, receiver, src)


async def test_unregistered_transfer_for_future_room_is_refused_at_once(
    engine_name: str, bootstrap_url: str
) -> None:
    async with open_pair(engine_name, bootstrap_url) as pair, fake_decode() as fake:
        p = pair.prefill
        room = 33
        src, dst = np.array([1, 2]), np.array([7, 8])
        pair.src.fill(src, room)
        pair.src.fill_aux(0, room)
        receiver = pair.decode.receiver(room, bootstrap_url=bootstrap_url)
        receiver.init(dst, 1)  # the legitimate TRANSFER is queued: prefill has no room yet
        with trio.fail_after(10):  # the legitimate TRANSFER is queued
            await poll_until(lambda: room in p.table.parked)
        before = p.statistics()
        async with raw_push(p.endpoint) as sock:
            hostile = transfer(room, 666, "tcp://127.0.0.1:9", 2)
            await sock.send_multipart(_wire.encode(hostile, np.array([1, 2], dtype=np.int32)))
            await barrier(sock, fake)
        assert p.statistics().refused_messages == before.refused_messages + 1
        sender = p.sender(room, num_pages=2, aux_slot=0)  # must not raise
        sender.send(src, last=True)
        with trio.fail_after(10):
            assert await receiver.wait() is KVPoll.Success, receiver.failure
        assert pair.verify(room, dst, 1)


async def test_refused_transfer_is_answered_with_failed_status(
    engine_name: str, bootstrap_url: str
) -> None:
    async with open_pair(engine_name, bootstrap_url) as pair, fake_decode() as fake:
        p = pair.prefill
        engine = make_engine(engine_name)
        try:
            async with raw_push(p.endpoint) as sock:
                await sock.send_multipart(
                    _wire.encode(register(fake.endpoint, engine, pair.dst.spec))
                )
                sender = p.sender(21, num_pages=2, aux_slot=0)
                bad = transfer(21, 5, fake.endpoint, 2)
                await sock.send_multipart(
                    _wire.encode(bad, np.array([0, 99_999], dtype=np.int32))
                )
                await barrier(sock, fake)
            assert sender.poll() is KVPoll.Failed
            statuses = fake.statuses(21)
            assert statuses and not statuses[0].ok and "ProtocolError" in statuses[0].reason
        finally:
            await trio.to_thread.run_sync(engine.close)


async def test_abort_for_unknown_room_is_acked_and_late_transfer_dropped(
    engine_name: str, bootstrap_url: str
) -> None:
    async with open_pair(engine_name, bootstrap_url) as pair, fake_decode() as fake:
        p = pair.prefill
        before = p.statistics()
        async with raw_push(p.endpoint) as sock:
            await sock.send_multipart(
                _wire.encode(_wire.Abort(v=V, room=404, epoch=17, endpoint=fake.endpoint))
            )
            with trio.fail_after(10):
                ack = await fake.next_matching(lambda m: isinstance(m, _wire.AbortAck))
            assert isinstance(ack, _wire.AbortAck)
            assert (ack.room, ack.epoch, ack.rank) == (404, 17, p.tp_rank)
            # the TRANSFER of that (room, epoch), arriving late, is dropped: the room stays
            # unknown and nothing waits for it
            await sock.send_multipart(
                _wire.encode(transfer(404, 17, pair.decode.endpoint, 1),
                             np.array([0], dtype=np.int32))
            )
            await barrier(sock, fake)
        after = p.statistics()
        assert after.late_messages == before.late_messages + 1
        assert after.acks_sent >= before.acks_sent + 2  # ours and the barrier's
        assert 404 not in p.table.parked and after.rooms_active == before.rooms_active


# ------------------------------------------------------------------------ refused input: decode


async def test_decode_refuses_and_ignores_stray_messages(
    engine_name: str, bootstrap_url: str
) -> None:
    """STATUS / ABORT_ACK for unknown rooms or other epochs are late (ignored, counted);
    messages decode does not take, or a STATUS from a rank that is not a source, are refused;
    the live room they name is unaffected and succeeds."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        d = pair.decode
        sender, receiver, src = await good_room(pair, bootstrap_url, 1)
        with trio.fail_after(10):
            await poll_until(lambda: receiver.poll() >= KVPoll.WaitingForInput)
        epoch = receiver.epoch
        late: list[_wire.Message] = [
            _wire.Status(v=V, room=999, epoch=1, rank=0, ok=True),
            _wire.Status(v=V, room=1, epoch=epoch ^ 1, rank=0, ok=False, reason="stale"),
            _wire.AbortAck(v=V, room=999, epoch=1, rank=0),
            _wire.AbortAck(v=V, room=1, epoch=epoch ^ 1, rank=0),
        ]
        refused: list[tuple[_wire.Message, np.ndarray | None]] = [
            (_wire.Status(v=V, room=1, epoch=epoch, rank=5, ok=False, reason="not a source"),
             None),
            (_wire.Ping(v=V, nonce=1, endpoint="tcp://127.0.0.1:9"), None),
            (_wire.Abort(v=V, room=1, epoch=epoch, endpoint="tcp://127.0.0.1:9"), None),
            (transfer(1, epoch, "tcp://127.0.0.1:9", 1), np.array([0], dtype=np.int32)),
            (register("tcp://127.0.0.1:9", pair.prefill_engine, pair.dst.spec), None),
        ]
        before = d.statistics()
        async with raw_push(d.endpoint) as sock:
            for msg in late:
                await sock.send_multipart(_wire.encode(msg))
            for msg, pages in refused:
                await sock.send_multipart(_wire.encode(msg, pages))
            want_refused = before.refused_messages + len(refused)
            want_late = before.late_messages + len(late)
            with trio.fail_after(10):
                await poll_until(
                    lambda: d.statistics().refused_messages >= want_refused
                    and d.statistics().late_messages >= want_late
                )
        after = d.statistics()
        assert after.late_messages - before.late_messages == len(late)
        assert after.refused_messages - before.refused_messages == len(refused)
        assert after.bad_messages == before.bad_messages
        assert receiver.poll() is KVPoll.WaitingForInput  # untouched by any of it
        await finish_good_room(pair, 1, sender, receiver, src)


# ------------------------------------------------------------------------ hostile REGISTER (I8)


@asynccontextmanager
async def real_registration(
    engine_name: str, pool: HostKVPool, real_pages: int
) -> AsyncIterator[TransferEngine]:
    """A real engine that registers only the first ``real_pages`` pages of each buffer of
    ``pool`` (and its aux buffer): the rest is memory that exists but is not registered."""
    spec = dataclasses.replace(pool.spec, num_pages=real_pages)
    engine = make_engine(engine_name)
    try:
        await trio.to_thread.run_sync(engine.register, spec.regions())
        yield engine
        await trio.to_thread.run_sync(engine.unregister, spec.regions())
    finally:
        await trio.to_thread.run_sync(engine.close)


async def test_hostile_register_cannot_make_prefill_write_outside(
    engine_name: str, bootstrap_url: str
) -> None:
    """A decode rank REGISTERs a pool twice the size of what it registered with its engine.
    A TRANSFER into pages it registered works; one into pages it only *claimed* fails the
    room (the engine refuses: nothing lands in the unregistered guard pages); one beyond
    even the claim fails the room with a ProtocolError before any write. Pools whose shape
    does not fit fail their room too, and write nothing (I8)."""
    real, guard = 16, 16
    mem = host_pool(num_pages=real + guard)  # every byte here belongs to this test
    poison = 0xEE
    mem.kv[...] = poison
    async with open_pair(engine_name, bootstrap_url) as pair, fake_decode() as fake, \
            real_registration(engine_name, mem, real) as engine:
        p = pair.prefill
        async with raw_push(p.endpoint) as sock:
            await sock.send_multipart(_wire.encode(register(fake.endpoint, engine, mem.spec)))
            cases = {
                101: np.array([0, 1]),  # registered: lands
                102: np.array([real + 2, real + 3]),  # claimed only: the engine refuses
                103: np.array([real + guard + 1, 0]),  # beyond the claim: refused by prefill
            }
            senders = {}
            for room, dst in cases.items():
                src = np.array([40, 41])
                pair.src.fill(src, room)
                pair.src.fill_aux(2, room)
                senders[room] = p.sender(room, num_pages=2, aux_slot=2)
                await sock.send_multipart(
                    _wire.encode(transfer(room, 5, fake.endpoint, 2, aux_slot=3),
                                 dst.astype(np.int32))
                )
                await barrier(sock, fake)
                if room == 103:  # refused on arrival: the room is closed before any chunk
                    assert senders[room].poll() is KVPoll.Failed
                    with pytest.raises(AdmissionClosed):
                        senders[room].send(src, last=True)
                else:
                    senders[room].send(src, last=True)
                with trio.fail_after(15):
                    await senders[room].wait()
            assert senders[101].poll() is KVPoll.Success, senders[101].failure
            assert (mem.kv[:, [0, 1], :] == pair.src.expected(101, 2)).all()
            assert senders[102].poll() is KVPoll.Failed
            assert isinstance(senders[102].failure, (EngineError, ProtocolError))
            assert senders[103].poll() is KVPoll.Failed
            assert isinstance(senders[103].failure, ProtocolError), senders[103].failure
            # I8: not one byte landed in the memory that was never registered
            assert (mem.kv[:, real:, :] == poison).all()
            assert (mem.kv[:, 2:real, :] == poison).all()
            with trio.fail_after(10):
                status = await fake.next_matching(
                    lambda m: isinstance(m, _wire.Status) and m.room == 102
                )
            assert isinstance(status, _wire.Status) and not status.ok and status.reason


async def _room_after_register(
    pair: Pair, fake: Any, engine: TransferEngine, pool: Any, room: int
) -> Any:
    """The fake decode REGISTERs ``pool`` with ``engine``'s session, then names two of its
    pages for a new room of two pages in a TRANSFER; returns the room's sender, once the
    REGISTER and the TRANSFER were handled (the room Failed)."""
    async with raw_push(pair.prefill.endpoint) as sock:
        await sock.send_multipart(_wire.encode(register(fake.endpoint, engine, pool)))
        pair.src.fill(np.array([1, 2]), room)
        sender = pair.prefill.sender(room, num_pages=2, aux_slot=0)
        await sock.send_multipart(
            _wire.encode(transfer(room, 5, fake.endpoint, 2), np.array([30, 31], np.int32))
        )
        await barrier(sock, fake)
        assert sender.poll() is KVPoll.Failed
    return sender


async def test_register_with_mismatched_pool_shape_fails_rooms_without_writing(
    engine_name: str, bootstrap_url: str
) -> None:
    """A REGISTER whose pool claims fewer heads per token (or other page sizes) than this
    topology gives it is refused at REGISTER; the room its TRANSFER names fails with the
    reason (IncompatiblePeer), and nothing is written."""
    mem = host_pool(num_pages=32, heads=1)  # prefill (kv_heads=2, TP 1) writes 2 heads
    mem.kv[...] = 0xEE
    async with open_pair(engine_name, bootstrap_url) as pair, fake_decode() as fake, \
            real_registration(engine_name, mem, 32) as engine:
        p = pair.prefill
        sender = await _room_after_register(pair, fake, engine, mem.spec, 201)
        # the REGISTER was refused up front; the room its TRANSFER names fails with why
        with pytest.raises(AdmissionClosed):
            sender.send(np.array([1, 2]), last=True)
        assert isinstance(sender.failure, IncompatiblePeer), sender.failure
        assert "head" in str(sender.failure)
        assert not isinstance(sender.failure, TransferAborted)
        assert (mem.kv == 0xEE).all()
        assert p.statistics().engine_calls == 0




async def test_register_with_other_bytes_per_head_per_buffer_is_refused(
    engine_name: str, bootstrap_url: str
) -> None:
    """A decode pool whose V buffers have other bytes per head than prefill's (per-buffer
    geometry: K != V on one side only) is refused at REGISTER, naming the head bytes; the
    room fails and nothing is written."""
    mem = host_pool(num_pages=32, buffer_head_bytes=(16, 16, 8, 8))
    for buf in mem.buffers:
        buf[...] = 0xEE
    async with open_pair(engine_name, bootstrap_url) as pair, fake_decode() as fake, \
            real_registration(engine_name, mem, 32) as engine:
        p = pair.prefill
        sender = await _room_after_register(pair, fake, engine, mem.spec, 202)
        assert isinstance(sender.failure, IncompatiblePeer), sender.failure
        assert "head bytes" in str(sender.failure) and "(16, 16, 8, 8)" in str(sender.failure)
        assert all((buf == 0xEE).all() for buf in mem.buffers)
        assert p.statistics().engine_calls == 0


async def test_forged_abort_and_stray_transfer_cannot_end_a_waiting_room(
    engine_name: str, bootstrap_url: str
) -> None:
    """A room waiting for its decode metadata (epoch not known yet) gets a forged ABORT with
    a made-up epoch, then a TRANSFER with that epoch from an endpoint that never registered.
    The pair must not close it: the TRANSFER is refused, and the real request succeeds."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        p, room = pair.prefill, 61
        src, dst = np.array([1, 2]), np.array([5, 6])
        pair.src.fill(src, room)
        pair.src.fill_aux(0, room)
        sender = p.sender(room, num_pages=2, aux_slot=0)
        stray = "tcp://127.0.0.1:9"
        p._handle(_wire.Abort(v=V, room=room, epoch=999, endpoint=stray), None)
        with pytest.raises(ProtocolError):
            p._handle(transfer(room, 999, stray, 2), np.array([1, 2], dtype=np.int32))
        assert sender.poll() is KVPoll.Bootstrapping, sender.failure
        receiver = pair.decode.receiver(room, bootstrap_url=bootstrap_url)
        receiver.init(dst, 1)
        sender.send(src, last=True)
        with trio.fail_after(10):
            assert await receiver.wait() is KVPoll.Success, receiver.failure
        assert pair.verify(room, dst, 1)


# ------------------------------------------------- a caller's arguments: integers, or refused

NOT_PAGE_IDS: list[Any] = [
    [4.7, 5.2], [True], ["3"], "ab", None, [2**70], [[0], [1, 2]],
    [True, 2], (3, np.bool_(False)), [[1], [True]],  # (numpy makes these integer arrays)
]


@pytest.mark.parametrize("pages", NOT_PAGE_IDS, ids=repr)
def test_page_ids_that_are_not_integers_are_refused_not_truncated(pages: Any) -> None:
    """Page ids were cast with ``np.array(pages, dtype=np.int64)`` first, so [4.7, 5.2]
    became pages 4 and 5 (and the room succeeded, with other pages than the caller meant);
    None, "ab" and 2**70 raised TypeError, ValueError, OverflowError."""
    from trio_pd.core._memory import page_ids

    with pytest.raises(ProtocolError, match="page ids"):
        page_ids(pages)


def test_indices_are_integers_or_refused() -> None:
    from trio_pd.core._memory import as_index, page_ids

    assert page_ids(np.array([[1, 2], [3, 4]], dtype=np.uint16)).tolist() == [1, 2, 3, 4]
    assert page_ids([]).dtype == np.int64  # (an empty list is float64 to numpy)
    assert as_index(np.int32(3), "aux slot") == 3
    for bad in (0.5, True, np.bool_(False), "2", None):
        with pytest.raises(ProtocolError, match="aux slot must be an int"):
            as_index(bad, "aux slot")


async def test_every_api_refuses_float_pages_and_slots(bootstrap_url: str) -> None:
    """The trio API and the thread facade each refuse float page ids and aux slots with
    ProtocolError, and nothing is created or sent (the SGLang adapter's calls go through
    the same checks)."""
    from trio_pd import sync

    async with open_pair("mooncake", bootstrap_url) as pair:
        sender = pair.prefill.sender(1, num_pages=2, aux_slot=0)
        with pytest.raises(ProtocolError, match="page ids"):
            sender.send([4.7, 5.2], last=True)
        with pytest.raises(ProtocolError, match="aux slot"):
            pair.prefill.sender(2, num_pages=2, aux_slot=0.5)  # type: ignore[arg-type]
        with pytest.raises(ProtocolError, match="room must be an int"):
            pair.prefill.sender(1.5, num_pages=2, aux_slot=0)  # type: ignore[arg-type]
        receiver = pair.decode.receiver(1, bootstrap_url=bootstrap_url)
        with pytest.raises(ProtocolError, match="page ids"):
            receiver.init([4.7, 5.2], 0)
        with pytest.raises(ProtocolError, match="aux slot"):
            receiver.init([4, 5], True)  # type: ignore[arg-type]
        receiver.init([4, 5], 0)  # the refusals left the handle as it was
        sender.abort()
        receiver.abort()
        assert pair.prefill.statistics().engine_calls == 0

    def facade() -> None:
        with make_engine("mooncake") as de, sync.open_decode(
            engine=de, pool=host_pool().spec
        ) as decode:
            rx = decode.receiver(3, bootstrap_url="http://127.0.0.1:9")
            with pytest.raises(ProtocolError, match="page ids"):
                rx.init([4.7, 5.2], 0)
            with pytest.raises(ProtocolError, match="aux slot"):
                rx.init([4, 5], 0.5)  # type: ignore[arg-type]
            rx.init([4, 5], 0)  # not "init called twice"
            rx.abort()

    await trio.to_thread.run_sync(facade)


# the intake of page ids at each API (send, init) and off the wire (a TRANSFER at prefill)
# is one check, pool_page_ids: the quick path must refuse exactly what the full one does
POOL_PAGE_INPUTS: list[Any] = [
    [0, 1, 2], [2, 1, 0], np.array([5, 7], dtype=np.int32), np.array([3], dtype=np.uint64),
    np.arange(100), np.array([[1, 2], [3, 4]]), [], np.array(7), np.zeros(0, dtype=np.int32),
    [3, 3], [0, 1, 2, 1], [-1, 0], [0, 16], [16], np.arange(17), [*range(15), 15, 3],
    np.array([2**63 + 1], dtype=np.uint64), np.array([1, 1], dtype=np.int8),
    *NOT_PAGE_IDS, [1.0], np.array([True, False]),
]


@pytest.mark.parametrize("pages", POOL_PAGE_INPUTS, ids=repr)
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_one_page_intake_check_refuses_what_the_two_did(pages: Any, dtype: Any) -> None:
    """``pool_page_ids`` (the one intake check of a send's, an init's and a TRANSFER's page
    ids) gives what ``page_ids`` then ``validate_pages`` gave, or the same ProtocolError,
    from its quick path as from the full one; its result is always a copy of ``dtype``."""
    from trio_pd.core._memory import page_ids, pool_page_ids, validate_pages

    def old() -> np.ndarray:
        ids = page_ids(pages)
        validate_pages(ids, 16)
        return ids

    try:
        want = old()
    except ProtocolError as exc:
        with pytest.raises(ProtocolError) as got:
            pool_page_ids(pages, 16, dtype)
        assert str(got.value) == str(exc)
        return
    ids = pool_page_ids(pages, 16, dtype)
    assert ids.dtype == dtype and ids.tolist() == want.tolist()
    if isinstance(pages, np.ndarray):
        assert not np.shares_memory(ids, pages)


async def test_every_api_refuses_page_ids_outside_the_pool_or_repeated(
    bootstrap_url: str,
) -> None:
    """send and init check their page ids once, at the call: outside the pool, negative or
    repeated is a ProtocolError (a send's counted ``sends_refused``), the handle is left as
    it was, and nothing is sent or written."""
    async with open_pair("mooncake", bootstrap_url) as pair:
        n = pair.src.spec.num_pages
        sender = pair.prefill.sender(1, num_pages=2, aux_slot=0)
        receiver = pair.decode.receiver(1, bootstrap_url=bootstrap_url)
        bad = ([n, 1], [-1, 1], [3, 3], np.array([n - 1, n], dtype=np.int32))
        for pages in bad:
            with pytest.raises(ProtocolError, match="page"):
                sender.send(pages, last=True)
            with pytest.raises(ProtocolError, match="page"):
                receiver.init(pages, 0)
        assert pair.prefill.statistics().sends_refused == len(bad)
        sender.send([0, 1], last=True)  # the refusals left both handles as they were
        receiver.init([2, 3], 0)
        with trio.fail_after(10):
            assert await receiver.wait() is KVPoll.Success, receiver.failure


async def test_an_answer_that_breaks_the_resolver_is_contained(
    bootstrap_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever goes wrong while decode makes sense of a bootstrap service's answer (here an
    IndexError, as a lying topology once raised) is that resolution's failure, logged, and
    the failure of the room waiting on it; it used to leave the one task that resolves every
    instance and close the agent with every room on it. The next rooms are served."""
    from trio_pd.agents import _sources

    real = _sources.Sources._source_infos
    broken = [True]

    def once(self: Any, topo: Any) -> Any:
        if broken:
            broken.clear()
            raise IndexError("list index out of range")
        return real(self, topo)

    monkeypatch.setattr(_sources.Sources, "_source_infos", once)
    async with open_pair("mooncake", bootstrap_url) as pair:
        first = pair.decode.receiver(1, bootstrap_url=bootstrap_url)
        with trio.fail_after(10):
            assert await first.wait() is KVPoll.Failed
        assert isinstance(first.failure, BootstrapError), first.failure
        assert "IndexError" in str(first.failure)
        sender, receiver, src = await good_room(pair, bootstrap_url, 2)
        await finish_good_room(pair, 2, sender, receiver, src)
    assert not broken  # the broken answer was met
    assert "IndexError('list index out of range')" in caplog.text
