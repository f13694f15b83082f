"""The error family. Every failure a caller can see is a :class:`TransferError`.

At the public boundary trio_pd raises one of these ``from`` the ExceptionGroup that carried
it; nothing unwraps groups by hand.
"""

from __future__ import annotations

import copy


class TransferError(Exception):
    """Base of every error trio_pd reports for a room, a peer or a message."""


class TransferAborted(TransferError):
    """The room was aborted (by the scheduler, a peer, or a deadline) before it concluded."""


class AdmissionClosed(TransferAborted):
    """The room no longer admits chunks (it was aborted, failed or concluded)."""


class TransferTimeout(TransferError):
    """A room's deadline passed (bootstrap, waiting or close timeout) before it concluded.
    Not an abort: nobody asked for it."""


class ConfigurationError(TransferError, ValueError):
    """Our caller passed arguments that cannot work (a pool that does not match the model's
    shape, TP sizes that cannot pair, ...). Raised before anything starts."""


class RemoteFailure(TransferError):
    """A prefill rank reported the room Failed; the text is its reason."""


class PeerLost(TransferError):
    """A peer stopped answering, or its engine reports it gone."""


class EngineError(TransferError):
    """A transfer engine call returned an error. Completion of the call's blocks is unknown."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class ProtocolError(TransferError):
    """A control message was malformed, truncated, oversized, of an unknown version or type,
    or referred to something that does not exist (an unknown room, an out-of-range page)."""


class RegionError(ProtocolError):
    """A planned write would land outside the memory the destination registered (invariant I8
    of docs/architecture.md: nothing lands outside what the destination registered)."""


class IncompatiblePeer(ProtocolError):
    """A peer's pool or topology cannot pair with ours (page size, head bytes, head range,
    layer count, layout, engine); refused at registration, with the reason."""


class AuthenticationError(ProtocolError):
    """With authentication on, a message or request came from an identity that may not send
    it: a REGISTER without a valid proof, or for an endpoint another key registered; a
    TRANSFER or ABORT from a key other than the one that registered its endpoint; a STATUS or
    ABORT_ACK from a key other than the prefill rank's the room resolved. Refused and
    counted (``auth_refused``)."""


class BootstrapError(TransferError):
    """The bootstrap service refused a request or could not be reached."""


class NotReady(BootstrapError):
    """The service answered 503: not every prefill rank has registered yet."""


class UnknownRank(BootstrapError):
    """The service answered 404 for a rank: the registered ranks say it does not exist."""


class UnknownRoom(BootstrapError):
    """The bootstrap service could not say which DP rank of its prefill instance holds a
    room before the decode rank's ``bootstrap_timeout`` passed: no prefill DP rank announced
    it (yet), or its record expired."""


class BootstrapUnreachable(BootstrapError):
    """The service could not be reached, or the connection broke before it answered."""


def copy_error(exc: BaseException) -> BaseException:
    """A copy of ``exc`` to raise somewhere else too (each room of a shared engine call
    raises its own), type and attributes kept. An exception whose class cannot be rebuilt
    from its ``args`` (an ``__init__`` with other parameters: ``copy.copy`` raises
    TypeError) becomes an :class:`EngineError` (if it was one) or a :class:`TransferError`
    naming it, chained from it: a copy that fails must not take the agent, or trio's run,
    down with it."""
    try:
        return copy.copy(exc)
    except Exception:
        kind = EngineError if isinstance(exc, EngineError) else TransferError
        new = kind(f"{type(exc).__name__}: {exc}")
        new.__cause__ = exc
        return new

