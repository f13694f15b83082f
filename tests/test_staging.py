"""Staged head slices (trio_pd.core._staging): when decode runs at a larger TP than prefill, a
chunk's head slices are gathered into the prefill rank's staging area and written as one
block per run of destination pages.

The plan and the gather are checked on real memory against the per-token-slot copy they
replace (hypothesis); the agents are checked end to end on real engines, with the lifetime
rule of a staging range: back to the area once its call completed or never started, kept
while a failed call may still read it (until the room's pages are released).
"""

from __future__ import annotations

import ctypes
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_pd import KVPoll, PrefillConfig
from trio_pd.core._plan import Blocks, plan_pages, plan_staged, staged_bytes, stages_heads
from trio_pd.core._staging import UNIT, StagingArea
from trio_pd.core._topology import write_heads
from trio_pd.engines import TransferEngine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.testing.pools import HostKVPool
from trio_pd.tools._demo import DemoOptions

from .helpers.agents import poll_until
from .helpers.cluster import open_cluster

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _copy(blocks: Blocks) -> None:
    """Carry out ``blocks`` in this process, as an engine would."""
    for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.lens.tolist(),
                       strict=True):
        ctypes.memmove(d, s, n)


def _pools(total: int, d: int, rank: int, page_size: int, head_bytes: int,
           layers: int, v_head_bytes: int | None = None, pads: tuple[int, int] = (0, 0),
           ) -> tuple[HostKVPool, HostKVPool]:
    """A prefill pool of TP 1 (every head, random bytes) and decode rank ``rank`` of TP ``d``;
    V buffers of ``v_head_bytes`` per head if given, and ``pads`` bytes between pages on
    each side (per-buffer geometry)."""
    hbs = () if v_head_bytes is None else (head_bytes,) * layers + (v_head_bytes,) * layers
    src = HostKVPool(layout="mha", num_pages=12, num_layers=layers, page_size=page_size,
                     head_bytes=head_bytes, heads=total, buffer_head_bytes=hbs,
                     page_pad=pads[0])
    rng = np.random.default_rng(total * 31 + d)
    for buf in src.buffers:
        buf[:] = rng.integers(0, 256, buf.shape, np.uint8)
    per = max(1, total // d)
    first = rank * total // d if d > total else rank * per
    dst = HostKVPool(layout="mha", num_pages=10, num_layers=layers, page_size=page_size,
                     head_bytes=head_bytes, heads=per, first_head=first,
                     buffer_head_bytes=hbs, page_pad=pads[1])
    return src, dst


@FAST
@given(
    heads_d=st.sampled_from([(2, 2), (4, 2), (4, 4), (2, 4), (8, 4)]),
    page_size=st.integers(1, 5),
    head_bytes=st.integers(1, 9),
    layers=st.integers(1, 2),
    v_head_bytes=st.sampled_from([None, None, 1, 5]),
    pads=st.sampled_from([(0, 0), (0, 0), (3, 0), (0, 7), (2, 5)]),
    data=st.data(),
)
def test_staged_copy_equals_the_per_slot_copy(
    heads_d: tuple[int, int], page_size: int, head_bytes: int, layers: int,
    v_head_bytes: int | None, pads: tuple[int, int], data: st.DataObject,
) -> None:
    """For TP 1 -> D (GQA replication included: D > heads), gathering into staging and
    writing plan_staged's blocks leaves every destination byte as the per-token-slot plan
    does, touches nothing else, and costs one block per run of consecutive destination pages
    per buffer (per page where the destination leaves room between pages). Pools with K != V
    and page strides too."""
    total, d = heads_d
    rank = data.draw(st.integers(0, d - 1))
    src, dst = _pools(total, d, rank, page_size, head_bytes, layers, v_head_bytes, pads)
    heads = write_heads(0, rank, 1, d, total, "mha")
    assert heads is not None
    assert stages_heads(src.spec, dst.spec, heads)
    n = data.draw(st.integers(1, 8))
    src_pages = np.array(data.draw(st.lists(st.integers(0, 11), min_size=n, max_size=n)))
    dst_pages = np.array(data.draw(st.permutations(range(10)))[:n])
    if data.draw(st.booleans()):
        dst_pages = np.sort(dst_pages)

    want = HostKVPool(layout="mha", num_pages=10, num_layers=layers, page_size=page_size,
                      head_bytes=head_bytes, heads=dst.spec.heads,
                      first_head=dst.spec.first_head, buffer_head_bytes=dst.spec.buffer_head_bytes,
                      page_pad=pads[1])
    _copy(plan_pages(src.spec, want.spec, src_pages, dst_pages, heads=heads))

    area = StagingArea(4 * UNIT, unit=256)
    r = area.reserve(staged_bytes(src.spec, dst.spec, n))
    assert r is not None
    area.gatherer(src.spec, src_pages, heads, r, dst.spec.item_lens)()
    blocks = plan_staged(src.spec, dst.spec, dst_pages, r.addr)
    _copy(blocks)

    for got, expected in zip(dst.buffers, want.buffers, strict=True):
        np.testing.assert_array_equal(got, expected)  # (zeros where nothing was written)
    breaks = int(np.count_nonzero(np.diff(dst_pages) != 1))
    runs = (breaks + 1) if not pads[1] else n
    assert blocks.num_blocks == runs * src.spec.num_buffers
    assert blocks.nbytes == n * sum(dst.spec.item_lens)
    for s, ln in zip(blocks.src.tolist(), blocks.lens.tolist(), strict=True):
        assert r.addr <= s and s + ln <= r.addr + r.nbytes  # reads only its own range


def test_only_a_slice_onto_whole_destination_slots_is_staged() -> None:
    """P == D and MLA copy whole pages; P > D lands on part of each destination slot (its
    side is strided too): neither goes through staging."""
    full = HostKVPool(layout="mha", num_pages=4, num_layers=1, page_size=2, head_bytes=4,
                      heads=4).spec
    half = HostKVPool(layout="mha", num_pages=4, num_layers=1, page_size=2, head_bytes=4,
                      heads=2, first_head=2).spec
    mla = HostKVPool(layout="mla", num_pages=4, num_layers=1, page_size=2, head_bytes=4).spec
    assert stages_heads(full, half, (2, 4))  # TP 1 -> 2, rank 1
    assert not stages_heads(half, full, (2, 4))  # TP 2 -> 1: a slice of each decode slot
    assert not stages_heads(full, full, (0, 4))  # whole pages
    assert not stages_heads(mla, mla, (0, 1))
    assert not stages_heads(full, half, None)


def test_the_area_reserves_first_fit_and_says_when_it_is_full() -> None:
    area = StagingArea(4 * UNIT)
    a = area.reserve(UNIT + 1)  # two units
    b = area.reserve(UNIT)
    assert a is not None and b is not None and (a.first, a.units, b.first) == (0, 2, 2)
    assert area.reserve(2 * UNIT) is None  # one unit is left
    area.give(a)
    c = area.reserve(2 * UNIT)
    assert c is not None and c.first == 0 and c.addr == area.region.base
    assert area.reserve(0) is None and area.reserve(5 * UNIT) is None
    area.hold("room", b)
    assert area.held == 1 and area.units_reserved == 3
    area.release_held("room")
    assert area.held == 0 and area.units_reserved == 2
    assert StagingArea(UNIT - 1).usable is False
    assert area.region.base % 4096 == 0


# ------------------------------------------------------------------------ agents


def _opts(engine: str) -> DemoOptions:
    return DemoOptions(prefill_tp=1, decode_tp=2, kv_heads=4, layers=2, page_size=4,
                       head_bytes=16, max_tokens=64, engine=engine)


async def _room(c, room: int, n: int, on_released: dict[str, trio.Event]):  # type: ignore[no-untyped-def]
    """One room from prefill rank 0 to both decode ranks, fully sent."""
    p = c.prefill[0]
    src = np.arange(2, 2 + n)
    p.pool.fill(src, room)
    p.pool.fill_aux(1, room)
    sender = p.agent.sender(room, num_pages=n, aux_slot=1, on_release=on_released["p"].set)
    receivers, dsts = [], []
    for i, agent in enumerate(c.decode):
        dst = np.arange(30, 30 + n)[:: 1 if i else -1].copy()
        r = agent.receiver(room, bootstrap_url=c.url, epoch=room + 1)  # one per request
        r.init(dst, 2, on_release=on_released[f"d{i}"].set)
        receivers.append(r)
        dsts.append(dst)
    sender.send(src[: n // 2])
    sender.send(src[n // 2 :], last=True)
    return sender, receivers, dsts


async def _verified_room(c, room: int, n: int) -> None:  # type: ignore[no-untyped-def]
    """One room of ``n`` pages to both decode ranks: Success everywhere, each rank's bytes
    right, and prefill's pages released."""
    ev = {k: trio.Event() for k in ("p", "d0", "d1")}
    sender, receivers, dsts = await _room(c, room, n, ev)
    with trio.fail_after(15):
        assert await sender.wait() is KVPoll.Success
        for r in receivers:
            assert await r.wait() is KVPoll.Success
        await ev["p"].wait()  # (decode's pages are the scheduler's after a Success)
    for pool, dst in zip(c.decode_pools, dsts, strict=True):
        assert (pool.kv[:, dst, :] == pool.expected(room, len(dst))).all()
        assert pool.aux_ok(2, room)


async def test_decode_at_a_larger_tp_gets_staged_writes(
    engine_name: str, bootstrap_url: str
) -> None:
    """TP 1 -> 2: every chunk to each decode rank is staged, the bytes are each rank's heads,
    and the area is empty again after."""
    async with open_cluster(engine_name, bootstrap_url, _opts(engine_name)) as c:
        for room in (5, 6):
            await _verified_room(c, room, 8)
        stats = c.prefill[0].agent.statistics()
        # every write staged (the two chunks of a room may have coalesced into one)
        assert stats.chunks_staged == stats.engine_calls + stats.chunks_batched >= 2 * 2
        assert stats.staging_full == 0
        assert c.prefill[0].agent.runner.planner.staging.units_reserved == 0


async def test_a_full_area_writes_in_place(engine_name: str, bootstrap_url: str) -> None:
    """An area too small for a chunk: the chunk goes per token slot, counted, still right."""
    async with open_cluster(
        engine_name, bootstrap_url, _opts(engine_name),
        prefill_config=PrefillConfig(staging_bytes=UNIT),
    ) as c:
        # 2 layers K+V = 4 buffers x 40 pages x 128 B = 20 KiB per chunk: fits one unit
        # while the other decode rank's chunk holds it, then not
        await _verified_room(c, 7, 80)
        stats = c.prefill[0].agent.statistics()
        assert stats.staging_full >= 1 and stats.chunks_staged >= 1, stats


def _partial_once() -> object:
    fired: list[int] = []

    def rule(_index: int, _peer: str, _nblocks: int) -> Fault | None:
        if fired:
            return None
        fired.append(1)
        return Fault("partial")

    return rule


@asynccontextmanager
async def _a_quarantined_staged_room(
    engine_name: str, url: str, fence: float, close_timeout: float | None = None
) -> AsyncIterator[tuple[Any, Any, StagingArea, dict[str, trio.Event], list[FaultEngine]]]:
    """A cluster whose prefill rank 0 has one room quarantined: its staged write failed
    partway (half its blocks landed, outcome unknown), so the area holds its range. Yields
    the cluster, that agent, its staging area, the room's release events and the fault
    wrapper. ``close_timeout``: how long that agent's close waits for the quarantine."""
    faulty: list[FaultEngine] = []

    def wrap(engine: TransferEngine) -> TransferEngine:
        faulty.append(FaultEngine(engine, _partial_once()))  # type: ignore[arg-type]
        return faulty[0]

    async with open_cluster(engine_name, url, _opts(engine_name), wrap={0: wrap},
                            prefill_config=PrefillConfig(quarantine_fence=fence,
                                                         close_timeout=close_timeout)) as c:
        agent = c.prefill[0].agent
        area = agent.runner.planner.staging
        events = {k: trio.Event() for k in ("p", "d0", "d1")}
        sender, _receivers, _ = await _room(c, 8, 8, events)
        with trio.fail_after(15):
            assert await sender.wait() is KVPoll.Failed
            await poll_until(lambda: agent.statistics().leases_quarantined == 1)
        assert area.held == 1 and area.units_reserved >= 1
        yield c, agent, area, events, faulty


async def test_a_failed_staged_write_keeps_its_range_until_the_room_is_released(
    engine_name: str, bootstrap_url: str
) -> None:
    """A staged write that fails (half its blocks landed, outcome unknown) keeps its staging
    range out of the area while the room is quarantined (the engine may still read it: a
    later chunk must not gather into it); the range comes back with the room's pages."""
    async with _a_quarantined_staged_room(engine_name, bootstrap_url, 3.0) as (
        c, agent, area, ev, faulty
    ):
        assert not ev["p"].is_set()
        # another room meanwhile (once a probe cleared the peers' failed marks): staged
        # too, into other units, and right
        with trio.fail_after(15):
            await poll_until(lambda: not any(p.failed for p in agent.peers.all()))
        assert area.held == 1
        await _verified_room(c, 9, 4)
        assert area.held == 1  # still: the first room is quarantined
        with trio.fail_after(15):
            await ev["p"].wait()  # the fence passed, the peers answered: released
            await poll_until(lambda: area.units_reserved == 0)
        assert area.held == 0
        assert faulty[0].statistics().faults.get("partial", 0) == 1


@pytest.mark.parametrize("where", ["gather", "plan", "quick plan"])
async def test_a_staged_chunk_whose_planning_fails_gives_its_range_back(
    engine_name: str, bootstrap_url: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Planning a staged chunk raises after its range was reserved (making the gather, the
    general plan, or the quick plan): no engine call was made, so the range goes back at
    once and the room fails; it stayed reserved for good when the gather or the general
    plan raised."""
    from trio_pd.agents import _chunks

    def boom(*_args: object, **_kwargs: object) -> Any:
        raise RuntimeError(f"test: the {where} failed")

    async with open_cluster(engine_name, bootstrap_url, _opts(engine_name)) as c:
        agent = c.prefill[0].agent
        area = agent.runner.planner.staging
        if where == "gather":
            monkeypatch.setattr(area, "gatherer", boom)
        elif where == "plan":
            monkeypatch.setattr(_chunks, "plan_staged_small", lambda *_a: None)
            monkeypatch.setattr(_chunks, "plan_staged", boom)
        else:
            monkeypatch.setattr(_chunks, "plan_staged_small", boom)
        events = {k: trio.Event() for k in ("p", "d0", "d1")}
        sender, _receivers, _ = await _room(c, 11, 8, events)
        with trio.fail_after(15):
            assert await sender.wait() is KVPoll.Failed
            await events["p"].wait()
        assert area.units_reserved == 0 and area.held == 0


async def test_the_area_stays_allocated_when_the_agent_closes_with_a_range_held(
    bootstrap_url: str,
) -> None:
    """A staged write that failed keeps its range (the engine may still read it); the
    agent closing then handed it back with the room's source pages, so close_staging found
    nothing held and let the area be freed (found by a review). The range stays held and
    the area is kept for the life of the process."""
    from trio_pd.agents import _chunks

    # (the rule is the agent's, whatever the engine; the close gives up waiting for the
    # quarantine after 0.5 s)
    async with _a_quarantined_staged_room("mooncake", bootstrap_url, 30.0, 0.5) as (
        c, _agent, area, _ev, _faulty
    ):
        c.prefill[0].scope.cancel()
        with trio.fail_after(15):
            await c.prefill[0].closed.wait()
        assert area.held == 1 and area in _chunks._KEPT


@pytest.mark.parametrize("size", [0])
async def test_staging_off_writes_per_slot(size: int, bootstrap_url: str) -> None:
    """``staging_bytes=0``: nothing is staged, the bytes are right all the same."""
    async with open_cluster(
        "mooncake", bootstrap_url, _opts("mooncake"),
        prefill_config=PrefillConfig(staging_bytes=size),
    ) as c:
        await _verified_room(c, 3, 6)
        assert c.prefill[0].agent.statistics().chunks_staged == 0
