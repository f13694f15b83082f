"""The CUDA runtime, through cuda-python, for what trio_pd itself does with device memory: tell
where a pointer lives (:func:`classify`), and move bytes to, from and inside a device (the aux
row's stamp; the device pools of :mod:`trio_pd.testing`).

cuda-python (``cuda.bindings.runtime``, cuda-python 12.6 or newer) is imported on first use,
never when trio_pd is imported, and trio_pd loads no libcudart of its own. With no
cuda-python, no driver or no device everything here still imports, :func:`classify` answers
"host" and :func:`device_count` 0; only the copies raise.

Every copy and fill here is *synchronous*: it runs on a non-blocking stream that trio_pd keeps
per device (so it never queues behind a serving engine's kernels on the legacy default
stream), and that stream is synchronised before the function returns. A stamp written here is
in device memory before the engine call that follows reads it. The calling thread's current
device is switched for the call and put back afterwards. A failing CUDA call raises
:class:`~trio_pd.EngineError` with the ``cudaError_t`` as its ``code``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..core._errors import ConfigurationError, EngineError
from ..core._memory import HOST, MemoryKind

Direction = Literal["h2d", "d2h", "d2d"]

_KINDS: dict[Direction, str] = {
    "h2d": "cudaMemcpyHostToDevice",
    "d2h": "cudaMemcpyDeviceToHost",
    "d2d": "cudaMemcpyDeviceToDevice",
}

#: trio_pd's own non-blocking stream on each device (created on first use, kept for the life
#: of the process)
_streams: dict[int, Any] = {}
_streams_lock = threading.Lock()


@functools.cache
def runtime() -> Any | None:
    """``cuda.bindings.runtime``, or None where cuda-python is not installed (or cannot be
    loaded). Imported once, on the first call."""
    try:
        from cuda.bindings import runtime as rt
    except (ImportError, OSError, RuntimeError):
        return None
    return rt


def device_count() -> int:
    """The CUDA devices this process sees: 0 without cuda-python, a driver or a device."""
    rt = runtime()
    if rt is None:
        return 0
    try:
        err, count = rt.cudaGetDeviceCount()
    except Exception:  # a driver library that cannot even be loaded
        return 0
    return int(count) if err == rt.cudaError_t.cudaSuccess else 0


def classify(address: int) -> MemoryKind:
    """Where ``address`` lives, by ``cudaPointerGetAttributes``: ``MemoryKind.cuda(N)`` for
    memory of CUDA device N (``cudaMalloc``), host for everything else: ordinary and pinned
    host memory, managed memory (host-accessible; engines move it as host memory, and RDMA to
    a GPU cannot register it), and any address when there is no cuda-python, driver or
    device."""
    rt = runtime()
    if rt is None:
        return HOST
    try:
        err, attrs = rt.cudaPointerGetAttributes(address)
    except Exception:
        return HOST
    if err != rt.cudaError_t.cudaSuccess:
        rt.cudaGetLastError()  # a failed query must not leave an error for the next caller
        return HOST
    if attrs.type == rt.cudaMemoryType.cudaMemoryTypeDevice:
        return MemoryKind.cuda(int(attrs.device))
    return HOST


def require_device(device: int = 0, what: str = "device memory") -> None:
    """Raise :class:`~trio_pd.ConfigurationError`, saying why, unless cuda-python is installed
    and CUDA device ``device`` exists."""
    rt = runtime()
    if rt is None:
        raise ConfigurationError(
            f"{what} needs cuda-python (pip install 'trio-pd[cuda]'), which is not installed"
        )
    try:
        err, count = rt.cudaGetDeviceCount()
    except Exception as exc:
        raise ConfigurationError(f"{what} needs a CUDA driver: {exc!r}") from exc
    if err != rt.cudaError_t.cudaSuccess:
        raise ConfigurationError(f"{what} needs a CUDA device: cudaGetDeviceCount: {_name(err)}")
    if not 0 <= device < int(count):
        raise ConfigurationError(f"{what}: no CUDA device {device} (this process sees {count})")


def _name(err: Any) -> str:
    rt: Any = runtime()
    try:
        _, name = rt.cudaGetErrorName(err)
        return bytes(name).decode()
    except Exception:
        return str(err)


def _check(result: Any, what: str) -> Any:
    """The values of a cuda-python call's ``(err, *values)``; EngineError unless success."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    rt: Any = runtime()
    if err != rt.cudaError_t.cudaSuccess:
        raise EngineError(f"{what} failed: {_name(err)}", code=int(err))
    return rest[0] if len(rest) == 1 else None


def _stream(rt: Any, device: int) -> Any:
    """trio_pd's stream on ``device`` (the current device when this is called)."""
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _check(
                rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags"
            )
            _streams[device] = stream
    return stream


@contextmanager
def _on(device: int) -> Iterator[tuple[Any, Any]]:
    """The runtime and trio_pd's stream on ``device``, with ``device`` current in this thread
    for the block; the thread's device before it is put back afterwards."""
    rt = runtime()
    if rt is None:
        raise ConfigurationError("device memory needs cuda-python (pip install 'trio-pd[cuda]')")
    before = _check(rt.cudaGetDevice(), "cudaGetDevice")
    if before != device:
        _check(rt.cudaSetDevice(device), f"cudaSetDevice({device})")
    try:
        yield rt, _stream(rt, device)
    finally:
        if before != device:
            rt.cudaSetDevice(before)


def _finish(rt: Any, stream: Any, what: str) -> None:
    _check(rt.cudaStreamSynchronize(stream), f"{what} (cudaStreamSynchronize)")


# -------------------------------------------------------------------------------- allocation


def malloc(nbytes: int, device: int) -> int:
    """``cudaMalloc`` ``nbytes`` on ``device``; the address. Free it with :func:`free`."""
    with _on(device) as (rt, _):
        return int(_check(rt.cudaMalloc(nbytes), f"cudaMalloc({nbytes}) on cuda:{device}"))


def free(address: int, device: int) -> None:
    """``cudaFree`` an address from :func:`malloc`."""
    with _on(device) as (rt, _):
        _check(rt.cudaFree(address), "cudaFree")


# -------------------------------------------------------------------------------- copies


def memcpy(dst: int, src: int, nbytes: int, direction: Direction, device: int) -> None:
    """Copy ``nbytes`` from ``src`` to ``dst``: "h2d" and "d2h" between host memory and memory
    of ``device``, "d2d" within ``device`` (or to another device that it can reach)."""
    with _on(device) as (rt, stream):
        kind = getattr(rt.cudaMemcpyKind, _KINDS[direction])
        _check(rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream), f"cudaMemcpyAsync {direction}")
        _finish(rt, stream, f"cudaMemcpyAsync {direction}")


def memcpy_2d(
    dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
    direction: Direction, device: int,
) -> None:
    """Copy ``height`` rows of ``width`` bytes, rows ``spitch`` apart at ``src`` and ``dpitch``
    apart at ``dst`` (``cudaMemcpy2DAsync``): a page of every buffer of a pool in one call."""
    with _on(device) as (rt, stream):
        kind = getattr(rt.cudaMemcpyKind, _KINDS[direction])
        _check(
            rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream),
            f"cudaMemcpy2DAsync {direction}",
        )
        _finish(rt, stream, f"cudaMemcpy2DAsync {direction}")


def memset(dst: int, value: int, nbytes: int, device: int) -> None:
    """Set ``nbytes`` of device memory at ``dst`` to the byte ``value``."""
    with _on(device) as (rt, stream):
        _check(rt.cudaMemsetAsync(dst, value, nbytes, stream), "cudaMemsetAsync")
        _finish(rt, stream, "cudaMemsetAsync")


def memset_2d(dst: int, pitch: int, value: int, width: int, height: int, device: int) -> None:
    """Set ``height`` rows of ``width`` bytes, ``pitch`` apart, to the byte ``value``."""
    with _on(device) as (rt, stream):
        _check(rt.cudaMemset2DAsync(dst, pitch, value, width, height, stream), "cudaMemset2DAsync")
        _finish(rt, stream, "cudaMemset2DAsync")


def write(dst: int, data: bytes | npt.NDArray[Any], device: int) -> None:
    """Copy host bytes (``bytes`` or a contiguous array) to device memory at ``dst``."""
    host = np.ascontiguousarray(
        np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    )
    memcpy(dst, host.ctypes.data, host.nbytes, "h2d", device)


def read(src: int, nbytes: int, device: int) -> bytes:
    """``nbytes`` of device memory at ``src``, copied to the host."""
    host = np.empty(nbytes, dtype=np.uint8)
    memcpy(host.ctypes.data, src, nbytes, "d2h", device)
    return host.tobytes()
