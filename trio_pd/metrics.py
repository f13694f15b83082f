"""Prometheus metrics for prefill and decode agents, on a registry the caller supplies.

Nothing is registered at import time and nothing ever goes to prometheus-client's global
``REGISTRY``: an :class:`AgentMetrics` registers with the registry it is given, and
:meth:`AgentMetrics.unregister` takes it off again::

    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, role="prefill", rank=0)
    async with open_prefill(..., metrics=metrics) as agent:   # attaches the agent
        ...
    # or, for an agent made some other way: metrics.attach(agent)

Serve the registry with ``open_bootstrap_server(metrics_registry=registry)`` (``GET
/metrics``) or any prometheus-client exposition helper.

Several agents (say one prefill and one decode rank in one process) may share one registry:
the metric families are created once per registry and every :class:`AgentMetrics` fills its
own ``role``/``rank`` label values. The families are

``trio_pd_engine_write_seconds`` (histogram; ``role, rank, engine, outcome``)
    Duration of each engine write (prefill), from the call to its result, including the
    wait for a free engine thread. ``outcome`` is ``ok`` or ``error``; a write cancelled
    before it started is not observed.
``trio_pd_engine_write_bytes`` (histogram; ``role, rank, engine``)
    Bytes of each successful engine write.
``trio_pd_failures_total`` (counter; ``role, rank, reason``)
    Rooms that failed, once per room, by the exception type name (``TransferAborted``,
    ``PeerLost``, ...).
``trio_pd_ack_latency_seconds`` (histogram; ``role, rank``)
    Decode: from the moment a failed room starts draining (ABORT sent) to the release of
    its pages (every ack received, or the ack timeout / a lost peer released them).
``trio_pd_agent_<field>`` (``role, rank``)
    Every :class:`~trio_pd.AgentStatistics` field of the attached agent, read from
    ``agent.statistics()`` at scrape time, so they always equal ``statistics()``: gauges for
    ``rooms_active``, ``leases_live``, ``leases_quarantined`` and ``pages_held``, counters
    (``..._total``) for the rest.
``trio_pd_sanitizer_late_writes_total`` (counter; ``role, rank``)
    Late writes caught by page sanitizers registered with :meth:`AgentMetrics.track_late_writes`
    (e.g. :class:`trio_pd.testing.pools.PageAllocator`), read at scrape time.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._stats import AgentStatistics

__all__ = ["AgentMetrics", "StatisticsSource"]

#: AgentStatistics fields that are current values, not ever-growing counts
GAUGE_FIELDS = frozenset({"rooms_active", "leases_live", "leases_quarantined", "pages_held"})
_FIELDS = tuple(f.name for f in dataclasses.fields(AgentStatistics))

_M = TypeVar("_M", Histogram, Counter)

_SECONDS_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_BYTES_BUCKETS = tuple(float(4**k) for k in range(5, 16))  # 1 KiB .. 1 GiB


class StatisticsSource(Protocol):
    """What :meth:`AgentMetrics.attach` needs: a prefill or decode agent."""

    metrics: AgentMetrics | None

    def statistics(self) -> AgentStatistics: ...


class _StatisticsCollector(Collector):
    """Every attached agent's statistics, as metric families, read at scrape time."""

    def __init__(self, shared: _Shared) -> None:
        self._shared = shared

    def describe(self) -> Iterable[Metric]:
        return self._families(())

    def collect(self) -> Iterable[Metric]:
        return self._families(list(self._shared.members))

    @staticmethod
    def _families(members: Iterable[AgentMetrics]) -> list[Metric]:
        labels = ["role", "rank"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for name in _FIELDS:
            doc = f"AgentStatistics.{name} of a trio_pd agent."
            if name in GAUGE_FIELDS:
                families[name] = GaugeMetricFamily(f"trio_pd_agent_{name}", doc, labels=labels)
            else:
                families[name] = CounterMetricFamily(f"trio_pd_agent_{name}", doc, labels=labels)
        late = CounterMetricFamily(
            "trio_pd_sanitizer_late_writes",
            "Late writes into released pages caught by a page sanitizer.",
            labels=labels,
        )
        for member in members:
            values = [member.role, str(member.rank)]
            stats = member.statistics()
            if stats is not None:
                for name in _FIELDS:
                    families[name].add_metric(values, getattr(stats, name))
            sources = member.late_write_sources()
            if sources:
                late.add_metric(values, sum(fn() for fn in sources))
        return [*families.values(), late]


class _Shared:
    """The metric families of one registry, shared by every AgentMetrics using it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.members: list[AgentMetrics] = []
        labels = ("role", "rank")
        self.write_seconds = Histogram(
            "trio_pd_engine_write_seconds",
            "Duration of one engine write, including the wait for an engine thread.",
            (*labels, "engine", "outcome"),
            registry=None,
            buckets=_SECONDS_BUCKETS,
        )
        self.write_bytes = Histogram(
            "trio_pd_engine_write_bytes",
            "Bytes of one successful engine write.",
            (*labels, "engine"),
            registry=None,
            buckets=_BYTES_BUCKETS,
        )
        self.failures = Counter(
            "trio_pd_failures",
            "Rooms that failed, by the exception type name.",
            (*labels, "reason"),
            registry=None,
        )
        self.ack_latency = Histogram(
            "trio_pd_ack_latency_seconds",
            "Decode: from the start of a failed room's drain to the release of its pages.",
            labels,
            registry=None,
            buckets=_SECONDS_BUCKETS,
        )
        self.statistics = _StatisticsCollector(self)
        self.collectors: tuple[Collector, ...] = (
            self.write_seconds,
            self.write_bytes,
            self.failures,
            self.ack_latency,
            self.statistics,
        )

    def register(self) -> None:
        done: list[Collector] = []
        try:
            for collector in self.collectors:
                self.registry.register(collector)
                done.append(collector)
        except ValueError:
            for collector in done:
                self.registry.unregister(collector)
            raise

    def unregister(self) -> None:
        for collector in self.collectors:
            self.registry.unregister(collector)


_lock = threading.Lock()
_shared: weakref.WeakKeyDictionary[CollectorRegistry, _Shared] = weakref.WeakKeyDictionary()


class AgentMetrics:
    """Prometheus metrics of one agent (``role`` ``"prefill"`` or ``"decode"``, TP ``rank``),
    registered with ``registry`` only.

    Raises ``ValueError`` if the registry already has an AgentMetrics with this role and
    rank, or holds other collectors with the same metric names.
    """

    def __init__(self, registry: CollectorRegistry, *, role: str, rank: int) -> None:
        self.registry = registry
        self.role = role
        self.rank = rank
        self._agent: StatisticsSource | None = None
        self._late_writes: list[Callable[[], int]] = []
        self._drains: dict[Hashable, float] = {}
        #: (family, label values) of every series this agent created, for unregister()
        self._children: set[tuple[Histogram | Counter, tuple[str, ...]]] = set()
        self._registered = False
        with _lock:
            shared = _shared.get(registry)
            if shared is None:
                shared = _Shared(registry)
                shared.register()
                _shared[registry] = shared
            if any(m.role == role and m.rank == rank for m in shared.members):
                raise ValueError(f"this registry already has metrics for {role} rank {rank}")
            shared.members.append(self)
            self._registered = True
        self._shared = shared
        self._labels = (role, str(rank))

    def __repr__(self) -> str:
        return f"<AgentMetrics {self.role} rank {self.rank}>"

    # ------------------------------------------------------------------ wiring

    def attach(self, agent: StatisticsSource) -> None:
        """Export ``agent.statistics()`` at scrape time, and have the agent report its events
        here (sets ``agent.metrics``)."""
        self._agent = agent
        agent.metrics = self

    def track_late_writes(self, source: Callable[[], int]) -> None:
        """Export ``source()`` (summed over every source tracked) as the late writes caught
        by a sanitizer, e.g. ``metrics.track_late_writes(lambda: allocator.late_writes)``."""
        self._late_writes.append(source)

    def statistics(self) -> AgentStatistics | None:
        """The attached agent's statistics now (None when no agent is attached)."""
        return None if self._agent is None else self._agent.statistics()

    def late_write_sources(self) -> tuple[Callable[[], int], ...]:
        return tuple(self._late_writes)

    def unregister(self) -> None:
        """Remove this agent's series; the last AgentMetrics of a registry takes the metric
        families off it. Idempotent."""
        with _lock:
            if not self._registered:
                return
            self._registered = False
            shared = self._shared
            shared.members.remove(self)
            if not shared.members:
                shared.unregister()
                del _shared[self.registry]
                return
        for metric, key in self._children:
            metric.remove(*key)
        self._children.clear()

    # ------------------------------------------------------------------ events (agents call these)

    def observe_write(self, engine: str, seconds: float, nbytes: int, *, ok: bool = True) -> None:
        """One engine write finished (``ok``) or raised."""
        outcome = "ok" if ok else "error"
        self._child(self._shared.write_seconds, engine, outcome).observe(seconds)
        if ok:
            self._child(self._shared.write_bytes, engine).observe(nbytes)

    def observe_failure(self, error: BaseException) -> None:
        """A room failed (call once per room, when its status changed)."""
        self._child(self._shared.failures, type(error).__name__).inc()

    def drain_started(self, key: Hashable) -> None:
        """Decode: a failed room started draining (its ABORTs are being sent)."""
        self._drains.setdefault(key, time.perf_counter())

    def drain_released(self, key: Hashable) -> None:
        """Decode: the room's pages were released; observes the ack latency if it drained."""
        started = self._drains.pop(key, None)
        if started is not None:
            self._child(self._shared.ack_latency).observe(time.perf_counter() - started)

    def _child(self, metric: _M, *extra: str) -> _M:
        key = (*self._labels, *extra)
        self._children.add((metric, key))
        return metric.labels(*key)
