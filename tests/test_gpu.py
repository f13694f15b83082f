"""Device-memory smoke test: one engine writes between two CUDA buffers, bytes verified.

Skips without a CUDA device (cuda-python's ``cudaGetDeviceCount`` fails or finds none), and
per engine when the installed build cannot move device memory (Mooncake's non-CUDA wheel;
a NIXL whose UCX backend does not list VRAM).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from trio_pd.engines import Region, TransferEngine, make_engine

pytestmark = pytest.mark.gpu

NBYTES = 8 << 20
BLOCK = 128 << 10


def _runtime() -> Any:
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    return runtime


def _device_count() -> int:
    rt = _runtime()
    if rt is None:
        return 0
    try:
        err, count = rt.cudaGetDeviceCount()
    except Exception:  # no driver at all
        return 0
    return int(count) if err == rt.cudaError_t.cudaSuccess else 0


if _device_count() == 0:
    pytest.skip("no CUDA device (cuda-python: cudaGetDeviceCount)", allow_module_level=True)

rt = _runtime()


def _check(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if rest else None


@contextmanager
def _device_buffer(nbytes: int) -> Iterator[int]:
    ptr = int(_check(rt.cudaMalloc(nbytes), "cudaMalloc"))
    try:
        _check(rt.cudaMemset(ptr, 0, nbytes), "cudaMemset")
        yield ptr
    finally:
        _check(rt.cudaFree(ptr), "cudaFree")


def _to_device(ptr: int, host: npt.NDArray[np.uint8]) -> None:
    kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
    _check(rt.cudaMemcpy(ptr, host.ctypes.data, host.nbytes, kind), "cudaMemcpy H2D")


def _from_device(ptr: int, nbytes: int) -> npt.NDArray[np.uint8]:
    host = np.empty(nbytes, dtype=np.uint8)
    kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    _check(rt.cudaMemcpy(host.ctypes.data, ptr, nbytes, kind), "cudaMemcpy D2H")
    return host


def _mooncake_has_cuda() -> bool:
    """The CUDA build is the `mooncake-transfer-engine` distribution; the non-CUDA wheel
    (same module name) would treat a device pointer as host memory and crash."""
    try:
        importlib.metadata.distribution("mooncake-transfer-engine")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _make(kind: str) -> TransferEngine:
    if kind == "nixl":
        return make_engine("nixl", mem_type="VRAM", device_id=0)
    return make_engine(kind)


def _first_engine(kind: str) -> TransferEngine:
    """The first engine of the test, or a skip if this build cannot move device memory."""
    if kind == "mooncake":
        if importlib.util.find_spec("mooncake") is None:
            pytest.skip("mooncake not installed")
        if not _mooncake_has_cuda():
            pytest.skip("the installed Mooncake wheel is the non-CUDA build")
        return _make(kind)
    if importlib.util.find_spec("nixl_cu12") is None:
        pytest.skip("nixl_cu12 not installed")
    engine = _make(kind)
    mems = engine._agent.get_backend_mem_types("UCX")  # type: ignore[attr-defined]
    if not any("VRAM" in str(m) for m in mems):  # "VRAM_SEG"
        engine.close()
        pytest.skip(f"NIXL's UCX backend does not support VRAM here (it lists {mems})")
    return engine


@pytest.mark.parametrize("kind", ["mooncake", "nixl"])
def test_device_to_device_write(kind: str) -> None:
    _check(rt.cudaSetDevice(0), "cudaSetDevice")
    pattern = np.random.default_rng(11).integers(0, 256, NBYTES, dtype=np.uint8)
    with _device_buffer(NBYTES) as src, _device_buffer(NBYTES) as dst:
        _to_device(src, pattern)  # a CUDA context exists before the engines are built
        writer = _first_engine(kind)
        reader = _make(kind)
        try:
            writer.register([Region(src, NBYTES)])
            reader.register([Region(dst, NBYTES)])
            writer.add_peer(reader.session_id, reader.metadata())

            n = NBYTES // BLOCK
            order = np.random.default_rng(12).permutation(n)
            src_off = np.arange(n, dtype=np.uint64) * np.uint64(BLOCK)
            dst_off = order.astype(np.uint64) * np.uint64(BLOCK)
            writer.write(
                reader.session_id,
                src_off + np.uint64(src),
                dst_off + np.uint64(dst),
                np.full(n, BLOCK, dtype=np.uint64),
            )

            got = _from_device(dst, NBYTES)
            want = np.empty_like(pattern)
            for i, j in enumerate(order.tolist()):
                want[j * BLOCK : (j + 1) * BLOCK] = pattern[i * BLOCK : (i + 1) * BLOCK]
            assert np.array_equal(got, want)
        finally:
            writer.close()
            reader.close()
