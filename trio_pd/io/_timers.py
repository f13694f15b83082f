"""One task per agent runs every deadline the agent has (bootstrap and waiting timeouts,
quarantine fences, ack and send retries, tombstone expiry): no task, and no cancel scope, per
room. Actions are synchronous and run in deadline order.

**A deadline that is no longer wanted goes with what it was for.** An armed action holds what
it acts on (a room's deadline holds the room's record, its page ids with it), so a deadline
left in the heap until it expires keeps an ended room for the whole timeout: with
300-second timeouts, every room of the last five minutes, and the garbage collector walking
all of them. :meth:`Timers.cancel` drops the action at once; the heap's entry (four words)
stays until it comes up or the heap is rebuilt, which happens when cancelled entries are
more than half of it, so the heap is at most twice the deadlines still armed.

**An entry holds the action and its one argument, not a closure of them.** Every deadline
is "call this owner's handler with this key", and thousands are armed at once (three a
room, on the two sides): a ``functools.partial`` per deadline (the partial, its argument
tuple, its keyword dict and the bound method: about 250 bytes) was most of what an armed
deadline cost. The owners pass a handler they made once (:meth:`Timers.after`)."""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

import trio

log = logging.getLogger("trio_pd.timers")

#: an armed deadline: ``[deadline, seq, action, arg]``, action and arg None once it ran or
#: was cancelled (a list, so that the heap compares it in C; ``seq`` is unique, so the
#: action is never compared)
Timer: TypeAlias = list[Any]

T = TypeVar("T")

#: the heap is rebuilt once cancelled entries are more than half of it and at least this many
_COMPACT_MIN = 64


class Timers:
    def __init__(self) -> None:
        self._heap: list[Timer] = []
        self._seq = 0  # ties in deadline run in arming order (and never compare actions)
        self._cancelled = 0  # cancelled entries still in the heap
        self._wakeup = trio.Event()
        #: reads ``trio.current_time()``: while :meth:`run` runs, straight from the run's
        #: clock (two calls instead of four; every arm and every peer lookup reads it)
        self.clock: Callable[[], float] = trio.current_time

    def __len__(self) -> int:
        """Deadlines armed and not yet run or cancelled."""
        return len(self._heap) - self._cancelled

    def at(self, deadline: float, action: Callable[[T], object], arg: T) -> Timer:
        """Run ``action(arg)`` once ``trio.current_time()`` reaches ``deadline``; the handle
        :meth:`cancel` takes."""
        self._seq += 1
        timer = [deadline, self._seq, action, arg]
        heapq.heappush(self._heap, timer)
        if self._heap[0] is timer:
            self._wakeup.set()
        return timer

    def after(self, delay: float, action: Callable[[T], object], arg: T) -> Timer:
        """Run ``action(arg)`` ``delay`` seconds from now (:meth:`at`, inlined: a request arms
        several). ``action`` is best one object its owner made once (a bound method read
        once), not one per deadline: the entry holds it until it runs or is cancelled."""
        heap = self._heap
        self._seq += 1
        timer = [self.clock() + delay, self._seq, action, arg]
        heapq.heappush(heap, timer)
        if heap[0] is timer:
            self._wakeup.set()
        return timer

    def cancel(self, timer: Timer) -> None:
        """``timer``'s action will not run, and it and its argument are let go now. A no-op
        for one that ran or was cancelled already."""
        if timer[2] is None:
            return
        timer[2] = timer[3] = None
        self._let_go(1)

    def cancel_all(self, timers: list[Timer]) -> None:
        """:meth:`cancel` each of ``timers`` (a room's, when it is forgotten), and forget
        them."""
        cancelled = 0
        for timer in timers:  # (cancel's mark, once a timer, without its call)
            if timer[2] is not None:
                timer[2] = timer[3] = None
                cancelled += 1
        timers.clear()
        if cancelled:
            self._let_go(cancelled)

    def _let_go(self, cancelled: int) -> None:
        """``cancelled`` more entries of the heap are dead: once they are over half of it
        (and more than :data:`_COMPACT_MIN`), the heap is rebuilt without them, so a
        cancelled action and what it holds are let go now, not at their deadline."""
        self._cancelled += cancelled
        heap = self._heap
        if self._cancelled > _COMPACT_MIN and self._cancelled * 2 > len(heap):
            heap[:] = [t for t in heap if t[2] is not None]
            heapq.heapify(heap)
            self._cancelled = 0

    async def run(self) -> None:
        """Run due actions until cancelled.

        **Cancellation:** safe at any point; an action runs whole or not at all.
        """
        # the same clock trio.current_time() reads, for this run only (an agent's Timers
        # run in the trio run that uses them; after it, back to the plain call)
        self.clock = clock = trio.lowlevel.current_clock().current_time
        heap = self._heap
        try:
            while True:
                now = clock()
                while heap and heap[0][0] <= now:
                    timer = heapq.heappop(heap)
                    action, arg = timer[2], timer[3]
                    if action is None:
                        self._cancelled -= 1
                        continue
                    timer[2] = timer[3] = None
                    try:
                        action(arg)
                    except Exception:  # one room's bug must not end the agent (SPEC §5.7)
                        log.exception("timer action %r(%r) raised", action, arg)
                    action = arg = None  # (not held by this frame while it sleeps)
                self._wakeup = trio.Event()
                deadline = heap[0][0] if heap else math.inf
                with trio.move_on_at(deadline):
                    await self._wakeup.wait()
        finally:
            self.clock = trio.current_time
