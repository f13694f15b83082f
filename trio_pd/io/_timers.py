"""One task per agent runs every deadline the agent has (bootstrap and waiting timeouts,
quarantine fences, ack and send retries, tombstone expiry): no task, and no cancel scope, per
room. Actions are synchronous and run in deadline order."""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable

import trio

log = logging.getLogger("trio_pd.timers")


class Timers:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = 0  # ties in deadline run in arming order (and never compare actions)
        self._wakeup = trio.Event()
        #: reads ``trio.current_time()``: while :meth:`run` runs, straight from the run's
        #: clock (two calls instead of four; every arm and every peer lookup reads it)
        self.clock: Callable[[], float] = trio.current_time

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, deadline: float, action: Callable[[], object]) -> None:
        """Run ``action()`` once ``trio.current_time()`` reaches ``deadline``."""
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, action))
        if self._heap[0][0] == deadline:
            self._wakeup.set()

    def after(self, delay: float, action: Callable[[], object]) -> None:
        """Run ``action()`` ``delay`` seconds from now (:meth:`at`, inlined: a request arms
        several)."""
        deadline = self.clock() + delay
        heap = self._heap
        self._seq += 1
        heapq.heappush(heap, (deadline, self._seq, action))
        if heap[0][0] == deadline:
            self._wakeup.set()

    async def run(self) -> None:
        """Run due actions until cancelled.

        **Cancellation:** safe at any point; an action runs whole or not at all.
        """
        # the same clock trio.current_time() reads, for this run only (an agent's Timers
        # run in the trio run that uses them; after it, back to the plain call)
        self.clock = clock = trio.lowlevel.current_clock().current_time
        try:
            while True:
                now = clock()
                while self._heap and self._heap[0][0] <= now:
                    _, _, action = heapq.heappop(self._heap)
                    try:
                        action()
                    except Exception:  # one room's bug must not end the agent (SPEC §5.7)
                        log.exception("timer action %r raised", action)
                self._wakeup = trio.Event()
                deadline = self._heap[0][0] if self._heap else math.inf
                with trio.move_on_at(deadline):
                    await self._wakeup.wait()
        finally:
            self.clock = trio.current_time
