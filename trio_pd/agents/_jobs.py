"""Job queues kept per destination: a destination that hangs holds up only its own jobs.

A prefill agent's chunk jobs wait on their decode peer: for a lane slot, for the engine call,
for a probe of the peer after a failed call. With one queue for every destination and a
fixed set of worker tasks, a peer that stops reading (a stopped process, a black-holed host)
took every worker in turn, one job each, and the rooms of healthy peers queued behind them
until the stalled calls failed (measured: 12 s, the engine's deadline plus the probe's).

Here each destination (the set of endpoints a room writes to) has its own queue and at most
``per_key`` tasks serving it, started when a job arrives and ended when its queue is empty.
So the tasks are bounded by ``per_key`` times the destinations that have work, and a job
waits only behind jobs for the same destination.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import trio

J = TypeVar("J")


class JobQueues(Generic[J]):
    """Jobs by destination, each run by ``run(job)`` in a task of :attr:`nursery`, at most
    ``per_key`` at once per destination, in the order they were put."""

    def __init__(self, run: Callable[[J], Awaitable[object]], per_key: int) -> None:
        if per_key < 1:
            raise ValueError(f"per_key must be at least 1, not {per_key}")
        self._run = run
        self.per_key = per_key
        self._queues: dict[Hashable, deque[J]] = {}
        self._serving: dict[Hashable, int] = {}
        self._nursery: trio.Nursery | None = None

    def __len__(self) -> int:
        """Jobs queued and not yet taken."""
        return sum(len(q) for q in self._queues.values())

    @property
    def tasks(self) -> int:
        """Tasks serving a queue now."""
        return sum(self._serving.values())

    def start(self, nursery: trio.Nursery) -> None:
        """Serve the queues in ``nursery`` from now on (jobs put before wait for this)."""
        self._nursery = nursery
        for key in list(self._queues):
            self._spawn(key)

    def stop(self) -> None:
        """Start no more tasks (the agent is closing; what is queued stays queued)."""
        self._nursery = None

    def put(self, key: Hashable, job: J) -> None:
        """Queue ``job`` for destination ``key``. Synchronous: it never waits."""
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        queue.append(job)
        self._spawn(key)

    def _spawn(self, key: Hashable) -> None:
        nursery = self._nursery
        serving = self._serving.get(key, 0)
        if (
            nursery is None
            or serving >= self.per_key
            or not self._queues[key]
            or nursery.cancel_scope.cancel_called  # (last: a property that reads the clock)
        ):
            return
        self._serving[key] = serving + 1
        nursery.start_soon(self._serve, key, self._queues[key])

    async def _serve(self, key: Hashable, queue: deque[J]) -> None:  # noqa: ASYNC910 (a task)
        try:
            while queue:
                await self._run(queue.popleft())
        finally:
            left = self._serving[key] - 1
            if left:
                self._serving[key] = left
            else:
                del self._serving[key]
                if not queue:
                    del self._queues[key]
