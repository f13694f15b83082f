"""Per-buffer geometry (issue 18, item 1): buffers of their own head sizes (K != V, layers of
different widths), page strides longer than a page, and head-major (HND) pages beside
token-major (NHD) ones. Planning is checked against a naive per-byte reference on random
inputs, head slicing included (P != D, on either layout and across layouts)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_pd import ConfigurationError, PoolSpec
from trio_pd.core._memory import describe_pool
from trio_pd.core._plan import plan_pages, validate_blocks

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Layout = Literal["nhd", "hnd"]


def spec(*, heads: int, first: int, hbs: tuple[int, ...], page_size: int, pad: tuple[int, ...],
         page_layout: Layout, base: int, num_pages: int = 9) -> PoolSpec:
    """A pool at fake addresses: buffer ``b`` at ``base + b * 1_000_000``."""
    items = [page_size * heads * hb for hb in hbs]
    return PoolSpec(
        layout="mha", page_size=page_size, num_pages=num_pages, num_layers=len(hbs) // 2,
        head_bytes=hbs[0], heads=heads, first_head=first,
        buffer_bases=tuple(base + b * 1_000_000 for b in range(len(hbs))),
        aux_base=base + 90_000_000, aux_item_len=16, aux_slots=4, page_layout=page_layout,
        buffer_head_bytes=hbs, page_strides=tuple(i + p for i, p in zip(items, pad, strict=True)),
    )


def offset(pool: PoolSpec, b: int, page: int, t: int, h: int, k: int) -> int:
    """The address of byte ``k`` of global head ``h`` of token ``t`` of ``page`` in buffer
    ``b``: the layout as documented, spelled out."""
    hb = pool.head_bytes_of(b)
    rel = h - pool.first_head
    inner = (t * pool.heads + rel) * hb if pool.page_layout == "nhd" else (
        (rel * pool.page_size + t) * hb)
    return pool.buffer_bases[b] + page * pool.strides[b] + inner + k


def naive(src: PoolSpec, dst: PoolSpec, sp: list[int], dp: list[int],
          heads: tuple[int, int]) -> dict[int, int]:
    """Every destination byte the copy writes -> the source byte it copies."""
    out = {}
    for b in range(src.num_buffers):
        for s, d in zip(sp, dp, strict=True):
            for t in range(src.page_size):
                for h in range(*heads):
                    for k in range(src.head_bytes_of(b)):
                        out[offset(dst, b, d, t, h, k)] = offset(src, b, s, t, h, k)
    return out


def expand(blocks) -> dict[int, int]:  # type: ignore[no-untyped-def]
    out: dict[int, int] = {}
    for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.lens.tolist(),
                       strict=True):
        for k in range(n):
            assert d + k not in out, "a destination byte written twice"
            out[d + k] = s + k
    return out


@st.composite
def cases(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    layers = draw(st.integers(1, 2))
    hbs = tuple(draw(st.lists(st.integers(1, 4), min_size=2 * layers, max_size=2 * layers)))
    page_size = draw(st.integers(1, 3))
    total = draw(st.sampled_from([1, 2, 4]))
    # each side: all heads, or a TP slice of them
    def side(base: int) -> PoolSpec:
        tp = draw(st.sampled_from([t for t in (1, 2, 4) if t <= total]))
        rank = draw(st.integers(0, tp - 1))
        per = total // tp
        return spec(heads=per, first=rank * per, hbs=hbs, page_size=page_size,
                    pad=tuple(draw(st.lists(st.sampled_from([0, 0, 3, 8]), min_size=len(hbs),
                                            max_size=len(hbs)))),
                    page_layout=draw(st.sampled_from(["nhd", "hnd"])), base=base)
    src, dst = side(10_000_000), side(200_000_000)
    lo = max(src.first_head, dst.first_head)
    hi = min(src.first_head + src.heads, dst.first_head + dst.heads)
    if lo >= hi:
        dst = spec(heads=src.heads, first=src.first_head, hbs=hbs, page_size=page_size,
                   pad=(0,) * len(hbs), page_layout=dst.page_layout, base=200_000_000)
        lo, hi = src.first_head, src.first_head + src.heads
    n = draw(st.integers(0, 5))
    sp = draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
    dp = draw(st.permutations(range(9)))[:n]
    if draw(st.booleans()):
        dp, sp = sorted(dp), sorted(sp)
    return src, dst, sp, dp, (lo, hi)


@FAST
@given(cases())
def test_geometry_plans_match_the_naive_per_byte_copy(case) -> None:  # type: ignore[no-untyped-def]
    src, dst, sp, dp, heads = case
    blocks = plan_pages(src, dst, np.array(sp, dtype=np.int64), np.array(dp, dtype=np.int64),
                        heads=heads)
    assert expand(blocks) == naive(src, dst, sp, dp, heads)
    validate_blocks(blocks, dst.regions())  # nothing outside what decode registered


def test_block_counts_by_layout() -> None:
    """Head-major on both sides: a head slice is one block per page; token-major: one per
    token slot; across layouts: one per (token, head). Packed whole pages merge into runs;
    padded ones go one block per page."""
    hbs = (2, 3)
    kw = dict(hbs=hbs, page_size=4, base=1_000_000)
    full_h = spec(heads=4, first=0, pad=(0, 0), page_layout="hnd", **kw)  # type: ignore[arg-type]
    half_h = spec(heads=2, first=2, pad=(0, 0), page_layout="hnd", **kw)  # type: ignore[arg-type]
    half_n = spec(heads=2, first=2, pad=(0, 0), page_layout="nhd", **kw)  # type: ignore[arg-type]
    padded = spec(heads=4, first=0, pad=(5, 5), page_layout="hnd", **kw)  # type: ignore[arg-type]
    pages = np.arange(3)
    assert plan_pages(full_h, half_h, pages, pages, heads=(2, 4)).num_blocks == 2 * 3
    assert plan_pages(full_h, half_n, pages, pages, heads=(2, 4)).num_blocks == 2 * 3 * 4 * 2
    assert plan_pages(full_h, full_h, pages, pages, heads=(0, 4)).num_blocks == 2  # runs
    assert plan_pages(full_h, padded, pages, pages, heads=(0, 4)).num_blocks == 2 * 3
    # K != V: the blocks of buffer 1 are 3/2 the size of buffer 0's
    b = plan_pages(full_h, full_h, pages, pages, heads=None)
    assert b.lens.tolist() == [3 * 4 * 4 * 2, 3 * 4 * 4 * 3]


def test_geometry_is_checked() -> None:
    base = dict(layout="mha", page_size=4, num_pages=8, num_layers=1, head_bytes=2, heads=2,
                first_head=0, buffer_bases=(1000, 5000), aux_base=9000, aux_item_len=16,
                aux_slots=2)
    with pytest.raises(ConfigurationError, match="page_layout"):
        PoolSpec(**base, page_layout="thd")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="one per KV buffer"):
        PoolSpec(**base, buffer_head_bytes=(2,))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"page_strides\[1\] is 15 bytes, less"):
        PoolSpec(**base, page_strides=(16, 15))  # type: ignore[arg-type]
    spec2 = PoolSpec(**base, buffer_head_bytes=(2, 4))  # type: ignore[arg-type]
    assert spec2.item_lens == (16, 32) and not spec2.packed
    with pytest.raises(ValueError, match="item_lens"):
        _ = spec2.item_len
    assert [r.length for r in spec2.regions()[:2]] == [8 * 16, 8 * 32]
    padded = PoolSpec(**base, page_strides=(20, 24))  # type: ignore[arg-type]
    assert [r.length for r in padded.regions()[:2]] == [7 * 20 + 16, 7 * 24 + 16]


def test_describe_pool_takes_the_geometry() -> None:
    k = np.zeros(8 * 64, np.uint8)
    v = np.zeros(8 * 32 + 100, np.uint8)
    aux = np.zeros(4 * 32, np.uint8)
    pool = describe_pool(layout="mha", page_size=4, num_layers=1, head_bytes=8, heads=2,
                         buffers=[k, v], aux=aux, aux_item_len=32, page_layout="hnd",
                         buffer_head_bytes=(8, 4))
    assert pool.num_pages == 8 and pool.item_lens == (64, 32) and pool.page_layout == "hnd"
    with pytest.raises(ConfigurationError, match="fewer than 8 pages of 64 every 80"):
        describe_pool(layout="mha", page_size=4, num_layers=1, head_bytes=8, heads=2,
                      buffers=[k, v], aux=aux, aux_item_len=32, num_pages=8,
                      buffer_head_bytes=(8, 4), page_strides=(80, 32))


# ------------------------------------------------------------------------ end to end


@pytest.mark.parametrize(
    ("engine", "geometry"),
    [
        pytest.param("mooncake", dict(page_layout="hnd", prefill_tp=1, decode_tp=2), id="hnd-1-2"),
        pytest.param("mooncake", dict(page_layout="hnd", prefill_tp=2, decode_tp=1), id="hnd-2-1"),
        pytest.param("mooncake", dict(v_head_bytes=8, prefill_tp=1, decode_tp=2), id="k!=v-1-2"),
        pytest.param("mooncake", dict(v_head_bytes=24, page_pad=5, prefill_tp=2, decode_tp=1),
                     id="k!=v-pad-2-1"),
        pytest.param("nixl", dict(page_layout="hnd", v_head_bytes=8, page_pad=3, prefill_tp=1,
                                  decode_tp=4), id="nixl-hnd-k!=v-pad-1-4"),
    ],
)
async def test_the_demo_verifies_per_buffer_geometry(engine: str, geometry: dict) -> None:  # type: ignore[type-arg]
    """Every byte of every request lands where the decode rank's own layout keeps it, for
    head-major pages and K != V buffers with P != D, and padded page strides."""
    from trio_pd.tools._demo import DemoOptions, check, run_in_process

    from .helpers.engines import ENGINES

    if engine == "nixl" and "nixl" not in [getattr(e, "values", [e])[0] for e in ENGINES]:
        pytest.skip("NIXL is not installed")
    opts = DemoOptions(requests=8, concurrency=4, min_tokens=1, max_tokens=48, page_size=4,
                       chunk_pages=3, layers=2, head_bytes=16, kv_heads=4, engine=engine,
                       **geometry)
    assert opts.option_problem() is None
    with trio.fail_after(60):
        summary = await run_in_process(opts)
    assert summary["succeeded"] == opts.requests and summary["corrupt_pages"] == 0, summary
    assert check(opts, summary) == []


async def test_geometry_with_aborts_and_faults_leaves_no_trace() -> None:
    """Aborts and engine faults on head-major, K != V, padded pools (P 2 -> D 4): no page
    written after its release, none leaked, every Success verified."""
    from trio_pd.tools._demo import DemoOptions, check, run_in_process

    opts = DemoOptions(requests=30, concurrency=6, min_tokens=1, max_tokens=48, page_size=4,
                       chunk_pages=3, layers=1, head_bytes=16, v_head_bytes=8, page_pad=5,
                       page_layout="hnd", kv_heads=8, prefill_tp=2, decode_tp=4,
                       abort_rate=0.3, fault_rate=0.2, engine="mooncake", seed=3,
                       quarantine_fence=1.0)
    with trio.fail_after(90):
        summary = await run_in_process(opts)
    assert summary["aborted"] > 0 and summary["engine_errors"] > 0, summary
    for key in ("corrupt_pages", "late_writes", "leaked_pages", "hung", "source_uaf_pages"):
        assert summary[key] == 0, (key, summary)
    assert check(opts, summary) == []


async def test_decode_refuses_an_instance_whose_bytes_per_head_differ_buffer_by_buffer(
    bootstrap_url: str,
) -> None:
    """The bootstrap record names every buffer's bytes per head, so a decode rank whose V
    buffers are smaller than prefill's fails its room at once, naming them, before it
    registers anywhere (not at its waiting deadline)."""
    from trio_pd import DecodeConfig, IncompatiblePeer, KVPoll, open_decode, open_prefill
    from trio_pd.engines import make_engine
    from trio_pd.testing.pools import HostKVPool

    src = HostKVPool(layout="mha", num_pages=8, num_layers=1, page_size=4, head_bytes=16,
                     heads=2)
    dst = HostKVPool(layout="mha", num_pages=8, num_layers=1, page_size=4, head_bytes=16,
                     heads=2, buffer_head_bytes=(16, 8))
    with make_engine("mooncake") as pe, make_engine("mooncake") as de:
        async with (
            open_prefill(engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2),
            open_decode(engine=de, pool=dst.spec,
                        config=DecodeConfig(waiting_timeout=30.0)) as decode,
        ):
            receiver = decode.receiver(3, bootstrap_url=bootstrap_url)
            receiver.init(np.arange(2), 0)
            with trio.fail_after(10):
                assert await receiver.wait() is KVPoll.Failed
            assert isinstance(receiver.failure, IncompatiblePeer), receiver.failure
            assert "head bytes: prefill (16, 16), decode (16, 8)" in str(receiver.failure)
            assert decode.statistics().timeouts == 0


def _geometry_from_fields(pool: PoolSpec) -> tuple[object, ...]:
    """head_bytes_all, item_lens, strides, item_len (None: buffers differ) and packed, worked
    out from the pool's fields by the documented rules, with no cache."""
    hbs = pool.buffer_head_bytes or (pool.head_bytes,) * len(pool.buffer_bases)
    items = tuple(pool.page_size * pool.heads * hb for hb in hbs)
    same = len(set(hbs)) <= 1
    return (
        hbs, items, pool.page_strides or items,
        pool.page_size * pool.heads * (hbs[0] if hbs else pool.head_bytes) if same else None,
        pool.page_layout == "nhd" and same and (not pool.page_strides or pool.page_strides
                                                == items),
    )


def _geometry_asked(pool: PoolSpec) -> tuple[object, ...]:
    try:
        item: int | None = pool.item_len
    except ValueError:
        item = None
    return pool.head_bytes_all, pool.item_lens, pool.strides, item, pool.packed


def test_kept_geometry_is_each_pools_own() -> None:
    """A pool keeps its geometry once worked out (the planners ask for it per chunk and per
    destination): every pool answers with its own, asked in any order, and so do the pools
    made from one (a layer view, ``replace``, a pickled or copied pool)."""
    import copy
    import dataclasses
    import pickle

    from trio_pd.core._memory import layer_view

    a = spec(heads=2, first=0, hbs=(64, 64, 64, 64), page_size=4, pad=(0, 0, 0, 0),
             page_layout="nhd", base=1 << 30)
    b = spec(heads=4, first=4, hbs=(32, 64, 32, 64), page_size=8, pad=(0, 16, 0, 0),
             page_layout="hnd", base=1 << 34)
    pools = [a, b]
    for p in (a, b):
        p.item_lens  # noqa: B018 (worked out, and kept, before the copies are made)
        pools += [
            layer_view(p, 1, 1), dataclasses.replace(p, page_size=2),
            dataclasses.replace(p, page_strides=(), buffer_head_bytes=()),
            pickle.loads(pickle.dumps(p)), copy.copy(p), copy.deepcopy(p),
        ]
    for order in (pools, pools[::-1], pools[::2] + pools[1::2]):
        for p in order:
            assert _geometry_asked(p) == _geometry_from_fields(p), p
    assert _geometry_asked(a) != _geometry_asked(b)
