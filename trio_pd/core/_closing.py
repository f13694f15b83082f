"""The context-manager shapes that many trio_pd objects share, written once.

:class:`ClosesOnExit`: ``with obj:`` calls ``obj.close()`` when the block ends, however it ends
(engines, the thread facade's agents and threads, device pools).

:class:`AbortsOnExit`: ``async with handle:`` gives the room of a sender or receiver up when
the block ends, so that a request handler that is cancelled or raises leaves no room open and
no page behind; :class:`LeavesOnExit` is the same for ``with handle:`` (the thread facade).

Pure standard library: the engines import the first, which must not pull trio in.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self


def how_ended(exc_type: type[BaseException] | None) -> str:
    """How a block ended, for the reason a room given up on leaving it carries."""
    return "" if exc_type is None else f" ({exc_type.__name__})"


class LeavesOnExit:
    """Mixin: leaving ``with obj:``, however the block ends, runs ``obj._leave(why)``, the
    object's own exit rule (a plain call that never blocks); the block's exception, if any,
    propagates. A room handle of the thread facade gives its room up there."""

    __slots__ = ()

    def _leave(self, why: str) -> None:  # pragma: no cover - every user defines it
        """Give the room up as the block ends; ``why`` says how (empty, or `` (ValueError)``)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave(how_ended(exc_type))


class ClosesOnExit(LeavesOnExit):
    """Mixin: leaving ``with obj:`` runs ``obj.close()``, whatever ended the block; the
    block's exception, if any, propagates."""

    __slots__ = ()

    def close(self) -> None:  # pragma: no cover - every user defines it
        raise NotImplementedError

    def _leave(self, why: str) -> None:
        self.close()


class AbortsOnExit:
    """Mixin for a room handle: ``async with`` holds the room for the block, and leaving the
    block, however it ends, gives the room up by the handle's own rule (``_leave``, a plain
    synchronous call): a sender aborts a room that has not ended; a receiver aborts a room
    whose Success was not delivered to the block (a Success it never saw goes back through
    ``on_release``). The pages then go back by the usual rules: ``on_release`` runs exactly
    once, after the drain where one is due. Leaving does not wait for that.

    **Cancellation:** entering is a schedule point that is never cancelled, so the room the
    handle names is always handed to the block and its exit runs; leaving gives the room up
    first (synchronously), then a schedule point that is never cancelled, and re-raises
    whatever ended the block."""

    __slots__ = ()

    def _leave(self, why: str) -> None:  # pragma: no cover - every user defines it
        """Give the room up as the block ends; ``why`` says how (empty, or `` (Cancelled)``)."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        import trio.lowlevel

        await trio.lowlevel.cancel_shielded_checkpoint()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        import trio.lowlevel

        self._leave(how_ended(exc_type))
        await trio.lowlevel.cancel_shielded_checkpoint()
