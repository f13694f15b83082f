"""Device memory: engines and agents moving KV pages between CUDA buffers, bytes verified.

Every test here is marked ``gpu`` and skips without a CUDA device (cuda-python's
``cudaGetDeviceCount`` fails or finds none), and per engine when the installed build cannot
move device memory (Mooncake's non-CUDA wheel; a NIXL whose UCX backend does not list VRAM).
With ``TRIO_PD_REQUIRE_GPU=1`` in the environment (tools/gpu-check sets it) nothing skips: a
missing device or engine build fails the test that needs it, so a GPU host that cannot run
these is noticed instead of passing quietly.

The agent scenarios are helpers that take the engine factory: tests/test_memory_kinds.py
runs the same scenarios on a CUDA stand-in over host memory, so their logic is exercised on
every machine; here they run on the real device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import numpy as np
import pytest

from trio_pd.core._memory import MemoryKind
from trio_pd.engines import Region
from trio_pd.io import _cuda
from trio_pd.testing.device import engine_problem

from .helpers.device import (
    REQUIRE,
    abort_in_flight,
    engine_fault,
    gpu_engine,
    unavailable,
    verified_run,
)

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        _cuda.device_count() == 0 and not REQUIRE,
        reason="no CUDA device (cuda-python: cudaGetDeviceCount)",
    ),
]

NBYTES = 8 << 20
BLOCK = 128 << 10


ENGINES = ["mooncake", "nixl"]


@pytest.fixture(params=ENGINES)
def gpu_engine_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# ------------------------------------------------------------------------- engine alone


@contextmanager
def _device_buffer(nbytes: int) -> Iterator[int]:
    ptr = _cuda.malloc(nbytes, 0)
    try:
        _cuda.memset(ptr, 0, nbytes, 0)
        yield ptr
    finally:
        _cuda.free(ptr, 0)


@pytest.mark.parametrize("kind", ENGINES)
def test_device_to_device_write(kind: str) -> None:
    """One engine writes 64 scattered 128 KiB blocks from one CUDA buffer to another."""
    pattern = np.random.default_rng(11).integers(0, 256, NBYTES, dtype=np.uint8)
    with _device_buffer(NBYTES) as src, _device_buffer(NBYTES) as dst:
        _cuda.write(src, pattern, 0)  # a CUDA context exists before the engines are built
        writer = gpu_engine(kind)
        reader = gpu_engine(kind)
        try:
            assert _cuda.classify(src) == MemoryKind.cuda(0)
            writer.register([Region(src, NBYTES, MemoryKind.cuda(0))])
            reader.register([Region(dst, NBYTES, MemoryKind.cuda(0))])
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

            got = np.frombuffer(_cuda.read(dst, NBYTES, 0), dtype=np.uint8)
            want = np.empty_like(pattern)
            for i, j in enumerate(order.tolist()):
                want[j * BLOCK : (j + 1) * BLOCK] = pattern[i * BLOCK : (i + 1) * BLOCK]
            assert np.array_equal(got, want)
        finally:
            writer.close()
            reader.close()


# ------------------------------------------------------------------------- agent tests


@pytest.mark.parametrize("aux", ["device", "host"])
async def test_verified_room_on_device_pools(
    gpu_engine_name: str, bootstrap_url: str, aux: Literal["device", "host"]
) -> None:
    await verified_run(gpu_engine_name, bootstrap_url, aux=aux)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
async def test_tp_mismatch_on_device_pools(
    gpu_engine_name: str, bootstrap_url: str, prefill_tp: int, decode_tp: int
) -> None:
    """Prefill and decode split the KV heads differently: each prefill rank writes its heads
    into the slice of each decode rank's pages that holds them."""
    await verified_run(gpu_engine_name, bootstrap_url, prefill_tp=prefill_tp,
                       decode_tp=decode_tp)


async def test_abort_while_a_device_write_is_in_flight(
    gpu_engine_name: str, bootstrap_url: str
) -> None:
    await abort_in_flight(gpu_engine_name, bootstrap_url)


async def test_engine_fault_on_device_pools(gpu_engine_name: str, bootstrap_url: str) -> None:
    await engine_fault(gpu_engine_name, bootstrap_url)


# ------------------------------------------------------------------------- the demo


@pytest.mark.parametrize("processes", [False, True], ids=["in-process", "processes"])
def test_demo_on_device_pools(gpu_engine_name: str, processes: bool) -> None:
    """``trio-pd demo --device cuda``: every rank's pool on the device (TP 2 -> 1), aborts
    and engine faults, the sanitizer on; no page corrupt, written late or leaked, and every
    Success verified by reading the device pages back."""
    problem = engine_problem(gpu_engine_name)
    if problem is not None:
        unavailable(problem)
    cmd = [sys.executable, "-m", "trio_pd", "demo", "--json", "--device", "cuda",
           "--engine", gpu_engine_name, "--requests", "40", "--abort-rate", "0.2",
           "--fault-rate", "0.1", "--prefill-tp", "2", *(["--processes"] if processes else [])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert (summary["device"], summary["engine"]) == ("cuda", gpu_engine_name)
    for key in ("corrupt_pages", "source_uaf_pages", "late_writes", "leaked_pages", "hung",
                "released_by_timeout"):
        assert summary[key] == 0, (key, summary)
    assert summary["succeeded"] > 0 and summary["bytes"] > 0, summary
