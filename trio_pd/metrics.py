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
own ``role``/``rank`` label values. A family that only one role can move (engine writes are
prefill's, drain acks decode's) is exported only while the registry holds an agent of that
role, and only with that role's series. The families are

``trio_pd_transfer_latency_seconds`` (histogram; ``role, rank, outcome``)
    One observation per room, when its status becomes terminal; ``outcome`` is ``success``,
    ``failed`` or ``aborted`` (a :class:`~trio_pd.TransferAborted` failure). Prefill: from
    the room's first ``send()`` (a room that ends before any ``send()``: from its
    ``sender()``); decode: from ``init()`` (a room failed before ``init()``: from its
    ``receiver()``). Rooms created before the metrics were attached are counted in
    ``trio_pd_rooms_total`` only.
``trio_pd_rooms_total`` (counter; ``role, rank, outcome``)
    Rooms concluded, once per room, by the same ``outcome``. Both families start with a 0
    series for each outcome.
``trio_pd_engine_write_seconds`` (histogram; ``role, rank, engine, outcome``; prefill)
    Duration of each engine write, from the call to its result, including the wait for a
    free engine thread. ``outcome`` is ``ok`` or ``error``; a write cancelled before it
    started is not observed.
``trio_pd_engine_write_bytes`` (histogram; ``role, rank, engine``; prefill)
    Bytes of each successful engine write.
``trio_pd_engine_call_blocks`` (histogram; ``role, rank, engine``; prefill)
    Blocks (contiguous source/destination ranges) of each successful engine write; its sum
    is the blocks written. Coalescing (``PrefillConfig.coalesce_pages``) moves it up.
``trio_pd_failures_total`` (counter; ``role, rank, reason``)
    Rooms that failed, once per room, by the exception type name (``TransferAborted``,
    ``PeerLost``, ...).
``trio_pd_ack_latency_seconds`` (histogram; ``role, rank``; decode)
    From the moment a failed room starts draining (ABORT sent) to the release of its pages
    (every ack received, or the ack timeout / a lost peer released them).
``trio_pd_bootstrap_resolve_seconds`` (histogram; ``role, rank, outcome``; decode)
    Resolving one prefill instance: from the first receiver that names its bootstrap URL to
    the instance being usable (topology fetched, REGISTER sent to its ranks: ``ok``) or
    failed (unreachable, timed out, incompatible: ``error``).
``trio_pd_agent_<field>`` (``role, rank``)
    Every :class:`~trio_pd.AgentStatistics` field the attached agent's role keeps
    (``trio_pd.core._stats.SIDES``), read from ``agent.statistics()`` at scrape time, so they
    always equal ``statistics()``: gauges for ``rooms_active``, ``leases_live``,
    ``leases_quarantined``, ``pages_held`` and ``landing_held``, counters (``..._total``)
    for the rest.
    Names put the unit last (Prometheus naming); three fields are renamed for it:

    ===================  ==========================================================
    statistics field     exported as
    ===================  ==========================================================
    ``bytes_written``    ``trio_pd_agent_written_bytes_total``
    ``pages_held``       ``trio_pd_agent_held_pages``
    ``landing_held``     ``trio_pd_agent_held_landing_pages``
    every other field    ``trio_pd_agent_<field>``, plus ``_total`` for a counter
    ===================  ==========================================================
``trio_pd_sanitizer_late_writes_total`` (counter; ``role, rank``)
    Late writes caught by page sanitizers registered with :meth:`AgentMetrics.track_late_writes`
    (e.g. :class:`trio_pd.testing.pools.PageAllocator`), read at scrape time.

What SGLang and vLLM users chart: SGLang's ``kv_transfer_latency_ms`` (per request, prefill
side, milliseconds) is ``trio_pd_transfer_latency_seconds{role="prefill",outcome="success"}``
in seconds; vLLM's ``nixl_xfer_time_seconds`` (per NIXL transfer) is, per request, the same
family, and per engine call ``trio_pd_engine_write_seconds{outcome="ok"}`` (trio_pd writes
from prefill). docs/architecture.md has the whole table.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from types import MappingProxyType
from typing import Final, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .core._stats import SIDES, AgentStatistics, Side

__all__ = ["STATISTICS_NAMES", "AgentMetrics", "StatisticsSource"]

ROLES: Final = ("prefill", "decode")
#: the ``outcome`` of a concluded room (``trio_pd_rooms_total``, the transfer latency)
ROOM_OUTCOMES: Final = ("success", "failed", "aborted")
#: AgentStatistics fields that are current values, not ever-growing counts
GAUGE_FIELDS = frozenset(
    {"rooms_active", "leases_live", "leases_quarantined", "pages_held", "landing_held"}
)
_FIELDS = tuple(f.name for f in dataclasses.fields(AgentStatistics))
#: fields whose name does not end in their unit: exported with the unit last
_RENAMED: Final = {
    "bytes_written": "written_bytes", "pages_held": "held_pages",
    "landing_held": "held_landing_pages",
}
#: the family name each AgentStatistics field is exported as (``_total`` for a counter;
#: the table in the module docstring)
STATISTICS_NAMES: Final[Mapping[str, str]] = MappingProxyType({
    name: f"trio_pd_agent_{_RENAMED.get(name, name)}" + ("" if name in GAUGE_FIELDS else "_total")
    for name in _FIELDS
})

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
#: a room can last until its deadlines (bootstrap 30 s, waiting 120 s by default)
_ROOM_BUCKETS = (*_SECONDS_BUCKETS, 60.0, 120.0)
_BYTES_BUCKETS = tuple(float(4**k) for k in range(5, 16))  # 1 KiB .. 1 GiB
_BLOCKS_BUCKETS = tuple(float(4**k) for k in range(9))  # 1 .. 65536


def _applies(side: Side, roles: Iterable[str]) -> bool:
    return side == "both" or side in roles


class StatisticsSource(Protocol):
    """What :meth:`AgentMetrics.attach` needs: a prefill or decode agent."""

    metrics: AgentMetrics | None

    def statistics(self) -> AgentStatistics: ...


class _Collector(Collector):
    """Every family of one registry. A family only one role moves is left out while the
    registry holds no agent of that role; each agent's statistics are read at scrape time,
    the fields its role keeps only."""

    def __init__(self, shared: _Shared) -> None:
        self._shared = shared

    def describe(self) -> Iterable[Metric]:
        # every name, so that the registry refuses a clash up front
        described: list[Metric] = []
        for metric, _side in self._shared.events:
            described.extend(metric.describe())
        return [*described, *self._statistics(())]

    def collect(self) -> Iterable[Metric]:
        members = list(self._shared.members)
        roles = {m.role for m in members}
        collected: list[Metric] = []
        for metric, side in self._shared.events:
            if _applies(side, roles):
                collected.extend(metric.collect())
        return [*collected, *self._statistics(members, roles)]

    @staticmethod
    def _statistics(
        members: Iterable[AgentMetrics], roles: Iterable[str] = ROLES
    ) -> list[Metric]:
        labels = ["role", "rank"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for name in _FIELDS:
            if not _applies(SIDES.get(name, "both"), roles):
                continue
            doc = f"AgentStatistics.{name} of a trio_pd agent."
            kind = GaugeMetricFamily if name in GAUGE_FIELDS else CounterMetricFamily
            families[name] = kind(STATISTICS_NAMES[name], doc, labels=labels)
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
                    if _applies(SIDES.get(name, "both"), (member.role,)):
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
        self.transfer_latency = Histogram(
            "trio_pd_transfer_latency_seconds",
            "One room, from its first send() (prefill) or init() (decode) to its terminal "
            "status.",
            (*labels, "outcome"),
            registry=None,
            buckets=_ROOM_BUCKETS,
        )
        self.rooms = Counter(
            "trio_pd_rooms",
            "Rooms concluded, by outcome (success, failed, aborted).",
            (*labels, "outcome"),
            registry=None,
        )
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
        self.call_blocks = Histogram(
            "trio_pd_engine_call_blocks",
            "Blocks of one successful engine write.",
            (*labels, "engine"),
            registry=None,
            buckets=_BLOCKS_BUCKETS,
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
        self.resolve_seconds = Histogram(
            "trio_pd_bootstrap_resolve_seconds",
            "Decode: resolving one prefill instance through its bootstrap service.",
            (*labels, "outcome"),
            registry=None,
            buckets=_SECONDS_BUCKETS,
        )
        #: the event families, with the role that moves each
        self.events: tuple[tuple[Histogram | Counter, Side], ...] = (
            (self.transfer_latency, "both"),
            (self.rooms, "both"),
            (self.write_seconds, "prefill"),
            (self.write_bytes, "prefill"),
            (self.call_blocks, "prefill"),
            (self.failures, "both"),
            (self.ack_latency, "decode"),
            (self.resolve_seconds, "decode"),
        )
        self.collector = _Collector(self)

    def register(self) -> None:
        self.registry.register(self.collector)

    def unregister(self) -> None:
        self.registry.unregister(self.collector)


_lock = threading.Lock()
_shared: weakref.WeakKeyDictionary[CollectorRegistry, _Shared] = weakref.WeakKeyDictionary()


class AgentMetrics:
    """Prometheus metrics of one agent (``role`` ``"prefill"`` or ``"decode"``, TP ``rank``),
    registered with ``registry`` only.

    Raises ``ValueError`` for another ``role``, if the registry already has an AgentMetrics
    with this role and rank, or if it holds other collectors with the same metric names.
    """

    def __init__(self, registry: CollectorRegistry, *, role: str, rank: int) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
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
        for outcome in ROOM_OUTCOMES:  # a 0 series per outcome, for ratios before the first
            self._child(shared.rooms, outcome)
            self._child(shared.transfer_latency, outcome)

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

    def observe_write(
        self, engine: str, seconds: float, nbytes: int, *, blocks: int = 0, ok: bool = True
    ) -> None:
        """Prefill: one engine write of ``nbytes`` in ``blocks`` blocks finished (``ok``) or
        raised (its size is then not observed)."""
        outcome = "ok" if ok else "error"
        self._child(self._shared.write_seconds, engine, outcome).observe(seconds)
        if ok:
            self._child(self._shared.write_bytes, engine).observe(nbytes)
            self._child(self._shared.call_blocks, engine).observe(blocks)

    def observe_room(self, outcome: str, started: float | None) -> None:
        """A room's status became terminal (call once per room): ``outcome`` is one of
        ``success``, ``failed``, ``aborted``; ``started`` is the ``time.perf_counter()`` its
        transfer latency runs from (None: not known, the room is only counted)."""
        self._child(self._shared.rooms, outcome).inc()
        if started is not None:
            latency = self._child(self._shared.transfer_latency, outcome)
            latency.observe(time.perf_counter() - started)

    def observe_resolve(self, seconds: float, *, ok: bool) -> None:
        """Decode: resolving one prefill instance took ``seconds``, and succeeded (``ok``)
        or failed."""
        self._child(self._shared.resolve_seconds, "ok" if ok else "error").observe(seconds)

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
