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

The service is split by concern: the rank table (``_bootstrap_ranks``, pure), the DP-attention
records (``_bootstrap_dp``, pure), the token's nonces and proofs and the vouched keys
(``_bootstrap_auth``), the bounds on connections (``_bootstrap_limits``), the routes
(``_bootstrap_routes``), the ASGI app and the accept loop (``_bootstrap_http``), the counters
(``_bootstrap_metrics``); this module puts them together. The app is served by hypercorn's
HTTP/1.1 and HTTP/2 connection handling on a socket this module binds and accepts on itself
(the accept loop enforces the cap, a wrapper around each accepted stream the deadline), so
port ``0`` works and the listening socket is closed when the server stops.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from types import MappingProxyType
from typing import Final

import trio
from hypercorn.config import Config as _HypercornConfig
from prometheus_client import CollectorRegistry

from ..core._errors import BootstrapError, one_error
from ._bootstrap_auth import NonceGate, resolve_auth
from ._bootstrap_dp import DP_ROOM_TTL, MAX_DP_ROOMS
from ._bootstrap_http import App, bind, close_listening, serve_http
from ._bootstrap_limits import MAX_CONNECTIONS, REQUEST_TIMEOUT, Connections, check_limits
from ._bootstrap_metrics import BootstrapStatistics, MetricsCollector
from ._bootstrap_routes import Routes

__all__ = [
    "BootstrapServer",
    "BootstrapStatistics",
    "open_bootstrap_server",
    "serve_bootstrap",
]

logger = logging.getLogger("trio_pd.bootstrap")

# How long requests still in flight at shutdown may take before hypercorn cancels them, and
# the hard bound on the whole shutdown after which the serving task itself is cancelled.
_GRACEFUL_TIMEOUT: Final = 0.5
_SHUTDOWN_BACKSTOP: Final = 1.0
# A connection that sends nothing for this long while a request is open is dropped.
_READ_TIMEOUT: Final = 30


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
        self._tls = tls
        self._metrics_registry = metrics_registry
        #: the connections open and the bounds on them
        self._connections = Connections(
            request_timeout=request_timeout, max_connections=max_connections
        )
        #: the state the routes answer over (rank table, DP records, vouched keys)
        self._routes = Routes(
            metrics_registry=metrics_registry, dp_room_ttl=dp_room_ttl, max_dp_rooms=max_dp_rooms
        )
        #: the nonces this service issues, and the proofs of the cluster token it takes
        self._gate = NonceGate(token)
        # (without a token, nothing is checked)
        self._app = App(self._routes, None if token is None else self._gate)
        self._collector = MetricsCollector(self.statistics)

    def __repr__(self) -> str:
        return f"<BootstrapServer {self.url}>"

    def statistics(self) -> BootstrapStatistics:
        """A snapshot of the counters; see :class:`BootstrapStatistics`."""
        routes, table, app = self._routes, self._routes.table, self._app
        return BootstrapStatistics(
            requests=MappingProxyType(dict(app.requests)),
            malformed=app.malformed,
            registered_ranks=len(table),
            tp_size=table.tp_size,
            ready=table.complete,
            unauthorized=app.unauthorized,
            replayed=self._gate.replayed,
            refused_replacements=routes.refused_replacements,
            timed_out_connections=self._connections.timed_out,
            shed_connections=self._connections.shed,
            open_connections=len(self._connections.open),
            dp_size=table.dp_size,
            dp_rooms=len(routes.dp_rooms),
            dp_rooms_registered=routes.dp_registered,
            dp_rooms_evicted=routes.dp_rooms.evicted,
            dp_rooms_expired=routes.dp_rooms.expired,
            dp_rooms_unknown=routes.dp_unknown,
        )

    def issue_nonce(self) -> str:
        """A fresh nonce: its issue time (ms, monotonic), 8 random bytes and a tag under a
        key of this service; checked without any state."""
        return self._gate.issue()

    def _begin_shutdown(self) -> None:
        """Stop waiting for request bodies: such requests are answered 503 at once, so
        that a slow or stalled client cannot hold up the shutdown."""
        self._app.begin_shutdown()


def _config(server: BootstrapServer) -> _HypercornConfig:
    """Hypercorn's settings for ``server``."""
    config = _HypercornConfig()
    config.accesslog = None
    config.errorlog = logging.getLogger("trio_pd.bootstrap.http")
    config.graceful_timeout = _GRACEFUL_TIMEOUT
    config.read_timeout = _READ_TIMEOUT
    # Hypercorn's own bound on the wait for a request *head* (from the accept, or the end of
    # the last answer): a backstop, since the request deadline of a Connection, which also
    # covers the body, starts first and ends first.
    config.keep_alive_timeout = 2 * server._connections.request_timeout
    if server._tls is not None:
        config.certfile, config.keyfile = server._tls
    return config


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
    close_listening(sock)


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
            await serve_http(server._app, server._connections, sock, config, shutdown, listening)
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
    sock = await bind(host, port)
    try:
        return sock, _new_server(
            sock, metrics_registry, token, tls, request_timeout, max_connections, dp_limits
        )
    except BaseException:
        close_listening(sock)
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
    token, tls = resolve_auth(host, token, secure, certfile, keyfile)
    dp_limits = (dp_room_ttl, max_dp_rooms)
    check_limits(request_timeout, max_connections, dp_limits)
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
    token, tls = resolve_auth(host, token, secure, certfile, keyfile)
    dp_limits = (dp_room_ttl, max_dp_rooms)
    check_limits(request_timeout, max_connections, dp_limits)
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
