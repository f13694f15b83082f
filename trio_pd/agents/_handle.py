"""What a prefill sender and a decode receiver have in common, written once.

Both are the scheduler's handle for one room of one agent: they name the room, report its
status (``poll``; ``wait`` until it is terminal), give it up (``abort``, also from a thread),
wait for its pages to come back (``wait_released``) and, as an ``async with`` block, give the
room up when the block is left (:class:`~trio_pd.core._closing.AbortsOnExit`). Where they differ is
each one's own: what a status *delivers* (a decode Success hands the pages to the caller; a
prefill status hands nothing), what aborting does, and what leaving the block gives up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import trio

from ..core._closing import AbortsOnExit
from ..core._state import KVPoll
from ._lazy import LazyEvent


class _Machine(Protocol):
    @property
    def room(self) -> int: ...


class _Room(Protocol):
    """The trio side of a room, as the handle reads it."""

    @property
    def machine(self) -> _Machine: ...

    @property
    def terminal(self) -> LazyEvent: ...

    @property
    def released(self) -> LazyEvent: ...


class _Agent(Protocol):
    @property
    def _token(self) -> trio.lowlevel.TrioToken: ...


A = TypeVar("A", bound=_Agent)
R = TypeVar("R", bound=_Room)


class RoomHandle(AbortsOnExit, Generic[A, R]):
    """Base of :class:`~trio_pd.PrefillSender` and :class:`~trio_pd.DecodeReceiver`."""

    __slots__ = ("_agent", "_room")

    def __init__(self, agent: A, room: R) -> None:
        self._agent = agent
        self._room = room

    @property
    def room(self) -> int:
        """The room's id."""
        return self._room.machine.room

    def poll(self) -> KVPoll:
        """The room's status now. Never blocks; a terminal status never changes again."""
        return self._deliver(self._status())

    def abort(self, reason: str) -> None:  # pragma: no cover - every handle defines it
        raise NotImplementedError

    def abort_from_thread(self, reason: str = "aborted from a thread") -> None:
        """:meth:`abort` for code that runs in a thread outside trio."""
        trio.from_thread.run_sync(self.abort, reason, trio_token=self._agent._token)

    async def wait(self) -> KVPoll:
        """Wait until the room is terminal; return Success or Failed.

        **Cancellation:** cancelling the wait does not abort the room.
        """
        await self._room.terminal.wait()
        return self._deliver(self._status())

    async def wait_released(self) -> None:
        """Wait until the room's pages have been handed back (``on_release`` has run).

        **Cancellation:** cancelling the wait changes nothing.
        """
        await self._room.released.wait()

    # -------------------------------------------------------------- for the facades

    def _status(self) -> KVPoll:  # pragma: no cover - every handle defines it
        """:meth:`poll` without delivering anything."""
        raise NotImplementedError

    def _deliver(self, status: KVPoll) -> KVPoll:
        """What reading ``status`` hands the caller: nothing, unless a handle says so."""
        return status

    def _when_ended(self, hook: Callable[[], object]) -> None:
        """Call ``hook()`` once the room is terminal (now if it is), delivering nothing: on
        the trio thread, synchronously, inside the step that ended the room."""
        self._room.terminal.when_set(hook)
