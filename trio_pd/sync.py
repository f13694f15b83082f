"""Host trio_pd from plain threads: the agents run on a trio thread of their own.

A serving engine's scheduler is a loop on an ordinary thread (SGLang's and vLLM's are): each
step it polls its requests without blocking, an abort may come from another thread, and it
frees the pages of requests that are over on its own thread. This module gives such a loop
the shapes it expects: :func:`open_prefill` / :func:`open_decode` /
:func:`open_bootstrap_server` start the trio agent on a :class:`TrioThread` and return a
facade whose handles (:class:`SyncSender`, :class:`SyncReceiver`) look like SGLang's
``KVSender`` / ``KVReceiver``, and whose :meth:`~SyncPrefill.pop_released` says, once per
step, which rooms' pages are free again. docs/threads.md says which thread may call what.

There is one way into the trio thread, the thread's *inbox* (:meth:`TrioThread._enqueue`): a
queue of calls that the trio thread drains whole, in order, in one callback handed to
``TrioToken.run_sync_soon``. Only the call that finds the inbox idle wakes the trio thread;
the calls made before it has drained ride along, so a scheduler step's calls cost one
wake-up, not one each. It is used two ways:

* a *post* hands a function over and returns at once (``send``, ``abort``, the receiver's
  ``init``, creating a room whose id is free): what the function finds wrong fails the room,
  for ``poll()`` to report; what the calling thread can check, it checks first, and raises;
* a *hop* hands a function over and waits until the trio thread has run it (creating a room
  whose id is still held, ``statistics()``): its result or exception comes back. A hop
  never waits past its bound; on the bound it tells "never ran" from "ran" exactly
  (:class:`_Hop`).

The other way round needs no crossing: the trio thread *publishes* what the scheduler reads
(a room's terminal status and failure, the rooms whose pages came back) into fields that
other threads read with one reference load each.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt
import trio
import trio.lowlevel

from .agents._decode import DecodeAgent, DecodeConfig, DecodeReceiver
from .agents._decode import open_decode as _open_decode
from .agents._prefill import PrefillAgent, PrefillSender, layer_range
from .agents._prefill import open_prefill as _open_prefill
from .bootstrap._bootstrap import BootstrapServer
from .bootstrap._bootstrap import open_bootstrap_server as _open_bootstrap_server
from .bootstrap._bootstrap_client import MAX_DP_SIZE, check_dp, split_dp_url
from .core._closing import ClosesOnExit, LeavesOnExit
from .core._errors import (
    AdmissionClosed,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferTimeout,
)
from .core._memory import (
    PoolSpec,
    as_index,
    check_aux_slot,
    check_num_pages,
    check_prefix_pages,
    check_state_slots,
    pool_page_ids,
)
from .core._rooms import RequestPages
from .core._state import KVPoll
from .core._stats import AgentStatistics
from .engines import TransferEngine

__all__ = [
    "SyncBootstrapServer",
    "SyncDecode",
    "SyncPrefill",
    "SyncReceiver",
    "SyncSender",
    "TrioThread",
    "open_bootstrap_server",
    "open_decode",
    "open_prefill",
]

log = logging.getLogger("trio_pd.sync")

T = TypeVar("T")
A = TypeVar("A")
AG = TypeVar("AG", PrefillAgent, DecodeAgent)

_TERMINAL = (KVPoll.Success, KVPoll.Failed)

#: how often a caller waiting on the trio thread checks that the thread is still alive
_LIVENESS_SLICE = 0.25


def _closed(what: str) -> RuntimeError:
    return RuntimeError(f"trio_pd.sync: {what} is closed")


class _Hop(Generic[T]):
    """One call another thread is waiting for: run once on the trio thread, or never.

    ``state`` moves once, under ``guard``: PENDING -> RUNNING (the trio thread took it) or
    PENDING -> SKIPPED (the caller gave up first; the call then never runs). ``done`` is
    released once the call has run.
    """

    __slots__ = ("_args", "_done", "_error", "_fn", "_guard", "_state", "_value")

    PENDING, RUNNING, SKIPPED = 0, 1, 2

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        self._fn, self._args = fn, args
        self._done = threading.Lock()
        self._done.acquire()
        self._guard = threading.Lock()
        self._state = self.PENDING
        self._value: T | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        """On the trio thread (a ``run_sync_soon`` callback: it must not raise)."""
        with self._guard:
            if self._state == self.SKIPPED:
                return
            self._state = self.RUNNING
        try:
            self._value = self._fn(*self._args)
        except BaseException as exc:  # handed to the waiting thread, raised there
            self._error = exc
        finally:
            self._done.release()

    def wait(self, timeout: float, alive: Callable[[], bool], what: str) -> T:
        """On the calling thread: the call's result, or its exception raised here.
        :class:`~trio_pd.TransferTimeout` if the trio thread has not taken it within
        ``timeout`` seconds (it then never runs); RuntimeError if the thread ended first."""
        deadline = time.monotonic() + timeout
        while not self._done.acquire(
            timeout=max(0.0, min(_LIVENESS_SLICE, deadline - time.monotonic()))
        ):
            late = time.monotonic() >= deadline
            if late or not alive():
                with self._guard:
                    if self._state == self.PENDING:
                        self._state = self.SKIPPED
                        if late:
                            raise TransferTimeout(
                                f"trio_pd.sync: the trio thread did not take {what} within "
                                f"{timeout:g} s; it was not done"
                            )
                        raise _closed("the trio thread")
                self._done.acquire()  # it is running: a short synchronous call
                break
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._value  # type: ignore[return-value]  # (set when no error)


def _guarded(fn: Callable[..., object], args: tuple[Any, ...]) -> None:
    """Run a posted function. An exception out of a ``run_sync_soon`` callback would crash
    the trio run itself, so it is logged; posted functions catch what they expect."""
    try:
        fn(*args)
    except Exception:
        log.exception("trio_pd.sync: %r raised on the trio thread", fn)


class TrioThread(ClosesOnExit):
    """A trio run on a thread of its own, and the ways other threads hand it work.

    :func:`open_prefill`, :func:`open_decode` and :func:`open_bootstrap_server` start one for
    the facade they return, unless given one to share (``thread=``): services on one thread
    share one event loop (a prefill rank and its bootstrap service, say). Each service
    closes on its own; :meth:`close` closes the thread, and with it (by cancellation, under
    each service's own close rules) whatever still runs on it.

    Made on any thread; blocks until the run has started, at most ``start_timeout`` seconds
    (then :class:`~trio_pd.TransferTimeout`). The thread is a daemon thread, so a program
    that forgets :meth:`close` can still exit.
    """

    def __init__(self, name: str = "trio_pd", *, start_timeout: float = 10.0) -> None:
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        #: where services run; set on the trio thread before ``_ready``; None once closing
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        #: the inbox: calls for the trio thread, in order; a drain is due (handed to
        #: ``run_sync_soon``, not yet started) while ``_drain_due``; once the run refused
        #: one, ``_shut`` and nothing more is taken. All three under ``_inbox_lock``
        self._inbox: collections.deque[tuple[Callable[..., object], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._inbox_lock = threading.Lock()
        self._drain_due = False
        self._shut = False
        #: what ended ``trio.run`` with an error, if anything did
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ident = self._thread.ident
        if not self._ready.wait(start_timeout) or self._token is None:
            raise TransferTimeout(f"trio_pd.sync: trio thread {name!r} did not start")

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self.error = exc
            log.exception("trio_pd.sync: the trio thread %s ended with an error", self.name)
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._stop = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._ready.set()
            await self._stop.wait()
            self._nursery = None
            nursery.cancel_scope.cancel("trio_pd.sync: the trio thread is closing")

    @property
    def name(self) -> str:
        """The thread's name. Any thread; never blocks."""
        return self._thread.name

    @property
    def alive(self) -> bool:
        """The trio run has not ended. Any thread; never blocks."""
        return self._thread.is_alive()

    @property
    def in_trio_thread(self) -> bool:
        """The calling thread is this trio thread. Any thread; never blocks."""
        return threading.get_ident() == self._ident

    def check_may_block(self, what: str) -> None:
        """Raise RuntimeError if the calling thread is this trio thread: a call that waits
        for the trio thread would wait for itself."""
        if threading.get_ident() == self._ident:
            raise RuntimeError(
                f"trio_pd.sync: {what} waits for the trio thread and was called on it (from "
                "a callback or a trio task?): it would deadlock. Call it from another thread; "
                "on the trio thread use the trio API (the agent's own methods)"
            )

    def _enqueue(self, fn: Callable[..., object], args: tuple[Any, ...]) -> bool:
        """Put ``fn(*args)`` in the inbox: True if it will run on the trio thread, after
        everything enqueued before it; False if the trio run is over (it never runs). Wakes
        the trio thread only if no drain is due yet. Never blocks for long: the lock is held
        for an append, and by the caller that wakes the trio thread for a ``run_sync_soon``
        (a lock and a byte written), so that no call is taken after the run refused one."""
        with self._inbox_lock:
            if self._shut or self._token is None:
                return False
            self._inbox.append((fn, args))
            if self._drain_due:
                return True
            try:
                self._token.run_sync_soon(self._drain)
            except trio.RunFinishedError:
                self._shut = True
                self._inbox.clear()  # (nothing was due: only this call was waiting)
                return False
            self._drain_due = True
            return True

    def _drain(self) -> None:
        """On the trio thread (a ``run_sync_soon`` callback): run every call in the inbox,
        in order. A call enqueued meanwhile finds no drain due and hands over another."""
        with self._inbox_lock:
            batch = list(self._inbox)
            self._inbox.clear()
            self._drain_due = False
        for fn, args in batch:
            _guarded(fn, args)

    def post(self, fn: Callable[..., object], *args: Any) -> bool:
        """Hand ``fn(*args)`` to the trio thread and return at once: True if it will run
        there (in the order posted, after every call posted before it), False if the trio run
        is over. An exception ``fn`` raises is logged on the trio thread.

        Any thread, the trio thread included; never blocks (a lock, and for the first call
        of a batch a byte written to the run's wake-up socket).
        """
        return self._enqueue(fn, args)

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 10.0) -> T:
        """Run the synchronous ``fn(*args)`` on the trio thread and return its result, or
        raise its exception here. ``fn`` must not block (it runs on the event loop).

        Any thread but this trio thread (RuntimeError there). Blocks until the trio thread
        has run it: one hop (docs/threads.md says what one costs), longer while the loop is
        busy; at most ``timeout`` seconds before the trio thread takes it, then
        :class:`~trio_pd.TransferTimeout`, and ``fn`` never runs. RuntimeError if the
        thread has ended.
        """
        self.check_may_block("TrioThread.call")
        hop: _Hop[T] = _Hop(fn, args)
        if not self._enqueue(hop.run, ()):
            raise _closed("the trio thread")
        return hop.wait(timeout, self._thread.is_alive, getattr(fn, "__name__", repr(fn)))

    def start_service(
        self,
        service: Callable[..., Awaitable[object]],
        *,
        what: str,
        timeout: float,
    ) -> Any:
        """Start ``service(task_status=...)`` as a task of the trio thread, like
        ``nursery.start``, and return what it passes to ``task_status.started``.

        Any thread but this trio thread. Blocks until the service has started or failed, for
        at most ``timeout`` seconds (then the service is cancelled and
        :class:`~trio_pd.TransferTimeout` raised). The service's own error is raised here.
        RuntimeError if the thread is closing or closed.
        """
        self.check_may_block(f"starting {what}")
        done = threading.Lock()
        done.acquire()
        box: list[tuple[bool, Any]] = []

        async def starter(nursery: trio.Nursery) -> None:  # noqa: ASYNC910 - start() checkpoints
            try:
                with trio.fail_after(timeout):
                    box.append((True, await nursery.start(service)))
            except trio.TooSlowError:
                error = TransferTimeout(f"trio_pd.sync: {what} did not start in {timeout:g} s")
                box.append((False, error))
            except Exception as exc:
                box.append((False, exc))
            finally:
                done.release()

        def spawn() -> None:
            if self._nursery is None:
                box.append((False, _closed("the trio thread")))
                done.release()
            else:
                self._nursery.start_soon(starter, self._nursery)

        if not self.post(spawn):
            raise _closed("the trio thread")
        while not done.acquire(timeout=_LIVENESS_SLICE):
            if not self._thread.is_alive():
                break
        if not box:  # cancelled: the thread closed while the service started
            raise _closed("the trio thread")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self, timeout: float = 30.0) -> None:
        """Stop the trio run: every service still on it is cancelled, and closes under its
        own rules (a decode agent waits for its drains, at most its ``close_timeout``).
        Idempotent.

        Any thread but this trio thread (RuntimeError there). Blocks until the thread has
        ended, at most ``timeout`` seconds; then :class:`~trio_pd.TransferTimeout` (the
        thread goes on, as a daemon, until its services have closed).
        """
        self.check_may_block("TrioThread.close")
        stop = self._stop
        if stop is not None:
            self.post(stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TransferTimeout(
                f"trio_pd.sync: the trio thread {self.name} did not end within {timeout:g} s"
            )

class _Host(Generic[A]):
    """One trio_pd context manager (an ``open_*``) held open by a task of a TrioThread.

    ``stop`` becomes set once (on the trio thread), when the facade closes; ``done`` (a
    threading.Event) is set once the context manager has exited and ``on_stopped`` has run.
    """

    def __init__(
        self,
        thread: TrioThread,
        what: str,
        opener: Callable[[], AbstractAsyncContextManager[A]],
        on_stopped: Callable[[BaseException | None], None],
    ) -> None:
        self.thread, self.what = thread, what
        self._opener, self._on_stopped = opener, on_stopped
        self.stop = trio.Event()
        self.done = threading.Event()
        #: trio thread only: the nursery of the facade's own small tasks (room watchers)
        self.tasks: trio.Nursery | None = None
        #: what ended the service after it started, if it was not closed
        self.error: BaseException | None = None

    def start(self, timeout: float) -> A:
        """Start the service; raises what its ``open_*`` raised at start (one error, not a
        group: the ``open_*`` functions are the public boundary)."""
        value: A = self.thread.start_service(self._serve, what=self.what, timeout=timeout)
        return value

    async def _serve(  # noqa: ASYNC910 - a service task's end; every path is the opener's
        self, *, task_status: trio.TaskStatus[A]
    ) -> None:
        started = False
        try:
            async with self._opener() as value:
                try:
                    async with trio.open_nursery() as tasks:
                        self.tasks = tasks
                        task_status.started(value)
                        started = True
                        await self.stop.wait()
                        tasks.cancel_scope.cancel(f"{self.what} closing")
                finally:
                    self.tasks = None
        except Exception as exc:
            if not started:
                raise
            self.error = exc
            log.error("trio_pd.sync: %s stopped: %r", self.what, exc)
        finally:
            if started:
                try:
                    self._on_stopped(self.error)
                finally:
                    self.done.set()

    def close(self, bound: float) -> None:
        """Any thread but the trio thread. Blocks until the service has closed, at most
        ``bound`` seconds, then TransferTimeout."""
        self.thread.check_may_block(f"closing {self.what}")
        if not self.thread.post(self.stop.set):
            return  # the trio run is over, and the service with it
        if not self.done.wait(bound) and self.thread.alive:
            raise TransferTimeout(
                f"trio_pd.sync: {self.what} did not close within {bound:g} s; it goes on "
                "closing on its trio thread"
            )


# ---------------------------------------------------------------------------------- rooms


class _Handle(LeavesOnExit):
    """What a room's handle shares between the scheduler's threads and the trio thread.

    Invariants: ``_final`` is written as one tuple (status and failure together), under
    ``_final_lock``: once by the trio thread when the room ends, or first by a receiver's
    :meth:`abort`, which may also replace a published Success that :meth:`poll` has not yet
    returned (then the room reads Failed for good). Every other thread reads it with one
    load, so a terminal status is never seen without its failure. ``_delivered`` becomes
    True once, under the same lock, when :meth:`poll` returns a Success; after that nothing
    replaces it. ``_inner`` (the trio handle) is written once, by the trio thread, before the
    hop that made it returns. ``_reported`` (trio thread only) becomes True once, when the
    room is handed to ``pop_released``.
    """

    #: what poll() says before the trio handle reports anything further
    _START = KVPoll.Bootstrapping

    def __init__(self, facade: _Agent[Any], room: int) -> None:
        self._facade = facade
        self.room = room
        self._final: tuple[KVPoll, TransferError | None] | None = None
        self._final_lock = threading.Lock()
        #: poll() has returned Success (a receiver's pages are then the scheduler's)
        self._delivered = False
        self._inner: PrefillSender | DecodeReceiver | None = None
        #: the furthest non-terminal status poll() has reported (poll never moves back)
        self._floor = self._START
        self._floor_lock = threading.Lock()
        # trio thread only:
        self._released = False
        self._reported = False
        self._given = False  # pages were handed to trio_pd (decode: by init)
        #: an abort that came before the room was created (its creation then aborts it)
        self._abort_reason: str | None = None

    def poll(self) -> KVPoll:
        """The room's status: a :class:`~trio_pd.KVPoll`. Terminal ones (Success, Failed)
        never change again; the others only move forward.

        Any thread; never blocks and never waits for the trio thread: it reads what the trio
        thread published (one load each). A terminal status shows once the trio thread has
        published it with its failure, a loop iteration after the room ended.
        """
        final = self._final
        if final is not None:
            if final[0] is KVPoll.Success and not self._delivered:
                with self._final_lock:  # (against an abort withdrawing it meanwhile)
                    final = self._final
                    assert final is not None
                    self._delivered = final[0] is KVPoll.Success
            return final[0]
        inner = self._inner
        with self._floor_lock:  # (two threads polling must not lower it: read and raise as one)
            floor = self._floor
            live = inner._status() if inner is not None else floor
            if live in _TERMINAL or live < floor:
                return floor  # (terminal, not yet published with its failure)
            self._floor = live
            return live

    @property
    def failure(self) -> TransferError | None:
        """Why the room failed: None unless :meth:`poll` is Failed. Any thread; never
        blocks."""
        final = self._final
        return final[1] if final is not None else None

    def failure_exception(self) -> None:
        """Raise the room's failure (a :class:`~trio_pd.TransferError`) if :meth:`poll` is
        Failed; else return None. SGLang's scheduler calls it to log why a request failed.

        Any thread; never blocks.
        """
        error = self.failure
        if error is not None:
            raise error.with_traceback(None)

    def abort(self, reason: str = "aborted by the scheduler") -> None:
        """Abort the room, as the trio handle's ``abort``. Idempotent. (Each side says what
        it means for a room that has already ended: :meth:`SyncSender.abort`,
        :meth:`SyncReceiver.abort`.)

        Any thread, the trio thread included; never blocks: the abort is posted to the trio
        thread. Raises nothing (after the facade closed it does nothing: closing failed
        every open room).
        """
        self._facade._thread.post(self._facade._abort, self, reason)



class SyncSender(_Handle):
    """The prefill scheduler's handle for one room (≈ SGLang's ``KVSender``). Make it with
    :meth:`SyncPrefill.sender`; then :meth:`init`, :meth:`send` the chunks, :meth:`poll`.

    trio_pd takes chunks before decode's metadata has arrived (they wait for it, up to
    ``PrefillConfig.bootstrap_timeout``), so a sender is WaitingForInput from the start: a
    scheduler that waits for WaitingForInput before ``init`` (SGLang's bootstrap queue) goes
    on at once. The source pages of the chunks sent belong to trio_pd until the room comes
    out of :meth:`SyncPrefill.pop_released`.

    One thread at a time calls :meth:`init` and :meth:`send` (the scheduler's);
    :meth:`poll`, :meth:`abort` and the rest may come from any thread.

    ``with sender:`` holds the room for the block: leaving it before the room ended aborts
    the room, however the block ends. :meth:`abort` on a room that has ended changes
    nothing: the pages come out of :meth:`SyncPrefill.pop_released` after Success or
    failure alike.
    """

    _START = KVPoll.WaitingForInput

    def __init__(self, facade: SyncPrefill, room: int, epoch: int | None) -> None:
        super().__init__(facade, room)
        self._prefill = facade
        self._epoch = epoch
        self._lock = threading.Lock()  # the scheduler-side book below
        self._num_pages: int | None = None
        #: the pages (and layers) sent so far: the agent's own rule, checked here
        self._intake: RequestPages | None = None

    def init(self, num_pages: int, aux_slot: int) -> None:
        """Create the room on the prefill rank: ``num_pages`` source pages will come in
        chunks, and aux row ``aux_slot`` with the last one.

        The scheduler's thread, not the trio thread (RuntimeError there). Never blocks when
        the room id is free (the room is created on the trio thread, before anything this
        thread hands over after it); while this rank still holds a room with that id, or
        one is being created, it blocks for one hop, at most the facade's ``call_timeout``
        (then :class:`~trio_pd.TransferTimeout`, and nothing was created), to answer
        exactly. Raises :class:`~trio_pd.ProtocolError` for an aux slot outside the pool or
        a second init, ValueError for a ``num_pages`` below 0 or past 2**30,
        :class:`~trio_pd.TransferError` while the room id is still in use on this rank (or
        if the agent stopped on an error), RuntimeError once the facade is closed.
        """
        p = self._prefill
        p._thread.check_may_block("SyncSender.init")
        room = as_index(self.room, "room")
        aux_slot = check_aux_slot(aux_slot, p._pool.aux_slots)
        num_pages = check_num_pages(num_pages)
        with self._lock:
            if self._num_pages is not None:
                raise ProtocolError(f"room {self.room}: init called twice")
            if p._claim(room):
                p._create(p._init, self, num_pages, aux_slot)
            else:  # in use, or on its way to be: the trio thread answers (TransferError)
                p._call(p._init, self, num_pages, aux_slot)
            self._num_pages = num_pages
            self._intake = RequestPages(room, num_pages, p._pool.num_layers)

    def send(
        self, pages: npt.ArrayLike, *, layers: range | None = None, last: bool = False,
        state_slots: Sequence[npt.ArrayLike] | None = None,
    ) -> None:
        """Hand the next chunk over: ``pages`` are source page ids, in request order; the
        one with ``last=True`` ends at ``num_pages`` and carries the aux row, and the
        request's ``state_slots`` (one list per state component of the pool, see
        :meth:`PrefillSender.send <trio_pd.PrefillSender.send>`). The ids are copied: the
        array may be reused at once.

        ``layers``: ``range(a, b)``, only those layers of ``pages`` are ready (layer-wise
        streaming, as :meth:`PrefillSender.send <trio_pd.PrefillSender.send>`: each layer
        of a page once, the last send completes every layer of every page).

        The scheduler's thread (the trio thread works too). Never blocks: the chunk is
        posted to the trio thread. Raises :class:`~trio_pd.ProtocolError`, checked here, for
        a send before :meth:`init`, page ids outside the pool or repeated, a chunk past
        ``num_pages``, a last chunk that does not end there (or, layer-wise, leaves a layer
        of a page unsent), one after the last, a layer of a page sent twice, and state slots
        that do not fit the pool's components or come before the last chunk. A chunk
        for a room that failed or was aborted meanwhile is dropped (its pages are not
        trio_pd's); :meth:`poll` says Failed.
        """
        pool = self._prefill._pool
        ids = pool_page_ids(pages, pool.num_pages)  # (a copy)
        span = layer_range(layers)
        slots = None
        if state_slots is not None or (last and pool.states):
            if not last:
                raise ProtocolError(f"room {self.room}: state slots go with the last chunk")
            slots = check_state_slots(
                [st.slots for st in pool.states], () if state_slots is None else state_slots,
                "source",
            )
        with self._lock:
            intake = self._intake
            if intake is None:
                raise ProtocolError(f"room {self.room}: send before init")
            try:
                start, span = intake.check(ids, last, span)
            except ProtocolError:  # (counted where the agent's counters live)
                self._prefill._thread.post(self._prefill.agent.counters.bump, "sends_refused")
                raise
            intake.advance(start, ids, last, span)
            self._prefill._thread.post(
                self._prefill._send, self, ids, last, slots, None if span is None else layers
            )

    def _leave(self, why: str) -> None:
        if self.poll() not in _TERMINAL:
            self.abort(f"the room's with block was left before the room ended{why}")


class SyncReceiver(_Handle):
    """The decode scheduler's handle for one room (≈ SGLang's ``KVReceiver``). Make it with
    :meth:`SyncDecode.receiver`; then :meth:`init` (alias :meth:`send_metadata`) once the
    pages are allocated, and :meth:`poll`.

    The pages given to :meth:`init` are trio_pd's until :meth:`poll` returns Success (then
    they hold the KV and are the scheduler's) or the room comes out of
    :meth:`SyncDecode.pop_released` (after a failure, when no prefill rank can still write
    them; or after :meth:`abort` of a room whose Success :meth:`poll` had not yet returned),
    exactly one of the two. One thread at a time calls :meth:`init`.

    ``with receiver:`` holds the room for the block: leaving it before :meth:`poll` returned
    Success aborts the room, however the block ends, and the pages come out of
    ``pop_released``.
    """

    def __init__(self, facade: SyncDecode, room: int, epoch: int) -> None:
        super().__init__(facade, room)
        self._decode = facade
        self._epoch = epoch
        self._init_lock = threading.Lock()
        self._inited = False

    @property
    def epoch(self) -> int:
        """The room's epoch (given to :meth:`SyncDecode.receiver`, or the one it drew)."""
        return self._epoch

    def init(
        self, pages: npt.ArrayLike, aux_slot: int, *, prefix_pages: int = 0,
        state_slots: Sequence[npt.ArrayLike] = (),
    ) -> None:
        """Ask the prefill ranks for the room's KV into ``pages`` (destination page ids) and
        aux row ``aux_slot``. From here the pages are trio_pd's until Success, or until the
        room comes out of :meth:`SyncDecode.pop_released`. The ids are copied.
        ``prefix_pages``: this rank holds the request's first pages already; ``pages`` are
        for the ones after them; ``state_slots``: the request's slots of each state
        component of the pool, held and given back with the pages
        (:meth:`DecodeReceiver.init <trio_pd.DecodeReceiver.init>`).

        The scheduler's thread (the trio thread works too). Never blocks: posted to the
        trio thread. Raises :class:`~trio_pd.ProtocolError`, checked here, for page ids
        outside the pool or repeated, an aux slot outside it, state slots that do not fit
        the pool's components, or a second init. A room that
        failed before its init runs gets its pages back at once (through pop_released), as
        does one whose facade has closed.
        """
        pool = self._decode._pool
        ids = pool_page_ids(pages, pool.num_pages)  # (a copy)
        aux_slot = check_aux_slot(aux_slot, pool.aux_slots)
        slots = check_state_slots([st.slots for st in pool.states], state_slots, "destination")
        prefix = check_prefix_pages(prefix_pages)  # (every check before the room is inited)
        with self._init_lock:
            if self._inited:
                raise ProtocolError(f"room {self.room}: init called twice")
            self._inited = True
        if not self._decode._thread.post(
            self._decode._init, self, ids, aux_slot, prefix, slots
        ):
            self._decode._released.append(self.room)  # never reached trio_pd: free already

    send_metadata = init

    def abort(self, reason: str = "aborted by the scheduler") -> None:
        """Give the room up, decided by this call: unless :meth:`poll` has returned Success
        already (then it does nothing: the pages are the scheduler's), the room reads
        Failed from now on, whatever the trio thread does next, and a room given pages by
        :meth:`init` comes out of :meth:`SyncDecode.pop_released` exactly once: after its
        drain, or at once if it had succeeded without :meth:`poll` saying so.

        Any thread, the trio thread included; never blocks (the rest is posted to the trio
        thread). Raises nothing. Idempotent. Once the trio thread has ended it changes
        nothing: what the room published stands.
        """
        with self._final_lock:
            if self._delivered:
                return
            before = self._final
            if before is None or before[0] is KVPoll.Success:
                self._final = (KVPoll.Failed, TransferAborted(reason))
            if not self._facade._thread.post(self._facade._abort, self, reason):
                self._final = before  # nobody is left to hand the pages back: nothing changes

    def _leave(self, why: str) -> None:
        if not self._delivered:
            self.abort(f"the room's with block was left before Success was delivered{why}")


# ---------------------------------------------------------------------------------- agents


class _Agent(ClosesOnExit, Generic[AG]):
    """What the prefill and decode facades share: the host, the trio thread, the book of
    rooms and the queue of released ones."""

    _what = "agent"
    #: a room that succeeded is over for pop_released (decode: its pages are the caller's)
    _success_frees_nothing = False

    def __init__(
        self,
        thread: TrioThread,
        owned: bool,
        pool: PoolSpec,
        opener: Callable[[], AbstractAsyncContextManager[AG]],
        *,
        start_timeout: float,
        call_timeout: float,
        close_bound: float,
    ) -> None:
        self._thread, self._owned, self._pool = thread, owned, pool
        self._call_timeout, self._close_bound = call_timeout, close_bound
        #: rooms whose pages are free again, oldest first; the trio thread appends, any
        #: thread pops (deque appends and pops are atomic)
        self._released: collections.deque[int] = collections.deque()
        # trio thread only:
        #: handles whose room trio_pd may still report on (an ordered set)
        self._live: dict[_Handle, None] = {}
        self._closing = False
        self._final_stats: AgentStatistics | None = None
        self._close_lock = threading.Lock()
        self._closed = False
        #: room ids whose creation was handed to the trio thread and has not run yet
        self._claims: set[int] = set()
        self._claims_lock = threading.Lock()
        self._host: _Host[AG] = _Host(thread, self._what, opener, self._stopped)
        #: the trio agent: for code on the trio thread only
        self.agent: AG = self._host.start(start_timeout)

    # -------------------------------------------------------------- from the scheduler

    def pop_released(self) -> list[int]:
        """The rooms whose pages are free again since the last call, each room exactly once
        over the facade's life: the scheduler frees their pages on its own thread. Call it
        once per scheduler step. (What "free" means per side: see the subclass.)

        Any thread; never blocks. Works after :meth:`close` too: the last call returns what
        the close released.
        """
        if not self._released:
            return []
        out: list[int] = []
        popleft = self._released.popleft
        try:
            while True:
                out.append(popleft())
        except IndexError:
            return out

    def statistics(self) -> AgentStatistics:
        """The agent's counters (:class:`~trio_pd.AgentStatistics`); once the agent has
        closed (or stopped on an error), those it ended with.

        Any thread but the trio thread (RuntimeError there). Blocks for one hop (at most
        ``call_timeout``, then :class:`~trio_pd.TransferTimeout`); once closed, not at all.
        """
        if self._host.done.is_set():
            assert self._final_stats is not None
            return self._final_stats
        return self._call(self._statistics)

    def close(self) -> None:
        """Close the agent under its trio rules, then the trio thread if this facade started
        it. Rooms still open fail; what their release rules then allow comes out of the next
        :meth:`pop_released`. Idempotent; also what leaving the ``with`` block does.

        Any thread but the trio thread (RuntimeError there). Blocks until the agent has
        closed: at most the ``close_timeout`` given to ``open_*`` (by default the agent's own
        bound plus a margin), then :class:`~trio_pd.TransferTimeout` (the close goes on, on
        the trio thread).
        """
        self._thread.check_may_block(f"{self._what} close")
        with self._close_lock:
            self._closed = True
            self._host.close(self._close_bound)
            if self._owned:
                self._thread.close(self._close_bound)

    @property
    def thread(self) -> TrioThread:
        """The trio thread the agent runs on. Any thread; never blocks."""
        return self._thread

    # -------------------------------------------------------------- the way across

    def _check_open(self) -> None:
        if self._host.error is not None:
            raise TransferError(f"the {self._what} stopped: {self._host.error!r}")
        if self._closed or self._host.done.is_set():
            raise _closed(f"the {self._what}")

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        self._check_open()
        return self._thread.call(fn, *args, timeout=self._call_timeout)

    def _claim(self, room: int) -> bool:
        """On the caller's thread: True if no room with this id is held by the agent or on
        its way to it through this facade; the id is then this caller's until the trio
        thread has run the creation (:meth:`_create`). False: the trio thread must answer.

        Exact for the rooms made through this facade: the trio thread adds a room to the
        agent's table (read here with one load) before it drops the claim, and the two are
        read here under the lock that dropping takes."""
        with self._claims_lock:
            if room in self._claims or room in self.agent._rooms:
                return False
            self._claims.add(room)
            return True

    def _create(self, fn: Callable[..., object], h: _Handle, *args: Any) -> None:
        """Hand the creation of ``h``'s room (``fn(h, *args)``, which raises what the agent
        refuses) to the trio thread without waiting: the calls handed over after it find the
        room made. Raises what :meth:`_call` raises for a facade that is closed."""
        try:
            self._check_open()
            posted = self._thread.post(self._made, fn, h, args)
        except BaseException:
            self._unclaim(h.room)
            raise
        if not posted:
            self._unclaim(h.room)
            raise _closed("the trio thread")

    def _unclaim(self, room: int) -> None:
        with self._claims_lock:
            self._claims.discard(room)

    def _made(self, fn: Callable[..., object], h: _Handle, args: tuple[Any, ...]) -> None:
        """On the trio thread: run a creation the caller did not wait for. One the agent
        refuses all the same (a room made meanwhile by trio-side code with that id, or the
        facade closing, raced the caller's check) fails the room with the reason, as if it
        had failed at once: :meth:`~_Handle.poll` says Failed; what is handed over for it
        later is dropped or handed back."""
        try:
            fn(h, *args)
        except Exception as exc:
            error = exc if isinstance(exc, TransferError) else TransferAborted(
                f"{self._what}: the room could not be created: {exc}"
            )
            with h._final_lock:
                if h._final is None:
                    h._final = (KVPoll.Failed, error)
            if isinstance(h, SyncSender):  # (its init ran: pop_released reports it)
                h._given = h._released = True
            self._settle(h)
        finally:
            self._unclaim(h.room)

    # -------------------------------------------------------------- on the trio thread

    def _statistics(self) -> AgentStatistics:
        return self.agent.statistics()

    def _admit(self) -> None:
        """Refuse new rooms once the facade is closing (a hop made before close ran first)."""
        if self._closing or self._host.stop.is_set() or self._host.tasks is None:
            raise _closed(f"the {self._what}")

    def _track(self, h: _Handle) -> None:
        self._live[h] = None
        inner = h._inner
        assert inner is not None
        # (a hook, not a task per room: the room's end is published in the step that ends it)
        inner._when_ended(partial(self._finish, h))

    def _finish(self, h: _Handle) -> None:
        """Publish the room's terminal status and failure, as one tuple (unless an abort
        published its own first)."""
        inner = h._inner
        if h._final is None and inner is not None and inner._status() in _TERMINAL:
            with h._final_lock:
                if h._final is None:
                    h._final = (inner._status(), inner.failure)
        self._settle(h)

    def _on_release(self, h: _Handle) -> None:
        """The trio handle's ``on_release``: the room's pages are free again."""
        h._released = True
        self._finish(h)

    def _settle(self, h: _Handle) -> None:
        """Hand the room to pop_released once it is terminal (published) and released;
        forget it once nothing more can be reported."""
        if h._final is None or h._reported:
            return
        if h._released:
            h._reported = True
            self._released.append(h.room)
            self._live.pop(h, None)
        elif self._success_frees_nothing and (h._final[0] is KVPoll.Success or not h._given):
            # decode: the pages are the caller's, or none were handed over yet (an init
            # that comes later releases them through _on_release, which still reports)
            self._live.pop(h, None)

    def _abort(self, h: _Handle, reason: str) -> None:
        inner = h._inner
        if inner is not None:
            inner.abort(reason)
            self._finish(h)
            return
        h._abort_reason = reason  # (its creation is still on its way: it aborts the room)
        with h._final_lock:
            if h._final is None:
                h._final = (KVPoll.Failed, TransferAborted(reason))

    def _stopped(self, error: BaseException | None) -> None:
        """The agent has closed (or stopped with ``error``): publish what every room still
        tracked ended as, and keep the last statistics."""
        self._closing = True
        if error is None:
            gone: TransferError = TransferAborted(f"{self._what} closed")
        else:
            gone = TransferError(f"{self._what} stopped: {error!r}")
        for h in list(self._live):
            inner = h._inner
            with h._final_lock:
                if h._final is None:
                    if inner is not None and inner._status() in _TERMINAL:
                        h._final = (inner._status(), inner.failure)
                    else:
                        h._final = (KVPoll.Failed, gone)
            self._settle(h)
        self._final_stats = self._statistics()


class SyncPrefill(_Agent[PrefillAgent]):
    """A prefill rank for a thread-based scheduler. Make it with :func:`open_prefill`.

    :meth:`pop_released` returns every room whose :meth:`SyncSender.init` ran, exactly once,
    when its source pages may be reused (Success or failure: no engine call can still read
    them).
    """

    _what = "prefill agent"

    @property
    def endpoint(self) -> str:
        """The rank's control endpoint (ZeroMQ). Any thread; never blocks."""
        return self.agent.endpoint

    def sender(self, room: int, *, epoch: int | None = None) -> SyncSender:
        """A handle for ``room``; nothing reaches the agent before :meth:`SyncSender.init`.
        ``epoch`` as for :meth:`trio_pd.PrefillAgent.sender`: pass the router's epoch, the
        one decode's receiver got, when you know it.

        Any thread; never blocks; raises nothing.
        """
        return SyncSender(self, room, epoch)

    def _init(self, h: SyncSender, num_pages: int, aux_slot: int) -> None:
        self._admit()
        inner = self.agent.sender(
            h.room, num_pages=num_pages, aux_slot=aux_slot, epoch=h._epoch,
            on_release=partial(self._on_release, h),
        )
        h._inner = inner
        h._given = True
        self._track(h)
        if h._abort_reason is not None:
            inner.abort(h._abort_reason)
        self._finish(h)

    def _send(
        self, h: SyncSender, pages: npt.NDArray[np.int64], last: bool,
        state_slots: tuple[npt.NDArray[np.int64], ...] | None = None,
        layers: range | None = None,
    ) -> None:
        inner = h._inner
        if inner is None:
            return  # its creation was refused: the room failed; the pages never became ours
        assert isinstance(inner, PrefillSender)
        try:
            inner.send(pages, layers=layers, last=last, state_slots=state_slots)
        except AdmissionClosed:
            pass  # failed or aborted meanwhile: the chunk's pages never became trio_pd's
        except TransferError as exc:  # (checked on the scheduler's side: not expected)
            inner.abort(f"trio_pd.sync: a chunk was refused: {exc}")
            self._finish(h)


class SyncDecode(_Agent[DecodeAgent]):
    """A decode rank for a thread-based scheduler. Make it with :func:`open_decode`.

    :meth:`pop_released` returns a room given pages by :meth:`SyncReceiver.init` that
    failed (or was aborted), exactly once, when no prefill rank can still write its pages.
    A room that succeeded is not returned: its pages hold the KV and are the scheduler's
    from Success on. A room still unproven when the agent closes is never returned
    (``statistics().rooms_unproven_at_close``): a write may still land in its pages.
    """

    _what = "decode agent"
    _success_frees_nothing = True

    @property
    def endpoint(self) -> str:
        """The rank's control endpoint (ZeroMQ). Any thread; never blocks."""
        return self.agent.endpoint

    def receiver(
        self, room: int, *, bootstrap_url: str, epoch: int | None = None,
        dp_rank: int | None = None,
    ) -> SyncReceiver:
        """Create the handle for ``room``, served by the prefill instance at
        ``bootstrap_url`` (as :meth:`trio_pd.DecodeAgent.receiver`; ``dp_rank``: the prefill
        DP rank that holds the room, when the router knows it).

        Any thread but the trio thread (RuntimeError there). Never blocks when the room id
        is free (the room is created on the trio thread, before anything handed over after
        it: ``init``, ``abort``); while this rank still holds a room with that id, or one is
        being created, it blocks for one hop, at most the facade's ``call_timeout`` (then
        :class:`~trio_pd.TransferTimeout`, and nothing was created), to answer exactly.
        Raises :class:`~trio_pd.TransferError` while the room id is still in use on this
        rank (or if the agent stopped on an error), :class:`~trio_pd.ConfigurationError`
        for a ``dp_rank`` that is not an int in ``[0, 1024)``, RuntimeError once the facade
        is closed.
        """
        self._thread.check_may_block("SyncDecode.receiver")
        room = as_index(room, "room")
        # the trio agent's own checks of the arguments, made here so that they raise here
        named = split_dp_url(bootstrap_url)[1] if "?" in bootstrap_url else None
        dp = named if dp_rank is None else dp_rank
        if dp is not None:
            check_dp(dp, MAX_DP_SIZE, f"decode rank {self.agent.tp_rank}: room {room}")
        if epoch is None:
            epoch = secrets.randbits(62)  # (drawn here, as the agent draws it)
        if not self._claim(room):  # in use, or on its way to be: the trio thread answers
            return self._call(self._receiver, room, bootstrap_url, epoch, dp_rank)
        h = SyncReceiver(self, room, epoch)
        self._create(self._make_receiver, h, bootstrap_url, dp_rank)
        return h

    def _receiver(
        self, room: int, bootstrap_url: str, epoch: int, dp_rank: int | None
    ) -> SyncReceiver:
        h = SyncReceiver(self, room, epoch)
        self._make_receiver(h, bootstrap_url, dp_rank)
        return h

    def _make_receiver(self, h: SyncReceiver, bootstrap_url: str, dp_rank: int | None) -> None:
        self._admit()
        inner = self.agent.receiver(
            h.room, bootstrap_url=bootstrap_url, epoch=h._epoch, dp_rank=dp_rank
        )
        h._inner = inner
        self._track(h)
        if h._abort_reason is not None:  # (aborted before it was made)
            inner.abort(h._abort_reason)
        self._finish(h)

    def _init(
        self, h: SyncReceiver, pages: npt.NDArray[np.int64], aux_slot: int, prefix_pages: int,
        state_slots: tuple[npt.NDArray[np.int64], ...] = (),
    ) -> None:
        inner = h._inner
        h._given = True
        if inner is None:  # its creation was refused: the room failed; the pages come back
            h._released = True
            self._settle(h)
            return
        assert isinstance(inner, DecodeReceiver)
        try:
            inner.init(
                pages, aux_slot, on_release=partial(self._on_release, h),
                prefix_pages=prefix_pages, state_slots=state_slots,
            )
        except TransferError as exc:  # (checked on the scheduler's side: not expected)
            inner.abort(f"trio_pd.sync: init was refused: {exc}")
            with h._final_lock:
                if h._final is None:
                    h._final = (KVPoll.Failed, exc)
            h._released = True  # the pages never became trio_pd's
        self._finish(h)


class SyncBootstrapServer(ClosesOnExit):
    """The bootstrap service on a trio thread. Make it with :func:`open_bootstrap_server`."""

    def __init__(
        self, thread: TrioThread, owned: bool, kwargs: dict[str, Any], start_timeout: float
    ) -> None:
        self._thread, self._owned = thread, owned
        self._host: _Host[BootstrapServer] = _Host(
            thread, "bootstrap server", partial(_open_bootstrap_server, **kwargs),
            lambda error: None,
        )
        self.server: BootstrapServer = self._host.start(start_timeout)
        #: the service's URL, for ``bootstrap_url=``
        self.url: str = self.server.url

    def close(self) -> None:
        """Stop the service (well under a second), then the trio thread if this facade
        started it. Idempotent. Any thread but the trio thread (RuntimeError there); blocks
        at most 10 s, then :class:`~trio_pd.TransferTimeout`."""
        self._host.close(10.0)
        if self._owned:
            self._thread.close(10.0)

# ---------------------------------------------------------------------------------- open_*


def _thread_for(thread: TrioThread | None, name: str) -> tuple[TrioThread, bool]:
    if thread is not None:
        return thread, False
    return TrioThread(name), True


def _started(thread: TrioThread, owned: bool, make: Callable[[], T]) -> T:
    """``make()``, closing the thread this call started if it fails."""
    try:
        return make()
    except BaseException:
        if owned:
            thread.close()
        raise


def open_bootstrap_server(
    *, thread: TrioThread | None = None, start_timeout: float = 30.0, **kwargs: Any
) -> SyncBootstrapServer:
    """Start :func:`trio_pd.open_bootstrap_server` (``kwargs`` are its arguments) on
    ``thread``, or on a trio thread of its own that closing stops.

    Any thread but a trio thread of ``thread`` (RuntimeError there). Blocks until the
    service accepts connections, at most ``start_timeout`` seconds (then
    :class:`~trio_pd.TransferTimeout`); raises what the service raises at start
    (:class:`~trio_pd.BootstrapError`...).
    """
    thread, owned = _thread_for(thread, "trio_pd-bootstrap")
    return _started(thread, owned, lambda: SyncBootstrapServer(thread, owned, kwargs,
                                                               start_timeout))


def open_prefill(
    *,
    engine: TransferEngine,
    pool: PoolSpec,
    bootstrap_url: str,
    thread: TrioThread | None = None,
    start_timeout: float = 60.0,
    call_timeout: float = 10.0,
    close_timeout: float | None = None,
    **kwargs: Any,
) -> SyncPrefill:
    """Start :func:`trio_pd.open_prefill` (``engine``, ``pool``, ``bootstrap_url`` and
    ``kwargs`` are its arguments) on ``thread``, or on a trio thread of its own that
    :meth:`SyncPrefill.close` stops. The engine and the pool's memory stay the caller's:
    close the engine after the facade.

    ``call_timeout`` bounds each blocking call of the facade; ``close_timeout`` its close
    (default: the engine's per-call deadline, which bounds the engine calls the close waits
    for, plus 15 s).

    Any thread but a trio thread of ``thread`` (RuntimeError there). Blocks until the agent
    is registered with the bootstrap service, at most ``start_timeout`` seconds (then
    :class:`~trio_pd.TransferTimeout`); raises what :func:`trio_pd.open_prefill` raises at
    start (:class:`~trio_pd.ConfigurationError`, :class:`~trio_pd.BootstrapError`...).
    """
    if close_timeout is None:
        close_timeout = float(getattr(engine, "write_deadline_s", 10.0)) + 15.0
    bound = close_timeout

    opener = partial(_open_prefill, engine=engine, pool=pool, bootstrap_url=bootstrap_url,
                     **kwargs)
    thread, owned = _thread_for(thread, "trio_pd-prefill")
    return _started(thread, owned, lambda: SyncPrefill(
        thread, owned, pool, opener, start_timeout=start_timeout, call_timeout=call_timeout,
        close_bound=bound,
    ))


def open_decode(
    *,
    engine: TransferEngine,
    pool: PoolSpec,
    thread: TrioThread | None = None,
    start_timeout: float = 60.0,
    call_timeout: float = 10.0,
    close_timeout: float | None = None,
    **kwargs: Any,
) -> SyncDecode:
    """Start :func:`trio_pd.open_decode` (``engine``, ``pool`` and ``kwargs`` are its
    arguments) on ``thread``, or on a trio thread of its own that :meth:`SyncDecode.close`
    stops. The engine and the pool's memory stay the caller's: close the engine after the
    facade (a room unproven at close may still be written: keep that memory alive).

    ``call_timeout`` bounds each blocking call of the facade; ``close_timeout`` its close
    (default: ``DecodeConfig.close_timeout``, how long the agent waits for the drains of
    the rooms it fails, plus 15 s for the rest of its shutdown).

    Any thread but a trio thread of ``thread`` (RuntimeError there). Blocks until the agent
    serves, at most ``start_timeout`` seconds (then :class:`~trio_pd.TransferTimeout`);
    raises what :func:`trio_pd.open_decode` raises at start.
    """
    if close_timeout is None:
        config = kwargs.get("config") or DecodeConfig()
        close_timeout = float(config.close_timeout) + 15.0
    bound = close_timeout

    opener = partial(_open_decode, engine=engine, pool=pool, **kwargs)
    thread, owned = _thread_for(thread, "trio_pd-decode")
    return _started(thread, owned, lambda: SyncDecode(
        thread, owned, pool, opener, start_timeout=start_timeout, call_timeout=call_timeout,
        close_bound=bound,
    ))
