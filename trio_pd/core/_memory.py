"""The memory model: where memory lives (:class:`MemoryKind`), registered regions, a rank's
pool layout, the aux-row stamp, and the checks that page ids and planned writes stay inside
what was registered (SPEC §3, I8).

Pure: numpy and the standard library only (``ctypes`` for the aux stamp of a host row, which
trio_pd writes and reads in place). A device row goes through :mod:`trio_pd.io._cuda`, imported
only when a row or a buffer needs it. Nothing here imports trio, zmq, an engine adapter or the
trio layer; ``engines/_base.py`` imports :class:`Region` from here, never the reverse.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import operator
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import InitVar, dataclass, fields
from typing import Any, Final, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from ._errors import ConfigurationError, ProtocolError

_U64 = np.uint64
_U64_MAX: Final = int(np.iinfo(np.uint64).max)

#: Up to this many elements the hot-path helpers (here and in ``_plan``) work on Python lists,
#: where numpy's per-call overhead outweighs the work (docs/bench.md); above it, numpy. Both
#: paths give identical results (tested).
SMALL = 64
#: pools of at most this many pages check repeated page ids with a bitmap (one byte a page)
BITMAP_PAGES = 1 << 26


@dataclass(frozen=True, slots=True)
class MemoryKind:
    """Where a range of memory lives: host memory, or the memory of one CUDA device. Build one
    with :meth:`host` or :meth:`cuda`; ``str()`` gives ``"host"`` or ``"cuda:N"``."""

    #: None for host memory; else the CUDA device ordinal, as this process numbers its devices
    #: (after ``CUDA_VISIBLE_DEVICES``)
    device: int | None = None

    def __post_init__(self) -> None:
        d = self.device
        if d is not None and (type(d) is not int or d < 0):
            raise ConfigurationError(f"a CUDA device ordinal is an int >= 0, not {d!r}")

    @classmethod
    def host(cls) -> MemoryKind:
        return cls(None)

    @classmethod
    def cuda(cls, device: int = 0) -> MemoryKind:
        return cls(device)

    @property
    def is_device(self) -> bool:
        return self.device is not None

    def __str__(self) -> str:
        return "host" if self.device is None else f"cuda:{self.device}"


HOST: Final = MemoryKind.host()


@dataclass(frozen=True, slots=True)
class Region:
    """One registered memory range: [base, base + length), and where it lives.

    ``kind`` None means "not stated": an engine registers such a region as it always has
    (Mooncake finds the memory's location itself; NIXL uses the memory type it was built
    with). :meth:`PoolSpec.regions` states it whenever the pool's kinds are known.
    """

    base: int
    length: int
    kind: MemoryKind | None = None

    @property
    def end(self) -> int:
        return self.base + self.length


class _Geometry(NamedTuple):
    """A pool's per-buffer geometry, worked out from its fields once (:meth:`PoolSpec._geometry`):
    the planners ask for it on every chunk, for every destination."""

    head_bytes_all: tuple[int, ...]
    item_lens: tuple[int, ...]
    strides: tuple[int, ...]
    #: bytes of a page in every buffer; None where the buffers' pages differ in size
    item_len: int | None
    packed: bool


class _KindSlot:
    """Storage for :class:`PoolSpec`'s memory kinds and its geometry, made once (a cache of
    values that follow from its fields), outside its dataclass fields."""

    __slots__ = ("_geo", "_kinds")
    _kinds: tuple[MemoryKind, ...] | None
    _geo: _Geometry | None


MAX_STATE_NAME: Final = 64
MAX_POOL_PAGES: Final = 1 << 30
"""Bound of a pool's ``num_pages`` and of a request's ``prefix_pages``."""
MAX_REQUEST_STATE_SLOTS: Final = 1 << 17
"""Most state slots one request may name, over all its state components. They travel in
the TRANSFER's header, whose size is bounded (``_wire.MAX_HEADER_BYTES``, 2 MiB); at most
9 bytes each, 131,072 slots always fit. More is refused when the request is made
(:func:`check_state_slots`), not later, when its TRANSFER is sent."""
"""Longest :attr:`StateSpec.name`."""


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One state component of a pool: per-request state that is not paged KV, in buffers of
    its own indexed by *slot* (SGLang's state components: Mamba conv and SSM states, a
    sliding-window attention pool, NSA/DSA index pages).

    ``buffers`` are ``(base, slot bytes)`` pairs: buffer ``b`` holds ``slots`` slots, slot
    ``s`` at ``base + s * slot_bytes``. A request names its slots of each component (a Mamba
    request one slot, a sliding-window request its window's pages, an NSA request one index
    page per KV page); prefill's slot ``i`` is written to decode's slot ``i``, every buffer
    of the component, with the request's last chunk, and under the same rules as KV pages:
    the slots are the room's until its pages are released (leases, quarantine, the drain).

    How tensor parallelism splits a slot:

    * ``replicated=True``: every TP rank holds the same bytes (NSA index pages, like MLA's
      latent). Each decode rank's slots are written once, by one prefill rank, whole.
    * ``segments`` (one tuple per buffer): the slot is these segments in order, each
      ``units`` units of ``unit_bytes`` bytes, this rank's share of ``units * tp`` units (TP
      rank ``r`` holds units ``[r * units, (r + 1) * units)`` of each). A Mamba SSM state is
      one segment of heads; a conv state three (its x, B and C rows); a sliding-window page
      in head-major layout one segment of heads, in token-major layout one per token slot.
      Prefill and decode may then differ in TP size: each prefill rank writes the units it
      holds into the decode ranks that hold them.
    * neither: each rank's slot is its own, split in a way trio_pd is not told, so prefill
      and decode must have the same TP size (rank ``r`` writes rank ``r``); another pairing
      is refused at REGISTER.
    """

    name: str
    slots: int
    buffers: tuple[tuple[int, int], ...]
    replicated: bool = False
    segments: tuple[tuple[tuple[int, int], ...], ...] = ()

    def __post_init__(self) -> None:
        problem = _state_problem(self)
        if problem is not None:
            raise ConfigurationError(f"state component {self.name!r}: {problem}")

    @property
    def item_lens(self) -> tuple[int, ...]:
        """Bytes of one slot, buffer by buffer."""
        return tuple(n for _, n in self.buffers)

    @property
    def split(self) -> Literal["replicated", "segments", "rank"]:
        """How TP splits a slot (see the class docs)."""
        if self.replicated:
            return "replicated"
        return "segments" if self.segments else "rank"

    def regions(self, kinds: Sequence[MemoryKind | None] | None = None) -> list[Region]:
        """Each buffer's registered range, with ``kinds[b]`` if given."""
        ks = kinds or (None,) * len(self.buffers)
        return [Region(base, self.slots * n, k)
                for (base, n), k in zip(self.buffers, ks, strict=True)]


def _state_problem(state: StateSpec) -> str | None:
    """What is wrong with a state component's description, or None."""
    if not isinstance(state.name, str) or not 0 < len(state.name) <= MAX_STATE_NAME:
        return f"name must be a string of 1 to {MAX_STATE_NAME} characters"
    if type(state.slots) is not int or state.slots < 1:
        return f"slots must be a positive int, not {state.slots!r}"
    if type(state.replicated) is not bool:
        return f"replicated must be a bool, not {state.replicated!r}"
    if not isinstance(state.buffers, tuple) or not state.buffers:
        return "buffers must be a non-empty tuple of (base, slot bytes) pairs"
    for b, pair in enumerate(state.buffers):
        if (not isinstance(pair, tuple) or len(pair) != 2
                or any(type(v) is not int for v in pair) or pair[0] < 0 or pair[1] < 1):
            return f"buffers[{b}] must be (base, slot bytes): ints, base >= 0, bytes >= 1"
    if not isinstance(state.segments, tuple):
        return "segments must be a tuple (one tuple of (unit bytes, units) per buffer)"
    if state.segments:
        if state.replicated:
            return "a replicated slot is not split: give segments or replicated, not both"
        if len(state.segments) != len(state.buffers):
            return (f"segments: one tuple per buffer ({len(state.buffers)}), "
                    f"got {len(state.segments)}")
        for b, (segs, (_, n)) in enumerate(zip(state.segments, state.buffers, strict=True)):
            if not isinstance(segs, tuple) or not segs or any(
                not isinstance(g, tuple) or len(g) != 2
                or any(type(v) is not int or v < 1 for v in g) for g in segs
            ):
                return f"segments[{b}] must be a non-empty tuple of (unit bytes, units) pairs"
            total = sum(ub * u for ub, u in segs)
            if total != n:
                return (f"segments[{b}] cover {total} bytes, but a slot of buffer {b} has {n}")
    return None


#: :attr:`PoolSpec.kv_dtype` of a pool that does not say: never compared
UNKNOWN_DTYPE: Final = "unknown"
_DTYPE_ALIASES: Final = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
    "float": "float32", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
}
#: what a dtype name looks like (a peer's is checked against it too)
DTYPE_PATTERN: Final = r"[a-z][a-z0-9_]{0,31}"
_DTYPE_NAME: Final = re.compile(DTYPE_PATTERN)


def kv_dtype_name(dtype: object) -> str:
    """The name :attr:`PoolSpec.kv_dtype` compares for ``dtype``: a torch or numpy dtype, or a
    name (``torch.`` dropped, lower-cased, ``bf16``/``fp16``/``half``/``fp32``/``fp8_e4m3``/
    ``fp8_e5m2`` spelled out); ``"unknown"`` for None. :class:`ConfigurationError` for
    anything else."""
    if dtype is None:
        return UNKNOWN_DTYPE
    if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        name = np.dtype(dtype).name
    else:  # a name, or a torch.dtype (whose str is "torch.bfloat16")
        name = dtype if isinstance(dtype, str) else str(dtype)
    name = name.strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if _DTYPE_NAME.fullmatch(name) is None:
        raise ConfigurationError(f"kv_dtype {dtype!r} is not a dtype name")
    return name


@dataclass(frozen=True, slots=True)
class PoolSpec(_KindSlot):
    """The layout of one rank's KV pool and aux buffer, as registered with its engine.

    Buffers: MHA has one K and one V buffer per layer, ordered K[0..L-1] then V[0..L-1];
    MLA has one buffer per layer. Every buffer holds ``num_pages`` pages; a page of buffer
    ``i`` holds ``page_size`` tokens of ``heads`` heads of ``head_bytes_of(i)`` bytes each
    (:attr:`item_lens` ``[i]`` bytes in all) and page id ``p`` starts at
    ``buffer_bases[i] + p * strides[i]``.
    Inside a page, ``page_layout`` "nhd" (token-major, the default) puts global head ``h`` of
    token slot ``t`` at byte offset ``(t * heads + (h - first_head)) * hb``; "hnd"
    (head-major) at ``((h - first_head) * page_size + t) * hb``, so a head's tokens are
    contiguous. MLA: ``heads == 1`` and ``first_head == 0`` (the latent row is replicated on
    every rank). The aux buffer holds ``aux_slots`` rows of ``aux_item_len`` bytes at
    ``aux_base``; the first :data:`AUX_STAMP` bytes of each row are trio_pd's stamp.

    Several aux buffers (a serving engine's metadata buffers: output ids, logprobs, hidden
    states...): ``extra_aux`` lists the buffers after the first as ``(base, row bytes)``
    pairs, each with ``aux_slots`` rows, all indexed by the same aux slot. Aux slot ``s`` is
    row ``s`` of every aux buffer, and the last chunk of a request carries all of them. The
    stamp stays in the first buffer's row; the others are the caller's bytes alone (empty,
    the default: one aux buffer, as before). :attr:`aux_bases` and :attr:`aux_item_lens`
    give every aux buffer, the first included.

    Per-buffer geometry, for models whose buffers differ: ``buffer_head_bytes`` gives each
    buffer its own bytes per head (K and V of different head sizes, layers of different
    widths; empty: every buffer has ``head_bytes``), and ``page_strides`` each buffer's
    distance between consecutive pages when it is more than a page (empty: pages are packed).

    State components (:class:`StateSpec`: Mamba states, a sliding-window pool, NSA index
    pages): ``states`` lists them; each request names its slots of each, and they travel
    with its last chunk (empty, the default: a pool of KV and aux rows alone).

    ``kv_dtype`` names what the KV bytes hold (``"bfloat16"``, ``"float16"``,
    ``"float8_e4m3fn"``...; :func:`kv_dtype_name` normalises ``torch.bfloat16``, ``"bf16"``,
    a numpy dtype). Two pools that both name one must name the same to pair: the same bytes
    per head of another dtype are garbage. ``"unknown"`` (the default) skips that check, so
    pools that say nothing pair as before.

    ``kinds`` says where each region of :meth:`regions` lives, in that order: one
    :class:`MemoryKind` per KV buffer, then one per aux buffer (the first, then each of
    ``extra_aux``), then one per buffer of each state component (a pool may mix them: KV
    buffers on a device, the aux buffers on the host or on the device). None (the default)
    leaves them unstated: the regions go to the engine without a kind and the aux row is read and
    written as host memory, as for every pool before kinds existed.
    :func:`describe_pool` states them for the buffers it is given. Kinds are facts about this
    process's memory, not part of the layout a peer is told: they are no dataclass field, so
    the wire form (built field by field), ``==`` and ``repr`` are the layout's alone.
    ``dataclasses.replace`` does not carry them over: pass ``kinds=spec.region_kinds`` again.
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
    page_layout: Literal["nhd", "hnd"] = "nhd"
    buffer_head_bytes: tuple[int, ...] = ()
    page_strides: tuple[int, ...] = ()
    extra_aux: tuple[tuple[int, int], ...] = ()
    states: tuple[StateSpec, ...] = ()
    kv_dtype: str = UNKNOWN_DTYPE
    kinds: InitVar[Sequence[MemoryKind] | None] = None

    def __post_init__(self, kinds: Sequence[MemoryKind] | None) -> None:
        object.__setattr__(self, "_geo", None)  # (made on first use: _geometry)
        object.__setattr__(self, "kv_dtype", kv_dtype_name(self.kv_dtype))
        problem = _geometry_problem(self) or _extra_aux_problem(self.extra_aux)
        if problem is None and (not isinstance(self.states, tuple) or not all(
            isinstance(st, StateSpec) for st in self.states
        )):
            problem = "states must be a tuple of StateSpec"
        if problem is None and len({st.name for st in self.states}) != len(self.states):
            problem = "state components need distinct names"
        if problem is not None:
            raise ConfigurationError(problem)
        stated: tuple[MemoryKind, ...] | None = None
        if kinds is not None:
            stated = tuple(kinds)
            n_state = self.num_state_buffers
            if len(stated) != len(self.buffer_bases) + 1 + len(self.extra_aux) + n_state:
                raise ConfigurationError(
                    f"kinds: one per KV buffer ({len(self.buffer_bases)}), one per aux "
                    f"buffer ({1 + len(self.extra_aux)}) and one per state buffer "
                    f"({n_state}), got {len(stated)}"
                )
            if not all(isinstance(k, MemoryKind) for k in stated):
                raise ConfigurationError(f"kinds must be MemoryKind values, got {stated!r}")
        object.__setattr__(self, "_kinds", stated)

    # frozen + slots: pickling and copying go through these, so the kinds travel too
    def __getstate__(self) -> tuple[object, ...]:
        return (*(getattr(self, f) for f in _SPEC_FIELDS), self._kinds)

    def __setstate__(self, state: tuple[object, ...]) -> None:
        for name, value in zip((*_SPEC_FIELDS, "_kinds"), state, strict=True):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_geo", None)  # (made again from the fields it now has)

    def _geometry(self) -> _Geometry:
        """:attr:`head_bytes_all`, :attr:`item_lens`, :attr:`strides`, :attr:`item_len` and
        :attr:`packed`, worked out on first use and kept: they follow from fields a frozen
        pool never changes, and a chunk's plan asks for them per destination."""
        geo = self._geo
        if geo is None:
            geo = _geometry_of(self)
            object.__setattr__(self, "_geo", geo)
        return geo

    @property
    def region_kinds(self) -> tuple[MemoryKind, ...] | None:
        """The stated kind of each region of :meth:`regions` (KV buffers, then the aux
        buffers, then the state buffers), or None."""
        return self._kinds

    @property
    def num_state_buffers(self) -> int:
        """How many buffers the state components have in all."""
        return sum(len(st.buffers) for st in self.states)

    def state_kinds(self, component: int) -> tuple[MemoryKind | None, ...]:
        """The stated kind of each buffer of state component ``component`` (None each when
        the pool's kinds are unstated)."""
        sizes = [len(st.buffers) for st in self.states]
        if self._kinds is None:
            return (None,) * sizes[component]
        start = len(self.buffer_bases) + self.num_aux + sum(sizes[:component])
        return self._kinds[start : start + sizes[component]]

    @property
    def aux_kind(self) -> MemoryKind | None:
        """Where the (first) aux buffer, the one with the stamp, lives, if stated."""
        return None if self._kinds is None else self._kinds[len(self.buffer_bases)]

    @property
    def num_aux(self) -> int:
        """How many aux buffers the pool has: the first and each of ``extra_aux``."""
        return 1 + len(self.extra_aux)

    @property
    def aux_bases(self) -> tuple[int, ...]:
        """Where each aux buffer starts, the first (``aux_base``) first."""
        return (self.aux_base, *(base for base, _ in self.extra_aux))

    @property
    def aux_item_lens(self) -> tuple[int, ...]:
        """Bytes of one row of each aux buffer, the first (``aux_item_len``) first."""
        return (self.aux_item_len, *(n for _, n in self.extra_aux))

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token slot in one buffer (a pool whose buffers all have
        ``head_bytes``)."""
        return self.heads * self.head_bytes

    @property
    def item_len(self) -> int:
        """Bytes of one page in one buffer, for a pool whose buffers all have the same;
        :class:`ValueError` otherwise (use :attr:`item_lens`)."""
        item = self._geometry().item_len
        if item is None:
            raise ValueError("the pool's buffers differ in page size: use item_lens")
        return item

    @property
    def num_buffers(self) -> int:
        return len(self.buffer_bases)

    def head_bytes_of(self, buffer: int) -> int:
        """Bytes of one head of one token in buffer ``buffer``."""
        return self.buffer_head_bytes[buffer] if self.buffer_head_bytes else self.head_bytes

    @property
    def head_bytes_all(self) -> tuple[int, ...]:
        """Bytes per head, buffer by buffer."""
        return self._geometry().head_bytes_all

    @property
    def item_lens(self) -> tuple[int, ...]:
        """Bytes of one page, buffer by buffer."""
        return self._geometry().item_lens

    @property
    def strides(self) -> tuple[int, ...]:
        """Bytes from one page's start to the next's, buffer by buffer."""
        return self._geometry().strides

    @property
    def packed(self) -> bool:
        """Token-major pages of one size in every buffer, packed: the layout whose plans
        take the fast path (``_plan.plan_pages``)."""
        return self._geometry().packed

    def buffer_length(self, buffer: int) -> int:
        """Bytes buffer ``buffer`` spans: from its base to the end of its last page."""
        return (self.num_pages - 1) * self.strides[buffer] + self.item_lens[buffer]

    def regions(self) -> list[Region]:
        """Every registered range: the KV buffers, then the aux buffers (the first, then each
        of ``extra_aux``), then each state component's buffers, each with its stated kind
        (None when the pool's kinds are unstated)."""
        n = len(self.buffer_bases)
        kinds = self._kinds or (None,) * (n + self.num_aux)
        kv = [
            Region(b, self.buffer_length(i), kinds[i]) for i, b in enumerate(self.buffer_bases)
        ]
        aux = [
            Region(base, self.aux_slots * row, kinds[n + j])
            for j, (base, row) in enumerate(zip(self.aux_bases, self.aux_item_lens, strict=True))
        ]
        states = [r for c, st in enumerate(self.states) for r in st.regions(self.state_kinds(c))]
        return [*kv, *aux, *states]


def _geometry_of(spec: PoolSpec) -> _Geometry:
    """What :meth:`PoolSpec._geometry` keeps, from the pool's fields."""
    bhb = spec.buffer_head_bytes
    head_bytes_all = bhb or (spec.head_bytes,) * len(spec.buffer_bases)
    per = spec.page_size * spec.heads
    item_lens = tuple(per * hb for hb in head_bytes_all)
    same = not bhb or len(set(bhb)) == 1
    return _Geometry(
        head_bytes_all=head_bytes_all,
        item_lens=item_lens,
        strides=spec.page_strides or item_lens,
        item_len=per * (bhb[0] if bhb else spec.head_bytes) if same else None,
        packed=(
            spec.page_layout == "nhd" and same
            and (not spec.page_strides or spec.page_strides == item_lens)
        ),
    )


def _geometry_problem(spec: PoolSpec) -> str | None:
    """What is wrong with a pool's per-buffer geometry, or None."""
    if spec.page_layout not in ("nhd", "hnd"):
        return f"page_layout must be 'nhd' or 'hnd', not {spec.page_layout!r}"
    n = len(spec.buffer_bases)
    for name in ("buffer_head_bytes", "page_strides"):
        values = getattr(spec, name)
        if not isinstance(values, tuple):
            return f"{name} must be a tuple of ints, not {values!r}"
        if values and len(values) != n:
            return f"{name}: one per KV buffer ({n}) or none, got {len(values)}"
        if any(type(v) is not int or v < 1 for v in values):
            return f"{name} must be positive ints, got {values!r}"
    if spec.page_strides:
        per = spec.page_size * spec.heads
        items = [per * hb for hb in (spec.buffer_head_bytes or (spec.head_bytes,) * n)]
        short = [i for i, (s, it) in enumerate(zip(spec.page_strides, items, strict=True))
                 if s < it]
        if short:
            i = short[0]
            return (f"page_strides[{i}] is {spec.page_strides[i]} bytes, less than the "
                    f"{items[i]}-byte page of buffer {i}")
    return None


def _extra_aux_problem(extra: object) -> str | None:
    """What is wrong with a pool's ``extra_aux`` (``(base, row bytes)`` pairs), or None."""
    if not isinstance(extra, tuple):
        return f"extra_aux must be a tuple of (base, row bytes) pairs, not {extra!r}"
    for i, pair in enumerate(extra):
        if (
            not isinstance(pair, tuple) or len(pair) != 2
            or any(type(v) is not int for v in pair) or pair[0] < 0 or pair[1] < 1
        ):
            return (f"extra_aux[{i}] must be (base, row bytes): ints, the base >= 0 and the "
                    f"row bytes >= 1; got {pair!r}")
    return None


_SPEC_FIELDS: Final = tuple(f.name for f in fields(PoolSpec))


# --------------------------------------------------------------------------------------------
# Pipeline parallelism: a pool's buffers of a range of layers
# --------------------------------------------------------------------------------------------


def layer_buffers(layout: str, num_layers: int, first: int, count: int) -> list[int]:
    """The buffer indices, in buffer order, of layers ``[first, first + count)`` of a pool of
    ``num_layers`` layers: MHA K[first..] then V[first..] (its buffers are K[0..L-1] then
    V[0..L-1]); MLA one per layer. :class:`ValueError` if the range is not inside."""
    if not (first >= 0 and count >= 1 and first + count <= num_layers):
        raise ValueError(
            f"layers {first}..{first + count - 1} are not inside a pool of {num_layers} layers"
        )
    ks = list(range(first, first + count))
    return ks + [num_layers + k for k in ks] if layout == "mha" else ks


def layer_view(spec: PoolSpec, first: int, count: int) -> PoolSpec:
    """``spec`` restricted to layers ``[first, first + count)``: the same pool (pages, heads,
    aux buffers), holding only those layers' buffers, in the order a pool of ``count`` layers
    keeps them (:func:`layer_buffers`). A prefill PP stage plans its writes against such a
    view of decode's pool, so that its layer ``i`` lands in decode's layer ``first + i``
    (docs/topologies.md, "Pipeline parallelism"); what it writes is still checked against
    decode's *full* registered regions. ``spec`` itself when the range is all its layers.
    The view's memory kinds are ``spec``'s, buffer by buffer."""
    if first == 0 and count == spec.num_layers:
        return spec
    picks = layer_buffers(spec.layout, spec.num_layers, first, count)
    values = {f: getattr(spec, f) for f in _SPEC_FIELDS}
    values.update(
        num_layers=count,
        buffer_bases=tuple(spec.buffer_bases[b] for b in picks),
        buffer_head_bytes=tuple(spec.buffer_head_bytes[b] for b in picks)
        if spec.buffer_head_bytes else (),
        page_strides=tuple(spec.page_strides[b] for b in picks) if spec.page_strides else (),
    )
    kinds = spec.region_kinds
    view_kinds = None
    if kinds is not None:
        n = spec.num_buffers
        view_kinds = [kinds[b] for b in picks] + list(kinds[n:])
    return PoolSpec(**values, kinds=view_kinds)


# --------------------------------------------------------------------------------------------
# Describing buffers the caller allocated
# --------------------------------------------------------------------------------------------


def buffer_region(buffer: object, kind: MemoryKind | None = None) -> Region:
    """The :class:`Region` a caller's buffer occupies, and where it lives. ``buffer`` is:

    * a :class:`Region` (its kind replaced by ``kind`` if that is given);
    * ``(address, nbytes)``: a raw pointer and a size;
    * an object with ``data_ptr()`` (a PyTorch-style tensor): its size from ``nbytes``, or
      ``numel() * element_size()``; where it lives from ``device.type`` and ``device.index``
      when it has them;
    * an object with ``__cuda_array_interface__`` (CuPy, Numba, ...);
    * an object with ``__array_interface__`` (a NumPy array: host memory).

    No framework is imported: the object is only asked for these attributes. It must be
    contiguous and not empty. Where nothing says where it lives (a raw pointer, a CUDA array
    interface, which names no device) the pointer is classified with
    ``cudaPointerGetAttributes`` (:func:`trio_pd.io._cuda.classify`); without cuda-python a raw
    pointer counts as host memory, and a CUDA array interface is refused: pass ``kind``,
    which overrides all of the above. Raises :class:`~trio_pd.ConfigurationError` for a buffer
    it cannot describe.
    """
    if isinstance(buffer, Region):
        return _region(buffer.base, buffer.length,
                       kind or buffer.kind or _classify(buffer.base, buffer))
    if isinstance(buffer, tuple):
        try:
            base, nbytes = (operator.index(v) for v in buffer)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"a raw buffer is (address, nbytes), two ints; got {buffer!r}"
            ) from exc
        return _region(base, nbytes, kind or _classify(base, buffer))
    device = getattr(buffer, "device", None)
    stated = _stated_kind(device)
    data_ptr = getattr(buffer, "data_ptr", None)
    if callable(data_ptr) and (stated is not None or kind is not None):
        return _region(int(data_ptr()), _tensor_nbytes(buffer), kind or stated or HOST)
    cai = getattr(buffer, "__cuda_array_interface__", None)
    if isinstance(cai, dict):
        base, nbytes = _interface_extent(cai, "__cuda_array_interface__")
        return _region(base, nbytes, kind or _classify(base, buffer, required=True))
    if callable(data_ptr):
        base = int(data_ptr())
        return _region(base, _tensor_nbytes(buffer), _classify(base, buffer))
    ai = getattr(buffer, "__array_interface__", None)
    if isinstance(ai, dict):
        base, nbytes = _interface_extent(ai, "__array_interface__")
        return _region(base, nbytes, kind or HOST)
    raise ConfigurationError(
        f"cannot describe a buffer of type {type(buffer).__name__}: give (address, nbytes), "
        "a Region, or an object with data_ptr(), __cuda_array_interface__ or "
        "__array_interface__"
    )


def _region(base: int, nbytes: int, kind: MemoryKind) -> Region:
    if base <= 0 or nbytes <= 0:
        raise ConfigurationError(f"a buffer needs an address and a size, got {base:#x}, {nbytes}")
    return Region(base, nbytes, kind)


def _stated_kind(device: object) -> MemoryKind | None:
    """The kind a PyTorch-style ``device`` attribute states (``type`` "cuda" or "cpu")."""
    kind = getattr(device, "type", None)
    if kind == "cpu":
        return HOST
    index = getattr(device, "index", None)
    if kind == "cuda" and type(index) is int:
        return MemoryKind.cuda(index)
    return None


def _tensor_nbytes(buffer: Any) -> int:
    is_contiguous = getattr(buffer, "is_contiguous", None)
    if callable(is_contiguous) and not is_contiguous():
        raise ConfigurationError("the buffer is not contiguous")
    nbytes = getattr(buffer, "nbytes", None)
    if nbytes is None:
        nbytes = buffer.numel() * buffer.element_size()
    return int(nbytes)


def _interface_extent(iface: dict[str, Any], name: str) -> tuple[int, int]:
    """Address and size of the memory an array interface describes; refuse strided ones."""
    try:
        base = int(iface["data"][0])
        shape = tuple(int(n) for n in iface["shape"])
        itemsize = np.dtype(iface["typestr"]).itemsize
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ConfigurationError(f"malformed {name}: {iface!r}") from exc
    if iface.get("mask") is not None:
        raise ConfigurationError(f"a masked {name} cannot be a pool buffer")
    strides = iface.get("strides")
    if strides is not None:
        want, step = [], itemsize
        for n in reversed(shape):
            want.append(step)
            step *= n
        if any(n > 1 and s != w for n, s, w in zip(shape, strides, reversed(want), strict=True)):
            raise ConfigurationError(f"the buffer is not contiguous ({name} strides {strides})")
    return base, math.prod(shape) * itemsize


def _classify(base: int, buffer: object, *, required: bool = False) -> MemoryKind:
    from ..io._cuda import classify, runtime

    if required and runtime() is None:
        raise ConfigurationError(
            f"a {type(buffer).__name__} with __cuda_array_interface__ names no device, and "
            "without cuda-python trio_pd cannot ask CUDA which: pass kind=MemoryKind.cuda(N)"
        )
    return classify(base)


def describe_pool(
    *,
    layout: Literal["mha", "mla"],
    page_size: int,
    num_layers: int,
    head_bytes: int,
    buffers: Sequence[object],
    aux: object,
    aux_item_len: int,
    heads: int = 1,
    first_head: int = 0,
    num_pages: int | None = None,
    aux_slots: int | None = None,
    kv_kind: MemoryKind | None = None,
    aux_kind: MemoryKind | None = None,
    page_layout: Literal["nhd", "hnd"] = "nhd",
    buffer_head_bytes: Sequence[int] = (),
    page_strides: Sequence[int] = (),
    extra_aux: Sequence[tuple[object, int]] = (),
    states: Sequence[StateSpec] = (),
    state_kind: MemoryKind | None = None,
    kv_dtype: object = None,
) -> PoolSpec:
    """The :class:`PoolSpec` of KV and aux buffers the caller allocated (a serving engine's
    own cache), with every region's :class:`MemoryKind` stated.

    ``buffers`` are the KV buffers in :class:`PoolSpec`'s order (MHA: K of every layer, then V
    of every layer; MLA: one per layer) and ``aux`` the aux buffer, each anything
    :func:`buffer_region` takes; ``kv_kind`` / ``aux_kind`` override where they are found to
    live (``aux_kind`` for every aux buffer). ``extra_aux`` are more aux buffers, each
    ``(buffer, row bytes)`` (:attr:`PoolSpec.extra_aux`: a serving engine's other metadata
    buffers, indexed by the same aux slot; no stamp in their rows). ``states`` are the pool's
    state components (:class:`StateSpec`, whose buffers are raw addresses); where their
    buffers live is found as for a raw pointer, or is ``state_kind``. ``num_pages`` defaults to
    the pages the smallest KV buffer holds, ``aux_slots`` to the rows the smallest aux buffer
    holds. ``page_layout``, ``buffer_head_bytes`` and
    ``page_strides`` are :class:`PoolSpec`'s (head-major pages; bytes per head and the
    distance between pages, buffer by buffer). ``kv_dtype`` is :attr:`PoolSpec.kv_dtype`
    (a dtype or its name); left out, it is the KV buffers' own ``dtype`` when they all have
    the same one and it is not a byte type (``uint8``/``int8``: a byte view, or fp8 stored as
    bytes, says nothing), else ``"unknown"``. Raises :class:`~trio_pd.ConfigurationError`
    when the
    buffers cannot hold that layout: a wrong number of buffers, one too small for
    ``num_pages`` pages, aux rows shorter than trio_pd's 16-byte stamp, or overlapping
    buffers (two writes could land on one byte).
    """
    per_layer = 2 if layout == "mha" else 1
    if layout not in ("mha", "mla"):
        raise ConfigurationError(f"layout must be 'mha' or 'mla', not {layout!r}")
    for name, value in (("page_size", page_size), ("num_layers", num_layers),
                        ("head_bytes", head_bytes), ("heads", heads),
                        ("aux_item_len", aux_item_len)):
        if type(value) is not int or value < 1:
            raise ConfigurationError(f"{name} must be a positive int, not {value!r}")
    if layout == "mla" and (heads != 1 or first_head != 0):
        raise ConfigurationError("an mla pool has heads=1 and first_head=0")
    if len(buffers) != per_layer * num_layers:
        raise ConfigurationError(
            f"a {layout} pool of {num_layers} layers has {per_layer * num_layers} KV buffers, "
            f"got {len(buffers)}"
        )
    if aux_item_len < AUX_STAMP.size:
        raise ConfigurationError(
            f"aux rows of {aux_item_len} bytes cannot hold trio_pd's {AUX_STAMP.size}-byte stamp"
        )
    for j, pair in enumerate(extra_aux, start=1):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ConfigurationError(f"aux buffer {j}: give (buffer, row bytes), not {pair!r}")
        if type(pair[1]) is not int or pair[1] < 1:
            raise ConfigurationError(f"aux buffer {j}: row bytes must be a positive int, "
                                     f"not {pair[1]!r}")
    kv = [buffer_region(b, kv_kind) for b in buffers]
    aux_region = buffer_region(aux, aux_kind)
    extras = [(buffer_region(b, aux_kind), n) for b, n in extra_aux]
    state_regions = [
        buffer_region((base, st.slots * n), state_kind)
        for st in states for base, n in st.buffers
    ]
    shape = PoolSpec(  # (the geometry alone, checked: sizes below come from it)
        layout=layout, page_size=page_size, num_pages=1, num_layers=num_layers,
        head_bytes=head_bytes, heads=heads, first_head=first_head,
        buffer_bases=tuple(r.base for r in kv), aux_base=aux_region.base,
        aux_item_len=aux_item_len, aux_slots=1, page_layout=page_layout,
        buffer_head_bytes=tuple(buffer_head_bytes), page_strides=tuple(page_strides),
    )
    items, strides = shape.item_lens, shape.strides
    if num_pages is None:
        pages = min((r.length - it) // st + 1 if r.length >= it else 0
                    for r, it, st in zip(kv, items, strides, strict=True))
    else:
        pages = num_pages
    slots = aux_slots
    if slots is None:
        slots = min([aux_region.length // aux_item_len, *(r.length // n for r, n in extras)])
    if type(pages) is not int or pages < 1:
        raise ConfigurationError(f"the KV buffers hold no whole page of {max(items)} bytes")
    if type(slots) is not int or slots < 1:
        raise ConfigurationError(f"the aux buffer holds no whole row of {aux_item_len} bytes")
    spans = [(pages - 1) * st + it for it, st in zip(items, strides, strict=True)]
    for i, r in enumerate(kv):
        if r.length < spans[i]:
            raise ConfigurationError(
                f"KV buffer {i} has {r.length} bytes, fewer than {pages} pages of "
                f"{items[i]} every {strides[i]} bytes"
            )
    if aux_region.length < slots * aux_item_len:
        raise ConfigurationError(
            f"the aux buffer has {aux_region.length} bytes, fewer than {slots} rows of "
            f"{aux_item_len}"
        )
    for j, (r, n) in enumerate(extras, start=1):
        if r.length < slots * n:
            raise ConfigurationError(
                f"aux buffer {j} has {r.length} bytes, fewer than {slots} rows of {n}"
            )
    used = sorted([(r.base, r.base + span) for r, span in zip(kv, spans, strict=True)]
                  + [(aux_region.base, aux_region.base + slots * aux_item_len)]
                  + [(r.base, r.base + slots * n) for r, n in extras]
                  + [(r.base, r.end) for r in state_regions])
    for (_, end), (start, _) in itertools.pairwise(used):
        if start < end:
            raise ConfigurationError(f"pool buffers overlap at {start:#x}")
    return PoolSpec(
        layout=layout, page_size=page_size, num_pages=pages, num_layers=num_layers,
        head_bytes=head_bytes, heads=heads, first_head=first_head,
        buffer_bases=tuple(r.base for r in kv), aux_base=aux_region.base,
        aux_item_len=aux_item_len, aux_slots=slots, page_layout=page_layout,
        buffer_head_bytes=tuple(buffer_head_bytes), page_strides=tuple(page_strides),
        extra_aux=tuple((r.base, n) for r, n in extras), states=tuple(states),
        kv_dtype=_buffers_dtype(buffers) if kv_dtype is None else kv_dtype_name(kv_dtype),
        kinds=(*(r.kind or HOST for r in kv), aux_region.kind or HOST,
               *(r.kind or HOST for r, _ in extras), *(r.kind or HOST for r in state_regions)),
    )


def _buffers_dtype(buffers: Sequence[object]) -> str:
    """The dtype every one of ``buffers`` (tensors, arrays) has, by name, unless it is a byte
    type or they differ or do not say: then ``"unknown"`` (see :func:`describe_pool`)."""
    names = {kv_dtype_name(d) for b in buffers if (d := getattr(b, "dtype", None)) is not None}
    if len(names) != 1 or len(buffers) != sum(hasattr(b, "dtype") for b in buffers):
        return UNKNOWN_DTYPE
    (name,) = names
    return UNKNOWN_DTYPE if name in ("uint8", "int8") else name


# --------------------------------------------------------------------------------------------
# The aux row
# --------------------------------------------------------------------------------------------

#: bytes 0..15 of every aux row are trio_pd's: (room, epoch) as little-endian int64, so decode
#: can tell a row that belongs to someone else (SPEC §3).
AUX_STAMP: Final = struct.Struct("<qq")
#: the stamp's bytes in place, as a ctypes type over a host address. Reading or writing
#: through it does not release the GIL, as ``ctypes.memmove`` / ``string_at`` (foreign calls)
#: do: on the loop's thread that release hands the GIL to a waiting engine thread and costs a
#: switch back, several times the copy itself, on every room's last chunk and its check
_STAMP_BYTES: Final = ctypes.c_char * AUX_STAMP.size


def aux_row_address(pool: PoolSpec, slot: int, buffer: int = 0) -> int:
    """The address of aux row ``slot`` of ``pool``'s aux buffer ``buffer`` (0: the first, the
    one with the stamp; ``i >= 1``: ``extra_aux[i - 1]``). The slot is not checked: callers
    use slots they allocated, or checked (:func:`~trio_pd.core._plan.plan_aux`)."""
    if buffer == 0:
        return pool.aux_base + slot * pool.aux_item_len
    base, row = pool.extra_aux[buffer - 1]
    return base + slot * row


def stamp_aux_row(pool: PoolSpec, slot: int, room: int, epoch: int) -> None:
    """Write the :data:`AUX_STAMP` ``(room, epoch)`` into the first bytes of aux row ``slot``,
    in place. The row must be memory this process owns (the prefill side's own pool).

    A host row is written with ``ctypes``; a row on a CUDA device (the pool's
    :attr:`~PoolSpec.aux_kind`) with a device copy that has landed when this returns, so the
    engine call that follows reads the stamp. Raises :class:`~trio_pd.EngineError` if the
    copy fails."""
    address, stamp = aux_row_address(pool, slot), AUX_STAMP.pack(room, epoch)
    kind = pool.aux_kind
    if kind is not None and kind.device is not None:
        from ..io._cuda import write

        write(address, stamp, kind.device)
    else:
        _STAMP_BYTES.from_address(address).raw = stamp


def read_aux_stamp(pool: PoolSpec, slot: int) -> tuple[int, int]:
    """The ``(room, epoch)`` :data:`AUX_STAMP` at the start of aux row ``slot``, read in place
    (from a CUDA device with a device copy when the pool's aux buffer lives there)."""
    # (aux_row_address and aux_kind, inline: once a request on the event loop)
    address = pool.aux_base + slot * pool.aux_item_len
    kind = pool.aux_kind
    if kind is not None and kind.device is not None:
        from ..io._cuda import read

        raw = read(address, AUX_STAMP.size, kind.device)
    else:
        raw = _STAMP_BYTES.from_address(address).raw
    room, epoch = AUX_STAMP.unpack(raw)
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


def as_index(value: object, what: str) -> int:
    """``value`` (a slot, a count, a room id) as an int: a Python or numpy integer, not a
    bool, and not a float or a string, which ``int()`` would truncate or parse. Raises
    :class:`~trio_pd.ProtocolError` naming ``what``."""
    if type(value) is int:  # (the common case, with no call: a bool's type is bool)
        return value
    if not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise ProtocolError(f"{what} must be an int, not {value!r}")


def check_aux_slot(slot: object, slots: int, what: str = "aux slot") -> int:
    """``slot`` as a slot of an aux buffer of ``slots`` rows: an int (:func:`as_index`) in
    ``[0, slots)``. Raises :class:`~trio_pd.ProtocolError` naming ``what``. The one check of
    an aux slot, wherever one comes in (a sender, a receiver's ``init``, a TRANSFER)."""
    index = slot if type(slot) is int else as_index(slot, what)  # (a plain int: no call)
    if not 0 <= index < slots:
        raise ProtocolError(f"{what} {index} outside [0, {slots})")
    return index


def page_ids(pages: object) -> npt.NDArray[np.int64]:
    """``pages`` (a sequence or array of page ids, any shape) as a flat int64 array, without
    changing a value: integers only, so floats, bools, strings and ids past 2**63 are a
    :class:`~trio_pd.ProtocolError`, not truncated into other pages. Range and repeats are
    :func:`validate_pages`' to check. Always a copy: a call keeps the ids it was given, so a
    caller that reuses its array once the call returns redirects no write and no release."""
    try:
        arr = np.asarray(pages)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged, say
        raise ProtocolError(f"page ids must be integers: {exc}") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ProtocolError(f"page ids must be integers, not {arr.dtype} ({arr.dtype.kind})")
    if arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ProtocolError(f"page id {int(arr.max())} is out of range")
    if _holds_a_bool(pages):
        raise ProtocolError("page ids must be integers, not bools")
    return arr.astype(np.int64, copy=True).reshape(-1)


def _holds_a_bool(pages: object) -> bool:
    """Whether ids given as a sequence (not an array) hold a bool anywhere: ``np.asarray``
    makes ``[True, 2]`` an integer array, so its dtype alone does not tell. An array's dtype
    does (a bool array's kind is ``"b"``)."""
    if isinstance(pages, np.ndarray):
        return False
    try:
        items = np.asarray(pages, dtype=object).reshape(-1)
    except (TypeError, ValueError):
        return False  # (the integer conversion has said why already)
    return any(isinstance(x, (bool, np.bool_)) for x in items)


def pool_page_ids(
    pages: object, num_pages: int, dtype: type[np.signedinteger[Any]] = np.int64
) -> npt.NDArray[Any]:
    """:func:`page_ids` and :func:`validate_pages` in one intake: ``pages`` as a flat copy
    of ``dtype`` (int64, or int32 for ids below ``2**31``), each an integer in ``[0,
    num_pages)`` and none repeated. Refuses what the two refuse, with the same
    :class:`~trio_pd.ProtocolError` (anything the quick path does not pass goes through them
    both); the quick path (up to :data:`SMALL` ids of a 1-D integer array or list) is one
    conversion, one pass over Python ints and one copy."""
    if type(pages) is np.ndarray:  # (an array already, the usual chunk: no conversion call)
        arr: npt.NDArray[Any] | None = pages
    else:
        try:
            arr = np.asarray(pages)
        except (TypeError, ValueError, OverflowError):
            arr = None  # (page_ids says why)
    if (
        arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu" and 0 < arr.size <= SMALL
        and (arr is pages or not _holds_a_bool(pages))
    ):
        # sorted: the least and the greatest in one call (min and max are two); a chunk's
        # ids are mostly ascending already, one run for the sort to find
        values = sorted(arr.tolist())
        if values[0] >= 0 and values[-1] < num_pages and len(set(values)) == arr.size:
            return arr.astype(dtype)  # (a copy: never the caller's array)
    ids = page_ids(pages)
    validate_pages(ids, num_pages)
    return ids if dtype is np.int64 else ids.astype(dtype)


def check_num_pages(num_pages: object) -> int:
    """A room's ``num_pages`` as an int (:func:`as_index`); ValueError outside
    ``[0, MAX_POOL_PAGES]``."""
    n = num_pages if type(num_pages) is int else as_index(num_pages, "num_pages")
    if not 0 <= n <= MAX_POOL_PAGES:
        raise ValueError(f"num_pages must be in [0, {MAX_POOL_PAGES}], not {n}")
    return n


def check_prefix_pages(prefix_pages: object) -> int:
    """A decode rank's ``prefix_pages`` (the request's first pages it holds already), as an
    int (:func:`as_index`) in ``[0, MAX_POOL_PAGES]``. Raises
    :class:`~trio_pd.ProtocolError`."""
    prefix = prefix_pages if type(prefix_pages) is int else as_index(prefix_pages, "prefix_pages")
    if not 0 <= prefix <= MAX_POOL_PAGES:
        raise ProtocolError(f"prefix_pages must be an int >= 0, not {prefix_pages!r}")
    return prefix


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


def check_state_slots(
    sizes: Sequence[int], slots: Iterable[npt.ArrayLike], what: str,
) -> tuple[npt.NDArray[np.int64], ...]:
    """Slots of each state component, checked: one list per component (``sizes`` are their
    slot counts), each of integers inside the component and none repeated (two writes
    would land on one slot); none at all (empty) means no slot of any component. Raises
    :class:`~trio_pd.ProtocolError`; the ``what`` side ("source", "destination") names them
    in the reason."""
    lists = list(slots)
    if not lists:
        return tuple(np.zeros(0, dtype=np.int64) for _ in sizes)
    if len(lists) != len(sizes):
        raise ProtocolError(
            f"{what} state slots: one list per state component ({len(sizes)}), "
            f"got {len(lists)}"
        )
    out = []
    total = 0
    for c, (given, size) in enumerate(zip(lists, sizes, strict=True)):
        not_ints = ProtocolError(f"{what} slots of state component {c} must be a list of ints")
        try:
            arr = np.asarray(given)
        except (TypeError, ValueError):  # ragged, say
            raise not_ints from None
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise not_ints
        total += arr.size
        if total > MAX_REQUEST_STATE_SLOTS:
            raise ProtocolError(
                f"{what} state slots: more than {MAX_REQUEST_STATE_SLOTS} in one request"
            )
        ids = arr.astype(np.int64, copy=True)  # (kept by the room: never the caller's)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= size):
            bad = ids[(ids < 0) | (ids >= size)]
            raise ProtocolError(
                f"{what} slot {int(bad[0])} of state component {c} is outside [0, {size})"
            )
        if ids.size > 1 and _repeats(ids, size):
            raise ProtocolError(f"{what} slots of state component {c} repeat a slot")
        out.append(ids)
    return tuple(out)


def _repeats(ids: npt.NDArray[np.int64], size: int) -> bool:
    """Whether ids in ``[0, size)`` repeat: a bitmap when it is small enough (no sort on the
    event loop for a long list), else a sort."""
    if ids.size <= SMALL:
        return len(set(ids.tolist())) != ids.size
    if size <= BITMAP_PAGES:
        seen = np.zeros(size, dtype=np.bool_)
        seen[ids] = True
        return int(np.count_nonzero(seen)) != ids.size
    return bool(np.unique(ids).size != ids.size)


class RegionTable:
    """Registered regions prepared once for :func:`~trio_pd.core._plan.validate_blocks` (sorted
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
