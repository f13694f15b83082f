"""The control channel one agent uses: a bound PULL socket for what peers send us, and one
PUSH socket per peer endpoint for what we send them (those are :mod:`trio_pd.io._push`'s, the
CURVE keys :mod:`trio_pd.io._keyring`'s). Receiving decodes strictly; a bad message is logged
and counted and the listener goes on (SPEC §6).

Whatever arrives, the listener survives it. A message that does not decode (a reply endpoint
that :func:`~trio_pd.core._wire.numeric_endpoint` refuses included) counts as ``bad_messages``;
a handler that refuses one with a :class:`TransferError` counts ``refused_messages``; a handler
that raises anything else (a bug, or input nobody foresaw) counts ``handler_errors``. Each is
contained to its message, and logged at most once per kind of error per
:data:`ControlPlane.LOG_INTERVAL` seconds (the rest are counted, and the next log line says
how many were not logged).

Closing cannot hang: :meth:`ControlPlane.aclose` closes every socket first (on the trio
thread, which owns them), then waits for ``Context.term`` under a deadline
(:class:`~trio_pd.io._term.ContextTerm`).

With CURVE on (``keys=``, docs/security.md) both PULL sockets are CURVE servers, a ZAP handler
(:func:`~trio_pd.io._security.serve_zap`) on an inproc ROUTER socket admits only the keys the
plane knows (every key :meth:`ControlPlane.authorize` or :meth:`ControlPlane.admit` was
given, kept by :class:`~trio_pd.io._keyring.Keyring`) or that :attr:`ControlPlane.vouch`
vouches for, names every client by its public key, and each message is handed to the handler
with that key; a PUSH socket is made only for an endpoint :meth:`ControlPlane.authorize` gave
a key, as a CURVE client of it.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt
import trio
import zmq

from ..core import _wire
from ..core._errors import AuthenticationError, ProtocolError, TransferError
from ..core._stats import Counters
from ._keyring import Keyring
from ._push import PushSockets, is_ipv6
from ._security import ZAP_ENDPOINT, Keypair, Vouch, ZapGate, serve_zap
from ._term import ContextTerm
from ._timers import Timers
from ._zmq import Socket, open_socket, serve

log = logging.getLogger("trio_pd.control")

_FRAME_BYTES: Final = operator.attrgetter("bytes")


def sweep_idle_sockets(timers: Timers, control: ControlPlane, idle: float) -> None:
    """Close ``control``'s PUSH sockets idle for ``idle`` seconds, every ``idle / 2``
    seconds, from ``timers`` (one timer, for good; the agent's timer task runs it)."""
    period = max(idle / 2, 0.01)

    def sweep(_: None) -> None:
        try:
            control.senders.close_idle(idle)
        finally:
            timers.after(period, sweep, None)

    timers.after(period, sweep, None)

#: ``handle(msg, pages)``; with CURVE on, ``handle(msg, pages, sender)``, where ``sender`` is
#: the z85 public key the message came from (the ZAP handler's User-Id). A handler for a
#: CURVE plane takes ``sender: str | None = None`` (None: a trusted local call).
Handler = Callable[..., None]


class ControlPlane:
    """One agent's sockets, bound when it is constructed; close them with :meth:`aclose`.
    Owns the ZeroMQ context, the two PULL sockets and the ZAP socket, the listener (receive,
    dispatch, errors contained and logged at a limited rate) and the close. What we send
    goes through :attr:`senders` (one PUSH socket per peer endpoint); the CURVE keys are
    :attr:`keyring`'s."""

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
        # (counter, exception type) -> [last logged at, errors not logged since]
        self._log_state: dict[tuple[str, type[BaseException]], list[float]] = {}
        #: ``Context.term``, once, off the trio thread and under a deadline
        self._term = ContextTerm(self._ctx)
        #: CURVE on (docs/security.md): our keypair; every PULL socket is a CURVE server, and
        #: every PUSH socket a CURVE client of the key :meth:`authorize` gave its endpoint
        self.keys = keys
        self.keyring = Keyring(keys)
        #: one PUSH socket per peer endpoint, at most ``max_peers`` (see :meth:`send_nowait`)
        self.senders = PushSockets(
            self._ctx, counters, self.keyring, self._log_limited,
            sndhwm=sndhwm, max_peers=max_peers,
        )
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
            self._pull = self._open_pull(is_ipv6(host))
            opened.append(self._pull)
            self.endpoint = self._pull.bind(bind)
            # Heartbeats get their own socket: behind thousands of queued TRANSFERs on the
            # main one, a ping would wait long enough for a healthy peer to be declared lost.
            self._ping_pull = self._open_pull(is_ipv6(host))
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
        """:meth:`PushSockets.send_nowait <trio_pd.io._push.PushSockets.send_nowait>`: queue
        ``msg`` for ``endpoint`` without waiting; False if the peer's socket is full or
        closed."""
        return self.senders.send_nowait(endpoint, msg, pages)

    @property
    def curve(self) -> bool:
        """Is CURVE on (every message authenticated, every handler given its sender)?"""
        return self.keys is not None

    @property
    def public_key(self) -> str:
        """Our CURVE public key in z85 (\"\" with CURVE off): what peers authorise."""
        return "" if self.keys is None else self.keys.public_text

    def authorize(self, endpoint: str, key: str, *, reply: bool = False) -> None:
        """:meth:`Keyring.authorize <trio_pd.io._keyring.Keyring.authorize>`: with CURVE on,
        sends to ``endpoint`` go to the holder of ``key`` only; a key that changes closes the
        endpoint's socket, so the next send makes one for the new key. Forgetting a socket
        keeps its key."""
        if self.keyring.authorize(endpoint, key, reply=reply):
            self.forget(endpoint)

    def admit(self, key: str) -> None:
        """:meth:`Keyring.admit <trio_pd.io._keyring.Keyring.admit>`."""
        self.keyring.admit(key)

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

    def forget(self, endpoint: str) -> None:
        """Drop the socket to a peer (it is gone, or re-registered at a new endpoint)."""
        self.senders.forget(endpoint)

    async def serve(self, handle: Handler) -> None:
        """Receive and dispatch messages from both sockets until cancelled. ``handle`` is
        synchronous: it runs to completion between two receives, so handlers never
        interleave.

        Everything already waiting on a socket is handled in the same step (:data:`BATCH` at
        most, :func:`~trio_pd.io._zmq.serve`): under a busy loop every
        receive that checkpoints costs a whole scheduling round, and an ABORT queued behind a
        burst of TRANSFERs would wait one round per message ahead of it.

        **Cancellation:** safe at any point; a message is either handled or left unread.
        """
        # Each socket's loop is its task's one coroutine, and its handler a partial (no
        # lambda, no wrapper coroutine): every layer costs a Python call on every wake-up.
        async with trio.open_nursery() as nursery:
            if self._zap is not None:
                gate = ZapGate(self._counters, self.keyring.admits, self.vouch)
                nursery.start_soon(serve_zap, self._zap, gate)
                # CURVE: frames with their metadata, each message handed on with its sender
                dispatch = functools.partial(self._dispatch_curve, handle=handle)
                for sock in (self._pull, self._ping_pull):
                    nursery.start_soon(
                        functools.partial(serve, sock, dispatch, self.BATCH, frames=True),
                        name=f"{serve.__qualname__} (CURVE)",
                    )
                return
            dispatch = functools.partial(self._dispatch, handle=handle)
            for sock in (self._pull, self._ping_pull):
                nursery.start_soon(serve, sock, dispatch, self.BATCH)

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
        # As bytes: the decoder's fast path (a copy, which a memoryview of the Frame, being
        # writable, costs the page ids anyway)
        self._dispatch(list(map(_FRAME_BYTES, frames)), handle, sender)

    def _dispatch(
        self, frames: list[bytes], handle: Handler, sender: str | None = None
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
        self.senders.close(linger)
        self._pull.close()
        self._ping_pull.close()
        if self._zap is not None:
            self._zap.close()
        await self._term.wait(linger, self.TERM_GRACE)
