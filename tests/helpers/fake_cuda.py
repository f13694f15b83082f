"""Device memory played by host memory, on a machine with no GPU.

* :class:`FakeRuntime`, a stand-in for ``cuda.bindings.runtime`` whose "device" allocations
  are host buffers it knows. It checks every copy as CUDA would (direction, bounds of the
  allocation, the current device), so the device pools of :mod:`trio_pd.testing.device`, the
  aux row's device copies and the GPU agent scenarios run against it. Its functions take
  cuda-python's parameters (tests/test_memory_kinds.py checks them against the real module
  where cuda-python is installed).
* :func:`recording_engine`: a real engine whose binding records what it is asked to register
  and write (Mooncake: ``batch_register_memory``; NIXL: the memory type and device id of
  every descriptor list, handed on to the real agent as DRAM, which the bytes really are).
"""

from __future__ import annotations

import ctypes
import enum
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from trio_pd.engines import TransferEngine, make_engine
from trio_pd.engines import mooncake as mooncake_adapter
from trio_pd.io import _cuda


class Err(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorInsufficientDriver = 35
    cudaErrorNoDevice = 100


class _MemType(enum.IntEnum):
    cudaMemoryTypeUnregistered = 0
    cudaMemoryTypeHost = 1
    cudaMemoryTypeDevice = 2
    cudaMemoryTypeManaged = 3


class _CopyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class FakeRuntime:
    """``cuda.bindings.runtime`` over host memory. ``cudaMalloc`` hands out host buffers
    (filled with 0xCC, as CUDA promises nothing) and remembers which device each belongs to;
    every copy and fill asserts what CUDA would refuse or corrupt: a wrong direction, bytes
    outside one allocation, a device allocation used while another device is current.
    ``calls`` logs (function, direction or None, address, bytes, current device)."""

    cudaError_t = Err
    cudaMemoryType = _MemType
    cudaMemcpyKind = _CopyKind
    cudaStreamNonBlocking = 1

    def __init__(self, devices: int = 2, *, driver: bool = True) -> None:
        self.devices, self.driver = devices, driver
        self.allocs: dict[int, tuple[npt.NDArray[np.uint8], int]] = {}
        self.calls: list[tuple[str, str | None, int, int, int]] = []
        self.last_error_cleared = 0
        self.refuse_query: set[int] = set()  # addresses cudaPointerGetAttributes fails for
        self._local = threading.local()

    # -- bookkeeping ----------------------------------------------------------------------
    @property
    def current(self) -> int:
        return getattr(self._local, "device", 0)

    def device_of(self, ptr: int, nbytes: int = 1) -> int | None:
        """The device of the allocation holding all of [ptr, ptr + nbytes), None for host
        memory; an AssertionError for a range that leaves an allocation it starts in."""
        for base, (buf, dev) in self.allocs.items():
            if base <= ptr < base + buf.nbytes:
                assert ptr + nbytes <= base + buf.nbytes, (
                    f"{nbytes} bytes at {ptr:#x} run past a {buf.nbytes}-byte allocation"
                )
                return dev
            assert not (ptr < base < ptr + nbytes), f"host range at {ptr:#x} runs into device"
        return None

    def _side(self, ptr: int, nbytes: int, device: bool) -> None:
        dev = self.device_of(ptr, nbytes)
        if device:
            assert dev is not None, f"{ptr:#x} is not device memory"
            assert dev == self.current, f"cuda:{dev} memory used while cuda:{self.current} current"
        else:
            assert dev is None, f"{ptr:#x} is device memory, not host"

    def _ok(self) -> Err:
        return Err.cudaSuccess if self.driver else Err.cudaErrorInsufficientDriver

    # -- the API (cuda-python's parameter names) ---------------------------------------------
    def cudaGetDeviceCount(self) -> tuple[Err, int | None]:
        if not self.driver:
            return Err.cudaErrorInsufficientDriver, None
        return (Err.cudaSuccess, self.devices) if self.devices else (Err.cudaErrorNoDevice, 0)

    def cudaGetDevice(self) -> tuple[Err, int]:
        return self._ok(), self.current

    def cudaSetDevice(self, device: int) -> tuple[Err]:
        if not 0 <= device < self.devices:
            return (Err.cudaErrorInvalidValue,)
        self._local.device = device
        return (Err.cudaSuccess,)

    def cudaGetLastError(self) -> tuple[Err]:
        self.last_error_cleared += 1
        return (Err.cudaSuccess,)

    def cudaGetErrorName(self, error: Err) -> tuple[Err, bytes]:
        return Err.cudaSuccess, Err(error).name.encode()

    def cudaPointerGetAttributes(self, ptr: int) -> tuple[Err, Any]:
        if not self.driver or ptr in self.refuse_query:
            return Err.cudaErrorInvalidValue if self.driver else self._ok(), None
        dev = self.device_of(ptr)
        kind = _MemType.cudaMemoryTypeUnregistered if dev is None else _MemType.cudaMemoryTypeDevice
        return Err.cudaSuccess, SimpleNamespace(type=kind, device=-2 if dev is None else dev)

    def cudaMalloc(self, size: int) -> tuple[Err, int]:
        buf = np.full(size, 0xCC, dtype=np.uint8)
        self.allocs[int(buf.ctypes.data)] = (buf, self.current)
        return Err.cudaSuccess, int(buf.ctypes.data)

    def cudaFree(self, devPtr: int) -> tuple[Err]:
        return (Err.cudaSuccess,) if self.allocs.pop(devPtr, None) else (
            Err.cudaErrorInvalidValue,)

    #: bytes on each "device"; cudaMemGetInfo reports them less what is allocated there
    memory = 8 << 30

    def cudaMemGetInfo(self) -> tuple[Err, int, int]:
        used = sum(buf.nbytes for buf, dev in self.allocs.values() if dev == self.current)
        return self._ok(), self.memory - used, self.memory

    def cudaStreamCreateWithFlags(self, flags: int) -> tuple[Err, object]:
        assert flags == self.cudaStreamNonBlocking
        return Err.cudaSuccess, ("stream", self.current)

    def cudaStreamSynchronize(self, stream: Any) -> tuple[Err]:
        return (Err.cudaSuccess,)

    def _copy(self, dst: int, src: int, count: int, kind: _CopyKind) -> None:
        to_dev = kind in (_CopyKind.cudaMemcpyHostToDevice, _CopyKind.cudaMemcpyDeviceToDevice)
        from_dev = kind in (_CopyKind.cudaMemcpyDeviceToHost, _CopyKind.cudaMemcpyDeviceToDevice)
        self._side(dst, count, to_dev)
        self._side(src, count, from_dev)
        ctypes.memmove(dst, src, count)

    def cudaMemcpyAsync(self, dst: int, src: int, count: int, kind: _CopyKind,
                        stream: Any) -> tuple[Err]:
        self._copy(dst, src, count, kind)
        self.calls.append(("memcpy", _CopyKind(kind).name, dst, count, self.current))
        return (Err.cudaSuccess,)

    def cudaMemcpy2DAsync(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                          height: int, kind: _CopyKind, stream: Any) -> tuple[Err]:
        assert dpitch >= width and spitch >= width, "a pitch below the width"
        for row in range(height):
            self._copy(dst + row * dpitch, src + row * spitch, width, kind)
        self.calls.append(("memcpy2d", _CopyKind(kind).name, dst, width * height, self.current))
        return (Err.cudaSuccess,)

    def cudaMemsetAsync(self, devPtr: int, value: int, count: int,
                        stream: Any) -> tuple[Err]:
        self._side(devPtr, count, True)
        ctypes.memset(devPtr, value, count)
        self.calls.append(("memset", None, devPtr, count, self.current))
        return (Err.cudaSuccess,)

    def cudaMemset2DAsync(self, devPtr: int, pitch: int, value: int, width: int,
                          height: int, stream: Any) -> tuple[Err]:
        assert pitch >= width, "a pitch below the width"
        for row in range(height):
            self._side(devPtr + row * pitch, width, True)
            ctypes.memset(devPtr + row * pitch, value, width)
        self.calls.append(("memset2d", None, devPtr, width * height, self.current))
        return (Err.cudaSuccess,)


def install_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    """The stand-in as trio_pd's CUDA runtime, with two devices; Mooncake's adapter is told
    it is the CUDA build (its non-CUDA build moves host memory, which this all is)."""
    fake = FakeRuntime()
    monkeypatch.setattr(_cuda, "runtime", lambda: fake)
    monkeypatch.setattr(_cuda, "_streams", {})
    monkeypatch.setattr(mooncake_adapter, "_cuda_build", lambda: True)
    return fake




class RecordingBinding:
    """Wraps a real engine's binding object, passes every call on, and records the ones that
    describe memory. For NIXL a VRAM descriptor list is handed on as DRAM with the same
    device id: the memory is host memory under a fake kind, and the real agent then
    registers and matches it consistently on both sides."""

    def __init__(self, inner: Any, calls: list[tuple[Any, ...]]) -> None:
        self._inner, self.calls = inner, calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # mooncake
    def batch_register_memory(self, bases: list[int], lens: list[int], location: str) -> int:
        self.calls.append(("register", location, list(bases), list(lens)))
        return int(self._inner.batch_register_memory(bases, lens, location))

    # nixl
    def get_reg_descs(self, descs: list[tuple[int, int, int, str]], mem_type: str) -> Any:
        self.calls.append(("reg", mem_type, [(int(b), int(n), int(d)) for b, n, d, _ in descs]))
        return self._inner.get_reg_descs(descs, "DRAM")

    def get_xfer_descs(self, rows: npt.NDArray[np.uint64], mem_type: str) -> Any:
        self.calls.append(("xfer", mem_type, rows[:, 2].tolist(), rows[:, 0].tolist()))
        return self._inner.get_xfer_descs(rows, "DRAM")

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return [*self._inner.get_backend_mem_types(backend), "VRAM_SEG"]


def recording_engine(name: str, calls: list[tuple[Any, ...]] | None = None) -> TransferEngine:
    """A real engine whose binding is wrapped in a :class:`RecordingBinding`."""
    engine: Any = make_engine(name)
    attr = "_engine" if name == "mooncake" else "_agent"
    setattr(engine, attr, RecordingBinding(getattr(engine, attr), [] if calls is None else calls))
    return engine  # type: ignore[no-any-return]


