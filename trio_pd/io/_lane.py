"""A lane: one long-lived thread that runs one destination's engine calls, in order, with up
to ``depth`` writes in flight at once.

Why not ``trio.to_thread.run_sync`` per call (what trio_pd did first): every call then pays a
thread hand-off both ways (more than a small Mooncake write costs), a queue of calls waits on
a ``CapacityLimiter`` and a fresh hand-off between calls, and several threads writing to one
Mooncake peer at once cut its throughput (docs/bench.md has the measurements). A lane's
thread takes the next queued call the
moment the previous one returns, and a peer that hangs holds up only its own lane.

:meth:`Lane.run_sync` keeps the contract trio_pd's lifetimes rest on, the same as
``to_thread.run_sync(..., abandon_on_cancel=False)``: a call cancelled while it is still queued
is dropped and raises ``Cancelled`` (it never started); once the thread has taken it, the
caller waits for its result whatever is cancelled. The switch from "queued" to "started"
happens under the lane's lock, so exactly one of the two is ever true.

A call may return a :class:`~trio_pd.engines.Pending` (a write that has started, e.g.
Mooncake's ``submit``): the lane then starts the next queued call before it waits for that one,
up to ``depth`` started and unwaited, and waits for them in order; the caller's result is
what the Pending's ``wait()`` returned or raised. So the engine always has the next batch
queued while the lane waits for the current one, and the caller still hears only once its
write is complete.

**Joining.** A call that is :class:`Joinable` (an engine write, see ``_chunks.Write``) takes
the joinable calls queued right behind it with the same :attr:`~Joinable.join_key` (the same
engine and peer: chunks of other rooms for the same decode rank) into one call, up to
``join_blocks`` blocks and ``join_bytes`` bytes in all: what is queued already, never a wait
for more. The byte bound is the engine's (:func:`trio_pd.engines.join_bytes`): on an engine
that finishes a joined call's writes together, joined large writes all end with the whole
call and the rooms behind them start late (measured: the default bench workload's 8 MiB
calls, joined, moved 0.80 to 0.90 GB/s on Mooncake against 1.03 to 1.24 alone), so it joins
small writes only, whose cost is the call; NIXL moved joined 8 MiB writes as fast as separate
ones, and the event loop then wakes once for all of their rooms. Each joined
call is *started* by that, exactly as if it ran alone (it can no longer be cancelled), and
each caller gets the shared call's result: its value, or its error (a copy each). So a
failure of the shared call fails every call in it (each room quarantines its own lease), and
an abort of one room while the call runs waits for the call.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import outcome
import trio
import trio.lowlevel

from ..core._errors import copy_error


def run_to_end(fn: Callable[[], Any]) -> Any:
    """Call ``fn`` and, if it returned a Pending, wait for it: what a lane does for one call,
    on the caller's thread (for tests and for running a lane job elsewhere)."""
    result = fn()
    return result.wait() if hasattr(result, "wait") else result


log = logging.getLogger("trio_pd.lane")


class LaneClosed(RuntimeError):
    """A call was handed to a lane after :meth:`Lane.close`."""


class Joinable(Protocol):
    """A lane call that may share one engine call with the calls queued behind it: one
    whose ``join_key`` attribute is not None."""

    #: calls join only with calls of an equal key (the same engine and peer)
    join_key: object
    #: what the call weighs against the lane's ``join_blocks`` and ``join_bytes``
    num_blocks: int
    nbytes: int
    #: set by the lane on every call that rode in an earlier call's engine call
    joined: bool

    def __call__(self) -> Any: ...

    def join(self, others: Sequence[Joinable]) -> Callable[[], Any]:
        """The one call that does this call's work and ``others``' (in that order)."""
        ...


class _Job:
    __slots__ = ("args", "fn", "state", "task")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], task: Any) -> None:
        self.fn = fn
        self.args = args
        self.task = task
        self.state = "queued"  # -> "started" (by the thread) | "cancelled" (by trio)


class Lane:
    """One thread, one FIFO of blocking calls. Make it inside a trio run; the thread starts
    with the first call. :meth:`close` lets the thread finish what is queued and exit.

    ``nice`` > 0 raises the thread's nice value by that much (Linux only, where it is a
    per-thread attribute), so that the event loop's thread preempts it on a CPU-starved
    host.

    A thread with nothing to do for ``idle_exit`` seconds exits, and the next call starts a
    new one: threads are bounded by the lanes in use, not by the peers ever registered (a
    REGISTER flood used to leave one thread per endpoint for good). The switch happens under
    the lane's lock, so a call never finds a thread that is about to leave."""

    #: default seconds a lane's thread waits for a call before it exits
    IDLE_EXIT = 5.0

    def __init__(
        self, name: str, *, depth: int = 2, nice: int = 0, idle_exit: float | None = None,
        join_blocks: int = 0, join_bytes: int = 1 << 20,
    ) -> None:
        if depth < 1:
            raise ValueError("depth must be at least 1")
        if join_blocks < 0:
            raise ValueError("join_blocks must be >= 0 (0: calls never join)")
        #: joinable calls queued together share one engine call up to this many blocks and
        #: bytes
        self.join_blocks = join_blocks
        self.join_bytes = join_bytes
        if nice < 0:
            raise ValueError("nice can only lower the thread's priority (>= 0)")
        self.name = name
        self.depth = depth
        self.nice = nice
        self._token = trio.lowlevel.current_trio_token()
        #: the condition's lock, taken directly on trio's side: the Condition's Python-level
        #: ``__enter__`` and ``__exit__`` cost the event loop two calls more per engine call
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        #: the thread waits on the condition (set and cleared under the lock): a call is
        #: notified only then, a busy thread finds it in the queue before it waits again
        self._idle = False
        self._jobs: deque[_Job] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.idle_exit = self.IDLE_EXIT if idle_exit is None else idle_exit
        #: calls handed to :meth:`run_sync` whose caller has not been answered yet (trio side)
        self.outstanding = 0

    def __repr__(self) -> str:
        return f"<Lane {self.name}{' closed' if self._closed else ''}>"

    async def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the lane's thread and return (or raise) what it did.

        **Cancellation:** while the call waits its turn, cancelling drops it (it never runs);
        once it has started, the caller waits for it to return.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        job = _Job(fn, args, trio.lowlevel.current_task())
        with self._mutex:
            if self._closed:
                raise LaneClosed(f"{self!r} takes no more calls")
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name=f"trio_pd lane {self.name}", daemon=True
                )
                self._thread.start()
            elif self._idle:
                self._cond.notify()

        def abort(_: Any) -> trio.lowlevel.Abort:
            with self._mutex:
                if job.state == "queued":
                    job.state = "cancelled"  # the thread skips it
                    return trio.lowlevel.Abort.SUCCEEDED
            return trio.lowlevel.Abort.FAILED  # started: its result will come

        self.outstanding += 1
        try:
            return await trio.lowlevel.wait_task_rescheduled(abort)
        finally:
            self.outstanding -= 1

    def close(self) -> None:
        """No more calls; the thread runs what is queued, then exits. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _serve(self) -> None:
        if self.nice and sys.platform == "linux":  # per-thread there; elsewhere per-process
            tid = threading.get_native_id()
            try:
                os.setpriority(
                    os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self.nice
                )
            except OSError as exc:  # a sandbox may refuse it: run at the process's priority
                log.warning("%r: could not lower the thread's priority: %s", self, exc)
        # started, returned a Pending, not waited: the jobs that share it, and it
        flying: deque[tuple[list[_Job], Any]] = deque()
        done: list[tuple[list[_Job], outcome.Outcome[Any]]] = []  # waited, callers not told
        while True:
            job = None
            group: list[_Job] = []
            with self._cond:
                while len(flying) < self.depth:
                    while not self._jobs and not flying and not done and not self._closed:
                        self._idle = True
                        woken = self._cond.wait(self.idle_exit)
                        self._idle = False
                        if not woken and not (self._jobs or self._closed):
                            self._thread = None  # under the lock: the next call starts one
                            return
                    while self._jobs and job is None:
                        job = self._jobs.popleft()
                        if job.state == "cancelled":
                            job = None
                    if job is not None:
                        job.state = "started"
                        group = [job, *self._take_joiners(job)]
                        break
                    if flying or done:
                        break  # nothing new to start: tell callers, wait for the oldest
                    if self._closed:
                        return  # closed and drained
                    # only cancelled calls were queued: wait for more
            if job is not None:
                if len(group) > 1:
                    head = cast(Joinable, job.fn)
                    others = cast(list[Joinable], [j.fn for j in group[1:]])  # (_take_joiners)
                    # (joining itself may fail, a MemoryError say: every caller gets that)
                    joined = outcome.capture(head.join, others)
                    if isinstance(joined, outcome.Value):
                        started = outcome.capture(joined.value)
                    else:
                        started = joined
                else:
                    started = outcome.capture(job.fn, *job.args)
                if isinstance(started, outcome.Value) and hasattr(started.value, "wait"):
                    flying.append((group, started.value))
                else:
                    self._post(group, started)
                continue
            # The engine has its next batch (if there was one) before anyone is told: waking
            # the event loop costs a syscall and a GIL hand-off, off the engine's critical path.
            for finished, result in done:
                self._post(finished, result)
            done.clear()
            if flying:
                oldest, pending = flying.popleft()
                done.append((oldest, outcome.capture(pending.wait)))

    def _take_joiners(self, job: _Job) -> list[_Job]:
        """Under the lock: the joinable jobs queued right behind ``job`` (see the module
        docstring), marked started and taken off the queue. Cancelled ones are dropped."""
        fn = cast(Joinable, job.fn)
        # (an attribute, not isinstance on the runtime Protocol: that costs ~18 µs a job here,
        # under the lane's lock, on every chunk's path)
        key = getattr(fn, "join_key", None)
        if not self.join_blocks or job.args or key is None:
            return []
        taken: list[_Job] = []
        blocks, nbytes = fn.num_blocks, fn.nbytes
        while self._jobs:
            head = self._jobs[0]
            if head.state == "cancelled":
                self._jobs.popleft()
                continue
            other = cast(Joinable, head.fn)
            if (head.args or getattr(other, "join_key", None) != key
                    or blocks + other.num_blocks > self.join_blocks
                    or nbytes + other.nbytes > self.join_bytes):
                break
            self._jobs.popleft()
            head.state = "started"
            other.joined = True
            blocks += other.num_blocks
            nbytes += other.nbytes
            taken.append(head)
        return taken

    def _post(self, jobs: list[_Job], result: outcome.Outcome[Any]) -> None:
        """Tell each job's caller ``result`` (each its own outcome: one is unwrapped once)."""
        try:
            if len(jobs) == 1:
                self._token.run_sync_soon(trio.lowlevel.reschedule, jobs[0].task, result)
            else:
                self._token.run_sync_soon(_reschedule_all, [j.task for j in jobs], result)
        except trio.RunFinishedError:  # the run is over: nobody is left to tell
            pass


def _reschedule_all(tasks: list[Any], result: outcome.Outcome[Any]) -> None:
    """Wake every task of a shared call with its own copy of ``result`` (on trio's thread:
    one wake-up of the loop for all of them)."""
    for k, task in enumerate(tasks):
        if isinstance(result, outcome.Value):
            mine: outcome.Outcome[Any] = outcome.Value(result.value)
        else:
            assert isinstance(result, outcome.Error)
            mine = outcome.Error(result.error if k == 0 else copy_error(result.error))
        trio.lowlevel.reschedule(task, mine)
