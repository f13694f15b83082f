"""The bootstrap service: an HTTP rendezvous beside a prefill instance (SPEC §2, §6).

Each prefill rank registers where its control socket and transfer engine can be reached;
decode ranks read the complete topology (or one rank) before they send REGISTER. The service
is also the liveness target of the instance (``GET /health``).

Routes:

``PUT /route``
    Body: a :class:`PrefillRankInfo` as JSON. ``200 {"ok": true}`` when stored.
    Registering a ``tp_rank`` that is already known replaces it (a restarted rank) if it
    has the same ``control_key``, or once the old registration's control endpoint refuses
    connections (the old process is gone); otherwise ``409`` (``refused_replacements``).
    ``400`` for malformed JSON or a field out of range (``tp_rank`` outside
    ``[0, tp_size)``, ``tp_size`` outside ``[1, MAX_TP_SIZE]``, an unknown ``layout``, MLA
    with ``kv_heads != 1``...).
    ``409`` when the rank disagrees with the *other* registered ranks about ``tp_size``,
    ``engine``, ``layout``, ``kv_heads`` or ``page_size``: a prefill instance that restarts with
    a different shape must restart its bootstrap service too. Once every rank has registered,
    a rank replacing itself must keep the shape as well. ``413`` for a body over 64 KiB.

``GET /route`` (no query, or ``tp_rank=-1``)
    The :class:`Topology`. ``503`` until every rank ``0..tp_size-1`` registered; that
    includes the case where no rank registered yet (there is no separate ``404`` for it).

``GET /route?tp_rank=N``
    That rank's :class:`PrefillRankInfo`. ``400`` if the query is not exactly one
    ``tp_rank`` that is a decimal integer ``>= -1``; ``404`` if the registered ranks say
    ``tp_size <= N`` (no such rank will ever exist); otherwise ``503`` until every rank
    registered.

``GET /route?dp_rank=K`` (alone, or with ``tp_rank=N``)
    DP attention: the :class:`Topology` of DP rank K's TP group (or rank N of it); ``503``
    until every rank of that group registered; ``404`` if the registered ranks say
    ``dp_size <= K``. Without ``dp_rank`` the answers are DP rank 0's. A registration names
    its group with ``dp_rank`` and the instance's ``dp_size`` (0 and 1 by default: no DP
    attention), and ``dp_size`` is one of the fields every rank must agree on.

Pipeline parallelism (``pp_rank``, ``pp_size``, ``first_layer`` in a registration; 0, 1, 0
by default): a DP rank's topology holds every TP rank of every PP stage, stage by stage, and is
complete only once all of them registered. ``pp_size`` is a shared field (``409``). Stage 0
starts at layer 0 and a stage with ``pp_size > 1`` publishes ``num_layers >= 1`` (``400``
otherwise); the ranks of one stage hold the same layers, stage ``s + 1`` starts right after
stage ``s``'s last layer, and no two stages overlap (``409`` naming both stages otherwise).
``GET /route?tp_rank=N&pp_rank=S`` is TP rank N of stage S (``404`` if ``pp_size <= S``).

``POST /register_dp_rank``
    Body ``{"dp_rank": K, "rooms": [{"room": R, "epoch": E}, ...]}`` (``epoch`` optional):
    DP rank K holds these rooms (this use of each, when ``epoch`` is given). ``200
    {"ok": true, "registered": n}``; ``400`` for a malformed body, no rooms, or a ``dp_rank``
    the instance does not have; ``413`` over :data:`MAX_DP_BATCH` rooms; ``503`` while no rank
    registered (the DP size is not known). A later record of a room replaces an earlier one.
    Records are bounded: at most ``max_dp_rooms`` (past it the oldest goes, counted
    ``dp_rooms_evicted``), each kept ``dp_room_ttl`` seconds after it was registered
    (counted ``dp_rooms_expired`` when it goes).

``POST /query_dp_ranks``
    Body ``{"rooms": [{"room": R, "epoch": E}, ...]}``: ``200 {"dp_size": n, "dp_ranks":
    [K, ...]}``, one DP rank per room asked, in order; :data:`UNKNOWN_DP_RANK` (-1) for a room
    the service holds no record of, or a record of another epoch of it (counted
    ``dp_rooms_unknown``); with ``dp_size`` 1 every room is on DP rank 0. ``400`` / ``413`` /
    ``503`` as for ``/register_dp_rank``.

``GET /health``
    ``200 OK``.

``GET /metrics``
    Prometheus text format, only for a server created with a ``metrics_registry``;
    ``404`` otherwise.

``GET /key?key=K``
    ``{"vouched": true}`` when a decode rank announced CURVE key K (``GET /route?key=K``,
    with the token): prefill ranks ask it before they admit a control connection.

``GET /nonce``
    ``200``, with a fresh nonce in ``x-trio-pd-nonce`` (as every answer of a service with a
    token has).

With a cluster token (the default: ``token=``, ``TRIO_PD_TOKEN``, or the process's own), both
``/route`` requests, ``/key`` and both DP-rank requests need a proof of it, never the token
itself: ``Authorization: TRIO-PD-HMAC <nonce> <proof>``, the proof an HMAC-SHA256 under the
token of a nonce this service issued (under ``NONCE_TTL`` ago), the method, the target and
the body's digest (``_security.request_mac``). ``401`` without a valid one (counted
``unauthorized``; the body is not read when the nonce is not ours), or for a proof already
taken (a replay, counted ``replayed``). Every answer to those paths carries
``x-trio-pd-answer``, the service's proof over the request's nonce, the status and the
body (``_security.answer_mac``), which clients check.
``certfile``/``keyfile`` serve https. See docs/security.md.

Any other path is ``404``; a known path with the wrong method is ``405``. Error replies are
JSON ``{"ok": false, "error": "..."}``. Every answer is counted by (method, route, status) in
:meth:`BootstrapServer.statistics`; ``400`` and ``413`` answers are also counted as
*malformed*. A malformed request never affects other requests or the registered ranks.
When the server stops, a registration still waiting for its body is answered ``503`` and
idle connections are closed, so that no client can hold the shutdown up.

Slow and many clients: each request must arrive whole (head and body) within
``request_timeout`` (5 s) of the connection's accept or of the end of the previous answer, and
each write of an answer must be taken within it too; otherwise the connection is closed
(counted ``timed_out_connections`` when some of a request had arrived). At most
``max_connections`` (512) connections are open at once: a new one beyond that takes the place
of the one that has waited longest for its request (closed at once), or is closed itself when
every open connection is being answered (either way counted ``shed_connections``).

The pure part (validation and the rank table) has no I/O; the ASGI app around it is served by
hypercorn's HTTP/1.1 and HTTP/2 connection handling on a socket this module binds and accepts
on itself (the accept loop enforces the cap, a wrapper around each accepted stream the
deadline), so port ``0`` works and the listening socket is closed when the server stops.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import re
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Annotated, Any, Final
from urllib.parse import parse_qs

import msgspec
import trio
from hypercorn.app_wrappers import ASGIWrapper as _HypercornASGIWrapper
from hypercorn.config import Config as _HypercornConfig
from hypercorn.trio.tcp_server import TCPServer as _HypercornTCPServer
from hypercorn.trio.worker_context import WorkerContext as _HypercornWorkerContext
from hypercorn.typing import (
    ASGIReceiveCallable,
    ASGISendCallable,
    ConnectionState,
    HTTPScope,
    Scope,
    WebsocketCloseEvent,
)
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._bootstrap_client import (
    MAX_DP_BATCH,
    MAX_DP_SIZE,
    MAX_LAYERS,
    MAX_PP_SIZE,
    UNKNOWN_DP_RANK,
    DpRanks,
    DpRoom,
    PrefillRankInfo,
    Topology,
)
from ._errors import BootstrapError, ConfigurationError, one_error
from ._probe import port_refuses
from ._security import (
    ANSWER_HEADER,
    AUTH_SCHEME,
    NONCE_HEADER,
    STALE_HEADER,
    answer_mac,
    request_mac,
    resolve,
)

__all__ = [
    "BootstrapServer",
    "BootstrapStatistics",
    "open_bootstrap_server",
    "serve_bootstrap",
]

logger = logging.getLogger("trio_pd.bootstrap")

#: Largest request body the service reads; a longer one is answered ``413``.
MAX_BODY_BYTES: Final = 64 * 1024

# How long requests still in flight at shutdown may take before hypercorn cancels them, and
# the hard bound on the whole shutdown after which the serving task itself is cancelled.
_GRACEFUL_TIMEOUT: Final = 0.5
_SHUTDOWN_BACKSTOP: Final = 1.0
# A connection that sends nothing for this long while a request is open is dropped.
_READ_TIMEOUT: Final = 30
#: Default ``request_timeout``: seconds a connection has to deliver a whole request (from its
#: accept, or from the end of the previous answer), and to take each write of an answer.
REQUEST_TIMEOUT: Final = 5.0
#: Default ``max_connections``: connections open at once (well below the common file
#: descriptor limit of 1,024 a process gets).
MAX_CONNECTIONS: Final = 512

#: Seconds a nonce the service issued may be used in (once) for a request's proof.
NONCE_TTL: Final = 30.0
#: Most nonces remembered as used at once (each until it expires): requests proven within
#: NONCE_TTL beyond it are answered 401 until some expire.
MAX_USED_NONCES: Final = 262_144

#: how long a replacement's probe of the old rank's endpoint may take (see _put_route_guarded)
_REPLACE_PROBE_TIMEOUT: Final = 1.0

_LAYOUTS: Final = ("mha", "mla")
#: Largest tp_size a registration may name: the rank table holds at most this many ranks
#: (``tp_size * dp_size`` of them with DP attention).
MAX_TP_SIZE: Final = 1024
#: Default ``dp_room_ttl``: seconds a "room R is on DP rank K" record is kept (twice the
#: agents' default bootstrap timeout, after which neither side waits for the room).
DP_ROOM_TTL: Final = 60.0
#: Default ``max_dp_rooms``: records held at once (about 25 MB at most).
MAX_DP_ROOMS: Final = 100_000
_RANK_INT: Final = re.compile(r"-?[0-9]{1,9}")


# --------------------------------------------------------------------------------------------
# The pure part: validation and the rank table. No I/O.

# Fields every rank of one prefill instance must agree on.
_SHARED_FIELDS: Final = (
    "tp_size", "engine", "layout", "kv_heads", "page_size", "dp_size", "pp_size",
)


def _invalid_reason(info: PrefillRankInfo) -> str | None:
    """Why ``info`` is not a valid registration on its own, or None.

    Single-field bounds are checked by msgspec while decoding; these are the rules that
    relate fields to each other.
    """
    if info.tp_size > MAX_TP_SIZE:
        return f"tp_size {info.tp_size} is over {MAX_TP_SIZE}"
    if not 0 <= info.tp_rank < info.tp_size:
        return f"tp_rank {info.tp_rank} is outside [0, tp_size={info.tp_size})"
    if info.dp_size > MAX_DP_SIZE or info.dp_size * info.tp_size > MAX_TP_SIZE:
        return (f"dp_size {info.dp_size} x tp_size {info.tp_size} is over {MAX_TP_SIZE} ranks "
                f"(or dp_size over {MAX_DP_SIZE})")
    if not 0 <= info.dp_rank < info.dp_size:
        return f"dp_rank {info.dp_rank} is outside [0, dp_size={info.dp_size})"
    if info.pp_size > MAX_PP_SIZE or info.pp_size * info.dp_size * info.tp_size > MAX_TP_SIZE:
        return (f"pp_size {info.pp_size} x dp_size {info.dp_size} x tp_size {info.tp_size} is "
                f"over {MAX_TP_SIZE} ranks (or pp_size over {MAX_PP_SIZE})")
    if not 0 <= info.pp_rank < info.pp_size:
        return f"pp_rank {info.pp_rank} is outside [0, pp_size={info.pp_size})"
    if info.pp_rank == 0 and info.first_layer != 0:
        return f"PP stage 0 starts at layer 0, not {info.first_layer}"
    if info.pp_size > 1 and info.num_layers < 1:
        return f"PP stage {info.pp_rank} must publish its num_layers (at least 1)"
    if info.first_layer + info.num_layers > MAX_LAYERS:
        return (f"layers {info.first_layer}..{info.first_layer + info.num_layers - 1} end past "
                f"{MAX_LAYERS}")
    if info.layout not in _LAYOUTS:
        return f"layout {info.layout!r} is not one of {', '.join(_LAYOUTS)}"
    if info.layout == "mla" and info.kv_heads != 1:
        return f"an MLA rank has kv_heads 1, not {info.kv_heads}"
    return None


class _RankTable:
    """The registered ranks of one prefill instance, by ``(dp_rank, pp_rank, tp_rank)`` (DP
    rank 0 only, without DP attention; PP stage 0 only, without pipeline parallelism)."""

    def __init__(self) -> None:
        self._ranks: dict[tuple[int, int, int], PrefillRankInfo] = {}

    def __len__(self) -> int:
        return len(self._ranks)

    @property
    def tp_size(self) -> int | None:
        """The tp_size the registered ranks agree on, or None if none registered."""
        for info in self._ranks.values():
            return info.tp_size
        return None

    @property
    def dp_size(self) -> int | None:
        """The dp_size the registered ranks agree on, or None if none registered."""
        for info in self._ranks.values():
            return info.dp_size
        return None

    @property
    def pp_size(self) -> int | None:
        """The pp_size the registered ranks agree on, or None if none registered."""
        for info in self._ranks.values():
            return info.pp_size
        return None

    @property
    def complete(self) -> bool:
        """Every TP rank of every PP stage of every DP rank registered."""
        tp_size, dp_size, pp_size = self.tp_size, self.dp_size, self.pp_size
        return (tp_size is not None and dp_size is not None and pp_size is not None
                and len(self) == tp_size * dp_size * pp_size)

    def group_size(self, dp_rank: int) -> int:
        """How many ranks of DP rank ``dp_rank`` (all its PP stages) registered."""
        return sum(1 for d, _, _ in self._ranks if d == dp_rank)

    def conflict(self, info: PrefillRankInfo) -> str | None:
        """Why ``info`` disagrees with the other registered ranks, or None.

        The rank ``info`` would replace is not compared with while the instance is
        incomplete: a lone rank may re-register with a different shape. Once every rank has
        registered the shape is fixed: a rank replacing itself must keep it too (else one
        PUT could make the instance need 10**9 ranks, and every decode get 503).
        """
        complete = self.complete
        for other in self._ranks.values():
            if _key(other) == _key(info) and not complete:
                continue
            for field in _SHARED_FIELDS:
                mine, theirs = getattr(info, field), getattr(other, field)
                if mine != theirs:
                    return f"{field} {mine!r} disagrees with {theirs!r} of registered " + (
                        _named(other)
                    )
            if info.pp_size > 1:
                problem = _stage_conflict(info, other)
                if problem is not None:
                    return problem
        return None

    def get(self, tp_rank: int, dp_rank: int = 0, pp_rank: int = 0) -> PrefillRankInfo | None:
        """The registration of ``tp_rank`` of PP stage ``pp_rank`` of DP rank ``dp_rank``,
        if any."""
        return self._ranks.get((dp_rank, pp_rank, tp_rank))

    def register(self, info: PrefillRankInfo) -> None:
        """Store ``info``, replacing any earlier registration of its ``(dp_rank, pp_rank,
        tp_rank)``.

        The caller checked :func:`_invalid_reason` and :meth:`conflict` first.
        """
        self._ranks[_key(info)] = info

    def topology(self, dp_rank: int = 0) -> Topology | None:
        """The complete topology of DP rank ``dp_rank`` (every TP rank of every PP stage of
        it, stage by stage), or None while some rank of it is missing."""
        tp_size, dp_size, pp_size = self.tp_size, self.dp_size, self.pp_size
        if tp_size is None or dp_size is None or pp_size is None or not 0 <= dp_rank < dp_size:
            return None
        ranks = [self._ranks.get((dp_rank, s, t)) for s in range(pp_size) for t in range(tp_size)]
        if any(r is None for r in ranks):
            return None
        return Topology(
            tp_size=tp_size, ranks=[r for r in ranks if r is not None], dp_rank=dp_rank,
            dp_size=dp_size, pp_size=pp_size,
        )


def _key(info: PrefillRankInfo) -> tuple[int, int, int]:
    return info.dp_rank, info.pp_rank, info.tp_rank


def _named(info: PrefillRankInfo) -> str:
    """``tp_rank T`` (``of pp_rank S``, ``of dp_rank K`` where the instance has them)."""
    return (
        f"tp_rank {info.tp_rank}"
        + (f" of pp_rank {info.pp_rank}" if info.pp_size > 1 else "")
        + (f" of dp_rank {info.dp_rank}" if info.dp_size > 1 else "")
    )


def _stage_conflict(info: PrefillRankInfo, other: PrefillRankInfo) -> str | None:
    """Why PP stage ``info.pp_rank``'s layers do not fit with those of the registered
    ``other`` (same pp_size), or None. The stages tile the model's layers in order: the
    ranks of one stage (in every DP rank) hold the same layers; stage ``s + 1`` starts where
    stage ``s`` ends; a lower stage holds only lower layers (no overlap)."""
    lo, n = info.first_layer, info.num_layers
    olo, on = other.first_layer, other.num_layers
    mine = f"PP stage {info.pp_rank} (layers {lo}..{lo + n - 1})"
    theirs = f"PP stage {other.pp_rank} (layers {olo}..{olo + on - 1}) of registered " + (
        _named(other)
    )
    if other.pp_rank == info.pp_rank:
        if (olo, on) != (lo, n):
            return f"{mine} disagrees with {theirs}: one stage holds one range of layers"
        return None
    if lo < olo + on and olo < lo + n:
        return f"{mine} overlaps {theirs}"
    below, above = (other, info) if other.pp_rank < info.pp_rank else (info, other)
    if (below.first_layer >= above.first_layer
            or (above.pp_rank == below.pp_rank + 1
                and below.first_layer + below.num_layers != above.first_layer)):
        return (f"{mine} does not follow on from {theirs}: stage s + 1 starts at the layer "
                "after stage s's last")
    return None


class _DpRooms:
    """Which DP rank holds each room (DP attention): one record per room id, bounded and
    expiring. Pure: the caller passes the time (``trio.current_time()``).

    At most ``max_entries`` records: a new one past that replaces the oldest (counted
    :attr:`evicted`). A record lives ``ttl`` seconds from its last registration (counted
    :attr:`expired` when it goes; expired records go at the next registration or query).
    A record made with an epoch answers only for that use of the room id (or a query that
    names none); one made without answers for any.
    """

    def __init__(self, *, max_entries: int, ttl: float) -> None:
        self._max, self._ttl = max_entries, ttl
        # room -> (dp_rank, epoch or None, expires); oldest (soonest to expire) first
        self._entries: OrderedDict[int, tuple[int, int | None, float]] = OrderedDict()
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            room, (_, _, expires) = next(iter(entries.items()))
            if expires > now:
                return
            del entries[room]
            self.expired += 1

    def put(self, room: int, epoch: int | None, dp_rank: int, now: float) -> None:
        self.expire(now)
        entries = self._entries
        if room in entries:
            entries.move_to_end(room)  # its expiry moves too: the order stays by expiry
        elif len(entries) >= self._max:
            entries.popitem(last=False)
            self.evicted += 1
        entries[room] = (dp_rank, epoch, now + self._ttl)

    def get(self, room: int, epoch: int | None, now: float) -> int:
        self.expire(now)
        entry = self._entries.get(room)
        if entry is None:
            return UNKNOWN_DP_RANK
        dp_rank, held, _ = entry
        if held is not None and epoch is not None and held != epoch:
            return UNKNOWN_DP_RANK  # a record of another use of the room id
        return dp_rank


class _DpRegistration(msgspec.Struct, frozen=True):
    """The body of ``POST /register_dp_rank``."""

    dp_rank: Annotated[int, msgspec.Meta(ge=0)]
    rooms: list[DpRoom]


class _DpQuery(msgspec.Struct, frozen=True):
    """The body of ``POST /query_dp_ranks``."""

    rooms: list[DpRoom]


# --------------------------------------------------------------------------------------------
# Statistics and metrics


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


class _MetricsCollector(Collector):
    """Exports a server's statistics at scrape time (one source of truth)."""

    def __init__(self, server: BootstrapServer) -> None:
        self._server = server

    def describe(self) -> Iterable[Metric]:
        # Lets a registry refuse a second server's metrics instead of exporting both.
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._server.statistics())

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


# --------------------------------------------------------------------------------------------
# The server

_ROUTE_METHODS: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType({
    "/route": ("GET", "PUT"), "/register_dp_rank": ("POST",), "/query_dp_ranks": ("POST",),
    "/key": ("GET",), "/nonce": ("GET",), "/health": ("GET",), "/metrics": ("GET",),
})
#: the paths that need the cluster token (when the service has one)
_AUTHENTICATED: Final = frozenset({"/route", "/register_dp_rank", "/query_dp_ranks", "/key"})
#: Most decode control keys the service vouches for at once (``GET /route?key=``); past it
#: the least recently announced is forgotten.
MAX_VOUCHED_KEYS: Final = 65_536
_Z85_KEY: Final = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
#: the requests whose body is read (bounded: MAX_BODY_BYTES)
_WITH_BODY: Final = frozenset(
    {("PUT", "/route"), ("POST", "/register_dp_rank"), ("POST", "/query_dp_ranks")}
)
_STANDARD_METHODS: Final = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE"}
)
_JSON: Final = b"application/json"
_TEXT: Final = b"text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    body: bytes
    content_type: bytes = _JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @classmethod
    def error(cls, status: int, message: str, **kwargs: Any) -> _Reply:
        return cls(status, msgspec.json.encode({"ok": False, "error": message}), **kwargs)


_TOO_LARGE: Final = _Reply.error(
    413, f"request body over {MAX_BODY_BYTES} bytes", headers=((b"connection", b"close"),)
)
_STALE_NONCE: Final = "unknown or expired nonce"


def _presented_nonce(scope: HTTPScope) -> str:
    """The nonce a request's ``Authorization`` names, valid or not ("" for none)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            parts = value.decode("latin-1").split(" ")
            if len(parts) == 3 and parts[0] == AUTH_SCHEME and len(parts[1]) <= 80:
                return parts[1]
    return ""


def _unauthorized(why: str) -> _Reply:
    headers = [(b"www-authenticate", AUTH_SCHEME.encode("ascii")), (b"connection", b"close")]
    if why == _STALE_NONCE:  # (the client may retry once, with the nonce of this answer)
        headers.append((STALE_HEADER.encode("ascii"), b"1"))
    return _Reply.error(
        401, f"this bootstrap service needs a proof of the cluster token: {why}",
        headers=tuple(headers),
    )
_SHUTTING_DOWN: Final = _Reply.error(
    503, "bootstrap server shutting down", headers=((b"connection", b"close"),)
)


class _Connection(trio.abc.HalfCloseableStream):
    """One accepted connection, as hypercorn reads and writes it, and its deadline.

    Hypercorn serves the connection inside :attr:`scope`. While the connection *waits* for a
    request (from its accept, or from the end of the last answer, until the app has a request
    whole: :meth:`answering`), the scope's deadline is ``waiting_since + timeout``; when it
    passes, or when the connection is dropped (:meth:`shed`, or a write that ran out), the
    scope is cancelled: hypercorn's tasks for the connection end (as at the end of its own
    graceful shutdown) and the caller closes the socket. Each write must finish within
    ``timeout`` too (a client that takes no answer).
    """

    def __init__(self, stream: trio.SocketStream, server: BootstrapServer) -> None:
        self.stream = stream
        #: hypercorn reads the addresses from it (``transport_stream.socket`` under TLS)
        self.socket = stream.socket
        self._server = server
        self._timeout = server._request_timeout
        self.waiting_since = trio.current_time()
        self.scope = trio.CancelScope(deadline=self.waiting_since + self._timeout)
        self._answering = 0  # requests the app has whole and answers (HTTP/2: several)
        self._begun = False  # some byte arrived since waiting_since
        self._dropped = False

    @property
    def waiting(self) -> bool:
        """Waiting for a request (a connection the cap may shed)."""
        return self._answering == 0 and not self._dropped

    @property
    def expired(self) -> bool:
        """The deadline ended it while a request was begun (``timed_out_connections``)."""
        return self.scope.cancelled_caught and self.waiting and self._begun

    def _drop(self) -> None:
        self._dropped = True
        self.scope.cancel(reason="bootstrap connection dropped")

    def shed(self) -> None:
        """Close it to make room for a new connection (see :meth:`BootstrapServer._admit`)."""
        self._drop()

    @contextmanager
    def answering(self) -> Iterator[None]:
        """While the app answers a request it has whole: no deadline. Afterwards the wait
        for the next request begins."""
        self._answering += 1
        self.scope.deadline = math.inf
        try:
            yield
        finally:
            self._answering -= 1
            if self._answering == 0:
                self.waiting_since = trio.current_time()
                self._begun = False
                self.scope.deadline = self.waiting_since + self._timeout

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.stream.receive_some(max_bytes)
        self._begun = self._begun or bool(data)
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        # (hypercorn shields its writes from cancellation; this deadline still applies)
        with trio.move_on_after(self._timeout):
            await self.stream.send_all(data)
            return
        if not self._dropped:
            self._server._timed_out += 1
            logger.info("bootstrap: closed a connection that took no answer in %s s",
                        self._timeout)
            self._drop()
        raise trio.BrokenResourceError("the client took no answer within the request timeout")

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


class BootstrapServer:
    """A running bootstrap service. Made by :func:`open_bootstrap_server` or
    :func:`serve_bootstrap`, never directly.

    ``host`` and ``port`` are what the listening socket is bound to (``port`` is the real
    one when 0 was asked for); ``url`` is the base URL clients use.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        url: str,
        metrics_registry: CollectorRegistry | None,
        token: str | None = None,
        tls: tuple[str, str] | None = None,
        request_timeout: float = REQUEST_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        dp_room_ttl: float = DP_ROOM_TTL,
        max_dp_rooms: int = MAX_DP_ROOMS,
    ) -> None:
        self.host = host
        self.port = port
        self.url = url
        self._request_timeout = request_timeout
        self._max_connections = max_connections
        self._connections: set[_Connection] = set()
        self._timed_out = 0
        self._shed = 0
        self._metrics_registry = metrics_registry
        #: the cluster token every /route request must prove (None: not checked)
        self._token = token
        #: the key of the nonces this service issues (stateless: a nonce carries its issue
        #: time and a tag under this key), and the nonces used, until they expire
        self._nonce_key = os.urandom(32)
        self._used_nonces: OrderedDict[str, float] = OrderedDict()
        self._replayed = 0
        self._tls = tls
        self._unauthorized = 0
        self._refused_replacements = 0
        self._table = _RankTable()
        #: decode ranks' CURVE keys announced with GET /route (LRU, MAX_VOUCHED_KEYS)
        self._vouched: OrderedDict[str, None] = OrderedDict()
        self._dp_rooms = _DpRooms(max_entries=max_dp_rooms, ttl=dp_room_ttl)
        self._dp_registered = 0
        self._dp_unknown = 0
        self._requests: Counter[tuple[str, str, int]] = Counter()
        self._malformed = 0
        self._closing = False
        self._body_reads: set[trio.CancelScope] = set()
        self._collector = _MetricsCollector(self)

    def __repr__(self) -> str:
        return f"<BootstrapServer {self.url}>"

    def statistics(self) -> BootstrapStatistics:
        """A snapshot of the counters; see :class:`BootstrapStatistics`."""
        return BootstrapStatistics(
            requests=MappingProxyType(dict(self._requests)),
            malformed=self._malformed,
            registered_ranks=len(self._table),
            tp_size=self._table.tp_size,
            ready=self._table.complete,
            unauthorized=self._unauthorized,
            replayed=self._replayed,
            refused_replacements=self._refused_replacements,
            timed_out_connections=self._timed_out,
            shed_connections=self._shed,
            open_connections=len(self._connections),
            dp_size=self._table.dp_size,
            dp_rooms=len(self._dp_rooms),
            dp_rooms_registered=self._dp_registered,
            dp_rooms_evicted=self._dp_rooms.evicted,
            dp_rooms_expired=self._dp_rooms.expired,
            dp_rooms_unknown=self._dp_unknown,
        )

    def _admit(self, stream: trio.SocketStream) -> _Connection | None:
        """The new connection on ``stream``, or None to refuse it (the caller closes it).

        At the cap, the open connection that has waited longest for its request is shed to
        make room (a slow client holds a connection for at most ``request_timeout``, and a
        normal one sends its request at once: the oldest waiting is the likeliest slow); if
        none is waiting (each is being answered), the new one is refused. Both are counted
        ``shed_connections``.
        """
        if len(self._connections) >= self._max_connections:
            self._shed += 1
            waiting = [c for c in self._connections if c.waiting]
            if not waiting:
                return None
            oldest = min(waiting, key=lambda c: c.waiting_since)
            oldest.shed()
            self._connections.discard(oldest)  # (it closes at once)
        connection = _Connection(stream, self)
        self._connections.add(connection)
        return connection

    def issue_nonce(self) -> str:
        """A fresh nonce: its issue time (ms, monotonic), 8 random bytes and a tag under a
        key of this service; checked without any state (:meth:`_nonce_fresh`)."""
        stamp = f"{int(time.monotonic() * 1000):x}.{os.urandom(8).hex()}"
        tag = hmac.new(self._nonce_key, stamp.encode("ascii"), hashlib.sha256).hexdigest()
        return f"{stamp}.{tag[:32]}"

    def _nonce_fresh(self, nonce: str) -> float | None:
        """When ``nonce`` (one of ours, issued under :data:`NONCE_TTL` ago) expires; None
        if it is not one of ours or too old."""
        parts = nonce.split(".")
        if len(parts) != 3 or len(nonce) > 80:
            return None
        stamp = f"{parts[0]}.{parts[1]}"
        tag = hmac.new(self._nonce_key, stamp.encode("ascii"), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(tag[:32], parts[2]):
            return None
        try:
            issued = int(parts[0], 16) / 1000
        except ValueError:
            return None
        expires = issued + NONCE_TTL
        return expires if issued <= time.monotonic() < expires else None

    def _claim(self, scope: HTTPScope) -> tuple[str, str] | str:
        """The (nonce, proof) an authenticated request presents, or why it is refused
        before its body is read: no proof, or a nonce not ours, or expired."""
        given = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(given) != 1:
            return "no Authorization header"
        parts = given[0].decode("latin-1").split(" ")
        if len(parts) != 3 or parts[0] != AUTH_SCHEME:
            return f"Authorization must be {AUTH_SCHEME} <nonce> <proof>"
        if self._nonce_fresh(parts[1]) is None:
            return _STALE_NONCE
        return parts[1], parts[2]

    def _check_proof(
        self, scope: HTTPScope, claim: tuple[str, str], body: bytes
    ) -> str | None:
        """Why the request's proof fails (None: it holds). A proof is taken once: its nonce
        is remembered until it expires (at most :data:`MAX_USED_NONCES`; only holders of
        the token can add to them), so a captured request replayed is refused."""
        assert self._token is not None
        nonce, proof = claim
        target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"]
                                      else b"")
        want = request_mac(self._token, nonce, scope["method"], target, body)
        if not hmac.compare_digest(want, proof):
            return "the proof does not verify"
        now = time.monotonic()
        while self._used_nonces:
            first, expires = next(iter(self._used_nonces.items()))
            if expires > now:
                break
            del self._used_nonces[first]
        if nonce in self._used_nonces:
            self._replayed += 1
            logger.warning("bootstrap: refused a replayed request (%s %s)",
                           scope["method"], scope["path"])
            return "a replayed request"
        if len(self._used_nonces) >= MAX_USED_NONCES:
            return "too many requests in flight; retry"
        until = self._nonce_fresh(nonce)
        self._used_nonces[nonce] = now if until is None else until
        return None

    def _begin_shutdown(self) -> None:
        """Stop waiting for request bodies: such requests are answered 503 at once, so
        that a slow or stalled client cannot hold up the shutdown."""
        self._closing = True
        for scope in self._body_reads:
            scope.cancel(reason="bootstrap server shutting down")

    # -- ASGI ---------------------------------------------------------------------------

    async def _asgi(
        self,
        connection: _Connection,
        scope: Scope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
    ) -> None:
        """The ASGI app, for requests on ``connection``."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(connection, scope, receive, send)
        else:
            # A websocket upgrade: close it before accepting, which hypercorn answers with a
            # 403 (an app that just returns is a crash to it: a 500).
            await receive()  # websocket.connect
            close: WebsocketCloseEvent = {"type": "websocket.close", "code": 1008, "reason": None}
            await send(close)

    async def _lifespan(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(
        self,
        connection: _Connection,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
    ) -> None:
        method = scope["method"]
        path = scope["path"]
        method_label = method if method in _STANDARD_METHODS else "<other>"
        route_label = path if path in _ROUTE_METHODS else "<other>"
        # (the token's proof: the nonce is checked before the body is read, the proof after)
        claim: tuple[str, str] | str | None = None
        if path in _AUTHENTICATED and self._token is not None:
            claim = self._claim(scope)
        body: bytes | _Reply | None = None
        if not isinstance(claim, str) and (method, path) in _WITH_BODY:
            body = await self._read_body(scope, receive)  # (under the request deadline)
            if body is None:
                return  # the client went away before sending its whole request
        with connection.answering():  # the request is whole: no deadline while we answer
            refusal = claim if isinstance(claim, str) else None
            if isinstance(claim, tuple) and not isinstance(body, _Reply):
                refusal = self._check_proof(scope, claim, body or b"")
            if refusal is not None:
                await trio.lowlevel.checkpoint()
                reply = _unauthorized(refusal)  # (a body, if any, was not read)
            elif isinstance(body, _Reply):
                reply = body
            elif body is not None and path == "/route":
                reply = await self._put_route_guarded(body)
            elif body is not None:
                await trio.lowlevel.checkpoint()
                reply = self._dp_request(path, body)
            else:
                reply = self._dispatch(method, path, scope)
            self._requests[method_label, route_label, reply.status] += 1
            if reply.status == 401:
                self._unauthorized += 1
            if reply.status in (400, 413):
                self._malformed += 1
            headers = [
                (b"content-type", reply.content_type),
                (b"content-length", str(len(reply.body)).encode("ascii")),
                *reply.headers,
            ]
            if self._token is not None:
                # a fresh nonce for the client's next request, and the answer's proof,
                # bound to the request's nonce (every answer to a path that needs the token)
                fresh = self.issue_nonce()
                headers.append((NONCE_HEADER.encode("ascii"), fresh.encode("ascii")))
                if path in _AUTHENTICATED:
                    # (bound to the nonce the request presented, even one refused: so the
                    # client can tell our 401 from an answer forged on the way)
                    nonce = claim[0] if isinstance(claim, tuple) else _presented_nonce(scope)
                    proof = answer_mac(self._token, nonce, reply.status, reply.body, fresh)
                    headers.append((ANSWER_HEADER.encode("ascii"), proof.encode("ascii")))
            await send(
                {"type": "http.response.start", "status": reply.status, "headers": headers}
            )
            await send({"type": "http.response.body", "body": reply.body, "more_body": False})

    def _dispatch(self, method: str, path: str, scope: HTTPScope) -> _Reply:
        """The reply to every request except ``PUT /route`` (which has a body to read)."""
        allowed = _ROUTE_METHODS.get(path)
        if allowed is None:
            return _Reply.error(404, f"no such path: {path}")
        if method not in allowed:
            return _Reply.error(
                405,
                f"{path} does not accept {method}",
                headers=((b"allow", ", ".join(allowed).encode("ascii")),),
            )
        if path == "/route":
            return self._get_route(scope["query_string"])
        if path == "/key":
            return self._get_key(scope["query_string"])
        if path == "/health":
            return _Reply(200, b"OK", content_type=_TEXT)
        if path == "/nonce":  # (every answer carries one; this one only that)
            return _Reply(200, b'{"ok":true}')
        return self._get_metrics()

    async def _read_body(
        self, scope: HTTPScope, receive: ASGIReceiveCallable
    ) -> bytes | _Reply | None:
        """The whole request body, or the reply that refuses it, or None if the client
        went away.

        The body is refused with 413 when over MAX_BODY_BYTES (checked against
        Content-Length before reading anything, and against what arrives), and with 503
        when the server begins to shut down before it arrived.
        """
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > MAX_BODY_BYTES:
                await trio.lowlevel.checkpoint()
                return _TOO_LARGE
        body = bytearray()
        with trio.CancelScope() as read_scope:
            if self._closing:
                read_scope.cancel(reason="bootstrap server shutting down")
            self._body_reads.add(read_scope)
            try:
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return None  # http.disconnect
                    body += message["body"]
                    if len(body) > MAX_BODY_BYTES:
                        return _TOO_LARGE
                    if not message["more_body"]:
                        return bytes(body)
            finally:
                self._body_reads.discard(read_scope)
        return _SHUTTING_DOWN

    async def _put_route_guarded(self, body: bytes) -> _Reply:
        """:meth:`_put_route`, after the replacement rule: a rank already registered under
        another control key (a CURVE public key; "" with authentication off) is replaced only
        once its old control endpoint refuses connections (the old process is gone: a
        restarted rank has a new key). Otherwise ``409``, counted ``refused_replacements``:
        a live rank's route cannot be taken over, not even with the token."""
        await trio.lowlevel.checkpoint()
        try:
            info = msgspec.json.decode(body, type=PrefillRankInfo)
        except msgspec.DecodeError:
            return self._put_route(body)  # (answers 400)
        old = self._table.get(info.tp_rank, info.dp_rank, info.pp_rank)
        if old is not None and old.control_key != info.control_key:
            refused = None
            with trio.move_on_after(_REPLACE_PROBE_TIMEOUT):
                refused = await port_refuses(old.endpoint)
            # (it may have changed meanwhile)
            old = self._table.get(info.tp_rank, info.dp_rank, info.pp_rank)
            if refused is not True and old is not None and old.control_key != info.control_key:
                self._refused_replacements += 1
                logger.warning(
                    "bootstrap: refused to replace tp_rank %d: registered under another "
                    "control key, and its endpoint %s still answers", info.tp_rank, old.endpoint,
                )
                return _Reply.error(
                    409,
                    f"tp_rank {info.tp_rank} is registered under another control key and its "
                    f"endpoint still accepts connections",
                )
        else:
            await trio.lowlevel.checkpoint()
        return self._put_route(body)

    def _put_route(self, body: bytes) -> _Reply:
        try:
            info = msgspec.json.decode(body, type=PrefillRankInfo)
        except msgspec.DecodeError as exc:
            logger.info("bootstrap: refused a malformed registration: %s", exc)
            return _Reply.error(400, f"malformed PrefillRankInfo: {exc}")
        reason = _invalid_reason(info)
        if reason is not None:
            logger.info("bootstrap: refused registration %r: %s", info, reason)
            return _Reply.error(400, reason)
        conflict = self._table.conflict(info)
        if conflict is not None:
            logger.info("bootstrap: refused conflicting registration %r: %s", info, conflict)
            return _Reply.error(409, conflict)
        self._table.register(info)
        logger.debug("bootstrap: registered %r", info)
        return _Reply(200, b'{"ok":true}')

    def _get_route(self, query_string: bytes) -> _Reply:
        try:
            query = (
                parse_qs(query_string.decode("ascii"), keep_blank_values=True, strict_parsing=True)
                if query_string
                else {}
            )
        except (UnicodeDecodeError, ValueError):
            return _Reply.error(400, "unparseable query string")
        unknown = sorted(set(query) - {"tp_rank", "dp_rank", "pp_rank", "key"})
        if unknown:
            return _Reply.error(400, f"unknown query parameter(s): {', '.join(unknown)}")
        if "key" in query:
            keys = query["key"]
            if len(keys) != 1 or not _Z85_KEY.fullmatch(keys[0]):
                return _Reply.error(400, "key must be one CURVE public key in z85")
            self._vouch(keys[0])
        tp_rank = -1
        if "tp_rank" in query:
            values = query["tp_rank"]
            if len(values) != 1 or not _RANK_INT.fullmatch(values[0]):
                return _Reply.error(400, f"tp_rank must be one integer >= -1, not {values!r}")
            tp_rank = int(values[0])
            if tp_rank < -1:
                return _Reply.error(400, f"tp_rank must be >= -1, not {tp_rank}")
        dp_rank = 0
        if "dp_rank" in query:
            values = query["dp_rank"]
            if len(values) != 1 or not _RANK_INT.fullmatch(values[0]) or int(values[0]) < 0:
                return _Reply.error(400, f"dp_rank must be one integer >= 0, not {values!r}")
            dp_rank = int(values[0])
        pp_rank = 0
        if "pp_rank" in query:
            values = query["pp_rank"]
            if len(values) != 1 or not _RANK_INT.fullmatch(values[0]) or int(values[0]) < 0:
                return _Reply.error(400, f"pp_rank must be one integer >= 0, not {values!r}")
            pp_rank = int(values[0])
        tp_size, dp_size = self._table.tp_size, self._table.dp_size
        pp_size = self._table.pp_size
        if dp_size is not None and dp_rank >= dp_size:
            return _Reply.error(404, f"no dp_rank {dp_rank}: dp_size is {dp_size}")
        if pp_size is not None and pp_rank >= pp_size:
            return _Reply.error(404, f"no pp_rank {pp_rank}: pp_size is {pp_size}")
        if tp_size is not None and tp_rank >= tp_size:
            return _Reply.error(404, f"no tp_rank {tp_rank}: tp_size is {tp_size}")
        topology = self._table.topology(dp_rank)
        if topology is None:
            if dp_size is not None and dp_size > 1:
                return _Reply.error(
                    503, f"not ready: {self._table.group_size(dp_rank)} of "
                    f"{(tp_size or 0) * (pp_size or 1)} ranks of dp_rank {dp_rank} registered"
                )
            if pp_size is not None and pp_size > 1:
                return _Reply.error(
                    503, f"not ready: {len(self._table)} of {tp_size} x {pp_size} ranks "
                    f"(TP x PP) registered"
                )
            return _Reply.error(
                503, f"not ready: {len(self._table)} of {tp_size or '?'} ranks registered"
            )
        if tp_rank == -1:
            return _Reply(200, msgspec.json.encode(topology))
        return _Reply(200, msgspec.json.encode(topology.stage(pp_rank)[tp_rank]))

    def _vouch(self, key: str) -> None:
        """A decode rank that reads a route with the token announces its CURVE key: from
        then on the service vouches for it (``GET /key``), so that prefill ranks admit its
        control connections (docs/security.md). Bounded, least recently announced first
        out."""
        self._vouched.pop(key, None)
        while len(self._vouched) >= MAX_VOUCHED_KEYS:
            self._vouched.popitem(last=False)
        self._vouched[key] = None

    def _get_key(self, query_string: bytes) -> _Reply:
        """``GET /key?key=K``: ``{"vouched": true}`` when a decode rank announced K."""
        try:
            query = parse_qs(query_string.decode("ascii"), strict_parsing=True)
        except (UnicodeDecodeError, ValueError):
            return _Reply.error(400, "unparseable query string")
        keys = query.get("key", [])
        if set(query) != {"key"} or len(keys) != 1 or not _Z85_KEY.fullmatch(keys[0]):
            return _Reply.error(400, "GET /key takes one key, a CURVE public key in z85")
        vouched = keys[0] in self._vouched
        return _Reply(200, b'{"vouched":true}' if vouched else b'{"vouched":false}')

    def _dp_request(self, path: str, body: bytes) -> _Reply:
        """``POST /register_dp_rank`` or ``POST /query_dp_ranks`` (DP attention; see the
        module's docstring). Bounded: at most :data:`MAX_DP_BATCH` rooms (else ``413``), and
        at most ``max_dp_rooms`` records held."""
        try:
            request: _DpRegistration | _DpQuery = (
                msgspec.json.decode(body, type=_DpRegistration)
                if path == "/register_dp_rank"
                else msgspec.json.decode(body, type=_DpQuery)
            )
        except msgspec.DecodeError as exc:
            logger.info("bootstrap: refused a malformed %s: %s", path, exc)
            return _Reply.error(400, f"malformed {path} body: {exc}")
        rooms = request.rooms
        if not rooms:
            return _Reply.error(400, f"{path}: no rooms")
        if len(rooms) > MAX_DP_BATCH:
            return _Reply.error(
                413, f"{path}: {len(rooms)} rooms in one request, over {MAX_DP_BATCH}"
            )
        dp_size = self._table.dp_size
        if dp_size is None:
            return _Reply.error(503, "not ready: no prefill rank registered (DP size unknown)")
        now = trio.current_time()
        if isinstance(request, _DpRegistration):
            if request.dp_rank >= dp_size:
                return _Reply.error(
                    400, f"dp_rank {request.dp_rank} is outside [0, dp_size={dp_size})"
                )
            for r in rooms:
                self._dp_rooms.put(r.room, r.epoch, request.dp_rank, now)
            self._dp_registered += len(rooms)
            return _Reply(200, msgspec.json.encode({"ok": True, "registered": len(rooms)}))
        if dp_size == 1:
            ranks = [0] * len(rooms)  # one DP rank holds every room
        else:
            ranks = [self._dp_rooms.get(r.room, r.epoch, now) for r in rooms]
            # a room recorded under an earlier, larger DP size (an instance re-registering
            # with another shape) is unknown now: its rank would make the whole answer one
            # the client must refuse, and fail every room it asked about
            ranks = [UNKNOWN_DP_RANK if k >= dp_size else k for k in ranks]
            self._dp_unknown += ranks.count(UNKNOWN_DP_RANK)
        return _Reply(200, msgspec.json.encode(DpRanks(dp_size=dp_size, dp_ranks=ranks)))

    def _get_metrics(self) -> _Reply:
        if self._metrics_registry is None:
            return _Reply.error(404, "metrics are not enabled on this server")
        return _Reply(
            200,
            generate_latest(self._metrics_registry),
            content_type=CONTENT_TYPE_LATEST.encode("ascii"),
        )


def _config(server: BootstrapServer) -> _HypercornConfig:
    """Hypercorn's settings for ``server``."""
    config = _HypercornConfig()
    config.accesslog = None
    config.errorlog = logging.getLogger("trio_pd.bootstrap.http")
    config.graceful_timeout = _GRACEFUL_TIMEOUT
    config.read_timeout = _READ_TIMEOUT
    # Hypercorn's own bound on the wait for a request *head* (from the accept, or the end of
    # the last answer): a backstop, since the request deadline of _Connection, which also
    # covers the body, starts first and ends first.
    config.keep_alive_timeout = 2 * server._request_timeout
    if server._tls is not None:
        config.certfile, config.keyfile = server._tls
    return config


async def _serve_http(
    server: BootstrapServer,
    sock: socket.socket,
    config: _HypercornConfig,
    shutdown: trio.Event,
    listening: trio.Event,
) -> None:
    """Serve ``server`` on ``sock`` until ``shutdown`` is set, then stop gracefully.

    What hypercorn's trio worker does with a listening socket (its connection handling,
    ``TCPServer``, speaks HTTP to the app), with an accept loop of ours in front of it: each
    accepted connection is admitted under the cap (:meth:`BootstrapServer._admit`) and served
    by hypercorn through a :class:`_Connection`, inside its scope (the request deadline).
    Hypercorn offers
    neither: its timeouts are per read (``read_timeout``) or bound the request head only
    (``keep_alive_timeout``), and it accepts without limit.
    """
    context = _HypercornWorkerContext(None)
    ssl_context = config.create_ssl_context()
    sock.listen(config.backlog)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

    async def handle(stream: trio.SocketStream) -> None:
        connection = server._admit(stream)
        if connection is None:
            await trio.aclose_forcefully(stream)  # at the cap
            return
        try:
            transport: trio.abc.Stream = connection
            if ssl_context is not None:
                transport = trio.SSLStream(
                    connection, ssl_context, server_side=True, https_compatible=True
                )
            app = _HypercornASGIWrapper(partial(server._asgi, connection))
            with connection.scope:
                await _HypercornTCPServer(  # its annotation names only the TLS stream
                    app, config, context, ConnectionState({}), transport  # type: ignore[arg-type]
                ).run()
            if connection.expired:
                server._timed_out += 1
                logger.info(
                    "bootstrap: closed a connection whose request was not whole in %s s",
                    server._request_timeout,
                )
        finally:
            server._connections.discard(connection)
            # (hypercorn leaves the stream open when the TLS handshake fails)
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as handlers:
        async with trio.open_nursery() as accepting:
            accepting.start_soon(
                partial(trio.serve_listeners, handle, [listener], handler_nursery=handlers)
            )
            listening.set()
            await shutdown.wait()
            accepting.cancel_scope.cancel(reason="bootstrap server shutting down")
        # As hypercorn's worker: idle connections close now, no connection is kept alive
        # after its answer, and requests in flight get graceful_timeout.
        await context.terminated.set()
        handlers.cancel_scope.deadline = trio.current_time() + config.graceful_timeout


async def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, not yet listening (hypercorn listens)."""
    try:
        infos = await trio.socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, type_, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, type_, proto)
    except OSError as exc:
        raise BootstrapError(f"cannot bind the bootstrap service to {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise BootstrapError(f"cannot bind the bootstrap service to {host}:{port}: {exc}") from exc
    return sock


def _close_listening(sock: socket.socket) -> None:
    if sock.fileno() != -1:
        trio.lowlevel.notify_closing(sock)
        sock.close()


def _new_server(
    sock: socket.socket,
    metrics_registry: CollectorRegistry | None,
    token: str | None = None,
    tls: tuple[str, str] | None = None,
    request_timeout: float = REQUEST_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    dp_limits: tuple[float, int] = (DP_ROOM_TTL, MAX_DP_ROOMS),
) -> BootstrapServer:
    """The server for ``sock``, its metrics registered with ``metrics_registry``."""
    addr = sock.getsockname()
    host, port = addr[0], addr[1]
    shown = f"[{host}]" if sock.family == socket.AF_INET6 else host
    scheme = "http" if tls is None else "https"
    server = BootstrapServer(
        host=host, port=port, url=f"{scheme}://{shown}:{port}",
        metrics_registry=metrics_registry, token=token, tls=tls,
        request_timeout=request_timeout, max_connections=max_connections,
        dp_room_ttl=dp_limits[0], max_dp_rooms=dp_limits[1],
    )
    if metrics_registry is not None:
        try:
            metrics_registry.register(server._collector)
        except ValueError as exc:  # the registry already has these names
            raise BootstrapError(f"cannot export bootstrap metrics: {exc}") from exc
    return server


def _release(server: BootstrapServer, sock: socket.socket) -> None:
    if server._metrics_registry is not None:
        server._metrics_registry.unregister(server._collector)
    _close_listening(sock)


async def _serve(
    server: BootstrapServer,
    sock: socket.socket,
    *,
    task_status: trio.TaskStatus[BootstrapServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve on ``sock`` until cancelled, then shut down gracefully, bounded."""
    config = _config(server)
    shutdown = trio.Event()
    listening = trio.Event()
    # Shielded so that cancelling us starts a graceful shutdown instead of tearing the
    # connections down mid-write; the deadline set below bounds that shutdown.
    serve_scope = trio.CancelScope(shield=True)

    async def run_http() -> None:
        with serve_scope:
            await _serve_http(server, sock, config, shutdown, listening)
        if serve_scope.cancelled_caught:
            logger.warning("bootstrap service %s: shutdown overran, cancelled it", server.url)

    try:
        async with trio.open_nursery() as nursery:
            # Not nursery.start(): if we were cancelled while it waits, trio would leave
            # the (shielded) child where it is and wait for it to exit, which it only does
            # once the finally below has run: a deadlock.
            nursery.start_soon(run_http)
            try:
                await listening.wait()
                logger.info("bootstrap service listening on %s", server.url)
                task_status.started(server)
                await trio.sleep_forever()
            finally:
                server._begin_shutdown()
                shutdown.set()
                serve_scope.deadline = trio.current_time() + _SHUTDOWN_BACKSTOP
    except ExceptionGroup as group:  # hypercorn failed (a Cancelled is never in one)
        raise BootstrapError(f"bootstrap service on {server.url} failed") from group


def _auth(
    host: str,
    token: str | None,
    secure: bool | None,
    certfile: str | None,
    keyfile: str | None,
) -> tuple[str | None, tuple[str, str] | None]:
    """The token the service requires (``trio_pd._security.resolve``: required outside
    loopback) and its TLS files; :class:`~trio_pd.ConfigurationError` for what cannot
    work."""
    security = resolve(what="bootstrap service", hosts=[host], token=token, secure=secure)
    if (certfile is None) != (keyfile is None):
        raise ConfigurationError("bootstrap service: TLS needs both certfile and keyfile")
    tls = None if certfile is None or keyfile is None else (certfile, keyfile)
    return security.token, tls


def _check_limits(
    request_timeout: float,
    max_connections: int,
    dp_limits: tuple[float, int] = (DP_ROOM_TTL, MAX_DP_ROOMS),
) -> None:
    """:class:`~trio_pd.ConfigurationError` for a deadline or cap that cannot work."""
    dp_room_ttl, max_dp_rooms = dp_limits
    if not 0 < dp_room_ttl < math.inf:
        raise ConfigurationError(
            f"bootstrap service: dp_room_ttl must be a positive number of seconds, "
            f"not {dp_room_ttl!r}"
        )
    if isinstance(max_dp_rooms, bool) or not isinstance(max_dp_rooms, int) or max_dp_rooms < 1:
        raise ConfigurationError(
            f"bootstrap service: max_dp_rooms must be an int >= 1, not {max_dp_rooms!r}"
        )
    if not 0 < request_timeout < math.inf:
        raise ConfigurationError(
            f"bootstrap service: request_timeout must be a positive number of seconds, "
            f"not {request_timeout!r}"
        )
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) or (
        max_connections < 1
    ):
        raise ConfigurationError(
            f"bootstrap service: max_connections must be an int >= 1, not {max_connections!r}"
        )


async def _bound_server(
    host: str,
    port: int,
    metrics_registry: CollectorRegistry | None,
    token: str | None = None,
    tls: tuple[str, str] | None = None,
    request_timeout: float = REQUEST_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    dp_limits: tuple[float, int] = (DP_ROOM_TTL, MAX_DP_ROOMS),
) -> tuple[socket.socket, BootstrapServer]:
    """Bind the listening socket and build the server on it; on failure, close the socket."""
    sock = await _bind(host, port)
    try:
        return sock, _new_server(
            sock, metrics_registry, token, tls, request_timeout, max_connections, dp_limits
        )
    except BaseException:
        _close_listening(sock)
        raise


async def serve_bootstrap(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    metrics_registry: CollectorRegistry | None = None,
    token: str | None = None,
    secure: bool | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    request_timeout: float = REQUEST_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    dp_room_ttl: float = DP_ROOM_TTL,
    max_dp_rooms: int = MAX_DP_ROOMS,
    task_status: trio.TaskStatus[BootstrapServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the bootstrap service on ``host:port`` until cancelled.

    ``token`` (left out: ``TRIO_PD_TOKEN``, else, on loopback, this process's own) is the
    cluster token every ``/route`` request must prove (an HMAC over a one-time nonce and the
    request; ``401`` otherwise; ``/health``, ``/nonce`` and ``/metrics`` stay open). It is
    required unless ``secure=False`` (or ``TRIO_PD_SECURE=0``) turns it off, explicitly and
    logged; off loopback, with no token, :class:`~trio_pd.ConfigurationError`. ``certfile`` and
    ``keyfile`` (PEM) make it serve https (hypercorn's TLS); the server's ``url`` then says
    ``https://``. See docs/security.md.

    ``request_timeout`` (seconds, default 5) is how long a connection has to deliver a whole
    request, head and body, from its accept or from the end of the previous answer, and to
    take each write of an answer; past it the connection is closed, however slowly it keeps
    sending. ``max_connections`` (default 512) caps the connections open at once: beyond it,
    the one that has waited longest for its request is closed to make room (or the new one,
    if every open connection is being answered). Both are counted in
    :meth:`BootstrapServer.statistics`.

    DP attention (docs/topologies.md): ``max_dp_rooms`` (default 100,000) caps the "room R is
    on DP rank K" records held at once (past it the oldest goes, counted
    ``dp_rooms_evicted``), and ``dp_room_ttl`` (seconds, default 60) is how long each is kept
    after its registration (counted ``dp_rooms_expired``).

    Binds the socket first (port 0 picks a free port; the server's ``port`` is the real
    one), starts hypercorn on it, and calls ``task_status.started(server)`` with the
    :class:`BootstrapServer` once it accepts connections. With ``metrics_registry`` (a
    ``prometheus_client.CollectorRegistry``), the server's counters are registered with it
    (one server per registry) and ``GET /metrics`` serves that registry; they are
    unregistered when the server stops.

    Raises :class:`BootstrapError` if the address cannot be bound, the registry already
    holds bootstrap metrics, or hypercorn fails; :class:`~trio_pd.ConfigurationError` for a
    ``request_timeout``, ``max_connections``, ``dp_room_ttl`` or ``max_dp_rooms`` that is not
    positive.

    **Cancellation:** cancellation is the normal way to stop. The server stops accepting,
    answers any request still waiting for its body with 503, lets requests in flight finish
    for up to half a second, closes idle connections, and re-raises ``Cancelled`` once
    hypercorn has stopped and the listening socket is closed. The shutdown is shielded but
    bounded: past one second it is cancelled outright (and a warning is logged).
    """
    token, tls = _auth(host, token, secure, certfile, keyfile)
    dp_limits = (dp_room_ttl, max_dp_rooms)
    _check_limits(request_timeout, max_connections, dp_limits)
    sock, server = await _bound_server(
        host, port, metrics_registry, token, tls, request_timeout, max_connections, dp_limits
    )
    try:
        await _serve(server, sock, task_status=task_status)
    finally:
        _release(server, sock)


@one_error
@asynccontextmanager
async def open_bootstrap_server(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    metrics_registry: CollectorRegistry | None = None,
    token: str | None = None,
    secure: bool | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    request_timeout: float = REQUEST_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    dp_room_ttl: float = DP_ROOM_TTL,
    max_dp_rooms: int = MAX_DP_ROOMS,
) -> AsyncIterator[BootstrapServer]:
    """Run the bootstrap service for the duration of an ``async with`` block.

    Yields the :class:`BootstrapServer` once it accepts connections; see
    :func:`serve_bootstrap` for the arguments. Errors at start (the address cannot be
    bound...) are raised as they are. Leaving the block shuts the server down, well under a
    second. An exception raised in the block comes out as itself, not in an
    ExceptionGroup (so ``open_prefill``'s :class:`~trio_pd.ConfigurationError`, entered
    inside the block, is caught by ``except ConfigurationError``).

    **Cancellation:** if the block is cancelled, the server shuts down as on a normal exit
    and the ``Cancelled`` propagates; the shutdown itself is shielded and bounded (see
    :func:`serve_bootstrap`).
    """
    token, tls = _auth(host, token, secure, certfile, keyfile)
    dp_limits = (dp_room_ttl, max_dp_rooms)
    _check_limits(request_timeout, max_connections, dp_limits)
    sock, server = await _bound_server(
        host, port, metrics_registry, token, tls, request_timeout, max_connections, dp_limits
    )
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(_serve, server, sock))
            try:
                yield server
            finally:
                nursery.cancel_scope.cancel(reason="open_bootstrap_server block exited")
    finally:
        _release(server, sock)
