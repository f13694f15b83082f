"""State components (issue 18, item 2): per-request state that is not paged KV (Mamba conv
and SSM states, a sliding-window pool, NSA index pages), in buffers of its own indexed by
slot, moved with the last chunk under the rules of KV pages.

Planning is checked against a naive per-byte reference on random layouts and TP pairs
(hypothesis): every byte of every decode slot written once, with the byte the prefill rank
holding it has. The pairing check refuses what cannot pair; the wire checks what a peer
sends; real engines move states byte for byte, refuse a slot-count mismatch on both sides,
and hold a decode slot while a write may still land in it (the sanitizer, and a broken drain
it catches); the demo runs states through aborts and faults.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_pd import (
    ConfigurationError,
    DecodeAgent,
    DecodeConfig,
    IncompatiblePeer,
    KVPoll,
    PrefillAgent,
    ProtocolError,
    StateSpec,
    cli,
    open_decode,
    open_prefill,
)
from trio_pd.agents import _sources
from trio_pd.core import _wire
from trio_pd.core._memory import HOST, PoolSpec, describe_pool
from trio_pd.core._plan import plan_states, validate_blocks
from trio_pd.core._topology import served_decode_ranks, source_ranks, state_cuts, state_problem
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.testing.pools import DEST_POISON, HostKVPool, PageAllocator, StateShape
from trio_pd.tools._demo import DemoOptions, run_in_process

from .helpers.agents import host_pool, open_pair
from .helpers.faults import abort_a_stalled_write, stall_every_write

BOUND = 15.0
QUIET = 0.3
#: a Mamba-like component of a TP-1 rank: per layer (2), a conv state of x, B and C rows
#: and an SSM state of heads
MAMBA = StateShape(
    "mamba", (64, 64, 64, 64),
    segments=(((32, 1), (16, 1), (16, 1)),) * 2 + (((64, 1),),) * 2,
)


# ------------------------------------------------------------------------------ the layout


@pytest.mark.parametrize(("kw", "match"), [
    ({"name": ""}, "name"),
    ({"slots": 0}, "slots"),
    ({"buffers": ()}, "buffers"),
    ({"buffers": ((0, 0),)}, r"buffers\[0\]"),
    ({"replicated": 1}, "replicated"),
    ({"segments": (((8, 1),),)}, "cover 8 bytes, but a slot of buffer 0 has 16"),
    ({"segments": (((16, 1),), ((16, 1),))}, "one tuple per buffer"),
    ({"segments": (((16, 1),),), "replicated": True}, "not both"),
    ({"segments": (((0, 1),),)}, r"segments\[0\]"),
])
def test_a_state_that_makes_no_sense_is_refused(kw: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = dict(name="s", slots=4, buffers=((4096, 16),))
    args.update(kw)
    with pytest.raises(ConfigurationError, match=match):
        StateSpec(**args)


def test_pool_regions_and_kinds_take_the_state_buffers_last() -> None:
    state = StateSpec("m", 3, ((9000, 10), (9100, 20)))
    spec = PoolSpec("mla", 1, 1, 1, 32, 1, 0, (100,), 200, 16, 2, states=(state,),
                    kinds=[HOST] * 4)
    assert [(r.base, r.length) for r in spec.regions()[-2:]] == [(9000, 30), (9100, 60)]
    assert spec.state_kinds(0) == (HOST, HOST) and spec.num_state_buffers == 2
    with pytest.raises(ConfigurationError, match="one per state buffer"):
        PoolSpec("mla", 1, 1, 1, 32, 1, 0, (100,), 200, 16, 2, states=(state,), kinds=[HOST] * 2)
    with pytest.raises(ConfigurationError, match="distinct names"):
        PoolSpec("mla", 1, 1, 1, 32, 1, 0, (100,), 200, 16, 2, states=(state, state))


def test_describe_pool_takes_states_and_refuses_overlap() -> None:
    kv, aux = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    states = np.zeros(96, np.uint8)
    base = int(states.ctypes.data)
    good = StateSpec("m", 3, ((base, 16), (base + 48, 16)))
    spec = describe_pool(layout="mla", page_size=1, num_layers=1, head_bytes=32,
                         buffers=[kv], aux=aux, aux_item_len=16, states=[good])
    assert spec.states == (good,) and spec.region_kinds is not None
    assert spec.state_kinds(0) == (HOST, HOST)
    clash = StateSpec("m", 3, ((base, 16), (int(kv.ctypes.data), 16)))
    with pytest.raises(ConfigurationError, match="overlap"):
        describe_pool(layout="mla", page_size=1, num_layers=1, head_bytes=32, buffers=[kv],
                      aux=aux, aux_item_len=16, states=[clash])


# ------------------------------------------------------------------------------ the wire


def test_states_travel_and_are_checked_on_the_wire() -> None:
    pool = host_pool(states=(MAMBA,), state_slots=(5,))
    wire = _wire.PoolWire.from_spec(pool.spec)
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=_wire.PoolWire)
    assert again.to_spec() == pool.spec
    bad = msgspec.structs.replace(wire.states[0], segments=(((8, 1),),) * 4)  # type: ignore[index]
    with pytest.raises(ProtocolError, match="cover 8 bytes"):
        msgspec.structs.replace(wire, states=(bad,)).to_spec()
    huge = _wire.StateWire("x", 2, ((2**64 - 8, 16),))
    with pytest.raises(ProtocolError, match="64-bit address space"):
        huge.to_spec()
    twice = msgspec.structs.replace(wire, states=(wire.states[0], wire.states[0]))  # type: ignore[index]
    with pytest.raises(ProtocolError, match="distinct names"):
        twice.to_spec()
    assert "states" not in msgspec.msgpack.decode(
        msgspec.msgpack.encode(_wire.PoolWire.from_spec(host_pool().spec)))


def test_transfer_state_slots_round_trip_and_are_bounded() -> None:
    msg = _wire.Transfer(v=_wire.WIRE_VERSION, room=1, epoch=2, endpoint="tcp://127.0.0.1:1",
                         decode_rank=0, aux_slot=0, required=1, num_pages=2,
                         state_slots=((3,), (4, 5)))
    frames = _wire.encode(msg, np.arange(2, dtype=np.int32))
    got, _pages = _wire.decode(frames)
    assert isinstance(got, _wire.Transfer) and got.state_slots == ((3,), (4, 5))
    plain = _wire.Transfer(v=_wire.WIRE_VERSION, room=1, epoch=2, endpoint="tcp://127.0.0.1:1",
                           decode_rank=0, aux_slot=0, required=1, num_pages=2)
    assert b"state_slots" not in _wire.encode(plain, np.arange(2, dtype=np.int32))[0]
    many = msgspec.structs.replace(msg, state_slots=((0,),) * (_wire.MAX_STATES + 1))
    with pytest.raises(ProtocolError):
        _wire.decode(_wire.encode(many, np.arange(2, dtype=np.int32)))


# ------------------------------------------------------------------------------ planning


@st.composite
def split_states(draw: st.DrawFn) -> tuple[str, list[tuple[int, int]], int, int]:
    """How a component splits, its buffers' segments as (unit bytes, units in all), and a
    prefill and a decode TP size (one a multiple of the other, both dividing every unit
    count)."""
    p, d = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]))
    split = draw(st.sampled_from(["segments", "replicated", "rank"]))
    if split == "rank":
        d = p
    step = max(p, d)
    buffers = [
        draw(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 3).map(lambda k: k * step)),
                      min_size=1, max_size=4))
        for _ in range(draw(st.integers(1, 3)))
    ]
    return split, buffers, p, d  # type: ignore[return-value]


def _spec(split: str, buffers: list[Any], tp: int, slots: int, base: int) -> StateSpec:
    if split == "segments":
        segs = tuple(tuple((ub, total // tp) for ub, total in b) for b in buffers)
        items = [sum(ub * u for ub, u in s) for s in segs]
    else:
        segs, items = (), [sum(ub * total for ub, total in b) for b in buffers]
    bufs, at = [], base
    for n in items:
        bufs.append((at, n))
        at += slots * n + 7  # a gap between buffers
    return StateSpec("c", slots, tuple(bufs), split == "replicated", segs)


def _global(split: str, buffers: list[Any], b: int, rank: int, tp: int) -> np.ndarray:
    """The global id of each byte of a rank's slot of buffer ``b`` (rank-local: its own)."""
    if split != "segments":
        n = sum(ub * total for ub, total in buffers[b])
        return np.arange(n) + (rank << 30 if split == "rank" else 0)
    parts, off = [], 0
    for ub, total in buffers[b]:
        u = total // tp
        parts.append(off + rank * u * ub + np.arange(u * ub))
        off += total * ub
    return np.concatenate(parts)


@settings(max_examples=60, deadline=None)
@given(layout=split_states(), data=st.data())
def test_state_plans_match_a_naive_per_byte_copy(
    layout: tuple[str, list[Any], int, int], data: st.DataObject
) -> None:
    """Every prefill rank plans its writes to each decode rank it serves (the ranks that
    send it their TRANSFER): each byte of each decode slot named is written exactly once,
    with the byte of the same global position (or, rank-local, of the same rank), and no
    other byte of decode's state buffers is touched."""
    split, buffers, p, d = layout
    slots = data.draw(st.integers(1, 5))
    k = data.draw(st.integers(0, slots))
    if data.draw(st.booleans()):  # any order
        src_ids = np.array(data.draw(st.permutations(range(slots)))[:k], dtype=np.int64)
        dst_ids = np.array(data.draw(st.permutations(range(slots)))[:k], dtype=np.int64)
    else:  # consecutive on both sides (whole slots are then planned as runs)
        src_ids = np.arange(k, dtype=np.int64) + data.draw(st.integers(0, slots - k))
        dst_ids = np.arange(k, dtype=np.int64) + data.draw(st.integers(0, slots - k))
    size = 1 << 16
    for dr in range(d):
        dst = _spec(split, buffers, d, slots, 1000)
        memory = np.full(size, -1, dtype=np.int64)  # decode's memory: global ids land here
        written = np.zeros(size, dtype=np.int64)
        for pr in range(p):
            if dr not in served_decode_ranks(pr, p, d):
                continue  # it gets no TRANSFER from this decode rank
            assert pr in source_ranks(dr, p, d)
            src = _spec(split, buffers, p, slots, 30000)
            assert state_problem([src], [dst], p, d) is None
            src_pool = PoolSpec("mla", 1, 1, 1, 8, 1, 0, (10,), 20, 16, 1, states=(src,))
            dst_pool = PoolSpec("mla", 1, 1, 1, 8, 1, 0, (10,), 20, 16, 1, states=(dst,))
            cuts = state_cuts(src, dst, pr, dr, p, d)
            blocks = plan_states(src_pool, dst_pool, [cuts], [src_ids], [dst_ids])
            validate_blocks(blocks, dst_pool.regions()[2:])  # inside decode's state buffers
            source = np.full(size, -2, dtype=np.int64)
            for b, (sb, n) in enumerate(src.buffers):
                ids = _global(split, buffers, b, pr, p) * 8 + b
                for i, s in enumerate(src_ids.tolist()):
                    source[sb + s * n : sb + (s + 1) * n] = ids * 64 + i
            for a, t, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.lens.tolist(),
                               strict=True):
                memory[t : t + n] = source[a : a + n]
                written[t : t + n] += 1
        want = np.full(size, -1, dtype=np.int64)
        for b, (db, n) in enumerate(dst.buffers):
            ids = _global(split, buffers, b, dr, d) * 8 + b
            for i, s in enumerate(dst_ids.tolist()):
                want[db + s * n : db + (s + 1) * n] = ids * 64 + i
        np.testing.assert_array_equal(memory, want)
        assert written.max(initial=0) <= 1


def test_whole_slots_consecutive_on_both_sides_are_one_block() -> None:
    """A rank-local (or replicated) component: slots consecutive on both sides are copied as
    one block per buffer, as pages are; a break on either side starts a new one."""
    spec = StateSpec("swa", 64, ((1 << 20, 256), (1 << 22, 32)))
    pool = PoolSpec("mla", 1, 1, 1, 8, 1, 0, (10,), 20, 16, 1, states=(spec,))
    cuts = state_cuts(spec, spec, 0, 0, 1, 1)
    src, dst = np.arange(8, 16), np.arange(40, 48)
    blocks = plan_states(pool, pool, [cuts], [src], [dst])
    assert blocks.lens.tolist() == [8 * 256, 8 * 32]
    assert blocks.src.tolist() == [(1 << 20) + 8 * 256, (1 << 22) + 8 * 32]
    assert blocks.dst.tolist() == [(1 << 20) + 40 * 256, (1 << 22) + 40 * 32]
    dst[4:] += 1  # decode's run breaks after four slots
    assert len(plan_states(pool, pool, [cuts], [src], [dst]).lens) == 4


def test_pairing_refuses_states_that_cannot_pair() -> None:
    seg = StateSpec("m", 4, ((0, 48),), segments=(((16, 2), (8, 2)),))
    assert state_problem([seg], [StateSpec("m", 4, ((0, 24),), segments=(((16, 1), (8, 1)),))],
                         1, 2) is None
    assert "prefill [(16, 2), (8, 2)], decode [(16, 2), (8, 4)]" in str(state_problem(
        [seg], [StateSpec("m", 4, ((0, 32),), segments=(((16, 1), (8, 2)),))], 1, 2))
    local = StateSpec("m", 4, ((0, 48),))
    assert "prefill TP 1 cannot fill decode TP 2" in str(state_problem([local], [local], 1, 2))
    assert state_problem([local], [local], 2, 2) is None
    assert "splits it by rank, decode by segments" in str(state_problem([local], [seg], 1, 1))
    assert "prefill ['m'], decode []" in str(state_problem([local], [], 1, 1))
    assert "pipeline stages" in str(state_problem([local], [local], 1, 1, pp_size=2))
    assert "slot bytes" in str(state_problem(
        [StateSpec("m", 4, ((0, 48),), replicated=True)],
        [StateSpec("m", 4, ((0, 40),), replicated=True)], 2, 1))


def test_a_slot_count_mismatch_is_a_protocol_error() -> None:
    state = StateSpec("m", 4, ((1000, 8),))
    pool = PoolSpec("mla", 1, 1, 1, 8, 1, 0, (10,), 20, 16, 1, states=(state,))
    cuts = [state_cuts(state, state, 0, 0, 1, 1)]
    with pytest.raises(ProtocolError, match="prefill has 1 slots for the room, decode 2"):
        plan_states(pool, pool, cuts, [np.array([0])], [np.array([1, 2])])


def test_host_pool_fills_checks_and_sanitizes_state_slots() -> None:
    """The test pools' state bytes are a function of the global position (so ranks of other
    TP sizes agree), checked slot by slot in every buffer, and a slot is one sanitizer row
    over every buffer of the component."""
    whole = host_pool(states=(StateShape("s", (8,), segments=(((2, 4),),)),), state_slots=(4,))
    halves = [host_pool(states=(StateShape("s", (4,), segments=(((2, 2),),)),),
                        state_slots=(4,), tp_rank=r) for r in range(2)]
    whole.fill_state(0, np.array([1]), room=5)
    for r, half in enumerate(halves):
        half.state_arrays[0][0][2] = whole.state_arrays[0][0][1][4 * r : 4 * r + 4]
        assert half.bad_state_slots(0, np.array([2]), room=5) == 0
        assert half.bad_state_slots(0, np.array([2]), room=6) == 1  # another room's bytes
    halves[1].state_arrays[0][0][2, 3] ^= 1
    assert halves[1].bad_state_slots(0, np.array([2]), room=5) == 1
    pool = mamba_pool()
    alloc = PageAllocator(pool.state_rows(0), DEST_POISON)
    assert all((a == DEST_POISON).all() for a in pool.state_arrays[0])
    ids = alloc.alloc_nowait(2)
    assert ids is not None
    alloc.free(ids)
    pool.state_arrays[0][3][int(ids[1]), 5] = 1  # a late write into the last buffer alone
    assert alloc.late_in_free_rows() == 1


# ------------------------------------------------------------------------------ real engines


def mamba_pool(rank: int = 0, shape: StateShape = MAMBA, slots: int = 8) -> HostKVPool:
    return host_pool(states=(shape,), state_slots=(slots,), tp_rank=rank)


@asynccontextmanager
async def state_pair(
    engine_name: str, url: str, *, dst_shape: StateShape = MAMBA,
    wrap: Callable[[TransferEngine], TransferEngine] | None = None,
    decode_config: DecodeConfig | None = None,
) -> AsyncIterator[tuple[PrefillAgent, DecodeAgent, HostKVPool, HostKVPool]]:
    """One prefill and one decode rank on loopback with a Mamba-like state component of 8
    slots each; decode's slots poisoned."""
    src, dst = mamba_pool(), mamba_pool(shape=dst_shape)
    for rows in dst.state_arrays[0]:
        rows[...] = DEST_POISON
    async with open_pair(engine_name, url, src=src, dst=dst, wrap=wrap,
                         decode_config=decode_config) as pair:
        yield pair.prefill, pair.decode, src, dst


def poisoned(dst: HostKVPool, slots: list[int]) -> bool:
    return all(bool((rows[slots] == DEST_POISON).all()) for rows in dst.state_arrays[0])


async def test_states_arrive_byte_for_byte(engine_name: str, bootstrap_url: str) -> None:
    """Three rooms, with one, two and no state slots, each in two chunks: decode's slots
    hold the request's state bytes, in the order named; no other slot is touched."""
    async with state_pair(engine_name, bootstrap_url) as (prefill, decode, src, dst):
        rooms = [(50, [2], [6]), (51, [0, 5], [3, 1]), (52, [], [])]
        receivers = []
        for k, (room, s_slots, d_slots) in enumerate(rooms):
            sp, dp = np.arange(4 * k, 4 * k + 4), np.arange(40 + 4 * k, 44 + 4 * k)
            src.fill(sp, room)
            src.fill_aux(k, room)
            src.fill_state(0, np.array(s_slots, dtype=np.int64), room)
            sender = prefill.sender(room, num_pages=4, aux_slot=k)
            receiver = decode.receiver(room, bootstrap_url=bootstrap_url)
            receiver.init(dp, 10 + k, state_slots=[d_slots])
            sender.send(sp[:2])
            sender.send(sp[2:], last=True, state_slots=[s_slots])
            receivers.append(receiver)
        with trio.fail_after(BOUND):
            for r in receivers:
                assert await r.wait() is KVPoll.Success, r.failure
        for room, _s, d_slots in rooms:
            assert dst.bad_state_slots(0, np.array(d_slots, dtype=np.int64), room) == 0
        assert poisoned(dst, [2, 4, 5, 7])
        # the slot order is the request's: slot 3 holds index 0, slot 1 index 1
        assert dst.bad_state_slots(0, np.array([1, 3]), 51) == 2


async def test_state_slot_arrays_reused_after_the_call_change_nothing(
    engine_name: str, bootstrap_url: str
) -> None:
    """The state slots a call is given are the room's, not a view of the caller's int64
    arrays: a scheduler that reuses its slot buffers once ``init`` and ``send`` return
    redirects no state write."""
    async with state_pair(engine_name, bootstrap_url) as (prefill, decode, src, dst):
        sp, dp = np.arange(0, 4), np.arange(40, 44)
        src.fill(sp, 53)
        src.fill_aux(0, 53)
        src.fill_state(0, np.array([2], dtype=np.int64), 53)
        sender = prefill.sender(53, num_pages=4, aux_slot=0)
        receiver = decode.receiver(53, bootstrap_url=bootstrap_url)
        d_slots = np.array([6], dtype=np.int64)
        receiver.init(dp, 10, state_slots=[d_slots])
        d_slots[0] = 1
        s_slots = np.array([2], dtype=np.int64)
        sender.send(sp, last=True, state_slots=[s_slots])
        s_slots[0] = 4
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Success, receiver.failure
        assert dst.bad_state_slots(0, np.array([6], dtype=np.int64), 53) == 0
        assert poisoned(dst, [0, 1, 2, 3, 4, 5, 7])


async def test_a_slot_count_mismatch_fails_the_room_on_both_sides(
    engine_name: str, bootstrap_url: str
) -> None:
    async with state_pair(engine_name, bootstrap_url) as (prefill, decode, src, dst):
        src.fill(np.arange(4), 7)
        sender = prefill.sender(7, num_pages=4, aux_slot=0)
        receiver = decode.receiver(7, bootstrap_url=bootstrap_url)
        receiver.init(np.arange(10, 14), 3, state_slots=[[1, 2]])
        sender.send(np.arange(4), last=True, state_slots=[[0]])
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Failed
            assert await sender.wait() is KVPoll.Failed
        assert "prefill has 1 slots for the room, decode 2" in str(sender.failure)
        assert "prefill has 1 slots" in str(receiver.failure)
        assert poisoned(dst, list(range(8)))  # nothing of the states was written


@pytest.mark.parametrize("checker", ["decode", "prefill"])
async def test_a_decode_pool_with_other_states_is_refused(
    engine_name: str, bootstrap_url: str, checker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode pool whose state component differs (an SSM state of another size) cannot
    pair. The bootstrap record names prefill's components, so decode tells by itself, before
    it registers: its room fails at once (not at its deadline), naming the component. A
    decode that registers anyway (its own check switched off here) is refused at REGISTER,
    and the prefill room its TRANSFER names fails with the same reason; nothing is
    written."""
    if checker == "prefill":
        monkeypatch.setattr(_sources, "_states_problem", lambda *_a: None)
    other = StateShape("mamba", (64, 64, 64, 32), segments=(*MAMBA.segments[:3], ((32, 1),)))
    want = "state component 'mamba', buffer 3: segments (unit bytes, units in all): " \
        "prefill [(64, 1)], decode [(32, 1)]"
    async with state_pair(engine_name, bootstrap_url, dst_shape=other,
                          decode_config=DecodeConfig(waiting_timeout=5.0)) as (prefill, decode,
                                                                               _src, dst):
        sender = prefill.sender(9, num_pages=4, aux_slot=0)
        receiver = decode.receiver(9, bootstrap_url=bootstrap_url)
        receiver.init(np.arange(4), 1, state_slots=[[0]])
        sender.send(np.arange(4), last=True, state_slots=[[0]])
        with trio.fail_after(4.0):
            if checker == "prefill":
                assert await sender.wait() is KVPoll.Failed
                assert isinstance(sender.failure, IncompatiblePeer), sender.failure
                assert want in str(sender.failure)
            else:
                assert await receiver.wait() is KVPoll.Failed
                assert isinstance(receiver.failure, IncompatiblePeer), receiver.failure
                assert want in str(receiver.failure)
                assert decode.statistics().timeouts == 0
                sender.abort()  # (decode never registered: its room waits for no TRANSFER)
        receiver.abort()
        assert prefill.statistics().engine_calls == 0
        assert poisoned(dst, list(range(8)))


@pytest.mark.parametrize(("call", "match"), [
    (lambda r: r.init(np.arange(4), 0, state_slots=[[8]]), r"slot 8 .* outside \[0, 8\)"),
    (lambda r: r.init(np.arange(4), 0, state_slots=[[1, 1]]), "repeat a slot"),
    (lambda r: r.init(np.arange(4), 0, state_slots=[[1], [2]]), "one list per state"),
    (lambda r: r.init(np.arange(4), 0, state_slots=[[0.5]]), "list of ints"),
    (lambda r: r.init(np.arange(4), 0, state_slots=[[1, [2]]]), "list of ints"),  # ragged
])
async def test_decode_refuses_bad_state_slots(
    bootstrap_url: str, call: Callable[[Any], None], match: str
) -> None:
    pool = mamba_pool()
    engine = make_engine("mooncake")
    try:
        async with open_decode(engine=engine, pool=pool.spec) as decode:
            receiver = decode.receiver(1, bootstrap_url=bootstrap_url)
            with pytest.raises(ProtocolError, match=match):
                call(receiver)
            receiver.abort()
    finally:
        engine.close()


async def test_prefill_refuses_bad_state_slots(bootstrap_url: str) -> None:
    pool = mamba_pool()
    engine = make_engine("mooncake")
    try:
        async with open_prefill(engine=engine, pool=pool.spec, bootstrap_url=bootstrap_url,
                                kv_heads=2) as prefill:
            sender = prefill.sender(1, num_pages=4, aux_slot=0)
            with pytest.raises(ProtocolError, match="go with the last chunk"):
                sender.send(np.arange(2), state_slots=[[0]])
            with pytest.raises(ProtocolError, match=r"source slot 9 .* outside \[0, 8\)"):
                sender.send(np.arange(4), last=True, state_slots=[[9]])
            sender.abort()
    finally:
        engine.close()


async def test_more_state_slots_than_a_transfer_carries_are_refused_up_front(
    bootstrap_url: str,
) -> None:
    """A request naming more slots than its TRANSFER's header can carry is refused by
    ``init`` and ``send``, before anything is committed: the TRANSFER used to fail to encode
    later, in the task that resolves every room's instance, and the error tore the decode
    agent down (or, once resolved, ``init`` raised with the room half made, and its
    ``on_release`` still ran at its deadline)."""
    from trio_pd.core._memory import MAX_REQUEST_STATE_SLOTS

    many = MAX_REQUEST_STATE_SLOTS + 1
    tiny = StateShape("swa", (1,))
    src = host_pool(states=(tiny,), state_slots=(many,))
    dst = host_pool(states=(tiny,), state_slots=(many,))
    released: list[int] = []
    async with open_pair("mooncake", bootstrap_url, src=src, dst=dst) as pair:
        receiver = pair.decode.receiver(1, bootstrap_url=bootstrap_url)
        with pytest.raises(ProtocolError, match=f"more than {MAX_REQUEST_STATE_SLOTS}"):
            receiver.init(np.arange(4), 0, state_slots=[np.arange(many)],
                          on_release=lambda: released.append(1))
        sender = pair.prefill.sender(1, num_pages=4, aux_slot=0)
        with pytest.raises(ProtocolError, match=f"more than {MAX_REQUEST_STATE_SLOTS}"):
            sender.send(np.arange(4), last=True, state_slots=[np.arange(many)])
        receiver.abort()
        sender.abort()
        # the agents serve on
        slots = np.array([0, 7, many - 1])
        src.fill(np.arange(4), 2)
        src.fill_aux(1, 2)
        src.fill_state(0, slots, 2)
        sender = pair.prefill.sender(2, num_pages=4, aux_slot=1)
        receiver = pair.decode.receiver(2, bootstrap_url=bootstrap_url)
        receiver.init(np.arange(4, 8), 1, state_slots=[slots])
        sender.send(np.arange(4), last=True, state_slots=[slots])
        with trio.fail_after(10):
            assert await receiver.wait() is KVPoll.Success, receiver.failure
        assert dst.bad_state_slots(0, slots, 2) == 0
    assert released == []
    # and a TRANSFER right at the bound, its slots as long as msgpack makes them, encodes
    most = (1 << 63) - 1
    at_bound = _wire.Transfer(
        v=_wire.WIRE_VERSION, room=most, epoch=most, endpoint="tcp://127.0.0.1:65535",
        decode_rank=0, aux_slot=most, required=1, num_pages=4, prefix_pages=0,
        state_slots=(tuple(range(most - MAX_REQUEST_STATE_SLOTS + 1, most + 1)),),
    )
    header, _ = _wire.encode(at_bound, np.arange(4))
    assert len(header) <= _wire.MAX_HEADER_BYTES


async def test_a_transfer_that_cannot_be_encoded_fails_its_room_only(
    bootstrap_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Should a TRANSFER still fail to encode (a bug: ``init`` checks what it can), its room
    fails with the reason and the decode agent serves on, also when the send runs in the
    task that resolves the prefill instance (the first room of an instance)."""
    src, dst = mamba_pool(), mamba_pool()
    async with open_pair("mooncake", bootstrap_url, src=src, dst=dst) as pair:
        control = pair.decode.control
        real = control.send_nowait

        def refuse(endpoint: str, msg: Any, pages: Any = None) -> bool:
            if isinstance(msg, _wire.Transfer) and msg.room == 1:
                raise ProtocolError("refusing to encode Transfer: header too big")
            return real(endpoint, msg, pages)

        monkeypatch.setattr(control, "send_nowait", refuse)
        receiver = pair.decode.receiver(1, bootstrap_url=bootstrap_url)
        receiver.init(np.arange(4), 0, state_slots=[[1]])
        with trio.fail_after(10):
            assert await receiver.wait() is KVPoll.Failed
        assert isinstance(receiver.failure, ProtocolError)
        assert "header too big" in str(receiver.failure)
        src.fill(np.arange(4), 2)
        src.fill_aux(1, 2)
        src.fill_state(0, np.array([3]), 2)
        sender = pair.prefill.sender(2, num_pages=4, aux_slot=1)
        receiver = pair.decode.receiver(2, bootstrap_url=bootstrap_url)
        receiver.init(np.arange(4, 8), 1, state_slots=[[3]])
        sender.send(np.arange(4), last=True, state_slots=[[3]])
        with trio.fail_after(10):
            assert await receiver.wait() is KVPoll.Success, receiver.failure


@pytest.mark.parametrize("drain", ["real", "broken"])
async def test_abort_during_the_state_write_leaves_no_late_write_in_a_slot(
    engine_name: str, bootstrap_url: str, drain: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last chunk's write (KV pages, the aux row and the state slots) is held inside the
    engine when decode aborts the room. With the real drain decode hands its slots back only
    once that write has returned, so the sanitizer (the slots' allocator poisons a slot in
    every buffer of the component at release and checks it) sees no late write. With the
    drain broken (prefill abandons the running call on abort), the write lands in the slots
    after their release, and the sanitizer sees it."""
    faults, wrap = stall_every_write(drain, monkeypatch)

    async with state_pair(engine_name, bootstrap_url, wrap=wrap) as (prefill, decode, src, dst):
        gate = faults[0].stalls
        try:
            slots = PageAllocator(dst.state_rows(0), DEST_POISON)
            mine = slots.alloc_nowait(2)
            assert mine is not None
            released = trio.Event()

            def release() -> None:
                slots.free(mine)
                released.set()

            src.fill(np.arange(4), 8)
            src.fill_state(0, np.array([3, 4]), 8)
            sender = prefill.sender(8, num_pages=4, aux_slot=1)
            receiver = decode.receiver(8, bootstrap_url=bootstrap_url)
            receiver.init(np.arange(20, 24), 2, on_release=release, state_slots=[mine])
            sender.send(np.arange(4), last=True, state_slots=[[3, 4]])
            await abort_a_stalled_write(drain, faults[0], receiver, sender, released)
            if drain == "real":
                assert slots.late_in_free_rows() == 0
            else:
                assert slots.late_in_free_rows() == 2  # both slots, written after release
        finally:
            gate.release_all()


# ------------------------------------------------------------------------------ the demo


async def test_demo_moves_and_verifies_every_state_kind() -> None:
    """Mamba, sliding-window and NSA components at once (P == D here; the topology matrix
    runs them where a slot splits differently on the two sides): every Success verified
    byte for byte in every slot of every component."""
    opts = DemoOptions(states=("mamba", "swa", "nsa"), requests=10, concurrency=3,
                       max_tokens=96, layers=1, kv_heads=4)
    summary = await run_in_process(opts)
    assert summary["succeeded"] == 10, summary
    assert summary["corrupt_pages"] == summary["late_writes"] == summary["leaked_pages"] == 0


async def test_demo_with_mamba_states_aborts_and_faults_leaves_no_late_write() -> None:
    """Aborts on both sides and engine faults (partial writes, delayed writes) while Mamba
    states move: no late write into any page or state slot, nothing corrupt or leaked."""
    opts = DemoOptions(
        states=("mamba",), requests=40, concurrency=4, abort_rate=0.5, fault_rate=1.0,
        fault_kinds=("delay_before", "partial"), fault_delay=0.005, max_tokens=256, seed=5,
        quarantine_fence=1.0,
    )
    summary = await run_in_process(opts)
    assert summary["aborted"] > 0 and summary["engine_errors"] > 0, summary
    assert summary["late_writes"] == 0, summary
    assert summary["corrupt_pages"] == summary["leaked_pages"] == summary["hung"] == 0, summary


@pytest.mark.parametrize(("kw", "says"), [
    ({"states": ("lstm",)}, "--state: unknown"),
    ({"states": ("mamba", "mamba")}, "--state: unknown or repeated"),
    ({"states": ("mamba",), "prefill_tp": 16, "kv_heads": 16}, "TP 16 does not divide"),
    ({"states": ("nsa",), "prefill_pp": 2}, "one prefill PP stage"),
])
def test_demo_refuses_bad_states(kw: dict[str, Any], says: str) -> None:
    problem = DemoOptions(**kw).option_problem()
    assert problem is not None and says in problem


def test_cli_takes_states() -> None:
    parser, _ = cli._parser()
    got = cli._options(parser.parse_args(["demo", "--state", "mamba,nsa"]))
    assert got.states == ("mamba", "nsa")
    assert cli._options(parser.parse_args(["demo"])).states == ()


async def test_pp_with_states_is_refused_before_anything_starts() -> None:
    pool = mamba_pool()
    engine = make_engine("mooncake")
    try:
        with pytest.raises(ConfigurationError, match="pipeline"):
            async with open_prefill(engine=engine, pool=pool.spec,
                                    bootstrap_url="http://127.0.0.1:1", kv_heads=2, pp_size=2,
                                    pp_rank=0):
                pass
    finally:
        engine.close()

