"""The memory model: registered regions, a rank's pool layout, the aux-row stamp, and the
checks that page ids and planned writes stay inside what was registered (SPEC §3, I8).

Pure: numpy and the standard library only (``ctypes`` for the aux stamp, which trio_pd writes
and reads in place). Nothing here imports trio, zmq, an engine adapter or the trio layer;
``engines/_base.py`` imports :class:`Region` from here, never the reverse.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from ._errors import ProtocolError

_U64 = np.uint64
_U64_MAX: Final = int(np.iinfo(np.uint64).max)

#: Up to this many elements the hot-path helpers (here and in ``_plan``) work on Python lists,
#: where numpy's per-call overhead outweighs the work (docs/bench.md); above it, numpy. Both
#: paths give identical results (tested).
SMALL = 64
#: pools of at most this many pages check repeated page ids with a bitmap (one byte a page)
BITMAP_PAGES = 1 << 26


@dataclass(frozen=True, slots=True)
class Region:
    """One registered memory range: [base, base + length)."""

    base: int
    length: int

    @property
    def end(self) -> int:
        return self.base + self.length


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
# The aux row
# --------------------------------------------------------------------------------------------

#: bytes 0..15 of every aux row are trio_pd's: (room, epoch) as little-endian int64, so decode
#: can tell a row that belongs to someone else (SPEC §3).
AUX_STAMP: Final = struct.Struct("<qq")


def aux_row_address(pool: PoolSpec, slot: int) -> int:
    """The address of aux row ``slot`` of ``pool``. The slot is not checked: callers use slots
    they allocated, or checked (:func:`~trio_pd._plan.plan_aux`)."""
    return pool.aux_base + slot * pool.aux_item_len


def stamp_aux_row(pool: PoolSpec, slot: int, room: int, epoch: int) -> None:
    """Write the :data:`AUX_STAMP` ``(room, epoch)`` into the first bytes of aux row ``slot``,
    in place. The row must be memory this process owns (the prefill side's own pool)."""
    ctypes.memmove(aux_row_address(pool, slot), AUX_STAMP.pack(room, epoch), AUX_STAMP.size)


def read_aux_stamp(pool: PoolSpec, slot: int) -> tuple[int, int]:
    """The ``(room, epoch)`` :data:`AUX_STAMP` at the start of aux row ``slot``, read in place."""
    room, epoch = AUX_STAMP.unpack(ctypes.string_at(aux_row_address(pool, slot), AUX_STAMP.size))
    return int(room), int(epoch)


# --------------------------------------------------------------------------------------------
# Checks against registered memory (SPEC I8)
# --------------------------------------------------------------------------------------------


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
    if num_pages <= BITMAP_PAGES:
        # O(n + num_pages) instead of a sort's O(n log n): 4M ids take ~20 ms, not ~300
        seen = np.zeros(num_pages, dtype=np.bool_)
        seen[ids] = True
        if int(np.count_nonzero(seen)) == ids.size:
            return
        # a repeat: the sort below names it
    ordered = np.sort(ids)
    dup = np.flatnonzero(ordered[1:] == ordered[:-1])
    if dup.size:
        raise ProtocolError(
            f"{dup.size} repeated page ids (first: {int(ordered[dup[0]])}); "
            "two writes would land on one page"
        )


class RegionTable:
    """Registered regions prepared once for :func:`~trio_pd._plan.validate_blocks` (sorted
    bases and the running maximum of their ends), so checking a chunk costs no per-call
    set-up."""

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
