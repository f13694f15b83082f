"""Transfer planning (SPEC §2, §3, I8).

The strongest checks here run the planned blocks as memcpy over small numpy arrays standing in
for source and destination memory, and compare the result with what a naive per-page /
per-token loop would copy. Every fake "byte" is an int64 that encodes where it came from
(buffer, page, token slot, global head, byte), so a misplaced byte is always visible.
"""

from __future__ import annotations

import itertools
from typing import Literal

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_pd.core import _memory
from trio_pd.core._errors import ProtocolError, RegionError
from trio_pd.core._memory import PoolSpec, Region, RegionTable, validate_pages
from trio_pd.core._plan import (
    SMALL_CHUNK,
    Blocks,
    chunk_ranges,
    concat,
    contiguous_runs,
    empty,
    plan_aux,
    plan_pages,
    plan_small,
    stages_pages,
    total_bytes,
    validate_blocks,
)
from trio_pd.core._topology import (
    aux_writer,
    head_range,
    served_decode_ranks,
    source_ranks,
    write_heads,
)

from .helpers.plans import FAST, PATHS, assert_same_blocks, make_pool, on_path

Mem = npt.NDArray[np.int64]


# --------------------------------------------------------------------------------------------
# Helpers: pools, fake memory, memcpy, naive reference planner
# --------------------------------------------------------------------------------------------


def mem_size(pool: PoolSpec) -> int:
    return pool.aux_base + pool.aux_slots * pool.aux_item_len + 32


def fill_source(pool: PoolSpec, *, aux_tag: int = 7) -> Mem:
    """Memory of one rank whose every KV byte says which (buffer, page, token, global head,
    byte) it is: replicas of one head on different ranks hold the same bytes, as on a GPU."""
    mem = np.full(mem_size(pool), -1, dtype=np.int64)
    b, pg, t, k, y = np.meshgrid(
        np.arange(pool.num_buffers),
        np.arange(pool.num_pages),
        np.arange(pool.page_size),
        np.arange(pool.heads),
        np.arange(pool.head_bytes),
        indexing="ij",
    )
    addr = (
        np.array(pool.buffer_bases)[b]
        + pg * pool.item_len
        + t * pool.slot_bytes
        + k * pool.head_bytes
        + y
    )
    mem[addr.ravel()] = encode_arr(b, pg, t, k + pool.first_head, y).ravel()
    aux = np.arange(pool.aux_slots * pool.aux_item_len, dtype=np.int64)
    mem[pool.aux_base : pool.aux_base + aux.size] = -(aux_tag * 100_000 + aux + 1)
    return mem


def encode_arr(*parts: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    b, pg, t, h, y = (np.asarray(p, dtype=np.int64) for p in parts)
    return (((b * 1000 + pg) * 1000 + t) * 1000 + h) * 1000 + y + 1


def memcpy(blocks: Blocks, src_mem: Mem, dst_mem: Mem, count: Mem | None = None) -> None:
    """Apply every block as a copy; ``count`` tallies how often each destination byte is
    written."""
    lens = blocks.lens.astype(np.int64)
    if lens.size == 0:
        return
    starts = np.cumsum(lens) - lens
    offsets = np.arange(int(lens.sum())) - np.repeat(starts, lens)
    s = np.repeat(blocks.src.astype(np.int64), lens) + offsets
    d = np.repeat(blocks.dst.astype(np.int64), lens) + offsets
    dst_mem[d] = src_mem[s]
    if count is not None:
        np.add.at(count, d, 1)


def naive_plan(
    src: PoolSpec,
    dst: PoolSpec,
    src_pages: list[int],
    dst_pages: list[int],
    heads: tuple[int, int] | None,
) -> list[tuple[int, int, int]]:
    """One block per page per buffer, or per token slot when heads are sliced."""
    out: list[tuple[int, int, int]] = []
    for i in range(src.num_buffers):
        for sp, dp in zip(src_pages, dst_pages, strict=True):
            s = src.buffer_bases[i] + sp * src.item_len
            d = dst.buffer_bases[i] + dp * dst.item_len
            if heads is None:
                out.append((s, d, src.item_len))
                continue
            h0, h1 = heads
            for t in range(src.page_size):
                out.append(
                    (
                        s + t * src.slot_bytes + (h0 - src.first_head) * src.head_bytes,
                        d + t * dst.slot_bytes + (h0 - dst.first_head) * dst.head_bytes,
                        (h1 - h0) * src.head_bytes,
                    )
                )
    return out


def naive_memcpy(blocks: list[tuple[int, int, int]], src_mem: Mem, dst_mem: Mem) -> None:
    for s, d, n in blocks:
        dst_mem[d : d + n] = src_mem[s : s + n]


def as_blocks(rows: list[tuple[int, int, int]]) -> Blocks:
    arr = np.array(rows, dtype=np.uint64).reshape(-1, 3)
    return Blocks(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy())


@st.composite
def page_lists(draw: st.DrawFn, num_pages: int, max_len: int = 8) -> tuple[list[int], list[int]]:
    """Aligned (src, dst) page lists: destination pages unique, source pages may repeat; runs
    of consecutive ids are likely so both the merging and the splitting get exercised."""
    n = draw(st.integers(0, min(max_len, num_pages)))
    dst = draw(st.permutations(range(num_pages)))[:n]
    if draw(st.booleans()):
        dst = sorted(dst)
    src = draw(st.lists(st.integers(0, num_pages - 1), min_size=n, max_size=n))
    if draw(st.booleans()) and n:
        start = draw(st.integers(0, num_pages - n))
        src = list(range(start, start + n))
    return src, dst


# --------------------------------------------------------------------------------------------
# contiguous_runs
# --------------------------------------------------------------------------------------------


def naive_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


@PATHS
@FAST
@given(
    st.integers(0, 12).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(0, 6), min_size=n, max_size=n),
            st.lists(st.integers(0, 6), min_size=n, max_size=n),
        )
    )
)
def test_contiguous_runs_matches_naive(path: str, lists: tuple[list[int], list[int]]) -> None:
    src, dst = lists
    with on_path(path):
        s0, d0, n = contiguous_runs(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))
    assert list(zip(s0.tolist(), d0.tolist(), n.tolist(), strict=True)) == naive_runs(src, dst)


@PATHS
def test_contiguous_runs_splits_where_either_side_breaks(path: str) -> None:
    with on_path(path):
        s0, d0, n = contiguous_runs(np.array([1, 2, 3, 7, 8]), np.array([10, 11, 20, 21, 22]))
    assert s0.tolist() == [1, 3, 7]
    assert d0.tolist() == [10, 20, 21]
    assert n.tolist() == [2, 1, 2]


def test_contiguous_runs_empty_and_mismatched() -> None:
    s0, d0, n = contiguous_runs(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert s0.size == d0.size == n.size == 0
    with pytest.raises(ValueError):
        contiguous_runs(np.arange(3), np.arange(2))


# --------------------------------------------------------------------------------------------
# plan_pages against the naive planner, by memory contents
# --------------------------------------------------------------------------------------------


@PATHS
@FAST
@given(
    layout=st.sampled_from(["mha", "mla"]),
    page_size=st.integers(1, 4),
    head_bytes=st.integers(1, 3),
    heads=st.integers(1, 3),
    num_layers=st.integers(1, 2),
    data=st.data(),
)
def test_plan_pages_whole_pages_matches_naive(
    path: str,
    layout: Literal["mha", "mla"],
    page_size: int,
    head_bytes: int,
    heads: int,
    num_layers: int,
    data: st.DataObject,
) -> None:
    if layout == "mla":
        heads = 1
    src = make_pool(
        layout=layout,
        page_size=page_size,
        head_bytes=head_bytes,
        heads=heads,
        num_layers=num_layers,
        num_pages=9,
        base=40,
    )
    dst = make_pool(
        layout=layout,
        page_size=page_size,
        head_bytes=head_bytes,
        heads=heads,
        num_layers=num_layers,
        num_pages=7,
        base=8,
        gap=5,
    )
    src_pages, dst_pages = data.draw(page_lists(7))
    src_mem = fill_source(src)

    with on_path(path):
        blocks = plan_pages(
            src, dst, np.array(src_pages, np.int64), np.array(dst_pages, np.int64)
        )
    assert blocks.src.dtype == blocks.dst.dtype == blocks.lens.dtype == np.uint64
    got = np.zeros(mem_size(dst), np.int64)
    count = np.zeros_like(got)
    memcpy(blocks, src_mem, got, count)

    want = np.zeros_like(got)
    naive_memcpy(naive_plan(src, dst, src_pages, dst_pages, None), src_mem, want)
    np.testing.assert_array_equal(got, want)
    assert count.max(initial=0) <= 1
    assert total_bytes(blocks) == len(dst_pages) * dst.item_len * dst.num_buffers
    runs = len(naive_runs(src_pages, dst_pages))
    assert len(blocks.lens) == runs * dst.num_buffers
    validate_blocks(blocks, dst.regions())


@FAST
@given(
    page_size=st.integers(1, 4),
    head_bytes=st.integers(1, 3),
    src_heads=st.tuples(st.integers(0, 3), st.integers(1, 4)),
    dst_heads=st.tuples(st.integers(0, 3), st.integers(1, 4)),
    data=st.data(),
)
def test_plan_pages_head_slices_matches_naive(
    page_size: int,
    head_bytes: int,
    src_heads: tuple[int, int],
    dst_heads: tuple[int, int],
    data: st.DataObject,
) -> None:
    lo = max(src_heads[0], dst_heads[0])
    hi = min(sum(src_heads), sum(dst_heads))
    if lo >= hi:
        return
    h0 = data.draw(st.integers(lo, hi - 1))
    h1 = data.draw(st.integers(h0 + 1, hi))
    src = make_pool(
        page_size=page_size,
        head_bytes=head_bytes,
        heads=src_heads[1],
        first_head=src_heads[0],
        num_pages=6,
        base=24,
    )
    dst = make_pool(
        page_size=page_size,
        head_bytes=head_bytes,
        heads=dst_heads[1],
        first_head=dst_heads[0],
        num_pages=5,
        base=3,
        gap=7,
    )
    src_pages, dst_pages = data.draw(page_lists(5))
    src_mem = fill_source(src)

    blocks = plan_pages(src, dst, np.array(src_pages), np.array(dst_pages), heads=(h0, h1))
    got = np.zeros(mem_size(dst), np.int64)
    count = np.zeros_like(got)
    memcpy(blocks, src_mem, got, count)

    whole = src_heads == dst_heads == (h0, h1 - h0)
    want = np.zeros_like(got)
    naive_memcpy(
        naive_plan(src, dst, src_pages, dst_pages, None if whole else (h0, h1)), src_mem, want
    )
    np.testing.assert_array_equal(got, want)
    assert count.max(initial=0) <= 1
    assert total_bytes(blocks) == len(dst_pages) * page_size * (h1 - h0) * head_bytes * 4
    validate_blocks(blocks, dst.regions())


@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_contiguous_pages_give_one_block_per_buffer(layout: Literal["mha", "mla"]) -> None:
    pool = make_pool(layout=layout, num_layers=3, num_pages=100)
    blocks = plan_pages(pool, pool, np.arange(10, 60), np.arange(40, 90))
    assert len(blocks.lens) == pool.num_buffers
    assert set(blocks.lens.tolist()) == {50 * pool.item_len}
    # Identical head sets on both sides take the same path as heads=None.
    same = plan_pages(pool, pool, np.arange(10, 60), np.arange(40, 90), heads=(0, 1))
    for a, b in zip(same, blocks, strict=True):
        np.testing.assert_array_equal(a, b)


def test_plan_pages_empty() -> None:
    pool = make_pool()
    blocks = plan_pages(pool, pool, np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert len(blocks.lens) == 0 and blocks.lens.dtype == np.uint64
    sliced = make_pool(heads=2)
    assert len(plan_pages(sliced, pool, [], [], heads=(0, 1)).lens) == 0


def test_plan_pages_refuses_layouts_that_do_not_fit() -> None:
    two = make_pool(heads=2)
    one = make_pool(heads=1, first_head=1)
    pages = np.arange(2)
    with pytest.raises(ValueError, match="item_len"):
        plan_pages(two, one, pages, pages)
    with pytest.raises(ValueError, match="does not fit"):
        plan_pages(two, one, pages, pages, heads=(0, 1))  # head 0 is not on the destination
    with pytest.raises(ValueError, match="does not fit"):
        plan_pages(two, one, pages, pages, heads=(1, 3))  # head 2 is on neither
    with pytest.raises(ValueError, match="does not fit"):
        plan_pages(two, one, pages, pages, heads=(1, 1))  # empty slice
    with pytest.raises(ValueError, match="does not fit"):  # as many heads, but other ones
        plan_pages(make_pool(heads=1), one, pages, pages, heads=(0, 1))
    assert not stages_pages(make_pool(heads=1), one, (0, 1))  # (not whole pages either)
    with pytest.raises(ValueError, match="per head"):
        plan_pages(two, make_pool(heads=1, first_head=1, head_bytes=4), pages, pages, heads=(1, 2))
    with pytest.raises(ValueError, match="page size"):
        plan_pages(two, make_pool(heads=2, page_size=8), pages, pages)
    with pytest.raises(ValueError, match="buffers"):
        plan_pages(two, make_pool(heads=2, num_layers=3), pages, pages)
    with pytest.raises(ValueError):
        plan_pages(two, two, np.arange(3), np.arange(2))


def test_plan_pages_refuses_bad_page_ids() -> None:
    pool = make_pool(num_pages=8)
    with pytest.raises(ProtocolError):
        plan_pages(pool, pool, [0, 1], [7, 8])
    with pytest.raises(ProtocolError):
        plan_pages(pool, pool, [0, -1], [1, 2])
    with pytest.raises(ProtocolError, match="repeated"):
        plan_pages(pool, pool, [0, 1], [3, 3])
    # Reading one source page twice is allowed.
    assert len(plan_pages(pool, pool, [2, 2], [3, 4]).lens) == 2 * pool.num_buffers


# --------------------------------------------------------------------------------------------
# Topology
# --------------------------------------------------------------------------------------------


def test_head_range_examples() -> None:
    assert head_range(1, 4, 8) == (2, 2)
    assert head_range(3, 4, 8) == (6, 2)
    # GQA replication: integer division, not modulo.
    assert [head_range(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [head_range(r, 8, 1)[0] for r in range(8)] == [0] * 8
    for bad in [(0, 3, 8), (0, 4, 3), (4, 4, 8), (-1, 4, 8), (0, 0, 8)]:
        with pytest.raises(ValueError):
            head_range(*bad)


def test_source_and_served_ranks_examples() -> None:
    assert [list(source_ranks(d, 2, 4)) for d in range(4)] == [[0], [0], [1], [1]]
    assert [list(source_ranks(d, 4, 2)) for d in range(2)] == [[0, 1], [2, 3]]
    assert [list(served_decode_ranks(p, 2, 4)) for p in range(2)] == [[0, 1], [2, 3]]
    assert [list(served_decode_ranks(p, 4, 2)) for p in range(4)] == [[0], [0], [1], [1]]
    assert aux_writer(1, 4, 2) == 2
    with pytest.raises(ValueError):
        source_ranks(0, 3, 2)
    with pytest.raises(ValueError):
        served_decode_ranks(0, 2, 3)


def test_write_heads_examples() -> None:
    # P=4 > H=2 = D: ranks 0,1 hold head 0, ranks 2,3 head 1; only the lowest holder writes.
    assert [write_heads(p, 0, 4, 2, 2, "mha") for p in (0, 1)] == [(0, 1), None]
    assert [write_heads(p, 1, 4, 2, 2, "mha") for p in (2, 3)] == [(1, 2), None]
    # P=4 > D=2, H=8: every prefill rank sends its own two heads.
    assert [write_heads(p, 0, 4, 2, 8, "mha") for p in (0, 1)] == [(0, 2), (2, 4)]
    # D > P: each decode rank takes its slice of the one prefill rank's heads.
    assert [write_heads(0, d, 1, 4, 8, "mha") for d in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # MLA: one real sender, the others are dummies.
    assert [write_heads(p, 0, 4, 1, 1, "mla") for p in range(4)] == [(0, 1), None, None, None]
    # Not a source rank of that decode rank at all.
    assert write_heads(1, 0, 2, 2, 2, "mha") is None


TOPOLOGIES = st.sampled_from([1, 2, 4, 8]).flatmap(
    lambda h: st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]), st.just(h))
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    topo=TOPOLOGIES,
    layout=st.sampled_from(["mha", "mla"]),
    page_size=st.integers(1, 3),
    head_bytes=st.integers(1, 3),
    num_layers=st.integers(1, 2),
    data=st.data(),
)
def test_every_head_of_every_slot_is_written_exactly_once(
    topo: tuple[int, int, int],
    layout: Literal["mha", "mla"],
    page_size: int,
    head_bytes: int,
    num_layers: int,
    data: st.DataObject,
) -> None:
    """Across all prefill ranks, each byte of each requested destination page on each decode
    rank is written exactly once, with the bytes of the right source page, token and head;
    nothing else is written; each decode rank's aux row arrives exactly once."""
    p_tp, d_tp, total = topo
    if layout == "mla":
        total = 1

    def pool(rank: int, tp: int, base: int, num_pages: int) -> PoolSpec:
        first, count = head_range(rank, tp, total)
        return make_pool(
            layout=layout,
            page_size=page_size,
            head_bytes=head_bytes,
            heads=count,
            first_head=first,
            num_layers=num_layers,
            num_pages=num_pages,
            base=base,
        )

    n_src, n_dst = 5, 6
    prefill = [pool(p, p_tp, 16 + 3 * p, n_src) for p in range(p_tp)]
    decode = [pool(d, d_tp, 5 + d, n_dst) for d in range(d_tp)]
    src_mem = [fill_source(pl, aux_tag=p + 1) for p, pl in enumerate(prefill)]
    n = data.draw(st.integers(0, n_src))
    src_pages = np.array(data.draw(st.permutations(range(n_src)))[:n], dtype=np.int64)
    dst_pages = [
        np.array(data.draw(st.permutations(range(n_dst)))[:n], dtype=np.int64) for _ in range(d_tp)
    ]
    src_slot = data.draw(st.integers(0, 3))
    dst_slots = [data.draw(st.integers(0, 3)) for _ in range(d_tp)]

    for p in range(p_tp):
        assert list(served_decode_ranks(p, p_tp, d_tp)) == [
            d for d in range(d_tp) if p in source_ranks(d, p_tp, d_tp)
        ]

    for d in range(d_tp):
        dst = decode[d]
        got = np.zeros(mem_size(dst), np.int64)
        count = np.zeros_like(got)
        for p in source_ranks(d, p_tp, d_tp):
            heads = write_heads(p, d, p_tp, d_tp, total, layout)
            if heads is not None:
                blocks = plan_pages(
                    prefill[p],
                    dst,
                    src_pages,
                    dst_pages[d],
                    heads=heads if layout == "mha" else None,
                )
                validate_blocks(blocks, dst.regions())
                memcpy(blocks, src_mem[p], got, count)
            if p == aux_writer(d, p_tp, d_tp):
                aux = plan_aux(prefill[p], dst, src_slot, dst_slots[d])
                validate_blocks(aux, dst.regions())
                memcpy(aux, src_mem[p], got, count)

        # Expected: every (buffer, requested page, token, head held by d, byte).
        want = np.zeros_like(got)
        want_count = np.zeros_like(got)
        b, j, t, k, y = np.meshgrid(
            np.arange(dst.num_buffers),
            np.arange(n),
            np.arange(page_size),
            np.arange(dst.heads),
            np.arange(head_bytes),
            indexing="ij",
        )
        addr = (
            np.array(dst.buffer_bases)[b]
            + dst_pages[d][j] * dst.item_len
            + t * dst.slot_bytes
            + k * head_bytes
            + y
        )
        want[addr] = encode_arr(b, src_pages[j], t, k + dst.first_head, y)
        want_count[addr] = 1
        row = dst.aux_base + dst_slots[d] * dst.aux_item_len
        writer = aux_writer(d, p_tp, d_tp)
        src_row = prefill[writer].aux_base + src_slot * prefill[writer].aux_item_len
        want[row : row + dst.aux_item_len] = src_mem[writer][src_row : src_row + dst.aux_item_len]
        want_count[row : row + dst.aux_item_len] = 1

        np.testing.assert_array_equal(count, want_count)
        np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------------------------
# plan_aux, Blocks helpers
# --------------------------------------------------------------------------------------------


def test_plan_aux() -> None:
    src = make_pool(base=100, aux_item_len=16, aux_slots=4)
    dst = make_pool(base=7, aux_item_len=16, aux_slots=2)
    blocks = plan_aux(src, dst, 3, 1)
    assert blocks.src.tolist() == [src.aux_base + 48]
    assert blocks.dst.tolist() == [dst.aux_base + 16]
    assert blocks.lens.tolist() == [16]
    validate_blocks(blocks, dst.regions())
    with pytest.raises(ProtocolError):
        plan_aux(src, dst, 0, 2)
    with pytest.raises(ValueError):
        plan_aux(src, dst, 4, 0)
    with pytest.raises(ValueError, match="aux"):
        plan_aux(src, make_pool(aux_item_len=8), 0, 0)


def _general_plan(
    src: PoolSpec, dst: PoolSpec, sp: list[int], dp: list[int],
    aux: tuple[PoolSpec, PoolSpec, int, int] | None, regions: RegionTable,
    heads: tuple[int, int] | None,
) -> Blocks:
    """What the chunk planner does without :func:`plan_small` (numpy, part by part)."""
    parts = []
    if sp:
        parts.append(plan_pages(src, dst, np.array(sp), np.array(dp), heads=heads,
                                pages_checked=True))
    if aux is not None:
        parts.append(plan_aux(*aux))
    blocks = parts[0] if len(parts) == 1 else concat(parts)
    validate_blocks(blocks, regions)
    return blocks


@FAST
@given(
    layout=st.sampled_from(["mha", "mla"]),
    heads=st.sampled_from([(1, 0, None), (2, 0, (0, 2)), (2, 0, (0, 1)), (1, 1, (1, 2))]),
    dst_heads=st.booleans(),
    pages=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 11)), max_size=SMALL_CHUNK + 2),
    aux=st.one_of(st.none(), st.tuples(st.integers(-1, 4), st.integers(-1, 4))),
    aux_len=st.sampled_from([8, 16]),
    drop=st.one_of(st.none(), st.integers(0, 9)),
    page_size=st.sampled_from([4, 2]),
)
def test_plan_small_matches_the_general_path(
    layout: Literal["mha", "mla"], heads: tuple[int, int, tuple[int, int] | None],
    dst_heads: bool, pages: list[tuple[int, int]], aux: tuple[int, int] | None, aux_len: int,
    drop: int | None, page_size: int,
) -> None:
    """The small-chunk path plans exactly the blocks of plan_pages + plan_aux + concat +
    validate_blocks, or declines (None) and the general path then plans or refuses: it never
    plans something the general path would not."""
    nh, first, sliced = heads
    src = make_pool(layout=layout, heads=nh, first_head=first, num_pages=12, base=100)
    dst = make_pool(
        layout=layout, heads=nh if dst_heads else 1, first_head=first, num_pages=12,
        base=9, gap=8, aux_item_len=aux_len, page_size=page_size,
    )
    seen: set[int] = set()
    sp, dp = [], []
    for a, b in pages:  # destination ids checked (distinct), as the agents' are
        if b not in seen:
            seen.add(b)
            sp.append(a)
            dp.append(b)
    regions = dst.regions()
    if drop is not None:
        regions = [r for i, r in enumerate(regions) if i != drop % len(regions)]
    aux_arg = None if aux is None else (src, dst, aux[0], aux[1])
    _check_small(src, dst, sp, dp, aux_arg, RegionTable(regions), sliced)


def _check_small(
    src: PoolSpec, dst: PoolSpec, sp: list[int], dp: list[int],
    aux: tuple[PoolSpec, PoolSpec, int, int] | None, table: RegionTable,
    sliced: tuple[int, int] | None,
) -> None:
    """plan_small gives exactly the general path's blocks, or declines; it declines a chunk
    the general path plans only if it is not of whole pages in at most SMALL_CHUNK runs."""
    small = plan_small(src, dst, sp, dp, aux, table, heads=sliced)
    # (the agents hand it numpy arrays: the same answer)
    again = plan_small(src, dst, np.array(sp, dtype=np.int64), np.array(dp, dtype=np.int64),
                       aux, table, heads=sliced)
    assert (small is None) == (again is None)
    try:
        want: Blocks | None = _general_plan(src, dst, sp, dp, aux, table, sliced)
    except (ValueError, RegionError, ProtocolError):
        want = None
    if small is None:
        whole = sliced is None or (src.heads == dst.heads == sliced[1] - sliced[0]
                                   and src.first_head == sliced[0])
        few = contiguous_runs(sp, dp)[2].size <= SMALL_CHUNK
        applies = few and ((whole and src.item_len == dst.item_len
                            and src.page_size == dst.page_size) or not sp)
        assert want is None or not applies  # declined only what it does not plan
        return
    assert_same_blocks(small, again, want)


@FAST
@PATHS
@given(
    layout=st.sampled_from(["mha", "mla"]),
    heads=st.sampled_from([(1, 0, None), (2, 0, (0, 2)), (2, 0, (0, 1))]),
    runs=st.lists(
        st.tuples(st.one_of(st.none(), st.integers(0, 199)),
                  st.one_of(st.none(), st.integers(0, 199)), st.integers(1, 48)),
        min_size=1, max_size=SMALL_CHUNK + 3,
    ),
    aux=st.one_of(st.none(), st.tuples(st.integers(-1, 4), st.integers(-1, 4))),
    drop=st.one_of(st.none(), st.integers(0, 9)),
    swap=st.one_of(st.none(), st.tuples(st.booleans(), st.integers(0, 999), st.integers(0, 999))),
)
def test_plan_small_matches_the_general_path_on_long_chunks(
    path: str, layout: Literal["mha", "mla"], heads: tuple[int, int, tuple[int, int] | None],
    runs: list[tuple[int | None, int | None, int]], aux: tuple[int, int] | None,
    drop: int | None, swap: tuple[bool, int, int] | None,
) -> None:
    """Chunks of many pages made of runs (a start of None goes on from the last run's end,
    so runs merge), maybe with two pages of one side swapped (the first and last page
    kept: a chunk that only looks consecutive from its ends): plan_small takes those of at
    most SMALL_CHUNK runs, contiguous or not, in Python up to _memory.SMALL pages and in
    numpy above (the numpy path forces the latter), and plans exactly the general path's
    blocks or declines."""
    nh, first, sliced = heads
    src = make_pool(layout=layout, heads=nh, first_head=first, num_pages=200, base=100)
    dst = make_pool(layout=layout, heads=nh, first_head=first, num_pages=200, base=9, gap=8)
    sp: list[int] = []
    dp: list[int] = []
    seen: set[int] = set()
    a = b = 0
    for s0, d0, k in runs:
        a = a if s0 is None else s0
        b = b if d0 is None else d0
        for i in range(k):
            if a + i < 200 and b + i < 200 and b + i not in seen:
                seen.add(b + i)  # destination ids checked (distinct), as the agents' are
                sp.append(a + i)
                dp.append(b + i)
        a, b = a + k, b + k
    if swap is not None and len(sp) > 3:
        side = sp if swap[0] else dp
        i, j = 1 + swap[1] % (len(sp) - 2), 1 + swap[2] % (len(sp) - 2)
        side[i], side[j] = side[j], side[i]
    regions = dst.regions()
    if drop is not None:
        regions = [r for i, r in enumerate(regions) if i != drop % len(regions)]
    aux_arg = None if aux is None else (src, dst, aux[0], aux[1])
    with on_path(path):
        _check_small(src, dst, sp, dp, aux_arg, RegionTable(regions), sliced)


def test_plan_small_takes_long_contiguous_chunks() -> None:
    """The bench's chunk (64 pages consecutive on both sides, and the aux row) and a longer
    one in a few runs take the Python path, which declines only past SMALL_CHUNK runs."""
    src, dst = make_pool(num_pages=300, base=100), make_pool(num_pages=300, base=9)
    table = RegionTable(dst.regions())
    pages = np.arange(10, 74, dtype=np.int64)
    blocks = plan_small(src, dst, pages, pages + 5, (src, dst, 1, 2), table)
    assert blocks is not None and blocks.num_blocks == src.num_buffers + 1
    runs = np.concatenate([np.arange(20 * i, 20 * i + 15) for i in range(SMALL_CHUNK)])
    assert plan_small(src, dst, runs, runs, None, table) is not None
    more = np.concatenate([runs, [299]])
    assert plan_small(src, dst, more, more, None, table) is None
    assert plan_small(src, dst, more[:60], more[:60][::-1].copy(), None, table) is None
    # up to _memory.SMALL pages in Python: SMALL_CHUNK runs taken, one more declined
    short = np.concatenate([np.arange(9 * i, 9 * i + 7) for i in range(SMALL_CHUNK)])
    assert short.size <= _memory.SMALL
    assert plan_small(src, dst, short, short, None, table) is not None
    short = np.concatenate([short, [298]])
    assert plan_small(src, dst, short, short, None, table) is None
    # a source address past 2**64 (a source id far past the pool): declined
    far = np.array([2**62, 2**62 + 1], dtype=np.int64)
    assert plan_small(src, dst, far, np.array([0, 1]), None, table) is None


@PATHS
def test_total_bytes_never_wraps(path: str) -> None:
    """Both paths (lists for a few blocks, numpy above) sum in Python ints."""
    blocks = as_blocks([(0, 0, 2**64 - 1), (0, 8, 2**63), (0, 16, 5)])
    with on_path(path):
        assert total_bytes(blocks) == 2**64 - 1 + 2**63 + 5
        assert total_bytes(empty()) == 0


def test_blocks_helpers() -> None:
    e = empty()
    assert len(e.lens) == 0 and total_bytes(e) == 0 and e.nbytes == 0
    a = as_blocks([(0, 10, 3), (5, 20, 4)])
    b = as_blocks([(9, 30, 2**63)])
    both = concat([a, e, b])
    assert both.dst.tolist() == [10, 20, 30]
    assert both.src.dtype == both.dst.dtype == both.lens.dtype == np.uint64
    assert total_bytes(both) == 7 + 2**63  # no uint64 wrap-around
    assert both.num_blocks == 3
    assert len(concat([]).lens) == 0


# --------------------------------------------------------------------------------------------
# validate_blocks (I8)
# --------------------------------------------------------------------------------------------

REGIONS = [Region(1000, 100), Region(1100, 50), Region(5000, 10)]


@pytest.mark.parametrize(
    "block",
    [(1000, 100), (1000, 1), (1099, 1), (1100, 50), (1149, 1), (5000, 10), (5003, 2)],
)
@PATHS
def test_validate_blocks_accepts_in_range(path: str, block: tuple[int, int]) -> None:
    with on_path(path):
        validate_blocks(as_blocks([(0, *block)]), REGIONS)


@pytest.mark.parametrize(
    "block",
    [
        (1140, 11),  # just past the end
        (1000, 101),  # past the end into the adjacent region: spans two regions
        (1090, 20),  # spans two adjacent regions
        (999, 2),  # starts before the base
        (999, 1),  # entirely before
        (3000, 1),  # between regions
        (5010, 1),  # just past the last region
        (0, 1),  # below everything
        (1000, 0),  # zero length
        (1000, 2**64 - 1000),  # wraps to exactly 0
        (1000, 2**64 - 1),  # wraps around into a region
        (2**64 - 1, 1),  # far above
    ],
)
@PATHS
def test_validate_blocks_refuses_out_of_range(path: str, block: tuple[int, int]) -> None:
    good = [(0, 1000, 4), (0, 5000, 10)]
    with on_path(path), pytest.raises(RegionError, match=r"1 of 3 blocks.*block 1 "):
        validate_blocks(as_blocks([good[0], (0, *block), good[1]]), REGIONS)


def test_validate_blocks_counts_bad_blocks_and_handles_edge_inputs() -> None:
    with pytest.raises(RegionError, match="2 of 2"):
        validate_blocks(as_blocks([(0, 1, 1), (0, 2, 1)]), REGIONS)
    with pytest.raises(RegionError):
        validate_blocks(as_blocks([(0, 1000, 1)]), [])
    validate_blocks(empty(), [])
    # Signed arrays with negative values are refused, not reinterpreted.
    with pytest.raises(RegionError):
        validate_blocks(
            Blocks(np.zeros(1, np.int64), np.array([-1]), np.array([1])),
            REGIONS,
        )
    # One region inside another: a block inside the outer one is fine.
    validate_blocks(as_blocks([(0, 15, 50)]), [Region(0, 100), Region(10, 10)])


@PATHS
@FAST
@given(
    regions=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 30)), max_size=5),
    blocks=st.lists(st.tuples(st.integers(0, 260), st.integers(0, 40)), min_size=1, max_size=8),
)
def test_validate_blocks_matches_naive(
    path: str, regions: list[tuple[int, int]], blocks: list[tuple[int, int]]
) -> None:
    regs = [Region(b, n) for b, n in regions]

    def ok(d: int, n: int) -> bool:
        return n > 0 and any(r.base <= d and d + n <= r.end for r in regs)

    want = all(ok(d, n) for d, n in blocks)
    arr = as_blocks([(0, d, n) for d, n in blocks])
    with on_path(path):
        if want:
            validate_blocks(arr, regs)
        else:
            with pytest.raises(RegionError):
                validate_blocks(arr, regs)


# --------------------------------------------------------------------------------------------
# validate_pages, chunk_ranges
# --------------------------------------------------------------------------------------------


@PATHS
def test_validate_pages(path: str) -> None:
    with on_path(path):
        validate_pages(np.array([3, 0, 7]), 8)
        validate_pages(np.zeros(0, np.int64), 0)
        validate_pages(np.array([2**63], dtype=np.uint64)[:0], 8)
        for bad in ([8], [-1], [1, 2, 1], [0.5], [5, 3, 5, 9]):
            with pytest.raises(ProtocolError):
                validate_pages(np.array(bad), 8)
        with pytest.raises(ProtocolError, match="repeated"):
            validate_pages(np.array([1, 2, 1]), 8)
        with pytest.raises(ProtocolError, match="out of range"):
            validate_pages(np.array([1, 8]), 8)
        with pytest.raises(ProtocolError):
            validate_pages(np.array([2**64 - 1], dtype=np.uint64), 8)
        with pytest.raises(ProtocolError):
            validate_pages(np.zeros((2, 2), np.int64), 8)


@given(st.integers(0, 200), st.integers(1, 50))
def test_chunk_ranges_cover_once_with_whole_non_last_chunks(num_pages: int, chunk: int) -> None:
    ranges = chunk_ranges(num_pages, chunk)
    assert ranges
    assert ranges[0][0] == 0 and ranges[-1][1] == num_pages
    for (_, stop), (start, _) in itertools.pairwise(ranges):
        assert stop == start
    for start, stop in ranges[:-1]:
        assert stop - start == chunk
    assert 0 <= ranges[-1][1] - ranges[-1][0] <= chunk
    if num_pages:
        assert all(stop > start for start, stop in ranges)


def test_chunk_ranges_edges() -> None:
    assert chunk_ranges(0, 4) == [(0, 0)]  # the last chunk still carries the aux row
    assert chunk_ranges(8, 4) == [(0, 4), (4, 8)]
    assert chunk_ranges(9, 4) == [(0, 4), (4, 8), (8, 9)]
    with pytest.raises(ValueError):
        chunk_ranges(4, 0)
    with pytest.raises(ValueError):
        chunk_ranges(-1, 4)


def test_plan_small_declines_pages_of_another_size() -> None:
    """Packed pools whose pages differ in size (another ``head_bytes``) with no head slice:
    the general path refuses them, so the small path declines rather than planning blocks
    of the source's size into the destination's pages (it reads the two pools' page sizes
    from their kept geometry)."""
    src = make_pool(head_bytes=2, base=100)
    for dst in (make_pool(head_bytes=4, base=9, gap=8), make_pool(head_bytes=1, base=9, gap=8)):
        assert plan_small(src, dst, [0, 1], [2, 3], None, RegionTable(dst.regions())) is None
        _check_small(src, dst, [0, 1], [2, 3], None, RegionTable(dst.regions()), None)
