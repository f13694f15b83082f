"""Layer-wise streaming (docs/layerwise.md): ``send(pages, layers=range(a, b))``.

The room machine's rules (each layer of a page admitted once, the last send completes every
layer, layer groups coalesce), the planner's blocks for a layer group, and the real agents
on both engines: bytes per layer, Success only after every layer's write, release only after
every layer's write returned, an abort between layer groups.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio

from trio_pd import AdmissionClosed, KVPoll, ProtocolError
from trio_pd.core._memory import layer_buffers, layer_view
from trio_pd.core._plan import plan_pages
from trio_pd.core._rooms import PeerPool, PrefillRoom, PublishDue, RunChunks
from trio_pd.core._state import Outcome
from trio_pd.engines import TransferEngine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.testing.pools import DEST_POISON, PageAllocator
from trio_pd.tools._demo import DemoOptions

from .helpers.agents import host_pool, open_pair, poll_until
from .helpers.aio import open_agents as open_aio_agents
from .helpers.cluster import open_cluster
from .helpers.faults import break_the_drain
from .helpers.pp import BOUND, PAGES, check_layers, open_pp
from .helpers.threads import agents
from .helpers.threads import poll_until as thread_poll_until


def ready_room(num_pages: int, num_layers: int) -> PrefillRoom:
    room = PrefillRoom(1, num_pages, 0, 64, num_layers=num_layers)
    room.expected_targets = 0  # (no decode rank needed to queue chunks)
    return room


# ------------------------------------------------------------------------------ the machine


def test_each_layer_of_a_page_is_admitted_once() -> None:
    room = ready_room(4, 3)
    assert room.admit(np.array([5, 6]), False, layers=(0, 1)) == [RunChunks(1)]
    # the same pages again for layer 0: refused, nothing changes
    with pytest.raises(ProtocolError, match="layer 0 was admitted"):
        room.admit(np.array([5, 6]), False, layers=(0, 1))
    assert room.layer_pages == [2, 0, 0] and len(room.leases.live) == 1
    # layers at different pages cannot go in one send
    with pytest.raises(ProtocolError, match="different request pages"):
        room.admit(np.array([7, 8]), False, layers=(0, 2))
    # another layer must name the pages the first named at those positions
    with pytest.raises(ProtocolError, match="request page 0 is page 5"):
        room.admit(np.array([6, 5]), False, layers=(1, 3))
    room.admit(np.array([5, 6]), False, layers=(1, 3))
    assert room.layer_pages == [2, 2, 2] and room.sent_pages == 2
    # a page of the request cannot come back as a later page
    with pytest.raises(ProtocolError, match="page 5 is request page 0 already"):
        room.admit(np.array([5, 9]), False, layers=(0, 1))
    with pytest.raises(ProtocolError, match="not a range inside"):
        room.admit(np.array([7]), False, layers=(2, 4))


def test_the_last_send_completes_every_layer_of_every_page() -> None:
    room = ready_room(2, 2)
    room.admit(np.array([1, 2]), False, layers=(1, 2))
    with pytest.raises(ProtocolError, match="leaves layer 0 at page 0"):
        room.admit(np.array([]), True, layers=(1, 2))
    with pytest.raises(ProtocolError, match="leaves layer 0 at page 1"):
        room.admit(np.array([1]), True, layers=(0, 1))
    room.admit(np.array([1, 2]), True, layers=(0, 1))
    assert room.last_admitted and room.sent_pages == 2


def test_whole_chunks_then_layers_still_admit_each_layer_once() -> None:
    room = ready_room(4, 2)
    room.admit(np.array([10, 11]), False)  # every layer of request pages 0, 1
    with pytest.raises(ProtocolError, match="page 10 is request page 0 already"):
        room.admit(np.array([10, 11]), False, layers=(0, 1))
    room.admit(np.array([12, 13]), False, layers=(0, 1))
    room.admit(np.array([12, 13]), True, layers=(1, 2))


def test_layer_groups_of_one_chunk_coalesce_into_one_call() -> None:
    room = ready_room(4, 4)
    pages = np.array([3, 4])
    for layer in range(4):
        room.admit(pages, layer == 3 and False, layers=(layer, layer + 1))
    taken = room.take_chunks(64)
    assert taken is not None
    chunk, joined = taken
    assert joined == 3 and chunk.layers is None and list(chunk.pages) == [3, 4]
    assert len(room.leases.live) == 1
    # the next pages of one layer join along pages, not across layers
    room.admit(np.array([5]), False, layers=(0, 1))
    room.admit(np.array([6]), False, layers=(0, 1))
    room.admit(np.array([5]), False, layers=(1, 2))
    taken = room.take_chunks(64)
    assert taken is not None
    chunk, joined = taken
    assert (joined, chunk.layers, list(chunk.pages)) == (1, (0, 1), [5, 6])
    chunk2, joined2 = room.take_chunks(64) or (None, -1)
    assert chunk2 is not None and (joined2, chunk2.layers) == (0, (1, 2))
    room.chunk_settled(chunk, Outcome.COMPLETED, None)
    assert not room.leases.closed


# ------------------------------------------------------------------------------ planning


@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_a_layer_group_plans_only_its_buffers(layout: str) -> None:
    src, dst = host_pool(layout, num_layers=4), host_pool(layout, num_layers=4)
    pages = np.array([1, 2, 3])
    whole = plan_pages(src.spec, dst.spec, pages, pages + 10)
    group = plan_pages(layer_view(src.spec, 1, 2), layer_view(dst.spec, 1, 2), pages, pages + 10)
    picks = layer_buffers(layout, 4, 1, 2)
    per_buffer = whole.num_blocks // src.spec.num_buffers
    want = np.concatenate([whole.dst[b * per_buffer : (b + 1) * per_buffer] for b in picks])
    assert list(group.dst) == list(want)
    assert group.nbytes * 2 == whole.nbytes


# ------------------------------------------------------------------------------ real engines


async def test_layer_by_layer_bytes_arrive(engine_name: str, bootstrap_url: str) -> None:
    """A model loop's sends: each layer of a chunk as it is computed, two chunks; the aux
    row with the last layer of the last chunk. Every byte lands; Success once."""
    src, dst = host_pool(num_layers=3), host_pool(num_layers=3)
    async with open_pair(engine_name, bootstrap_url, src=src, dst=dst) as pair:
        src_pages = np.array([3, 4, 5, 9, 10])
        dst_pages = np.array([100, 101, 7, 8, 9])
        pair.src.fill(src_pages, room=77)
        pair.src.fill_aux(5, room=77)
        sender = pair.prefill.sender(77, num_pages=5, aux_slot=5)
        receiver = pair.decode.receiver(77, bootstrap_url=bootstrap_url)
        receiver.init(dst_pages, 3)
        for i, chunk in enumerate((src_pages[:2], src_pages[2:])):
            for layer in range(3):
                await trio.sleep(0.002)  # "compute"
                sender.send(chunk, layers=range(layer, layer + 1), last=(i, layer) == (1, 2))
        with pytest.raises(ProtocolError):
            sender.send(src_pages[:1], layers=range(0, 1))
        with trio.fail_after(20):
            assert await receiver.wait() is KVPoll.Success
            assert await sender.wait() is KVPoll.Success
            await sender.wait_released()
        assert pair.verify(77, dst_pages, 3)
        stats = pair.prefill.statistics()
        assert stats.sends_refused == 1 and stats.leases_live == 0


async def test_layer_groups_are_staged_for_a_larger_decode_tp(
    engine_name: str, bootstrap_url: str
) -> None:
    """TP 1 -> 2 (MHA, staged head slices): each layer group is gathered and written on its
    own; both decode ranks hold their heads of every layer."""
    opts = DemoOptions(prefill_tp=1, decode_tp=2, kv_heads=4, layers=2, page_size=4,
                       head_bytes=16, max_tokens=64, engine=engine_name)
    async with open_cluster(engine_name, bootstrap_url, opts) as c:
        p, n, room = c.prefill[0], 6, 9
        src = np.arange(2, 2 + n)
        p.pool.fill(src, room)
        p.pool.fill_aux(1, room)
        sender = p.agent.sender(room, num_pages=n, aux_slot=1)
        receivers, dsts = [], []
        for i, agent in enumerate(c.decode):
            dst = np.arange(30, 30 + n)[:: 1 if i else -1].copy()
            r = agent.receiver(room, bootstrap_url=c.url, epoch=room + 1)
            r.init(dst, 2)
            receivers.append(r)
            dsts.append(dst)
        for layer in range(2):
            sender.send(src, layers=range(layer, layer + 1), last=layer == 1)
            with trio.fail_after(15):  # (written alone: not coalesced with the next)
                await poll_until(lambda: p.agent.statistics().chunks_staged >= 2)
        with trio.fail_after(15):
            for r in receivers:
                assert await r.wait() is KVPoll.Success
            await sender.wait_released()
        for pool, dst in zip(c.decode_pools, dsts, strict=True):
            assert (pool.kv[:, dst, :] == pool.expected(room, len(dst))).all()
            assert pool.aux_ok(2, room)
        stats = p.agent.statistics()
        assert stats.chunks_staged == 4 and stats.staging_full == 0
        assert p.agent.runner.planner.staging.units_reserved == 0


@pytest.mark.parametrize("layout", ["mha", "mla"])
async def test_pipeline_stages_stream_their_own_layers(
    engine_name: str, bootstrap_url: str, layout: str
) -> None:
    """PP 2: each stage sends its own layers (its pool's 0 and 1: model layers 0-1 and 2-3)
    one at a time; decode holds every model layer in its place."""
    async with open_pp(engine_name, bootstrap_url, pp=2, prefill_tp=1, decode_tp=1,
                       layout=layout) as c:
        room, n = 31, 4
        src = np.arange(n)
        dst = np.arange(PAGES - n, PAGES)[::-1].copy()
        senders = []
        for st in c.stages:
            st.pool.fill(src, room)
            st.pool.fill_aux(3, room)
            senders.append(st.agent.sender(room, num_pages=n, aux_slot=3))
        receiver = c.decode[0].receiver(room, bootstrap_url=c.url, epoch=room * 7)
        receiver.init(dst, 5)
        for layer in range(2):  # (each stage holds 2 of the model's 4 layers)
            for s in senders:
                s.send(src, layers=range(layer, layer + 1), last=layer == 1)
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Success, receiver.failure
        check_layers(c, room, dst)
        assert c.decode_pools[0].aux_ok(5, room)


# ------------------------------------------------------------------------------ lifetimes


def test_success_waits_for_every_layer_groups_write() -> None:
    """The last layer group's write returning first concludes the room, but publication
    waits for every other layer group's lease (a write of an earlier layer still running)."""
    room = PrefillRoom(1, 2, 0, 64, num_layers=2)
    room.add_target(
        endpoint="d", session="s", decode_rank=0, epoch=3, aux_slot=0, num_pages=2,
        dst_pages=np.array([5, 6]), peer=PeerPool(64, 4), expected=1,
    )
    room.admit(np.array([1, 2]), False, layers=(0, 1))
    first = room.take_chunks(64)
    room.admit(np.array([1, 2]), True, layers=(1, 2))
    last = room.take_chunks(64)
    assert first is not None and last is not None
    assert (first[0].layers, last[0].layers, last[0].last) == ((0, 1), (1, 2), True)
    due = room.chunk_settled(last[0], Outcome.COMPLETED, None)
    assert room.leases.closed and not room.publish_due and not any(
        isinstance(e, PublishDue) for e in due
    ), "Success due while layer 0's write is still running"
    due = room.chunk_settled(first[0], Outcome.COMPLETED, None)
    assert room.publish_due and any(isinstance(e, PublishDue) for e in due)


def _stall_layer(k: int) -> Callable[[TransferEngine], TransferEngine]:
    def wrap(engine: TransferEngine) -> TransferEngine:
        return FaultEngine(engine, lambda i, _p, _n: Fault("stall") if i == k else None)

    return wrap


@pytest.mark.parametrize("drain", ["real", "broken"])
@pytest.mark.parametrize("k", [0, 1, 2])
async def test_abort_at_a_layer_boundary_leaves_no_late_write(
    engine_name: str, bootstrap_url: str, drain: str, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three layers sent one by one; layer ``k``'s write is held inside the engine when
    decode aborts the room (layers before it landed, layers after it are never sent). With
    the real drain decode's pages go back only after that write returned, and the poisoned
    freed pages see no late byte; prefill's pages go back after it too. With the drain
    broken (prefill abandons the running call on abort) the test sees the late write."""
    if drain == "broken":
        break_the_drain(monkeypatch)
    src, dst = host_pool(num_layers=3), host_pool(num_layers=3)
    async with open_pair(
        engine_name, bootstrap_url, src=src, dst=dst, wrap=_stall_layer(k)
    ) as pair:
        fault = pair.prefill_engine
        assert isinstance(fault, FaultEngine)
        gate = fault.stalls
        try:
            pages = PageAllocator(dst.page_rows(), DEST_POISON)
            dp = pages.alloc_nowait(4)
            assert dp is not None
            released, src_released = trio.Event(), trio.Event()

            def release() -> None:
                pages.free(dp)
                released.set()

            src_pages = np.arange(4)
            src.fill(src_pages, 8)
            src.fill_aux(1, 8)
            sender = pair.prefill.sender(8, num_pages=4, aux_slot=1,
                                         on_release=src_released.set)
            receiver = pair.decode.receiver(8, bootstrap_url=bootstrap_url)
            receiver.init(dp, 2, on_release=release)
            with trio.fail_after(15):
                for layer in range(k + 1):
                    sender.send(src_pages, layers=range(layer, layer + 1), last=layer == 2)
                    if layer < k:  # (landed before the next: one write per layer)
                        await poll_until(
                            lambda n=layer: fault.statistics().calls == n + 1
                            and pair.prefill.statistics().engine_calls == n + 1
                        )
                await gate.wait_stalled_async(1)  # layer k's write is inside the engine
            written = fault.statistics().blocks_written
            receiver.abort("test: abort at a layer boundary")
            assert receiver.poll() is KVPoll.Failed
            if drain == "real":
                with trio.move_on_after(0.3):
                    await released.wait()
                assert not released.is_set(), "released while layer k's write could land"
                assert not src_released.is_set(), "prefill released a page being read"
            else:
                with trio.fail_after(15):
                    await released.wait()  # the bug: released at once
            gate.release_all()
            with trio.fail_after(15):
                await released.wait()
                await src_released.wait()
                await poll_until(lambda: fault.statistics().blocks_written > written)
            await trio.sleep(0.3)  # (a late write has landed by now)
            late = pages.late_in_free_rows()
            assert late == (0 if drain == "real" else 4), late
            if k < 2:  # the model loop's next layer finds the room closed
                with pytest.raises(AdmissionClosed):
                    sender.send(src_pages, layers=range(k + 1, k + 2))
        finally:
            gate.release_all()


# ------------------------------------------------------------------------------ facades


def test_the_thread_facade_streams_layers_and_checks_them_at_the_call(engine_name: str) -> None:
    """``SyncSender.send(layers=)``: a layer of a page sent twice, or a last send that leaves
    a layer unsent, is refused on the scheduler's thread (and counted); the layers sent go
    through, and decode's Success holds every layer's bytes."""
    with agents(engine_name) as a:  # (host pools of 2 layers)
        room, n = 12, 4
        src_pages, dst_pages = np.arange(n), np.arange(n) + n
        a.src.fill(src_pages, room)
        a.src.fill_aux(1, room)
        sender = a.prefill.sender(room, epoch=99)
        sender.init(n, 1)
        receiver = a.decode.receiver(room, bootstrap_url=a.boot.url, epoch=99)
        thread_poll_until(lambda: receiver.poll() is not KVPoll.Bootstrapping)
        receiver.init(dst_pages, 2)
        sender.send(src_pages, layers=range(0, 1))
        with pytest.raises(ProtocolError, match="layer 0 was admitted"):
            sender.send(src_pages, layers=range(0, 1))
        with pytest.raises(ProtocolError, match="leaves layer 1"):
            sender.send(src_pages[:2], layers=range(1, 2), last=True)
        sender.send(src_pages, layers=range(1, 2), last=True)
        thread_poll_until(lambda: receiver.poll() is KVPoll.Success)
        assert (a.dst.kv[:, dst_pages, :] == a.src.expected(room, n)).all()
        assert a.dst.aux_ok(2, room)
        thread_poll_until(lambda: a.prefill.statistics().sends_refused == 2)


def test_the_asyncio_facade_passes_layers_through() -> None:
    async def scenario() -> None:
        async with open_aio_agents() as a:
            n = 2
            src = a.src_pages.alloc_nowait(n)
            dst = a.dst_pages.alloc_nowait(n)
            assert src is not None and dst is not None
            a.src.fill(src, 5)
            a.src.fill_aux(3, 5)
            sender = await a.prefill.sender(
                5, num_pages=n, aux_slot=3, on_release=lambda: a.src_pages.free(src)
            )
            receiver = await a.decode.receiver(5, bootstrap_url=a.url)
            await receiver.init(dst, 4, on_release=lambda: a.dst_pages.free(dst))
            layers = a.src.spec.num_layers
            for layer in range(layers):
                await sender.send(src, layers=range(layer, layer + 1), last=layer == layers - 1)
            with pytest.raises(ProtocolError):
                await sender.send(src, layers=range(0, 1))
            async with asyncio.timeout(10):
                assert await receiver.wait() is KVPoll.Success
            assert (a.dst.read(dst) == a.src.expected(5, n)).all()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ the demo


@pytest.mark.parametrize(
    "shape",
    [
        dict(decode_tp=2),  # staged head slices
        dict(prefill_pp=2, prefill_tp=2, decode_tp=2),
        dict(layout="mla", kv_heads=1, prefill_tp=2),  # a dummy rank
        # per-buffer geometry: head-major pages, K and V of different widths, page strides
        dict(page_layout="hnd", v_head_bytes=24, page_pad=64, decode_tp=2),
    ],
    ids=["tp1-2-staged", "pp2-tp2-2", "mla-tp2-1", "geometry-tp1-2"],
)
async def test_the_demo_streams_layers_with_aborts_and_faults(
    engine_name: str, shape: dict[str, Any]
) -> None:
    """`trio-pd demo --layerwise`: every chunk layer by layer, aborts (one between the first
    chunk's layers) and engine faults (a late write among them) at layer granularity:
    nothing corrupt, late, leaked or read after release; nothing freed by timeout."""
    from trio_pd.tools._demo import check, run_in_process

    shape = {"kv_heads": 4, **shape}
    opts = DemoOptions(requests=30, concurrency=6, min_tokens=1, max_tokens=48, page_size=4,
                       chunk_pages=3, layers=4, head_bytes=16, abort_rate=0.3,
                       fault_rate=0.05, fault_kinds=("fail", "partial", "late", "delay_before"),
                       seed=5, request_bound=20.0, quarantine_fence=1.0, engine=engine_name,
                       layerwise=True, **shape)
    assert opts.option_problem() is None
    with trio.fail_after(90):
        summary = await run_in_process(opts)
    # (a request fails with any of its engine calls, and layer by layer it makes more: with
    # 4 prefill ranks, and calls shared by several rooms, a faulted call fails several)
    assert summary["succeeded"] >= 5, summary
    for key in ("corrupt_pages", "late_writes", "leaked_pages", "source_uaf_pages", "hung",
                "released_by_timeout"):
        assert summary[key] == 0, (key, summary)
    assert check(opts, summary) == []
