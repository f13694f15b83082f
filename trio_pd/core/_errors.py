"""The error family. Every failure a caller can see is a :class:`TransferError`.

At the public boundary trio_pd raises one of these ``from`` the ExceptionGroup that carried
it; nothing unwraps groups by hand. :func:`one_error` is that boundary for the ``open_*``
context managers, which own nurseries.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")


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



def one_error(
    opener: Callable[_P, AbstractAsyncContextManager[_T]],
) -> Callable[_P, AbstractAsyncContextManager[_T]]:
    """The public boundary of a context manager that owns a nursery (``open_prefill``,
    ``open_decode``, ``open_bootstrap_server``): what leaves it is one error a caller can
    catch by its type, as the docs promise, not the ExceptionGroup its nursery raised.

    * The exception that ended the caller's own ``async with`` block comes out as itself
      (the nursery around the block had wrapped it): ``except KeyError`` around the block
      works as it would without trio_pd.
    * A group of exactly one error of ours (a failed start, a background task that failed)
      becomes a copy of that error (:func:`copy_error`: its type and attributes) raised
      ``from`` the group, whose traceback says where it happened.
    * Anything else stays the group it is: two unrelated failures, or the caller's error
      beside one of ours, are not folded into one; nor is a lone ``Cancelled`` or
      ``KeyboardInterrupt`` (trio's cancel scopes and ``trio.run`` take them in groups).

    Nested context managers each apply the rule, so ``async with open_bootstrap_server()
    as boot, open_prefill(...) as prefill:`` raises a :class:`ConfigurationError` from
    ``open_prefill`` as itself, and the block's own exception as itself.

    **Cancellation:** none of its own; the wrapped context manager's rules apply.
    """

    @functools.wraps(opener)
    @asynccontextmanager
    async def boundary(*args: _P.args, **kwargs: _P.kwargs) -> AsyncIterator[_T]:
        theirs: BaseException | None = None  # what ended the caller's block, if anything
        try:
            async with opener(*args, **kwargs) as value:
                try:
                    yield value
                except BaseException as exc:
                    theirs = exc
                    raise
        except BaseExceptionGroup as group:
            mine, rest = group.split(lambda exc: exc is theirs)
            if mine is None:
                leaves = _leaves(group)
                if len(leaves) == 1 and isinstance(leaves[0], Exception):
                    raise copy_error(leaves[0]) from group
                raise
            if rest is not None:
                raise
        else:
            return
        # the caller's exception alone: raised as itself, outside the except clause above
        # so that it does not get the group that held it as its __context__
        assert theirs is not None
        raise theirs

    return boundary


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions ``exc`` holds, through nested groups (``[exc]`` if it is none)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]
