"""DP-attention routing (issue 18, item 5): one bootstrap service in front of several DP ranks
of a prefill instance, each its own TP group; decode routes each room to the DP rank that
holds it.

Real bootstrap service on loopback, real prefill and decode agents on real Mooncake engines,
page allocators with the lifetime sanitizer of :mod:`trio_pd.testing.pools`. Every wait is
bounded; a condition without an event is polled under a deadline (:func:`poll_until`).
"""

from __future__ import annotations

import gc
import json
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import msgspec
import numpy as np
import numpy.typing as npt
import pytest
import trio

from trio_pd import (
    BootstrapError,
    DecodeAgent,
    DecodeConfig,
    KVPoll,
    PrefillAgent,
    PrefillConfig,
    TransferAborted,
    UnknownRoom,
    open_bootstrap_server,
    open_decode,
    open_prefill,
)
from trio_pd.agents._decode import DecodeReceiver
from trio_pd.agents._prefill import PrefillSender
from trio_pd.bootstrap._bootstrap import BootstrapServer
from trio_pd.bootstrap._bootstrap_client import (
    MAX_DP_BATCH,
    UNKNOWN_DP_RANK,
    BootstrapClient,
    DpRoom,
    PrefillRankInfo,
    TokenProof,
    dp_url,
)
from trio_pd.core._dp_routes import RouteTimer
from trio_pd.core._errors import ConfigurationError, NotReady
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.io._security import default_token
from trio_pd.testing.pools import (
    DEST_POISON,
    SOURCE_POISON,
    HostKVPool,
    PageAllocator,
    page_rows,
)

from .helpers.agents import host_pool, poll_until

BOUND = 20.0
KV_HEADS = 2
TOKEN = "dp-routing test token, shared by the cluster"



# ------------------------------------------------------------------------------ a cluster


@dataclass
class PrefillRank:
    agent: PrefillAgent
    pool: HostKVPool
    pages: PageAllocator


@dataclass
class Cluster:
    """A bootstrap service, ``dp_size`` DP ranks of ``tp_size`` prefill ranks each behind it,
    and one decode rank (TP 1: it gathers the heads of every TP rank of a DP rank)."""

    boot: BootstrapServer
    prefill: list[list[PrefillRank]]  # [dp_rank][tp_rank]
    decode: DecodeAgent
    dst: HostKVPool
    dst_pages: PageAllocator
    token: str | None = None
    epochs: dict[int, int] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.boot.url

    def allocators(self) -> list[PageAllocator]:
        return [self.dst_pages, *(p.pages for group in self.prefill for p in group)]

    def assert_no_late_writes(self) -> None:
        for alloc in self.allocators():
            assert alloc.late_writes == 0 and alloc.late_in_free_rows() == 0
            assert alloc.outstanding == 0


@asynccontextmanager
async def open_cluster(
    *,
    dp_size: int = 2,
    tp_size: int = 2,
    token: str | None = None,
    decode_config: DecodeConfig | None = None,
    prefill_config: PrefillConfig | None = None,
    **boot_kw: Any,
) -> AsyncIterator[Cluster]:
    secure = True if token else None
    engines: list[TransferEngine] = []
    heads = KV_HEADS // tp_size
    try:
        async with AsyncExitStack() as stack:
            boot = await stack.enter_async_context(
                open_bootstrap_server(token=token, secure=secure, **boot_kw)
            )
            groups: list[list[PrefillRank]] = []
            for d in range(dp_size):
                group = []
                for t in range(tp_size):
                    pool = host_pool(heads=heads, first_head=t * heads)
                    engine = make_engine("mooncake")
                    engines.append(engine)
                    agent = await stack.enter_async_context(open_prefill(
                        engine=engine, pool=pool.spec, bootstrap_url=boot.url, tp_rank=t,
                        tp_size=tp_size, kv_heads=KV_HEADS, dp_rank=d, dp_size=dp_size,
                        token=token, secure=secure, config=prefill_config,
                    ))
                    group.append(PrefillRank(agent, pool, PageAllocator(page_rows(pool),
                                                                         SOURCE_POISON)))
                groups.append(group)
            dst = host_pool(heads=KV_HEADS)
            engine = make_engine("mooncake")
            engines.append(engine)
            decode = await stack.enter_async_context(open_decode(
                engine=engine, pool=dst.spec, kv_heads=KV_HEADS, token=token, secure=secure,
                config=decode_config,
            ))
            yield Cluster(boot, groups, decode, dst, PageAllocator(page_rows(dst), DEST_POISON),
                          token)
    finally:
        for engine in engines:
            engine.close()


@dataclass
class Room:
    room: int
    dp_rank: int
    senders: list[PrefillSender]
    receiver: DecodeReceiver
    src: list[npt.NDArray[np.int64]]
    dst: npt.NDArray[np.int64]
    slot: int


def open_senders(c: Cluster, room: int, dp_rank: int, n: int, *, epoch: int | None
                 ) -> tuple[list[PrefillSender], list[npt.NDArray[np.int64]]]:
    """Every TP rank of DP rank ``dp_rank`` creates ``room`` (its KV in fresh pages)."""
    senders, pages = [], []
    for p in c.prefill[dp_rank]:
        src = p.pages.alloc_nowait(n)
        assert src is not None
        p.pool.fill(src, room)
        p.pool.fill_aux(room % 32, room)
        senders.append(p.agent.sender(room, num_pages=n, aux_slot=room % 32, epoch=epoch,
                                      on_release=partial(p.pages.free, src)))
        pages.append(src)
    return senders, pages


def open_room(c: Cluster, room: int, dp_rank: int, *, n: int = 3, receiver_first: bool = False,
              prefill_knows_epoch: bool = True, name_dp_rank: bool = False) -> Room:
    epoch = random.getrandbits(62)
    dst = c.dst_pages.alloc_nowait(n)
    assert dst is not None
    hint = dp_rank if name_dp_rank else None
    if receiver_first:
        receiver = c.decode.receiver(room, bootstrap_url=c.url, epoch=epoch, dp_rank=hint)
    senders, src = open_senders(c, room, dp_rank, n,
                                epoch=epoch if prefill_knows_epoch else None)
    if not receiver_first:
        receiver = c.decode.receiver(room, bootstrap_url=c.url, epoch=epoch, dp_rank=hint)
    receiver.init(dst, room % 32, on_release=partial(c.dst_pages.free, dst))
    for s, pages in zip(senders, src, strict=True):
        s.send(pages, last=True)
    return Room(room, dp_rank, senders, receiver, src, dst, room % 32)


async def finish(c: Cluster, r: Room) -> None:
    """The room succeeded on both sides, its bytes arrived, its pages are back."""
    with trio.fail_after(BOUND):
        assert await r.receiver.wait() is KVPoll.Success, r.receiver.failure
        for s in r.senders:
            assert await s.wait() is KVPoll.Success
            await s.wait_released()
    assert (c.dst.kv[:, r.dst, :] == c.dst.expected(r.room, len(r.dst))).all()
    assert c.dst.aux_ok(r.slot, r.room)
    assert r.receiver.prefill_dp_rank == r.dp_rank
    c.dst_pages.free(r.dst)  # after Success the pages are the scheduler's


def http(c: Cluster, token: str | None = None) -> httpx.AsyncClient:
    """Raw requests to the cluster's service, proving ``token`` (left out: the one the
    service took by default, security being on)."""
    auth = TokenProof(token or default_token() or "")
    return httpx.AsyncClient(base_url=c.url, trust_env=False, auth=auth)


# ------------------------------------------------------------------------------ routing


async def test_rooms_reach_the_dp_rank_that_holds_them() -> None:
    """Two DP ranks of two TP ranks each behind one bootstrap service. Rooms on either DP
    rank, the decode receiver made before or after the prefill senders, with or without the
    prefill side knowing the epoch: each room is routed to its DP rank's TP group (the other
    DP rank never hears of it), every byte arrives, no page is written after its release.
    Only TP rank 0 of each DP rank announces."""
    async with open_cluster() as c:
        rooms = [
            open_room(c, room, room % 2, receiver_first=room % 3 == 0,
                      prefill_knows_epoch=room % 4 != 1)
            for room in range(1, 9)
        ]
        for r in rooms:
            await finish(c, r)
        for d, group in enumerate(c.prefill):
            held = sum(1 for r in rooms if r.dp_rank == d)
            for p in group:
                stats = p.agent.statistics()
                assert stats.succeeded == held and stats.failed == 0, (d, stats)
                assert not p.agent.table.parked  # no TRANSFER for a room of the other DP rank
        boot = c.boot.statistics()
        assert boot.dp_size == 2
        assert boot.dp_rooms_registered == len(rooms)  # TP rank 0 of each DP rank, once a room
        assert boot.requests[("POST", "/query_dp_ranks", 200)] >= 1
        assert c.decode.statistics().succeeded == len(rooms)
    c.assert_no_late_writes()


async def test_a_dp_rank_named_by_the_router_is_not_looked_up() -> None:
    """``receiver(dp_rank=K)``: the room goes to DP rank K at once, without asking the
    bootstrap service; a later room that names none still asks (mixed routing)."""
    async with open_cluster() as c:
        named = open_room(c, 11, 1, name_dp_rank=True, receiver_first=True)
        await finish(c, named)
        assert ("POST", "/query_dp_ranks", 200) not in c.boot.statistics().requests
        asked = open_room(c, 12, 1)
        await finish(c, asked)
        assert c.boot.statistics().requests[("POST", "/query_dp_ranks", 200)] >= 1
        with pytest.raises(ConfigurationError, match="dp_rank"):
            c.decode.receiver(13, bootstrap_url=c.url, dp_rank=-1)
        # a DP rank the instance does not have: the service's 404 fails the room
        ghost = c.decode.receiver(14, bootstrap_url=c.url, dp_rank=5)
        with trio.fail_after(BOUND):
            assert await ghost.wait() is KVPoll.Failed
        assert isinstance(ghost.failure, BootstrapError) and "dp_rank" in str(ghost.failure)
    c.assert_no_late_writes()


async def test_one_dp_rank_is_never_asked_and_announces_nothing() -> None:
    """Without DP attention (dp_size 1) the decode rank learns so from the topology it
    resolves anyway and never asks the service for a room's DP rank (no request that a
    closing agent could cut off mid-body); the prefill side announces no room."""
    async with open_cluster(dp_size=1) as c:
        first = [open_room(c, room, 0) for room in (21, 22)]
        for r in first:
            await finish(c, r)
        asked = c.boot.statistics().requests.get(("POST", "/query_dp_ranks", 200), 0)
        for r in [open_room(c, room, 0) for room in (23, 24)]:
            await finish(c, r)
        boot = c.boot.statistics()
        assert boot.requests.get(("POST", "/query_dp_ranks", 200), 0) == asked == 0
        assert boot.dp_rooms_registered == 0 and boot.dp_rooms == 0
        assert all(p.agent.dp_announcer is None for g in c.prefill for p in g)
    c.assert_no_late_writes()


@pytest.mark.serial
async def test_unknown_room_fails_at_the_bootstrap_deadline() -> None:
    """A room no prefill DP rank announced: the decode receiver stays Bootstrapping, asking,
    then fails with UnknownRoom at its bootstrap deadline (counted ``timeouts``); no prefill
    rank hears of it. The service answers the unknown room with -1, not an error."""
    config = DecodeConfig(bootstrap_timeout=2.0)  # (the first answer: a nonce, then the ask)
    async with open_cluster(decode_config=config) as c:
        dst = c.dst_pages.alloc_nowait(2)
        assert dst is not None
        receiver = c.decode.receiver(31, bootstrap_url=c.url)
        receiver.init(dst, 1, on_release=partial(c.dst_pages.free, dst))
        await trio.sleep(0.2)
        assert receiver.poll() is KVPoll.Bootstrapping and receiver.prefill_dp_rank is None
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Failed
        assert isinstance(receiver.failure, UnknownRoom), receiver.failure
        assert "DP rank" in str(receiver.failure) and receiver.prefill_dp_rank is None
        assert c.decode.statistics().timeouts == 1
        assert c.boot.statistics().dp_rooms_unknown >= 2  # it asked more than once
        # the deadline that ran left the router's books too (only the quiet second is armed)
        assert not [k for k in c.decode.router._armed if isinstance(k, RouteTimer)]
        for group in c.prefill:
            for p in group:
                assert not p.agent.table.parked and p.agent.statistics().refused_messages == 0
        async with BootstrapClient(c.url) as client:
            answer = await client.query_dp_ranks([DpRoom(31), DpRoom(32, 7)])
        assert answer.dp_size == 2 and answer.dp_ranks == [UNKNOWN_DP_RANK] * 2
        # a service that never answers: the room fails as an instance that does not resolve
        lost = c.decode.receiver(34, bootstrap_url="http://127.0.0.1:1")
        with trio.fail_after(BOUND):
            assert await lost.wait() is KVPoll.Failed
        assert isinstance(lost.failure, BootstrapError), lost.failure
        assert not isinstance(lost.failure, UnknownRoom) and "no answer" in str(lost.failure)
        # the agent still serves
        await finish(c, open_room(c, 33, 1))
    c.assert_no_late_writes()


async def test_a_room_aborted_while_asking_still_tells_its_dp_rank() -> None:
    """The decode scheduler aborts a room before its DP rank is known: it fails at once, its
    pages (never named to a prefill rank) come back at once, and once the prefill DP rank
    announces it, decode routes the ABORT there: the prefill senders fail now, not at their
    bootstrap deadline."""
    pconfig = PrefillConfig(bootstrap_timeout=60.0)
    async with open_cluster(prefill_config=pconfig) as c:
        dst = c.dst_pages.alloc_nowait(2)
        assert dst is not None
        released = trio.Event()

        def on_release() -> None:
            c.dst_pages.free(dst)
            released.set()

        epoch = 12345
        receiver = c.decode.receiver(41, bootstrap_url=c.url, epoch=epoch)
        receiver.init(dst, 2, on_release=on_release)
        receiver.abort("the client went away")
        assert receiver.poll() is KVPoll.Failed
        with trio.fail_after(BOUND):
            await released.wait()
        senders, _ = open_senders(c, 41, 1, 2, epoch=epoch)
        with trio.fail_after(10):
            for s in senders:
                assert await s.wait() is KVPoll.Failed
                await s.wait_released()
        assert all(isinstance(s.failure, TransferAborted) for s in senders)
    c.assert_no_late_writes()


async def test_closing_decode_while_rooms_ask_is_bounded() -> None:
    """Leaving ``open_decode`` while rooms are still asking for their DP rank fails them and
    returns promptly (nothing waits for the bootstrap deadline)."""
    config = DecodeConfig(bootstrap_timeout=60.0)
    async with open_cluster(decode_config=config) as c:
        engine = make_engine("mooncake")
        try:
            dst = host_pool(heads=KV_HEADS)
            with trio.fail_after(10):
                async with open_decode(engine=engine, pool=dst.spec, kv_heads=KV_HEADS) as d:
                    receivers = [d.receiver(room, bootstrap_url=c.url) for room in (51, 52)]
                    await trio.sleep(0.1)
                    assert all(r.poll() is KVPoll.Bootstrapping for r in receivers)
            assert all(r.poll() is KVPoll.Failed for r in receivers)
        finally:
            engine.close()


def decode_records_alive(rooms: set[int]) -> list[int]:
    """The decode agent's room records (its ``_Room``) of ``rooms`` still reachable."""
    from trio_pd.agents import _decode

    gc.collect()
    return sorted(o.machine.room for o in gc.get_objects()
                  if type(o) is _decode._Room and o.machine.room in rooms)


async def test_routed_rooms_are_let_go_at_once_not_at_their_bootstrap_deadline() -> None:
    """A room waiting for its DP rank arms its bootstrap deadline at its first ask; once it
    is routed (or can no longer be), that deadline is dropped there and then, not left armed
    with the room in it. Here the deadline is an hour away: after the rooms (succeeded, and
    aborted while asking, whose ABORT still reaches their DP rank) have ended and their
    handles are dropped, nothing of the decode agent holds their records, and no timer is
    left armed on a room's routing. Before, each routed room kept its record (and the
    route) until its bootstrap deadline: every room of the last 30 seconds by default, for
    the garbage collector to walk."""
    far = 3600.0
    dcfg = DecodeConfig(bootstrap_timeout=far, waiting_timeout=far, ack_timeout=far)
    rooms = set(range(60, 72))
    async with open_cluster(decode_config=dcfg, prefill_config=PrefillConfig(
            bootstrap_timeout=far)) as c:
        for room in sorted(rooms):
            if room % 4:  # routed by the service's answer, then succeeds
                r = open_room(c, room, room % 2)
                await finish(c, r)
                del r
                continue
            # aborted while it asks: routed once its DP rank announces it, to tell it
            dst = c.dst_pages.alloc_nowait(2)
            assert dst is not None
            receiver = c.decode.receiver(room, bootstrap_url=c.url, epoch=room)
            receiver.init(dst, 2, on_release=partial(c.dst_pages.free, dst))
            receiver.abort("the client went away")
            senders, _ = open_senders(c, room, room % 2, 2, epoch=room)
            with trio.fail_after(BOUND):
                await receiver.wait_released()
                for s in senders:
                    assert await s.wait() is KVPoll.Failed
                    await s.wait_released()
            del receiver, senders, s
        assert c.boot.statistics().requests[("POST", "/query_dp_ranks", 200)] >= 1
        with trio.fail_after(BOUND):  # (decode forgets an aborted room once it is acked)
            await poll_until(lambda: c.decode.statistics().rooms_active == 0)
        assert decode_records_alive(rooms) == []
        # the deadlines are cancelled, not only let go: none left armed on a route's room
        armed = [t[2] for t in c.decode.timers._heap if t[2] is not None]
        assert len(armed) == len(c.decode.timers)
        assert not [a for a in armed if isinstance(a, partial)
                    and any(isinstance(x, RouteTimer) for x in a.args)]
        assert not c.decode.router._armed
    c.assert_no_late_writes()


# ------------------------------------------------------------------------------ the service


async def test_forged_dp_registration_without_the_token_is_refused() -> None:
    """With a cluster token, ``/register_dp_rank`` and ``/query_dp_ranks`` need it like
    ``/route``: a forged "room 61 is on DP rank 1" without it (or with another) is refused
    401 and counted, changes nothing, and the real room still reaches DP rank 0."""
    async with open_cluster(token=TOKEN) as c:
        forged = json.dumps({"dp_rank": 1, "rooms": [{"room": 61}]}).encode()
        async with http(c) as anonymous, http(c, "not the token") as wrong:
            for client in (anonymous, wrong):
                reply = await client.post("/register_dp_rank", content=forged)
                assert reply.status_code == 401
                reply = await client.post("/query_dp_ranks", content=b'{"rooms":[{"room":61}]}')
                assert reply.status_code == 401
        stats = c.boot.statistics()
        assert stats.unauthorized == 4
        assert stats.dp_rooms == 0 and stats.dp_rooms_registered == 0
        await finish(c, open_room(c, 61, 0))
        async with BootstrapClient(c.url, token=TOKEN) as client:
            answer = await client.query_dp_ranks([DpRoom(61)])
        assert answer.dp_ranks == [0]
    c.assert_no_late_writes()


async def registered(boot: BootstrapServer, dp_size: int = 2, tp_size: int = 1) -> None:
    """Register every rank of a fake instance (the service then knows the DP size)."""
    async with BootstrapClient(boot.url) as client:
        for d in range(dp_size):
            for t in range(tp_size):
                await client.register(PrefillRankInfo(
                    tp_rank=t, tp_size=tp_size, endpoint=f"tcp://127.0.0.1:{5000 + 10 * d + t}",
                    engine="mooncake", engine_session=f"127.0.0.1:{16000 + 10 * d + t}",
                    layout="mha", kv_heads=2, page_size=4, dp_rank=d, dp_size=dp_size,
                ))


async def test_bad_and_oversized_dp_requests_are_refused() -> None:
    """Bounded and typed: over MAX_DP_BATCH rooms is 413, a body over 64 KiB 413, malformed
    JSON, no rooms, a room id out of range or a DP rank the instance lacks 400, before any
    rank registered 503 (NotReady); each counted, none stores anything."""
    async with open_bootstrap_server() as boot:
        async with BootstrapClient(boot.url) as client:
            with pytest.raises(NotReady):
                await client.query_dp_ranks([DpRoom(1)])
            with pytest.raises(NotReady):
                await client.register_dp_rooms(0, [DpRoom(1)])
        await registered(boot)
        rooms = [{"room": i} for i in range(MAX_DP_BATCH + 1)]
        async with httpx.AsyncClient(
            base_url=boot.url, trust_env=False, auth=TokenProof(default_token() or "")
        ) as h:
            cases = {
                ("/register_dp_rank", json.dumps({"dp_rank": 0, "rooms": rooms})): 413,
                ("/query_dp_ranks", json.dumps({"rooms": rooms})): 413,
                ("/register_dp_rank", json.dumps({"dp_rank": 0, "rooms": [{"room": 1}] * 9000})):
                    413,  # over 64 KiB
                ("/register_dp_rank", "not json"): 400,
                ("/register_dp_rank", json.dumps({"dp_rank": 0, "rooms": []})): 400,
                ("/query_dp_ranks", json.dumps({"rooms": [{"room": -1}]})): 400,
                ("/query_dp_ranks", json.dumps({"rooms": [{"room": 1 << 63}]})): 400,
                ("/register_dp_rank", json.dumps({"dp_rank": 2, "rooms": [{"room": 1}]})): 400,
                ("/register_dp_rank", json.dumps({"bootstrap_room": 1, "dp_rank": 1})): 400,
            }
            for (path, body), status in cases.items():
                reply = await h.post(path, content=body.encode())
                assert reply.status_code == status, (path, body[:60], reply.text)
                assert reply.json()["ok"] is False and reply.json()["error"]
            assert (await h.get("/query_dp_ranks")).status_code == 405
        stats = boot.statistics()
        assert stats.malformed == len(cases)
        assert stats.dp_rooms == 0 and stats.dp_rooms_registered == 0
        async with BootstrapClient(boot.url) as client:  # exactly at the bound: fine
            await client.register_dp_rooms(1, [DpRoom(i) for i in range(MAX_DP_BATCH)])
            answer = await client.query_dp_ranks([DpRoom(i) for i in range(MAX_DP_BATCH)])
        assert answer.dp_ranks == [1] * MAX_DP_BATCH


async def test_records_expire_and_are_bounded() -> None:
    """A record lives ``dp_room_ttl`` after its (last) registration, then answers -1 and is
    counted expired; past ``max_dp_rooms`` the oldest goes, counted evicted."""
    async with open_bootstrap_server(dp_room_ttl=0.4, max_dp_rooms=4) as boot:
        await registered(boot)
        async with BootstrapClient(boot.url) as client:
            await client.register_dp_rooms(1, [DpRoom(7)])
            assert (await client.query_dp_ranks([DpRoom(7)])).dp_ranks == [1]
            await trio.sleep(0.5)
            assert (await client.query_dp_ranks([DpRoom(7)])).dp_ranks == [UNKNOWN_DP_RANK]
            stats = boot.statistics()
            assert stats.dp_rooms_expired == 1 and stats.dp_rooms == 0
            await client.register_dp_rooms(0, [DpRoom(r) for r in range(10, 16)])
            stats = boot.statistics()
            assert stats.dp_rooms_evicted == 2 and stats.dp_rooms == 4
            answer = await client.query_dp_ranks([DpRoom(r) for r in range(10, 16)])
            assert answer.dp_ranks == [UNKNOWN_DP_RANK] * 2 + [0] * 4
            # registering again refreshes a record (and its place in the eviction order)
            await trio.sleep(0.25)
            await client.register_dp_rooms(1, [DpRoom(12)])
            await trio.sleep(0.25)
            answer = await client.query_dp_ranks([DpRoom(r) for r in range(12, 16)])
            assert answer.dp_ranks == [1] + [UNKNOWN_DP_RANK] * 3
    with pytest.raises(ConfigurationError, match="dp_room_ttl"):
        async with open_bootstrap_server(dp_room_ttl=0):
            pass  # pragma: no cover
    with pytest.raises(ConfigurationError, match="max_dp_rooms"):
        async with open_bootstrap_server(max_dp_rooms=0):
            pass  # pragma: no cover


async def test_an_epoch_tells_uses_of_a_room_apart() -> None:
    """A record made with an epoch answers only that use of the room id (and a query naming
    no epoch); one made without an epoch answers any use."""
    async with open_bootstrap_server() as boot:
        await registered(boot)
        async with BootstrapClient(boot.url) as client:
            await client.register_dp_rooms(1, [DpRoom(5, 100), DpRoom(6)])
            answer = await client.query_dp_ranks(
                [DpRoom(5, 100), DpRoom(5, 101), DpRoom(5), DpRoom(6, 1), DpRoom(6)]
            )
        assert answer.dp_ranks == [1, UNKNOWN_DP_RANK, 1, 1, 1]


async def test_a_record_made_under_a_larger_dp_size_is_unknown_not_invalid() -> None:
    """A room recorded while the instance said DP 4, asked about after it re-registered as
    DP 2: the service answered its old DP rank 3, an answer the client must refuse whole,
    and decode failed every room it had asked about with it. It is unknown now; the
    others' answers stand."""
    def rank(dp_rank: int, dp_size: int) -> PrefillRankInfo:
        return PrefillRankInfo(
            tp_rank=0, tp_size=1, endpoint=f"tcp://127.0.0.1:{5000 + dp_rank}",
            engine="mooncake", engine_session=f"127.0.0.1:{16000 + dp_rank}", layout="mha",
            kv_heads=2, page_size=4, dp_rank=dp_rank, dp_size=dp_size,
        )

    async with open_bootstrap_server() as boot, BootstrapClient(boot.url) as client:
        await client.register(rank(0, 4))  # one rank so far, of an instance of DP 4
        await client.register_dp_rooms(3, [DpRoom(1, 11)])
        await client.register(rank(0, 2))  # it re-registers: the instance is DP 2 now
        await client.register(rank(1, 2))
        await client.register_dp_rooms(1, [DpRoom(2, 12)])
        answer = await client.query_dp_ranks([DpRoom(1, 11), DpRoom(2, 12)])
    assert answer.dp_size == 2 and answer.dp_ranks == [UNKNOWN_DP_RANK, 1]


async def test_a_reused_room_id_is_announced_again_wherever_it_goes() -> None:
    """Room 5 on DP rank 1, then 0, then 1 again, with the same epoch each time (SGLang's
    epochs are a function of the room id): DP rank 1's announcer remembered its first use
    and skipped the third, so decode was routed to DP rank 0 and the room hung. A use
    that ends is forgotten; each use is announced and reaches the DP rank that holds it.
    (Uses of one room id and epoch are told apart only one after the other: a decode rank
    that asks before the new use's announcement is in gets the last one's answer.)"""
    async with open_cluster(tp_size=1) as c:
        for use, dp_rank in enumerate((1, 0, 1), start=1):
            dst = c.dst_pages.alloc_nowait(3)
            assert dst is not None
            senders, src = open_senders(c, 5, dp_rank, 3, epoch=777)
            # (decode asks once the announcement is in: before, the service would still
            # answer with the last use's record, the same room and epoch)
            await poll_until(lambda u=use: c.boot.statistics().dp_rooms_registered == u)
            receiver = c.decode.receiver(5, bootstrap_url=c.url, epoch=777)
            receiver.init(dst, 5, on_release=partial(c.dst_pages.free, dst))
            for s, pages in zip(senders, src, strict=True):
                s.send(pages, last=True)
            await finish(c, Room(5, dp_rank, senders, receiver, src, dst, 5))
        assert c.boot.statistics().dp_rooms_registered == 3


async def test_topology_per_dp_rank() -> None:
    """``GET /route?dp_rank=K`` is DP rank K's TP group, ready as soon as that group is (503
    before), 404 past the DP size; ``dp_size`` is a shared field (409), ``dp_rank`` must fit
    it and ``dp_size x tp_size`` the service's bound (400)."""
    async with open_bootstrap_server() as boot, BootstrapClient(boot.url) as plain:
        info = PrefillRankInfo(tp_rank=0, tp_size=2, endpoint="tcp://127.0.0.1:5000",
                               engine="mooncake", engine_session="127.0.0.1:16000",
                               layout="mha", kv_heads=2, page_size=4, dp_size=2)
        for d, t in ((1, 0), (1, 1), (0, 0)):
            await plain.register(msgspec.structs.replace(
                info, tp_rank=t, dp_rank=d, endpoint=f"tcp://127.0.0.1:{5000 + 10 * d + t}"
            ))
        async with BootstrapClient(dp_url(boot.url, 1)) as one:
            topology = await one.topology()
            assert topology.dp_rank == 1 and topology.dp_size == 2
            assert [r.endpoint for r in topology.ranks] == [
                "tcp://127.0.0.1:5010", "tcp://127.0.0.1:5011"]
            assert (await one.rank(1)).endpoint == "tcp://127.0.0.1:5011"
        with pytest.raises(NotReady, match="1 of 2 ranks of dp_rank 0"):
            await plain.topology()  # (DP rank 0: not complete)
        assert not boot.statistics().ready
        await plain.register(msgspec.structs.replace(info, tp_rank=1,
                                                     endpoint="tcp://127.0.0.1:5001"))
        assert (await plain.topology()).ranks[1].endpoint == "tcp://127.0.0.1:5001"
        assert boot.statistics().ready and boot.statistics().registered_ranks == 4
        async with httpx.AsyncClient(
            base_url=boot.url, trust_env=False, auth=TokenProof(default_token() or "")
        ) as h:
            assert (await h.get("/route", params={"dp_rank": "2"})).status_code == 404
            assert (await h.get("/route", params={"dp_rank": "-1"})).status_code == 400
            body = msgspec.json.encode(msgspec.structs.replace(info, dp_size=4))
            assert (await h.put("/route", content=body)).status_code == 409
            for bad in ({"dp_rank": 2}, {"dp_size": 1024}):
                body = msgspec.json.encode(msgspec.structs.replace(info, **bad))
                assert (await h.put("/route", content=body)).status_code == 400, bad


async def test_prefill_refuses_a_dp_rank_outside_its_dp_size() -> None:
    pool = host_pool()
    engine = make_engine("mooncake")
    try:
        for dp_rank, dp_size in ((2, 2), (-1, 2), (0, 0)):
            with pytest.raises(ConfigurationError, match="dp_"):
                async with open_prefill(engine=engine, pool=pool.spec, kv_heads=2,
                                        bootstrap_url="http://127.0.0.1:1", dp_rank=dp_rank,
                                        dp_size=dp_size):
                    pass  # pragma: no cover
    finally:
        engine.close()


# ------------------------------------------------------------------------------ SGLang


def test_sglang_dp_attention_prefill_managers_route_by_the_bootstrap_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's DP attention through the adapter: ``tp_size`` 2, ``dp_size`` 2,
    ``enable_dp_attention``: prefill managers of ``engine_rank`` 0 and 1 are DP ranks 0 and 1
    (attention TP 1, rank 0 each) behind one bootstrap service. A request on DP rank 1
    reaches the decode manager (which names no DP rank), bytes and metadata verified."""
    monkeypatch.setenv("TRIO_PD_TOKEN", "dp-sglang-test-token")  # (as SGLang's processes)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "0")
    from trio_pd.compat.sglang import KVBootstrapServer, KVManager, KVReceiver, KVSender

    from .helpers.sglang import Memory, server_args
    from .helpers.threads import poll_until

    srcs = [Memory(num_pages=16, heads=2, aux_slots=4) for _ in range(2)]
    dst = Memory(num_pages=16, heads=2, aux_slots=4)
    with KVBootstrapServer("127.0.0.1", 0) as boot:
        args = server_args(disaggregation_bootstrap_port=boot.port, tp_size=2, dp_size=2,
                           enable_dp_attention=True)
        with (
            KVManager(srcs[0].kvargs(rank=0), "prefill", args) as p0,
            KVManager(srcs[1].kvargs(rank=1), "prefill", args) as p1,
            KVManager(dst.kvargs(), "decode", server_args()) as decode,
        ):
            assert (p0.dp_rank, p0.tp_rank, p0.tp_size) == (0, 0, 1)
            assert (p1.dp_rank, p1.tp_rank, p1.tp_size, p1.dp_size) == (1, 0, 1, 2)
            assert boot._server.server.statistics().dp_size == 2
            room = 0x5EED
            srcs[1].fill(room, np.arange(4), 1)
            sender = KVSender(p1, f"127.0.0.1:{boot.port}", room)
            receiver = KVReceiver(decode, f"127.0.0.1:{boot.port}", room)
            receiver.init(None)
            poll_until(lambda: receiver.poll() == KVPoll.WaitingForInput)
            receiver.send_metadata(np.arange(8, 12), aux_index=3)
            sender.init(4, aux_index=1)
            sender.send(np.arange(4))
            poll_until(lambda: receiver.poll() == KVPoll.Success)
            assert dst.holds(room, np.arange(8, 12), 3)
            poll_until(lambda: sender.poll() == KVPoll.Success)
            assert p0.statistics().rooms_active == 0 and p0.statistics().succeeded == 0
            # announced once, when the sender was made (the agent's own, at init, is not
            # sent again)
            assert boot._server.server.statistics().dp_rooms_registered == 1


def test_sglang_system_dp_prefill_manager_registers_its_dp_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DP without DP attention (``dp_size`` 2, each DP rank a full TP group): a prefill
    manager's DP rank is ``KVArgs.system_dp_rank``, registered with the bootstrap service. A
    system DP rank is still refused where it means nothing to trio_pd (prefill with
    ``dp_size`` 1; decode)."""
    monkeypatch.setenv("TRIO_PD_TOKEN", "dp-sglang-test-token")  # (as SGLang's processes)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "0")
    from trio_pd.compat.sglang import KVBootstrapServer, KVManager

    from .helpers.sglang import Memory, server_args

    mem = Memory(num_pages=8, heads=2, aux_slots=4)
    args = mem.kvargs()
    args.system_dp_rank = 1
    with KVBootstrapServer("127.0.0.1", 0) as boot:
        sargs = server_args(disaggregation_bootstrap_port=boot.port, dp_size=2)
        with KVManager(args, "prefill", sargs) as prefill:
            assert (prefill.dp_rank, prefill.dp_size, prefill.tp_rank) == (1, 2, 0)

            async def registered_rank() -> PrefillRankInfo:
                async with BootstrapClient(dp_url(boot.url, 1)) as client:
                    return await client.rank(0)

            info = trio.run(registered_rank)
            assert (info.dp_rank, info.dp_size) == (1, 2)
        for mode, kw in (("prefill", {}), ("decode", {"dp_size": 2})):
            with pytest.raises(ConfigurationError, match="system_dp_rank=1"):
                KVManager(args, mode, server_args(disaggregation_bootstrap_port=boot.port, **kw))


@pytest.mark.parametrize("engine", ["mooncake"])
async def test_the_demo_routes_two_prefill_dp_ranks(engine: str) -> None:
    """`trio-pd demo --prefill-dp 2`: two DP ranks of two prefill ranks each behind one
    bootstrap service, each serving every other request; decode finds the right one for every
    room by asking the service (a room sent to the other DP rank would never be served, and
    fail at its deadline). Aborts and faults included: nothing late, corrupt or leaked."""
    from trio_pd.tools._demo import DemoOptions, check, run_in_process

    opts = DemoOptions(requests=24, concurrency=6, min_tokens=1, max_tokens=48, page_size=4,
                       chunk_pages=3, layers=1, head_bytes=16, kv_heads=4, prefill_tp=2,
                       prefill_dp=2, abort_rate=0.2, fault_rate=0.1, engine=engine, seed=2,
                       request_bound=20.0, quarantine_fence=1.0)
    assert opts.option_problem() is None
    with trio.fail_after(90):
        summary = await run_in_process(opts)
    assert summary["succeeded"] >= 12, summary
    for key in ("corrupt_pages", "late_writes", "leaked_pages", "hung", "released_by_timeout"):
        assert summary[key] == 0, (key, summary)
    assert check(opts, summary) == []
