"""KV pools in the memory of a CUDA device, for tests and benchmarks on a GPU host: the twin
of :class:`~trio_pd.testing.pools.HostKVPool`, built with cuda-python (``cudaMalloc``), filled
and read back with ``cudaMemcpy``, poisoned for the lifetime sanitizer with ``cudaMemset``.

A :class:`DeviceKVPool` can only be built where cuda-python finds the device; elsewhere its
constructor raises :class:`~trio_pd.ConfigurationError` saying what is missing, and this
module still imports. To describe device buffers allocated by something else (a serving
engine's own KV cache, a PyTorch or CuPy tensor) use :func:`describe_pool`, which needs no
framework import and no device pool of ours.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import numpy as np
import numpy.typing as npt

from ..core._closing import ClosesOnExit
from ..core._errors import ConfigurationError, EngineError
from ..core._memory import (
    AUX_STAMP,
    HOST,
    MemoryKind,
    PoolSpec,
    buffer_region,
    describe_pool,
)
from ..io import _cuda
from .pools import AUX_ITEM_LEN, HostRows, Rows, aux_bytes, kv_bytes

__all__ = [
    "DeviceKVPool",
    "DeviceRows",
    "MemoryKind",
    "buffer_region",
    "describe_pool",
    "device_count",
    "device_free_bytes",
    "engine_problem",
]

device_count = _cuda.device_count


def device_free_bytes(device: int = 0) -> int | None:
    """Bytes free on CUDA device ``device`` (``cudaMemGetInfo``), or None where cuda-python
    cannot say (no cuda-python, driver or device, or a failing call)."""
    if _cuda.runtime() is None:
        return None
    try:
        with _cuda._on(device) as (rt, _):
            err, free, _total = rt.cudaMemGetInfo()
    except Exception:
        return None
    return int(free) if err == rt.cudaError_t.cudaSuccess else None


def engine_problem(name: str) -> str | None:
    """Why transfer engine ``name``, as installed here, cannot move device memory, or None
    if it can. Mooncake needs its CUDA wheel (``mooncake-transfer-engine``): its adapter
    refuses device regions on the non-CUDA one. NIXL needs a UCX backend that lists VRAM,
    which only an agent can say, so this builds one and closes it (once per process: the
    answer is kept). Asks nothing of a device."""
    if name == "mooncake":
        from ..engines import mooncake

        if importlib.util.find_spec("mooncake") is None:
            return "mooncake is not installed (pip install mooncake-transfer-engine)"
        if not mooncake._cuda_build():
            return (f"the installed Mooncake wheel is the non-CUDA build ({mooncake._PIP_NAME}), "
                    "which moves host memory only (pip install mooncake-transfer-engine in "
                    "its place)")
        return None
    if name == "nixl":
        return _nixl_problem()
    return f"unknown engine {name!r}"


@functools.cache
def _nixl_problem() -> str | None:
    from ..engines import make_engine

    try:
        with make_engine("nixl") as engine:
            mems = engine._agent.get_backend_mem_types("UCX")  # type: ignore[attr-defined]
    except (ConfigurationError, EngineError) as exc:  # no wheel, or the agent cannot be built
        return str(exc)
    except Exception as exc:
        return f"NIXL's UCX backend could not say which memory it moves: {exc!r}"
    if not any("VRAM" in str(m) for m in mems):  # "VRAM_SEG"
        return f"NIXL's UCX backend cannot move device memory here (it lists {mems})"
    return None


class DeviceRows:
    """:class:`~trio_pd.testing.pools.Rows` in device memory: row ``i`` is ``height`` runs of
    ``width`` bytes at ``base + i * width + k * pitch`` (k < height). For a pool's pages,
    ``height`` is its number of buffers and ``pitch`` the bytes of one buffer."""

    def __init__(
        self, base: int, width: int, count: int, device: int, *, height: int = 1,
        pitch: int = 0,
    ) -> None:
        self.base, self.width, self._count, self.device = base, width, count, device
        self.height, self.pitch = height, pitch or width * count

    @property
    def count(self) -> int:
        return self._count

    def _runs(self, ids: npt.NDArray[np.int64] | None) -> list[tuple[int, int]]:
        """``ids`` as runs ``[start, stop)`` of consecutive rows (one CUDA call each)."""
        if ids is None:
            return [(0, self._count)]
        if not len(ids):
            return []
        ordered = np.unique(ids)
        cuts = np.flatnonzero(np.diff(ordered) != 1) + 1
        return [(int(run[0]), int(run[-1]) + 1) for run in np.split(ordered, cuts)]

    def poison(self, ids: npt.NDArray[np.int64] | None, value: int) -> None:
        for a, b in self._runs(ids):
            _cuda.memset_2d(self.base + a * self.width, self.pitch, value,
                            (b - a) * self.width, self.height, self.device)

    def read(self, a: int, b: int) -> npt.NDArray[np.uint8]:
        """Rows ``[a, b)`` copied to the host, shape (b - a, height, width)."""
        out = np.empty((self.height, b - a, self.width), dtype=np.uint8)
        span = (b - a) * self.width
        _cuda.memcpy_2d(out.ctypes.data, span, self.base + a * self.width, self.pitch, span,
                        self.height, "d2h", self.device)
        return out.transpose(1, 0, 2)

    def broken(self, ids: npt.NDArray[np.int64], value: int) -> int:
        bad = 0
        for a, b in self._runs(ids):
            intact = (self.read(a, b) == value).reshape(b - a, -1).all(axis=1)
            bad += int((b - a) - intact.sum())
        return bad


class DeviceKVPool(ClosesOnExit):
    """One rank's KV pool on CUDA device ``device``, and the :class:`PoolSpec` describing it,
    with its kinds stated (``spec.region_kinds``).

    The KV buffers are one ``cudaMalloc``: buffer ``i`` at ``kv_base + i * buffer_bytes``. The
    aux buffer is on the device too (``aux="device"``), or in host memory (``aux="host"``: a
    numpy array, :attr:`aux`), which makes a pool of mixed kinds. Every byte starts at zero.
    The methods mirror :class:`~trio_pd.testing.pools.HostKVPool`'s, with copies to and
    from the device in place of numpy views. Close the pool (or leave its ``with`` block) to
    free the device memory, once no engine has it registered.
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
        device: int = 0,
        aux: Literal["device", "host"] = "device",
    ) -> None:
        _cuda.require_device(device, "a DeviceKVPool")
        if aux not in ("device", "host"):
            raise ValueError(f"aux must be 'device' or 'host', not {aux!r}")
        self.device = device
        buffers = 2 * num_layers if layout == "mha" else num_layers
        self.item_len = page_size * heads * head_bytes
        self.buffer_bytes = num_pages * self.item_len
        self.kv_base = _cuda.malloc(buffers * self.buffer_bytes, device)
        self.aux: npt.NDArray[np.uint8] | None = None  # the host aux buffer (aux="host")
        self._aux_device = 0
        self._closed = False
        try:
            _cuda.memset(self.kv_base, 0, buffers * self.buffer_bytes, device)
            if aux == "device":
                self._aux_device = _cuda.malloc(aux_slots * aux_item_len, device)
                _cuda.memset(self._aux_device, 0, aux_slots * aux_item_len, device)
                aux_base, aux_kind = self._aux_device, MemoryKind.cuda(device)
            else:
                self.aux = np.zeros((aux_slots, aux_item_len), dtype=np.uint8)
                aux_base, aux_kind = int(self.aux.ctypes.data), HOST
        except BaseException:
            self.close()
            raise
        self.spec = PoolSpec(
            layout=layout, page_size=page_size, num_pages=num_pages, num_layers=num_layers,
            head_bytes=head_bytes, heads=heads, first_head=first_head,
            buffer_bases=tuple(self.kv_base + i * self.buffer_bytes for i in range(buffers)),
            aux_base=aux_base, aux_item_len=aux_item_len, aux_slots=aux_slots,
            kinds=(*[MemoryKind.cuda(device)] * buffers, aux_kind),
        )

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the device memory. Idempotent. Only once no engine has it registered."""
        if self._closed:
            return
        self._closed = True
        for ptr in (self.kv_base, self._aux_device):
            if ptr:
                _cuda.free(ptr, self.device)

    # -- contents ------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        spec = self.spec
        return spec.num_buffers * self.buffer_bytes + spec.aux_slots * spec.aux_item_len

    def page_rows(self) -> DeviceRows:
        """The pages as :class:`~trio_pd.testing.pools.Rows` (each page spans every buffer),
        for a :class:`~trio_pd.testing.pools.PageAllocator`."""
        return DeviceRows(self.kv_base, self.item_len, self.spec.num_pages, self.device,
                          height=self.spec.num_buffers, pitch=self.buffer_bytes)

    def aux_rows(self) -> Rows:
        """The aux rows as :class:`~trio_pd.testing.pools.Rows`."""
        if self.aux is not None:
            return HostRows(self.aux)
        return DeviceRows(self._aux_device, self.spec.aux_item_len, self.spec.aux_slots,
                          self.device)

    def fill(self, pages: npt.NDArray[np.int64], room: int) -> None:
        """Write the request's deterministic KV bytes (for this rank's heads) into ``pages``;
        page i of the request goes to ``pages[i]``."""
        want = np.ascontiguousarray(kv_bytes(self.spec, room, len(pages)))
        self._pages(want, pages, "h2d")

    def read(self, pages: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
        """What ``pages`` hold, copied to the host: shape (buffers, len(pages), item_len)."""
        out = np.empty((self.spec.num_buffers, len(pages), self.item_len), dtype=np.uint8)
        self._pages(out, pages, "d2h")
        return out

    def _pages(
        self, host: npt.NDArray[np.uint8], pages: npt.NDArray[np.int64], direction: _cuda.Direction
    ) -> None:
        """Copy between ``host`` (buffers, len(pages), item_len) and the pool's ``pages``: one
        2-D copy per page (its slice of every buffer)."""
        n, item, stride = len(pages), self.item_len, self.buffer_bytes
        for j, page in enumerate(np.asarray(pages).tolist()):
            if not 0 <= page < self.spec.num_pages:
                raise IndexError(f"page {page} outside [0, {self.spec.num_pages})")
            on_host, on_device = host.ctypes.data + j * item, self.kv_base + page * item
            if direction == "h2d":
                _cuda.memcpy_2d(on_device, stride, on_host, n * item, item,
                                self.spec.num_buffers, "h2d", self.device)
            else:
                _cuda.memcpy_2d(on_host, n * item, on_device, stride, item,
                                self.spec.num_buffers, "d2h", self.device)

    def kv(self) -> npt.NDArray[np.uint8]:
        """Every KV byte, copied to the host: shape (buffers, pages, item_len)."""
        out = np.empty((self.spec.num_buffers, self.spec.num_pages, self.item_len), np.uint8)
        _cuda.memcpy(out.ctypes.data, self.kv_base, out.nbytes, "d2h", self.device)
        return out

    def expected(self, room: int, npages: int) -> npt.NDArray[np.uint8]:
        return kv_bytes(self.spec, room, npages)

    def aux_row(self, slot: int) -> bytes:
        """Aux row ``slot``, copied to the host."""
        if self.aux is not None:
            return bytes(self.aux[slot].tobytes())
        n = self.spec.aux_item_len
        return _cuda.read(self._aux_device + slot * n, n, self.device)

    def fill_aux(self, slot: int, room: int) -> None:
        """Bytes 16.. of the row (0..15 are trio_pd's room/epoch stamp)."""
        tail = aux_bytes(room, self.spec.aux_item_len - AUX_STAMP.size)
        if self.aux is not None:
            self.aux[slot, AUX_STAMP.size:] = tail
        else:
            start = self._aux_device + slot * self.spec.aux_item_len + AUX_STAMP.size
            _cuda.write(start, tail, self.device)

    def aux_ok(self, slot: int, room: int) -> bool:
        want = aux_bytes(room, self.spec.aux_item_len - AUX_STAMP.size).tobytes()
        return self.aux_row(slot)[AUX_STAMP.size:] == want
