"""Host trio_pd inside a running asyncio event loop, through trio's guest mode.

:func:`open_trio_host` starts a trio run as a *guest* of the asyncio loop that is running:
trio hands each of its ticks to the loop as a callback (``loop.call_soon_threadsafe``), so
trio code and asyncio code run on the loop's thread, taking turns; only trio's wait for I/O
sits in a thread of trio's own. The agents live in that trio run, and asyncio code reaches
them through the thin wrappers here (:class:`AioPrefill`, :class:`AioSender`,
:class:`AioDecode`, :class:`AioReceiver`).

The ways across, all owned by this module:

* asyncio -> trio, at once: asyncio code only runs between trio's ticks, so the room calls
  (making a room, ``send``, ``init``, ``abort``, the start of a task a ``wait`` awaits) are
  made right there, on the loop's thread (:meth:`TrioHost._now`): nothing crosses, and what
  they wake in trio asks the loop for trio's next tick. Their errors are raised at the call.
* asyncio -> trio, on the next tick: a callable handed to the run's
  ``TrioToken.run_sync_soon``, for code of the caller's (:meth:`TrioHost.call`,
  :meth:`TrioHost.start_soon`) and the host's own closing.
* trio -> asyncio: a task's ``outcome``, set on an asyncio future the asyncio side awaits
  (``None`` there: the call never finished, because it was cancelled or the host closed).

Reads that change nothing (``poll()``, ``failure``, ``statistics()``) are made directly: both
sides run on one thread, so a read sees the state trio's last tick left.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Any, Generic, Self, TypeVar, TypeVarTuple

import numpy.typing as npt
import outcome
import trio
import trio.lowlevel

from .agents._decode import DecodeAgent, DecodeReceiver, open_decode
from .agents._prefill import PrefillAgent, PrefillSender, open_prefill
from .bootstrap._bootstrap import BootstrapServer, open_bootstrap_server
from .core._closing import how_ended
from .core._errors import TransferError
from .core._state import KVPoll
from .core._stats import AgentStatistics

__all__ = [
    "AioDecode",
    "AioPrefill",
    "AioReceiver",
    "AioSender",
    "TrioHost",
    "open_trio_host",
]

log = logging.getLogger("trio_pd.aio")

T = TypeVar("T")
Ts = TypeVarTuple("Ts")
H = TypeVar("H", PrefillSender, DecodeReceiver)
_A = TypeVar("_A", PrefillAgent, DecodeAgent)

#: the message of the RuntimeError a call raises once the trio run is over (or ending)
CLOSED = "the trio host is closed"

#: what trio owes the asyncio side for one call: its outcome, or None if it never finished
_Done = asyncio.Future[outcome.Outcome[T] | None]


@dataclass(eq=False, slots=True)
class _Call(Generic[T]):
    """One trio task started for the asyncio side."""

    #: set once, when the task is over: its outcome, or None if it was cancelled (by the
    #: asyncio side giving up, or by the host closing)
    done: _Done[T]
    #: the task runs inside it; cancelled when the asyncio task awaiting it is cancelled
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class TrioHost:
    """The asyncio side's handle on one trio guest run. Make one with :func:`open_trio_host`.

    Every method is for asyncio code on the loop that runs the host; none blocks the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        #: the run's token, set as soon as the guest run exists; its ``run_sync_soon`` is the
        #: only way into trio
        self._token: trio.lowlevel.TrioToken | None = None
        #: where the tasks the asyncio side starts run; None before the run's main task has
        #: opened it and once it has closed
        self._nursery: trio.Nursery | None = None
        #: set (inside trio) when the host closes: the main task then cancels the nursery
        self._stop = trio.Event()
        #: futures trio still owes an outcome; the run's end settles those left with None
        self._pending: set[_Done[Any]] = set()
        #: the trio run's own context (its main task's, copied): what a call made between
        #: trio's ticks (:meth:`_now`) runs in. None before the run's main task started
        self._context: contextvars.Context | None = None
        #: the trio run has ended (its done callback ran)
        self._over = False

    # ------------------------------------------------------------------ the way across

    def _future(self) -> _Done[T]:
        fut: _Done[T] = self._loop.create_future()
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    def _soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` inside trio on its next tick. Raises RuntimeError if the run is over.

        An exception out of a ``run_sync_soon`` callback would crash trio itself
        (``TrioInternalError``), so ``fn``'s is logged instead: callers that want it back
        catch it in ``fn`` and hand it over in a future.
        """
        if self._token is None:
            raise RuntimeError(CLOSED)
        try:
            self._token.run_sync_soon(_logged, fn)
        except trio.RunFinishedError:
            raise RuntimeError(CLOSED) from None

    def _now(self, fn: Callable[[], T]) -> T:
        """Call the synchronous trio-side ``fn()`` at once, between trio's ticks, and return
        its result or raise its exception here. Raises RuntimeError if the run is over.

        Both loops run on this one thread, taking turns, and asyncio code only runs between
        trio's ticks: trio's run state is then at rest, and a call that wakes a trio task
        (``Event.set``, a channel's ``send_nowait``, ``nursery.start_soon``, a cancel)
        reschedules it, which in guest mode also asks the loop for trio's next tick. So
        nothing crosses for the call: no round trip, no wake-up of trio's I/O thread unless
        trio was idle. ``fn`` runs outside any trio task, in a copy of the run's own
        context: it must not await, checkpoint or ask for the current task (the agents'
        handle methods do none of these).
        """
        if self._over or self._context is None:
            raise RuntimeError(CLOSED)
        return self._context.copy().run(fn)

    def _submit(self, fn: Callable[[], T]) -> _Done[T]:
        """Call ``fn()`` inside trio; its outcome lands in the returned future. If the future
        is cancelled before trio gets to it, ``fn`` is not called."""
        fut: _Done[T] = self._future()

        def call() -> None:
            if fut.done():
                return  # the asyncio side gave up before trio got here
            try:
                result: outcome.Outcome[T] = outcome.Value(fn())
            except Exception as exc:
                result = outcome.Error(exc)
            fut.set_result(result)

        self._soon(call)
        return fut

    def _start(self, async_fn: Callable[[*Ts], Awaitable[T]], *args: *Ts) -> _Call[T]:
        """Start ``async_fn(*args)`` as a task of the host's nursery, inside a cancel scope of
        its own; the returned call's ``done`` gets its outcome."""
        call: _Call[T] = _Call(self._future())

        def start() -> None:
            if self._nursery is None:
                _settle(call.done, None)  # closed: it will never run
            else:
                self._nursery.start_soon(_task, call, partial(async_fn, *args))

        self._now(start)
        return call

    def _cancel(self, call: _Call[Any], reason: str) -> None:
        with contextlib.suppress(RuntimeError):  # the run is over: so is the task
            self._now(partial(call.scope.cancel, reason))

    async def _wait(self, call: _Call[Any], *also: asyncio.Future[Any]) -> None:
        """Wait until the trio task is over, or until one of ``also`` is done.

        **Cancellation:** cancels the trio task, waits until it is over (trio decides how
        long: its shielded cleanup runs whole), then re-raises CancelledError, or an
        exception the task raised meanwhile instead (an error is not dropped for a cancel).
        """
        try:
            await asyncio.wait((call.done, *also), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._cancel(call, "the asyncio task awaiting it was cancelled")
            await _outlast_cancellation(call.done)
            result = call.done.result()
            if isinstance(result, outcome.Error):
                result.unwrap()
            raise

    # ------------------------------------------------------------------ public API

    async def call(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """Call the synchronous trio-side function ``fn(*args)`` inside the trio run (on its
        next tick) and return its result, or raise its exception. Use ``functools.partial``
        for keyword arguments.

        Raises RuntimeError if the host is closed (``fn`` did not run).

        **Cancellation:** once called, ``fn`` runs whole: a cancelled await waits until
        trio has run it (its next tick), then raises CancelledError, or ``fn``'s own
        exception if it raised one. So CancelledError means ``fn`` ran and returned (its
        result is dropped); any other exception means what it means without a cancel.
        """
        return await _whole(self._submit(partial(fn, *args)))

    async def run(self, async_fn: Callable[[*Ts], Awaitable[T]], *args: *Ts) -> T:
        """Run ``async_fn(*args)`` as a task of the trio run and return its result, or raise
        its exception (as it is, not in a group).

        Raises RuntimeError if the host is closed, or closes before the task finished.

        **Cancellation:** cancelling the awaiting asyncio task cancels the trio task and
        waits for it to finish; then CancelledError propagates (or the exception the trio
        task raised while it was being cancelled).
        """
        call = self._start(async_fn, *args)
        await self._wait(call)
        return _unwrap(call.done.result())

    def start_soon(self, async_fn: Callable[[*Ts], Awaitable[object]], *args: *Ts) -> None:
        """Start ``async_fn(*args)`` as a background task of the trio run, like
        ``nursery.start_soon``. It is cancelled when the host closes. An exception out of it
        ends the host as one out of a nursery child would: every other trio task is
        cancelled, calls in flight raise RuntimeError, and the host's ``async with`` raises
        the ExceptionGroup.

        Raises RuntimeError if the host is closed.
        """

        def start() -> None:
            if self._nursery is None:
                log.warning("the trio host is closing: %r not started", async_fn)
            else:
                self._nursery.start_soon(partial(async_fn, *args))

        self._soon(start)

    @asynccontextmanager
    async def open(self, cm: AbstractAsyncContextManager[T]) -> AsyncIterator[T]:
        """Enter the trio async context manager ``cm`` in a task of the trio run and yield
        what it yields; leaving the block exits ``cm`` in that task and waits until it has.

        ``cm`` may be made on the asyncio side (``trio_pd.open_prefill(...)``: calling an
        ``open_*`` function runs none of its code). An exception raised entering or exiting
        it comes out here; one raised in the ``async with`` body on the asyncio side is not
        thrown into ``cm``, which exits as on a normal exit.

        **Cancellation:** cancelled while entering, the trio task is cancelled and waited
        for (see :meth:`run`). Leaving the block always waits until ``cm`` has exited; if the
        waiting task is cancelled meanwhile, the trio task is cancelled (``cm``'s shielded
        cleanup still runs whole, as in trio), and CancelledError follows.
        """
        entered: asyncio.Future[T] = self._loop.create_future()
        leave = trio.Event()
        call = self._start(_hold, cm, entered, leave)
        await self._wait(call, entered)
        if not entered.done():  # the task ended before cm yielded: it raised, or host closed
            _unwrap(call.done.result())
            raise RuntimeError(f"{cm!r} did not yield")
        try:
            yield entered.result()
        finally:
            with contextlib.suppress(RuntimeError):  # the run is over: so is the task
                self._soon(leave.set)
            await self._wait(call)
            _unwrap(call.done.result())

    @asynccontextmanager
    async def open_bootstrap_server(self, **kwargs: Any) -> AsyncIterator[BootstrapServer]:
        """:func:`trio_pd.open_bootstrap_server` (same arguments) in the trio run. Read
        ``url`` (and the server's statistics) directly."""
        async with self.open(open_bootstrap_server(**kwargs)) as server:
            yield server

    @asynccontextmanager
    async def open_prefill(self, **kwargs: Any) -> AsyncIterator[AioPrefill]:
        """:func:`trio_pd.open_prefill` (same arguments) in the trio run, as an
        :class:`AioPrefill`. Closing it closes the agent as in trio, and waits for that."""
        async with self.open(open_prefill(**kwargs)) as agent:
            yield AioPrefill(self, agent)

    @asynccontextmanager
    async def open_decode(self, **kwargs: Any) -> AsyncIterator[AioDecode]:
        """:func:`trio_pd.open_decode` (same arguments) in the trio run, as an
        :class:`AioDecode`. Closing it waits, as in trio, for the drain of the rooms it fails
        (at most ``DecodeConfig.close_timeout``)."""
        async with self.open(open_decode(**kwargs)) as agent:
            yield AioDecode(self, agent)


@asynccontextmanager
async def open_trio_host(
    *, close_timeout: float = 30.0, host_uses_signal_set_wakeup_fd: bool = True
) -> AsyncIterator[TrioHost]:
    """Start a trio guest run on the running asyncio loop, for the duration of the block.

    On exit the run's nursery is cancelled (tasks started with :meth:`TrioHost.start_soon`,
    and anything still open; close what you opened first) and the exit waits until the
    trio run has ended, for at most ``close_timeout`` seconds. Then it raises what
    ``trio.run`` would have: the ExceptionGroup of a failed background task, say (it wins
    over an exception from the block, which becomes its ``__context__``).
    If the run has not ended by then, TimeoutError: trio still runs on the loop, which must
    keep running until it ends.

    ``host_uses_signal_set_wakeup_fd`` is passed to ``trio.lowlevel.start_guest_run``:
    True (the default) leaves ``signal.set_wakeup_fd`` to asyncio, which needs it for
    ``loop.add_signal_handler``; trio_pd's tasks do not wait for signals.

    Only one trio run may exist on a thread at a time: a second host raises RuntimeError.

    **Cancellation:** the exit's wait for the trio run outlasts cancellation of the
    awaiting task (up to ``close_timeout``): stopping the loop before trio's run has ended
    would leave trio half-run. CancelledError follows once it has.
    """
    loop = asyncio.get_running_loop()
    host = TrioHost(loop)
    started: asyncio.Future[None] = loop.create_future()
    done: asyncio.Future[outcome.Outcome[None]] = loop.create_future()

    def run_ended(result: outcome.Outcome[None]) -> None:
        host._over = True
        for fut in list(host._pending):
            _settle(fut, None)
        _settle(done, result)

    trio.lowlevel.start_guest_run(
        _main,
        host,
        started,
        run_sync_soon_threadsafe=loop.call_soon_threadsafe,
        run_sync_soon_not_threadsafe=loop.call_soon,
        done_callback=run_ended,
        host_uses_signal_set_wakeup_fd=host_uses_signal_set_wakeup_fd,
    )
    host._token = trio.lowlevel.current_trio_token()  # (callable once the guest run exists)
    try:
        await asyncio.wait((started, done), return_when=asyncio.FIRST_COMPLETED)
        if started.done():
            yield host
    finally:
        with contextlib.suppress(RuntimeError):  # the run is already over
            host._soon(host._stop.set)
        cancelled = await _outlast_cancellation(done, loop.time() + close_timeout)
        if not done.done():
            raise TimeoutError(
                f"the trio run did not end within {close_timeout} s of closing its host; "
                "it still runs on this asyncio loop, which must keep running until it ends"
            )
        done.result().unwrap()
        if cancelled:
            raise asyncio.CancelledError


async def _main(host: TrioHost, started: asyncio.Future[None]) -> None:
    """The guest run's main task: the nursery the asyncio side's tasks run in."""
    host._context = contextvars.copy_context()
    try:
        async with trio.open_nursery() as nursery:
            host._nursery = nursery
            _settle(started, None)
            await host._stop.wait()
            nursery.cancel_scope.cancel("the trio host is closing")
    finally:
        host._nursery = None


async def _task(  # noqa: ASYNC910 - a task's end; the error path is async_fn's own
    call: _Call[T], async_fn: Callable[[], Awaitable[T]]
) -> None:
    """Run one call and hand its outcome over. Its own exception goes to the asyncio side,
    not to the host's nursery; a Cancelled (the call's scope, or the host closing) leaves
    the outcome None, and the latter goes on up."""
    result: outcome.Outcome[T] | None = None
    try:
        with call.scope:
            result = outcome.Value(await async_fn())
    except Exception as exc:
        result = outcome.Error(exc)
    finally:
        _settle(call.done, result)


async def _hold(
    cm: AbstractAsyncContextManager[T], entered: asyncio.Future[T], leave: trio.Event
) -> None:
    """Keep ``cm`` entered, in this one trio task, until ``leave`` is set."""
    async with cm as value:
        _settle(entered, value)
        await leave.wait()


async def _whole(fut: _Done[T]) -> T:
    """The result of a synchronous call handed to trio, waited for however often the
    awaiting task is cancelled meanwhile (the call then still runs, once, on trio's next
    tick); then CancelledError if it was cancelled and the call returned, else the call's
    result or exception (RuntimeError if the host closed before it ran)."""
    cancelled = await _outlast_cancellation(fut)
    result = _unwrap(fut.result())
    if cancelled:
        raise asyncio.CancelledError
    return result


def _settle(fut: asyncio.Future[T], value: T) -> None:
    if not fut.done():
        fut.set_result(value)


def _unwrap(result: outcome.Outcome[T] | None) -> T:
    if result is None:
        raise RuntimeError(CLOSED)
    return result.unwrap()


def _logged(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:
        log.exception("trio host: %r raised", fn)


async def _outlast_cancellation(
    fut: asyncio.Future[Any], deadline: float | None = None
) -> bool:
    """Wait until ``fut`` is done (or the loop's clock passes ``deadline``), however often
    the awaiting task is cancelled meanwhile. Returns whether it was cancelled; the caller
    re-raises. ``fut`` itself is never cancelled."""
    loop = asyncio.get_running_loop()
    cancelled = False
    while not fut.done():
        timeout = None if deadline is None else deadline - loop.time()
        if timeout is not None and timeout <= 0:
            break
        try:
            await asyncio.wait((fut,), timeout=timeout)
        except asyncio.CancelledError:
            cancelled = True
    return cancelled  # noqa: ASYNC910 - asyncio code: trio's checkpoint rule does not apply


# ---------------------------------------------------------------------- the agents' wrappers


class _AioRoom(Generic[H]):
    """What a sender and a receiver share on the asyncio side: reads, abort, the waits, and
    the room's ``async with`` block.

    **Cancellation:** entering and leaving the block never suspend, so neither is ever
    cancelled: leaving always gives the room up by the handle's rule (``_leave``)."""

    def __init__(self, host: TrioHost, handle: H) -> None:
        self.host = host
        #: the trio-side handle. Read it directly; call what changes it through ``host.call``
        self.handle: H = handle

    @property
    def room(self) -> int:
        return self.handle.room

    def poll(self) -> KVPoll:
        """The room's status as trio's last tick left it (and as :meth:`abort` left it).
        Never blocks."""
        return self.handle.poll()

    @property
    def failure(self) -> TransferError | None:
        """Why the room failed (a TransferError; None unless Failed)."""
        return self.handle.failure

    def abort(self, reason: str = "aborted from asyncio") -> None:
        """Abort the room, as the trio handle's ``abort`` does, at once
        (:meth:`TrioHost._now`); the agent's tasks do the rest on trio's next tick (its
        ABORTs, its release). Idempotent; once the host has closed it only hands back what a
        receiver still owes (see :meth:`AioReceiver.abort`)."""
        self._post(partial(self.handle.abort, reason))

    def _post(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` on the trio side now (:meth:`TrioHost._now`); False if the trio run is
        over. What ``fn`` raises is logged, not raised (an abort raises nothing)."""
        try:
            self.host._now(fn)
        except Exception as exc:
            if isinstance(exc, RuntimeError) and str(exc) == CLOSED:
                return False
            log.exception("trio host: %r raised", fn)
        return True

    async def wait(self) -> KVPoll:
        """Wait until the room is terminal: return ``KVPoll.Success``, or raise the room's
        failure (a :class:`~trio_pd.TransferError`: ``TransferAborted`` after an abort...).

        **Cancellation:** unlike the trio handle's ``wait``, cancelling the awaiting asyncio
        task *aborts the room* (reason: the task was cancelled), so that a request given up
        on the asyncio side does not keep its room open until a deadline. Its pages come
        back through the usual release path (``on_release``) once that is safe.
        """
        # (a hook on the room's end resolves a future: no trio task per wait)
        ended: _Done[None] = self.host._future()
        hook = partial(_settle, ended, outcome.Value(None))
        if not self._post(partial(self.handle._when_ended, hook)):
            raise RuntimeError(CLOSED)
        try:
            if ended.done():
                await asyncio.sleep(0)  # (a schedule point even when ended, as in trio)
            _unwrap(await ended)  # (None: the trio run ended first)
        except asyncio.CancelledError:
            self.abort(f"room {self.room}: the asyncio task waiting for it was cancelled")
            raise
        status = self.handle.poll()  # (a receiver's Success is delivered here)
        failure = self.handle.failure
        if status is KVPoll.Failed and failure is not None:
            raise failure.with_traceback(None)
        return status

    async def wait_released(self) -> None:
        """Wait until the room's pages have been handed back (see the trio handle's).

        **Cancellation:** cancelling the wait changes nothing.
        """
        await self.host.run(self.handle.wait_released)

    async def __aenter__(self) -> Self:
        return self  # noqa: ASYNC910 - asyncio code; never suspends

    async def __aexit__(  # noqa: ASYNC910 - asyncio code; never suspends
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave(how_ended(exc_type))

    def _leave(self, why: str) -> None:  # pragma: no cover - every user defines it
        raise NotImplementedError


class AioSender(_AioRoom[PrefillSender]):
    """A :class:`~trio_pd.PrefillSender` seen from asyncio. Make one with
    :meth:`AioPrefill.sender`.

    ``async with`` it (or ``async with prefill.sender(...)``) holds the room for the block:
    leaving the block before the room ended aborts it, however the block ends. The room's
    source pages come back through ``on_release`` whatever the outcome.
    """

    async def send(  # noqa: ASYNC910 - never suspends
        self, pages: npt.ArrayLike, *, layers: range | None = None, last: bool = False,
        state_slots: Sequence[npt.ArrayLike] | None = None,
    ) -> None:
        """Admit the next chunk, with the request's state slots if it is the last (see
        :meth:`PrefillSender.send <trio_pd.PrefillSender.send>`): its errors
        (``AdmissionClosed``, ``ProtocolError``) are raised here. ``layers``: only those
        layers of ``pages`` are ready (layer-wise streaming, as ``PrefillSender.send``).

        **Cancellation:** never suspends, so never cancelled: when it returns the chunk was
        admitted; when it raises, it was not.
        """
        self.host._now(partial(
            self.handle.send, pages, layers=layers, last=last, state_slots=state_slots
        ))

    def _leave(self, why: str) -> None:
        if self.handle.poll() not in (KVPoll.Success, KVPoll.Failed):
            self.abort(f"the room's async with block was left before the room ended{why}")


class AioReceiver(_AioRoom[DecodeReceiver]):
    """A :class:`~trio_pd.DecodeReceiver` seen from asyncio. Make one with
    :meth:`AioDecode.receiver`.

    The pages given to :meth:`init` are trio_pd's until Success is delivered to you
    (:meth:`wait` returned it, or :meth:`poll` said Success) or ``on_release`` runs, exactly
    once. ``async with`` it (or ``async with decode.receiver(...)``) holds the room for the
    block: leaving the block before Success was delivered gives the room up as
    :meth:`abort` does, however the block ends.
    """

    @property
    def epoch(self) -> int:
        return self.handle.epoch

    @property
    def propagated(self) -> bool:
        return self.handle.propagated

    def abort(self, reason: str = "aborted from asyncio") -> None:
        """Give the room up, decided here and now: unless Success was delivered to you
        already (then it does nothing), the room reads Failed from this call on, whatever
        trio's next tick brings, and its pages come back through ``on_release``, exactly
        once: after the drain, or at once if it had succeeded without your seeing it. The
        agent does its part (ABORTs, the release) on trio's next tick. Idempotent."""
        if not self.handle._withdraw(reason):
            return
        posted = self._post(partial(self.handle.abort, reason))
        if not posted and self.handle._room.machine.status is KVPoll.Success:
            # the trio run is over (the agent closed): only a Success left unclaimed still
            # owes its pages, and handing them back touches nothing of trio's
            self.handle.abort(reason)

    async def init(  # noqa: ASYNC910 - never suspends
        self, pages: npt.ArrayLike, aux_slot: int, *,
        on_release: Callable[[], None] | None = None, prefix_pages: int = 0,
        state_slots: Sequence[npt.ArrayLike] = (),
    ) -> None:
        """Ask for the room's KV (see :meth:`DecodeReceiver.init
        <trio_pd.DecodeReceiver.init>`). ``on_release`` runs inside trio, on the loop's
        thread: it may call asyncio's non-blocking methods (``fut.set_result``,
        ``queue.put_nowait``), not await.

        When it returns, the pages are trio_pd's; when it raises an error
        (``ProtocolError``; RuntimeError once the host has closed), they were not taken.

        **Cancellation:** never suspends, so never cancelled: when it returns the pages are
        trio_pd's (they come back through ``on_release``, or as a Success delivered to you);
        when it raises, they are still yours.
        """
        self.host._now(partial(
            self.handle.init, pages, aux_slot, on_release=on_release,
            prefix_pages=prefix_pages, state_slots=state_slots,
        ))

    def _leave(self, why: str) -> None:
        if not self.handle._room.delivered:
            self.abort(f"the room's async with block was left before Success was delivered{why}")


R = TypeVar("R", AioSender, AioReceiver)


class _Opening(Generic[R]):
    """What :meth:`AioPrefill.sender` and :meth:`AioDecode.receiver` return: ``await`` it
    for the handle, or ``async with`` it to hold the room for a block.

    **Cancellation:** entering makes the room, as awaiting does, without suspending (so no
    cancel lands there); leaving never suspends."""

    __slots__ = ("_make", "_room")

    def __init__(self, make: Callable[[], Coroutine[Any, Any, R]]) -> None:
        self._make: Callable[[], Coroutine[Any, Any, R]] = make
        self._room: R | None = None

    def __await__(self) -> Generator[Any, None, R]:
        return self._make().__await__()

    async def __aenter__(self) -> R:
        self._room = await self._make()
        return self._room

    async def __aexit__(  # noqa: ASYNC910 - asyncio code; never suspends
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._room is not None
        await self._room.__aexit__(exc_type, exc, tb)


async def _new_room(host: TrioHost, make: Callable[[], H]) -> H:  # noqa: ASYNC910
    """``make()`` on the trio side, at once (:meth:`TrioHost._now`): it never suspends, so
    it is never cancelled midway. An error means nothing was made."""
    return host._now(make)  # noqa: ASYNC910


class _AioAgent(Generic[_A]):
    """What both agents seen from asyncio have: the host, the trio agent, its endpoint and
    its statistics (read directly: both run on the loop's thread)."""

    def __init__(self, host: TrioHost, agent: _A) -> None:
        self.host = host
        #: the trio agent: read it directly, change it through ``host.call``
        self.agent: _A = agent

    @property
    def endpoint(self) -> str:
        return self.agent.endpoint

    def statistics(self) -> AgentStatistics:
        return self.agent.statistics()


class AioPrefill(_AioAgent[PrefillAgent]):
    """A :class:`~trio_pd.PrefillAgent` seen from asyncio. Make one with
    :meth:`TrioHost.open_prefill`."""

    def sender(
        self,
        room: int,
        *,
        num_pages: int,
        aux_slot: int,
        on_release: Callable[[], None] | None = None,
        epoch: int | None = None,
    ) -> _Opening[AioSender]:
        """Create the room's sender (see :meth:`PrefillAgent.sender
        <trio_pd.PrefillAgent.sender>`): ``await`` it for the :class:`AioSender`, or
        ``async with`` it to hold the room for the block. ``on_release`` runs inside trio,
        on the loop's thread (see :meth:`AioReceiver.init`), exactly once, whenever the
        sender was created.

        **Cancellation:** never suspends: the sender is created (or refused with its error)
        at the call.
        """
        make = partial(
            self.agent.sender, room, num_pages=num_pages, aux_slot=aux_slot,
            on_release=on_release, epoch=epoch,
        )

        async def opened() -> AioSender:
            return AioSender(self.host, await _new_room(self.host, make))

        return _Opening(opened)


class AioDecode(_AioAgent[DecodeAgent]):
    """A :class:`~trio_pd.DecodeAgent` seen from asyncio. Make one with
    :meth:`TrioHost.open_decode`."""

    def receiver(
        self, room: int, *, bootstrap_url: str, epoch: int | None = None,
        dp_rank: int | None = None,
    ) -> _Opening[AioReceiver]:
        """Create the room's receiver (see :meth:`DecodeAgent.receiver
        <trio_pd.DecodeAgent.receiver>`): ``await`` it for the :class:`AioReceiver`, or
        ``async with`` it to hold the room for the block.

        **Cancellation:** never suspends: the receiver is created (or refused with its
        error) at the call.
        """
        make = partial(
            self.agent.receiver, room, bootstrap_url=bootstrap_url, epoch=epoch, dp_rank=dp_rank
        )

        async def opened() -> AioReceiver:
            return AioReceiver(self.host, await _new_room(self.host, make))

        return _Opening(opened)
