"""Per-room synchronisation that costs nothing until someone waits.

Thousands of rooms are open at once and few are ever waited on by a task: a room's
``trio.Event``/``trio.Lock`` (with their parking lots) are made on first use only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

log = logging.getLogger(__name__)


class LazyEvent:
    """The part of ``trio.Event`` a room needs; the real Event exists only once waited on."""

    __slots__ = ("_event", "_flag", "_hooks")

    def __init__(self) -> None:
        self._flag = False
        self._event: trio.Event | None = None
        self._hooks: list[Callable[[], object]] | None = None

    def set(self) -> None:
        if self._flag:
            return
        self._flag = True
        if self._event is not None:
            self._event.set()
        hooks, self._hooks = self._hooks, None
        for hook in hooks or ():
            try:
                hook()
            except Exception:  # (a hook must not break the agent's step that set us)
                log.exception("%r raised", hook)

    def when_set(self, hook: Callable[[], object]) -> None:
        """Call ``hook()`` once the event is set: now if it is, else inside :meth:`set`,
        synchronously (a waiter without a task: no wake-up, no schedule point). What it
        raises is logged, never raised into the code that set the event."""
        if self._flag:
            hook()
        elif self._hooks is None:
            self._hooks = [hook]
        else:
            self._hooks.append(hook)

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
