"""Per-room synchronisation that costs nothing until someone waits.

Thousands of rooms are open at once and few are ever waited on by a task: a room's
``trio.Event``/``trio.Lock`` (with their parking lots) are made on first use only.
"""

from __future__ import annotations

import trio


class LazyEvent:
    """The part of ``trio.Event`` a room needs; the real Event exists only once waited on."""

    __slots__ = ("_event", "_flag")

    def __init__(self) -> None:
        self._flag = False
        self._event: trio.Event | None = None

    def set(self) -> None:
        self._flag = True
        if self._event is not None:
            self._event.set()

    def is_set(self) -> bool:
        return self._flag

    async def wait(self) -> None:
        """Wait until :meth:`set` has been called.

        **Cancellation:** like ``trio.Event.wait``: a checkpoint even when already set.
        """
        if self._flag:
            await trio.lowlevel.checkpoint()
            return
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()
