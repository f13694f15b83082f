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
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pytest
import trio

from trio_pd import (
    DecodeAgent,
    EngineError,
    KVPoll,
    PrefillAgent,
    PrefillConfig,
    _cuda,
    open_decode,
    open_prefill,
)
from trio_pd._memory import MemoryKind
from trio_pd._topology import head_range
from trio_pd.engines import Region, TransferEngine, make_engine
from trio_pd.engines.fault import Fault, FaultEngine, Policy
from trio_pd.testing.device import DeviceKVPool, engine_problem

REQUIRE = os.environ.get("TRIO_PD_REQUIRE_GPU") == "1"
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
#: bound on every wait for something that must happen
BOUND = 20.0
#: how long a test watches for something that must not happen
QUIET = 0.3
KV_HEADS = 2

EngineFactory = Callable[[str], TransferEngine]


def unavailable(reason: str) -> None:
    """Skip, or fail where ``TRIO_PD_REQUIRE_GPU=1`` says this host must run the test."""
    if REQUIRE:
        pytest.fail(f"TRIO_PD_REQUIRE_GPU=1, but {reason}", pytrace=False)
    pytest.skip(reason)


def gpu_engine(kind: str) -> TransferEngine:
    """An engine that can move device memory, or a skip saying why this build cannot
    (:func:`trio_pd.testing.device.engine_problem`, which ``demo --device cuda`` asks too)."""
    problem = engine_problem(kind)
    if problem is not None:
        unavailable(problem)
    return make_engine(kind)


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


# ------------------------------------------------------------------------- agent scenarios


def device_pool(rank: int, tp: int, aux: Literal["device", "host"] = "device") -> DeviceKVPool:
    first, heads = head_range(rank, tp, KV_HEADS)
    return DeviceKVPool(
        layout="mha", num_pages=64, num_layers=2, page_size=4, head_bytes=16, heads=heads,
        first_head=first, aux_slots=16, aux=aux,
    )


@dataclass
class DeviceCluster:
    """P prefill ranks and D decode ranks of one instance on device pools; each prefill
    engine is wrapped in a :class:`FaultEngine` (no faults unless a policy is set)."""

    url: str
    prefills: list[PrefillAgent]
    decodes: list[DecodeAgent]
    srcs: list[DeviceKVPool]
    dsts: list[DeviceKVPool]
    faults: list[FaultEngine]
    log: list[str] = field(default_factory=list)


@asynccontextmanager
async def device_cluster(
    engine_name: str,
    url: str,
    *,
    engines: EngineFactory = gpu_engine,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    aux: Literal["device", "host"] = "device",
    policy: Policy | None = None,
    probe_override: bool | None = None,
    prefill_config: PrefillConfig | None = None,
) -> AsyncIterator[DeviceCluster]:
    """Build the pools and engines, open the agents; on the way out open every stall gate,
    close the agents, then the engines, then free the device memory (in that order: no
    engine may still have the memory registered when it is freed)."""
    async with AsyncExitStack() as stack:
        srcs = [stack.enter_context(device_pool(r, prefill_tp, aux)) for r in range(prefill_tp)]
        dsts = [stack.enter_context(device_pool(r, decode_tp, aux)) for r in range(decode_tp)]
        d_engines = []
        faults: list[FaultEngine] = []
        try:
            for _ in range(decode_tp):
                d_engines.append(engines(engine_name))
            for _ in range(prefill_tp):
                faults.append(FaultEngine(engines(engine_name), policy,
                                          probe_override=probe_override))
            async with AsyncExitStack() as agents:
                prefills = [
                    await agents.enter_async_context(open_prefill(
                        engine=faults[r], pool=srcs[r].spec, bootstrap_url=url, tp_rank=r,
                        tp_size=prefill_tp, kv_heads=KV_HEADS, config=prefill_config,
                    ))
                    for r in range(prefill_tp)
                ]
                decodes = [
                    await agents.enter_async_context(open_decode(
                        engine=d_engines[r], pool=dsts[r].spec, tp_rank=r, tp_size=decode_tp,
                    ))
                    for r in range(decode_tp)
                ]
                try:
                    yield DeviceCluster(url, prefills, decodes, srcs, dsts, faults)
                finally:
                    for f in faults:
                        f.stalls.release_all()
        finally:
            for e in [*faults, *d_engines]:
                e.close()


def start_room(
    c: DeviceCluster, room: int, src_pages: npt.NDArray[Any], dst_pages: npt.NDArray[Any], *,
    aux_slot: int = 1, record: list[npt.NDArray[np.uint8]] | None = None,
) -> tuple[list[Any], list[Any]]:
    """Fill every prefill rank's pages and aux row, open a sender per prefill rank and a
    receiver per decode rank, and send the whole room as one last chunk. Release callbacks
    append to ``c.log``; with ``record``, each decode rank's release first copies what its
    pages hold then (the bytes the next owner would see)."""
    senders, receivers = [], []
    for r, (agent, pool) in enumerate(zip(c.prefills, c.srcs, strict=True)):
        pool.fill(src_pages, room)
        pool.fill_aux(aux_slot, room)
        senders.append(agent.sender(
            room, num_pages=len(src_pages), aux_slot=aux_slot,
            on_release=lambda r=r: c.log.append(f"src{r} released"),
        ))
    for r, (agent, pool) in enumerate(zip(c.decodes, c.dsts, strict=True)):
        def released(r: int = r, pool: DeviceKVPool = pool) -> None:
            if record is not None:
                record.append(pool.read(dst_pages))
            c.log.append(f"dst{r} released")

        receiver = agent.receiver(room, bootstrap_url=c.url, epoch=room)  # one per request
        receiver.init(dst_pages, aux_slot + 1, on_release=released)
        receivers.append(receiver)
    for s in senders:
        s.send(src_pages, last=True)
    return senders, receivers


def room_landed(c: DeviceCluster, room: int, dst_pages: npt.NDArray[Any], aux_slot: int) -> bool:
    """Every decode rank's pages hold the room's bytes for its heads, and its aux row."""
    return all(
        np.array_equal(pool.read(dst_pages), pool.expected(room, len(dst_pages)))
        and pool.aux_ok(aux_slot, room)
        for pool in c.dsts
    )


async def verified_run(
    engine_name: str, url: str, *, engines: EngineFactory = gpu_engine,
    prefill_tp: int = 1, decode_tp: int = 1, aux: Literal["device", "host"] = "device",
) -> None:
    """Two rooms, scattered pages on both sides: every byte lands, both sides release once."""
    async with device_cluster(engine_name, url, engines=engines, prefill_tp=prefill_tp,
                              decode_tp=decode_tp, aux=aux) as c:
        for room, (src, dst) in enumerate([
            (np.array([3, 9, 4, 30, 31]), np.array([60, 2, 17, 18, 5])),
            (np.array([0, 63]), np.array([63, 0])),
        ], start=41):
            c.log.clear()
            senders, receivers = start_room(c, room, src, dst)
            with trio.fail_after(BOUND):
                for rec in receivers:
                    assert await rec.wait() is KVPoll.Success, rec.failure
                for s in senders:
                    assert await s.wait() is KVPoll.Success, s.failure
                    await s.wait_released()
            assert room_landed(c, room, dst, 2)
            assert sorted(c.log) == sorted(f"src{r} released" for r in range(prefill_tp))
        for agent in c.prefills:
            stats = agent.statistics()
            assert stats.succeeded == 2 and stats.leases_live == 0 and stats.failed == 0


async def abort_in_flight(
    engine_name: str, url: str, *, engines: EngineFactory = gpu_engine,
    aux: Literal["device", "host"] = "device",
) -> None:
    """Decode aborts while prefill's write is inside the engine (held there by a stall): no
    ack, so no release of the destination pages, until the write returns; then one ack, and
    the destination pages held the source's bytes when they were handed back."""
    async with device_cluster(engine_name, url, engines=engines, aux=aux,
                              policy=lambda *_: Fault("stall")) as c:
        room, src, dst = 61, np.arange(8, 12), np.arange(30, 34)
        seen: list[npt.NDArray[np.uint8]] = []
        (sender,), (receiver,) = start_room(c, room, src, dst, record=seen)
        with trio.fail_after(BOUND):
            await c.faults[0].stalls.wait_stalled_async(1)
        receiver.abort()
        assert receiver.poll() is KVPoll.Failed
        with trio.fail_after(BOUND):
            assert await sender.wait() is KVPoll.Failed
        with trio.move_on_after(QUIET) as cs:
            await receiver.wait_released()
        assert cs.cancelled_caught, "decode released its pages while the write was in flight"
        assert c.prefills[0].statistics().acks_sent == 0
        c.faults[0].stalls.release_all()
        with trio.fail_after(BOUND):
            await receiver.wait_released()
            await sender.wait_released()
        assert c.prefills[0].statistics().acks_sent == 1
        assert sorted(c.log) == ["dst0 released", "src0 released"]
        assert np.array_equal(seen[0], c.dsts[0].expected(room, len(dst)))


async def engine_fault(
    engine_name: str, url: str, *, engines: EngineFactory = gpu_engine,
    aux: Literal["device", "host"] = "device",
) -> None:
    """An engine error (half the blocks written, outcome unknown) fails the room on both
    sides and quarantines the lease: nothing is released until the fence ends it."""
    fence = 1.0
    async with device_cluster(
        engine_name, url, engines=engines, aux=aux, policy=lambda *_: Fault("partial"),
        probe_override=True, prefill_config=PrefillConfig(quarantine_fence=fence),
    ) as c:
        (sender,), (receiver,) = start_room(c, 91, np.arange(4), np.arange(10, 14))
        with trio.fail_after(BOUND):
            assert await sender.wait() is KVPoll.Failed
            assert await receiver.wait() is KVPoll.Failed
        assert isinstance(sender.failure, EngineError)
        stats = c.prefills[0].statistics()
        assert stats.quarantined == 1 and stats.leases_quarantined == 1
        assert c.log == []
        with trio.fail_after(fence + BOUND):
            await sender.wait_released()
            await receiver.wait_released()
        assert sorted(c.log) == ["dst0 released", "src0 released"]
        assert c.prefills[0].statistics().released_after_quarantine == 1


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
