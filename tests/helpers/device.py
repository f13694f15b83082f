"""The GPU agent scenarios: a cluster on device pools, a verified room, an abort while a
device write is in flight, an engine fault. They take the engine factory, so that
tests/test_gpu.py runs them on a real device and tests/test_memory_kinds.py on the CUDA
stand-in of :mod:`tests.helpers.fake_cuda` over host memory, on every machine."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
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
    open_decode,
    open_prefill,
)
from trio_pd.core._topology import head_range
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.engines.fault import Fault, FaultEngine, Policy
from trio_pd.testing.device import DeviceKVPool, engine_problem

#: TRIO_PD_REQUIRE_GPU=1 (tools/gpu-check sets it): a missing device or engine build fails
REQUIRE = os.environ.get("TRIO_PD_REQUIRE_GPU") == "1"
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
