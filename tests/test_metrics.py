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
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from trio_pd import (
    DecodeAgent,
    DecodeConfig,
    EngineError,
    KVPoll,
    PrefillAgent,
    PrefillConfig,
    open_bootstrap_server,
    open_decode,
    open_prefill,
)
from trio_pd.core._stats import SIDES, AgentStatistics
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.metrics import STATISTICS_NAMES, AgentMetrics
from trio_pd.testing.pools import HostKVPool, PageAllocator

from .helpers.agents import host_pool, poll_until

ENGINE = "mooncake"



@dataclasses.dataclass
class MeteredPair:
    prefill: PrefillAgent
    decode: DecodeAgent
    src: HostKVPool
    dst: HostKVPool
    url: str


@asynccontextmanager
async def open_metered_pair(
    url: str, prefill_metrics: AgentMetrics, decode_metrics: AgentMetrics,
    *, wrap: Callable[[TransferEngine], TransferEngine] | None = None,
) -> AsyncIterator[MeteredPair]:
    """Like conftest.open_pair (Mooncake, MHA host pools), with metrics on both agents, and
    one engine call per chunk (no coalescing), so that a room makes several. ``wrap`` wraps
    the prefill engine (a FaultEngine); a failed write's quarantine then lasts 0.2 s."""
    src, dst = host_pool(), host_pool()
    pe: TransferEngine = make_engine(ENGINE)
    de = make_engine(ENGINE)
    if wrap is not None:
        pe = wrap(pe)
    try:
        async with open_prefill(
            engine=pe, pool=src.spec, bootstrap_url=url, kv_heads=2, metrics=prefill_metrics,
            config=PrefillConfig(coalesce_pages=1, quarantine_fence=0.2),
        ) as prefill, open_decode(
            engine=de, pool=dst.spec, metrics=decode_metrics,
            config=DecodeConfig(close_timeout=1.0),
        ) as decode:
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
    """Every field the role keeps equals statistics(); the other role's fields have no series
    of this agent."""
    stats = agent.statistics()
    for field in dataclasses.fields(stats):
        name = STATISTICS_NAMES[field.name]
        got = registry.get_sample_value(name, {"role": role, "rank": "0"})
        if SIDES[field.name] in ("both", role):
            assert got == getattr(stats, field.name), (name, got, stats)
        else:
            assert got is None, (name, got)


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
        stats = pair.prefill.statistics()
        calls = stats.engine_calls  # (the room's two chunks may share one call: batching)
        assert calls >= 1 and calls + stats.chunks_batched + stats.chunks_coalesced >= 2
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


# ------------------------------------------------------------------ per-request families


def families(registry: CollectorRegistry) -> dict[str, Metric]:
    """The registry's families by name (a counter's without its ``_total``)."""
    return {m.name: m for m in registry.collect()}


def series_roles(registry: CollectorRegistry, family: str) -> set[str]:
    return {s.labels["role"] for s in families(registry)[family].samples}


async def fail_room(pair: MeteredPair, room: int, shots: list[Fault]) -> None:
    """The room's one engine write fails (nothing written): Failed on both sides."""
    shots.append(Fault("fail"))
    sender = pair.prefill.sender(room, num_pages=2, aux_slot=0)
    receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
    receiver.init(np.arange(2), 0)
    sender.send(np.arange(2), last=True)
    with trio.fail_after(20):
        assert await sender.wait() is KVPoll.Failed
        assert await receiver.wait() is KVPoll.Failed
        await receiver.wait_released()
        await sender.wait_released()
    assert isinstance(sender.failure, EngineError), repr(sender.failure)
    assert not shots, "the fault was not used"


@asynccontextmanager
async def faulty_pair(
    url: str, prefill_metrics: AgentMetrics, decode_metrics: AgentMetrics
) -> AsyncIterator[tuple[MeteredPair, FaultEngine, list[Fault]]]:
    """A metered pair whose prefill engine fails the next write once per Fault a test puts
    in the list (probes answer alive, so a quarantine ends at its 0.2 s fence)."""
    shots: list[Fault] = []
    faults: list[FaultEngine] = []

    def wrap(engine: TransferEngine) -> TransferEngine:
        faults.append(
            FaultEngine(engine, lambda *_: shots.pop() if shots else None, probe_override=True)
        )
        return faults[0]

    async with open_metered_pair(url, prefill_metrics, decode_metrics, wrap=wrap) as pair:
        yield pair, faults[0], shots


async def test_latency_and_rooms_per_outcome(bootstrap_url: str) -> None:
    """Two rooms succeed, one is aborted, one fails on an injected engine error: on each side
    the transfer latency histogram has one observation per room of each outcome, rooms_total
    counts them exactly, the decode side observed resolving the instance, and the blocks per
    engine call add up to the blocks the engine wrote."""
    registry = CollectorRegistry()
    pm = AgentMetrics(registry, role="prefill", rank=0)
    dm = AgentMetrics(registry, role="decode", rank=0)
    async with faulty_pair(bootstrap_url, pm, dm) as (pair, fault, shots):
        await run_room(pair, 41)
        await run_room(pair, 42)
        await abort_room(pair, 43)
        await fail_room(pair, 44, shots)
        expected = {"success": 2, "aborted": 1, "failed": 1}
        for role, agent in (("prefill", pair.prefill), ("decode", pair.decode)):
            stats = agent.statistics()
            assert (stats.succeeded, stats.aborted, stats.failed) == (2, 1, 1), stats
            for outcome, rooms in expected.items():
                labels = {"role": role, "rank": "0", "outcome": outcome}
                got = (
                    value(registry, "trio_pd_transfer_latency_seconds_count", **labels),
                    value(registry, "trio_pd_rooms_total", **labels),
                )
                assert got == (rooms, rooms), (role, outcome, got)
                assert value(registry, "trio_pd_transfer_latency_seconds_sum", **labels) > 0

        d = {"role": "decode", "rank": "0"}
        assert value(registry, "trio_pd_bootstrap_resolve_seconds_count", **d, outcome="ok") >= 1
        assert value(registry, "trio_pd_bootstrap_resolve_seconds_sum", **d, outcome="ok") > 0

        p = {"role": "prefill", "rank": "0", "engine": ENGINE}
        written = fault.statistics().blocks_written
        assert fault.statistics().faults == {"fail": 1}
        assert written > 0
        assert value(registry, "trio_pd_engine_call_blocks_sum", **p) == written
        writes = value(registry, "trio_pd_engine_write_bytes_count", **p)
        assert value(registry, "trio_pd_engine_call_blocks_count", **p) == writes > 0

        # the renamed families (units last)
        assert (
            value(registry, "trio_pd_agent_written_bytes_total", role="prefill", rank="0")
            == pair.prefill.statistics().bytes_written > 0
        )
        assert registry.get_sample_value("trio_pd_agent_held_pages", d) == 0
        for old in ("trio_pd_agent_bytes_written_total", "trio_pd_agent_pages_held"):
            assert old not in {s.name for m in registry.collect() for s in m.samples}

        # one registry, both roles: each family once, each role's series only where it applies
        text = generate_latest(registry).decode()
        for field, side in SIDES.items():
            name = STATISTICS_NAMES[field]
            assert text.count(f"# TYPE {name} ") == 1, name
            roles = {"prefill", "decode"} if side == "both" else {side}
            assert series_roles(registry, name.removesuffix("_total")) == roles, field
        assert series_roles(registry, "trio_pd_engine_call_blocks") == {"prefill"}
        assert series_roles(registry, "trio_pd_bootstrap_resolve_seconds") == {"decode"}
    pm.unregister()
    dm.unregister()


async def test_latency_runs_from_first_send_and_from_init(bootstrap_url: str) -> None:
    """Prefill's latency starts at the room's first send(), decode's at init(), not when the
    handles were made: the half second before init and the one between init and the first
    send show where they belong."""
    registry = CollectorRegistry()
    pm = AgentMetrics(registry, role="prefill", rank=0)
    dm = AgentMetrics(registry, role="decode", rank=0)
    async with open_metered_pair(bootstrap_url, pm, dm) as pair:
        sender = pair.prefill.sender(51, num_pages=2, aux_slot=0)
        receiver = pair.decode.receiver(51, bootstrap_url=pair.url)
        await trio.sleep(0.5)  # the handles wait: counted by neither side
        receiver.init(np.arange(2), 0)
        await trio.sleep(0.5)  # decode waits for prefill's KV: decode's latency only
        sender.send(np.arange(2), last=True)
        with trio.fail_after(20):
            assert await receiver.wait() is KVPoll.Success
            assert await sender.wait() is KVPoll.Success
        ok = {"rank": "0", "outcome": "success"}
        prefill = value(registry, "trio_pd_transfer_latency_seconds_sum", role="prefill", **ok)
        decode = value(registry, "trio_pd_transfer_latency_seconds_sum", role="decode", **ok)
        assert 0 < prefill < 0.5, prefill
        assert 0.5 <= decode < 1.0, decode
    pm.unregister()
    dm.unregister()


#: families only one role moves, besides the statistics fields SIDES gives to one role
PREFILL_EVENTS = {"trio_pd_engine_write_seconds", "trio_pd_engine_write_bytes",
                  "trio_pd_engine_call_blocks"}
DECODE_EVENTS = {"trio_pd_ack_latency_seconds", "trio_pd_bootstrap_resolve_seconds"}


async def test_no_family_of_the_other_role(bootstrap_url: str) -> None:
    """A registry with only a decode agent exports no prefill-only family (and the other way
    round), even after traffic; those fields stay 0 in the other agent's statistics, and the
    families both roles move are in both."""
    p_registry, d_registry = CollectorRegistry(), CollectorRegistry()
    pm = AgentMetrics(p_registry, role="prefill", rank=0)
    dm = AgentMetrics(d_registry, role="decode", rank=0)
    async with open_metered_pair(bootstrap_url, pm, dm) as pair:
        await run_room(pair, 61)
        await abort_room(pair, 62)
        only: dict[str, set[str]] = {"prefill": set(PREFILL_EVENTS), "decode": set(DECODE_EVENTS)}
        for field, side in SIDES.items():
            if side != "both":
                only[side].add(STATISTICS_NAMES[field].removesuffix("_total"))
        p_names, d_names = set(families(p_registry)), set(families(d_registry))
        assert not only["prefill"] & d_names, sorted(only["prefill"] & d_names)
        assert not only["decode"] & p_names, sorted(only["decode"] & p_names)
        assert only["prefill"] <= p_names, sorted(only["prefill"] - p_names)
        assert only["decode"] <= d_names, sorted(only["decode"] - d_names)
        for name in ("trio_pd_agent_engine_calls", "trio_pd_agent_acks_sent"):
            assert name in p_names and name not in d_names, name
        for name in ("trio_pd_agent_acks_received", "trio_pd_agent_held_pages"):
            assert name in d_names and name not in p_names, name
        both = {"trio_pd_rooms", "trio_pd_transfer_latency_seconds", "trio_pd_failures",
                "trio_pd_agent_succeeded", "trio_pd_agent_rooms_active"}
        assert both <= p_names & d_names, sorted(both - (p_names & d_names))
        for agent, other in ((pair.prefill, "decode"), (pair.decode, "prefill")):
            stats = agent.statistics()
            moved = {f: getattr(stats, f) for f, side in SIDES.items()
                     if side == other and getattr(stats, f)}
            assert not moved, f"{type(agent).__name__} moved {other}-only fields: {moved}"
        assert_statistics_exported(p_registry, pair.prefill, "prefill")
        assert_statistics_exported(d_registry, pair.decode, "decode")
    pm.unregister()
    dm.unregister()


UNITS = ("seconds", "bytes", "pages", "blocks")


def test_exported_names_put_units_last() -> None:
    """Prometheus naming for every family of a registry holding both roles: a unit is the
    last word of the name (before ``_total``), counters and only counters end in
    ``_total``, and the two statistics fields whose names had it inside are renamed."""
    registry = CollectorRegistry()
    pm = AgentMetrics(registry, role="prefill", rank=0)
    dm = AgentMetrics(registry, role="decode", rank=0)
    names = {STATISTICS_NAMES["bytes_written"], STATISTICS_NAMES["pages_held"]}
    assert names == {"trio_pd_agent_written_bytes_total", "trio_pd_agent_held_pages"}
    metrics = list(registry.collect())
    assert len(metrics) >= len(SIDES) + 8, [m.name for m in metrics]
    for metric in metrics:
        name = metric.name  # a counter's is without its _total
        assert not name.endswith("_total"), name  # no gauge or histogram ends in _total
        if metric.type == "counter":
            exported = {s.name for s in metric.samples} - {f"{name}_created"}
            assert exported <= {f"{name}_total"}, exported
        words = name.split("_")
        for unit in UNITS:
            assert unit not in words[:-1], f"{name}: unit {unit!r} not last"
    pm.unregister()
    dm.unregister()


def test_every_statistics_field_has_a_side() -> None:
    """SIDES classifies every AgentStatistics field (an unlisted one would be exported for
    both roles, always 0 for one of them)."""
    fields = {f.name for f in dataclasses.fields(AgentStatistics)}
    assert set(SIDES) == fields, set(SIDES) ^ fields
    assert set(SIDES.values()) <= {"prefill", "decode", "both"}
