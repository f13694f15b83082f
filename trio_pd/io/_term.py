"""The end of a control plane's ZeroMQ context: closing cannot hang.

``zmq.Context.term`` blocks until every socket of the context is closed and has flushed or
given up its queue (``LINGER``), and it runs off the trio thread, so the plane closes every
socket first (on the trio thread, which owns them), then waits for ``term`` under a deadline
(:meth:`ContextTerm.wait`), and past the deadline closes with ``LINGER=0`` any socket the
context still has open, which lets ``term`` return. It never calls ``Context.destroy`` there:
``destroy`` ends in a second ``term`` on the same context, and pyzmq only clears the
context's handle once the first ``term`` has returned, so that would enter libzmq's
``zmq_ctx_term`` twice for one context.
"""

from __future__ import annotations

import logging
import threading

import trio
import zmq

log = logging.getLogger("trio_pd.control")


class ContextTerm:
    """Owns the ``term`` of one context: started once, in a daemon thread, and its event,
    set when it returns (every later :meth:`wait` waits for the same one)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._ctx = ctx
        #: set once ``term`` has returned (None: not started)
        self._done: trio.Event | None = None

    async def wait(self, linger: float, grace: float) -> None:
        """Start ``term`` (once) and wait for it, ``linger + grace`` seconds; then close
        every socket the context still has open with ``LINGER=0`` and wait ``grace`` more;
        past that, leave its thread behind (logged). See
        :meth:`ControlPlane.aclose <trio_pd.io._control.ControlPlane.aclose>`.

        **Cancellation:** if cancelled while ``term`` runs, any socket the context still
        has open is closed with ``LINGER=0`` before :exc:`trio.Cancelled` propagates."""
        done = self._done
        if done is None:
            if self._ctx.closed:
                await trio.lowlevel.checkpoint()
                return
            done = self._done = self._start()
        try:
            with trio.move_on_after(max(0.0, linger) + grace):
                await done.wait()
        finally:
            if not done.is_set():
                self._close_stragglers()
        if not done.is_set():
            with trio.move_on_after(grace):
                await done.wait()
            if not done.is_set():
                log.error("zmq Context.term did not return; leaving its thread behind")

    def _start(self) -> trio.Event:
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
