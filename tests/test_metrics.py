"""Prometheus metrics (trio_pd.metrics) on real Mooncake agents and the real bootstrap service.

Every registry here is a fresh ``CollectorRegistry``; prometheus-client's global ``REGISTRY``
must never see a ``trio_pd_*`` metric.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import numpy as np
import prometheus_client
import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trio_pd import (
    DecodeAgent,
    KVPoll,
    PrefillAgent,
    PrefillConfig,
    open_bootstrap_server,
    open_decode,
    open_prefill,
)
from trio_pd.engines import make_engine
from trio_pd.metrics import GAUGE_FIELDS, AgentMetrics
from trio_pd.testing.pools import HostKVPool, PageAllocator

from .conftest import host_pool

ENGINE = "mooncake"


async def poll_until(pred: Callable[[], bool]) -> None:
    """Callers bound every use with ``trio.fail_after``."""
    while not pred():  # noqa: ASYNC110 - counters have no trio.Event
        await trio.sleep(0.005)


@dataclasses.dataclass
class MeteredPair:
    prefill: PrefillAgent
    decode: DecodeAgent
    src: HostKVPool
    dst: HostKVPool
    url: str


@asynccontextmanager
async def open_metered_pair(
    url: str, prefill_metrics: AgentMetrics, decode_metrics: AgentMetrics
) -> AsyncIterator[MeteredPair]:
    """Like conftest.open_pair (Mooncake, MHA host pools), with metrics on both agents, and
    one engine call per chunk (no coalescing), so that a room makes several."""
    src, dst = host_pool(), host_pool()
    pe, de = make_engine(ENGINE), make_engine(ENGINE)
    try:
        async with open_prefill(
            engine=pe, pool=src.spec, bootstrap_url=url, kv_heads=2, metrics=prefill_metrics,
            config=PrefillConfig(coalesce_pages=1),
        ) as prefill, open_decode(engine=de, pool=dst.spec, metrics=decode_metrics) as decode:
            yield MeteredPair(prefill, decode, src, dst, url)
    finally:
        pe.close()
        de.close()


async def run_room(pair: MeteredPair, room: int) -> None:
    src_pages, dst_pages = np.array([3, 4, 5, 9, 10]), np.array([100, 101, 7, 8, 9])
    pair.src.fill(src_pages, room=room)
    pair.src.fill_aux(5, room=room)
    sender = pair.prefill.sender(room, num_pages=5, aux_slot=5)
    receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
    receiver.init(dst_pages, 3)
    sender.send(src_pages[:2])
    sender.send(src_pages[2:], last=True)
    with trio.fail_after(20):
        assert await receiver.wait() is KVPoll.Success, receiver.failure
        assert await sender.wait() is KVPoll.Success, sender.failure
        await sender.wait_released()


async def abort_room(pair: MeteredPair, room: int) -> None:
    """Decode aborts a room prefill knows (metadata received, nothing sent yet)."""
    sender = pair.prefill.sender(room, num_pages=3, aux_slot=0)
    receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
    receiver.init(np.arange(3), 0)
    with trio.fail_after(20):
        await poll_until(lambda: sender.poll() is KVPoll.WaitingForInput)
        receiver.abort()
        await receiver.wait_released()
        await sender.wait_released()
    assert receiver.poll() is KVPoll.Failed and sender.poll() is KVPoll.Failed


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def assert_statistics_exported(registry: CollectorRegistry, agent: PrefillAgent | DecodeAgent,
                               role: str) -> None:
    stats = agent.statistics()
    for field in dataclasses.fields(stats):
        name = f"trio_pd_agent_{field.name}"
        if field.name not in GAUGE_FIELDS:
            name += "_total"
        got = registry.get_sample_value(name, {"role": role, "rank": "0"})
        assert got == getattr(stats, field.name), (name, got, stats)


def assert_nothing_global() -> None:
    assert b"trio_pd" not in generate_latest(prometheus_client.REGISTRY)


async def test_room_and_abort_move_the_metrics(bootstrap_url: str) -> None:
    registry = CollectorRegistry()
    pm = AgentMetrics(registry, role="prefill", rank=0)
    dm = AgentMetrics(registry, role="decode", rank=0)
    p, d = {"role": "prefill", "rank": "0"}, {"role": "decode", "rank": "0"}
    ok = {**p, "engine": ENGINE, "outcome": "ok"}
    async with open_metered_pair(bootstrap_url, pm, dm) as pair:
        assert pair.prefill.metrics is pm and pair.decode.metrics is dm
        await run_room(pair, 11)
        calls = pair.prefill.statistics().engine_calls
        assert calls >= 2
        assert value(registry, "trio_pd_engine_write_seconds_count", **ok) == calls
        assert value(registry, "trio_pd_engine_write_seconds_sum", **ok) > 0
        write_bytes = {**p, "engine": ENGINE}
        assert value(registry, "trio_pd_engine_write_bytes_count", **write_bytes) == calls
        assert (
            value(registry, "trio_pd_engine_write_bytes_sum", **write_bytes)
            == pair.prefill.statistics().bytes_written
            > 0
        )
        assert value(registry, "trio_pd_failures_total", **p, reason="TransferAborted") == 0
        assert value(registry, "trio_pd_ack_latency_seconds_count", **d) == 0

        await abort_room(pair, 12)
        assert value(registry, "trio_pd_failures_total", **d, reason="TransferAborted") == 1
        assert value(registry, "trio_pd_failures_total", **p, reason="TransferAborted") == 1
        assert value(registry, "trio_pd_ack_latency_seconds_count", **d) == 1
        assert value(registry, "trio_pd_ack_latency_seconds_sum", **d) > 0
        assert value(registry, "trio_pd_engine_write_seconds_count", **ok) == calls
        assert pair.decode.statistics().aborted == 1
        assert pair.prefill.statistics().aborted == 1
        assert pair.decode.statistics().acks_received == 1

        assert_statistics_exported(registry, pair.prefill, "prefill")
        assert_statistics_exported(registry, pair.decode, "decode")
    # after close the collector still reads the final statistics
    assert_statistics_exported(registry, pair.prefill, "prefill")
    assert_nothing_global()

    pm.unregister()
    assert value(registry, "trio_pd_engine_write_seconds_count", **ok) == 0
    assert registry.get_sample_value("trio_pd_agent_succeeded_total", p) is None
    assert registry.get_sample_value("trio_pd_agent_succeeded_total", d) == 1
    dm.unregister()
    dm.unregister()  # idempotent
    assert b"trio_pd" not in generate_latest(registry)


async def test_bootstrap_serves_agent_metrics() -> None:
    registry = CollectorRegistry()
    async with open_bootstrap_server(metrics_registry=registry) as server:
        pm = AgentMetrics(registry, role="prefill", rank=0)
        dm = AgentMetrics(registry, role="decode", rank=0)
        async with open_metered_pair(server.url, pm, dm) as pair:
            await run_room(pair, 21)
            await abort_room(pair, 22)
            async with httpx.AsyncClient(trust_env=False) as http:
                response = await http.get(f"{server.url}/metrics")
            assert response.status_code == 200
            samples = {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(response.text)
                for s in family.samples
            }

            def sample(name: str, **labels: str) -> float | None:
                return samples.get((name, tuple(sorted(labels.items()))))

            assert sample("trio_pd_agent_succeeded_total", role="prefill", rank="0") == 1
            assert sample("trio_pd_agent_succeeded_total", role="decode", rank="0") == 1
            assert sample(
                "trio_pd_failures_total", role="decode", rank="0", reason="TransferAborted"
            ) == 1
            assert sample("trio_pd_ack_latency_seconds_count", role="decode", rank="0") == 1
            count = sample(
                "trio_pd_engine_write_seconds_count",
                role="prefill", rank="0", engine=ENGINE, outcome="ok",
            )
            assert count == pair.prefill.statistics().engine_calls
            assert sample("trio_pd_bootstrap_ready") == 1
        pm.unregister()
        dm.unregister()
    assert_nothing_global()


async def test_nothing_registered_globally_by_default(bootstrap_url: str) -> None:
    import trio_pd.metrics  # noqa: F401 - importing registers nothing

    assert_nothing_global()
    src, dst = host_pool(), host_pool()
    pe, de = make_engine(ENGINE), make_engine(ENGINE)
    try:
        async with open_prefill(
            engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2
        ) as prefill, open_decode(engine=de, pool=dst.spec) as decode:
            assert prefill.metrics is None and decode.metrics is None
            await run_room(MeteredPair(prefill, decode, src, dst, bootstrap_url), 31)
    finally:
        pe.close()
        de.close()
    assert_nothing_global()


def test_one_series_per_role_and_rank() -> None:
    registry = CollectorRegistry()
    m = AgentMetrics(registry, role="prefill", rank=0)
    with pytest.raises(ValueError, match="prefill rank 0"):
        AgentMetrics(registry, role="prefill", rank=0)
    other = AgentMetrics(registry, role="prefill", rank=1)
    m.unregister()
    AgentMetrics(registry, role="prefill", rank=0).unregister()
    other.unregister()
    assert b"trio_pd" not in generate_latest(registry)
    AgentMetrics(registry, role="prefill", rank=0).unregister()  # the families come back


def test_metric_names_taken_by_someone_else() -> None:
    registry = CollectorRegistry()
    prometheus_client.Counter("trio_pd_failures", "taken", registry=registry)
    with pytest.raises(ValueError):
        AgentMetrics(registry, role="decode", rank=0)
    # nothing of ours was left behind
    assert b"trio_pd_engine_write" not in generate_latest(registry)


def test_late_writes_from_a_sanitizer() -> None:
    registry = CollectorRegistry()
    m = AgentMetrics(registry, role="decode", rank=0)
    labels = {"role": "decode", "rank": "0"}
    assert registry.get_sample_value("trio_pd_sanitizer_late_writes_total", labels) is None
    rows = np.zeros((2, 8), dtype=np.uint8)
    a, b = PageAllocator(rows[:1], 0xAB), PageAllocator(rows[1:], 0xCD)
    m.track_late_writes(lambda: a.late_writes)
    m.track_late_writes(lambda: b.late_writes)
    assert registry.get_sample_value("trio_pd_sanitizer_late_writes_total", labels) == 0
    for alloc, row in ((a, 0), (b, 1)):
        ids = alloc.alloc_nowait(1)
        assert ids is not None
        alloc.free(ids)
        rows[row, 3] = 1  # a write into a released row: caught at its next allocation
        assert alloc.alloc_nowait(1) is not None
    assert a.late_writes == b.late_writes == 1
    assert registry.get_sample_value("trio_pd_sanitizer_late_writes_total", labels) == 2
    m.unregister()
