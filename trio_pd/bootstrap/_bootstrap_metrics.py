"""The bootstrap service's counters: the :class:`BootstrapStatistics` snapshot and the
Prometheus collector that exports it at scrape time (one source of truth).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True, slots=True)
class BootstrapStatistics:
    """A snapshot of a :class:`BootstrapServer`'s counters.

    ``requests`` maps ``(method, route, status)`` to the number of answers. ``route`` is the
    path for the service's own paths and ``"<other>"`` for any other; ``method`` is the
    request method when it is a standard one and ``"<other>"`` otherwise (so the key space
    stays bounded whatever clients send). ``malformed`` counts ``400`` and ``413`` answers;
    requests that hypercorn itself rejects (unparseable HTTP) never reach the service and
    are not counted.
    """

    requests: Mapping[tuple[str, str, int], int]
    malformed: int
    registered_ranks: int
    tp_size: int | None
    ready: bool
    #: ``401`` answers: a ``/route`` request without the cluster token, or with another
    unauthorized: int = 0
    #: ``401`` answers to a request whose proof had been used already (a captured request
    #: replayed); also counted in ``unauthorized``
    replayed: int = 0
    #: ``409`` answers to a ``PUT /route`` for a rank registered under another control key
    #: whose endpoint still accepts connections (a squat of a live rank)
    refused_replacements: int = 0
    #: connections closed because a request begun on them (some byte of it arrived) was not
    #: whole within ``request_timeout``, or an answer was not taken within it (a connection
    #: that sent nothing is closed at the same deadline, but not counted: an idle keep-alive)
    timed_out_connections: int = 0
    #: connections closed at the ``max_connections`` cap: the one that had waited longest for
    #: its request, to make room for a new one, or the new one when none was waiting
    shed_connections: int = 0
    #: connections open now
    open_connections: int = 0
    #: DP attention: the DP size the registered ranks agree on (None: none registered)
    dp_size: int | None = None
    #: "room R is on DP rank K" records held now (expired ones go at the next DP request)
    dp_rooms: int = 0
    #: records stored by ``POST /register_dp_rank`` (a room registered again counts again)
    dp_rooms_registered: int = 0
    #: records dropped to stay under ``max_dp_rooms`` (the oldest first)
    dp_rooms_evicted: int = 0
    #: records dropped ``dp_room_ttl`` after their registration
    dp_rooms_expired: int = 0
    #: rooms ``POST /query_dp_ranks`` answered unknown (-1): no record of that use
    dp_rooms_unknown: int = 0

    @property
    def total_requests(self) -> int:
        """Every answer, all routes and statuses."""
        return sum(self.requests.values())


class MetricsCollector(Collector):
    """Exports a server's statistics at scrape time (one source of truth): ``statistics``
    is the server's :meth:`BootstrapServer.statistics`."""

    def __init__(self, statistics: Callable[[], BootstrapStatistics]) -> None:
        self._statistics = statistics

    def describe(self) -> Iterable[Metric]:
        # Lets a registry refuse a second server's metrics instead of exporting both.
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._statistics())

    def _families(self, stats: BootstrapStatistics | None) -> list[Metric]:
        """The metric families, with samples from ``stats`` (none when it is None)."""
        requests = CounterMetricFamily(
            "trio_pd_bootstrap_requests",
            "Requests answered by the bootstrap service.",
            labels=["method", "route", "status"],
        )
        malformed = CounterMetricFamily(
            "trio_pd_bootstrap_malformed_requests",
            "Requests answered 400 or 413 by the bootstrap service.",
        )
        registered = GaugeMetricFamily(
            "trio_pd_bootstrap_registered_ranks",
            "Prefill ranks registered with the bootstrap service.",
        )
        ready = GaugeMetricFamily(
            "trio_pd_bootstrap_ready", "1 once every prefill rank registered, else 0."
        )
        timed_out = CounterMetricFamily(
            "trio_pd_bootstrap_timed_out_connections",
            "Connections closed because a request was not whole, or an answer not taken, "
            "within the bootstrap service's request timeout.",
        )
        shed = CounterMetricFamily(
            "trio_pd_bootstrap_shed_connections",
            "Connections closed at the bootstrap service's connection cap.",
        )
        connections = GaugeMetricFamily(
            "trio_pd_bootstrap_open_connections", "Connections open to the bootstrap service."
        )
        dp_rooms = GaugeMetricFamily(
            "trio_pd_bootstrap_dp_rooms",
            "Room -> DP rank records the bootstrap service holds (DP attention).",
        )
        dp_counters = {
            name: CounterMetricFamily(f"trio_pd_bootstrap_{name}", text)
            for name, text in (
                ("dp_rooms_registered", "Room -> DP rank records registered."),
                ("dp_rooms_evicted", "Room -> DP rank records dropped at the max_dp_rooms cap."),
                ("dp_rooms_expired", "Room -> DP rank records dropped after dp_room_ttl."),
                ("dp_rooms_unknown", "Rooms a DP-rank query found no record of."),
            )
        }
        if stats is not None:
            for (method, route, status), count in sorted(stats.requests.items()):
                requests.add_metric([method, route, str(status)], count)
            malformed.add_metric([], stats.malformed)
            registered.add_metric([], stats.registered_ranks)
            ready.add_metric([], 1 if stats.ready else 0)
            timed_out.add_metric([], stats.timed_out_connections)
            shed.add_metric([], stats.shed_connections)
            connections.add_metric([], stats.open_connections)
            dp_rooms.add_metric([], stats.dp_rooms)
            for name, family in dp_counters.items():
                family.add_metric([], getattr(stats, name))
        return [requests, malformed, registered, ready, timed_out, shed, connections, dp_rooms,
                *dp_counters.values()]

