"""The bootstrap service's bounds on what clients can hold: the request deadline of each
connection (:class:`Connection`), the cap on connections open at once
(:class:`Connections`), the largest body read, and the check of these settings.

Hypercorn offers neither bound the service needs: its timeouts are per read
(``read_timeout``) or bound the request head only (``keep_alive_timeout``), and it accepts
without limit. So the accept loop (:func:`trio_pd.bootstrap._bootstrap_http.serve_http`) admits each
connection here and hypercorn serves it through a :class:`Connection`, inside its scope.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import trio

from ..core._errors import ConfigurationError
from ._bootstrap_dp import DP_ROOM_TTL, MAX_DP_ROOMS

logger = logging.getLogger("trio_pd.bootstrap")

#: Largest request body the service reads; a longer one is answered ``413``.
MAX_BODY_BYTES: Final = 64 * 1024
#: Default ``request_timeout``: seconds a connection has to deliver a whole request (from its
#: accept, or from the end of the previous answer), and to take each write of an answer.
REQUEST_TIMEOUT: Final = 5.0
#: Default ``max_connections``: connections open at once (well below the common file
#: descriptor limit of 1,024 a process gets).
MAX_CONNECTIONS: Final = 512


def check_limits(
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


class Connection(trio.abc.HalfCloseableStream):
    """One accepted connection, as hypercorn reads and writes it, and its deadline.

    Hypercorn serves the connection inside :attr:`scope`. While the connection *waits* for a
    request (from its accept, or from the end of the last answer, until the app has a request
    whole: :meth:`answering`), the scope's deadline is ``waiting_since + timeout``; when it
    passes, or when the connection is dropped (:meth:`shed`, or a write that ran out), the
    scope is cancelled: hypercorn's tasks for the connection end (as at the end of its own
    graceful shutdown) and the caller closes the socket. Each write must finish within
    ``timeout`` too (a client that takes no answer).
    """

    def __init__(self, stream: trio.SocketStream, cap: Connections) -> None:
        self.stream = stream
        #: hypercorn reads the addresses from it (``transport_stream.socket`` under TLS)
        self.socket = stream.socket
        self._cap = cap
        self._timeout = cap.request_timeout
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
        """Close it to make room for a new connection (see :meth:`Connections.admit`)."""
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
            self._cap.timed_out += 1
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



class Connections:
    """The connections open to one service, under the cap, and the counts of those closed
    by a bound (``timed_out_connections``, ``shed_connections``)."""

    def __init__(self, *, request_timeout: float, max_connections: int) -> None:
        #: seconds a connection has to deliver a whole request, and to take each write
        self.request_timeout = request_timeout
        self._max = max_connections
        #: the connections open now (one leaves when its handler ends, or when it is shed)
        self.open: set[Connection] = set()
        #: closed because a request begun on them was not whole in time, or an answer was
        #: not taken in time
        self.timed_out = 0
        #: closed (or refused) at the cap
        self.shed = 0

    def admit(self, stream: trio.SocketStream) -> Connection | None:
        """The new connection on ``stream``, or None to refuse it (the caller closes it).

        At the cap, the open connection that has waited longest for its request is shed to
        make room (a slow client holds a connection for at most ``request_timeout``, and a
        normal one sends its request at once: the oldest waiting is the likeliest slow); if
        none is waiting (each is being answered), the new one is refused. Both are counted
        ``shed_connections``.
        """
        if len(self.open) >= self._max:
            self.shed += 1
            waiting = [c for c in self.open if c.waiting]
            if not waiting:
                return None
            oldest = min(waiting, key=lambda c: c.waiting_since)
            oldest.shed()
            self.open.discard(oldest)  # (it closes at once)
        connection = Connection(stream, self)
        self.open.add(connection)
        return connection
