"""Staged head slices: a prefill rank's host staging area, and the gather into it.

When decode runs at a larger TP than prefill (MHA), each decode rank holds a subset of the
heads a prefill page holds. Copied in place, that is one block per token slot per page per
buffer (a 64-page chunk of 32-token pages and 16 buffers: 32,768 blocks of a few hundred
bytes), and the engine's cost per block is the whole cost. Staged, the prefill rank first
gathers the slices of a chunk into one contiguous range of its own registered memory, laid
out as the destination pages are, and writes a few large blocks: one per run of consecutive
destination pages per buffer (:func:`~trio_pd.core._plan.plan_staged`). The destination's side
needs nothing: its pages receive whole token slots, so they are contiguous already.

The same area gathers whole pages for a decode rank's *landing pages*
(:mod:`trio_pd.core._landing`): a room whose pages are scattered on both sides is written
into a run of consecutive landing pages, and its source pages, gathered as they are, go as
one block per buffer (:func:`~trio_pd.core._plan.stages_pages`).

**The lifetime rule of a reservation** (a range of the area one engine call reads):

* the gather writes it on the lane's thread, right before the engine call that reads it
  (``_chunks.Write``), so a call that never starts never touches it;
* it goes back to the area once its call is known to read it no more: the call completed, or
  never started;
* a call that failed (its outcome unknown: the engine may still be reading) keeps its
  reservation until the room's pages are released, which the room machine allows only once
  no write of the room can still be in flight (the quarantine, docs/lifetimes.md). So a range
  is never gathered into again while an engine may still read it for another write.

The area is allocated and registered with the engine the first time a chunk needs it, and
only then. A chunk that finds no room in it (``staging_full``) is written in place, per token
slot, as without staging: a room is never held back waiting for staging.

Host pools only: the gather reads the source pages with numpy. A pool whose KV buffers are
not stated to be host memory (:attr:`~trio_pd.PoolSpec.region_kinds`) is written in place;
a device pool would gather with a strided device copy (``cudaMemcpy2DAsync``) at
:meth:`StagingArea.gather`, the one place that reads source pages.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from ._memory import HOST, PoolSpec, Region

#: the area's allocation unit (bytes): a reservation is a run of whole units
UNIT = 64 * 1024
#: the area's start is aligned to this (a page: what engines that pin memory want)
ALIGN = 4096


def buffer_view(
    pool: PoolSpec, b: int, shape: tuple[int, ...], strides: tuple[int, ...],
    *, writeable: bool,
) -> npt.NDArray[np.uint8]:
    """A numpy view of KV buffer ``b`` of a host pool (:func:`host_source`), bytes seen with
    ``shape`` and byte ``strides``: how the staging gather reads source pages and the
    landing copy writes destination pages."""
    raw = np.ctypeslib.as_array(
        (ctypes.c_uint8 * pool.buffer_length(b)).from_address(pool.buffer_bases[b])
    )
    return np.lib.stride_tricks.as_strided(raw, shape, strides, writeable=writeable)


class RunMap:
    """``size`` slots handed out first-fit in runs of consecutive slots: one byte per slot,
    0 free and 1 held, so ``bytearray.find`` looks for a free run in C. The one allocator of
    the staging area (units) and of the landing area (landing pages)."""

    __slots__ = ("_map", "held")

    def __init__(self, size: int) -> None:
        self._map = bytearray(size)
        #: slots held now
        self.held = 0

    def take(self, n: int) -> int | None:
        """The first slot of a free run of ``n``, now held; None when there is none."""
        if n <= 0 or n > len(self._map):
            return None
        first = self._map.find(bytes(n))
        if first < 0:
            return None
        self._map[first : first + n] = b"\x01" * n
        self.held += n
        return first

    def give(self, first: int, n: int) -> None:
        """Slots ``[first, first + n)`` are free again (each run is given back once)."""
        assert self._map[first : first + n] == b"\x01" * n, "a run given back twice"
        self._map[first : first + n] = bytes(n)
        self.held -= n


class Reservation:
    """A contiguous range of the staging area, held for one engine call."""

    __slots__ = ("addr", "first", "nbytes", "units")

    def __init__(self, first: int, units: int, addr: int, nbytes: int) -> None:
        self.first = first
        self.units = units
        self.addr = addr
        self.nbytes = nbytes


def host_source(pool: PoolSpec) -> bool:
    """Whether ``pool``'s KV buffers are stated to be host memory (so numpy may read them)."""
    kinds = pool.region_kinds
    return kinds is not None and all(k == HOST for k in kinds[: pool.num_buffers])


class StagingArea:
    """``nbytes`` of host memory (rounded down to whole :data:`UNIT` s), reserved first-fit in
    runs of units. Not thread-safe: the trio thread reserves and gives back; the lanes'
    threads only gather into reservations they were handed."""

    def __init__(self, nbytes: int, unit: int = UNIT) -> None:
        if nbytes < 0:
            raise ValueError(f"staging bytes must be >= 0, got {nbytes}")
        self.unit = unit
        self.units = nbytes // unit
        self._runs = RunMap(self.units)
        self._mem: npt.NDArray[np.uint8] | None = None
        self._base = 0
        #: registered with the engine (set by whoever registered :attr:`region`)
        self.registered = False
        #: True once registering failed: chunks are written in place from then on
        self.disabled = False
        #: reservations of failed calls, by the room that must release them
        self._held: dict[object, list[Reservation]] = {}
        self._source: tuple[PoolSpec, list[npt.NDArray[np.uint8]]] | None = None
        #: (heads, destination page sizes, buffers) -> what the gather reads: _slices
        self._sliced: dict[
            tuple[tuple[int, int], tuple[int, ...], tuple[int, ...] | None],
            list[tuple[npt.NDArray[np.uint8], int]],
        ] = {}

    @property
    def units_reserved(self) -> int:
        return self._runs.held

    @property
    def usable(self) -> bool:
        return self.units > 0 and not self.disabled

    @property
    def region(self) -> Region:
        """The area's memory, allocated on first use (host memory, page-aligned)."""
        self._allocate()
        return Region(self._base, self.units * self.unit, HOST)

    def _allocate(self) -> None:
        """The area's memory, made on first use (page-aligned host memory)."""
        if self._mem is None:
            raw = np.empty(self.units * self.unit + ALIGN, dtype=np.uint8)
            skip = -raw.ctypes.data % ALIGN
            self._mem = raw[skip : skip + self.units * self.unit]
            self._base = int(self._mem.ctypes.data)

    def reserve(self, nbytes: int) -> Reservation | None:
        """A free run of units holding ``nbytes``, or None when there is none now."""
        k = -(-nbytes // self.unit)
        first = self._runs.take(k) if nbytes > 0 else None
        if first is None:
            return None
        if self._mem is None:
            self._allocate()
        return Reservation(first, k, self._base + first * self.unit, nbytes)

    def give(self, r: Reservation) -> None:
        """Hand a reservation back: no engine call can read it any more."""
        self._runs.give(r.first, r.units)

    def hold(self, owner: object, r: Reservation) -> None:
        """Keep ``r`` until :meth:`release_held` for ``owner``: its call failed, and the
        engine may still read it."""
        self._held.setdefault(owner, []).append(r)

    def release_held(self, owner: object) -> None:
        """``owner``'s pages were released: no write of it can still be in flight."""
        for r in self._held.pop(owner, ()):
            self.give(r)

    @property
    def held(self) -> int:
        """Reservations kept for failed calls."""
        return sum(len(v) for v in self._held.values())

    def gatherer(
        self, pool: PoolSpec, pages: npt.NDArray[np.int64], heads: tuple[int, int],
        r: Reservation, dst_item_lens: tuple[int, ...], buffers: list[int] | None = None,
    ) -> Callable[[], None]:
        """The copy that fills ``r`` with heads ``[h0, h1)`` of ``pages`` of every buffer of
        ``pool`` (or of ``buffers`` of it, in that order: a layer-wise chunk's layers; then
        ``dst_item_lens`` is theirs), in :func:`~trio_pd.core._plan.plan_staged`'s layout; run by
        the lane's thread right before the engine call (:meth:`gather`)."""
        assert self._mem is not None
        n = int(pages.size)
        start = r.addr - self._base
        mem = self._mem
        parts = []
        for source, item in self._slices(pool, heads, dst_item_lens, buffers):
            parts.append((source, mem[start : start + n * item].reshape(n, *source.shape[1:])))
            start += n * item
        return lambda: self.gather(parts, pages)

    def _slices(
        self, pool: PoolSpec, heads: tuple[int, int], dst_item_lens: tuple[int, ...],
        buffers: list[int] | None,
    ) -> list[tuple[npt.NDArray[np.uint8], int]]:
        """For each buffer :meth:`gatherer` copies, in order: the view of heads ``[h0, h1)``
        of every token slot of every page of ``pool`` (``(num_pages, page_size, slice
        bytes)``), and the bytes a page of it takes in staging. They depend on the pool, the
        heads (a decode rank's), the destination's page sizes and the buffers, not on the
        chunk: made once per destination geometry, kept while the pool is the same."""
        key = (heads, dst_item_lens, None if buffers is None else tuple(buffers))
        views = self._views(pool)  # (a new pool: a new cache, see _views)
        hit = self._sliced.get(key)
        if hit is None:
            if len(self._sliced) >= 256:
                self._sliced.clear()
            hit = []
            for k, b in enumerate(range(pool.num_buffers) if buffers is None else buffers):
                hb = pool.head_bytes_of(b)
                width = (heads[1] - heads[0]) * hb
                offset = (heads[0] - pool.first_head) * hb
                hit.append((views[b][:, :, offset : offset + width], dst_item_lens[k]))
            self._sliced[key] = hit
        return hit

    def _views(self, pool: PoolSpec) -> list[npt.NDArray[np.uint8]]:
        """numpy views ``(num_pages, page_size, slot bytes)`` of the host pool's KV buffers,
        with each buffer's page stride (made once: an agent has one pool)."""
        if self._source is None or self._source[0] is not pool:
            views = []
            for b in range(pool.num_buffers):
                slot = pool.heads * pool.head_bytes_of(b)
                views.append(buffer_view(
                    pool, b, (pool.num_pages, pool.page_size, slot), (pool.strides[b], slot, 1),
                    writeable=False,
                ))
            self._source = (pool, views)
            self._sliced.clear()  # (views of the pool before)
        return self._source[1]

    @staticmethod
    def gather(
        parts: list[tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]],
        pages: npt.NDArray[np.int64],
    ) -> None:
        """For each buffer, copy its slice of every token slot of ``pages`` (``source``, a
        view of the slice's bytes of every page) into its range of the reservation
        (``out``): the one place source pages are read for staging (a device pool would
        issue a strided device copy here)."""
        for source, out in parts:
            # (pages were checked against the pool when they were admitted.) Indexing, not
            # np.take: take copies a strided source whole first (the pool's every page:
            # measured 30x slower for a 64-page chunk of a 1,024-page pool)
            out[...] = source[pages]
