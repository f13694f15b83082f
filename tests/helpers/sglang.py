"""SGLang-shaped memory for the adapter's tests: KV buffers laid out as SGLang's token-to-KV
pools lay them, its metadata buffers, state components (Mamba, sliding window) as its hybrid
pools hold them, and the ``server_args`` its managers read."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt

from trio_pd.compat.sglang import KVArgs
from trio_pd.testing.pools import PageAllocator, state_bytes

#: SGLang's metadata buffers, reduced: (name, dtype, elements per slot)
METADATA = (("output_ids", np.int32, 16), ("logprobs", np.float32, 16),
            ("hidden_states", np.float16, 40))
PAGE_SIZE, HEAD_DIM, LAYERS = 4, 8, 2  # float16 heads: 16 bytes each


class Memory:
    """One rank's KV cache and metadata buffers, allocated as SGLang does: a separate
    ``(tokens, heads, head_dim)`` float16 array per K layer and per V layer (or per MLA
    layer), and a ``(slots, n)`` array per metadata buffer."""

    def __init__(self, *, num_pages: int, heads: int, aux_slots: int, mla: bool = False) -> None:
        buffers = LAYERS if mla else 2 * LAYERS
        self.heads = heads
        self.kv = [np.zeros((num_pages * PAGE_SIZE, heads, HEAD_DIM), dtype=np.float16)
                   for _ in range(buffers)]
        self.meta = [np.zeros((aux_slots, n), dtype=dt) for _, dt, n in METADATA]
        #: byte views: a page per row, a slot per row
        self.pages = [b.view(np.uint8).reshape(num_pages, -1) for b in self.kv]
        self.slots = [m.view(np.uint8).reshape(aux_slots, -1) for m in self.meta]

    def kvargs(self, *, rank: int = 0, total_heads: int | None = None) -> KVArgs:
        args = KVArgs()  # set field by field, as SGLang's scheduler does
        args.engine_rank = rank
        args.kv_data_ptrs = [int(b.ctypes.data) for b in self.kv]
        args.kv_data_lens = [int(b.nbytes) for b in self.kv]
        args.kv_item_lens = [int(p.shape[1]) for p in self.pages]
        args.aux_data_ptrs = [int(m.ctypes.data) for m in self.meta]
        args.aux_data_lens = [int(m.nbytes) for m in self.meta]
        args.aux_item_lens = [int(s.shape[1]) for s in self.slots]
        args.kv_head_num = self.heads
        args.total_kv_head_num = total_heads or self.heads
        args.page_size = PAGE_SIZE
        return args

    def fill(self, room: int, pages: npt.NDArray[np.int64], slot: int, first_head: int = 0) -> None:
        want = kv_pattern(room, len(self.kv), len(pages), first_head, self.heads)
        for b, rows in enumerate(self.pages):
            rows[pages] = want[b]
        for m, rows in enumerate(self.slots):
            rows[slot] = meta_pattern(room, m, rows.shape[1])

    def holds(self, room: int, pages: npt.NDArray[np.int64], slot: int) -> bool:
        want = kv_pattern(room, len(self.kv), len(pages), 0, self.heads)
        kv_ok = all((rows[pages] == want[b]).all() for b, rows in enumerate(self.pages))
        meta_ok = all((rows[slot] == meta_pattern(room, m, rows.shape[1])).all()
                      for m, rows in enumerate(self.slots))
        return bool(kv_ok and meta_ok)


def _key(room: int) -> npt.NDArray[np.uint8]:
    return np.frombuffer(((room * 0x9E3779B97F4A7C15) % (1 << 64) | 1).to_bytes(8, "little"),
                         dtype=np.uint8)


def kv_pattern(room: int, buffers: int, npages: int, first_head: int, heads: int,
               ) -> npt.NDArray[np.uint8]:
    """A request's page bytes as held by a rank with heads ``first_head..+heads``: a function
    of (room, buffer, page of the request, token, global head, byte). Shape (buffers, npages,
    page bytes)."""
    hb = HEAD_DIM * 2
    b = np.arange(buffers)[:, None, None, None, None]
    p = np.arange(npages)[None, :, None, None, None]
    t = np.arange(PAGE_SIZE)[None, None, :, None, None]
    h = np.arange(first_head, first_head + heads)[None, None, None, :, None]
    k = np.arange(hb)[None, None, None, None, :]
    v = ((b * 104729 + p * 257 + t * 31 + h * 61 + k * 3) % 251).astype(np.uint8)
    v ^= _key(room)[k % 8]
    return v.reshape(buffers, npages, -1)


def meta_pattern(room: int, m: int, n: int) -> npt.NDArray[np.uint8]:
    i = np.arange(n)
    return ((i * 13 + m * 37) % 251).astype(np.uint8) ^ _key(room)[(i + m) % 8]


class SplitRows:
    """The sanitizer's rows over several arrays at once: row ``i`` is row ``i`` of each (a
    page of every KV buffer, or a slot of every metadata buffer)."""

    def __init__(self, arrays: Sequence[npt.NDArray[np.uint8]]) -> None:
        self.arrays = list(arrays)

    @property
    def count(self) -> int:
        return int(self.arrays[0].shape[0])

    def poison(self, ids: npt.NDArray[np.int64] | None, value: int) -> None:
        for a in self.arrays:
            if ids is None:
                a[...] = value
            else:
                a[ids] = value

    def broken(self, ids: npt.NDArray[np.int64], value: int) -> int:
        intact = np.ones(len(ids), dtype=bool)
        for a in self.arrays:
            intact &= (a[ids] == value).reshape(len(ids), -1).all(axis=1)
        return int(len(ids) - intact.sum())


class StateType(enum.StrEnum):  # (SGLang's StateType, reduced: a str enum)
    MAMBA = "mamba"
    SWA = "swa"
    DSA = "dsa"


#: a Mamba state per layer, as (rows, row bytes): a conv state of 6 rows of 16 bytes and an
#: SSM state of 4 heads of 64 bytes, the TP-split dim outermost (SGLang's layout)
MAMBA_ROWS = ((6, 16), (4, 64))
#: pages a sliding-window request keeps (its last ones)
SWA_WINDOW = 3


class States:
    """One rank's state buffers as SGLang allocates them, and their KVArgs fields: a Mamba
    type (conv states of every layer, then SSM states of every layer, ``(slots, rows x row
    bytes)`` each, this rank's ``rows / tp_size`` rows) and an SWA type (a K and a V page
    array per layer, ``3 x slots`` pages); a slot allocator per type with the lifetime
    sanitizer (freed slots poisoned, late writes counted); the bytes a request's slots hold.

    A request has one Mamba slot and the last ``min(SWA_WINDOW, pages)`` SWA pages."""

    def __init__(self, *, slots: int, poison: int, kinds: Sequence[str] = ("mamba", "swa"),
                 tp_rank: int = 0, tp_size: int = 1, dims: bool = True) -> None:
        self.kinds, self.tp_rank, self.dims = tuple(kinds), tp_rank, dims
        self.rows = [(n // tp_size, rb) for n, rb in MAMBA_ROWS for _ in range(LAYERS)]
        page = PAGE_SIZE * 2 * HEAD_DIM * 2  # 2 heads of 8 float16 values, 4 tokens
        arrays = {
            "mamba": [np.zeros((slots, n * rb), np.uint8) for n, rb in self.rows],
            "swa": [np.zeros((SWA_WINDOW * slots, page), np.uint8) for _ in range(2 * LAYERS)],
        }
        self.arrays = [arrays[k] for k in self.kinds]
        self.alloc = [PageAllocator(SplitRows(a), poison) for a in self.arrays]

    def add_to(self, args: KVArgs) -> KVArgs:
        """``args`` with this rank's state fields, set as SGLang's scheduler sets them."""
        args.state_types = [StateType(k) for k in self.kinds]
        args.state_data_ptrs = [[int(a.ctypes.data) for a in arr] for arr in self.arrays]
        args.state_data_lens = [[int(a.nbytes) for a in arr] for arr in self.arrays]
        args.state_item_lens = [[int(a.shape[1]) for a in arr] for arr in self.arrays]
        if self.dims:
            args.state_dim_per_tensor = [[n for n, _ in self.rows] if k == "mamba" else []
                                         for k in self.kinds]
        return args

    def take(self, npages: int) -> list[npt.NDArray[np.int64]] | None:
        """A request's slots of each type, or None (and nothing held) when one is short."""
        want = {"mamba": 1, "swa": min(SWA_WINDOW, npages)}
        held: list[npt.NDArray[np.int64]] = []
        for kind, alloc in zip(self.kinds, self.alloc, strict=True):
            ids = alloc.alloc_nowait(want[kind])
            if ids is None:
                self.free(held)
                return None
            held.append(ids)
        return held

    def free(self, held: Sequence[npt.NDArray[np.int64]]) -> None:
        for alloc, ids in zip(self.alloc, held, strict=False):
            alloc.free(ids)

    @staticmethod
    def indices(held: Sequence[npt.NDArray[np.int64]]) -> list[Any]:
        """SGLang's ``state_indices``: a list per type (lists and int32 arrays, as SGLang's
        scheduler passes them)."""
        return [ids.tolist() if c == 0 else ids.astype(np.int32) for c, ids in enumerate(held)]

    def want(self, room: int, c: int, b: int, i: int) -> npt.NDArray[np.uint8]:
        """Slot ``i`` of a request's slots of type ``c``, buffer ``b``, as this rank holds
        it: a function of the byte's place in the whole (unsplit) slot, so that ranks of
        other TP sizes agree."""
        item = self.arrays[c][b].shape[1]
        # (SGLang's room ids are 63-bit: the pattern takes them modulo a large prime)
        return state_bytes(room % 2147483647, c, b, i, self.tp_rank * item + np.arange(item))

    def fill(self, room: int, held: Sequence[npt.NDArray[np.int64]]) -> None:
        for c, ids in enumerate(held):
            for b, rows in enumerate(self.arrays[c]):
                for i, slot in enumerate(ids.tolist()):
                    rows[slot] = self.want(room, c, b, i)

    def holds(self, room: int, held: Sequence[npt.NDArray[np.int64]]) -> bool:
        """Whether every byte of the request's slots, every type and buffer, is right."""
        return all(
            bool((rows[slot] == self.want(room, c, b, i)).all())
            for c, ids in enumerate(held) for b, rows in enumerate(self.arrays[c])
            for i, slot in enumerate(ids.tolist())
        )

    def clean(self) -> bool:
        """Every slot back, and none written after it was freed (poison intact)."""
        return all(a.outstanding == 0 and a.late_writes == 0 and a.late_in_free_rows() == 0
                   for a in self.alloc)


def server_args(**kw: Any) -> SimpleNamespace:
    base = dict(host="127.0.0.1", disaggregation_bootstrap_port=0, tp_size=1, pp_size=1,
                disaggregation_transfer_backend="mooncake")
    base.update(kw)
    return SimpleNamespace(**base)
