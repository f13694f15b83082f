"""Two context-manager shapes that many trio_pd objects share, written once.

:class:`ClosesOnExit`: ``with obj:`` calls ``obj.close()`` when the block ends, however it ends
(engines, the thread facade's agents and threads, device pools).

:class:`AbortsOnExit`: ``async with handle:`` aborts the room of a sender or receiver when the
block ends before the room did, so that a request handler that is cancelled or raises leaves no
room open.

Pure standard library: the engines import the first, which must not pull trio in.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self


class ClosesOnExit:
    """Mixin: leaving ``with obj:`` runs ``obj.close()``, whatever ended the block; the
    block's exception, if any, propagates."""

    __slots__ = ()

    def close(self) -> None:  # pragma: no cover - every user defines it
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AbortsOnExit:
    """Mixin for a room handle with ``poll()`` and ``abort(reason)``: ``async with`` holds the
    room for the block, and leaving the block aborts it unless it already ended (Success or
    Failed). Wait for the outcome inside the block: a room still going when it ends is
    aborted too. Its pages then go back by the usual rules (on_release once nothing can
    still write or read them).

    **Cancellation:** entering is a schedule point that is never cancelled, so the room the
    handle names is always handed to the block and its exit can abort it; leaving aborts
    first (synchronously), then a schedule point that is never cancelled, and re-raises
    whatever ended the block."""

    __slots__ = ()

    def poll(self) -> Any:  # pragma: no cover - every user defines it
        raise NotImplementedError

    def abort(self, reason: str = "") -> None:  # pragma: no cover - every user defines it
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

        from ._state import KVPoll

        if self.poll() not in (KVPoll.Success, KVPoll.Failed):
            why = "" if exc_type is None else f" ({exc_type.__name__})"
            self.abort(f"the room's async with block was left before the room ended{why}")
        await trio.lowlevel.cancel_shielded_checkpoint()
