"""Decode prefix (issue 18, item 4): a decode rank that holds a request's first pages already
(its own prefix cache hit) asks only for the rest; prefill writes only those, and the
status, aux and release rules are unchanged."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import trio

from trio_pd import KVPoll, ProtocolError
from trio_pd.core import _wire as wire
from trio_pd.tools._demo import DemoOptions, check, run_in_process

from .helpers.agents import open_pair

BOUND = 15


async def test_only_the_pages_after_the_prefix_are_written(
    engine_name: str, bootstrap_url: str
) -> None:
    """8 pages, decode holds the first 3: chunk [0, 2) lies in the prefix (nothing to write),
    chunk [2, 5) in part, [5, 8) wholly. Every destination page gets its request page's
    bytes; no other page of decode's pool is touched; prefill writes exactly 5 pages and the
    aux row."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        room, n, prefix = 17, 8, 3
        src = np.arange(40, 40 + n)
        dst = np.array([90, 91, 70, 71, 72])  # for request pages 3..7
        pair.src.fill(src, room)
        pair.src.fill_aux(4, room)
        released = trio.Event()
        sender = pair.prefill.sender(room, num_pages=n, aux_slot=4, on_release=released.set)
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        receiver.init(dst, 6, prefix_pages=prefix)
        sender.send(src[:2])
        sender.send(src[2:5])
        sender.send(src[5:], last=True)
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Success
            assert await sender.wait() is KVPoll.Success
            await released.wait()
        want = pair.src.expected(room, n)[:, prefix:, :]
        assert (pair.dst.kv[:, dst, :] == want).all()
        assert pair.dst.aux_ok(6, room)
        others = np.setdiff1d(np.arange(pair.dst.spec.num_pages), dst)
        assert (pair.dst.kv[:, others, :] == 0).all()
        page_bytes = pair.src.spec.item_len * pair.src.spec.num_buffers
        stats = pair.prefill.statistics()
        assert stats.bytes_written == (n - prefix) * page_bytes + pair.src.spec.aux_item_len


async def test_a_prefix_covering_every_page_sends_only_the_aux_row(
    engine_name: str, bootstrap_url: str
) -> None:
    async with open_pair(engine_name, bootstrap_url) as pair:
        room, n = 18, 4
        src = np.arange(4, 4 + n)
        pair.src.fill(src, room)
        pair.src.fill_aux(1, room)
        sender = pair.prefill.sender(room, num_pages=n, aux_slot=1)
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        receiver.init(np.zeros(0, np.int64), 2, prefix_pages=n)
        sender.send(src, last=True)
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Success
            assert await sender.wait() is KVPoll.Success
        assert pair.dst.aux_ok(2, room)
        assert (pair.dst.kv == 0).all()
        assert pair.prefill.statistics().bytes_written == pair.src.spec.aux_item_len


async def test_a_prefix_that_does_not_add_up_fails_the_room_and_writes_nothing(
    engine_name: str, bootstrap_url: str
) -> None:
    """Prefix pages plus page ids must be the request's pages: 2 + 5 != 8 is refused, the
    room fails on both sides with the reason, nothing is written."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        room = 19
        src = np.arange(8)
        pair.src.fill(src, room)
        sender = pair.prefill.sender(room, num_pages=8, aux_slot=0)
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        receiver.init(np.arange(100, 105), 0, prefix_pages=2)
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Failed
            assert await sender.wait() is KVPoll.Failed
        assert "5 pages after a prefix of 2, prefill has 8" in str(sender.failure)
        assert (pair.dst.kv == 0).all()
        assert pair.prefill.statistics().engine_calls == 0


async def test_init_refuses_a_bad_prefix(engine_name: str, bootstrap_url: str) -> None:
    async with open_pair(engine_name, bootstrap_url) as pair:
        for room, bad in enumerate([-1, 1.0, True, "2", (1 << 30) + 1], start=20):
            receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
            with pytest.raises(ProtocolError, match="prefix_pages"):
                receiver.init(np.arange(2), 0, prefix_pages=bad)  # type: ignore[arg-type]
            receiver.abort()


def test_the_thread_facade_checks_the_prefix_before_the_room_is_inited() -> None:
    """A refused prefix leaves the handle as it was: the same init with a good one (a numpy
    integer, as scheduler code often has) then goes through. It used to mark the room
    inited first, so the retry was refused as a second init."""
    from trio_pd import sync
    from trio_pd.engines import make_engine

    from .helpers.agents import host_pool

    dst = host_pool()
    with make_engine("mooncake") as de, sync.open_decode(engine=de, pool=dst.spec) as decode:
        receiver = decode.receiver(21, bootstrap_url="http://127.0.0.1:9")
        with pytest.raises(ProtocolError, match="prefix_pages"):
            receiver.init(np.arange(2), 0, prefix_pages=-1)
        receiver.init(np.arange(2), 0, prefix_pages=np.int64(1))  # not "init called twice"
        with pytest.raises(ProtocolError, match="init called twice"):
            receiver.init(np.arange(2), 0)
        receiver.abort()


def test_the_wire_carries_the_prefix_only_when_there_is_one() -> None:
    base = dict(v=wire.WIRE_VERSION, room=1, epoch=2, endpoint="tcp://127.0.0.1:5000",
                decode_rank=0, aux_slot=0, required=1, num_pages=2)
    pages = np.array([3, 4], np.int32)
    plain = wire.encode(wire.Transfer(**base), pages)  # type: ignore[arg-type]
    assert b"prefix_pages" not in plain[0]  # the wire as before for a request without one
    with_prefix = wire.encode(wire.Transfer(**base, prefix_pages=5), pages)  # type: ignore[arg-type]
    msg, _ = wire.decode(with_prefix)
    assert isinstance(msg, wire.Transfer) and msg.prefix_pages == 5
    bad = msgspec.msgpack.decode(with_prefix[0])
    bad["prefix_pages"] = -1
    with pytest.raises(ProtocolError):
        wire.decode([msgspec.msgpack.encode(bad), with_prefix[1]])


async def test_the_demo_with_a_prefix_aborts_and_faults_leaves_no_trace() -> None:
    opts = DemoOptions(requests=30, concurrency=6, min_tokens=1, max_tokens=64, page_size=4,
                       chunk_pages=3, layers=1, head_bytes=16, kv_heads=4, decode_tp=2,
                       prefix_tokens=12, abort_rate=0.3, fault_rate=0.2, seed=5,
                       quarantine_fence=1.0)
    assert opts.option_problem() is None
    with trio.fail_after(90):
        summary = await run_in_process(opts)
    assert summary["succeeded"] > 0 and summary["aborted"] > 0, summary
    for key in ("corrupt_pages", "late_writes", "leaked_pages", "hung", "source_uaf_pages"):
        assert summary[key] == 0, (key, summary)
    assert check(opts, summary) == []
    assert DemoOptions(prefix_tokens=5, page_size=4).option_problem() is not None
