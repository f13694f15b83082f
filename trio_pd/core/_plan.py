"""Transfer planning: page ids -> the fewest (src_addr, dst_addr, len) blocks.

Pure numpy, no I/O, no trio. (SPEC §3)
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from . import _memory
from ._errors import ProtocolError, RegionError
from ._memory import (
    PoolSpec,
    Region,
    RegionTable,
    _check_pages_in_range,
    aux_row_address,
    validate_pages,
)
from ._topology import SlotCuts

# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------

_U64 = np.uint64


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
    lens = blocks.lens
    if lens.size <= _memory.SMALL:  # (Python ints: 0.08 us for a chunk's 3 blocks, not 1.0)
        return sum(lens.tolist())
    return int(lens.astype(object).sum())


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


def _runs_small(sl: list[int], dl: list[int]) -> tuple[list[int], list[int], list[int]]:
    """:func:`_runs` on two non-empty lists of one length, in Python (see
    :data:`~trio_pd.core._memory.SMALL`)."""
    runs = _runs_upto(sl, dl, 0)
    assert runs is not None
    return runs


def _runs_upto(
    sl: list[int], dl: list[int], most: int
) -> tuple[list[int], list[int], list[int]] | None:
    """:func:`_runs_small`, or None as soon as it finds more than ``most`` runs (0: any
    number)."""
    s0, d0, lengths = [sl[0]], [dl[0]], []
    start = 0
    for i in range(1, len(sl)):
        if sl[i] != sl[i - 1] + 1 or dl[i] != dl[i - 1] + 1:
            if len(s0) == most:
                return None
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
    if n <= _memory.SMALL:
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


def _u64(values: Sequence[int]) -> npt.NDArray[np.uint64]:
    return np.array([int(v) for v in values], dtype=_U64)


@functools.lru_cache(maxsize=256)
def _bases_column(bases: tuple[int, ...]) -> npt.NDArray[np.uint64]:
    """A pool's buffer bases as a read-only (buffers, 1) column, made once per pool."""
    col = _u64(bases)[:, None]
    col.flags.writeable = False
    return col


def _check_slice(src: PoolSpec, dst: PoolSpec, h0: int, h1: int) -> None:
    """:class:`ValueError` unless both sides hold every head of ``[h0, h1)``."""
    for side, pool in (("source", src), ("destination", dst)):
        if not (pool.first_head <= h0 < h1 <= pool.first_head + pool.heads):
            raise ValueError(
                f"heads [{h0}, {h1}) is a slice that does not fit the {side}, which holds "
                f"heads [{pool.first_head}, {pool.first_head + pool.heads})"
            )


def _holds_exactly(src: PoolSpec, dst: PoolSpec, heads: tuple[int, int]) -> bool:
    """Both pools hold exactly heads ``[h0, h1)``: a copy of them is of whole pages (the rule
    of :func:`plan_pages`, :func:`plan_small`, :func:`stages_pages` and
    :func:`stages_heads`, one place)."""
    h0, h1 = heads
    return src.first_head == dst.first_head == h0 and src.heads == dst.heads == h1 - h0


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

    Pools with per-buffer geometry (head-major pages, buffers of different sizes, page
    strides: :attr:`PoolSpec.packed` False on either side) are planned buffer by buffer
    (:func:`_plan_geometry`): whole pages as above where both sides lay them out alike
    (runs merge only where both sides' pages are packed); a head slice is one block per page
    when both sides are head-major, one per token slot when both are token-major, and one per
    (token, head) when they differ.
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
    if not (src.packed and dst.packed):
        return _plan_geometry(src, dst, s_pages, d_pages, heads)

    src_bases = _bases_column(src.buffer_bases)
    dst_bases = _bases_column(dst.buffer_bases)
    whole = heads is None or _holds_exactly(src, dst, heads)
    if whole:
        if src.item_len != dst.item_len:
            raise ValueError(
                f"whole-page copy needs equal page sizes in bytes: source item_len "
                f"{src.item_len}, destination {dst.item_len} (pass heads= to slice)"
            )
        if s_pages.size <= _memory.SMALL:  # lists: cheaper than numpy here (see SMALL)
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
    _check_slice(src, dst, h0, h1)
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


def _plan_geometry(
    src: PoolSpec,
    dst: PoolSpec,
    s_pages: npt.NDArray[np.int64],
    d_pages: npt.NDArray[np.int64],
    heads: tuple[int, int] | None,
) -> Blocks:
    """:func:`plan_pages` for pools with per-buffer geometry (page ids checked already)."""
    if src.head_bytes_all != dst.head_bytes_all:
        raise ValueError(
            f"bytes per head differ buffer by buffer: source {src.head_bytes_all}, "
            f"destination {dst.head_bytes_all}"
        )
    if heads is None:  # (MLA, or the caller's whole pages): both hold the same heads
        if (src.first_head, src.heads) != (dst.first_head, dst.heads):
            raise ValueError(
                f"whole-page copy needs the same heads on both sides: source "
                f"[{src.first_head}, {src.first_head + src.heads}), destination "
                f"[{dst.first_head}, {dst.first_head + dst.heads}) (pass heads= to slice)"
            )
        heads = (src.first_head, src.first_head + src.heads)
    h0, h1 = heads
    _check_slice(src, dst, h0, h1)
    T = src.page_size
    count = h1 - h0

    def layout_of(pool: PoolSpec) -> str | None:
        # one head or one token a page: token-major and head-major are the same bytes
        return None if pool.heads == 1 or T == 1 else pool.page_layout

    s_lay, d_lay = layout_of(src), layout_of(dst)
    # the layout both sides are read in (None: either); "cells" when they differ
    common = s_lay or d_lay if s_lay is None or d_lay is None or s_lay == d_lay else "cells"
    whole = (
        src.first_head == dst.first_head == h0 and src.heads == dst.heads == count
        and common != "cells"
    )

    def atoms(pool: PoolSpec, hb: int) -> tuple[npt.NDArray[np.uint64], int]:
        """Offsets in a page of the copy's contiguous pieces on ``pool``'s side, and their
        length: the whole page, the slice (head-major), a token's slice (token-major), or
        one head of one token (the layouts differ)."""
        rel = h0 - pool.first_head
        if whole:
            return np.zeros(1, dtype=_U64), T * pool.heads * hb
        t = np.arange(T, dtype=np.int64)
        if common == "hnd":
            return np.array([rel * T * hb], dtype=_U64), count * T * hb
        if common in ("nhd", None):
            return ((t * pool.heads + rel) * hb).astype(_U64), count * hb
        h = np.arange(count, dtype=np.int64)[None, :]
        if (layout_of(pool) or "nhd") == "nhd":
            off = (t[:, None] * pool.heads + rel + h) * hb
        else:
            off = ((rel + h) * T + t[:, None]) * hb
        return off.ravel().astype(_U64), hb

    src_parts, dst_parts, len_parts = [], [], []
    for b in range(src.num_buffers):
        hb = src.head_bytes_of(b)
        s_off, length = atoms(src, hb)
        d_off, _ = atoms(dst, hb)
        s_stride, d_stride = _U64(src.strides[b]), _U64(dst.strides[b])
        s_p, d_p, lens = s_pages, d_pages, None
        if whole and src.strides[b] == length and dst.strides[b] == length:
            s_p, d_p, run = _runs(s_pages, d_pages)  # both packed: runs are one block
            lens = run.astype(_U64) * _U64(length)
        s_addr = _U64(src.buffer_bases[b]) + s_p.astype(_U64)[:, None] * s_stride + s_off[None]
        d_addr = _U64(dst.buffer_bases[b]) + d_p.astype(_U64)[:, None] * d_stride + d_off[None]
        src_parts.append(s_addr.ravel())
        dst_parts.append(d_addr.ravel())
        len_parts.append(
            lens if lens is not None else np.full(s_addr.size, length, dtype=_U64)
        )
    return Blocks(
        np.concatenate(src_parts), np.concatenate(dst_parts), np.concatenate(len_parts)
    )


def stages_heads(src: PoolSpec, dst: PoolSpec, heads: tuple[int, int] | None) -> bool:
    """Whether a head-sliced copy of heads ``[h0, h1)`` can go through a staging area on the
    source side: an MHA copy that slices (not :func:`plan_pages`' whole-page case) and fills
    whole token slots of the destination (it holds exactly those heads: decode TP a multiple
    of prefill TP). Then a destination page is one contiguous range, and the slices of a
    page, gathered into staging, go as one block (:func:`plan_staged`). Where the
    destination holds more heads than the slice (prefill TP above decode TP) its side is
    strided too, and the copy stays per token slot."""
    if heads is None or src.layout != "mha" or src.head_bytes_all != dst.head_bytes_all:
        return False
    if src.page_layout != "nhd" or dst.page_layout != "nhd":
        return False  # (a head-major slice is one block per page already)
    h0, h1 = heads
    return not _holds_exactly(src, dst, heads) and dst.first_head == h0 and dst.heads == h1 - h0


def stages_pages(src: PoolSpec, dst: PoolSpec, heads: tuple[int, int] | None) -> bool:
    """Whether a copy of heads ``[h0, h1)`` (None: MLA, whole pages) is of whole pages that
    are alike on both sides (the same heads, page sizes and page layout): then a chunk's
    source pages can be gathered into a staging area as they are and written with
    :func:`plan_staged` (a decode landing area, ``trio_pd.core._landing``)."""
    if heads is not None and not _holds_exactly(src, dst, heads):
        return False
    return src.item_lens == dst.item_lens and src.page_layout == dst.page_layout


def staged_bytes(src: PoolSpec, dst: PoolSpec, num_pages: int) -> int:
    """Bytes of staging one chunk of ``num_pages`` pages takes (see :func:`plan_staged`)."""
    return num_pages * sum(dst.item_lens)


def plan_staged(src: PoolSpec, dst: PoolSpec, dst_pages: npt.ArrayLike, base: int) -> Blocks:
    """The blocks that copy a gathered chunk from staging memory at ``base`` into the
    destination pages ``dst_pages`` (checked already: the caller ran :func:`validate_pages`).

    The staging layout is buffer-major, then page: buffer ``b``'s slices start at ``base``
    plus ``n`` pages of every buffer before it, and the slice of chunk page ``k`` is the
    ``dst.item_lens[b]`` bytes ``k`` pages further, laid out as the destination page is
    (:func:`stages_heads` holds). One block per run of destination pages consecutive in a
    buffer whose pages are packed (a consecutive chunk costs ``num_buffers`` blocks); one per
    page where the destination leaves room between pages."""
    if src.num_buffers != dst.num_buffers:
        raise ValueError(f"source has {src.num_buffers} buffers, destination {dst.num_buffers}")
    num_buffers = src.num_buffers
    d = _as_pages(dst_pages, "destination")
    n = d.size
    if n == 0 or num_buffers == 0:
        return empty()
    if not dst.packed:
        return _plan_staged_geometry(dst, d, base)
    item = _U64(dst.item_len)
    _, d0, run = _runs(np.arange(n, dtype=np.int64), d)
    k0 = np.concatenate(([0], np.cumsum(run)[:-1])).astype(_U64)  # first chunk page of a run
    rows = (np.arange(num_buffers, dtype=_U64) * _U64(n))[:, None]
    lens = np.empty((num_buffers, run.size), dtype=_U64)
    lens[:] = run.astype(_U64) * item
    dst_bases = _bases_column(dst.buffer_bases)
    return Blocks(
        (_U64(base) + (rows + k0[None, :]) * item).ravel(),
        (dst_bases + d0.astype(_U64) * item).ravel(),
        lens.ravel(),
    )


def _plan_staged_geometry(dst: PoolSpec, d: npt.NDArray[np.int64], base: int) -> Blocks:
    """:func:`plan_staged` for a destination with per-buffer geometry, buffer by buffer."""
    n = d.size
    src_parts, dst_parts, len_parts = [], [], []
    start = base
    for b, (item, stride) in enumerate(zip(dst.item_lens, dst.strides, strict=True)):
        if stride == item:
            _, d0, run = _runs(np.arange(n, dtype=np.int64), d)
            k0 = np.concatenate(([0], np.cumsum(run)[:-1]))
        else:
            d0, run, k0 = d, np.ones(n, dtype=np.int64), np.arange(n, dtype=np.int64)
        src_parts.append(_U64(start) + k0.astype(_U64) * _U64(item))
        dst_parts.append(_U64(dst.buffer_bases[b]) + d0.astype(_U64) * _U64(stride))
        len_parts.append(run.astype(_U64) * _U64(item))
        start += n * item
    return Blocks(
        np.concatenate(src_parts), np.concatenate(dst_parts), np.concatenate(len_parts)
    )


def plan_aux(src: PoolSpec, dst: PoolSpec, src_slot: int, dst_slot: int) -> Blocks:
    """The blocks that copy aux slot ``src_slot`` to the destination's slot ``dst_slot``: one
    block per aux buffer (:attr:`~trio_pd.PoolSpec.num_aux`), in order, the first (the
    stamped row) first.

    Both sides must have the same aux buffers with the same row sizes, buffer by buffer, or
    it raises :class:`ValueError` (the pairing check refuses such a peer at REGISTER). A
    destination slot out of range is a :class:`~trio_pd.ProtocolError` (it came from the
    peer); a bad source slot is a :class:`ValueError` (a local bug).
    """
    rows_src, rows_dst = src.aux_item_lens, dst.aux_item_lens
    if rows_src != rows_dst:
        if len(rows_src) != len(rows_dst):
            raise ValueError(
                f"aux buffers differ: the source has {len(rows_src)}, the destination "
                f"{len(rows_dst)}"
            )
        i = next(i for i, (a, b) in enumerate(zip(rows_src, rows_dst, strict=True)) if a != b)
        which = "aux row size" if i == 0 else f"aux buffer {i}'s row size"
        raise ValueError(f"{which} differs: source {rows_src[i]}, destination {rows_dst[i]}")
    if not 0 <= src_slot < src.aux_slots:
        raise ValueError(f"source aux slot {src_slot} out of range [0, {src.aux_slots})")
    if not 0 <= dst_slot < dst.aux_slots:
        raise ProtocolError(f"destination aux slot {dst_slot} out of range [0, {dst.aux_slots})")
    if not src.extra_aux:
        rows = _u64([aux_row_address(src, src_slot), aux_row_address(dst, dst_slot),
                     src.aux_item_len])
        return Blocks(rows[0:1], rows[1:2], rows[2:3])
    k = src.num_aux
    return Blocks(
        _u64([aux_row_address(src, src_slot, i) for i in range(k)]),
        _u64([aux_row_address(dst, dst_slot, i) for i in range(k)]),
        _u64(rows_src),
    )


#: chunks of at most this many runs of pages (consecutive on both sides) take
#: :func:`plan_small` (the agents' hot path): a chunk of that many pages always qualifies
SMALL_CHUNK = 8


def _few_runs(
    src_pages: Sequence[int] | npt.NDArray[np.int64],
    dst_pages: Sequence[int] | npt.NDArray[np.int64],
    n: int,
) -> tuple[list[int], list[int], list[int]] | None:
    """:func:`_runs` of two page lists of length ``n`` > 0 as Python ints, or None where
    there are more than :data:`SMALL_CHUNK` runs (only a chunk of more pages can have). Up to
    :data:`~trio_pd.core._memory.SMALL` pages in Python (a chunk consecutive on both sides,
    the usual one, by two list comparisons: no loop over its pages), more in numpy."""
    if n > _memory.SMALL:
        s, d = np.asarray(src_pages), np.asarray(dst_pages)
        if s.dtype.kind not in "iu" or d.dtype.kind not in "iu":
            return None  # (not page ids: the general path refuses them)
        s0, d0, k = _runs(s.astype(np.int64, copy=False), d.astype(np.int64, copy=False))
        if k.size > SMALL_CHUNK:
            return None
        return s0.tolist(), d0.tolist(), k.tolist()
    sl = src_pages.tolist() if isinstance(src_pages, np.ndarray) else list(src_pages)
    dl = dst_pages.tolist() if isinstance(dst_pages, np.ndarray) else list(dst_pages)
    a, b = sl[0], dl[0]
    if (
        sl[-1] - a == n - 1 == dl[-1] - b
        and sl == list(range(a, a + n)) and dl == list(range(b, b + n))
    ):
        return [a], [b], [n]
    return _runs_upto(sl, dl, SMALL_CHUNK)  # (a fragmented chunk: declined at its 9th run)


def plan_small(
    src: PoolSpec,
    dst: PoolSpec,
    src_pages: Sequence[int] | npt.NDArray[np.int64],
    dst_pages: Sequence[int] | npt.NDArray[np.int64],
    aux: tuple[PoolSpec, PoolSpec, int, int] | None,
    regions: RegionTable,
    *,
    heads: tuple[int, int] | None = None,
) -> Blocks | None:
    """A chunk's blocks in plain Python, for a chunk of whole pages in a few runs: what
    ``validate_blocks(concat([plan_pages(src, dst, src_pages, dst_pages, heads=heads,
    pages_checked=True), plan_aux(*aux)]), regions)`` gives (the pages' part left out when
    there are none), the same blocks in the same order, with three numpy arrays made once at
    the end instead of a dozen small ones: a chunk's planning costs more in numpy calls than
    in work (docs/bench.md). The page ids must have been checked already
    (:func:`validate_pages`), as ``pages_checked=True`` says.

    None where it does not apply or something would be refused (more than
    :data:`SMALL_CHUNK` runs of pages consecutive on both sides, pools that are not both
    packed, head slices, pages of different sizes, extra aux buffers, an aux slot out of
    range, a block outside ``regions``): the caller then takes the general path, which plans
    the same blocks or raises its error.
    """
    n = len(src_pages)
    if n != len(dst_pages):
        return None
    # (each pool's geometry read once, not through four properties: a call per chunk each)
    num_buffers = len(src.buffer_bases)
    sg, dg = src._geometry(), dst._geometry()
    if n and (
        not (sg.packed and dg.packed)
        or num_buffers != len(dst.buffer_bases)
        or src.page_size != dst.page_size
        or not (heads is None or _holds_exactly(src, dst, heads))
    ):
        return None
    s: list[int] = []
    d: list[int] = []
    lens: list[int] = []
    if n and num_buffers:
        item = sg.item_len  # (packed pools have one page size: never None here)
        if item is None or item != dg.item_len:
            return None
        runs = _few_runs(src_pages, dst_pages, n)
        if runs is None:
            return None
        ss, ds, ns = runs
        s = [b + x * item for b in src.buffer_bases for x in ss]
        d = [b + x * item for b in dst.buffer_bases for x in ds]
        lens = [x * item for x in ns] * num_buffers
    return _finish_small(s, d, lens, aux, regions)


def _finish_small(
    s: list[int], d: list[int], lens: list[int],
    aux: tuple[PoolSpec, PoolSpec, int, int] | None, regions: RegionTable,
) -> Blocks | None:
    """The end of :func:`plan_small` and :func:`plan_staged_small`: the aux row's block
    appended to the pages' (``s``, ``d``, ``lens``), every block checked as
    :func:`validate_blocks` and :func:`plan_aux` check it, and the three arrays made; None
    where one of them would refuse (the general path then says what is wrong)."""
    if aux is not None:
        asrc, adst, a, b = aux
        if (
            asrc.extra_aux or adst.extra_aux or asrc.aux_item_len != adst.aux_item_len
            or not 0 <= a < asrc.aux_slots or not 0 <= b < adst.aux_slots
        ):
            return None
        s.append(aux_row_address(asrc, a))
        d.append(aux_row_address(adst, b))
        lens.append(asrc.aux_item_len)
    base_list, reach_list = regions.base_list, regions.reach_list
    for x, k in zip(d, lens, strict=True):
        i = bisect.bisect_right(base_list, x) - 1
        if k == 0 or i < 0 or x + k > reach_list[i] or x < 0:
            return None  # (the general path says what is wrong)
    if s and (min(s) < 0 or max(s) > _memory._U64_MAX):
        return None
    return Blocks(np.array(s, dtype=_U64), np.array(d, dtype=_U64), np.array(lens, dtype=_U64))


def plan_staged_small(
    src: PoolSpec,
    dst: PoolSpec,
    dst_pages: Sequence[int] | npt.NDArray[np.int64],
    base: int,
    aux: tuple[PoolSpec, PoolSpec, int, int] | None,
    regions: RegionTable,
) -> Blocks | None:
    """:func:`plan_small` for a staged chunk: what ``validate_blocks(concat([plan_staged(src,
    dst, dst_pages, base), plan_aux(*aux)]), regions)`` gives (the aux part left out for
    None), the same blocks in the same order, in plain Python (a decode rank of a larger TP
    takes this path for every chunk, once per destination rank). The destination page ids
    must have been checked already, as for :func:`plan_staged`.

    None where it does not apply or something would be refused (no pages, more than
    :data:`SMALL_CHUNK` runs of consecutive destination pages, a destination whose pages are
    not packed, pools of different buffer counts, extra aux buffers, an aux slot out of
    range, a block outside ``regions``): the caller then takes the general path, which plans
    the same blocks or raises its error."""
    n = len(dst_pages)
    num_buffers = dst.num_buffers
    if not n or not num_buffers or src.num_buffers != num_buffers or not dst.packed:
        return None
    runs = _few_runs(range(n), dst_pages, n)  # (the staging side: chunk pages 0..n-1)
    if runs is None:
        return None
    ks, ds, ns = runs
    item = dst.item_len
    s = [base + (b * n + k) * item for b in range(num_buffers) for k in ks]
    d = [b + x * item for b in dst.buffer_bases for x in ds]
    lens = [x * item for x in ns] * num_buffers
    return _finish_small(s, d, lens, aux, regions)


def plan_states(
    src: PoolSpec,
    dst: PoolSpec,
    cuts: Sequence[SlotCuts],
    src_slots: Sequence[npt.NDArray[np.int64]],
    dst_slots: Sequence[npt.NDArray[np.int64]],
) -> Blocks:
    """The blocks that copy a room's state slots: slot ``src_slots[c][i]`` of component
    ``c`` to decode's slot ``dst_slots[c][i]``, in every buffer of the component, each
    slot cut as ``cuts[c]`` says (:func:`~trio_pd.core._topology.state_cuts`: what this rank
    writes of a slot there). Both sides' slots were checked when they came; a room whose
    two sides name different numbers of slots of a component is a
    :class:`~trio_pd.ProtocolError` (the room fails, nothing of its states is written)."""
    parts: list[Blocks] = []
    for c, (ours, theirs) in enumerate(zip(src.states, dst.states, strict=True)):
        a, b = src_slots[c], dst_slots[c]
        if len(a) != len(b):
            raise ProtocolError(
                f"state component {ours.name!r}: prefill has {len(a)} slots for the room, "
                f"decode {len(b)}"
            )
        if not len(a):
            continue
        ua, ub = a.astype(_U64), b.astype(_U64)
        runs: tuple[npt.NDArray[np.uint64], ...] | None = None
        for i, buffer_cuts in enumerate(cuts[c]):
            (base_a, item_a), (base_b, item_b) = ours.buffers[i], theirs.buffers[i]
            if buffer_cuts == ((0, 0, item_a),) and item_a == item_b:
                # whole slots of one size on both sides: slots consecutive on both sides
                # are one block (as pages are: a window's slots often are)
                if runs is None:
                    s0, d0, k = _runs(a, b)
                    runs = s0.astype(_U64), d0.astype(_U64), k.astype(_U64)
                item = _U64(item_a)
                parts.append(Blocks(_U64(base_a) + runs[0] * item,
                                    _U64(base_b) + runs[1] * item, runs[2] * item))
                continue
            row_a = _U64(base_a) + ua * _U64(item_a)
            row_b = _U64(base_b) + ub * _U64(item_b)
            for so, do, n in buffer_cuts:
                parts.append(Blocks(row_a + _U64(so), row_b + _U64(do),
                                    np.full(len(a), n, dtype=_U64)))
    return concat(parts)


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
    if dst.size <= _memory.SMALL:
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
