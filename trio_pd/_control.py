"""The control channel one agent uses: a bound PULL socket for what peers send us, and one
PUSH socket per peer endpoint for what we send them.

Every send here is non-blocking (SPEC §5.4): a full socket answers ``False`` at once and is
counted; it never holds a lock or a task. Each peer has its own socket, so one stalled peer
never delays messages to another (I7). Receiving decodes strictly; a bad message is logged and
counted and the listener goes on (SPEC §6).
"""

from __future__ import annotations

import logging
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
    """One agent's sockets. Create with :meth:`open`; close with :meth:`close`."""

    #: at most this many waiting messages are handled in one scheduling step
    BATCH = 64

    def __init__(self, host: str, counters: Counters, *, sndhwm: int = 10_000) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._counters = counters
        self._sndhwm = sndhwm
        self._pull = open_socket(self._ctx, zmq.PULL, rcvhwm=0)
        self.endpoint = self._pull.bind(f"tcp://{host}:*")
        # Heartbeats get their own socket: behind thousands of queued TRANSFERs on the main
        # one, a ping would wait long enough for a healthy peer to be declared lost.
        self._ping_pull = open_socket(self._ctx, zmq.PULL, rcvhwm=0)
        self.heartbeat_endpoint = self._ping_pull.bind(f"tcp://{host}:*")
        self._push: dict[str, Socket] = {}

    def send_nowait(
        self,
        endpoint: str,
        msg: _wire.Message,
        pages: npt.NDArray[np.int32] | None = None,
    ) -> bool:
        """Queue ``msg`` for ``endpoint`` without waiting. False if the peer's socket is full
        (back-pressure: the peer is not reading) or closed."""
        sock = self._push.get(endpoint)
        if sock is None:
            sock = open_socket(self._ctx, zmq.PUSH, sndhwm=self._sndhwm)
            sock.connect(endpoint)
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
        try:
            msg, pages = _wire.decode(frames)
        except ProtocolError as exc:
            self._counters.bump("bad_messages")
            log.warning("dropped a malformed control message: %s", exc)
            return
        try:
            handle(msg, pages)
        except TransferError as exc:
            self._counters.bump("refused_messages")
            log.warning("refused %s: %s", type(msg).__name__, exc)

    async def aclose(self, linger: float = 0.5) -> None:
        """Close every socket. What is still queued for a peer (a last STATUS, an ABORT, an
        ack) gets ``linger`` seconds to leave; ``Context.term`` waits for that in a thread.

        **Cancellation:** if cancelled, the sockets are closed anyway and queued messages may
        be lost.
        """
        for sock in self._push.values():
            sock.zsock.setsockopt(zmq.LINGER, int(linger * 1000))
            sock.close()
        self._push.clear()
        self._pull.close()
        self._ping_pull.close()
        await trio.to_thread.run_sync(self._ctx.term)
