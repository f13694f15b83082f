"""Core path on real engines, real ZeroMQ and the real bootstrap server (issue: core).

Everything here runs the real agents end to end: a real transfer engine per side (Mooncake and
NIXL), the real bootstrap HTTP service, real ZeroMQ sockets. Waits are bounded with
``trio.fail_after``; nothing sleeps to synchronise (a condition that has no event is polled
under a deadline by :func:`poll_until`).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any, Literal

import numpy as np
import pytest
import trio

from trio_pd import (
    DecodeConfig,
    KVPoll,
    PeerLost,
    PrefillAgent,
    PrefillConfig,
    TransferAborted,
    TransferTimeout,
    open_decode,
    open_prefill,
)
from trio_pd.core import _wire as wire
from trio_pd.core._plan import chunk_ranges
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.testing.pools import HostKVPool
from trio_pd.tools._demo import DemoOptions, RankResult, summarize

from .helpers.agents import Pair, host_pool, open_pair, poll_until


async def test_one_room_bytes_arrive(engine_name: str, bootstrap_url: str) -> None:
    async with open_pair(engine_name, bootstrap_url) as pair:
        src_pages = np.array([3, 4, 5, 9, 10, 20, 21, 22, 23, 40])
        dst_pages = np.array([100, 101, 7, 8, 9, 55, 56, 57, 2, 1])
        pair.src.fill(src_pages, room=77)
        pair.src.fill_aux(5, room=77)
        released: list[str] = []
        sender = pair.prefill.sender(
            77, num_pages=10, aux_slot=5, on_release=lambda: released.append("src")
        )
        receiver = pair.decode.receiver(77, bootstrap_url=bootstrap_url)
        receiver.init(dst_pages, 3)
        sender.send(src_pages[:4])
        sender.send(src_pages[4:], last=True)
        with trio.fail_after(20):
            assert await receiver.wait() is KVPoll.Success
            assert await sender.wait() is KVPoll.Success
            await sender.wait_released()
        assert pair.verify(77, dst_pages, 3)
        assert released == ["src"]
        assert receiver.poll() is KVPoll.Success  # terminal status is cached
        stats = pair.prefill.statistics()
        assert stats.succeeded == 1 and stats.leases_live == 0 and stats.rooms_active == 0


async def test_decode_re_registering_keeps_or_retires_its_lane(
    engine_name: str, insecure: None, bootstrap_url: str
) -> None:
    """A REGISTER again from the same decode endpoint: with the same engine session (a
    reconnect) the peer keeps its lane and rooms already bound to it carry on; with a new one
    (decode restarted) the old lane is closed and a chunk for a room bound to the old engine
    fails the room with PeerLost, never reaching the engine, and its pages go back."""
    async with open_pair(engine_name, bootstrap_url) as pair:

        def register(session: str) -> None:
            pair.prefill._handle(
                wire.Register(
                    v=wire.WIRE_VERSION, endpoint=pair.decode.endpoint, decode_rank=0,
                    decode_tp=1, engine=pair.decode.engine.name, session=session,
                    engine_meta=pair.decode.engine.metadata(),
                    pool=wire.PoolWire.from_spec(pair.decode.pool),
                ),
                None,
            )

        async def bound_room(room: int) -> tuple[Any, Any, list[str]]:
            released: list[str] = []
            sender = pair.prefill.sender(
                room, num_pages=2, aux_slot=room % 4, on_release=lambda: released.append("src")
            )
            receiver = pair.decode.receiver(room, bootstrap_url=bootstrap_url)
            receiver.init(np.array([10 + room, 20 + room]), room % 4)
            with trio.fail_after(20):
                while sender.poll() is not KVPoll.WaitingForInput:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            return sender, receiver, released

        sender, receiver, _ = await bound_room(1)
        session = pair.decode.engine.session_id
        lane = pair.prefill.peers.get(pair.decode.endpoint).lane
        register(session)  # a reconnect: same engine
        assert pair.prefill.peers.get(pair.decode.endpoint).lane is lane
        pair.src.fill(np.array([1, 2]), room=1)
        pair.src.fill_aux(1, room=1)
        sender.send(np.array([1, 2]), last=True)
        with trio.fail_after(20):
            assert await receiver.wait() is KVPoll.Success
        assert pair.verify(1, np.array([11, 21]), 1)

        sender, receiver, released = await bound_room(2)
        calls = pair.prefill.counters.snapshot().engine_calls
        register(session + "-restarted")
        assert pair.prefill.peers.get(pair.decode.endpoint).lane is not lane
        sender.send(np.array([3, 4]), last=True)
        with trio.fail_after(20):
            assert await sender.wait() is KVPoll.Failed
            await sender.wait_released()
        assert isinstance(sender.failure, PeerLost)
        assert released == ["src"]
        assert pair.prefill.counters.snapshot().engine_calls == calls  # nothing was written
        assert not pair.dst.kv[:, [12, 22], :].any()


# ------------------------------------------------------------------------ many rooms at once


async def test_many_concurrent_rooms_random_pages(engine_name: str, bootstrap_url: str) -> None:
    """30 rooms at once, random (scattered, unordered) page ids on both sides, random chunk
    sizes, random creation order of the two handles: every byte of every room arrives."""
    rng = np.random.default_rng(1234)
    n_rooms = 30
    async with open_pair(engine_name, bootstrap_url) as pair:
        sizes = rng.integers(1, 9, n_rooms)  # at most 8 pages each: 240 <= 256 pages
        src_perm = rng.permutation(pair.src.spec.num_pages)
        dst_perm = rng.permutation(pair.dst.spec.num_pages)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        src_aux = rng.permutation(pair.src.spec.aux_slots)[:n_rooms]
        dst_aux = rng.permutation(pair.dst.spec.aux_slots)[:n_rooms]
        rooms = [int(r) for r in rng.choice(1 << 40, n_rooms, replace=False)]
        released: set[int] = set()
        done: list[tuple[int, np.ndarray, int]] = []

        async def one(i: int) -> None:
            room = rooms[i]
            src = src_perm[offsets[i] : offsets[i + 1]]
            dst = dst_perm[offsets[i] : offsets[i + 1]]
            pair.src.fill(src, room)
            pair.src.fill_aux(int(src_aux[i]), room)
            ranges = chunk_ranges(len(src), int(rng.integers(1, 4)))

            def make_sender() -> Any:
                return pair.prefill.sender(
                    room, num_pages=len(src), aux_slot=int(src_aux[i]),
                    on_release=lambda: released.add(room),
                )

            if i % 2:
                receiver = pair.decode.receiver(room, bootstrap_url=bootstrap_url)
                receiver.init(dst, int(dst_aux[i]))
                sender = make_sender()
            else:
                sender = make_sender()
                receiver = pair.decode.receiver(room, bootstrap_url=bootstrap_url)
                receiver.init(dst, int(dst_aux[i]))
            for k, (a, b) in enumerate(ranges):
                await trio.lowlevel.checkpoint()  # let the other rooms interleave
                sender.send(src[a:b], last=k == len(ranges) - 1)
            assert await receiver.wait() is KVPoll.Success, receiver.failure
            assert await sender.wait() is KVPoll.Success, sender.failure
            await sender.wait_released()
            done.append((room, dst, int(dst_aux[i])))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(n_rooms):
                    nursery.start_soon(one, i)

        assert len(done) == n_rooms
        for room, dst, aux in done:
            assert pair.verify(room, dst, aux), f"room {room}: bytes differ"
        assert released == set(rooms)
        p, d = pair.prefill.statistics(), pair.decode.statistics()
        assert p.succeeded == n_rooms and d.succeeded == n_rooms
        assert p.failed == d.failed == 0
        assert p.rooms_active == d.rooms_active == 0
        assert p.leases_live == p.leases_quarantined == 0
        assert p.bad_messages == d.bad_messages == p.refused_messages == d.refused_messages == 0


# ------------------------------------------------------------------------ chunked prefill


async def _chunked_room(
    pair: Pair,
    url: str,
    room: int,
    chunks: list[np.ndarray],
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    aux: tuple[int, int] = (1, 2),
) -> None:
    pair.src.fill(src_pages, room)
    pair.src.fill_aux(aux[0], room)
    sender = pair.prefill.sender(room, num_pages=len(src_pages), aux_slot=aux[0])
    receiver = pair.decode.receiver(room, bootstrap_url=url)
    receiver.init(dst_pages, aux[1])
    for k, chunk in enumerate(chunks):
        sender.send(chunk, last=k == len(chunks) - 1)
    with trio.fail_after(15):
        assert await receiver.wait() is KVPoll.Success, receiver.failure
        assert await sender.wait() is KVPoll.Success, sender.failure
        await sender.wait_released()
    assert pair.verify(room, dst_pages, aux[1]), f"room {room}: bytes differ"


@pytest.mark.parametrize("layout", ["mha", "mla"])
async def test_chunked_prefill_partial_last_page(
    engine_name: str, bootstrap_url: str, layout: str
) -> None:
    """Scenario 11: prompts whose last page is partial, cut into chunks of whole pages; the
    chunk ranges cover [0, num_pages) exactly once; aux rides with the last chunk. MHA and
    MLA layouts (scenario 12)."""
    async with open_pair(engine_name, bootstrap_url, layout=layout) as pair:
        page_size = pair.src.spec.page_size
        room = 500
        for tokens, chunk_pages in [(10, 1), (13, 2), (17, 3), (7, 8), (33, 4)]:
            room += 1
            num_pages = math.ceil(tokens / page_size)
            assert tokens % page_size or tokens == num_pages * page_size
            ranges = chunk_ranges(num_pages, chunk_pages)
            covered = np.concatenate([np.arange(a, b) for a, b in ranges])
            assert (covered == np.arange(num_pages)).all()  # exactly once, in order
            assert all(b - a == chunk_pages for a, b in ranges[:-1])  # whole pages
            src = np.arange(10, 10 + num_pages) * 3 % 97  # scattered, distinct
            dst = np.arange(num_pages)[::-1] + 60  # reversed: no two runs line up
            await _chunked_room(pair, bootstrap_url, room, [src[a:b] for a, b in ranges], src,
                                dst)


@pytest.mark.parametrize("layout", ["mha", "mla"])
async def test_last_chunk_without_pages_carries_aux(
    engine_name: str, bootstrap_url: str, layout: str
) -> None:
    """Scenario 11: a last chunk that carries no pages still carries the aux row, and a room
    with no pages at all is only its aux row."""
    async with open_pair(engine_name, bootstrap_url, layout=layout) as pair:
        src = np.array([7, 8, 9, 30, 31])
        dst = np.array([200, 3, 4, 5, 90])
        empty = np.array([], dtype=np.int64)
        await _chunked_room(pair, bootstrap_url, 601, [src[:2], src[2:], empty], src, dst)
        await _chunked_room(pair, bootstrap_url, 602, [empty], empty, empty, aux=(4, 9))
        # The aux row of the page-less room carries that room's stamp (room, epoch) too.
        assert pair.dst.aux_ok(9, 602)


# ------------------------------------------------------------------------ handle creation order


@pytest.mark.parametrize("order", ["receiver_first", "sender_first"])
async def test_handle_creation_order(engine_name: str, bootstrap_url: str, order: str) -> None:
    """Receiver first: the TRANSFER reaches prefill before its scheduler created the room (it
    is queued). Sender first: chunks are admitted before the metadata arrives (they wait)."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        room = 4242
        src = np.array([1, 2, 3, 50, 51, 52, 53])
        dst = np.array([9, 8, 7, 6, 100, 101, 102])
        pair.src.fill(src, room)
        pair.src.fill_aux(0, room)
        with trio.fail_after(15):
            if order == "receiver_first":
                receiver = pair.decode.receiver(room, bootstrap_url=bootstrap_url)
                receiver.init(dst, 6)
                await poll_until(lambda: room in pair.prefill.table.parked)
                sender = pair.prefill.sender(room, num_pages=len(src), aux_slot=0)
                assert room not in pair.prefill.table.parked  # consumed by the new room
                assert sender.poll() is KVPoll.WaitingForInput
                sender.send(src[:3])
                sender.send(src[3:], last=True)
            else:
                sender = pair.prefill.sender(room, num_pages=len(src), aux_slot=0)
                sender.send(src[:3])
                sender.send(src[3:], last=True)
                assert sender.poll() is KVPoll.Bootstrapping  # no metadata yet: chunks wait
                receiver = pair.decode.receiver(room, bootstrap_url=bootstrap_url)
                receiver.init(dst, 6)
            assert await receiver.wait() is KVPoll.Success, receiver.failure
            assert await sender.wait() is KVPoll.Success, sender.failure
            await sender.wait_released()
        assert pair.verify(room, dst, 6)


async def test_a_transfer_whose_room_prefill_never_makes_fails_decode_at_prefills_deadline(
    engine_name: str, bootstrap_url: str
) -> None:
    """Decode's TRANSFER reaches prefill, whose scheduler never makes the room (in a chaos
    run the two schedulers, each out of pages, took different rooms): the TRANSFER is parked
    and dropped at prefill's bootstrap deadline, and decode is told Failed then, its pages
    given back on the ack, rather than waiting out its own (much longer) deadline. A sender
    made later for that use fails at once (decode's ABORT left a tombstone)."""
    async with open_pair(
        engine_name, bootstrap_url, prefill_config=PrefillConfig(bootstrap_timeout=1.0),
        decode_config=DecodeConfig(waiting_timeout=60.0),
    ) as pair:
        room, epoch = 4343, 77
        with trio.fail_after(15):
            receiver = pair.decode.receiver(room, bootstrap_url=bootstrap_url, epoch=epoch)
            receiver.init(np.array([9, 8, 7]), 6)
            await poll_until(lambda: room in pair.prefill.table.parked)
            assert await receiver.wait() is KVPoll.Failed
            assert "did not create it within 1 s" in str(receiver.failure), receiver.failure
            await receiver.wait_released()
            sender = pair.prefill.sender(room, num_pages=3, aux_slot=0, epoch=epoch)
            assert sender.poll() is KVPoll.Failed, sender.failure


# ------------------------------------------------------------------------ room reuse


async def test_room_aborted_without_leases_is_forgotten_and_reusable(
    engine_name: str, bootstrap_url: str
) -> None:
    """A room aborted before its first chunk (released at once, published later by a worker)
    is forgotten once published, and its id can be used again."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        sender = pair.prefill.sender(5, num_pages=2, aux_slot=0)
        sender.abort("the scheduler gives up before the first chunk")
        with trio.fail_after(5):
            assert await sender.wait() is KVPoll.Failed
            await sender.wait_released()
            await poll_until(lambda: sender._room.machine.published)
        assert pair.prefill.statistics().rooms_active == 0
        # Rooms are reused (a new epoch tells the uses apart): the id works again.
        src, dst = np.array([1, 2]), np.array([3, 4])
        pair.src.fill(src, 5)
        pair.src.fill_aux(0, 5)
        again = pair.prefill.sender(5, num_pages=2, aux_slot=0)
        receiver = pair.decode.receiver(5, bootstrap_url=bootstrap_url)
        receiver.init(dst, 0)
        again.send(src, last=True)
        with trio.fail_after(10):
            assert await receiver.wait() is KVPoll.Success
        assert pair.verify(5, dst, 0)


# ------------------------------------------------------------------------ separate processes


def _worker_cmd(role: str, rank: int, url: str, opts: DemoOptions) -> list[str]:
    return [
        sys.executable, "-m", "trio_pd.cli", "_worker", role, str(rank), url,
        json.dumps(asdict(opts)),
    ]


def _parse_result(stdout: bytes) -> RankResult:
    for line in stdout.decode().splitlines():
        if line.startswith("result "):
            raw = json.loads(line[len("result ") :])
            raw["outcomes"] = {int(k): v for k, v in raw["outcomes"].items()}
            return RankResult(**raw)
    raise AssertionError(f"no result line in {stdout[-2000:]!r}")


@pytest.mark.processes
async def test_prefill_and_decode_in_separate_processes(
    engine_name: str, cluster_token: str, bootstrap_url: str
) -> None:
    """One prefill agent and one decode agent, each in its own OS process, talking through
    this process's bootstrap service: every request succeeds with verified bytes."""
    opts = DemoOptions(requests=20, max_tokens=256, concurrency=8, engine=engine_name)
    results: dict[str, RankResult] = {}

    async def worker(role: str) -> None:
        proc = await trio.run_process(
            _worker_cmd(role, 0, bootstrap_url, opts), capture_stdout=True,
            capture_stderr=True, check=False,
        )
        assert proc.returncode == 0, proc.stderr.decode()[-3000:]
        results[role] = _parse_result(proc.stdout)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker, "prefill")
            nursery.start_soon(worker, "decode")
    decode, prefill = results["decode"], results["prefill"]
    assert decode.outcomes == {i: int(KVPoll.Success) for i in range(opts.requests)}
    assert prefill.outcomes == decode.outcomes
    assert decode.corrupt_pages == prefill.corrupt_pages == 0
    assert decode.late_writes == prefill.late_writes == 0
    assert decode.leaked_pages == prefill.leaked_pages == 0
    assert decode.bytes > 0
    summary = summarize(opts, [prefill, decode], 1.0)
    assert summary["succeeded"] == opts.requests


@pytest.mark.processes
async def test_cli_demo_processes_json(engine_name: str) -> None:
    """`trio-pd demo --processes --json`: bootstrap, prefill and decode as OS processes."""
    cmd = [
        sys.executable, "-m", "trio_pd.cli", "demo", "--processes", "--requests", "20",
        "--max-tokens", "256", "--engine", engine_name, "--json",
    ]
    with trio.fail_after(90):
        proc = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
    summary = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert summary["corrupt_pages"] == 0
    assert summary["bytes"] > 0
    assert summary["succeeded"] == summary["requests"] == 20, summary
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]


# ------------------------------------------------------------------------ deadlines (scenario 10)


@pytest.mark.serial
async def test_waiting_timeout_fails_silent_room_only(
    engine_name: str, bootstrap_url: str
) -> None:
    """A room whose prefill never sends fails at the waiting deadline with a reason; its
    pages come back once prefill acked the drain; a room that succeeded is untouched."""
    config = DecodeConfig(waiting_timeout=1.0)
    async with open_pair(engine_name, bootstrap_url, decode_config=config) as pair:
        src, dst = np.array([1, 2, 3]), np.array([4, 5, 6])
        pair.src.fill(src, 10)
        pair.src.fill_aux(0, 10)
        ok_sender = pair.prefill.sender(10, num_pages=3, aux_slot=0)
        ok = pair.decode.receiver(10, bootstrap_url=bootstrap_url)
        ok.init(dst, 0)
        ok_sender.send(src, last=True)

        silent_sender = pair.prefill.sender(11, num_pages=2, aux_slot=1)  # never sends
        silent = pair.decode.receiver(11, bootstrap_url=bootstrap_url)
        released: list[int] = []
        # The third room has no prefill sender at all: prefill never heard of it.
        unknown = pair.decode.receiver(12, bootstrap_url=bootstrap_url)
        start = trio.current_time()
        silent.init(np.array([20, 21]), 1, on_release=lambda: released.append(11))
        unknown.init(np.array([30]), 2, on_release=lambda: released.append(12))
        with trio.fail_after(10):
            assert await ok.wait() is KVPoll.Success
            assert await silent.wait() is KVPoll.Failed
            assert await unknown.wait() is KVPoll.Failed
            elapsed = trio.current_time() - start
            await silent.wait_released()
            await unknown.wait_released()
            # decode's ABORT fails the prefill side of the silent room as well
            assert await silent_sender.wait() is KVPoll.Failed
        assert 0.9 <= elapsed < 3.0, elapsed
        for r in (silent, unknown):
            # a deadline is not an abort: callers and failures_total{reason} tell them apart
            assert isinstance(r.failure, TransferTimeout), r.failure
            assert not isinstance(r.failure, TransferAborted)
            assert "waiting timeout" in str(r.failure)
        assert sorted(released) == [11, 12]
        assert ok.poll() is KVPoll.Success and ok.failure is None
        assert pair.verify(10, dst, 0)
        stats = pair.decode.statistics()
        assert stats.timeouts >= 2 and stats.succeeded == 1
        assert stats.released_by_timeout == 0  # freed by the drain acks, not by the deadline
        assert stats.pages_held == 0


# ------------------------------------------------------------------------ heartbeat (scenario 14)


@asynccontextmanager
async def _prefill_in_scope(
    engine_name: str, url: str, pool: HostKVPool
) -> AsyncIterator[tuple[PrefillAgent, trio.CancelScope]]:
    """A prefill agent served in a task; cancelling the yielded scope closes the agent (its
    engine is closed in a thread afterwards, so the event loop never blocks on it)."""
    engine: TransferEngine = make_engine(engine_name)
    closed = trio.Event()
    scope = trio.CancelScope()

    async def serve(task_status: trio.TaskStatus[PrefillAgent]) -> None:
        try:
            with scope:
                async with open_prefill(
                    engine=engine, pool=pool.spec, bootstrap_url=url, kv_heads=2
                ) as agent:
                    task_status.started(agent)
                    await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(engine.close)
            closed.set()

    async with trio.open_nursery() as nursery:
        agent = await nursery.start(serve)
        try:
            yield agent, scope
        finally:
            scope.cancel()
            with trio.fail_after(20):
                await closed.wait()


async def test_heartbeat_loss_then_reregistered_prefill_works(
    engine_name: str, bootstrap_url: str
) -> None:
    """Scenario 14: the prefill agent goes away mid-room without a word; decode fails the room
    with PeerLost within heartbeat_interval * misses (plus a tick), the decode agent keeps
    working, and a new prefill agent registering at the same bootstrap serves a new room.

    The failed room's pages come back without a drain ack only under a counted policy:
    Mooncake's probe proves the closed engine gone (released_peer_gone); NIXL cannot prove a
    peer it never loaded gone, so that run uses ``release_policy="timeout"``."""
    policy: Literal["drain", "timeout"] = "drain" if engine_name == "mooncake" else "timeout"
    config = DecodeConfig(
        heartbeat_interval=0.2, heartbeat_misses=3, ack_timeout=1.0, release_policy=policy
    )
    bound = config.heartbeat_interval * (config.heartbeat_misses + 1)
    src_pool, dst_pool = host_pool(), host_pool()
    decode_engine = make_engine(engine_name)
    try:
        async with open_decode(engine=decode_engine, pool=dst_pool.spec, config=config) as dec:
            async with _prefill_in_scope(engine_name, bootstrap_url, src_pool) as (agent, scope):
                src, dst = np.array([1, 2, 3, 4]), np.array([10, 11, 12, 13])
                src_pool.fill(src, 71)
                sender = agent.sender(71, num_pages=4, aux_slot=0)
                receiver = dec.receiver(71, bootstrap_url=bootstrap_url)
                released = trio.Event()
                receiver.init(dst, 0, on_release=released.set)
                sender.send(src[:2])  # the first chunk moves; the room waits for the rest
                with trio.fail_after(10):
                    await poll_until(lambda: agent.statistics().engine_calls >= 1)
                assert receiver.poll() is KVPoll.WaitingForInput
                lost_at = trio.current_time()
                # a crash says nothing: no STATUS, ack or BYE (as a closing agent sends)
                agent._shutdown_rooms = lambda: None  # type: ignore[method-assign]
                agent._say_goodbye = lambda: None  # type: ignore[method-assign]
                scope.cancel()  # the prefill agent closes: no STATUS, no ACK, no PONG
            with trio.fail_after(10):
                assert await receiver.wait() is KVPoll.Failed
                failed_after = trio.current_time() - lost_at
                await released.wait()
            assert isinstance(receiver.failure, PeerLost), receiver.failure
            # + up to ~1 s: closing the dead rank's Mooncake engine holds the GIL that long
            assert failed_after <= bound + 1.5, failed_after
            stats = dec.statistics()
            assert stats.peers_lost >= 1 and stats.pages_held == 0
            if policy == "drain":  # the writer was proven gone: its engine is closed
                assert stats.released_peer_gone == 1 and stats.released_by_timeout == 0
            else:  # proof (a refused control port) may come before the timeout: either frees
                assert stats.released_by_timeout + stats.released_peer_gone == 1

            # A new prefill agent (a new engine session) registers rank 0 again.
            src_pool2 = host_pool()
            async with _prefill_in_scope(engine_name, bootstrap_url, src_pool2) as (agent2, _):
                src2, dst2 = np.array([5, 6, 7]), np.array([40, 41, 42])
                src_pool2.fill(src2, 72)
                src_pool2.fill_aux(3, 72)
                sender2 = agent2.sender(72, num_pages=3, aux_slot=3)
                receiver2 = dec.receiver(72, bootstrap_url=bootstrap_url)
                receiver2.init(dst2, 5)
                sender2.send(src2, last=True)
                with trio.fail_after(15):
                    assert await receiver2.wait() is KVPoll.Success, receiver2.failure
                    assert await sender2.wait() is KVPoll.Success
                assert (dst_pool.kv[:, dst2, :] == src_pool2.expected(72, 3)).all()
                assert dst_pool.aux_ok(5, 72)
    finally:
        decode_engine.close()


async def test_an_engine_error_that_cannot_be_copied_fails_its_room_only(
    bootstrap_url: str,
) -> None:
    """An engine's own EngineError subclass whose ``__init__`` takes other arguments: the
    room's copy of it raised TypeError inside the chunk's error handling, which left the
    worker and closed the prefill agent with every room on it (found by a review). Now the
    room fails with an EngineError naming it, and the next room moves."""
    from trio_pd import EngineError, PrefillConfig
    from trio_pd.engines.fault import FaultEngine

    class OddEngineError(EngineError):
        def __init__(self, peer: str, blocks: int) -> None:
            super().__init__(f"engine lost {blocks} blocks to {peer}")

    class FirstWriteFails(FaultEngine):
        failed = False

        def write(self, peer: str, src: Any, dst: Any, lens: Any) -> None:
            if not self.failed:
                self.failed = True
                raise OddEngineError(peer, len(src))
            self.inner.write(peer, src, dst, lens)

    config = PrefillConfig(batch_blocks=0, quarantine_fence=0.2)
    async with open_pair("mooncake", bootstrap_url, wrap=FirstWriteFails,
                         prefill_config=config) as pair:
        for room in (1, 2):
            if room == 2:  # (the engine error marked the peer failed until a probe passes)
                peer = pair.prefill.peers.get(pair.decode.endpoint)
                assert peer is not None
                await poll_until(lambda p=peer: not p.failed)
            pages = np.array([room * 2, room * 2 + 1])
            pair.src.fill(pages, room)
            pair.src.fill_aux(room, room)
            sender = pair.prefill.sender(room, num_pages=2, aux_slot=room)
            receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
            receiver.init(pages + 100, room)
            sender.send(pages, last=True)
            with trio.fail_after(15):
                status = await sender.wait()
                assert await receiver.wait() is status
            if room == 1:
                assert status is KVPoll.Failed
                assert isinstance(sender.failure, EngineError)
                assert "OddEngineError: engine lost" in str(sender.failure)
            else:
                assert status is KVPoll.Success, sender.failure
                assert (pair.dst.kv[:, pages + 100] == pair.src.expected(room, 2)).all()


async def test_caller_reusing_its_page_arrays_after_the_call_changes_nothing(
    engine_name: str, bootstrap_url: str
) -> None:
    """The trio API takes the page ids a call is given, not the caller's array: a scheduler
    that reuses its index buffer right after ``init`` or ``send`` returns (before any write
    or any TRANSFER) must not redirect a write into other pages. Both arrays are int64, the
    dtype kept without a conversion, so a view of the caller's memory would be kept."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        src_pages = np.array([3, 4, 5, 9, 10, 20, 21, 22], dtype=np.int64)
        dst_pages = np.array([100, 101, 7, 8, 9, 55, 56, 57], dtype=np.int64)
        pair.src.fill(src_pages, room=78)
        pair.src.fill_aux(5, room=78)
        sender = pair.prefill.sender(78, num_pages=8, aux_slot=5)
        receiver = pair.decode.receiver(78, bootstrap_url=bootstrap_url)
        dst_buf = dst_pages.copy()
        receiver.init(dst_buf, 3)
        dst_buf[:] = np.arange(200, 208)  # the scheduler's next request's pages
        src_buf = src_pages.copy()
        sender.send(src_buf, last=True)
        src_buf[:] = np.arange(60, 68)
        with trio.fail_after(20):
            assert await receiver.wait() is KVPoll.Success
            assert await sender.wait() is KVPoll.Success
        assert pair.verify(78, dst_pages, 3)
