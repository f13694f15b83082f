"""The control channel one agent uses: a bound PULL socket for what peers send us, and one
PUSH socket per peer endpoint for what we send them.

Every send here is non-blocking (SPEC §5.4): a full socket answers ``False`` at once and is
counted; it never holds a lock or a task. Each peer has its own socket, so one stalled peer
never delays messages to another (I7). Receiving decodes strictly; a bad message is logged and
counted and the listener goes on (SPEC §6).

Whatever arrives, the listener survives it. A message that does not decode (a reply endpoint
that :func:`~trio_pd.core._wire.numeric_endpoint` refuses included) counts as ``bad_messages``;
a handler that refuses one with a :class:`TransferError` counts ``refused_messages``; a handler
that raises anything else (a bug, or input nobody foresaw) counts ``handler_errors``. Each is
contained to its message, and logged at most once per kind of error per
:data:`ControlPlane.LOG_INTERVAL` seconds (the rest are counted, and the next log line says
how many were not logged).

Closing cannot hang. ``zmq.Context.term`` blocks until every socket of the context is closed
and has flushed or given up its queue (``LINGER``), and it runs off the trio thread, so
:meth:`ControlPlane.aclose` closes every socket first (on the trio thread, which owns them),
then waits for ``term`` under a deadline, and past the deadline closes with ``LINGER=0`` any
socket the context still has open, which lets ``term`` return. It never calls
``Context.destroy`` there: ``destroy`` ends in a second ``term`` on the same context, and
pyzmq only clears the context's handle once the first ``term`` has returned, so that would
enter libzmq's ``zmq_ctx_term`` twice for one context.

With CURVE on (``keys=``, docs/security.md) both PULL sockets are CURVE servers, a ZAP handler
(:func:`~trio_pd.io._security.serve_zap`) on an inproc ROUTER socket admits only the keys the
plane knows (every key :meth:`ControlPlane.authorize` or :meth:`ControlPlane.admit` was
given) or that :attr:`ControlPlane.vouch` vouches for, names every client by its public key,
and each message is handed to the handler with that key; a PUSH socket is made only for an
endpoint :meth:`ControlPlane.authorize` gave a key, as a CURVE client of it.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import trio
import zmq

from ..core import _wire
from ..core._errors import AuthenticationError, ProtocolError, TransferError
from ..core._stats import Counters
from ._security import ZAP_ENDPOINT, Keypair, Vouch, ZapGate, serve_zap
from ._timers import Timers
from ._zmq import Socket, open_socket

log = logging.getLogger("trio_pd.control")


def sweep_idle_sockets(timers: Timers, control: ControlPlane, idle: float) -> None:
    """Close ``control``'s PUSH sockets idle for ``idle`` seconds, every ``idle / 2``
    seconds, from ``timers`` (one timer, for good; the agent's timer task runs it)."""
    period = max(idle / 2, 0.01)

    def sweep() -> None:
        try:
            control.close_idle(idle)
        finally:
            timers.after(period, sweep)

    timers.after(period, sweep)

#: errnos that mean "out of a resource" (descriptors, memory, buffers), not "a bad address":
#: a socket that cannot be made for them is a counted, local failure of that one send
EXHAUSTED_ERRNOS: frozenset[int] = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
)

#: ``handle(msg, pages)``; with CURVE on, ``handle(msg, pages, sender)``, where ``sender`` is
#: the z85 public key the message came from (the ZAP handler's User-Id). A handler for a
#: CURVE plane takes ``sender: str | None = None`` (None: a trusted local call).
Handler = Callable[..., None]


def _is_ipv6(host: str) -> bool:
    """Whether ``host`` is an IPv6 literal (a socket for it needs ``zmq.IPV6``)."""
    address = _wire.ip_literal(host)
    return address is not None and address.version == 6


class ControlPlane:
    """One agent's sockets, bound when it is constructed; close them with :meth:`aclose`."""

    #: at most this many waiting messages are handled in one scheduling step
    BATCH = 64
    #: seconds between two log lines for the same kind of error in :meth:`_dispatch`
    LOG_INTERVAL = 10.0
    #: :meth:`aclose` gives ``Context.term`` its linger plus this long, twice at most
    TERM_GRACE = 2.0
    _MAX_LOG_KINDS = 64

    def __init__(
        self,
        host: str,
        counters: Counters,
        *,
        sndhwm: int = 10_000,
        max_peers: int = 512,
        keys: Keypair | None = None,
    ) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, not {max_peers!r}")
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._counters = counters
        self._sndhwm = sndhwm
        #: at most this many PUSH sockets are open; a new endpoint past it evicts the least
        #: recently used one (see :meth:`send_nowait`). Below libzmq's default MAX_SOCKETS
        #: (1023 per context), which would otherwise refuse the next socket with EMFILE.
        self.max_peers = max_peers
        #: endpoint -> its PUSH socket, least recently used first
        self._push: OrderedDict[str, Socket] = OrderedDict()
        #: endpoint -> time.monotonic() of its last send (for :meth:`close_idle`)
        self._used: dict[str, float] = {}
        # (counter, exception type) -> [last logged at, errors not logged since]
        self._log_state: dict[tuple[str, type[BaseException]], list[float]] = {}
        self._term_done: trio.Event | None = None
        #: CURVE on (docs/security.md): our keypair; every PULL socket is a CURVE server, and
        #: every PUSH socket a CURVE client of the key :meth:`authorize` gave its endpoint
        self.keys = keys
        #: endpoint -> the peer's CURVE public key (z85), most recently authorised last: keys
        #: from the bootstrap service or a verified REGISTER, and (bounded apart, so that
        #: they cannot push those out) reply endpoints a PING named
        self._server_keys: OrderedDict[str, bytes] = OrderedDict()
        self._reply_keys: OrderedDict[str, bytes] = OrderedDict()
        #: keys whose clients the ZAP handler admits (LRU, at most MAX_KEYS + MAX_REPLY_KEYS):
        #: every key :meth:`authorize` or :meth:`admit` was given
        self._admitted: OrderedDict[bytes, None] = OrderedDict()
        #: asked by the ZAP handler about a key not admitted (None: such a key is refused);
        #: the prefill side asks its bootstrap service (docs/security.md)
        self.vouch: Vouch | None = None
        self._zap: Socket | None = None
        opened: list[Socket] = []
        try:
            if keys is not None:
                # Bound before the CURVE servers: a handshake that finds no ZAP handler is
                # accepted without a User-Id (and its messages then dropped by _dispatch).
                self._zap = open_socket(self._ctx, zmq.ROUTER)
                opened.append(self._zap)
                self._zap.bind(ZAP_ENDPOINT)
            bind = f"tcp://{_wire.bracketed(host)}:*"
            self._pull = self._open_pull(_is_ipv6(host))
            opened.append(self._pull)
            self.endpoint = self._pull.bind(bind)
            # Heartbeats get their own socket: behind thousands of queued TRANSFERs on the
            # main one, a ping would wait long enough for a healthy peer to be declared lost.
            self._ping_pull = self._open_pull(_is_ipv6(host))
            opened.append(self._ping_pull)
            self.heartbeat_endpoint = self._ping_pull.bind(bind)
        except BaseException:
            for sock in opened:
                sock.close()  # LINGER 0, nothing queued: term() returns at once
            self._ctx.term()
            raise

    def send_nowait(
        self,
        endpoint: str,
        msg: _wire.Message,
        pages: npt.NDArray[np.int32] | None = None,
    ) -> bool:
        """Queue ``msg`` for ``endpoint`` without waiting. False if the peer's socket is full
        (back-pressure: the peer is not reading) or closed.

        A first send to an endpoint makes its socket. Should the process be out of
        descriptors or memory for it (``EMFILE`` and the like), the send answers ``False``,
        counted ``resources_exhausted``: a local failure of that send (its room fails, a
        heartbeat counts a miss), never an error that escapes into the caller's task. The
        endpoint is checked first with
        :func:`~trio_pd.core._wire.numeric_endpoint` (a host name is refused: libzmq would
        resolve it on its I/O thread, and a resolver that never answers would stall every
        socket of the agent): one it refuses raises :class:`ProtocolError`
        (counted as ``bad_endpoints``) and no socket is made. It raises rather than answer
        ``False`` because it is a bad argument, not back-pressure: retrying cannot help, and
        the callers that take endpoints from peers run inside the listener, which contains
        the error to that message. Should libzmq still refuse the address, the new socket is
        closed before :class:`ProtocolError` is raised, so no half-made socket is left to
        block ``Context.term``.

        Sockets are bounded: at most :attr:`max_peers` are open, and a new endpoint past that
        first closes the least recently used socket, with ``LINGER=0`` (counted
        ``sockets_evicted``; what it still had queued is lost, and a later send to it makes a
        new socket). Every endpoint a peer can name (a PING's or an ABORT's reply address)
        gets a socket, so without the bound 1,100 distinct ones ran the process out of
        sockets. :meth:`close_idle` closes the ones nobody used for a while.
        """
        sock = self._push.get(endpoint)
        if sock is not None:
            self._push.move_to_end(endpoint)
        else:
            try:
                _wire.numeric_endpoint(endpoint)
            except ProtocolError:
                self._counters.bump("bad_endpoints")
                raise
            while len(self._push) >= self.max_peers:  # before opening: never over the cap
                self._evict(next(iter(self._push)))
            try:
                sock = self._open_push(endpoint)
            except zmq.ZMQError as exc:
                if exc.errno not in EXHAUSTED_ERRNOS:
                    raise
                self._exhausted(endpoint, exc)
                return False
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                sock.close()
                if exc.errno in EXHAUSTED_ERRNOS:
                    self._exhausted(endpoint, exc)
                    return False
                self._counters.bump("bad_endpoints")
                raise ProtocolError(f"cannot connect to {endpoint!r}: {exc}") from exc
            except BaseException:
                sock.close()
                raise
            self._push[endpoint] = sock
        self._used[endpoint] = time.monotonic()
        try:
            sock.send_multipart_nowait(_wire.encode(msg, pages))
        except (trio.WouldBlock, trio.ClosedResourceError):
            self._counters.bump("send_backpressure")
            return False
        return True

    #: most endpoints :meth:`authorize` remembers a key for (oldest forgotten first), for
    #: registered peers and for reply endpoints (``reply=True``)
    MAX_KEYS = 65_536
    MAX_REPLY_KEYS = 4096

    @property
    def curve(self) -> bool:
        """Is CURVE on (every message authenticated, every handler given its sender)?"""
        return self.keys is not None

    @property
    def public_key(self) -> str:
        """Our CURVE public key in z85 (\"\" with CURVE off): what peers authorise."""
        return "" if self.keys is None else self.keys.public_text

    def authorize(self, endpoint: str, key: str, *, reply: bool = False) -> None:
        """With CURVE on, sends to ``endpoint`` go to the holder of public key ``key`` (z85)
        only. A key that changes closes the endpoint's socket, so the next send makes one for
        the new key. No-op with CURVE off. Forgetting a socket keeps its key. Bounded,
        oldest dropped first: :data:`MAX_KEYS` for peers' own endpoints, and apart from
        them :data:`MAX_REPLY_KEYS` for reply endpoints a peer named (``reply=True``: a
        PING's), so that a peer naming many cannot push a registered peer's key out."""
        if self.keys is None:
            return
        raw = key.encode("ascii")
        if len(raw) != 40:
            raise AuthenticationError(f"{endpoint}: not a z85 CURVE public key: {key!r}")
        table, bound = (
            (self._reply_keys, self.MAX_REPLY_KEYS) if reply else
            (self._server_keys, self.MAX_KEYS)
        )
        if reply and endpoint in self._server_keys:
            return  # a peer's own endpoint keeps the key it registered with
        old = self._server_keys.get(endpoint) or self._reply_keys.get(endpoint)
        if old is not None and old != raw:
            self.forget(endpoint)
        self._reply_keys.pop(endpoint, None)
        table.pop(endpoint, None)
        while len(table) >= bound:
            table.popitem(last=False)
        table[endpoint] = raw
        self._admit(raw)

    def admit(self, key: str) -> None:
        """With CURVE on, let the holder of ``key`` (z85) hold a session with our sockets
        (the ZAP handler's allow-list; :meth:`authorize` admits its key too). Bounded, least
        recently admitted forgotten first. No-op with CURVE off."""
        if self.keys is None:
            return
        raw = key.encode("ascii")
        if len(raw) != 40:
            raise AuthenticationError(f"not a z85 CURVE public key: {key!r}")
        self._admit(raw)

    def _admit(self, raw: bytes) -> None:
        self._admitted.pop(raw, None)
        while len(self._admitted) >= self.MAX_KEYS + self.MAX_REPLY_KEYS:
            self._admitted.popitem(last=False)
        self._admitted[raw] = None

    def admits(self, raw: bytes) -> bool:
        """Is the z85 key ``raw`` on the allow-list (without asking :attr:`vouch`)?"""
        return raw in self._admitted

    #: seconds a connection to our sockets may take to finish its ZeroMQ handshake (CURVE's
    #: included, and the ZAP handler's answer) before libzmq closes it: what a connection
    #: that never speaks (or never proves a key we admit) holds a descriptor for
    HANDSHAKE_TIMEOUT = 5.0

    def _open_pull(self, ipv6: bool) -> Socket:
        sock = open_socket(self._ctx, zmq.PULL, rcvhwm=0, ipv6=ipv6)
        zsock = sock.zsock
        # A frame larger than any legal message's is refused as it arrives (the connection
        # is dropped), before libzmq allocates it whole.
        zsock.set(zmq.MAXMSGSIZE, _wire.MAX_FRAME_BYTES)
        zsock.set(zmq.HANDSHAKE_IVL, int(self.HANDSHAKE_TIMEOUT * 1000))
        if self.keys is not None:
            zsock.curve_secretkey = self.keys.secret
            zsock.curve_publickey = self.keys.public
            zsock.curve_server = True
        return sock

    def _open_push(self, endpoint: str) -> Socket:
        """A new PUSH socket for ``endpoint``, a CURVE client of its authorised key when
        CURVE is on (:class:`AuthenticationError` if it has none: we talk only to peers
        whose keys came from the bootstrap service or a verified REGISTER)."""
        ipv6 = _is_ipv6(_wire.address_host(endpoint) or "")
        if self.keys is None:
            return open_socket(self._ctx, zmq.PUSH, sndhwm=self._sndhwm, ipv6=ipv6)
        server_key = self._server_keys.get(endpoint) or self._reply_keys.get(endpoint)
        if server_key is None:
            raise AuthenticationError(f"no CURVE key is known for {endpoint}: not sending")
        sock = open_socket(self._ctx, zmq.PUSH, sndhwm=self._sndhwm, ipv6=ipv6)
        try:
            zsock = sock.zsock
            zsock.curve_serverkey = server_key
            zsock.curve_publickey = self.keys.public
            zsock.curve_secretkey = self.keys.secret
        except BaseException:
            sock.close()
            raise
        return sock

    def forget(self, endpoint: str) -> None:
        """Drop the socket to a peer (it is gone, or re-registered at a new endpoint)."""
        self._used.pop(endpoint, None)
        sock = self._push.pop(endpoint, None)
        if sock is not None:
            sock.close()

    @property
    def peer_sockets(self) -> int:
        """How many PUSH sockets are open now (a gauge; at most :attr:`max_peers`)."""
        return len(self._push)

    def _exhausted(self, endpoint: str, exc: zmq.ZMQError) -> None:
        self._counters.bump("resources_exhausted")
        self._log_limited(
            "resources_exhausted", exc, "no socket for a send to %s: %s", endpoint, exc
        )

    def _evict(self, endpoint: str) -> None:
        """Close one endpoint's socket, with ``LINGER=0``, and count it."""
        self._used.pop(endpoint, None)
        sock = self._push.pop(endpoint)
        if not sock.closed:
            sock.zsock.setsockopt(zmq.LINGER, 0)
        sock.close()
        self._counters.bump("sockets_evicted")

    def close_idle(self, idle: float) -> int:
        """Close every PUSH socket not sent on for ``idle`` seconds or more (``LINGER=0``:
        what such a socket still holds has waited that long already), counted
        ``sockets_evicted``; returns how many. Least recently used first, so it stops at the
        first socket used since. The agents call it from their timers."""
        deadline = time.monotonic() - idle
        closed = 0
        while self._push:
            endpoint = next(iter(self._push))
            if self._used.get(endpoint, -float("inf")) > deadline:
                break
            self._evict(endpoint)
            closed += 1
        return closed

    async def serve(self, handle: Handler) -> None:
        """Receive and dispatch messages from both sockets until cancelled. ``handle`` is
        synchronous: it runs to completion between two receives, so handlers never
        interleave.

        **Cancellation:** safe at any point; a message is either handled or left unread.
        """
        async with trio.open_nursery() as nursery:
            if self._zap is not None:
                gate = ZapGate(self._counters, self.admits, self.vouch)
                nursery.start_soon(serve_zap, self._zap, gate)
                nursery.start_soon(self._serve_curve, self._pull, handle)
                nursery.start_soon(self._serve_curve, self._ping_pull, handle)
                return
            nursery.start_soon(self._serve_socket, self._pull, handle)
            nursery.start_soon(self._serve_socket, self._ping_pull, handle)

    async def _serve_socket(self, sock: Socket, handle: Handler) -> None:
        missed = False
        while True:
            self._dispatch(await sock.recv_multipart(missed=missed), handle)
            # Then everything already waiting, in the same step: under a busy loop every
            # receive that checkpoints costs a whole scheduling round, and an ABORT queued
            # behind a burst of TRANSFERs would wait one round per message ahead of it.
            # Asked by zmq.EVENTS (which keeps the GIL), not by a receive meeting EAGAIN
            # (which releases it); found empty, the next receive need not try before it waits.
            missed = True
            for _ in range(self.BATCH - 1):
                if not sock.readable_nowait():
                    break
                try:
                    frames = sock.recv_multipart_nowait()
                except trio.WouldBlock:
                    break
                self._dispatch(frames, handle)
            else:
                missed = False

    async def _serve_curve(self, sock: Socket, handle: Handler) -> None:
        """:meth:`_serve_socket` for CURVE: frames with their metadata, each message handed
        on with the key that sent it."""
        missed = False
        while True:
            self._dispatch_curve(await sock.recv_frames(missed=missed), handle)
            missed = True
            for _ in range(self.BATCH - 1):
                if not sock.readable_nowait():
                    break
                try:
                    frames = sock.recv_frames_nowait()
                except trio.WouldBlock:
                    break
                self._dispatch_curve(frames, handle)
            else:
                missed = False


    def drain_nowait(self, handle: Handler, limit: int = 100_000) -> int:
        """Handle every message already waiting on the control socket (not the heartbeat
        one), at most ``limit``, without a checkpoint; return how many. For a closing agent
        whose listener has stopped: what peers sent before it closed (a TRANSFER naming pages,
        an ABORT) is answered rather than dropped with the socket. Errors are contained and
        counted as in :meth:`serve`."""
        n = 0
        while n < limit:
            try:
                if self._zap is not None:
                    self._dispatch_curve(self._pull.recv_frames_nowait(), handle)
                else:
                    self._dispatch(self._pull.recv_multipart_nowait(), handle)
            except trio.WouldBlock:
                break
            n += 1
        return n

    def _dispatch_curve(self, frames: list[zmq.Frame], handle: Handler) -> None:
        """The sender is the connection's User-Id, set by our ZAP handler to the client's
        public key; a message without one (no ZAP answer took part) is dropped, counted
        ``auth_refused``."""
        try:
            sender = frames[0].get("User-Id")
        except zmq.ZMQError:
            sender = None
        if not isinstance(sender, str) or len(sender) != 40:
            self._counters.bump("auth_refused")
            exc = AuthenticationError("control message without a CURVE User-Id")
            self._log_limited("auth_refused", exc, "dropped a control message: %s", exc)
            return
        self._dispatch([f.buffer for f in frames], handle, sender)

    def _dispatch(
        self, frames: list[bytes] | list[memoryview], handle: Handler, sender: str | None = None
    ) -> None:
        """Decode and handle one message. Nothing it raises (short of ``BaseException``:
        cancellation, ``KeyboardInterrupt``) leaves here: each error is counted and logged
        under :meth:`_log_limited`, and the listener goes on with the next message."""
        try:
            msg, pages = _wire.decode(frames)
        except ProtocolError as exc:
            self._counters.bump("bad_messages")
            self._log_limited("bad_messages", exc, "dropped a malformed control message: %s", exc)
            return
        try:
            if sender is None:
                handle(msg, pages)
            else:
                handle(msg, pages, sender)
        except TransferError as exc:
            self._counters.bump("refused_messages")
            if isinstance(exc, AuthenticationError):
                self._counters.bump("auth_refused")
            self._log_limited("refused_messages", exc, "refused %s: %s", type(msg).__name__, exc)
        except Exception as exc:
            self._counters.bump("handler_errors")
            self._log_limited(
                "handler_errors",
                exc,
                "handling %s raised %r",
                type(msg).__name__,
                exc,
                exc_info=exc,
            )

    def _log_limited(
        self,
        counter: str,
        exc: BaseException,
        fmt: str,
        *args: object,
        exc_info: BaseException | None = None,
    ) -> None:
        """One WARNING per (counter, exception type) per :data:`LOG_INTERVAL` seconds; the
        next one says how many went unlogged in between. The table has one row per kind of
        error the code can raise (a peer cannot invent exception types); it is cleared
        should it ever reach :data:`_MAX_LOG_KINDS` rows, so it stays bounded regardless."""
        key = (counter, type(exc))
        now = trio.current_time()
        state = self._log_state.get(key)
        if state is not None and now - state[0] < self.LOG_INTERVAL:
            state[1] += 1
            return
        unlogged = 0 if state is None else int(state[1])
        if state is None and len(self._log_state) >= self._MAX_LOG_KINDS:
            self._log_state.clear()
        self._log_state[key] = [now, 0]
        if unlogged:
            fmt += " (and %d more like it not logged)"
            args = (*args, unlogged)
        log.warning(fmt, *args, exc_info=exc_info)

    async def aclose(self, linger: float = 0.5) -> None:
        """Close every socket, then terminate the ZeroMQ context; returns within about
        ``linger + 2 * TERM_GRACE`` seconds whatever the peers do.

        What is still queued for a peer (a last STATUS, an ABORT, an ack) gets ``linger``
        seconds to leave: every socket is closed at once, on this thread, with that
        ``LINGER``, and ``Context.term``, which waits for the queues, runs in a daemon thread
        of its own. If it has not returned after ``linger + TERM_GRACE`` seconds, some socket
        of the context is still open (made by nobody here: ours are all closed); every such
        socket is closed with ``LINGER=0``, which lets ``term`` return, and it gets another
        ``TERM_GRACE`` seconds. Past that the thread is left behind (logged); it holds the
        context, and is no reason to keep the process alive. Calling ``aclose`` again waits
        for the same ``term``; it never starts a second one.

        **Cancellation:** the sockets are closed before the first checkpoint, whatever
        happens. If cancelled while ``term`` runs, any socket the context still has open is
        closed with ``LINGER=0`` before :exc:`trio.Cancelled` propagates; ``term`` finishes
        in its thread, and queued messages may be lost.
        """
        for sock in self._push.values():
            if not sock.closed:
                sock.zsock.setsockopt(zmq.LINGER, max(0, int(linger * 1000)))
            sock.close()
        self._push.clear()
        self._used.clear()
        self._pull.close()
        self._ping_pull.close()
        if self._zap is not None:
            self._zap.close()
        done = self._term_done
        if done is None:
            if self._ctx.closed:
                await trio.lowlevel.checkpoint()
                return
            done = self._term_done = self._start_term()
        try:
            with trio.move_on_after(max(0.0, linger) + self.TERM_GRACE):
                await done.wait()
        finally:
            if not done.is_set():
                self._close_stragglers()
        if not done.is_set():
            with trio.move_on_after(self.TERM_GRACE):
                await done.wait()
            if not done.is_set():
                log.error("zmq Context.term did not return; leaving its thread behind")

    def _start_term(self) -> trio.Event:
        """Run ``Context.term`` in a daemon thread; the event is set when it returns."""
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()
        ctx = self._ctx

        def term() -> None:
            try:
                ctx.term()
            except Exception as exc:  # nothing to hand it to: the caller only waits
                log.warning("zmq Context.term raised %r", exc)
            finally:
                try:
                    token.run_sync_soon(done.set)
                except trio.RunFinishedError:
                    pass  # the run is over: nobody waits any more

        threading.Thread(target=term, name="trio_pd: zmq Context.term", daemon=True).start()
        return done

    def _close_stragglers(self) -> int:
        """Close, with ``LINGER=0``, every socket the context still has open: the first half
        of ``Context.destroy(linger=0)``, without its ``term`` (one is already running).
        Called on the trio thread, the one every socket of this plane belongs to. Returns
        how many were closed."""
        # pyzmq keeps a weak set of a context's sockets for destroy(); it is the only list of
        # sockets made on this context by anyone.
        sockets = list(getattr(self._ctx, "_sockets", None) or ())
        closed = 0
        for zsock in sockets:
            if zsock is not None and not zsock.closed:
                zsock.close(linger=0)
                closed += 1
        if closed:
            log.warning("closed %d zmq socket(s) left open, so that Context.term returns", closed)
        return closed
