"""Several aux buffers (issue 18, item 6): a pool's metadata buffers (output ids, logprobs,
hidden states...) as aux buffers of their own, all indexed by the request's aux slot, each of
its own row size; the stamp stays in the first one's row.

Planning is checked against a naive per-byte reference (hypothesis); the pairing check
refuses pools whose aux rows differ buffer by buffer; real engines move three aux buffers of
different row sizes and every byte is verified; and an abort while a write is inside the
engine leaves no late write in any aux buffer's rows (the sanitizer), which a broken drain
does.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from trio_pd import (
    ConfigurationError,
    DecodeAgent,
    DecodeConfig,
    IncompatiblePeer,
    KVPoll,
    PrefillAgent,
    cli,
)
from trio_pd.core._memory import (
    AUX_STAMP,
    HOST,
    MemoryKind,
    PoolSpec,
    aux_row_address,
    describe_pool,
    read_aux_stamp,
)
from trio_pd.core._plan import plan_aux, validate_blocks
from trio_pd.core._topology import pairing_problem
from trio_pd.engines import TransferEngine
from trio_pd.testing.pools import (
    DEST_POISON,
    HostKVPool,
    PageAllocator,
    aux_bytes,
    extra_aux_lens,
)
from trio_pd.tools._demo import DemoOptions, run_in_process

from .helpers.agents import host_pool, open_pair
from .helpers.faults import abort_a_stalled_write, stall_every_write

BOUND = 15.0
QUIET = 0.3
#: the aux buffers after the first: with the first's 64 bytes, three of different row sizes
LENS = (24, 41)


# ------------------------------------------------------------------------------ the layout


def spec(extra: tuple[tuple[int, int], ...] = ((6000, 24), (7000, 41)), **kw: Any) -> PoolSpec:
    args: dict[str, Any] = dict(
        layout="mha", page_size=4, num_pages=8, num_layers=1, head_bytes=16, heads=2,
        first_head=0, buffer_bases=(1000, 3000), aux_base=5000, aux_item_len=32, aux_slots=4,
        extra_aux=extra,
    )
    args.update(kw)
    return PoolSpec(**args)


def test_regions_list_every_aux_buffer_after_the_first() -> None:
    s = spec(kinds=(MemoryKind.cuda(0),) * 2 + (HOST, HOST, MemoryKind.cuda(0)))
    assert [(r.base, r.length) for r in s.regions()] == [
        (1000, 1024), (3000, 1024), (5000, 4 * 32), (6000, 4 * 24), (7000, 4 * 41)]
    assert [str(r.kind) for r in s.regions()] == ["cuda:0", "cuda:0", "host", "host", "cuda:0"]
    assert s.aux_kind == HOST  # the first aux buffer's, where the stamp is
    assert (s.num_aux, s.aux_bases, s.aux_item_lens) == (3, (5000, 6000, 7000), (32, 24, 41))
    assert [aux_row_address(s, 3, i) for i in range(3)] == [5000 + 96, 6000 + 72, 7000 + 123]
    # positional use and pools without them are unchanged
    plain = PoolSpec("mha", 4, 8, 1, 16, 2, 0, (1000, 3000), 5000, 32, 4)
    assert plain.extra_aux == () and plain.num_aux == 1 and len(plain.regions()) == 3
    # the layout travels with copies, pickles and replace()
    assert pickle.loads(pickle.dumps(s)) == s and pickle.loads(pickle.dumps(s)).region_kinds
    assert dataclasses.replace(s, num_pages=4).extra_aux == s.extra_aux


@pytest.mark.parametrize(("kw", "match"), [
    ({"extra": ((6000, 0),)}, r"extra_aux\[0\]"),
    ({"extra": ((-1, 24),)}, r"extra_aux\[0\]"),
    ({"extra": ((6000, 24, 1),)}, r"extra_aux\[0\]"),
    ({"extra": [(6000, 24)]}, "tuple"),
    ({"kinds": (HOST,) * 3}, "one per aux buffer"),
])
def test_bad_extra_aux_is_refused(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        spec(**kw)


def test_describe_pool_takes_several_aux_buffers() -> None:
    kv = [np.zeros(8 * 4 * 2 * 16, np.uint8) for _ in range(2)]
    aux = np.zeros((10, 32), np.uint8)
    meta = [np.zeros((12, 24), np.uint8), np.zeros((9, 41), np.uint8)]
    pool = describe_pool(layout="mha", page_size=4, num_layers=1, head_bytes=16, heads=2,
                         buffers=kv, aux=aux, aux_item_len=32,
                         extra_aux=[(m, m.shape[1]) for m in meta])
    assert pool.aux_slots == 9  # what every aux buffer holds
    assert pool.extra_aux == tuple((int(m.ctypes.data), m.shape[1]) for m in meta)
    assert pool.region_kinds == (HOST,) * 5
    with pytest.raises(ConfigurationError, match="aux buffer 2 has 369 bytes, fewer than 10"):
        describe_pool(layout="mha", page_size=4, num_layers=1, head_bytes=16, heads=2,
                      buffers=kv, aux=aux, aux_item_len=32, aux_slots=10,
                      extra_aux=[(m, m.shape[1]) for m in meta])
    with pytest.raises(ConfigurationError, match="overlap"):
        describe_pool(layout="mha", page_size=4, num_layers=1, head_bytes=16, heads=2,
                      buffers=kv, aux=aux, aux_item_len=32,
                      extra_aux=[(meta[0], 24), ((int(meta[0].ctypes.data) + 8, 100), 8)])
    with pytest.raises(ConfigurationError, match="row bytes"):
        describe_pool(layout="mha", page_size=4, num_layers=1, head_bytes=16, heads=2,
                      buffers=kv, aux=aux, aux_item_len=32, extra_aux=[(meta[0], 0)])


# ------------------------------------------------------------------------------ planning


@st.composite
def aux_layouts(draw: st.DrawFn) -> tuple[PoolSpec, PoolSpec, int, int]:
    """A source and a destination pool with the same aux row sizes, buffer by buffer, laid
    out in one small address space (in a random order, with random gaps), and a slot each."""
    rows = draw(st.lists(st.integers(1, 80), min_size=1, max_size=6))
    rows[0] = max(rows[0], AUX_STAMP.size)
    pools = []
    for _ in range(2):
        slots = draw(st.integers(1, 6))
        sizes = [("kv", 32), *((i, slots * n) for i, n in enumerate(rows))]
        order = draw(st.permutations(sizes))
        at, bases = 0, {}
        for name, n in order:
            at += draw(st.integers(0, 40))
            bases[name] = at
            at += n
        pools.append(PoolSpec(
            layout="mla", page_size=1, num_pages=1, num_layers=1, head_bytes=32, heads=1,
            first_head=0, buffer_bases=(bases["kv"],), aux_base=bases[0],
            aux_item_len=rows[0], aux_slots=slots,
            extra_aux=tuple((bases[i], n) for i, n in enumerate(rows) if i),
        ))
    src, dst = pools
    return (src, dst, draw(st.integers(0, src.aux_slots - 1)),
            draw(st.integers(0, dst.aux_slots - 1)))


@given(layout=aux_layouts())
def test_plan_aux_matches_a_naive_per_byte_copy(
    layout: tuple[PoolSpec, PoolSpec, int, int]
) -> None:
    src, dst, s, d = layout
    size = 4096
    memory = np.arange(size, dtype=np.int64) + 1  # the source's bytes: their own address
    got = np.zeros(size, dtype=np.int64)
    written = np.zeros(size, dtype=np.int64)
    blocks = plan_aux(src, dst, s, d)
    assert blocks.num_blocks == src.num_aux
    validate_blocks(blocks, dst.regions())  # nothing outside the destination's aux buffers
    for a, b, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.lens.tolist(),
                       strict=True):
        got[b : b + n] = memory[a : a + n]
        written[b : b + n] += 1
    want = np.zeros(size, dtype=np.int64)
    for i, row in enumerate(src.aux_item_lens):  # byte by byte, buffer by buffer
        for k in range(row):
            want[aux_row_address(dst, d, i) + k] = memory[aux_row_address(src, s, i) + k]
    np.testing.assert_array_equal(got, want)
    assert written.max() == 1  # every byte once


@given(layout=aux_layouts(), data=st.data())
def test_plan_aux_refuses_rows_that_differ_buffer_by_buffer(
    layout: tuple[PoolSpec, PoolSpec, int, int], data: st.DataObject
) -> None:
    src, dst, s, d = layout
    rows = list(dst.aux_item_lens)
    i = data.draw(st.integers(0, len(rows)))
    if i == len(rows):
        changed = dataclasses.replace(dst, extra_aux=(*dst.extra_aux, (9000, 8)))
        match = f"aux buffers differ: the source has {len(rows)}, the destination"
    else:
        rows[i] += 1
        changed = dataclasses.replace(
            dst, aux_item_len=rows[0],
            extra_aux=tuple((b, n) for (b, _), n in zip(dst.extra_aux, rows[1:], strict=True)))
        match = "aux row size differs" if i == 0 else f"aux buffer {i}'s row size differs"
    with pytest.raises(ValueError, match=match):
        plan_aux(src, changed, s, d)


def test_pairing_compares_aux_rows_buffer_by_buffer() -> None:
    def problem(ours: int | tuple[int, ...], theirs: int | tuple[int, ...]) -> str | None:
        return pairing_problem(
            layout="mha", page_size=4, head_bytes=16, num_layers=1, aux_item_len=ours,
            kv_heads=2, prefill_tp=1, peer_layout="mha", peer_page_size=4, peer_head_bytes=16,
            peer_num_layers=1, peer_aux_item_len=theirs, peer_rank=0, peer_tp=1, peer_heads=2,
            peer_first_head=0,
        )

    assert problem((64, 24, 41), (64, 24, 41)) is None
    assert problem(64, (64,)) is None  # one aux buffer: the int and the 1-tuple agree
    assert problem((64,), (32,)) == "aux row bytes: prefill 64, decode 32"  # as before
    assert problem((64, 24, 41), (64, 24, 40)) == (
        "aux row bytes per aux buffer: prefill (64, 24, 41), decode (64, 24, 40)")
    assert problem((64, 24), (64,)) == (
        "aux row bytes per aux buffer: prefill (64, 24), decode (64,)")


# ------------------------------------------------------------------------------ host pools


def test_host_pool_fills_checks_and_sanitizes_every_aux_buffer() -> None:
    pool = host_pool(num_pages=8, extra_aux_lens=LENS)
    assert [a.shape for a in pool.extra_aux] == [(32, 24), (32, 41)]
    assert pool.spec.aux_item_lens == (64, 24, 41)
    pool.fill_aux(5, room=9)
    assert pool.aux_ok(5, 9) and not pool.aux_ok(5, 10)
    assert bytes(pool.extra_aux[1][5]) == bytes(aux_bytes(9, 41, buffer=2))
    pool.extra_aux[1][5, 40] ^= 1  # the last byte of the last buffer counts too
    assert not pool.aux_ok(5, 9)
    alloc = PageAllocator(pool.aux_rows(), DEST_POISON)
    assert all((a == DEST_POISON).all() for a in (pool.aux, *pool.extra_aux))
    ids = alloc.alloc_nowait(2)
    assert ids is not None
    alloc.free(ids)
    pool.extra_aux[1][int(ids[1]), 7] = 3  # a late write into one extra aux buffer alone
    assert alloc.late_in_free_rows() == 1
    assert extra_aux_lens(3) == (24, 41, 58)


# ------------------------------------------------------------------------------ real engines


@asynccontextmanager
async def aux_pair(
    engine_name: str, url: str, *, src_lens: tuple[int, ...] = LENS,
    dst_lens: tuple[int, ...] = LENS,
    wrap: Callable[[TransferEngine], TransferEngine] | None = None,
    decode_config: DecodeConfig | None = None,
) -> AsyncIterator[tuple[PrefillAgent, DecodeAgent, HostKVPool, HostKVPool]]:
    """One prefill and one decode rank on loopback, each with a host pool of three aux
    buffers (64, 24 and 41 bytes a row unless told otherwise)."""
    src, dst = host_pool(extra_aux_lens=src_lens), host_pool(extra_aux_lens=dst_lens)
    for rows in (dst.aux, *dst.extra_aux):
        rows[...] = DEST_POISON
    async with open_pair(engine_name, url, src=src, dst=dst, wrap=wrap,
                         decode_config=decode_config) as pair:
        yield pair.prefill, pair.decode, src, dst


def poisoned(dst: HostKVPool, slots: list[int]) -> bool:
    """Every byte of these slots, in every aux buffer, still holds the destination poison."""
    return all(bool((rows[slots] == DEST_POISON).all()) for rows in (dst.aux, *dst.extra_aux))


async def test_three_aux_buffers_arrive_byte_for_byte(engine_name: str, bootstrap_url: str) -> None:
    """Four rooms, each in two chunks: every KV page and every aux buffer's row of the room's
    slot holds exactly the source's bytes (the stamp in the first), and no other slot of any
    aux buffer is touched."""
    async with aux_pair(engine_name, bootstrap_url) as (prefill, decode, src, dst):
        rooms = [(40 + k, np.arange(6 * k, 6 * k + 6), np.arange(100 + 7 * k, 106 + 7 * k),
                  3 + k, 20 + 2 * k) for k in range(4)]
        receivers = []
        for room, sp, dp, s_slot, d_slot in rooms:
            src.fill(sp, room)
            src.fill_aux(s_slot, room)
            sender = prefill.sender(room, num_pages=6, aux_slot=s_slot)
            receiver = decode.receiver(room, bootstrap_url=bootstrap_url, epoch=1000 + room)
            receiver.init(dp, d_slot)
            sender.send(sp[:3])
            sender.send(sp[3:], last=True)
            receivers.append(receiver)
        with trio.fail_after(BOUND):
            for r in receivers:
                assert await r.wait() is KVPoll.Success, r.failure
        for room, _sp, dp, s_slot, d_slot in rooms:
            assert (dst.kv[:, dp, :] == src.expected(room, 6)).all()
            assert read_aux_stamp(dst.spec, d_slot) == (room, 1000 + room)
            assert dst.aux_ok(d_slot, room)
            for s_rows, d_rows in zip(src.extra_aux, dst.extra_aux, strict=True):
                assert bytes(d_rows[d_slot]) == bytes(s_rows[s_slot])
        untouched = sorted(set(range(32)) - {r[4] for r in rooms})
        assert poisoned(dst, untouched)


@pytest.mark.parametrize("other", [(24, 40), (24,), (24, 41, 8)])
async def test_register_with_other_aux_rows_per_buffer_is_refused(
    engine_name: str, bootstrap_url: str, other: tuple[int, ...]
) -> None:
    """A decode pool whose further aux buffers differ from prefill's (a row size, or how many)
    is refused at REGISTER, naming the aux rows buffer by buffer: the prefill room fails at
    once and nothing is written. The bootstrap record names every aux buffer's row bytes, so
    decode tells by itself, before it registers: its room fails at once too, with the same
    reason (not at its waiting deadline)."""
    async with aux_pair(engine_name, bootstrap_url, dst_lens=other,
                        decode_config=DecodeConfig(waiting_timeout=1.0)) as (prefill, decode,
                                                                             src, dst):
        src.fill(np.arange(4), 7)
        src.fill_aux(0, 7)
        sender = prefill.sender(7, num_pages=4, aux_slot=0)
        receiver = decode.receiver(7, bootstrap_url=bootstrap_url)
        receiver.init(np.arange(10, 14), 3)
        sender.send(np.arange(4), last=True)
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Failed
        want = f"aux row bytes per aux buffer: prefill (64, 24, 41), decode {(64, *other)}"
        assert isinstance(receiver.failure, IncompatiblePeer), receiver.failure
        assert want in str(receiver.failure)
        assert decode.statistics().timeouts == 0  # (failed up front, not at its deadline)
        sender.abort()  # (decode never registered with it: its room waits for no TRANSFER)
        assert prefill.statistics().engine_calls == 0
        assert poisoned(dst, list(range(32)))


@pytest.mark.parametrize("drain", ["real", "broken"])
async def test_abort_during_a_write_leaves_no_late_write_in_any_aux_buffer(
    engine_name: str, bootstrap_url: str, drain: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last chunk's write (KV pages and all three aux rows) is held inside the engine
    when decode aborts the room. With the real drain decode hands the pages and the aux slot
    back only once that write has returned, so the sanitizer (the aux allocator poisons the
    slot's row in every aux buffer at release and checks it) sees no late write. With the
    drain broken (prefill abandons the running call on abort, as in
    tests/test_sanitizer.py), the write lands after the release, and the sanitizer sees it
    in every aux buffer."""
    faults, wrap = stall_every_write(drain, monkeypatch)

    async with aux_pair(engine_name, bootstrap_url, wrap=wrap) as (prefill, decode, src, dst):
        gate = faults[0].stalls
        try:
            pages = PageAllocator(dst.page_rows(), DEST_POISON)
            slots = PageAllocator(dst.aux_rows(), DEST_POISON)
            dp, slot = pages.alloc_nowait(4), slots.alloc_nowait(1)
            assert dp is not None and slot is not None
            released = trio.Event()

            def release() -> None:
                pages.free(dp)
                slots.free(slot)
                released.set()

            src.fill(np.arange(4), 8)
            src.fill_aux(1, 8)
            sender = prefill.sender(8, num_pages=4, aux_slot=1)
            receiver = decode.receiver(8, bootstrap_url=bootstrap_url)
            receiver.init(dp, int(slot[0]), on_release=release)
            sender.send(np.arange(4), last=True)
            await abort_a_stalled_write(drain, faults[0], receiver, sender, released)
            late = [bool((rows[int(slot[0])] != DEST_POISON).any())
                    for rows in (dst.aux, *dst.extra_aux)]
            if drain == "real":
                assert late == [False, False, False]
                assert slots.late_in_free_rows() == 0 and pages.late_in_free_rows() == 0
            else:
                assert late == [True, True, True]  # each aux buffer's row was written late
                assert slots.late_in_free_rows() == 1
                dst.aux[int(slot[0])] = DEST_POISON  # the first buffer's late bytes gone:
                assert slots.late_in_free_rows() == 1  # the sanitizer sees the others'
        finally:
            gate.release_all()


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 1), (1, 2)])
async def test_demo_moves_and_verifies_three_aux_buffers(p: int, d: int) -> None:
    """The demo with --aux-buffers 2 (rows of 64, 24 and 41 bytes) on TP shapes where the aux
    writer is one of several prefill ranks, or serves several decode ranks: every Success
    verified byte for byte in every aux buffer."""
    opts = DemoOptions(aux_buffers=2, requests=12, concurrency=3, max_tokens=96, layers=1,
                       prefill_tp=p, decode_tp=d, kv_heads=4)
    summary = await run_in_process(opts)
    assert summary["succeeded"] == 12, summary
    assert summary["corrupt_pages"] == summary["late_writes"] == summary["leaked_pages"] == 0


async def test_demo_with_aux_buffers_aborts_and_faults_leaves_no_late_write() -> None:
    """Aborts on both sides and engine faults (partial writes that fail after writing half
    their blocks, delayed writes) while three aux buffers move: no late write into any page
    or any aux buffer's row, nothing corrupt, nothing leaked."""
    opts = DemoOptions(
        aux_buffers=2, requests=80, concurrency=4, abort_rate=0.5, fault_rate=1.0,
        fault_kinds=("delay_before", "partial"), fault_delay=0.005, max_tokens=256,
        seed=3, quarantine_fence=1.0,
    )
    summary = await run_in_process(opts)
    assert summary["aborted"] > 0 and summary["engine_errors"] > 0, summary
    assert summary["late_writes"] == 0, summary
    assert summary["corrupt_pages"] == summary["leaked_pages"] == summary["hung"] == 0, summary


@pytest.mark.parametrize(("kw", "says"), [
    ({"aux_buffers": -1}, "--aux-buffers"),
    ({"aux_buffers": 64}, "--aux-buffers"),
])
def test_demo_refuses_bad_aux_buffers(kw: dict[str, Any], says: str) -> None:
    problem = DemoOptions(**kw).option_problem()
    assert problem is not None and says in problem


def test_cli_takes_aux_buffers() -> None:
    parser, _ = cli._parser()
    assert cli._options(parser.parse_args(["demo", "--aux-buffers", "3"])).aux_buffers == 3
    assert cli._options(parser.parse_args(["demo"])).aux_buffers == 0
