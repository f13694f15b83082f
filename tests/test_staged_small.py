"""The staged chunk's quick plan (:func:`~trio_pd.core._plan.plan_staged_small`): what a
prefill rank plans for every chunk to each decode rank of a larger TP, in plain Python. It
gives exactly the blocks of the general path (``plan_staged`` + ``plan_aux`` + ``concat`` +
``validate_blocks``), or declines and leaves that path to plan them or say what is wrong."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_pd.core._errors import ProtocolError, RegionError
from trio_pd.core._memory import PoolSpec, RegionTable
from trio_pd.core._plan import (
    SMALL_CHUNK,
    Blocks,
    concat,
    contiguous_runs,
    plan_aux,
    plan_staged,
    plan_staged_small,
    validate_blocks,
)

from .helpers.plans import FAST, PATHS, assert_same_blocks, make_pool, on_path

BASE = 1 << 40  # where the staging range starts (any address: nothing is read or written)


def _general(
    src: PoolSpec, dst: PoolSpec, dp: list[int], aux: tuple[PoolSpec, PoolSpec, int, int] | None,
    table: RegionTable,
) -> Blocks | None:
    """What the chunk planner does without the quick plan; None where it refuses."""
    try:
        parts = [plan_staged(src, dst, np.array(dp, dtype=np.int64), BASE)]
        if aux is not None:
            parts.append(plan_aux(*aux))
        blocks = parts[0] if len(parts) == 1 else concat(parts)
        validate_blocks(blocks, table)
    except (ValueError, RegionError, ProtocolError):
        return None
    return blocks


@FAST
@PATHS
@given(
    layout=st.sampled_from(["mha", "mla"]),
    runs=st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 199)), st.integers(1, 40)),
                  min_size=0, max_size=SMALL_CHUNK + 3),
    aux=st.one_of(st.none(), st.tuples(st.integers(-1, 4), st.integers(-1, 4))),
    aux_len=st.sampled_from([8, 16]),
    drop=st.one_of(st.none(), st.integers(0, 9)),
    dst_heads=st.sampled_from([1, 2]),
)
def test_plan_staged_small_matches_the_general_path(
    path: str, layout: str, runs: list[tuple[int | None, int]],
    aux: tuple[int, int] | None, aux_len: int, drop: int | None, dst_heads: int,
) -> None:
    src = make_pool(layout=layout, heads=4, num_pages=200, base=100)  # type: ignore[arg-type]
    dst = make_pool(layout=layout, heads=dst_heads, num_pages=200, base=9,  # type: ignore[arg-type]
                    gap=8, aux_item_len=aux_len)
    dp: list[int] = []
    seen: set[int] = set()
    b = 0
    for d0, k in runs:  # destination ids checked (distinct), as the agents' are
        b = b if d0 is None else d0
        dp += [b + i for i in range(k) if b + i < 200 and b + i not in seen]
        seen.update(dp)
        b += k
    regions = dst.regions()
    if drop is not None:
        regions = [r for i, r in enumerate(regions) if i != drop % len(regions)]
    table = RegionTable(regions)
    aux_arg = None if aux is None else (src, dst, aux[0], aux[1])
    with on_path(path):
        quick = plan_staged_small(src, dst, dp, BASE, aux_arg, table)
        again = plan_staged_small(src, dst, np.array(dp, dtype=np.int64), BASE, aux_arg, table)
        want = _general(src, dst, dp, aux_arg, table)
    assert (quick is None) == (again is None)
    if quick is None:
        few = bool(dp) and contiguous_runs(dp, dp)[2].size <= SMALL_CHUNK
        assert want is None or not few  # declined only what it does not plan
        return
    assert_same_blocks(quick, again, want)


def test_plan_staged_small_declines_what_it_cannot_plan() -> None:
    """Pools of other buffer counts and a destination with room between its pages are the
    general path's (which refuses the first and plans the second page by page)."""
    src, dst = make_pool(heads=4, num_pages=20), make_pool(num_pages=20, base=1 << 20)
    table = RegionTable(dst.regions())
    assert plan_staged_small(src, dst, [3, 4, 5], BASE, None, table) is not None
    assert plan_staged_small(src, dst, [], BASE, None, table) is None
    fewer = make_pool(heads=4, num_pages=20, num_layers=1)
    assert plan_staged_small(fewer, dst, [3], BASE, None, table) is None
    with pytest.raises(ValueError):
        plan_staged(fewer, dst, [3], BASE)
    import dataclasses

    strided = dataclasses.replace(dst, page_strides=(dst.item_len + 8,) * dst.num_buffers)
    assert plan_staged_small(src, strided, [3], BASE, None, table) is None


def test_gathers_for_decode_ranks_of_other_heads_each_read_their_own() -> None:
    """One prefill rank's staging area gathers for decode ranks that hold other heads (TP 1
    -> 4 and, in the same agent, TP 1 -> 2), of every buffer or of some (layer-wise): what it
    keeps of one destination's gather (the source views) is never used for another's, in
    any order."""
    from trio_pd.core._plan import staged_bytes
    from trio_pd.core._staging import UNIT, StagingArea
    from trio_pd.core._topology import write_heads
    from trio_pd.testing.pools import HostKVPool

    page_size, hb, layers, total = 3, 4, 2, 8
    src = HostKVPool(layout="mha", num_pages=12, num_layers=layers, page_size=page_size,
                     head_bytes=hb, heads=total)
    rng = np.random.default_rng(7)
    for buf in src.buffers:
        buf[:] = rng.integers(0, 256, buf.shape, np.uint8)
    area = StagingArea(64 * UNIT, unit=256)
    cases = []
    for d in (4, 2):
        for rank in range(d):
            heads = write_heads(0, rank, 1, d, total, "mha")
            assert heads is not None
            dst = HostKVPool(layout="mha", num_pages=4, num_layers=layers, page_size=page_size,
                             head_bytes=hb, heads=total // d, first_head=heads[0]).spec
            for buffers in (None, [1, 3], [0, 2]):
                cases.append((heads, dst, buffers))
    for order in (cases, cases[::-1], cases[1::2] + cases[::2]):
        for i, (heads, dst, buffers) in enumerate(order):
            pages = np.array([(i + 5) % 12, (3 * i) % 12, 11], dtype=np.int64)
            picks = list(range(src.spec.num_buffers)) if buffers is None else buffers
            items = tuple(dst.item_lens[b] for b in picks)
            r = area.reserve(staged_bytes(src.spec, dst, len(pages)))
            assert r is not None
            area.gatherer(src.spec, pages, heads, r, items, buffers=buffers)()
            got = np.ctypeslib.as_array((ctypes.c_uint8 * r.nbytes).from_address(r.addr))
            h0, h1 = heads
            want = np.concatenate([
                src.buffers[b].reshape(12, page_size, total, hb)[pages, :, h0:h1].ravel()
                for b in picks
            ])
            area.give(r)
            np.testing.assert_array_equal(got[: want.size], want)
