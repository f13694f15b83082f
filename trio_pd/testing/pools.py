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
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt
import trio

from ..core._memory import HOST, PoolSpec, StateSpec

#: poison byte of released source (prefill) pages and of released destination (decode) pages
SOURCE_POISON = 0x5A
DEST_POISON = 0xD6
AUX_ITEM_LEN = 64


@dataclass(frozen=True)
class StateShape:
    """A state component of a test pool, as one TP rank holds it: ``item_lens`` bytes a
    slot, buffer by buffer, split as :class:`~trio_pd.StateSpec` says (``replicated``, or
    ``segments`` of ``(unit bytes, units)``: this rank's share)."""

    name: str
    item_lens: tuple[int, ...]
    replicated: bool = False
    segments: tuple[tuple[tuple[int, int], ...], ...] = ()

    def positions(self, buffer: int, tp_rank: int) -> npt.NDArray[np.int64]:
        """Where each byte of this rank's slot of ``buffer`` lies in the component's whole
        (unsplit) slot: what the bytes are a function of, so that prefill and decode ranks
        of other TP sizes agree on them. A rank-local slot is its rank's alone."""
        if not self.segments:
            offset = 0 if self.replicated else tp_rank << 40
            return offset + np.arange(self.item_lens[buffer], dtype=np.int64)
        parts = [
            (j << 44) + tp_rank * units * ub + np.arange(units * ub, dtype=np.int64)
            for j, (ub, units) in enumerate(self.segments[buffer])
        ]
        return np.concatenate(parts)


def state_bytes(
    room: int, component: int, buffer: int, index: int, positions: npt.NDArray[np.int64],
) -> npt.NDArray[np.uint8]:
    """The bytes of slot ``index`` of a request's slots of a state component, at these
    positions (:meth:`StateShape.positions`): another room, component, buffer, slot index
    or position all differ."""
    v = (positions * 2654435761 + room * 40503 + component * 97 + buffer * 193 + index * 389)
    return ((v >> 7) % 251).astype(np.uint8)


class HostKVPool:
    """One rank's KV pool in host memory (numpy), and the :class:`PoolSpec` describing it.

    ``kv`` has shape (buffers, pages, page_size * heads * head_bytes); ``aux`` has shape
    (aux_slots, aux_item_len). Both stay alive as long as this object does.

    Per-buffer geometry (:class:`PoolSpec`'s): ``page_layout="hnd"`` (head-major pages),
    ``buffer_head_bytes`` (bytes per head buffer by buffer: K and V of different sizes) and
    ``page_pad`` (bytes between one page's end and the next's start). Such a pool keeps each
    buffer in an array of its own (``buffers``; ``kv`` is None), and :meth:`read` /
    :meth:`expected` give a request's bytes in one logical form whatever the layout, shape
    (1, pages, bytes of a page over every buffer, token-major), so that pools of different
    layouts verify against each other.

    ``kv_dtype`` is the spec's :attr:`PoolSpec.kv_dtype` (what the bytes stand for; they are
    bytes here whatever it says).

    Several aux buffers: ``extra_aux_lens`` gives the row bytes of each aux buffer after the
    first (:attr:`PoolSpec.extra_aux`), kept in ``extra_aux``, one (aux_slots, row bytes)
    array each. :meth:`fill_aux` and :meth:`aux_ok` cover every aux buffer's row of a slot,
    and :meth:`aux_rows` makes a slot's row in every aux buffer one sanitizer row.
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
        page_layout: Literal["nhd", "hnd"] = "nhd",
        buffer_head_bytes: tuple[int, ...] = (),
        page_pad: int = 0,
        extra_aux_lens: tuple[int, ...] = (),
        first_layer: int = 0,
        model_layers: int | None = None,
        states: tuple[StateShape, ...] = (),
        state_slots: tuple[int, ...] = (),
        tp_rank: int = 0,
        kv_dtype: str = "unknown",
    ) -> None:
        buffers = 2 * num_layers if layout == "mha" else num_layers
        #: state components: their shapes, slots and, per component, one (slots, slot
        #: bytes) array per buffer; ``tp_rank`` is the rank whose share the slots hold
        self.state_shapes, self.tp_rank = states, tp_rank
        self.state_arrays = [
            [np.zeros((n, item), dtype=np.uint8) for item in shape.item_lens]
            for shape, n in zip(states, state_slots, strict=True)
        ]
        #: pipeline parallelism: the pool of a PP stage holds ``num_layers`` layers of a model
        #: of ``model_layers`` from ``first_layer``; its bytes are those of the model's buffers
        #: (None: the pool's own buffer ids, a pool of every layer)
        self.buffer_ids: tuple[int, ...] | None = None
        if first_layer or (model_layers is not None and model_layers != num_layers):
            total = num_layers if model_layers is None else model_layers
            ks = [first_layer + i for i in range(num_layers)]
            self.buffer_ids = tuple(ks + [total + k for k in ks] if layout == "mha" else ks)
        hbs = buffer_head_bytes or (head_bytes,) * buffers
        items = [page_size * heads * hb for hb in hbs]
        self.aux = np.zeros((aux_slots, aux_item_len), dtype=np.uint8)
        #: the aux buffers after the first, (aux_slots, row bytes) each
        self.extra_aux = [np.zeros((aux_slots, n), dtype=np.uint8) for n in extra_aux_lens]
        geometry = page_layout != "nhd" or len(set(hbs)) > 1 or page_pad > 0
        self._kv: npt.NDArray[np.uint8] | None = None
        self.buffers: list[npt.NDArray[np.uint8]]
        if geometry:
            strides = tuple(it + page_pad for it in items)
            self.buffers = [
                np.zeros((num_pages - 1) * st + it, dtype=np.uint8)
                for it, st in zip(items, strides, strict=True)
            ]
        else:
            strides = ()
            kv = np.zeros((buffers, num_pages, items[0]), dtype=np.uint8)
            self._kv = kv
            self.buffers = [kv[i].reshape(-1) for i in range(buffers)]
        self.spec = PoolSpec(
            layout=layout,
            page_size=page_size,
            num_pages=num_pages,
            num_layers=num_layers,
            head_bytes=head_bytes,
            heads=heads,
            first_head=first_head,
            buffer_bases=tuple(int(b.ctypes.data) for b in self.buffers),
            aux_base=int(self.aux.ctypes.data),
            aux_item_len=aux_item_len,
            aux_slots=aux_slots,
            page_layout=page_layout,
            buffer_head_bytes=tuple(buffer_head_bytes) if geometry else (),
            page_strides=strides if page_pad else (),
            extra_aux=tuple((int(a.ctypes.data), int(a.shape[1])) for a in self.extra_aux),
            states=tuple(
                StateSpec(
                    shape.name, int(arrays[0].shape[0]),
                    tuple((int(a.ctypes.data), int(a.shape[1])) for a in arrays),
                    shape.replicated, shape.segments,
                )
                for shape, arrays in zip(states, self.state_arrays, strict=True)
            ),
            kv_dtype=kv_dtype,
            # numpy memory: host (staging may read it)
            kinds=(HOST,) * (buffers + 1 + len(self.extra_aux)
                             + sum(len(a) for a in self.state_arrays)),
        )

    @property
    def kv(self) -> npt.NDArray[np.uint8]:
        """Every page of every buffer, (buffers, pages, item_len): a packed pool's memory.
        A pool with per-buffer geometry has no such array (:class:`ValueError`)."""
        if self._kv is None:
            raise ValueError("a pool with per-buffer geometry has no kv array: use buffers")
        return self._kv

    @property
    def nbytes(self) -> int:
        return int(sum(b.nbytes for b in self.buffers) + self.aux.nbytes
                   + sum(a.nbytes for a in self.extra_aux)
                   + sum(a.nbytes for arrays in self.state_arrays for a in arrays))

    def state_rows(self, component: int) -> Rows:
        """Slots of state component ``component`` as the rows of a :class:`PageAllocator`:
        row ``s`` is slot ``s`` of every buffer of the component."""
        arrays = self.state_arrays[component]
        return HostRows(arrays[0]) if len(arrays) == 1 else _BufferRows(arrays)

    def _state_want(self, c: int, b: int, i: int, room: int) -> npt.NDArray[np.uint8]:
        return state_bytes(room, c, b, i, self.state_shapes[c].positions(b, self.tp_rank))

    def fill_state(self, component: int, slots: npt.NDArray[np.int64], room: int) -> None:
        """Write the request's state bytes (this rank's share) into its ``slots`` of a
        component: slot ``slots[i]`` gets the request's slot ``i``."""
        for b, rows in enumerate(self.state_arrays[component]):
            for i, slot in enumerate(slots.tolist()):
                rows[slot] = self._state_want(component, b, i, room)

    def bad_state_slots(self, component: int, slots: npt.NDArray[np.int64], room: int) -> int:
        """How many of the request's ``slots`` of a component do not hold what
        :meth:`fill_state` writes for ``room`` (this rank's share), in some buffer."""
        bad = 0
        for i, slot in enumerate(slots.tolist()):
            bad += not all(
                bool((rows[slot] == self._state_want(component, b, i, room)).all())
                for b, rows in enumerate(self.state_arrays[component])
            )
        return bad

    def _pages(self, b: int) -> npt.NDArray[np.uint8]:
        """Buffer ``b`` as (pages, tokens, heads, head bytes), in logical (token-major)
        order: a strided view of the memory, whatever the page layout."""
        spec, buf = self.spec, self.buffers[b]
        hb = spec.head_bytes_of(b)
        T, H, stride = spec.page_size, spec.heads, spec.strides[b]
        if spec.page_layout == "nhd":
            shape, strides = (spec.num_pages, T, H, hb), (stride, H * hb, hb, 1)
        else:
            shape, strides = (spec.num_pages, T, H, hb), (stride, hb, T * hb, 1)
        return np.lib.stride_tricks.as_strided(buf, shape, strides, writeable=True)

    def fill(self, pages: npt.NDArray[np.int64], room: int) -> None:
        """Write the request's deterministic KV bytes (for this rank's heads) into ``pages``;
        page i of the request goes to ``pages[i]``."""
        if self._kv is not None:
            self.kv[:, pages, :] = kv_bytes(self.spec, room, len(pages), self.buffer_ids)
            return
        for b, want in enumerate(_logical_bytes(self.spec, room, len(pages), self.buffer_ids)):
            self._pages(b)[pages] = want

    def expected(self, room: int, npages: int) -> npt.NDArray[np.uint8]:
        if self._kv is not None:
            return kv_bytes(self.spec, room, npages, self.buffer_ids)
        items = self.spec.item_lens
        parts = [w.reshape(npages, items[b])
                 for b, w in enumerate(_logical_bytes(self.spec, room, npages, self.buffer_ids))]
        return np.concatenate(parts, axis=1)[None]

    def read(self, pages: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
        """What ``pages`` hold, in :meth:`expected`'s form."""
        if self._kv is not None:
            return self.kv[:, pages, :]
        items = self.spec.item_lens
        parts = [self._pages(b)[pages].reshape(len(pages), items[b])
                 for b in range(len(self.buffers))]
        return np.concatenate(parts, axis=1)[None]

    def page_rows(self) -> Rows:
        """The pool's pages as the rows of a :class:`PageAllocator` (every buffer's bytes of
        a page are its row)."""
        if self._kv is not None:
            return HostRows(page_rows(self))
        return _BufferRows([self._pages(b) for b in range(len(self.buffers))])

    def aux_rows(self) -> Rows:
        """The aux slots as the rows of a :class:`PageAllocator`: row ``s`` is slot ``s`` of
        every aux buffer (poisoned, and checked, in all of them)."""
        if not self.extra_aux:
            return HostRows(self.aux)
        return _BufferRows([self.aux, *self.extra_aux])

    def close(self) -> None:
        """Nothing to free: numpy owns the memory, which lives as long as this object."""

    def fill_aux(self, slot: int, room: int) -> None:
        """Bytes 16.. of the row (0..15 are trio_pd's room/epoch stamp), and every byte of
        the slot's row in each further aux buffer."""
        self.aux[slot, 16:] = aux_bytes(room, self.aux.shape[1] - 16)
        for i, rows in enumerate(self.extra_aux, start=1):
            rows[slot] = aux_bytes(room, rows.shape[1], buffer=i)

    def aux_ok(self, slot: int, room: int) -> bool:
        """Whether slot ``slot`` holds what :meth:`fill_aux` writes for ``room``, in every
        aux buffer (the stamp aside)."""
        if not (self.aux[slot, 16:] == aux_bytes(room, self.aux.shape[1] - 16)).all():
            return False
        return all(bool((rows[slot] == aux_bytes(room, rows.shape[1], buffer=i)).all())
                   for i, rows in enumerate(self.extra_aux, start=1))


def _logical_bytes(
    spec: PoolSpec, room: int, npages: int, buffer_ids: tuple[int, ...] | None = None
) -> list[npt.NDArray[np.uint8]]:
    """:func:`kv_bytes` for a pool with per-buffer geometry: buffer by buffer, shape (pages,
    tokens, heads, head bytes), the same pattern (a function of room, buffer, page index,
    token, global head and byte) a packed pool holds."""
    key = np.frombuffer(
        (room * 0x9E3779B97F4A7C15 % (1 << 64) | 1).to_bytes(8, "little"), dtype=np.uint8
    )
    p = np.arange(npages, dtype=np.int64)[:, None, None, None]
    t = np.arange(spec.page_size, dtype=np.int64)[None, :, None, None]
    h = np.arange(spec.first_head, spec.first_head + spec.heads, dtype=np.int64)[
        None, None, :, None
    ]
    out = []
    for b in range(spec.num_buffers):
        hb = spec.head_bytes_of(b)
        k = np.arange(hb, dtype=np.int64)[None, None, None, :]
        model_b = b if buffer_ids is None else buffer_ids[b]
        v = ((model_b * 104729 + p * 257 + t * 31 + h * 61 + k * 3) % 251).astype(np.uint8)
        out.append(v ^ key[(h * hb + k) % 8])  # (by global head and byte: see kv_bytes)
    return out


def kv_bytes(
    spec: PoolSpec, room: int, npages: int, buffer_ids: tuple[int, ...] | None = None
) -> npt.NDArray[np.uint8]:
    """The bytes of a request's first ``npages`` pages as held by a rank with ``spec``'s
    heads: a function of (room, buffer, page index in the request, token, global head, byte).
    Shape (buffers, npages, item_len).

    A per-position pattern XOR an 8-byte key of the room: a page of another room, another
    page of this room, another buffer, token or head all differ. ``buffer_ids``: the model's
    buffer id of each of the pool's buffers (a PP stage's pool: its layers' ids in a pool of
    every layer), so that a stage's bytes of layer l are decode's bytes of layer l.
    """
    base = _position_pattern(spec, npages, buffer_ids)
    key = np.frombuffer(
        (room * 0x9E3779B97F4A7C15 % (1 << 64) | 1).to_bytes(8, "little"), dtype=np.uint8
    )
    # the key byte by global head and byte, not by place in the page: a rank holding fewer
    # heads must see the same bytes for the heads it holds (by place in the page, head
    # bytes that are not a multiple of 8 gave each rank other bytes: false corruption)
    hb = spec.head_bytes
    h = np.arange(spec.first_head, spec.first_head + spec.heads)[None, :, None]
    where = (h * hb + np.arange(hb)[None, None, :]) % 8
    return base ^ key[np.broadcast_to(where, (spec.page_size, spec.heads, hb)).reshape(-1)]


_PATTERNS: dict[tuple[object, ...], npt.NDArray[np.uint8]] = {}


def _position_pattern(
    spec: PoolSpec, npages: int, buffer_ids: tuple[int, ...] | None = None
) -> npt.NDArray[np.uint8]:
    key = (spec.num_buffers, spec.page_size, spec.first_head, spec.heads, spec.head_bytes,
           buffer_ids)
    cached = _PATTERNS.get(key)
    if cached is None or cached.shape[1] < npages:
        n = max(npages, 64 if cached is None else 2 * cached.shape[1])
        ids = range(spec.num_buffers) if buffer_ids is None else buffer_ids
        b = np.array(ids, dtype=np.int64)[:, None, None, None, None]
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


def aux_bytes(room: int, n: int, buffer: int = 0) -> npt.NDArray[np.uint8]:
    """A request's ``n`` aux bytes for aux buffer ``buffer``: a function of (room, buffer,
    byte), so another room's row, or another buffer's, differs."""
    i = np.arange(n, dtype=np.int64)
    return ((i * 13 + room * 101 + buffer * 59) % 251).astype(np.uint8)


def extra_aux_lens(n: int) -> tuple[int, ...]:
    """Row bytes of ``n`` aux buffers after the first, as the demo's ``--aux-buffers`` makes
    them: 24, 41, 58... (all different, odd ones among them)."""
    return tuple(24 + 17 * i for i in range(n))


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


class _BufferRows:
    """:class:`Rows` whose row ``i`` is page ``i`` of every one of several arrays (the
    buffers of a pool with per-buffer geometry, as strided views)."""

    def __init__(self, buffers: list[npt.NDArray[np.uint8]]) -> None:
        self.buffers = buffers

    @property
    def count(self) -> int:
        return int(self.buffers[0].shape[0])

    def poison(self, ids: npt.NDArray[np.int64] | None, value: int) -> None:
        for buf in self.buffers:
            if ids is None:
                buf[...] = value
            else:
                buf[ids] = value

    def broken(self, ids: npt.NDArray[np.int64], value: int) -> int:
        intact = np.ones(len(ids), dtype=bool)
        for buf in self.buffers:
            intact &= (buf[ids] == value).reshape(len(ids), -1).all(axis=1)
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

        **Cancellation:** nothing is allocated if cancelled. The rows are taken only after
        the last point where a cancellation can land: what follows is a schedule point
        that is never cancelled, so rows taken are always returned to the caller.
        """
        if n > self.capacity:
            raise ValueError(f"asked for {n} rows of {self.capacity}")
        await trio.lowlevel.checkpoint_if_cancelled()
        while (ids := self.alloc_nowait(n)) is None:
            await self._freed.wait()
        await trio.lowlevel.cancel_shielded_checkpoint()
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
    """A view of ``pool.kv`` with pages on axis 0 (shape (pages, buffers, item_len)); a
    pool with per-buffer geometry has no such array (use :meth:`HostKVPool.page_rows`)."""
    return pool.kv.transpose(1, 0, 2)
