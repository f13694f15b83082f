"""Three-valued liveness: what a probe of a peer proves (SPEC §5.6).

A probe answers :class:`~trio_pd.core._state.Liveness`: ALIVE (the peer's engine answered),
REFUSED (its host refused a connect where it listened) or UNKNOWN (anything else). It never
answers GONE: a probe cannot prove that none of a peer's writes can land any more. A timeout
is no evidence (a partitioned or stopped peer's engine may still deliver queued writes when it
comes back), and neither is a refusal: it says that nothing listens on a port the peer's
process owned, not that no byte of it is still on its way. An agent may close its control
socket while its engine keeps delivering, and a killed process's kernel keeps sending what its
sockets held (both measured: docs/reliability.md). REFUSED is a hint that makes the stronger
proof worth trying: on decode, a fence made by our own engine
(:meth:`~trio_pd.engines.TransferEngine.fence_writer`, in :mod:`trio_pd.agents._sources`); on
prefill, our own kernel's word that the bytes we sent have left (:mod:`trio_pd.agents._peers`).

Two ports are asked: the peer agent's control endpoint, and for Mooncake the engine's own RPC
port (its session id is ``"host:rpc_port"``). A refusal is trusted as coming from the peer's
own kernel; a middlebox that answers for it (a firewall rule that rejects with a reset or an
ICMP port-unreachable) would make a partition look like an exit, which is one more reason it
is only a hint.

The engine's own probe only ever proves ALIVE. Its False is not proof: NIXL's False means UCX
saw the connection drop, which a partition causes too.

A check that cannot run (no descriptor for a socket, no thread) is UNKNOWN, counted
``checks_unknown`` where the caller passes its counters; nothing escapes into the agent.
"""

from __future__ import annotations

import errno
import logging
import math

import trio
import trio.lowlevel

from ..core._state import Liveness
from ..core._stats import Counters
from ..engines import TransferEngine

log = logging.getLogger("trio_pd.probe")

__all__ = ["ProbeThreads", "peer_hosts", "port_refuses", "probe", "wait_idle"]

#: how often a probe looks whether the hung probe thread of its peer has returned
_RUNNING_POLL = 0.05


class ProbeThreads:
    """The engine-probe threads of one agent: at most ``limit`` at once (``limiter``), and at
    most one per peer session (``running``).

    A probe thread may hang (Mooncake's ``send_probe`` takes about 60 s against a stopped
    process) and is then abandoned, keeping its token until it returns. One per session means
    that a later probe of that same peer waits for it instead of starting another thread (and
    ends UNKNOWN at its own deadline if it does not return), while probes of every other peer
    still get a thread: one hung peer never makes a live one look silent. ``limit`` bounds the
    threads when many peers hang at once."""

    __slots__ = ("limiter", "running")

    def __init__(self, limit: int = 16) -> None:
        self.limiter = trio.CapacityLimiter(limit)
        #: sessions with a probe thread started and not yet returned (a hung one included);
        #: the thread removes its own session when it returns
        self.running: set[str] = set()


def _probe_in_thread(
    engine: TransferEngine, session: str, running: set[str], started: list[bool]
) -> bool:
    started.append(True)
    try:
        return engine.probe(session)
    finally:
        running.discard(session)


def _host_port(endpoint: str) -> tuple[str, int] | None:
    """``(host, port)`` from ``"tcp://host:port"`` or ``"host:port"`` (IPv6 hosts in
    brackets); None for anything else (another transport, a bind wildcard, no port)."""
    text = endpoint
    if text.startswith("tcp://"):
        text = text[len("tcp://") :]
    elif "://" in text:
        return None
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None  # an IPv6 address without brackets: where its port starts is a guess
    port = int(port_text)
    if not host or host == "*" or not 0 < port < 65536:
        return None
    return host, port


async def peer_hosts(
    engine: TransferEngine, session: str, control_endpoint: str
) -> list[str] | None:
    """The numeric addresses of the peer's host(s): its control endpoint's, and for Mooncake
    its engine session's (``"host:rpc_port"``), resolved. None if neither names a TCP host
    (nothing goes over TCP to it: an in-process peer); empty if a host does not resolve.
    Nothing but Cancelled is raised."""
    await trio.lowlevel.checkpoint()
    endpoints = [control_endpoint] + ([session] if engine.name == "mooncake" else [])
    hosts: set[str] = set()
    named = False
    for endpoint in endpoints:
        parsed = _host_port(endpoint)
        if parsed is None:
            continue
        named = True
        try:
            infos = await trio.socket.getaddrinfo(parsed[0], parsed[1],
                                                  type=trio.socket.SOCK_STREAM)
        except OSError:
            continue
        hosts.update(str(info[4][0]) for info in infos)
    return sorted(hosts) if named else None


class _CannotRun(Exception):
    """A check could not be made at all (no descriptor for a socket): no evidence."""


async def _connect(family: int, type_: int, proto: int, addr: object) -> bool | None:
    """One connect attempt: True if refused, False if connected (closed at once), else None.
    :class:`_CannotRun` if no socket can be made."""
    await trio.lowlevel.checkpoint()
    try:
        sock = trio.socket.socket(family, type_, proto)
    except OSError as exc:
        raise _CannotRun(f"no socket for a connect to {addr}: {exc}") from exc
    with sock:
        try:
            await sock.connect(addr)
        except OSError as exc:
            return True if exc.errno == errno.ECONNREFUSED else None
    return False


async def port_refuses(endpoint: str) -> bool | None:
    """Does the host of ``endpoint`` (``"tcp://host:port"`` or ``"host:port"``) refuse a TCP
    connection to that port?

    True iff every address the host resolves to actively refused (ECONNREFUSED: the host
    answered and nothing listens there, so the process that owned the port is gone). False as
    soon as one connects (the connection is closed at once, nothing is sent). None for anything
    else: an endpoint that does not parse, a name that does not resolve, an unreachable host or
    network, or a connect still pending when the caller's deadline fires. Nothing but
    Cancelled is raised.

    The connect runs on the event loop (no thread). A numeric host resolves without a thread;
    a host name goes through :func:`trio.socket.getaddrinfo`, which uses trio's own abandonable
    resolver thread.

    **Cancellation:** cancellable at any point, and unbounded on its own (a host that drops
    SYNs keeps a connect pending for minutes): the caller bounds it with
    ``trio.move_on_after``. A cancelled connect's socket is closed; nothing is left behind.
    """
    try:
        return await _refuses(endpoint)
    except _CannotRun:
        await trio.lowlevel.checkpoint()
        return None


async def _refuses(endpoint: str) -> bool | None:
    """:func:`port_refuses`, but :class:`_CannotRun` when no socket can be made."""
    await trio.lowlevel.checkpoint()
    parsed = _host_port(endpoint)
    if parsed is None:
        return None
    host, port = parsed
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    except trio.socket.gaierror:
        return None  # does not resolve
    except OSError as exc:  # the resolver itself could not run (EAI_SYSTEM: no descriptor)
        raise _CannotRun(f"no address for {endpoint}: {exc}") from exc
    refused = 0
    for family, type_, proto, _canonname, addr in infos:
        outcome = await _connect(family, type_, proto, addr)
        if outcome is False:
            return False
        if outcome is True:
            refused += 1
    return True if infos and refused == len(infos) else None


async def probe(
    engine: TransferEngine,
    session: str,
    *,
    control_endpoint: str | None,
    timeout: float,  # noqa: ASYNC109 (its expiry is an answer, UNKNOWN, not an error)
    threads: ProbeThreads,
    counters: Counters | None = None,
) -> Liveness:
    """What can be said of the peer whose engine session is ``session``, within ``timeout``
    seconds.

    In order, under one deadline of ``timeout``:

    1. REFUSED if ``control_endpoint`` (the peer agent's ZeroMQ endpoint) refuses a TCP
       connect, or, for Mooncake (the only engine whose session id is its address,
       ``"host:rpc_port"``), if the session's own port refuses. The hint comes first, so a
       hung engine probe cannot hide it. It proves nothing by itself (module docstring).
    2. ALIVE if ``engine.probe(session)`` returns True.
    3. UNKNOWN otherwise: the deadline passed, the engine said False (no proof: see the module
       docstring), it raised (logged at debug), or a check could not run at all (no socket,
       no thread: logged, and counted ``checks_unknown`` in ``counters``). Nothing but
       Cancelled is raised.

    An unreachable host ends in UNKNOWN: its connect hangs until the deadline, and its engine
    probe would hang too.

    The engine probe runs in a thread, ``trio.to_thread.run_sync(..., limiter=threads.limiter,
    abandon_on_cancel=True)``. This is the one exception to "never abandon an engine call": a
    probe touches no page, so an abandoned one that returns later changes nothing. ``threads``
    (the agent's :class:`ProbeThreads`) bounds them: trio acquires a token before it starts
    the thread and gives it back only when the thread really returns, also after the call was
    abandoned; and while a probe thread of ``session`` is still running (a hung one: Mooncake's
    ``send_probe`` takes about 60 s against a stopped process), a new probe of that session
    waits for it to return rather than start another, and ends UNKNOWN at its deadline if it
    does not. Probes of other peers are not held up by it. The REFUSED hint (step 1) needs no
    thread and still works meanwhile. Before the agent closes its engine it waits for every
    probe thread with :func:`wait_idle` on ``threads.limiter``.

    **Cancellation:** cancellable at any point. A pending connect is closed; a probe thread
    already started is abandoned (it keeps its token, and its session stays running, until it
    returns); one still waiting for the limiter never starts. Cancelled propagates; no
    Liveness is returned.
    """
    await trio.lowlevel.checkpoint()
    endpoints = [control_endpoint] if control_endpoint is not None else []
    if engine.name == "mooncake":
        endpoints.append(session)
    with trio.move_on_after(timeout):
        await trio.lowlevel.checkpoint()
        for endpoint in endpoints:
            try:
                refused = await _refuses(endpoint)
            except _CannotRun as exc:
                log.warning("probe of %s could not run: %s: unknown", session, exc)
                if counters is not None:
                    counters.bump("checks_unknown")
                return Liveness.UNKNOWN
            if refused:
                log.debug("probe of %s: %s refused a connection", session, endpoint)
                return Liveness.REFUSED
        # (its last probe thread still hangs: a worker thread has no trio event to set)
        while session in threads.running:  # noqa: ASYNC110
            await trio.sleep(_RUNNING_POLL)
        started: list[bool] = []
        threads.running.add(session)
        try:
            answered = await trio.to_thread.run_sync(
                _probe_in_thread, engine, session, threads.running, started,
                limiter=threads.limiter, abandon_on_cancel=True,
            )
        except (RuntimeError, OSError) as exc:  # no thread for it: the check did not run
            log.warning("probe of %s could not run: %r: unknown", session, exc)
            if counters is not None:
                counters.bump("checks_unknown")
            return Liveness.UNKNOWN
        except Exception as exc:
            log.debug("probe of %s raised %r: unknown", session, exc)
            return Liveness.UNKNOWN
        finally:
            if not started:  # the thread never ran (cancelled, or no thread): none is running
                threads.running.discard(session)
        if answered:
            return Liveness.ALIVE
        log.debug("probe of %s: the engine said no answer: unknown", session)
        return Liveness.UNKNOWN
    log.debug("probe of %s: no answer within %.3g s: unknown", session, timeout)
    return Liveness.UNKNOWN


async def wait_idle(
    limiter: trio.CapacityLimiter,
    timeout: float,  # noqa: ASYNC109 (its expiry is an answer, False, not an error)
) -> bool:
    """Wait until no probe thread holds ``limiter`` (every token is free at once), for at
    most ``timeout`` seconds. True if it became idle, False if a thread still held a token at
    the deadline (a probe hung for longer: do not close the engine under it).

    An agent calls this on close, after cancelling its probe tasks and before closing its
    engine: an abandoned probe thread may still be inside the engine. It takes every token for
    a moment and gives them back, so it needs a limiter with a finite number of tokens
    (:class:`ValueError` otherwise).

    **Cancellation:** cancellable at any point; the tokens it took so far are given back and
    the cancellation propagates.
    """
    await trio.lowlevel.checkpoint()
    total = limiter.total_tokens
    if isinstance(total, float) and math.isinf(total):
        raise ValueError("wait_idle needs a limiter with a finite number of tokens")
    held: list[object] = []
    try:
        with trio.move_on_after(timeout):
            await trio.lowlevel.checkpoint()
            for _ in range(int(total)):
                token = object()
                await limiter.acquire_on_behalf_of(token)
                held.append(token)
            return True
        return False
    finally:
        for token in held:
            limiter.release_on_behalf_of(token)
