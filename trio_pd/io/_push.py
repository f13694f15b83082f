"""A control plane's senders: one PUSH socket per peer endpoint, made on the first send to it.

Every send is non-blocking (SPEC §5.4): a full socket answers ``False`` at once and is counted;
it never holds a lock or a task. Each peer has its own socket, so one stalled peer never
delays messages to another (I7). The sockets are bounded, least recently used closed first,
and the ones nobody used for a while are closed by the agents' timers
(:func:`~trio_pd.io._control.sweep_idle_sockets`).
"""

from __future__ import annotations

import errno
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import trio
import zmq

from ..core import _wire
from ..core._errors import AuthenticationError, ProtocolError
from ..core._stats import Counters
from ._keyring import Keyring
from ._zmq import Socket, open_socket

#: errnos that mean "out of a resource" (descriptors, memory, buffers), not "a bad address":
#: a socket that cannot be made for them is a counted, local failure of that one send
EXHAUSTED_ERRNOS: frozenset[int] = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
)

#: ``log_limited(counter, exc, fmt, *args)``: the plane's rate-limited WARNING
LogLimited = Callable[..., None]


def is_ipv6(host: str) -> bool:
    """Whether ``host`` is an IPv6 literal (a socket for it needs ``zmq.IPV6``)."""
    address = _wire.ip_literal(host)
    return address is not None and address.version == 6


class PushSockets:
    """Owns the PUSH sockets of one control plane, one per peer endpoint, least recently used
    first, and when each was last sent on. The context, the counters, the keys (a CURVE
    client of the key :class:`~trio_pd.io._keyring.Keyring` gave its endpoint) and the
    rate-limited log are the plane's."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        counters: Counters,
        keyring: Keyring,
        log_limited: LogLimited,
        *,
        sndhwm: int,
        max_peers: int,
    ) -> None:
        self._ctx = ctx
        self._counters = counters
        self._keyring = keyring
        self._log_limited = log_limited
        self._sndhwm = sndhwm
        #: at most this many PUSH sockets are open; a new endpoint past it evicts the least
        #: recently used one (see :meth:`send_nowait`). Below libzmq's default MAX_SOCKETS
        #: (1023 per context), which would otherwise refuse the next socket with EMFILE.
        self.max_peers = max_peers
        #: endpoint -> its PUSH socket, least recently used first
        self._push: OrderedDict[str, Socket] = OrderedDict()
        #: endpoint -> time.monotonic() of its last send (for :meth:`close_idle`)
        self._used: dict[str, float] = {}

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
                sock = self._open(endpoint)
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

    def _open(self, endpoint: str) -> Socket:
        """A new PUSH socket for ``endpoint``, a CURVE client of its authorised key when
        CURVE is on (:class:`AuthenticationError` if it has none: we talk only to peers
        whose keys came from the bootstrap service or a verified REGISTER)."""
        ipv6 = is_ipv6(_wire.address_host(endpoint) or "")
        keys = self._keyring.keys
        if keys is None:
            return open_socket(self._ctx, zmq.PUSH, sndhwm=self._sndhwm, ipv6=ipv6)
        server_key = self._keyring.server_key(endpoint)
        if server_key is None:
            raise AuthenticationError(f"no CURVE key is known for {endpoint}: not sending")
        sock = open_socket(self._ctx, zmq.PUSH, sndhwm=self._sndhwm, ipv6=ipv6)
        try:
            zsock = sock.zsock
            zsock.curve_serverkey = server_key
            zsock.curve_publickey = keys.public
            zsock.curve_secretkey = keys.secret
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
    def count(self) -> int:
        """How many PUSH sockets are open now (at most :attr:`max_peers`)."""
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

    def close(self, linger: float) -> None:
        """Close every socket at once, giving what it still holds ``linger`` seconds to
        leave (on ``Context.term``)."""
        for sock in self._push.values():
            if not sock.closed:
                sock.zsock.setsockopt(zmq.LINGER, max(0, int(linger * 1000)))
            sock.close()
        self._push.clear()
        self._used.clear()
