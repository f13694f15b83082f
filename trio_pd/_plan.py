"""Transfer planning: page ids -> the fewest (src_addr, dst_addr, len) blocks.

Pure numpy, no I/O, no trio. (SPEC §3)
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from ._errors import ProtocolError, RegionError
from .engines._base import Region


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The layout of one rank's KV pool and aux buffer, as registered with its engine.

    Buffers: MHA has one K and one V buffer per layer, ordered K[0..L-1] then V[0..L-1];
    MLA has one buffer per layer. Every buffer holds ``num_pages`` pages of ``item_len`` bytes;
    page id ``p`` is at ``buffer_bases[i] + p * item_len`` in every buffer ``i``.
    Inside a page, token slot ``t`` holds ``heads`` heads of ``head_bytes`` bytes each:
    byte offset ``t * heads * head_bytes + (h - first_head) * head_bytes`` for global head ``h``.
    MLA: ``heads == 1`` and ``first_head == 0`` (the latent row is replicated on every rank).
    The aux buffer holds ``aux_slots`` rows of ``aux_item_len`` bytes at ``aux_base``.
    """

    layout: Literal["mha", "mla"]
    page_size: int
    num_pages: int
    num_layers: int
    head_bytes: int
    heads: int
    first_head: int
    buffer_bases: tuple[int, ...]
    aux_base: int
    aux_item_len: int
    aux_slots: int

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token slot in one buffer."""
        return self.heads * self.head_bytes

    @property
    def item_len(self) -> int:
        """Bytes of one page in one buffer."""
        return self.page_size * self.slot_bytes

    @property
    def num_buffers(self) -> int:
        return len(self.buffer_bases)

    def regions(self) -> list[Region]:
        """Every registered range: the KV buffers, then the aux buffer."""
        kv = [Region(b, self.num_pages * self.item_len) for b in self.buffer_bases]
        return [*kv, Region(self.aux_base, self.aux_slots * self.aux_item_len)]


# --------------------------------------------------------------------------------------------
# Topology: which prefill rank holds, and writes, which heads of which decode rank
# --------------------------------------------------------------------------------------------


def _check_tp(prefill_tp: int, decode_tp: int) -> None:
    if prefill_tp < 1 or decode_tp < 1:
        raise ValueError(f"TP sizes must be positive, got P={prefill_tp}, D={decode_tp}")
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp) != 0:
        raise ValueError(
            f"the larger TP size must be a multiple of the smaller one, "
            f"got P={prefill_tp}, D={decode_tp}"
        )


def _check_rank(rank: int, tp_size: int, what: str) -> None:
    if not 0 <= rank < tp_size:
        raise ValueError(f"{what} rank {rank} is out of range for TP size {tp_size}")


def head_range(rank: int, tp_size: int, total_heads: int) -> tuple[int, int]:
    """Return ``(first_head, count)``: the global KV heads that TP rank ``rank`` holds.

    With at most one rank per head (``tp_size <= total_heads``) the heads are split evenly and
    ``total_heads`` must be a multiple of ``tp_size``. With more ranks than heads (GQA head
    replication) every rank holds one head, ``rank * total_heads // tp_size``, so ``tp_size /
    total_heads`` neighbouring ranks hold the same head; ``tp_size`` must then be a multiple
    of ``total_heads``, otherwise the replicas of one head would not line up across two TP
    sizes. Integer division, not modulo: rank 1 of 4 with 2 heads holds head 0, not head 1.
    """
    if tp_size < 1 or total_heads < 1:
        raise ValueError(f"need tp_size >= 1 and total_heads >= 1, got {tp_size}, {total_heads}")
    _check_rank(rank, tp_size, "TP")
    if tp_size <= total_heads:
        if total_heads % tp_size != 0:
            raise ValueError(f"{total_heads} KV heads cannot be split evenly over TP {tp_size}")
        count = total_heads // tp_size
        return rank * count, count
    if tp_size % total_heads != 0:
        raise ValueError(
            f"TP {tp_size} is not a multiple of the {total_heads} KV heads it replicates"
        )
    return rank * total_heads // tp_size, 1


def source_ranks(decode_rank: int, prefill_tp: int, decode_tp: int) -> range:
    """The prefill ranks that decode rank ``decode_rank`` reads its KV cache from.

    ``P == D``: one, the same rank number. ``D > P``: one, shared by ``D / P`` neighbouring
    decode ranks. ``D < P``: the ``P / D`` consecutive prefill ranks whose heads together make
    up this decode rank's heads (MHA), or that all hold the same replicated latent (MLA).
    """
    _check_tp(prefill_tp, decode_tp)
    _check_rank(decode_rank, decode_tp, "decode")
    lo = decode_rank * prefill_tp // decode_tp
    hi = max(lo + 1, (decode_rank + 1) * prefill_tp // decode_tp)
    return range(lo, hi)


def served_decode_ranks(prefill_rank: int, prefill_tp: int, decode_tp: int) -> range:
    """The decode ranks whose :func:`source_ranks` contain ``prefill_rank``.

    This is how many metadata (TRANSFER) messages a prefill rank waits for per request:
    ``D / P`` when ``D > P``, otherwise one.
    """
    _check_tp(prefill_tp, decode_tp)
    _check_rank(prefill_rank, prefill_tp, "prefill")
    if decode_tp >= prefill_tp:
        fan = decode_tp // prefill_tp
        return range(prefill_rank * fan, (prefill_rank + 1) * fan)
    first = prefill_rank // (prefill_tp // decode_tp)
    return range(first, first + 1)


def aux_writer(decode_rank: int, prefill_tp: int, decode_tp: int) -> int:
    """The one prefill rank that writes decode rank ``decode_rank``'s aux row: the lowest of
    its source ranks."""
    return source_ranks(decode_rank, prefill_tp, decode_tp)[0]


def write_heads(
    prefill_rank: int,
    decode_rank: int,
    prefill_tp: int,
    decode_tp: int,
    total_heads: int,
    layout: Literal["mha", "mla"],
) -> tuple[int, int] | None:
    """Which global heads ``[h0, h1)`` prefill rank ``prefill_rank`` writes to decode rank
    ``decode_rank``, or ``None`` when it writes no KV bytes there.

    MHA: the heads both ranks hold, less those a *lower* source rank of the decode rank also
    holds (under GQA replication several prefill ranks hold the same head; only the lowest
    writes it, so every destination byte is written exactly once). MLA: the latent is
    replicated, so the lowest source rank writes ``(0, 1)`` and the others write nothing.

    ``None`` marks a *dummy* rank for this decode rank: it still takes part in the request's
    bookkeeping (status, acks) but moves no KV bytes. A prefill rank that is not a source rank
    of ``decode_rank`` at all also gets ``None``.
    """
    _check_tp(prefill_tp, decode_tp)
    _check_rank(prefill_rank, prefill_tp, "prefill")
    sources = source_ranks(decode_rank, prefill_tp, decode_tp)
    if prefill_rank not in sources:
        return None
    if layout == "mla":
        return (0, 1) if prefill_rank == sources[0] else None
    if layout != "mha":
        raise ValueError(f"unknown layout {layout!r}")
    p_first, p_count = head_range(prefill_rank, prefill_tp, total_heads)
    d_first, d_count = head_range(decode_rank, decode_tp, total_heads)
    h0 = max(p_first, d_first)
    h1 = min(p_first + p_count, d_first + d_count)
    # Lower source ranks hold either exactly the same heads (replicas) or disjoint ones, and
    # only ever heads at or below ours: trimming from the bottom is all that can happen.
    for lower in range(sources[0], prefill_rank):
        q_first, q_count = head_range(lower, prefill_tp, total_heads)
        if q_first <= h0 < q_first + q_count:
            h0 = q_first + q_count
    return (h0, h1) if h0 < h1 else None


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------

_U64 = np.uint64
_U64_MAX = int(np.iinfo(np.uint64).max)


class Blocks(NamedTuple):
    """A batch of one-sided writes: ``lens[i]`` bytes from local ``src[i]`` to remote
    ``dst[i]``. Three uint64 arrays of one length, ready for ``TransferEngine.write``."""

    src: npt.NDArray[np.uint64]
    dst: npt.NDArray[np.uint64]
    lens: npt.NDArray[np.uint64]

    @property
    def nbytes(self) -> int:
        """Total bytes the batch moves."""
        return total_bytes(self)

    @property
    def num_blocks(self) -> int:
        return int(self.lens.shape[0])


def empty() -> Blocks:
    """A batch with no blocks."""
    z = np.zeros(0, dtype=_U64)
    return Blocks(z, z.copy(), z.copy())


def total_bytes(blocks: Blocks) -> int:
    """Total bytes ``blocks`` moves (a Python int: no uint64 wrap-around)."""
    return int(blocks.lens.astype(object).sum()) if blocks.lens.size else 0


def concat(parts: Sequence[Blocks]) -> Blocks:
    """One batch holding every block of ``parts``, in order."""
    if not parts:
        return empty()
    return Blocks(
        np.concatenate([b.src for b in parts]).astype(_U64, copy=False),
        np.concatenate([b.dst for b in parts]).astype(_U64, copy=False),
        np.concatenate([b.lens for b in parts]).astype(_U64, copy=False),
    )


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


def _as_pages(pages: npt.ArrayLike, what: str) -> npt.NDArray[np.int64]:
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise ValueError(f"{what} page ids must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} page ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def contiguous_runs(
    src_pages: npt.ArrayLike, dst_pages: npt.ArrayLike
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Split two aligned page-id lists into maximal runs that are consecutive on *both* sides.

    Returns ``(src_starts, dst_starts, lengths)``: run ``k`` covers source pages
    ``src_starts[k] + 0..lengths[k]-1`` and the same number of destination pages from
    ``dst_starts[k]``. A run breaks wherever either side does not step by exactly +1.
    """
    s = _as_pages(src_pages, "source")
    d = _as_pages(dst_pages, "destination")
    if s.shape != d.shape:
        raise ValueError(f"{s.size} source pages but {d.size} destination pages")
    return _runs(s, d)


#: Up to this many elements the hot-path helpers below work on Python lists: one numpy call
#: costs 1-2 µs on a small box, so a 16-page chunk spent ~20 µs finding its runs with numpy
#: against ~4 µs in a loop. Above it, numpy. Both paths give identical results (tested).
SMALL = 64


def _runs_small(sl: list[int], dl: list[int]) -> tuple[list[int], list[int], list[int]]:
    """:func:`_runs` on two non-empty lists of one length, in Python (see :data:`SMALL`)."""
    s0, d0, lengths = [sl[0]], [dl[0]], []
    start = 0
    for i in range(1, len(sl)):
        if sl[i] != sl[i - 1] + 1 or dl[i] != dl[i - 1] + 1:
            lengths.append(i - start)
            start = i
            s0.append(sl[i])
            d0.append(dl[i])
    lengths.append(len(sl) - start)
    return s0, d0, lengths


def _runs(
    s: npt.NDArray[np.int64], d: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """:func:`contiguous_runs` of two int64 arrays of one shape, already checked."""
    n = s.size
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z.copy(), z.copy()
    if n <= SMALL:
        s0, d0, lengths = _runs_small(s.tolist(), d.tolist())
        return (
            np.array(s0, dtype=np.int64), np.array(d0, dtype=np.int64),
            np.array(lengths, dtype=np.int64),
        )
    # (slices and preallocated outputs, not np.diff/concatenate: fewer numpy calls)
    breaks = np.flatnonzero((s[1:] - s[:-1] != 1) | (d[1:] - d[:-1] != 1))
    bounds = np.empty(breaks.size + 2, dtype=np.int64)
    bounds[0] = 0
    bounds[1:-1] = breaks + 1
    bounds[-1] = n
    starts = bounds[:-1]
    return s[starts], d[starts], bounds[1:] - starts


def _check_pages_in_range(pages: npt.NDArray[np.int64], num_pages: int, what: str) -> None:
    if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        bad = pages[(pages < 0) | (pages >= num_pages)]
        raise ProtocolError(
            f"{bad.size} {what} page ids out of range [0, {num_pages}) (first: {int(bad[0])})"
        )


def validate_pages(pages: npt.ArrayLike, num_pages: int) -> None:
    """Refuse page ids that are not integers, out of ``[0, num_pages)``, or repeated.

    A repeated destination page would make two writes land on one page, so duplicates are a
    protocol error, not a no-op. Raises :class:`~trio_pd.ProtocolError`.
    """
    arr = np.asarray(pages)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ProtocolError(f"page ids must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.size == 0:
        return
    # uint64 ids past 2**63 wrap to negative int64 and are refused as out of range.
    ids = arr.astype(np.int64, copy=False)
    if ids.size <= SMALL:
        values = ids.tolist()
        if min(values) >= 0 and max(values) < num_pages and len(set(values)) == len(values):
            return
        # something is wrong: the checks below say what
    _check_pages_in_range(ids, num_pages, "destination")
    ordered = np.sort(ids)
    dup = np.flatnonzero(ordered[1:] == ordered[:-1])
    if dup.size:
        raise ProtocolError(
            f"{dup.size} repeated page ids (first: {int(ordered[dup[0]])}); "
            "two writes would land on one page"
        )


def _u64(values: Sequence[int]) -> npt.NDArray[np.uint64]:
    return np.array([int(v) for v in values], dtype=_U64)


@functools.lru_cache(maxsize=256)
def _bases_column(bases: tuple[int, ...]) -> npt.NDArray[np.uint64]:
    """A pool's buffer bases as a read-only (buffers, 1) column, made once per pool."""
    col = _u64(bases)[:, None]
    col.flags.writeable = False
    return col


def plan_pages(
    src: PoolSpec,
    dst: PoolSpec,
    src_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
    *,
    heads: tuple[int, int] | None = None,
    pages_checked: bool = False,
) -> Blocks:
    """Turn aligned source/destination page ids into the blocks that copy them, buffer by
    buffer. ``pages_checked=True`` skips the page-id checks for a caller that already ran
    :func:`validate_pages` on both lists (the agents do, when the ids arrive).

    Whole pages (``heads is None``, which is also the MLA case, or both sides holding exactly
    heads ``[h0, h1)``): one block per run of pages consecutive on both sides per buffer, so a
    fully consecutive request costs ``num_buffers`` blocks.

    Head slices (the sides hold different head sets, MHA with P != D): one block per token slot
    per page per buffer, each copying heads ``[h0, h1)`` from where the source keeps them in
    that slot to where the destination keeps them.

    Blocks are ordered buffer-major, then by page, then by token slot. Page ids are checked
    against both pools (:class:`~trio_pd.ProtocolError`; repeated destination pages too);
    layouts that cannot be copied between raise :class:`ValueError`.
    """
    s_pages = _as_pages(src_pages, "source")
    d_pages = _as_pages(dst_pages, "destination")
    if s_pages.shape != d_pages.shape:
        raise ValueError(f"{s_pages.size} source pages but {d_pages.size} destination pages")
    if src.num_buffers != dst.num_buffers:
        raise ValueError(f"source has {src.num_buffers} buffers, destination {dst.num_buffers}")
    if src.page_size != dst.page_size:
        raise ValueError(f"page size differs: source {src.page_size}, destination {dst.page_size}")
    if not pages_checked:
        _check_pages_in_range(s_pages, src.num_pages, "source")
        validate_pages(d_pages, dst.num_pages)
    if s_pages.size == 0 or src.num_buffers == 0:
        return empty()

    src_bases = _bases_column(src.buffer_bases)
    dst_bases = _bases_column(dst.buffer_bases)
    whole = heads is None or (
        src.first_head == dst.first_head == heads[0]
        and src.heads == dst.heads == heads[1] - heads[0]
    )
    if whole:
        if src.item_len != dst.item_len:
            raise ValueError(
                f"whole-page copy needs equal page sizes in bytes: source item_len "
                f"{src.item_len}, destination {dst.item_len} (pass heads= to slice)"
            )
        if s_pages.size <= SMALL:  # lists: a few µs instead of ~30 (see SMALL)
            item_len = src.item_len
            ss, ds, ns = _runs_small(s_pages.tolist(), d_pages.tolist())
            return Blocks(
                np.array([b + x * item_len for b in src.buffer_bases for x in ss], dtype=_U64),
                np.array([b + x * item_len for b in dst.buffer_bases for x in ds], dtype=_U64),
                np.array([x * item_len for x in ns] * src.num_buffers, dtype=_U64),
            )
        item = _U64(src.item_len)
        s0, d0, n = _runs(s_pages, d_pages)
        lens = np.empty((src.num_buffers, n.size), dtype=_U64)
        lens[:] = n.astype(_U64) * item  # (a filled grid: broadcast_to().ravel() was 3x slower)
        return Blocks(
            (src_bases + s0.astype(_U64) * item).ravel(),
            (dst_bases + d0.astype(_U64) * item).ravel(),
            lens.ravel(),
        )

    assert heads is not None
    h0, h1 = heads
    if src.head_bytes != dst.head_bytes:
        raise ValueError(
            f"head slicing needs equal bytes per head: source {src.head_bytes}, "
            f"destination {dst.head_bytes}"
        )
    for side, pool in (("source", src), ("destination", dst)):
        if not (pool.first_head <= h0 < h1 <= pool.first_head + pool.heads):
            raise ValueError(
                f"heads [{h0}, {h1}) is a slice that does not fit the {side}, which holds "
                f"heads [{pool.first_head}, {pool.first_head + pool.heads})"
            )
    hb = src.head_bytes
    tokens = np.arange(src.page_size, dtype=_U64)[None, None, :]

    def addrs(
        pool: PoolSpec, bases: npt.NDArray[np.uint64], pages: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.uint64]:
        page_off = (pages.astype(_U64) * _U64(pool.item_len))[None, :, None]
        slot_off = tokens * _U64(pool.slot_bytes) + _U64((h0 - pool.first_head) * hb)
        out: npt.NDArray[np.uint64] = (bases[:, :, None] + page_off + slot_off).ravel()
        return out

    src_addr = addrs(src, src_bases, s_pages)
    dst_addr = addrs(dst, dst_bases, d_pages)
    return Blocks(src_addr, dst_addr, np.full(src_addr.size, (h1 - h0) * hb, dtype=_U64))


def plan_aux(src: PoolSpec, dst: PoolSpec, src_slot: int, dst_slot: int) -> Blocks:
    """The one block that copies aux row ``src_slot`` to the destination's row ``dst_slot``.

    Both sides must use the same row size. A destination slot out of range is a
    :class:`~trio_pd.ProtocolError` (it came from the peer); a bad source slot is a
    :class:`ValueError` (a local bug).
    """
    if src.aux_item_len != dst.aux_item_len:
        raise ValueError(
            f"aux row size differs: source {src.aux_item_len}, destination {dst.aux_item_len}"
        )
    if not 0 <= src_slot < src.aux_slots:
        raise ValueError(f"source aux slot {src_slot} out of range [0, {src.aux_slots})")
    if not 0 <= dst_slot < dst.aux_slots:
        raise ProtocolError(f"destination aux slot {dst_slot} out of range [0, {dst.aux_slots})")
    n = min(src.aux_item_len, dst.aux_item_len)
    rows = _u64(
        [src.aux_base + src_slot * src.aux_item_len, dst.aux_base + dst_slot * dst.aux_item_len, n]
    )
    return Blocks(rows[0:1], rows[1:2], rows[2:3])


# --------------------------------------------------------------------------------------------
# Validation against registered memory (SPEC I8)
# --------------------------------------------------------------------------------------------


def _as_u64(values: npt.ArrayLike, what: str) -> npt.NDArray[np.uint64]:
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=_U64)
    if arr.dtype.kind not in "iu":
        raise RegionError(f"block {what} must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and bool((arr < 0).any()):
        first = int(np.flatnonzero(arr < 0)[0])
        raise RegionError(f"block {first} has a negative {what} ({int(arr[first])})")
    return arr.astype(_U64, copy=False)


class RegionTable:
    """Registered regions prepared once for :func:`validate_blocks` (sorted bases and the
    running maximum of their ends), so checking a chunk costs no per-call set-up."""

    __slots__ = ("base_list", "bases", "reach", "reach_list")

    def __init__(self, regions: Sequence[Region]) -> None:
        bases: list[int] = []
        ends: list[int] = []
        for r in regions:
            if r.base < 0 or r.length < 0:
                raise ValueError(f"invalid region {r}")
            if r.length == 0 or r.base > _U64_MAX:
                continue
            bases.append(r.base)
            ends.append(min(r.end, _U64_MAX))
        order = np.argsort(np.array(bases, dtype=_U64), kind="stable")
        self.bases: npt.NDArray[np.uint64] = np.array(bases, dtype=_U64)[order]
        # Running maximum of the ends: overlapping regions are handled by asking whether
        # *some* region starting at or before dst reaches far enough.
        self.reach: npt.NDArray[np.uint64] = (
            np.maximum.accumulate(np.array(ends, dtype=_U64)[order]) if ends else self.bases
        )
        self.base_list: list[int] = self.bases.tolist()  # for small batches (SMALL)
        self.reach_list: list[int] = self.reach.tolist()


def validate_blocks(blocks: Blocks, regions: Sequence[Region] | RegionTable) -> None:
    """Refuse a batch unless every destination range ``[dst, dst + len)`` lies entirely inside
    one of ``regions`` (the memory the destination registered; SPEC I8).

    Zero-length blocks and ranges that would wrap past 2**64 are refused too. A range that
    straddles two adjacent regions is refused: an engine registers them separately and may
    not write across the seam. Raises :class:`~trio_pd.RegionError` naming how many blocks
    are bad and the first of them. Cost: O((blocks + regions) log regions); pass a
    :class:`RegionTable` built once to skip preparing the regions on every call.
    """
    dst = _as_u64(blocks.dst, "dst")
    lens = _as_u64(blocks.lens, "len")
    if dst.shape != lens.shape or dst.ndim != 1:
        raise RegionError(f"malformed blocks: dst shape {dst.shape}, lens shape {lens.shape}")
    if dst.size == 0:
        return
    table = regions if isinstance(regions, RegionTable) else RegionTable(regions)
    if dst.size <= SMALL:
        base_list, reach_list = table.base_list, table.reach_list
        for d, n in zip(dst.tolist(), lens.tolist(), strict=True):
            i = bisect.bisect_right(base_list, d) - 1
            if n == 0 or i < 0 or d + n > reach_list[i]:  # (Python ints: no wrap-around)
                break
        else:
            return
        # a bad block: the vectorised check below finds them all and says what is wrong
    sorted_bases, reach = table.bases, table.reach
    zero = lens == 0
    end = dst + lens  # wraps modulo 2**64 where it overflows: caught as end < dst
    overflow = end < dst
    if sorted_bases.size:
        idx = np.searchsorted(sorted_bases, dst, side="right") - 1
        # idx -1 (below every region) reads reach[-1]; it is refused by idx >= 0
        fits = (idx >= 0) & (end <= reach[idx])
    else:
        fits = np.zeros(dst.size, dtype=bool)
    bad = zero | overflow | ~fits
    if not bad.any():
        return
    where = np.flatnonzero(bad)
    i = int(where[0])
    why = (
        "zero length"
        if zero[i]
        else "dst + len overflows 64 bits"
        if overflow[i]
        else "not inside any single registered region"
    )
    raise RegionError(
        f"{where.size} of {dst.size} blocks fall outside the destination's registered memory; "
        f"first: block {i} dst={int(dst[i]):#x} len={int(lens[i])} ({why})"
    )


# --------------------------------------------------------------------------------------------
# Chunked prefill
# --------------------------------------------------------------------------------------------


def chunk_ranges(num_pages: int, chunk_pages: int) -> list[tuple[int, int]]:
    """Split ``[0, num_pages)`` into ``[start, stop)`` chunks of ``chunk_pages`` pages, the
    last one possibly shorter.

    Every non-last chunk covers exactly ``chunk_pages`` whole pages, and the chunks cover
    ``[0, num_pages)`` exactly once, in order. With no pages the result is ``[(0, 0)]``: a
    request always has a last chunk, because the last chunk carries the aux row.
    """
    if chunk_pages < 1:
        raise ValueError(f"chunk_pages must be at least 1, got {chunk_pages}")
    if num_pages < 0:
        raise ValueError(f"num_pages must not be negative, got {num_pages}")
    if num_pages == 0:
        return [(0, 0)]
    return [(s, min(s + chunk_pages, num_pages)) for s in range(0, num_pages, chunk_pages)]
