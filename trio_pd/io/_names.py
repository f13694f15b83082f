"""Host names, resolved off every I/O thread, bounded in time, before any socket sees them.

libzmq resolves a name in a ``tcp://`` endpoint synchronously on its I/O thread, when it
connects and again on every reconnect: one name whose DNS never answers stalls every
socket of the context, every peer's control traffic with it. So no ZeroMQ socket here is
given a name. Endpoints that arrive in control messages must be numeric
(:func:`trio_pd.core._wire.validate_endpoint` with ``numeric=True``: a stranger's name is a
malformed message, counted and dropped); names that come from our own configuration (a
``host=`` that is a name, a bootstrap record that names a host) are resolved here, in a
thread of this module's own (a resolver that hangs holds one of those, never a thread
another part of the agent needs), under a deadline.
"""

from __future__ import annotations

import socket
from typing import Final

import trio

from ..core import _wire
from ..core._errors import ConfigurationError

#: seconds a name may take to resolve (a resolver that never answers holds the caller
#: this long, then the name counts as unresolvable)
RESOLVE_TIMEOUT: Final = 10.0

#: threads resolving names at once (an abandoned, hung lookup keeps its thread until the
#: system resolver gives up)
_LIMITER: Final = trio.CapacityLimiter(8)


async def resolve_host(host: str, *, within: float = RESOLVE_TIMEOUT) -> str:
    """The numeric address ``host`` names: an IP literal as it is (brackets and all), a name
    resolved (its first address, IPv4 preferred). :class:`OSError` if it does not resolve,
    :class:`TimeoutError` if no answer came within ``within`` seconds.

    **Cancellation:** cancellable at any point; a lookup already running finishes in its
    thread and its answer is dropped.
    """
    if _wire.ip_literal(host) is not None:
        await trio.lowlevel.checkpoint()
        return host
    name = host.strip()
    with trio.move_on_after(within):
        infos = await trio.to_thread.run_sync(
            socket.getaddrinfo, name, None, 0, socket.SOCK_STREAM,
            abandon_on_cancel=True, limiter=_LIMITER,
        )
        if not infos:
            raise OSError(f"{name!r} resolves to no address")
        infos.sort(key=lambda info: info[0] != socket.AF_INET)
        return str(infos[0][4][0])
    raise TimeoutError(f"{name!r} did not resolve within {within:g} s")


async def resolve_endpoint(endpoint: str, *, within: float = RESOLVE_TIMEOUT) -> str:
    """``endpoint`` (``tcp://HOST:PORT``) with its host resolved by :func:`resolve_host`;
    a numeric one as it is. :class:`~trio_pd.ProtocolError` if it is not an endpoint;
    OSError or TimeoutError as :func:`resolve_host`.

    **Cancellation:** as :func:`resolve_host`.
    """
    _wire.validate_endpoint(endpoint)
    host = _wire.address_host(endpoint)
    assert host is not None  # (validate_endpoint accepts only tcp://HOST:PORT)
    numeric = await resolve_host(host, within=within)
    if numeric == host:
        return endpoint
    port = endpoint.rpartition(":")[2]
    return f"tcp://{_wire.bracketed(numeric)}:{port}"


async def bind_address(host: str, what: str, *, within: float = RESOLVE_TIMEOUT) -> str:
    """The numeric address an agent binds for ``host=`` (a name resolved off the I/O
    thread, once, at start); :class:`~trio_pd.ConfigurationError` saying why if it does not
    resolve within ``within`` seconds.

    **Cancellation:** as :func:`resolve_host`.
    """
    try:
        return await resolve_host(host, within=within)
    except (OSError, TimeoutError) as exc:
        raise ConfigurationError(f"{what}: host={host!r} does not resolve: {exc}") from None
