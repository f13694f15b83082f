"""Memory kinds on a machine with no GPU: where each region lives, what the engines are asked to
register and to write, the aux row's device copies, describing a caller's buffers, and the
GPU test session's skip path.

Nothing here needs CUDA. Device memory is played by host memory in two ways:

* *fake kinds*: host buffers described as living on a CUDA device (``kv_kind=cuda(N)``). The
  real engines move host memory either way, so a full run works; what matters is what they
  were *asked*, which a recording wrapper around each real engine binding captures (Mooncake:
  ``batch_register_memory``; NIXL: the memory type and device id of every descriptor list,
  handed on to the real agent as DRAM, which is what the bytes really are).
* :class:`FakeRuntime`, a stand-in for ``cuda.bindings.runtime`` whose "device" allocations
  are host buffers it knows. It checks every copy as CUDA would (direction, bounds of the
  allocation, the current device), so the device pools of :mod:`trio_pd.testing.device`, the
  aux row's device copies and the GPU agent scenarios (tests/helpers/device.py) run
  here against it. Its functions take cuda-python's parameters (checked against the real
  module where cuda-python is installed).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import os
import pickle
import re
import subprocess
import sys
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio

from trio_pd import ConfigurationError, EngineError, KVPoll, open_decode, open_prefill
from trio_pd.core import _wire as wire
from trio_pd.core._memory import (
    HOST,
    MemoryKind,
    PoolSpec,
    Region,
    buffer_region,
    describe_pool,
    read_aux_stamp,
    stamp_aux_row,
)
from trio_pd.core._plan import concat, plan_aux, plan_pages, validate_blocks
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.engines import mooncake as mooncake_adapter
from trio_pd.io import _cuda
from trio_pd.testing.device import DeviceKVPool
from trio_pd.testing.pools import HostKVPool, PageAllocator

from .helpers import device as gpu
from .helpers.engines import ENGINES, HAVE_NIXL
from .helpers.fake_cuda import (
    Err,
    FakeRuntime,
    RecordingBinding,
    install_fake_cuda,
    recording_engine,
)

ROOT = Path(__file__).resolve().parent.parent
CUDA0, CUDA1 = MemoryKind.cuda(0), MemoryKind.cuda(1)
U64 = np.uint64


# ============================================================================ fixtures


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    """:func:`install_fake_cuda` for one test."""
    return install_fake_cuda(monkeypatch)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """No cuda-python, whatever this environment has."""
    monkeypatch.setattr(_cuda, "runtime", lambda: None)


def kinds_of(blocks: npt.NDArray[np.uint64], regions: list[Region]) -> list[str]:
    """The kind of the region each address lies in."""
    out = []
    for a in blocks.tolist():
        (r,) = [r for r in regions if r.base <= a < r.end]
        out.append(str(r.kind))
    return out


def mixed(pool: HostKVPool, kv_kind: MemoryKind, aux_kind: MemoryKind = HOST) -> PoolSpec:
    """``pool``'s layout with fake kinds: its host arrays described as living elsewhere."""
    s = pool.spec
    return describe_pool(
        layout=s.layout, page_size=s.page_size, num_layers=s.num_layers,
        head_bytes=s.head_bytes, heads=s.heads, first_head=s.first_head,
        buffers=[pool.kv[i] for i in range(s.num_buffers)], aux=pool.aux,
        aux_item_len=s.aux_item_len, kv_kind=kv_kind, aux_kind=aux_kind,
    )


def host_pool(**kw: Any) -> HostKVPool:
    args: dict[str, Any] = dict(layout="mha", num_pages=32, num_layers=2, page_size=4,
                                head_bytes=16, heads=2, aux_slots=8)
    return HostKVPool(**(args | kw))


# ============================================================================ classification


def _ptr(a: npt.NDArray[Any]) -> int:
    return int(a.ctypes.data)


def test_without_cuda_python_everything_is_host(no_cuda: None) -> None:
    a = np.zeros(64, np.uint8)
    assert _cuda.classify(_ptr(a)) == HOST
    assert _cuda.classify(0xDEAD0000) == HOST
    assert _cuda.device_count() == 0
    with pytest.raises(ConfigurationError, match="cuda-python"):
        _cuda.require_device(0)
    with pytest.raises(ConfigurationError, match="cuda-python"):
        DeviceKVPool(layout="mla", num_pages=4, num_layers=1, page_size=4, head_bytes=16)


def test_this_environment_without_cuda_python_imports_and_says_host() -> None:
    """The real import path: where cuda-python is not installed, ``runtime()`` is None."""
    try:
        present = importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:
        present = False
    if present:
        pytest.skip("cuda-python is installed here")
    _cuda.runtime.cache_clear()
    assert _cuda.runtime() is None
    assert _cuda.classify(_ptr(np.zeros(8, np.uint8))) == HOST


def test_classify_asks_cuda(fake_cuda: FakeRuntime) -> None:
    with _on_device(fake_cuda, 1):
        _, dev = fake_cuda.cudaMalloc(256)
    host = np.zeros(64, np.uint8)
    assert _cuda.classify(dev) == CUDA1
    assert _cuda.classify(dev + 255) == CUDA1
    assert _cuda.classify(_ptr(host)) == HOST
    fake_cuda.refuse_query.add(_ptr(host))
    assert _cuda.classify(_ptr(host)) == HOST  # a failed query is host, and leaves no error
    assert fake_cuda.last_error_cleared == 1
    assert _cuda.device_count() == 2


@contextmanager
def _on_device(fake: FakeRuntime, device: int) -> Iterator[None]:
    before = fake.current
    fake.cudaSetDevice(device)
    try:
        yield
    finally:
        fake.cudaSetDevice(before)


def test_cuda_python_without_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda-python present, no driver: classification says host, no device is counted, and
    a device pool says why it cannot be built."""
    fake = FakeRuntime(driver=False)
    monkeypatch.setattr(_cuda, "runtime", lambda: fake)
    assert _cuda.classify(_ptr(np.zeros(8, np.uint8))) == HOST
    assert _cuda.device_count() == 0
    with pytest.raises(ConfigurationError, match=r"needs a CUDA device.*InsufficientDriver"):
        DeviceKVPool(layout="mla", num_pages=4, num_layers=1, page_size=4, head_bytes=16)


def test_real_cuda_python_without_a_device() -> None:
    """The same with the real cuda-python, where it is installed on a machine with no GPU."""
    _cuda.runtime.cache_clear()
    if _cuda.runtime() is None:
        pytest.skip("cuda-python cannot be loaded")
    if _cuda.device_count():
        pytest.skip("this machine has a CUDA device")
    assert _cuda.classify(_ptr(np.zeros(8, np.uint8))) == HOST
    with pytest.raises(ConfigurationError, match="needs a CUDA device"):
        DeviceKVPool(layout="mla", num_pages=4, num_layers=1, page_size=4, head_bytes=16)


def test_fake_runtime_has_cuda_pythons_parameters() -> None:
    """Every function the stand-in offers takes the parameters cuda-python's does, and its
    enums have cuda-python's values (where cuda-python is installed)."""
    _cuda.runtime.cache_clear()
    real = _cuda.runtime()
    if real is None:
        pytest.skip("cuda-python is not installed")
    for name, fn in inspect.getmembers(FakeRuntime, inspect.isfunction):
        if not name.startswith("cuda"):
            continue
        first = (getattr(real, name).__doc__ or "").strip().splitlines()[0]
        doc_params = re.fullmatch(rf"{name}\((.*)\)", first)
        assert doc_params, first
        want = [p.split(":")[0].split()[-1] for p in doc_params.group(1).split(",") if p.strip()]
        got = list(inspect.signature(fn).parameters)[1:]
        assert got == want, name
    for enum_name in ("cudaMemoryType", "cudaMemcpyKind"):
        for member in getattr(FakeRuntime, enum_name):
            assert int(getattr(getattr(real, enum_name), member.name)) == member.value
    for member in Err:
        assert int(getattr(real.cudaError_t, member.name)) == member.value
    assert int(real.cudaStreamNonBlocking) == FakeRuntime.cudaStreamNonBlocking


# ============================================================================ kinds and pools


def test_memory_kind_values() -> None:
    assert MemoryKind.host() == HOST and not HOST.is_device and str(HOST) == "host"
    assert MemoryKind.cuda(3).is_device and str(MemoryKind.cuda(3)) == "cuda:3"
    with pytest.raises(ConfigurationError):
        MemoryKind.cuda(-1)
    with pytest.raises(ConfigurationError):
        MemoryKind(True)  # type: ignore[arg-type]


def test_pool_kinds_are_stated_per_region_and_kept_out_of_the_layout() -> None:
    pool = host_pool()
    spec = mixed(pool, CUDA0)
    assert spec.region_kinds == (CUDA0, CUDA0, CUDA0, CUDA0, HOST)
    assert [r.kind for r in spec.regions()] == [CUDA0] * 4 + [HOST]
    assert [r.base for r in spec.regions()] == [r.base for r in pool.spec.regions()]
    assert spec == pool.spec  # the same layout: kinds are no part of it
    assert spec.aux_kind == HOST and pool.spec.aux_kind == HOST  # (numpy memory: host)
    plain = dataclasses.replace(pool.spec)  # (replace drops the kinds)
    assert plain == pool.spec and plain.aux_kind is None
    assert [r.kind for r in plain.regions()] == [None] * 5  # unstated, as before kinds
    # the wire form is the layout's: a peer is not told our kinds
    form = wire.PoolWire.from_spec(spec)
    assert form == wire.PoolWire.from_spec(pool.spec)
    assert form.to_spec().region_kinds is None
    for twin in (copy.copy(spec), copy.deepcopy(spec), pickle.loads(pickle.dumps(spec))):
        assert twin.region_kinds == spec.region_kinds
    with pytest.raises(ConfigurationError, match="one per KV buffer"):
        PoolSpec("mla", 4, 8, 1, 16, 1, 0, (1000,), 5000, 32, 4, kinds=(CUDA0,))
    with pytest.raises(ConfigurationError, match="MemoryKind"):
        PoolSpec("mla", 4, 8, 1, 16, 1, 0, (1000,), 5000, 32, 4,
                 kinds=("cuda:0", "host"))  # type: ignore[arg-type]


def test_describe_pool_refuses_buffers_that_cannot_hold_the_layout() -> None:
    pool = host_pool()
    s = pool.spec
    base: dict[str, Any] = dict(layout="mha", page_size=4, num_layers=2, head_bytes=16,
                                heads=2, aux_item_len=64, kv_kind=CUDA0)
    kv = [pool.kv[i] for i in range(s.num_buffers)]
    with pytest.raises(ConfigurationError, match="4 KV buffers, got 3"):
        describe_pool(buffers=kv[:3], aux=pool.aux, **base)
    with pytest.raises(ConfigurationError, match="fewer than 33 pages"):
        describe_pool(buffers=kv, aux=pool.aux, num_pages=33, **base)
    with pytest.raises(ConfigurationError, match="overlap"):
        describe_pool(buffers=[kv[0], kv[0], kv[2], kv[3]], aux=pool.aux, **base)
    with pytest.raises(ConfigurationError, match="16-byte stamp"):
        describe_pool(buffers=kv, aux=pool.aux, **(base | {"aux_item_len": 8}))
    with pytest.raises(ConfigurationError, match="fewer than 9 rows"):
        describe_pool(buffers=kv, aux=pool.aux, aux_slots=9, **base)
    got = describe_pool(buffers=kv, aux=pool.aux, **base)
    assert (got.num_pages, got.aux_slots) == (32, 8)  # what the buffers hold


# ---------------------------------------------------------------------------- stub buffers


class CudaArray:
    """A CuPy/Numba-style device array: only ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str = "<f2",
                 strides: tuple[int, ...] | None = None) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": typestr, "data": (ptr, False), "strides": strides,
            "version": 3,
        }


class Tensor:
    """A PyTorch-style tensor: ``data_ptr()``, sizes, ``device.type`` / ``device.index``."""

    def __init__(self, ptr: int, numel: int, element_size: int, device: Any = None,
                 contiguous: bool = True) -> None:
        self._ptr, self._numel, self._size, self._contiguous = ptr, numel, element_size, contiguous
        if device is not None:
            self.device = device

    def data_ptr(self) -> int:
        return self._ptr

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._size

    def is_contiguous(self) -> bool:
        return self._contiguous


def test_cuda_array_interface_buffers(fake_cuda: FakeRuntime) -> None:
    _, dev = fake_cuda.cudaMalloc(4096)
    assert buffer_region(CudaArray(dev, (8, 128))) == Region(dev, 2048, CUDA0)  # classified
    assert buffer_region(CudaArray(dev, (8, 128), strides=(256, 2))) == Region(dev, 2048, CUDA0)
    with pytest.raises(ConfigurationError, match="not contiguous"):
        buffer_region(CudaArray(dev, (8, 64), strides=(256, 2)))  # every other row
    assert buffer_region(CudaArray(dev, (16,), "|u1"), CUDA1).kind == CUDA1  # kind= wins


def test_cuda_array_interface_without_cuda_python_needs_a_kind(no_cuda: None) -> None:
    with pytest.raises(ConfigurationError, match="kind="):
        buffer_region(CudaArray(0x7000_0000, (8, 128)))
    got = buffer_region(CudaArray(0x7000_0000, (8, 128)), MemoryKind.cuda(2))
    assert got == Region(0x7000_0000, 2048, MemoryKind.cuda(2))


def test_data_ptr_buffers(no_cuda: None) -> None:
    cuda3 = SimpleNamespace(type="cuda", index=3)
    assert buffer_region(Tensor(0x9000, 100, 4, cuda3)) == Region(0x9000, 400, MemoryKind.cuda(3))
    cpu = SimpleNamespace(type="cpu", index=None)
    assert buffer_region(Tensor(0x9000, 100, 4, cpu)) == Region(0x9000, 400, HOST)
    with pytest.raises(ConfigurationError, match="not contiguous"):
        buffer_region(Tensor(0x9000, 100, 4, cuda3, contiguous=False))
    # no device attribute: the pointer is classified (host without cuda-python)
    assert buffer_region(Tensor(0x9000, 10, 2)) == Region(0x9000, 20, HOST)


def test_data_ptr_without_a_device_is_classified(fake_cuda: FakeRuntime) -> None:
    _, dev = fake_cuda.cudaMalloc(512)
    assert buffer_region(Tensor(dev, 128, 4)) == Region(dev, 512, CUDA0)


def test_raw_pointers_and_arrays(no_cuda: None) -> None:
    a = np.zeros((4, 32), np.uint8)
    assert buffer_region(a) == Region(_ptr(a), 128, HOST)
    assert buffer_region((0x5000, 64)) == Region(0x5000, 64, HOST)
    assert buffer_region((np.uint64(0x5000), 64), CUDA1) == Region(0x5000, 64, CUDA1)
    with pytest.raises(ConfigurationError, match="address, nbytes"):
        buffer_region((0x5000, 64, 1))
    with pytest.raises(ConfigurationError, match="cannot describe"):
        buffer_region("0x5000")
    with pytest.raises(ConfigurationError, match="an address and a size"):
        buffer_region((0x5000, 0))


def test_describe_pool_of_stub_tensors(no_cuda: None) -> None:
    """A caller's pool of tensors (no framework imported): each region takes its tensor's
    device; the aux tensor lives in host memory."""
    cuda0 = SimpleNamespace(type="cuda", index=0)
    item = 4 * 2 * 16
    kv = [Tensor(0x10_0000 + i * 0x10_000, 64 * item // 2, 2, cuda0) for i in range(4)]
    aux = Tensor(0x90_0000, 8 * 64, 1, SimpleNamespace(type="cpu", index=None))
    spec = describe_pool(layout="mha", page_size=4, num_layers=2, head_bytes=16, heads=2,
                         buffers=kv, aux=aux, aux_item_len=64)
    assert spec.num_pages == 64 and spec.aux_slots == 8
    assert spec.buffer_bases == tuple(t.data_ptr() for t in kv)
    assert spec.region_kinds == (CUDA0,) * 4 + (HOST,)


# ============================================================================ planning


def test_mixed_pool_plans_every_block_inside_a_region_of_its_kind() -> None:
    """Device KV buffers and a host aux row on the source; KV and aux on another device on
    the destination. The planned KV blocks go cuda:0 -> cuda:1, the aux block host ->
    cuda:1, and all lie inside the destination's registered regions."""
    src_mem, dst_mem = host_pool(), host_pool()
    src, dst = mixed(src_mem, CUDA0), mixed(dst_mem, CUDA1, CUDA1)
    kv = plan_pages(src, dst, np.array([1, 2, 3, 9]), np.array([7, 8, 9, 20]))
    aux = plan_aux(src, dst, 3, 5)
    blocks = concat([kv, aux])
    validate_blocks(blocks, dst.regions())
    assert kinds_of(blocks.src, src.regions()) == ["cuda:0"] * len(kv.src) + ["host"]
    assert kinds_of(blocks.dst, dst.regions()) == ["cuda:1"] * len(blocks.dst)


# ============================================================================ registration


def test_mooncake_registers_each_region_at_its_location(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mooncake_adapter, "_cuda_build", lambda: True)
    calls: list[tuple[Any, ...]] = []
    spec, spare = mixed(host_pool(), CUDA1), np.zeros(64, np.uint8)
    with recording_engine("mooncake", calls) as engine:  # type: ignore[attr-defined]
        engine.register(spec.regions())
        engine.register([Region(_ptr(spare), 64)])
    kv = [r for r in spec.regions() if r.kind == CUDA1]
    assert calls[0] == ("register", "cuda:1", [r.base for r in kv], [r.length for r in kv])
    assert calls[1] == ("register", "*", [spec.aux_base], [spec.aux_slots * spec.aux_item_len])
    assert calls[2][1] == "*"  # a region of unstated kind: Mooncake finds its location


def test_mooncake_non_cuda_build_refuses_device_regions() -> None:
    if mooncake_adapter._cuda_build():
        pytest.skip("the CUDA build of Mooncake is installed")
    calls: list[tuple[Any, ...]] = []
    spec = mixed(host_pool(), CUDA0)
    with recording_engine("mooncake", calls) as engine:  # type: ignore[attr-defined]
        with pytest.raises(EngineError, match="CUDA build"):
            engine.register(spec.regions())
        assert calls == [] and engine._registered == {}


def test_mooncake_failed_second_location_undoes_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mooncake_adapter, "_cuda_build", lambda: True)
    spec = mixed(host_pool(), CUDA0)
    with make_engine("mooncake") as engine:
        log: list[tuple[str, list[int]]] = []
        real = engine._engine  # type: ignore[attr-defined]

        class Failing:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            def batch_register_memory(self, bases: list[int], lens: list[int], loc: str) -> int:
                log.append(("register", bases))
                return -1 if loc == "*" else int(real.batch_register_memory(bases, lens, loc))

            def batch_unregister_memory(self, bases: list[int]) -> int:
                log.append(("unregister", bases))
                return int(real.batch_unregister_memory(bases))

        engine._engine = Failing()  # type: ignore[attr-defined]
        with pytest.raises(EngineError, match="'\\*' returned -1"):
            engine.register(spec.regions())
        kv_bases = list(spec.buffer_bases)
        assert log == [("register", kv_bases), ("register", [spec.aux_base]),
                       ("unregister", kv_bases)]
        assert engine._registered == {}  # type: ignore[attr-defined]
        engine._engine = real  # type: ignore[attr-defined]


needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="nixl-cu12 not installed")


@needs_nixl
def test_nixl_registers_each_region_with_its_memory_type() -> None:
    """VRAM with the device id for device regions, DRAM for host ones, and the engine's own
    mem_type / device_id for a region of unstated kind; all in one agent."""
    calls: list[tuple[Any, ...]] = []
    spec = mixed(host_pool(), MemoryKind.cuda(1))
    spare = np.zeros(64, np.uint8)
    with make_engine("nixl", mem_type="VRAM", device_id=2) as engine:
        engine._agent = RecordingBinding(engine._agent, calls)  # type: ignore[attr-defined]
        engine.register([*spec.regions(), Region(_ptr(spare), 64)])
        regs = [(mem, rows[0][2]) for _, mem, rows in calls]
        assert regs == [("VRAM", 1)] * 4 + [("DRAM", 0), ("VRAM", 2)]
        # and the peer is told: the header lists each region with its kind
        listed, rest = nixl_adapter()._unpack_metadata(engine.metadata())
        assert listed is not None and rest
        assert sorted((r.base, r.length, r.kind) for r in listed) == sorted(
            [(r.base, r.length, r.kind) for r in spec.regions()]
            + [(_ptr(spare), 64, MemoryKind.cuda(2))]
        )


def nixl_adapter() -> Any:
    from trio_pd.engines import nixl

    return nixl


@needs_nixl
def test_nixl_metadata_header_is_checked() -> None:
    nixl = nixl_adapter()
    regions = [Region(0x1000, 64, CUDA1), Region(0x2000, 8, HOST)]
    packed = nixl._pack_metadata(regions, b"agent-bytes")
    assert nixl._unpack_metadata(packed) == (regions, b"agent-bytes")
    assert nixl._unpack_metadata(b"raw nixl metadata") == (None, b"raw nixl metadata")
    with pytest.raises(EngineError, match="malformed"):
        nixl._unpack_metadata(packed[: len(nixl._META_MAGIC) + 10])
    with make_engine("nixl") as engine, pytest.raises(EngineError, match="malformed"):
        engine.add_peer("someone", packed[:-20])


@needs_nixl
def test_nixl_write_posts_one_request_per_pair_of_memory_types() -> None:
    """KV pages cuda:0 -> cuda:1 and the aux row host -> cuda:1 in one write: two NIXL
    requests, each with its own local and remote types and device ids; the bytes land."""
    src_mem, dst_mem = host_pool(), host_pool()
    src, dst = mixed(src_mem, CUDA0), mixed(dst_mem, CUDA1, CUDA1)
    src_mem.fill(np.arange(4), room=5)
    src_mem.aux[3] = 0xAB
    kv = plan_pages(src, dst, np.arange(4), np.arange(10, 14))
    blocks = concat([kv, plan_aux(src, dst, 3, 6)])
    calls: list[tuple[Any, ...]] = []
    with make_engine("nixl") as writer, make_engine("nixl") as reader:
        writer._agent = RecordingBinding(writer._agent, calls)  # type: ignore[attr-defined]
        reader._agent = RecordingBinding(reader._agent, [])  # type: ignore[attr-defined]
        writer.register(src.regions())
        reader.register(dst.regions())
        writer.add_peer(reader.session_id, reader.metadata())
        del calls[:]
        writer.write(reader.session_id, *blocks)
    xfers = [(mem, set(devs), len(devs)) for _, mem, devs, _ in calls]
    n = len(kv.src)
    assert sorted(xfers) == sorted([
        ("VRAM", {0}, n), ("VRAM", {1}, n),  # the KV request: local, remote
        ("DRAM", {0}, 1), ("VRAM", {1}, 1),  # the aux request: local, remote
    ])
    assert np.array_equal(dst_mem.kv[:, 10:14, :], src_mem.expected(5, 4))
    assert (dst_mem.aux[6] == 0xAB).all()


@needs_nixl
def test_nixl_refused_part_posts_nothing() -> None:
    """The second request of a two-part write is refused: the first, already built, is
    released unposted, and the write raises before any byte moves."""
    src_mem, dst_mem = host_pool(), host_pool()
    src, dst = mixed(src_mem, CUDA0), mixed(dst_mem, CUDA0)
    blocks = concat([plan_pages(src, dst, [0], [1]), plan_aux(src, dst, 0, 0)])
    with make_engine("nixl") as writer, make_engine("nixl") as reader:
        calls: list[tuple[Any, ...]] = []
        writer._agent = RecordingBinding(writer._agent, calls)  # type: ignore[attr-defined]
        reader._agent = RecordingBinding(reader._agent, [])  # type: ignore[attr-defined]
        writer.register(src.regions())
        reader.register(dst.regions())
        writer.add_peer(reader.session_id, reader.metadata())
        real = writer._agent._inner  # type: ignore[attr-defined]
        log: list[str] = []

        class Refusing(RecordingBinding):
            def initialize_xfer(self, *args: Any) -> Any:
                if log.count("init"):
                    raise RuntimeError("refused")
                log.append("init")
                return real.initialize_xfer(*args)

            def release_xfer_handle(self, handle: Any) -> None:
                log.append("release")
                real.release_xfer_handle(handle)

            def transfer(self, handle: Any) -> str:
                log.append("transfer")
                return str(real.transfer(handle))

        writer._agent = Refusing(real, calls)  # type: ignore[attr-defined]
        with pytest.raises(EngineError, match="refused"):
            writer.submit(reader.session_id, *blocks)  # type: ignore[attr-defined]
        assert log == ["init", "release"]
        assert (dst_mem.kv[:, 1, :] == 0).all()


# ============================================================================ the aux row


def test_host_aux_row_is_written_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_device_copy(*_a: object) -> None:
        raise AssertionError("a host row went through a device copy")

    monkeypatch.setattr(_cuda, "memcpy", no_device_copy)
    pool = host_pool()
    for spec in (pool.spec, mixed(pool, CUDA0)):  # unstated kinds, and a stated host aux
        stamp_aux_row(spec, 2, room=77, epoch=5)
        assert read_aux_stamp(spec, 2) == (77, 5)
        assert bytes(pool.aux[2, :16]) == (77).to_bytes(8, "little") + (5).to_bytes(8, "little")


def test_device_aux_row_goes_through_device_copies(fake_cuda: FakeRuntime) -> None:
    with DeviceKVPool(layout="mla", num_pages=4, num_layers=1, page_size=4, head_bytes=16,
                      aux_slots=4, device=1) as pool:
        del fake_cuda.calls[:]
        stamp_aux_row(pool.spec, 3, room=(1 << 40) + 7, epoch=9)
        row = pool.spec.aux_base + 3 * pool.spec.aux_item_len
        assert fake_cuda.calls == [("memcpy", "cudaMemcpyHostToDevice", row, 16, 1)]
        assert read_aux_stamp(pool.spec, 3) == ((1 << 40) + 7, 9)
        assert fake_cuda.calls[-1][:2] == ("memcpy", "cudaMemcpyDeviceToHost")
        assert pool.aux_row(3)[:16] == ((1 << 40) + 7).to_bytes(8, "little") + bytes([9] + [0] * 7)
        assert fake_cuda.current == 0  # the thread's device is put back


# ============================================================================ device pools


def test_device_pool_layout_and_copies(fake_cuda: FakeRuntime) -> None:
    with DeviceKVPool(layout="mha", num_pages=16, num_layers=2, page_size=4, head_bytes=8,
                      heads=2, aux_slots=4, device=1) as pool:
        spec = pool.spec
        assert spec.region_kinds == (CUDA1,) * 5
        assert all(fake_cuda.device_of(r.base, r.length) == 1 for r in spec.regions())
        assert not pool.kv().any()  # zeroed, though cudaMalloc gave 0xCC
        pages = np.array([5, 0, 15, 6])
        pool.fill(pages, room=3)
        assert np.array_equal(pool.read(pages), pool.expected(3, 4))
        kv = pool.kv()
        assert np.array_equal(kv[:, pages, :], pool.expected(3, 4))
        assert not np.delete(kv, pages, axis=1).any()  # nothing outside those pages
        pool.fill_aux(2, room=3)
        assert pool.aux_ok(2, room=3) and not pool.aux_ok(1, room=3)
    assert fake_cuda.allocs == {}  # freed


def test_device_pool_with_host_aux(fake_cuda: FakeRuntime) -> None:
    with DeviceKVPool(layout="mla", num_pages=8, num_layers=2, page_size=4, head_bytes=16,
                      aux_slots=4, aux="host") as pool:
        assert pool.spec.region_kinds == (CUDA0, CUDA0, HOST)
        assert pool.aux is not None and pool.spec.aux_base == _ptr(pool.aux)
        pool.fill_aux(1, room=8)
        assert pool.aux_ok(1, room=8)


def test_device_pool_sanitizer_poisons_and_sees_late_writes(fake_cuda: FakeRuntime) -> None:
    """The lifetime sanitizer on device rows: released pages are poisoned with cudaMemset,
    and a write into a released page is counted when the page is handed out again."""
    with DeviceKVPool(layout="mha", num_pages=8, num_layers=2, page_size=4, head_bytes=8,
                      heads=2, aux_slots=4) as pool:
        alloc = PageAllocator(pool.page_rows(), 0x5A)
        aux = PageAllocator(pool.aux_rows(), 0x5A)
        assert (pool.kv() == 0x5A).all()
        ids = alloc.alloc_nowait(8)
        assert ids is not None and alloc.late_writes == 0
        pool.fill(np.array([2, 3, 6]), room=1)
        alloc.free(np.array([2, 3, 6]))
        assert (pool.read(np.array([2, 3, 6])) == 0x5A).all()
        # a late write into page 3 of buffer 2 only
        late = pool.spec.buffer_bases[2] + 3 * pool.item_len + 5
        _cuda.memset(late, 7, 1, 0)
        assert alloc.late_in_free_rows() == 1
        got = alloc.alloc_nowait(3)
        assert got is not None and alloc.late_writes == 1
        slot = aux.alloc_nowait(1)
        assert slot is not None and aux.late_writes == 0


# ============================================================================ agents


@asynccontextmanager
async def kinds_pair(
    engine_name: str, url: str, src: PoolSpec, dst: PoolSpec, calls: list[tuple[Any, ...]],
) -> AsyncIterator[tuple[Any, Any]]:
    """A prefill and a decode agent on recording engines (their calls go to ``calls``)."""
    pe = recording_engine(engine_name, calls)
    de = recording_engine(engine_name, calls)
    try:
        async with AsyncExitStack() as stack:
            prefill = await stack.enter_async_context(
                open_prefill(engine=pe, pool=src, bootstrap_url=url, kv_heads=2))
            decode = await stack.enter_async_context(open_decode(engine=de, pool=dst))
            yield prefill, decode
    finally:
        pe.close()
        de.close()


@pytest.mark.parametrize("engine_name", ENGINES)
async def test_mixed_kind_pools_end_to_end(
    engine_name: str, bootstrap_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Agents on pools whose KV buffers are described as device memory and whose aux buffers
    are host memory: the room succeeds with every byte in place, and each engine was asked
    to register and write each region as its kind."""
    monkeypatch.setattr(mooncake_adapter, "_cuda_build", lambda: True)
    src_mem, dst_mem = host_pool(), host_pool()
    src, dst = mixed(src_mem, CUDA0), mixed(dst_mem, CUDA1)
    calls: list[tuple[Any, ...]] = []
    async with kinds_pair(engine_name, bootstrap_url, src, dst, calls) as (prefill, decode):
        room, src_pages, dst_pages = 17, np.array([4, 5, 9]), np.array([30, 2, 3])
        src_mem.fill(src_pages, room)
        src_mem.fill_aux(1, room)
        sender = prefill.sender(room, num_pages=3, aux_slot=1)
        receiver = decode.receiver(room, bootstrap_url=bootstrap_url)
        receiver.init(dst_pages, 4)
        sender.send(src_pages, last=True)
        with trio.fail_after(20):
            assert await receiver.wait() is KVPoll.Success, receiver.failure
            assert await sender.wait() is KVPoll.Success, sender.failure
        assert np.array_equal(dst_mem.kv[:, dst_pages, :], src_mem.expected(room, 3))
        assert dst_mem.aux_ok(4, room)
    if engine_name == "mooncake":
        registered = {(loc, tuple(bases)) for _, loc, bases, _ in calls}
        assert registered == {
            ("cuda:0", src.buffer_bases), ("*", (src.aux_base,)),
            ("cuda:1", dst.buffer_bases), ("*", (dst.aux_base,)),
        }
    else:
        regs = sorted((c[1], c[2][0][2], c[2][0][0]) for c in calls if c[0] == "reg")
        assert regs == sorted(
            [("VRAM", 0, b) for b in src.buffer_bases] + [("DRAM", 0, src.aux_base)]
            + [("VRAM", 1, b) for b in dst.buffer_bases] + [("DRAM", 0, dst.aux_base)]
        )
        xfers = [(c[1], sorted(set(c[2]))) for c in calls if c[0] == "xfer"]
        # one write of KV and aux: a request cuda:0 -> cuda:1, one host -> host
        assert sorted(xfers) == [("DRAM", [0]), ("DRAM", [0]), ("VRAM", [0]), ("VRAM", [1])]


def fake_device_engine(name: str) -> TransferEngine:
    """For the GPU scenarios on the CUDA stand-in: a real engine that records (NIXL: and
    registers its fake VRAM as the host memory it is)."""
    return recording_engine(name)


@pytest.mark.usefixtures("fake_cuda")
@pytest.mark.parametrize("engine_name", ENGINES)
class TestGpuScenariosOnTheStandIn:
    """tests/test_gpu.py's agent scenarios, on device pools of the CUDA stand-in."""

    @pytest.mark.parametrize("aux", ["device", "host"])
    async def test_verified_run(self, engine_name: str, bootstrap_url: str, aux: Any) -> None:
        await gpu.verified_run(engine_name, bootstrap_url, engines=fake_device_engine, aux=aux)

    @pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2)])
    async def test_tp_mismatch(self, engine_name: str, bootstrap_url: str, p: int,
                               d: int) -> None:
        await gpu.verified_run(engine_name, bootstrap_url, engines=fake_device_engine,
                               prefill_tp=p, decode_tp=d)

    async def test_abort_in_flight(self, engine_name: str, bootstrap_url: str) -> None:
        await gpu.abort_in_flight(engine_name, bootstrap_url, engines=fake_device_engine)

    async def test_engine_fault(self, engine_name: str, bootstrap_url: str) -> None:
        await gpu.engine_fault(engine_name, bootstrap_url, engines=fake_device_engine)


# ============================================================================ the skip path


def test_gpu_session_accepts_no_tests_collected() -> None:
    """``nox -s gpu_tests`` runs every gpu-marked test and counts pytest's exit code 5 (no
    tests collected) as a pass, as it counts all-skipped (exit 0)."""
    sys.path.insert(0, str(ROOT))
    try:
        with warnings.catch_warnings():  # nox warns if its sessions were registered before
            warnings.simplefilter("ignore", FutureWarning)
            noxfile = importlib.import_module("noxfile")
    finally:
        sys.path.remove(str(ROOT))
    runs: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    session = SimpleNamespace(posargs=[], run=lambda *a, **kw: runs.append((a, kw)))
    noxfile.gpu_tests(session)
    ((args, kw),) = runs
    assert args[0] == "pytest" and "-m" in args and args[args.index("-m") + 1] == "gpu"
    assert set(kw.get("success_codes", [0])) >= {0, 5}


def _gpu_pytest(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs",
         "tests/test_gpu.py"],
        cwd=ROOT, env=os.environ | env, capture_output=True, text=True, timeout=120,
        check=False,
    )


def test_gpu_tests_skip_without_a_device_and_fail_when_required() -> None:
    if _cuda.device_count():
        pytest.skip("this machine has a CUDA device")
    skipped = _gpu_pytest({"TRIO_PD_REQUIRE_GPU": ""})
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert "skipped" in skipped.stdout and "passed" not in skipped.stdout
    assert "no CUDA device" in skipped.stdout
    required = _gpu_pytest({"TRIO_PD_REQUIRE_GPU": "1"})
    assert required.returncode == 1, required.stdout + required.stderr
    assert "needs" in required.stdout  # the reason: cuda-python or a device is missing
