"""The bootstrap service's HTTP side: the ASGI app that reads each request, checks the
token's proof and counts every answer (:class:`App`), and the accept loop that serves it
with hypercorn's HTTP/1.1 and HTTP/2 connection handling, under the bounds of
:mod:`trio_pd.bootstrap._bootstrap_limits` (:func:`serve_http`).
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from functools import partial
from typing import Final

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

from ..core._errors import BootstrapError
from ..io._security import ANSWER_HEADER, AUTH_SCHEME, NONCE_HEADER, STALE_HEADER
from ._bootstrap_auth import STALE_NONCE, NonceGate, presented_nonce
from ._bootstrap_limits import MAX_BODY_BYTES, Connection, Connections
from ._bootstrap_routes import AUTHENTICATED, ROUTE_METHODS, WITH_BODY, Reply, Routes

logger = logging.getLogger("trio_pd.bootstrap")

STANDARD_METHODS: Final = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE"}
)

TOO_LARGE: Final = Reply.error(
    413, f"request body over {MAX_BODY_BYTES} bytes", headers=((b"connection", b"close"),)
)


def unauthorized(why: str) -> Reply:
    headers = [(b"www-authenticate", AUTH_SCHEME.encode("ascii")), (b"connection", b"close")]
    if why == STALE_NONCE:  # (the client may retry once, with the nonce of this answer)
        headers.append((STALE_HEADER.encode("ascii"), b"1"))
    return Reply.error(
        401, f"this bootstrap service needs a proof of the cluster token: {why}",
        headers=tuple(headers),
    )


SHUTTING_DOWN: Final = Reply.error(
    503, "bootstrap server shutting down", headers=((b"connection", b"close"),)
)


class App:
    """The ASGI app of one service, called once per request with the :class:`Connection`
    it came on.

    Counts every answer by (method, route, status), the ``400``/``413`` ones as malformed
    and the ``401`` ones as unauthorized. With a :class:`NonceGate` (a service with a
    cluster token), the paths that need the token are answered only to a request whose
    proof holds, and every answer carries a fresh nonce.
    """

    def __init__(self, routes: Routes, gate: NonceGate | None) -> None:
        self.routes = routes
        #: the token's nonces and proofs (None: no token, nothing checked)
        self.gate = gate
        self.requests: Counter[tuple[str, str, int]] = Counter()
        self.malformed = 0
        self.unauthorized = 0
        # set once by begin_shutdown: a body not read yet is never waited for
        self._closing = False
        # the scopes of the body reads in flight (begin_shutdown cancels them)
        self._body_reads: set[trio.CancelScope] = set()

    def begin_shutdown(self) -> None:
        """Stop waiting for request bodies: such requests are answered 503 at once, so
        that a slow or stalled client cannot hold up the shutdown."""
        self._closing = True
        for scope in self._body_reads:
            scope.cancel(reason="bootstrap server shutting down")


    async def __call__(
        self,
        connection: Connection,
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
        connection: Connection,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
    ) -> None:
        method = scope["method"]
        path = scope["path"]
        method_label = method if method in STANDARD_METHODS else "<other>"
        route_label = path if path in ROUTE_METHODS else "<other>"
        # (the token's proof: the nonce is checked before the body is read, the proof after)
        gate = self.gate
        claim: tuple[str, str] | str | None = None
        if path in AUTHENTICATED and gate is not None:
            claim = gate.claim(scope)
        body: bytes | Reply | None = None
        if not isinstance(claim, str) and (method, path) in WITH_BODY:
            body = await self._read_body(scope, receive)  # (under the request deadline)
            if body is None:
                return  # the client went away before sending its whole request
        with connection.answering():  # the request is whole: no deadline while we answer
            refusal = claim if isinstance(claim, str) else None
            if isinstance(claim, tuple) and gate is not None and not isinstance(body, Reply):
                refusal = gate.check(scope, claim, body or b"")
            if refusal is not None:
                await trio.lowlevel.checkpoint()
                reply = unauthorized(refusal)  # (a body, if any, was not read)
            elif isinstance(body, Reply):
                reply = body
            elif body is not None and path == "/route":
                reply = await self.routes.put_route(body)
            elif body is not None:
                await trio.lowlevel.checkpoint()
                reply = self.routes.dp_request(path, body)
            else:
                reply = self.routes.dispatch(method, path, scope)
            self.requests[method_label, route_label, reply.status] += 1
            if reply.status == 401:
                self.unauthorized += 1
            if reply.status in (400, 413):
                self.malformed += 1
            headers = [
                (b"content-type", reply.content_type),
                (b"content-length", str(len(reply.body)).encode("ascii")),
                *reply.headers,
            ]
            if gate is not None:
                # a fresh nonce for the client's next request, and the answer's proof,
                # bound to the request's nonce (every answer to a path that needs the token)
                fresh = gate.issue()
                headers.append((NONCE_HEADER.encode("ascii"), fresh.encode("ascii")))
                if path in AUTHENTICATED:
                    # (bound to the nonce the request presented, even one refused: so the
                    # client can tell our 401 from an answer forged on the way)
                    nonce = claim[0] if isinstance(claim, tuple) else presented_nonce(scope)
                    proof = gate.answer(nonce, reply.status, reply.body, fresh)
                    headers.append((ANSWER_HEADER.encode("ascii"), proof.encode("ascii")))
            await send(
                {"type": "http.response.start", "status": reply.status, "headers": headers}
            )
            await send({"type": "http.response.body", "body": reply.body, "more_body": False})

    async def _read_body(
        self, scope: HTTPScope, receive: ASGIReceiveCallable
    ) -> bytes | Reply | None:
        """The whole request body, or the reply that refuses it, or None if the client
        went away.

        The body is refused with 413 when over MAX_BODY_BYTES (checked against
        Content-Length before reading anything, and against what arrives), and with 503
        when the server begins to shut down before it arrived.
        """
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > MAX_BODY_BYTES:
                await trio.lowlevel.checkpoint()
                return TOO_LARGE
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
                        return TOO_LARGE
                    if not message["more_body"]:
                        return bytes(body)
            finally:
                self._body_reads.discard(read_scope)
        return SHUTTING_DOWN


async def serve_http(
    app: App,
    connections: Connections,
    sock: socket.socket,
    config: _HypercornConfig,
    shutdown: trio.Event,
    listening: trio.Event,
) -> None:
    """Serve ``app`` on ``sock`` until ``shutdown`` is set, then stop gracefully.

    What hypercorn's trio worker does with a listening socket (its connection handling,
    ``TCPServer``, speaks HTTP to the app), with an accept loop of ours in front of it: each
    accepted connection is admitted under the cap (:meth:`Connections.admit`) and served
    by hypercorn through a :class:`Connection`, inside its scope (the request deadline).
    Hypercorn offers neither: its timeouts are per read (``read_timeout``) or bound the
    request head only (``keep_alive_timeout``), and it accepts without limit.
    """
    context = _HypercornWorkerContext(None)
    ssl_context = config.create_ssl_context()
    sock.listen(config.backlog)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

    async def handle(stream: trio.SocketStream) -> None:
        connection = connections.admit(stream)
        if connection is None:
            await trio.aclose_forcefully(stream)  # at the cap
            return
        try:
            transport: trio.abc.Stream = connection
            if ssl_context is not None:
                transport = trio.SSLStream(
                    connection, ssl_context, server_side=True, https_compatible=True
                )
            wrapped = _HypercornASGIWrapper(partial(app, connection))
            with connection.scope:
                await _HypercornTCPServer(  # its annotation names only the TLS stream
                    wrapped, config, context, ConnectionState({}), transport  # type: ignore[arg-type]
                ).run()
            if connection.expired:
                connections.timed_out += 1
                logger.info(
                    "bootstrap: closed a connection whose request was not whole in %s s",
                    connections.request_timeout,
                )
        finally:
            connections.open.discard(connection)
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


async def bind(host: str, port: int) -> socket.socket:
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


def close_listening(sock: socket.socket) -> None:
    if sock.fileno() != -1:
        trio.lowlevel.notify_closing(sock)
        sock.close()

