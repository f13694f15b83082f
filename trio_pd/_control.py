"""The control channel one agent uses: a bound PULL socket for what peers send us, and one
PUSH socket per peer endpoint for what we send them.

Every send here is non-blocking (SPEC §5.4): a full socket answers ``False`` at once and is
counted; it never holds a lock or a task. Each peer has its own socket, so one stalled peer
never delays messages to another (I7). Receiving decodes strictly; a bad message is logged and
counted and the listener goes on (SPEC §6).

Whatever arrives, the listener survives it. A message that does not decode (a reply endpoint
that :func:`~trio_pd._wire.validate_endpoint` refuses included) counts as ``bad_messages``;
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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import trio
import zmq

from . import _wire
from ._errors import ProtocolError, TransferError
from ._stats import Counters
from ._zmq import Socket, open_socket

log = logging.getLogger("trio_pd.control")

Handler = Callable[[_wire.Message, npt.NDArray[np.int32] | None], None]


class ControlPlane:
    """One agent's sockets, bound when it is constructed; close them with :meth:`aclose`."""

    #: at most this many waiting messages are handled in one scheduling step
    BATCH = 64
    #: seconds between two log lines for the same kind of error in :meth:`_dispatch`
    LOG_INTERVAL = 10.0
    #: :meth:`aclose` gives ``Context.term`` its linger plus this long, twice at most
    TERM_GRACE = 2.0
    _MAX_LOG_KINDS = 64

    def __init__(self, host: str, counters: Counters, *, sndhwm: int = 10_000) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._counters = counters
        self._sndhwm = sndhwm
        self._push: dict[str, Socket] = {}
        # (counter, exception type) -> [last logged at, errors not logged since]
        self._log_state: dict[tuple[str, type[BaseException]], list[float]] = {}
        self._term_done: trio.Event | None = None
        opened: list[Socket] = []
        try:
            self._pull = open_socket(self._ctx, zmq.PULL, rcvhwm=0)
            opened.append(self._pull)
            self.endpoint = self._pull.bind(f"tcp://{host}:*")
            # Heartbeats get their own socket: behind thousands of queued TRANSFERs on the
            # main one, a ping would wait long enough for a healthy peer to be declared lost.
            self._ping_pull = open_socket(self._ctx, zmq.PULL, rcvhwm=0)
            opened.append(self._ping_pull)
            self.heartbeat_endpoint = self._ping_pull.bind(f"tcp://{host}:*")
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

        A first send to an endpoint makes its socket. The endpoint is checked first with
        :func:`~trio_pd._wire.validate_endpoint`: one it refuses raises :class:`ProtocolError`
        (counted as ``bad_endpoints``) and no socket is made. It raises rather than answer
        ``False`` because it is a bad argument, not back-pressure: retrying cannot help, and
        the callers that take endpoints from peers run inside the listener, which contains
        the error to that message. Should libzmq still refuse the address, the new socket is
        closed before :class:`ProtocolError` is raised, so no half-made socket is left to
        block ``Context.term``.
        """
        sock = self._push.get(endpoint)
        if sock is None:
            try:
                _wire.validate_endpoint(endpoint)
            except ProtocolError:
                self._counters.bump("bad_endpoints")
                raise
            sock = open_socket(self._ctx, zmq.PUSH, sndhwm=self._sndhwm)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                sock.close()
                self._counters.bump("bad_endpoints")
                raise ProtocolError(f"cannot connect to {endpoint!r}: {exc}") from exc
            except BaseException:
                sock.close()
                raise
            self._push[endpoint] = sock
        try:
            sock.send_multipart_nowait(_wire.encode(msg, pages))
        except (trio.WouldBlock, trio.ClosedResourceError):
            self._counters.bump("send_backpressure")
            return False
        return True

    def forget(self, endpoint: str) -> None:
        """Drop the socket to a peer (it is gone, or re-registered at a new endpoint)."""
        sock = self._push.pop(endpoint, None)
        if sock is not None:
            sock.close()

    async def serve(self, handle: Handler) -> None:
        """Receive and dispatch messages from both sockets until cancelled. ``handle`` is
        synchronous: it runs to completion between two receives, so handlers never
        interleave.

        **Cancellation:** safe at any point; a message is either handled or left unread.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_socket, self._pull, handle)
            nursery.start_soon(self._serve_socket, self._ping_pull, handle)

    async def _serve_socket(self, sock: Socket, handle: Handler) -> None:
        while True:
            self._dispatch(await sock.recv_multipart(), handle)
            # Then everything already waiting, in the same step: under a busy loop every
            # receive that checkpoints costs a whole scheduling round, and an ABORT queued
            # behind a burst of TRANSFERs would wait one round per message ahead of it.
            for _ in range(self.BATCH - 1):
                try:
                    frames = sock.recv_multipart_nowait()
                except trio.WouldBlock:
                    break
                self._dispatch(frames, handle)

    def _dispatch(self, frames: list[bytes], handle: Handler) -> None:
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
            handle(msg, pages)
        except TransferError as exc:
            self._counters.bump("refused_messages")
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
        self._pull.close()
        self._ping_pull.close()
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
