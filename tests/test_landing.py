"""Landing pages (trio_pd.core._landing): a decode rank with a landing area offers a room whose
pages are fragmented a run of landing pages; prefill gathers each chunk's source pages into
its staging area and writes one block per buffer there; decode copies the landing pages into
the room's pages before Success.

Checked on real engines end to end with shuffled pages on both sides (bytes, blocks per
call, counters), with prefix pages, layer-wise sends and several prefill ranks per room; a
full area falls back to the room's own pages; and the lifetime rule of a landing range: held
like the room's pages while a write of the room may land, never copied out of a failed
room, given back exactly once.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import msgspec
import numpy as np
import pytest
import trio

from trio_pd import DecodeConfig, KVPoll
from trio_pd.core import _wire
from trio_pd.core._errors import PeerLost, ProtocolError, TransferAborted
from trio_pd.core._landing import LandingArea, fragmented, landing_spec
from trio_pd.core._memory import HOST, Region
from trio_pd.core._plan import plan_staged, stages_pages
from trio_pd.core._rooms import DecodeRoom, Succeeded
from trio_pd.core._staging import StagingArea
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.testing.pools import HostKVPool
from trio_pd.tools._demo import DemoOptions

from .helpers.agents import open_pair, poll_until
from .helpers.cluster import open_cluster
from .helpers.peers import barrier, fake_decode, raw_push, register, transfer

LANDING = DecodeConfig(landing_bytes=1 << 20)


# ------------------------------------------------------------------------ pieces


def _page_bytes(pool: HostKVPool, b: int, pages: np.ndarray) -> np.ndarray:
    return pool._pages(b)[pages].reshape(len(pages), -1)


def test_the_area_reserves_first_fit_scatters_and_gives_back() -> None:
    pool = HostKVPool(layout="mha", num_pages=16, num_layers=2, page_size=2, head_bytes=4,
                      heads=2, page_pad=3)
    area = LandingArea(pool.spec, 5 * sum(pool.spec.item_lens) + 7)
    assert area.pages == 5 and area.region.base % 4096 == 0
    a, b = area.reserve(3), area.reserve(2)
    assert (a, b) == (0, 3) and area.reserve(1) is None and area.reserved == 5
    area.give(0, 3)
    assert area.reserve(4) is None and area.reserve(3) == 0
    spec = landing_spec(pool.spec, area.bases, area.pages)
    assert spec.packed and spec.num_pages == 5 and spec.regions()[0].base == area.bases[0]
    # landing pages 3, 4 -> the pool's pages 9, 2, buffer by buffer (the pads untouched)
    for v in area._views:
        v[3:5] = np.arange(2 * v.shape[1], dtype=np.uint8).reshape(2, -1) + 1
    before = [buf.copy() for buf in pool.buffers]
    area.scatter(3, np.array([9, 2]))
    for b, v in enumerate(area._views):
        assert (pool._pages(b)[[9, 2]].reshape(2, -1) == v[3:5]).all()
        changed = np.flatnonzero(pool.buffers[b].ravel() != before[b].ravel())
        stride = pool.spec.strides[b]
        assert set((changed // stride).tolist()) <= {9, 2}
        assert (changed % stride < pool.spec.item_lens[b]).all()


def test_the_fragmentation_rule() -> None:
    assert not fragmented(np.array([5]), 16 << 10, 256 << 10)
    assert not fragmented(np.arange(40), 16 << 10, 256 << 10)  # one run
    assert fragmented(np.array([3, 9, 1, 2]), 16 << 10, 256 << 10)
    # runs of 32 pages of 16 KiB: 512 KiB a block already
    assert not fragmented(np.r_[np.arange(32), np.arange(100, 132)], 16 << 10, 256 << 10)


def test_a_transfer_without_landing_is_byte_identical() -> None:
    """``landing`` and the REGISTER's landing fields are left off the wire at their defaults."""
    t = _wire.Transfer(v=_wire.WIRE_VERSION, room=1, epoch=2, endpoint="tcp://127.0.0.1:5",
                       decode_rank=0, aux_slot=0, required=1, num_pages=3)
    pages = np.arange(3, dtype=np.int32)
    assert b"landing" not in _wire.encode(t, pages)[0]
    on = _wire.Transfer(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "landing": True})
    assert b"landing" in _wire.encode(on, pages)[0]


def test_a_whole_page_gather_is_one_block_per_buffer() -> None:
    """Scattered source pages, gathered whole into staging and written to consecutive
    landing pages: one block per buffer, every byte where the per-page copy puts it."""
    src = HostKVPool(layout="mha", num_pages=12, num_layers=2, page_size=2, head_bytes=4,
                     heads=2, page_pad=5)
    rng = np.random.default_rng(3)
    for buf in src.buffers:
        buf[:] = rng.integers(0, 256, buf.shape, np.uint8)
    dst = HostKVPool(layout="mha", num_pages=12, num_layers=2, page_size=2, head_bytes=4,
                     heads=2)
    area = LandingArea(dst.spec, 8 * sum(dst.spec.item_lens))
    land = landing_spec(dst.spec, area.bases, area.pages)
    assert stages_pages(src.spec, land, (0, 2)) and not stages_pages(src.spec, land, (0, 1))
    pages = np.array([7, 2, 11, 0, 5])
    staging = StagingArea(1 << 20)
    r = staging.reserve(5 * sum(land.item_lens))
    assert r is not None
    staging.gatherer(src.spec, pages, (0, 2), r, land.item_lens)()
    blocks = plan_staged(src.spec, land, np.arange(2, 7), r.addr)
    assert blocks.num_blocks == src.spec.num_buffers
    for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.lens.tolist(),
                       strict=True):
        ctypes.memmove(d, s, n)
    out = np.array([4, 9, 1, 3, 10])
    area.scatter(2, out)
    for b in range(src.spec.num_buffers):
        assert (_page_bytes(dst, b, out) == _page_bytes(src, b, pages)).all()


# ------------------------------------------------------------------------ agents


def _opts(engine: str, prefill_tp: int = 1, decode_tp: int = 1, layers: int = 2) -> DemoOptions:
    return DemoOptions(prefill_tp=prefill_tp, decode_tp=decode_tp, kv_heads=4, layers=layers,
                       page_size=4, head_bytes=16, max_tokens=64, engine=engine)


def _recording(calls: list[int]):  # type: ignore[no-untyped-def]
    """A FaultEngine wrapper that injects nothing and records each write's block count."""
    def wrap(engine: TransferEngine) -> TransferEngine:
        def policy(_index: int, _peer: str, nblocks: int) -> Fault | None:
            calls.append(nblocks)
            return None
        return FaultEngine(engine, policy)  # type: ignore[arg-type]
    return wrap


async def _room(c, room: int, n: int, *, prefix: int = 0, layers: bool = False,  # type: ignore[no-untyped-def]
                seed: int = 0, events: dict[str, trio.Event] | None = None):
    """One room of ``n`` request pages with shuffled pages on both sides, sent in two
    chunks by every prefill rank (layer by layer with ``layers``); decode holds the first
    ``prefix`` pages already. Returns the senders, receivers and decode's pages."""
    rng = np.random.default_rng(seed + room)
    senders = []
    src = rng.permutation(40)[:n]
    for i, rank in enumerate(c.prefill):
        rank.pool.fill(src, room)
        rank.pool.fill_aux(1, room)
        ev = None if events is None else events.get(f"p{i}")
        senders.append(rank.agent.sender(
            room, num_pages=n, aux_slot=1, on_release=None if ev is None else ev.set
        ))
    receivers, dsts = [], []
    for i, agent in enumerate(c.decode):
        # (rooms in flight together get disjoint pages: a third of 60 each)
        dst = (room % 3) * 20 + rng.permutation(20)[: n - prefix]
        r = agent.receiver(room, bootstrap_url=c.url, epoch=room + 1)
        ev = None if events is None else events.get(f"d{i}")
        r.init(dst, 2, prefix_pages=prefix, on_release=None if ev is None else ev.set)
        receivers.append(r)
        dsts.append(dst)
    for s in senders:
        if layers:
            nl = c.prefill[0].pool.spec.num_layers
            for layer in range(nl):
                s.send(src, layers=range(layer, layer + 1), last=layer == nl - 1)
        else:
            s.send(src[: n // 2])
            s.send(src[n // 2 :], last=True)
    return senders, receivers, dsts


async def _verified(c, room: int, n: int, **kw: object) -> None:  # type: ignore[no-untyped-def]
    prefix = int(kw.get("prefix", 0))  # type: ignore[call-overload]
    await _check(c, room, n, prefix, *await _room(c, room, n, **kw))  # type: ignore[arg-type]


async def _check(c, room: int, n: int, prefix: int, senders, receivers, dsts) -> None:  # type: ignore[no-untyped-def]
    """Success on every side, decode's bytes and aux row right."""
    with trio.fail_after(20):
        for s in senders:
            assert await s.wait() is KVPoll.Success
        for r in receivers:
            assert await r.wait() is KVPoll.Success, r.failure
    for pool, dst in zip(c.decode_pools, dsts, strict=True):
        assert (pool.read(dst) == pool.expected(room, n)[:, prefix:]).all()
        assert pool.aux_ok(2, room)


async def test_shuffled_pages_land_in_few_blocks(engine_name: str, bootstrap_url: str) -> None:
    """Shuffled pages on both sides: the room lands (one block per buffer per chunk, the
    aux row aside), every byte right, the landing area empty again."""
    calls: list[int] = []
    async with open_cluster(engine_name, bootstrap_url, _opts(engine_name),
                            wrap={0: _recording(calls)}, decode_config=LANDING) as c:
        for room in (3, 4):
            await _verified(c, room, 12)
        d = c.decode[0]
        assert d.statistics().rooms_landed == 2 and d.statistics().landing_full == 0
        assert d.landing is not None and d.landing.reserved == 0
        buffers = c.prefill[0].pool.spec.num_buffers
        # two chunks a room (maybe coalesced): at most 2 x buffers + the aux row
        assert calls and max(calls) <= 2 * buffers + 1, calls
        stats = c.prefill[0].agent.statistics()
        assert stats.chunks_staged >= 2 and stats.staging_full == 0


async def test_without_a_landing_area_the_blocks_are_per_page(
    engine_name: str, bootstrap_url: str
) -> None:
    calls: list[int] = []
    async with open_cluster(engine_name, bootstrap_url, _opts(engine_name),
                            wrap={0: _recording(calls)}) as c:
        await _verified(c, 3, 12)
        assert c.decode[0].landing is None and c.decode[0].statistics().rooms_landed == 0
        assert max(calls) > 2 * c.prefill[0].pool.spec.num_buffers + 1


async def test_prefix_pages_and_layerwise_sends_land(engine_name: str, bootstrap_url: str) -> None:
    """Decode holds the first pages already (only the rest land), and a room streamed layer
    by layer (each layer's chunk lands in its buffers): both right, both landed."""
    calls: list[int] = []
    async with open_cluster(engine_name, bootstrap_url, _opts(engine_name),
                            wrap={0: _recording(calls)}, decode_config=LANDING) as c:
        await _verified(c, 3, 12, prefix=5)
        await _verified(c, 4, 10, layers=True)
        await _verified(c, 5, 9, prefix=2, layers=True)
        d = c.decode[0]
        assert d.statistics().rooms_landed == 3 and d.landing is not None
        assert d.landing.reserved == 0
        # a layer's chunk: its K and V buffers, one block each (+ the aux row with the last)
        assert max(calls) <= 2 * c.prefill[0].pool.spec.num_buffers + 1, calls


@pytest.mark.parametrize("tps", [(2, 1), (1, 2)])
async def test_head_slices(engine_name: str, bootstrap_url: str,
                           tps: tuple[int, int]) -> None:
    """TP 1 -> 2: each decode rank's head slices are staged and land in one block per
    buffer. Prefill TP 2 -> decode TP 1: each of the two prefill ranks would write its
    heads one block per token slot wherever they land, so the room is not offered landing
    pages (it would only add the copy), and is right."""
    p, d = tps
    async with open_cluster(engine_name, bootstrap_url, _opts(engine_name, p, d),
                            decode_config=LANDING) as c:
        for room in (3, 4):
            await _verified(c, room, 12)
        for agent in c.decode:
            assert agent.statistics().rooms_landed == (2 if d > p else 0)
            assert agent.landing is not None and agent.landing.reserved == 0
        if d > p:
            assert c.prefill[0].agent.statistics().chunks_staged >= 2


async def test_a_full_landing_area_sends_the_room_its_own_pages(
    engine_name: str, bootstrap_url: str
) -> None:
    """A room that finds no free run of landing pages is written into its own pages as
    without landing, counted, and right."""
    # 4 buffers x 256 B a page: 1 KiB a landing page; 8 pages
    async with open_cluster(engine_name, bootstrap_url, _opts(engine_name),
                            decode_config=DecodeConfig(landing_bytes=8 << 10)) as c:
        await _verified(c, 3, 12)  # 12 pages: no run of 12
        d = c.decode[0].statistics()
        assert d.landing_full == 1 and d.rooms_landed == 0
        await _verified(c, 4, 8)
        assert c.decode[0].statistics().rooms_landed == 1


#: how long a test watches for something that must not happen
QUIET = 0.3


async def test_an_aborted_room_keeps_its_landing_range_until_its_drain(
    engine_name: str, bootstrap_url: str
) -> None:
    """A landed room aborted while its write is held inside the engine: its landing range
    stays reserved (no other room gets it: that one falls back, ``landing_full``) until the
    drain ack, its pages are never copied into (nothing of a failed room is scattered), and
    every landing page is back once, the area serving the next room again."""
    faults: list[FaultEngine] = []

    def wrap(engine: TransferEngine) -> TransferEngine:
        faults.append(FaultEngine(
            engine, lambda i, _peer, _n: Fault("stall") if i == 0 else None  # type: ignore[arg-type]
        ))
        return faults[0]

    # 12 landing pages of 1 KiB (4 buffers x 256 B): one room's
    async with open_cluster(engine_name, bootstrap_url, _opts(engine_name), wrap={0: wrap},
                            decode_config=DecodeConfig(landing_bytes=12 << 10)) as c:
        gate = faults[0].stalls
        try:
            d, pool = c.decode[0], c.decode_pools[0]
            area = d.landing
            assert area is not None and area.pages == 12
            ev = {"d0": trio.Event(), "p0": trio.Event()}
            senders, receivers, dsts = await _room(c, 3, 12, events=ev)
            with trio.fail_after(15):
                await gate.wait_stalled_async(1)  # room 3's write is inside the engine
            assert area.reserved == 12
            before = pool.read(dsts[0]).copy()
            receivers[0].abort("test: the scheduler gives up")
            await trio.sleep(QUIET)  # (nothing may happen here: no ack can come)
            assert area.reserved == 12 and not ev["d0"].is_set()
            assert d.statistics().pages_held == d.statistics().landing_held == 12
            # another room meanwhile: no free run, so its own pages (its write waits behind
            # the held one on the peer's lane)
            other = await _room(c, 4, 12)
            assert d.statistics().landing_full == 1 and area.reserved == 12
            gate.release_all()  # room 3's write lands (in its landing pages); then the ack
            with trio.fail_after(15):
                await ev["d0"].wait()
                await poll_until(lambda: area.reserved == 0)
            await _check(c, 4, 12, 0, *other)
            assert (pool.read(dsts[0]) == before).all(), "a failed room was copied out"
            assert d.statistics().rooms_landed == 0
            with trio.fail_after(15):
                assert await senders[0].wait() is KVPoll.Failed
            await _verified(c, 5, 12)  # the area serves again
            assert d.statistics().rooms_landed == 1 and area.reserved == 0
        finally:
            gate.release_all()


def test_the_copy_out_comes_before_success_and_only_for_success() -> None:
    """The room machine calls ``land`` once, when every rank reported Success and the aux
    row is the room's, while the room does not read Success yet; never when the aux row is
    wrong or a rank failed."""
    def room() -> DecodeRoom:
        r = DecodeRoom(room=1, epoch=2)
        r.bind([0, 1])
        r.init(np.arange(3, dtype=np.int32), 0)
        r.contacted(0)
        r.contacted(1)
        return r

    seen: list[KVPoll] = []
    r = room()
    assert r.on_status(0, True, "", lambda: True, lambda: seen.append(r.status)) == []
    assert seen == []
    due = r.on_status(1, True, "", lambda: True, lambda: seen.append(r.status))
    assert Succeeded() in due and seen == [KVPoll.WaitingForInput]
    assert r.status is KVPoll.Success
    r = room()
    r.on_status(0, True, "", lambda: True, lambda: seen.append(r.status))
    r.on_status(1, True, "", lambda: False, lambda: seen.append(r.status))  # bad aux row
    r = room()
    r.fail(TransferAborted("x"))
    r.on_status(0, True, "", lambda: True, lambda: seen.append(r.status))
    r.on_status(1, True, "", lambda: True, lambda: seen.append(r.status))
    assert seen == [KVPoll.WaitingForInput]


@pytest.mark.parametrize("story", ["succeeds", "prefill gives up"])
@pytest.mark.parametrize("victim", ["decode", "prefill"])
async def test_a_cancel_at_every_schedule_point_with_landing_loses_nothing(
    engine_name: str, bootstrap_url: str, victim: str, story: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tests/test_cancellation.py's trio sweep with a landing area on decode and each
    request's pages handed out in reverse (three runs: the room lands): a cancel at any
    await of either handler loses no page, frees none twice, leaves no late write in a page
    that went back, and every landing page comes back."""
    from . import test_cancellation as tc
    from .helpers.agents import open_pair

    of = tc.Books.of.__func__  # type: ignore[attr-defined]

    def reversed_books(cls: type, src: HostKVPool, dst: HostKVPool) -> tc.Books:
        books = of(cls, src, dst)
        alloc = books.dst.alloc

        async def backwards(n: int) -> np.ndarray:
            return (await alloc(n))[::-1].copy()

        books.dst.alloc = backwards  # type: ignore[method-assign]
        return books

    monkeypatch.setattr(tc.Books, "of", classmethod(reversed_books))
    async with open_pair(engine_name, bootstrap_url, decode_config=LANDING) as pair:
        handlers = {"decode": tc.decode_handler, "prefill": tc.prefill_handler}
        covered = await tc.sweep_trio(pair, victim, story, handlers)
        assert covered == tc.AWAITS[victim, story]
        with trio.fail_after(15):
            await poll_until(lambda: pair.decode.statistics().pages_held == 0)
        area = pair.decode.landing
        assert area is not None and area.reserved == 0
        if story == "succeeds":
            assert pair.decode.statistics().rooms_landed > 0


async def test_a_prefill_rank_that_does_not_say_it_takes_landing_pages_gets_none(
    engine_name: str, bootstrap_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill rank that publishes no ``landing`` (an older one, whose REGISTER and
    TRANSFER refuse the fields) is sent neither the landing area nor landing pages: the
    room goes to its own pages, right."""
    from trio_pd.agents import _prefill

    real = _prefill.PrefillRankInfo

    def older(**kw: object) -> object:
        kw.pop("landing", None)
        return real(**kw)  # type: ignore[arg-type]

    monkeypatch.setattr(_prefill, "PrefillRankInfo", older)
    async with open_cluster(engine_name, bootstrap_url, _opts(engine_name),
                            decode_config=LANDING) as c:
        await _verified(c, 3, 12)
        assert c.decode[0].statistics().rooms_landed == 0
        assert all(p.landing is None for p in c.prefill[0].agent.peers.all())


@pytest.mark.parametrize("tps", [(1, 1), (1, 2)])
async def test_per_buffer_geometry_lands(engine_name: str, bootstrap_url: str,
                                         tps: tuple[int, int]) -> None:
    """Head-major pages, V buffers with their own bytes per head and padding between pages
    on both sides, with two aux buffers more: the landing pages are packed per buffer, the
    copy-out honours the pool's page strides; every byte right, the pads untouched."""
    opts = replace(_opts(engine_name, *tps), page_layout="hnd", v_head_bytes=8, page_pad=24,
                   aux_buffers=2)
    async with open_cluster(engine_name, bootstrap_url, opts, decode_config=LANDING) as c:
        pads = [[buf.copy() for buf in pool.buffers] for pool in c.decode_pools]
        for room in (3, 4):
            await _verified(c, room, 12)
        for agent in c.decode:
            assert agent.statistics().rooms_landed == 2
        for pool, before in zip(c.decode_pools, pads, strict=True):
            for b, buf in enumerate(pool.buffers):
                stride, item = pool.spec.strides[b], pool.spec.item_lens[b]
                # (every page's pad: bytes past its page, before the next)
                pad = np.ones(buf.size, dtype=bool)
                for p in range(pool.spec.num_pages):
                    pad[p * stride : p * stride + item] = False
                assert (buf.ravel()[pad] == before[b].ravel()[pad]).all()


async def test_the_area_is_kept_when_decode_closes_with_a_range_held(
    bootstrap_url: str,
) -> None:
    """Decode closes while a landed room's write is held inside prefill's engine: the room
    is unproven at close (no drain ack within ``close_timeout``), so its landing range stays
    held, and the area's memory is kept for the life of the process (a write may still
    land there), though deregistered."""
    from trio_pd import open_decode, open_prefill
    from trio_pd.core import _landing
    from trio_pd.engines import make_engine

    from .helpers.agents import host_pool

    src, dst = host_pool(), host_pool()
    pe = FaultEngine(make_engine("mooncake"), lambda _i, _p, _n: Fault("stall"))  # type: ignore[arg-type]
    de = make_engine("mooncake")
    try:
        async with open_prefill(engine=pe, pool=src.spec, bootstrap_url=bootstrap_url,
                                kv_heads=2) as prefill:
            try:
                async with open_decode(
                    engine=de, pool=dst.spec,
                    config=DecodeConfig(landing_bytes=1 << 20, close_timeout=0.3),
                ) as decode:
                    area = decode.landing
                    assert area is not None
                    src_pages = np.array([5, 1, 9])
                    src.fill(src_pages, 7)
                    src.fill_aux(1, 7)
                    tx = prefill.sender(7, num_pages=3, aux_slot=1)
                    rx = decode.receiver(7, bootstrap_url=bootstrap_url)
                    rx.init(np.array([8, 2, 30]), 3)
                    tx.send(src_pages, last=True)
                    with trio.fail_after(15):
                        await pe.stalls.wait_stalled_async(1)
                    assert area.reserved == 3
                assert decode.statistics().rooms_unproven_at_close == 1
                assert area.reserved == 3 and area in _landing.KEPT
                assert not area.registered
            finally:
                pe.stalls.release_all()
    finally:
        pe.close()
        de.close()


def test_a_landing_target_vs_abort_every_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/test_schedules.py's publication-vs-abort race with a landing target: the chunk's
    source pages are gathered whole into staging and written to decode's landing pages, in
    every schedule of an abort let go at each point of the room's life. Exactly one STATUS;
    a Success has every byte in the landing pages; the staging range is back in every
    schedule; the release runs once, after the write returned."""
    from . import test_schedules as ts

    # (the explorer runs no threads: the staging area's registration runs inline)
    monkeypatch.setattr(trio.to_thread, "run_sync", ts.inline_run_sync(ts.Trace()))
    seen: set[str] = set()
    dst = ts.small_pool()
    area = LandingArea(dst.spec, 4 * sum(dst.spec.item_lens))

    def scenario_at(point: ts.Point, steps: int) -> object:
        async def scenario() -> None:
            for v in area._views:
                v[...] = 0
            async with trio.open_nursery() as nursery:
                rig = await ts.start_prefill(nursery, landing=(area.bases, area.pages))
                for buf in rig.src.buffers:
                    buf[...] = np.arange(buf.size, dtype=np.uint8).reshape(buf.shape)
                sender = rig.room(2, landing=True)
                src = np.array([5, 2])  # scattered: gathered whole into staging
                sender.send(src, last=True)
                before: list[bool] = []

                async def abort() -> None:
                    await ts.at(rig.trace, point, steps)
                    before.append(bool(rig.trace.sent(ts.wire.Status)))
                    rig.abort_from_decode()

                nursery.start_soon(abort)
                await trio.sleep(ts.SETTLE)
                nursery.cancel_scope.cancel()
            statuses = rig.trace.sent(ts.wire.Status)
            assert len(statuses) == 1, statuses
            seen.add("abort after STATUS" if before[0] else "abort first")
            assert statuses[0].ok == before[0]
            if statuses[0].ok:
                for b, view in enumerate(area._views):
                    assert (view[:2] == _page_bytes(rig.src, b, src)).all()
                assert rig.agent.statistics().chunks_staged == 1
            assert rig.agent.runner.planner.staging.units_reserved == 0
            assert rig.released == [0]
        return scenario

    runs = 0
    for point in ts.POINTS_ONE_CALL:
        for steps in range(3):
            runs += ts.assert_explored(scenario_at(point, steps))  # type: ignore[arg-type]
    assert seen == {"abort first", "abort after STATUS"} and runs > 12, runs


async def test_no_landing_area_for_a_pool_not_stated_host_memory() -> None:
    """The copy-out writes the pool with numpy: a pool whose KV buffers are not stated to
    be host memory (a device pool, or kinds unstated) gets no landing area, whatever
    ``landing_bytes`` says, and advertises none."""
    from trio_pd import open_decode
    from trio_pd.core._memory import _SPEC_FIELDS, PoolSpec
    from trio_pd.engines import make_engine

    from .helpers.agents import host_pool

    dst = host_pool()
    unstated = PoolSpec(**{f: getattr(dst.spec, f) for f in _SPEC_FIELDS})
    assert unstated.region_kinds is None
    de = make_engine("mooncake")
    try:
        async with open_decode(engine=de, pool=unstated, config=LANDING) as d:
            assert d.landing is None and d.sources.landing == ((), 0)
    finally:
        de.close()


async def test_a_landing_area_too_large_to_allocate_is_off_and_the_agent_serves(
    engine_name: str, bootstrap_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``landing_bytes`` beyond what the process can allocate (here 2**30 landing pages of
    512 KiB: more than a 48-bit address space, refused whatever the overcommit policy): the
    decode agent opens without a landing area, says so once, and serves. (It used to fail
    to open with numpy's MemoryError: a careless TRIO_PD_LANDING_BYTES took the decode rank
    down.)"""
    opts = replace(_opts(engine_name), head_bytes=4096, page_size=8)
    async with open_cluster(engine_name, bootstrap_url, opts,
                            decode_config=DecodeConfig(landing_bytes=1 << 62)) as c:
        d = c.decode[0]
        assert d.landing is None and d.sources.landing == ((), 0)
        await _verified(c, 3, 6)
        assert d.statistics().rooms_landed == 0
    assert [r for r in caplog.records if "could not be allocated" in r.getMessage()]


@pytest.mark.parametrize("nbytes", [64e6, "64M", None, -1, True])
async def test_a_landing_size_that_is_not_bytes_is_refused_up_front(nbytes: object) -> None:
    """``landing_bytes`` that is not an int >= 0 (a float such as ``64e6``, a string, None,
    a negative count, a bool) is a ConfigurationError naming it before anything starts. (A
    float failed with a TypeError from the area's allocation, None and a string with one from
    a compare, and -1 was taken as "off".)"""
    from trio_pd import ConfigurationError, open_decode
    from trio_pd.engines import make_engine

    from .helpers.agents import host_pool

    de = make_engine("mooncake")
    try:
        with pytest.raises(ConfigurationError, match="landing_bytes"):
            async with open_decode(engine=de, pool=host_pool().spec,
                                   config=DecodeConfig(landing_bytes=nbytes)):  # type: ignore[arg-type]
                pass
    finally:
        de.close()


async def test_a_close_cut_short_still_keeps_a_held_landing_area() -> None:
    """``open_decode``'s close runs under a 10 s deadline; one that ran out before the
    landing area's turn (a slow drain, a slow deregistration) must still keep the memory of
    an area whose range a room holds (a write may still land there), not leave it to be
    freed with the agent. ``close_landing`` decides that before its first schedule point."""
    from types import SimpleNamespace

    from trio_pd.agents._decode import close_landing
    from trio_pd.core import _landing

    from .helpers.agents import host_pool

    area = LandingArea(host_pool().spec, 1 << 20)
    assert area.usable and area.reserve(3) is not None
    unregistered: list[object] = []
    agent = SimpleNamespace(landing=area, engine=SimpleNamespace(unregister=unregistered.append))
    try:
        with trio.CancelScope() as scope:
            scope.cancel()  # (the close's deadline has passed)
            await close_landing(agent, area)  # type: ignore[arg-type]
        assert area in _landing.KEPT, "a held landing area was left to be freed"
        assert agent.landing is None and not area.registered
    finally:
        if area in _landing.KEPT:
            _landing.KEPT.remove(area)


# ------------------------------------------------------------------------ a moved landing area


SENTINEL = 0xEE


@pytest.mark.parametrize("change", ["same", "moved", "fewer pages"])
async def test_a_reregister_that_moves_the_landing_area_fails_the_rooms_resolved_against_it(
    insecure: None, engine_name: str, bootstrap_url: str, change: str
) -> None:
    """A decode endpoint (a raw one: real engine, real memory, real sockets) registers a
    landing area A, gets a room's first chunk written there, has a second room's TRANSFER
    parked, then sends a second REGISTER with the SAME engine session advertising area B
    (other bases, or fewer pages), while its memory for both stays registered with the
    engine, so only prefill's own check stands between a stale room and the wrong bytes.

    The rooms resolved against A fail with PeerLost (no Success for bytes that did not all
    land in one registered area), counted; not a byte lands outside the area the endpoint
    registered when it was written (guards around and between the areas stay untouched, A
    is not written after the REGISTER that moved it, B gets nothing of a room resolved
    against A); a parked TRANSFER resolved against A is dropped, and the room's TRANSFER
    against B lands there; every page comes back. A REGISTER that moves nothing (``same``)
    keeps the rooms: they complete into A."""
    async with open_pair(engine_name, bootstrap_url) as pair, fake_decode() as fake:
        p, spec = pair.prefill, pair.dst.spec
        items = spec.item_lens
        pages, guard = 8, 4096
        per_page = sum(items)
        # guard | A (buffer after buffer) | guard | B | guard, one registered region
        mem = np.full(4 * guard + 2 * pages * per_page, SENTINEL, dtype=np.uint8)
        base = int(mem.ctypes.data)
        a_at, b_at = guard, 2 * guard + pages * per_page

        def bases(at: int) -> tuple[int, ...]:
            out, off = [], at
            for item in items:
                out.append(base + off)
                off += pages * item
            return tuple(out)

        def area(at: int) -> list[np.ndarray]:
            """Each buffer's landing pages at ``at``, as (pages, item) views of ``mem``."""
            out, off = [], at
            for item in items:
                out.append(mem[off : off + pages * item].reshape(pages, item))
                off += pages * item
            return out

        engine = make_engine(engine_name)
        try:
            await trio.to_thread.run_sync(
                engine.register,
                [*spec.regions(), Region(base, int(mem.nbytes), HOST)],
            )
            first = register(fake.endpoint, engine, spec, landing_bases=bases(a_at),
                             landing_pages=pages)
            second = {
                "same": first,
                "moved": msgspec.structs.replace(first, landing_bases=bases(b_at)),
                "fewer pages": msgspec.structs.replace(first, landing_pages=2),
            }[change]
            src1, src2 = np.array([10, 3, 17, 5]), np.array([20, 8, 31, 2])
            for room, src in ((1, src1), (2, src2)):
                pair.src.fill(src, room)
                pair.src.fill_aux(room, room)
            async with raw_push(p.endpoint) as sock:

                async def send(msg: _wire.Message, ids: list[int] | None = None) -> None:
                    arr = None if ids is None else np.array(ids, dtype=np.int32)
                    await sock.send_multipart(_wire.encode(msg, arr))

                await send(first)
                await barrier(sock, fake)
                s1 = p.sender(1, num_pages=4, aux_slot=1)
                await send(transfer(1, 1, fake.endpoint, 4, aux_slot=1, landing=True),
                           [0, 1, 2, 3])
                await send(transfer(2, 2, fake.endpoint, 4, aux_slot=2, landing=True),
                           [4, 5, 6, 7])  # parked: no sender for room 2 yet
                await barrier(sock, fake)
                s1.send(src1[:2])
                with trio.fail_after(10):  # room 1's first chunk has landed in A
                    await poll_until(lambda: p.statistics().leases_live == 0)
                assert s1.poll() is not KVPoll.Failed, s1.failure
                for b, view in enumerate(area(a_at)):
                    assert (view[:2] == _page_bytes(pair.src, b, src1[:2])).all()

                await send(second)
                await barrier(sock, fake)
                before = mem.copy()
                s1.send(src1[2:], last=True)
                s2 = p.sender(2, num_pages=4, aux_slot=2)
                s2.send(src2, last=True)
                if change == "same":  # nothing moved: both rooms complete into A
                    with trio.fail_after(15):
                        assert await s1.wait() is KVPoll.Success, s1.failure
                        assert await s2.wait() is KVPoll.Success, s2.failure
                    for b, view in enumerate(area(a_at)):
                        assert (view[:4] == _page_bytes(pair.src, b, src1)).all()
                        assert (view[4:] == _page_bytes(pair.src, b, src2)).all()
                    assert (mem[b_at:] == before[b_at:]).all(), "B was written"
                else:
                    with trio.fail_after(15):
                        assert await s1.wait() is KVPoll.Failed
                        assert isinstance(s1.failure, PeerLost), s1.failure
                        assert "other memory" in str(s1.failure)
                        status = await fake.next_matching(
                            lambda m: isinstance(m, _wire.Status) and m.room == 1
                        )
                    assert isinstance(status, _wire.Status) and not status.ok
                    # nothing of room 1 after the move, nor of the parked room 2, anywhere
                    assert (mem == before).all(), "a room resolved against A was written"
                    assert s2.poll() is not KVPoll.Success
                    # room 2, sent again against the registration now, goes where it says
                    await send(transfer(2, 2, fake.endpoint, 4, aux_slot=2, landing=True),
                               [0, 1, 2, 3])
                    await barrier(sock, fake)
                    with trio.fail_after(15):
                        got = await s2.wait()
                    ranges: list[tuple[int, int]] = []
                    if change == "moved":
                        assert got is KVPoll.Success, s2.failure
                        off = b_at
                        for b, (view, item) in enumerate(zip(area(b_at), items, strict=True)):
                            assert (view[:4] == _page_bytes(pair.src, b, src2)).all()
                            ranges.append((off, off + 4 * item))
                            off += pages * item
                    else:  # 4 ids for an area of 2 pages now: refused, nothing written
                        assert got is KVPoll.Failed and isinstance(s2.failure, ProtocolError)
                    changed = np.flatnonzero(mem != before)
                    assert all(any(a <= int(i) < z for a, z in ranges) for i in changed), (
                        "a byte landed outside room 2's landing pages"
                    )
                    assert not any(st.ok for st in fake.statuses(1)), "room 1 reported Success"
                with trio.fail_after(10):
                    await s1.wait_released()
                    await s2.wait_released()
            # the guards around and between the areas were never written
            for lo, hi in ((0, a_at), (a_at + pages * per_page, b_at),
                           (b_at + pages * per_page, len(mem))):
                assert (mem[lo:hi] == SENTINEL).all(), f"a guard byte in [{lo}, {hi}) written"
            stats = p.statistics()
            assert stats.registrations_moved == (change != "same")
            assert stats.leases_live == 0 and stats.leases_quarantined == 0
            with trio.fail_after(10):
                await poll_until(lambda: p.statistics().rooms_active == 0)
        finally:
            await trio.to_thread.run_sync(engine.close)
