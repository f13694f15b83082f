"""Host-memory KV pools, page allocators with a lifetime sanitizer, and the deterministic
KV bytes the demo and the tests write and verify. (Pools in the memory of a CUDA device:
:mod:`trio_pd.testing.device`.)

The sanitizer (invariant I1 of docs/architecture.md: no write after release): a page handed
back to its allocator is *poisoned*; when it is handed out again the poison must still be
intact. A page whose poison changed was written after it
was released: a late write, counted in :attr:`PageAllocator.late_writes`. Source and
destination allocators use different poison bytes, so a destination page that received
source poison tells of a source use-after-free (a write that read released source pages).
"""

from __future__ import annotations

from collections import deque
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt
import trio

from .._memory import HOST, PoolSpec

#: poison byte of released source (prefill) pages and of released destination (decode) pages
SOURCE_POISON = 0x5A
DEST_POISON = 0xD6
AUX_ITEM_LEN = 64


class HostKVPool:
    """One rank's KV pool in host memory (numpy), and the :class:`PoolSpec` describing it.

    ``kv`` has shape (buffers, pages, page_size * heads * head_bytes); ``aux`` has shape
    (aux_slots, aux_item_len). Both stay alive as long as this object does.
    """

    def __init__(
        self,
        *,
        layout: Literal["mha", "mla"],
        num_pages: int,
        num_layers: int,
        page_size: int,
        head_bytes: int,
        heads: int = 1,
        first_head: int = 0,
        aux_slots: int = 256,
        aux_item_len: int = AUX_ITEM_LEN,
    ) -> None:
        buffers = 2 * num_layers if layout == "mha" else num_layers
        item_len = page_size * heads * head_bytes
        self.kv = np.zeros((buffers, num_pages, item_len), dtype=np.uint8)
        self.aux = np.zeros((aux_slots, aux_item_len), dtype=np.uint8)
        self.spec = PoolSpec(
            layout=layout,
            page_size=page_size,
            num_pages=num_pages,
            num_layers=num_layers,
            head_bytes=head_bytes,
            heads=heads,
            first_head=first_head,
            buffer_bases=tuple(int(self.kv[i].ctypes.data) for i in range(buffers)),
            aux_base=int(self.aux.ctypes.data),
            aux_item_len=aux_item_len,
            aux_slots=aux_slots,
            kinds=(HOST,) * (buffers + 1),  # numpy memory: host (staging may read it)
        )

    @property
    def nbytes(self) -> int:
        return int(self.kv.nbytes + self.aux.nbytes)

    def fill(self, pages: npt.NDArray[np.int64], room: int) -> None:
        """Write the request's deterministic KV bytes (for this rank's heads) into ``pages``;
        page i of the request goes to ``pages[i]``."""
        self.kv[:, pages, :] = kv_bytes(self.spec, room, len(pages))

    def expected(self, room: int, npages: int) -> npt.NDArray[np.uint8]:
        return kv_bytes(self.spec, room, npages)

    def fill_aux(self, slot: int, room: int) -> None:
        """Bytes 16.. of the row (0..15 are trio_pd's room/epoch stamp)."""
        self.aux[slot, 16:] = aux_bytes(room, self.aux.shape[1] - 16)

    def aux_ok(self, slot: int, room: int) -> bool:
        return bool((self.aux[slot, 16:] == aux_bytes(room, self.aux.shape[1] - 16)).all())


def kv_bytes(spec: PoolSpec, room: int, npages: int) -> npt.NDArray[np.uint8]:
    """The bytes of a request's first ``npages`` pages as held by a rank with ``spec``'s
    heads: a function of (room, buffer, page index in the request, token, global head, byte).
    Shape (buffers, npages, item_len).

    A per-position pattern XOR an 8-byte key of the room: a page of another room, another
    page of this room, another buffer, token or head all differ.
    """
    base = _position_pattern(spec, npages)
    key = np.frombuffer(
        (room * 0x9E3779B97F4A7C15 % (1 << 64) | 1).to_bytes(8, "little"), dtype=np.uint8
    )
    return base ^ np.resize(key, spec.item_len)


_PATTERNS: dict[tuple[int, ...], npt.NDArray[np.uint8]] = {}


def _position_pattern(spec: PoolSpec, npages: int) -> npt.NDArray[np.uint8]:
    key = (spec.num_buffers, spec.page_size, spec.first_head, spec.heads, spec.head_bytes)
    cached = _PATTERNS.get(key)
    if cached is None or cached.shape[1] < npages:
        n = max(npages, 64 if cached is None else 2 * cached.shape[1])
        b = np.arange(spec.num_buffers, dtype=np.int64)[:, None, None, None, None]
        p = np.arange(n, dtype=np.int64)[None, :, None, None, None]
        t = np.arange(spec.page_size, dtype=np.int64)[None, None, :, None, None]
        h = np.arange(spec.first_head, spec.first_head + spec.heads, dtype=np.int64)[
            None, None, None, :, None
        ]
        k = np.arange(spec.head_bytes, dtype=np.int64)[None, None, None, None, :]
        v = (b * 104729 + p * 257 + t * 31 + h * 61 + k * 3) % 251
        cached = v.astype(np.uint8).reshape(spec.num_buffers, n, spec.item_len)
        _PATTERNS[key] = cached
    return cached[:, :npages]


def aux_bytes(room: int, n: int) -> npt.NDArray[np.uint8]:
    return ((np.arange(n, dtype=np.int64) * 13 + room * 101) % 251).astype(np.uint8)


class Rows(Protocol):
    """The rows a :class:`PageAllocator` hands out, wherever they live: it poisons rows and
    asks whether their poison is intact."""

    @property
    def count(self) -> int:
        """How many rows there are."""
        ...

    def poison(self, ids: npt.NDArray[np.int64] | None, value: int) -> None:
        """Set every byte of rows ``ids`` (None: of every row) to ``value``."""
        ...

    def broken(self, ids: npt.NDArray[np.int64], value: int) -> int:
        """How many of rows ``ids`` hold a byte other than ``value``."""
        ...


class HostRows:
    """:class:`Rows` over axis 0 of a host array (whatever the shape of one row)."""

    def __init__(self, rows: npt.NDArray[np.uint8]) -> None:
        self.rows = rows

    @property
    def count(self) -> int:
        return int(self.rows.shape[0])

    def poison(self, ids: npt.NDArray[np.int64] | None, value: int) -> None:
        if ids is None:
            self.rows[...] = value
        else:
            self.rows[ids] = value

    def broken(self, ids: npt.NDArray[np.int64], value: int) -> int:
        intact = (self.rows[ids] == value).reshape(len(ids), -1).all(axis=1)
        return int(len(ids) - intact.sum())


class PageAllocator:
    """Hands out row indices of ``rows`` (axis 0 of a host array, or any :class:`Rows`, such
    as a device pool's) and takes them back, poisoning each returned row and checking the
    poison when it is handed out again.

    ``alloc`` waits while the pool is exhausted (the demo's natural back-pressure).
    """

    def __init__(
        self, rows: npt.NDArray[np.uint8] | Rows, poison: int, *, sanitize: bool = True
    ) -> None:
        self._rows: Rows = HostRows(rows) if isinstance(rows, np.ndarray) else rows
        self._poison = poison
        self._sanitize = sanitize
        self.capacity = self._rows.count
        self._free: deque[int] = deque(range(self.capacity))
        self._out: set[int] = set()
        self._freed = trio.Event()
        self.late_writes = 0
        if sanitize:
            self._rows.poison(None, poison)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def outstanding(self) -> int:
        return len(self._out)

    def _broken_poison(self, ids: npt.NDArray[np.int64]) -> int:
        """How many of these rows no longer hold their poison (were written after release)."""
        if not self._sanitize or not len(ids):
            return 0
        return self._rows.broken(ids, self._poison)

    def alloc_nowait(self, n: int) -> npt.NDArray[np.int64] | None:
        if n > len(self._free):
            return None
        ids = np.array([self._free.popleft() for _ in range(n)], dtype=np.int64)
        self.late_writes += self._broken_poison(ids)
        self._out.update(ids.tolist())
        return ids

    def late_in_free_rows(self) -> int:
        """Late writes into rows that are free now and were never handed out again (an audit
        at the end of a run; changes nothing)."""
        return self._broken_poison(np.fromiter(self._free, dtype=np.int64))

    async def alloc(self, n: int) -> npt.NDArray[np.int64]:
        """Allocate ``n`` rows, waiting until enough are free.

        **Cancellation:** nothing is allocated if cancelled.
        """
        if n > self.capacity:
            raise ValueError(f"asked for {n} rows of {self.capacity}")
        while (ids := self.alloc_nowait(n)) is None:
            await self._freed.wait()
        await trio.lowlevel.checkpoint()
        return ids

    async def wait_all_returned(self) -> None:
        """Wait until every row handed out has been freed.

        **Cancellation:** safe; nothing changes.
        """
        while self._out:
            await self._freed.wait()
        await trio.lowlevel.checkpoint()

    def free(self, ids: npt.NDArray[np.int64]) -> None:
        for i in ids.tolist():
            if i not in self._out:
                raise RuntimeError(f"row {i} freed twice or never allocated")
            self._out.discard(i)
        if self._sanitize and len(ids):
            self._rows.poison(ids, self._poison)
        self._free.extend(ids.tolist())
        self._freed.set()
        self._freed = trio.Event()


def page_rows(pool: HostKVPool) -> npt.NDArray[np.uint8]:
    """A view of ``pool.kv`` with pages on axis 0 (shape (pages, buffers, item_len))."""
    return pool.kv.transpose(1, 0, 2)
