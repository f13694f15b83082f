"""Landing pages: a decode rank's host area where a room with scattered pages is written in
few blocks, then scattered into its real pages before Success.

Where pages are small and handed out in no order on both ranks (SGLang's shape: 16 KiB per
page per buffer), a request of ``n`` pages is ``n`` engine blocks per buffer, and the
engine's per-block cost bounds the transfer. A decode rank with a landing area
(``DecodeConfig.landing_bytes``) offers a room whose pages are fragmented a run of
consecutive *landing pages* instead (the TRANSFER says ``landing``): prefill gathers each
chunk's source pages into its staging area and writes one block per buffer into them
(:mod:`trio_pd.core._staging`); once every required rank reported Success and the aux row
is this room's, decode copies the landing pages into the room's real pages, and only then
does the room read Success. The aux row and state slots go to the real pool as always.

The area has the decode pool's KV geometry: the same buffers, each of ``pages`` pages of
that buffer's page size, packed, buffer after buffer (:func:`landing_spec` is the pool as
prefill plans against it). It is allocated and registered with the engine when the agent
opens, advertised in each REGISTER, and deregistered when it closes.

**The lifetime rule of a landing range** (the run of landing pages one room holds): it is
reserved when the room's TRANSFERs go out, and goes back only when no write of the room
can still land in it: at Success (every rank reported Success after all its engine calls
had returned: the scatter ran before, so it is copied already), or with the room's pages
on a Release (drain acks, writers proven gone, the timeout policy). A failed room is never
scattered. An agent that closes while a room still holds a range keeps the area's memory
for the life of the process (:data:`KEPT`): a write may still land there.

Host pools only: the scatter writes the destination pages with numpy.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import numpy.typing as npt

from ._memory import HOST, MAX_POOL_PAGES, PoolSpec, Region
from ._staging import RunMap, buffer_view

#: the area's start is aligned to this (a page: what engines that pin memory want)
ALIGN = 4096

#: landing areas of closed agents in which a write may still land (a held range)
KEPT: list[LandingArea] = []


def landing_spec(pool: PoolSpec, bases: tuple[int, ...], pages: int) -> PoolSpec:
    """``pool`` as a landing area of ``pages`` pages at ``bases`` (one per KV buffer): the
    same geometry, each buffer's pages packed, the aux buffers and no state component (the
    aux row and state slots of a landed room go to the real pool)."""
    return replace(pool, num_pages=pages, buffer_bases=tuple(bases), page_strides=(), states=())


class LandingArea:
    """``pages`` landing pages of ``pool``'s geometry in host memory, reserved first-fit in
    runs. Not thread-safe: the trio thread reserves, gives back and scatters."""

    def __init__(self, pool: PoolSpec, nbytes: int) -> None:
        self.pool = pool
        per_page = sum(pool.item_lens)
        # (at most what a REGISTER can advertise)
        self.pages = min(nbytes // per_page, MAX_POOL_PAGES) if per_page and nbytes > 0 else 0
        self._runs = RunMap(self.pages)
        self.registered = False
        self._mem: npt.NDArray[np.uint8] | None = None
        self._views: list[npt.NDArray[np.uint8]] = []
        self._dst: list[npt.NDArray[np.uint8]] = []
        if self.pages:
            size = self.pages * per_page
            raw = np.zeros(size + ALIGN, dtype=np.uint8)
            skip = -raw.ctypes.data % ALIGN
            self._mem = raw[skip : skip + size]
            start = 0
            for item in pool.item_lens:
                n = self.pages * item
                self._views.append(self._mem[start : start + n].reshape(self.pages, item))
                start += n

    @property
    def usable(self) -> bool:
        return self.pages > 0

    @property
    def region(self) -> Region:
        """The whole area, as registered with the engine."""
        assert self._mem is not None
        return Region(int(self._mem.ctypes.data), int(self._mem.nbytes), HOST)

    @property
    def bases(self) -> tuple[int, ...]:
        """Where each buffer's landing pages start (what REGISTER advertises)."""
        return tuple(int(v.ctypes.data) for v in self._views)

    @property
    def reserved(self) -> int:
        """Landing pages held now."""
        return self._runs.held

    def reserve(self, n: int) -> int | None:
        """The first of a free run of ``n`` landing pages, now reserved; None if none."""
        return self._runs.take(n)

    def give(self, first: int, n: int) -> None:
        """Hand a range back: no write of its room can land in it any more."""
        self._runs.give(first, n)

    def scatter(self, first: int, pages: npt.NDArray[np.integer]) -> None:
        """Copy landing pages ``[first, first + len(pages))`` into the pool's ``pages``,
        buffer by buffer: the landed room's bytes, where the scheduler asked for them."""
        dst = self._dst_views()
        n = len(pages)
        idx = pages.astype(np.intp, copy=False)
        for view, out in zip(self._views, dst, strict=True):
            out[idx] = view[first : first + n]

    def _dst_views(self) -> list[npt.NDArray[np.uint8]]:
        """numpy views ``(num_pages, page bytes)`` of the pool's KV buffers, with each
        buffer's page stride (made once)."""
        if not self._dst:
            pool = self.pool
            for b in range(pool.num_buffers):
                self._dst.append(buffer_view(
                    pool, b, (pool.num_pages, pool.item_lens[b]), (pool.strides[b], 1),
                    writeable=True,
                ))
        return self._dst


def fragmented(pages: npt.NDArray[np.integer], page_bytes: int, below: int) -> bool:
    """Whether ``pages`` are worth landing: more than one run of consecutive ids, and a mean
    run, in bytes of one buffer, below ``below``."""
    n = len(pages)
    if n < 2:
        return False
    runs = 1 + int(np.count_nonzero(np.diff(pages.astype(np.int64)) != 1))
    return runs > 1 and n * page_bytes < below * runs
