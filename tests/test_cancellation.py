"""A cancel never loses a page, on every host.

A request's life on each side is a room's block: allocate the pages, enter the room's block,
hand the pages over, wait for the outcome, use the KV (decode, after Success) or wait for the
drain (after a failure), leave. These tests cancel one side's handler at the k-th schedule
point of the run, for k = 1, 2, ... until a run ends without the cancel landing, and count
every page back exactly once: the allocators refuse a double free and are empty at the end,
and their sanitizer counts a write into a page after it went back.

Real engines (both), real ZeroMQ, the real bootstrap service.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.lowlevel

from trio_pd import AdmissionClosed, DecodeReceiver, KVPoll, PrefillSender, TransferError, sync
from trio_pd.aio import AioReceiver, AioSender
from trio_pd.testing.pools import (
    DEST_POISON,
    SOURCE_POISON,
    HostKVPool,
    HostRows,
    PageAllocator,
    page_rows,
)

from .helpers.agents import Pair, open_pair, poll_until, verify_room
from .helpers.aio import Agents as AioAgents
from .helpers.aio import open_agents as open_aio_agents
from .helpers.threads import Agents as SyncAgents
from .helpers.threads import agents as sync_agents

BOUND = 15.0
#: a sweep that has not ended by then is itself a failure (the handlers take a few dozen)
MAX_STEPS = 3000
PAGES = 3


class CancelAt(trio.abc.Instrument):
    """Calls ``cancel()`` just before the ``k``-th task step of the trio run, any task's:
    the cancel then lands wherever the victim is waiting at that moment, and the step that
    follows (a STATUS arriving, an engine call returning...) runs before the victim sees
    it."""

    def __init__(self, k: int, cancel: Callable[[], object]) -> None:
        self.k, self.steps, self._cancel = k, 0, cancel
        self.fired = False

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1
        if self.steps == self.k:
            self.fired = True
            self._cancel()


@dataclass
class Books:
    """The allocators of one pair of agents, and every error a free raised (a double free,
    or a row never handed out): on_release runs inside the agent, which logs and swallows
    what it raises, so it is kept here."""

    src: PageAllocator
    dst: PageAllocator
    aux: PageAllocator
    errors: list[str] = field(default_factory=list)
    #: threads: the rows each room handed over, for whoever frees what pop_released returns
    given: dict[int, list[tuple[PageAllocator, npt.NDArray[np.int64]]]] = field(
        default_factory=dict)
    src_given: dict[int, npt.NDArray[np.int64]] = field(default_factory=dict)
    #: threads: the allocators are not thread-safe
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, src: HostKVPool, dst: HostKVPool) -> Books:
        return cls(
            PageAllocator(page_rows(src), SOURCE_POISON),
            PageAllocator(page_rows(dst), DEST_POISON),
            PageAllocator(HostRows(dst.aux), DEST_POISON),
        )

    def free(self, alloc: PageAllocator, ids: npt.NDArray[np.int64], who: str) -> None:
        with self.lock:
            try:
                alloc.free(ids)
            except RuntimeError as exc:
                self.errors.append(f"{who}: {exc}")

    def alloc(self, alloc: PageAllocator, n: int) -> npt.NDArray[np.int64]:
        with self.lock:
            ids = alloc.alloc_nowait(n)
        assert ids is not None
        return ids

    @property
    def outstanding(self) -> int:
        return self.src.outstanding + self.dst.outstanding + self.aux.outstanding

    def check_run(self, run: Run, where: str) -> None:
        """After one run (``where`` names it): nothing outstanding, nothing freed twice,
        no Success with the wrong bytes."""
        assert self.outstanding == 0 and self.errors == [], (
            f"{where}: {self.outstanding} page(s) not back, errors {self.errors}; "
            f"the handlers were at {run.at}"
        )
        assert not run.corrupt, f"{where}: a Success with the wrong bytes"

    def check_all_back(self) -> None:
        assert self.errors == []
        assert self.outstanding == 0
        for a in (self.src, self.dst, self.aux):
            assert a.free_count == a.capacity
            assert a.late_writes == a.late_in_free_rows() == 0


@dataclass
class Run:
    """One request: its room, epoch and what each handler saw."""

    k: int
    room: int
    #: "succeeds", or "prefill gives up" (aborts after its first chunk: decode fails, and
    #: its pages wait for prefill's drain)
    story: str = "succeeds"
    epoch: int = field(default_factory=lambda: secrets.randbits(62))
    sender: PrefillSender | None = None
    receiver: DecodeReceiver | None = None
    #: the victim ended without a handle, so its peer would wait for it until a deadline:
    #: the router aborts the peer's room (the first handler to see this does)
    orphaned: bool = False
    succeeded: bool = False
    corrupt: bool = False
    #: where each handler is: the await it waits at (or last waited at)
    at: dict[str, str] = field(default_factory=dict)

    def holds(self, side: str, handle: Any) -> None:
        """``side``'s handler made its room's handle (aborted at once if its peer never
        will make one)."""
        if side == "prefill":
            self.sender = handle
        else:
            self.receiver = handle
        if self.orphaned:
            handle.abort(f"test: the {side}'s peer never made its room")

    def ended(self, side: str) -> None:
        """``side``'s handler has ended. If it never made its room, the peer would wait for
        it until a deadline: the router aborts the peer's room instead."""
        if (self.sender if side == "prefill" else self.receiver) is None:
            self.orphaned = True
            peer = self.receiver if side == "prefill" else self.sender
            if peer is not None:
                peer.abort(f"test: the {side} handler never made its room")


async def decode_handler(pair: Pair, books: Books, run: Run) -> None:
    """A decode request handler, written to the ownership rule: pages it never handed
    over are its own to free; once handed to ``init`` they are the room's until Success is
    delivered to it (then it frees them) or ``on_release`` runs."""
    run.at["decode"] = "allocating"
    pages = await books.dst.alloc(PAGES)
    try:
        aux = await books.aux.alloc(1)
    except BaseException:
        books.free(books.dst, pages, "decode handler, before init")
        raise

    def on_release() -> None:
        books.free(books.dst, pages, "decode on_release")
        books.free(books.aux, aux, "decode on_release (aux)")

    async with pair.decode.receiver(run.room, bootstrap_url=pair.url, epoch=run.epoch) as rx:
        run.holds("decode", rx)
        rx.init(pages, int(aux[0]), on_release=on_release)
        run.at["decode"] = "waiting"
        if await rx.wait() is KVPoll.Success:
            try:
                run.succeeded = True
                run.corrupt = not pair.verify(run.room, pages, int(aux[0]))
                run.at["decode"] = "using the KV"
                await trio.lowlevel.checkpoint()  # a cancel lands here too
            finally:
                books.free(books.dst, pages, "decode handler, after Success")
                books.free(books.aux, aux, "decode handler, after Success (aux)")
        else:
            run.at["decode"] = "in the drain"
            await rx.wait_released()


def forward_pass(pool: HostKVPool, src: npt.NDArray[np.int64], run: Run) -> int:
    """Write the request's KV into ``src`` and its aux row; returns the aux slot."""
    pool.fill(src, run.room)
    aux_slot = run.k % pool.spec.aux_slots
    pool.fill_aux(aux_slot, run.room)
    return aux_slot


async def prefill_handler(pair: Pair, books: Books, run: Run) -> None:
    """A prefill request handler: the KV's pages are filled before the room exists (the
    forward pass); from the sender's creation they come back through ``on_release``."""
    run.at["prefill"] = "allocating"
    src = await books.src.alloc(PAGES)
    aux_slot = forward_pass(pair.src, src, run)
    async with pair.prefill.sender(
        run.room, num_pages=PAGES, aux_slot=aux_slot, epoch=run.epoch,
        on_release=lambda: books.free(books.src, src, "prefill on_release"),
    ) as tx:
        run.holds("prefill", tx)
        try:
            tx.send(src[:1])
            run.at["prefill"] = "between chunks"
            await trio.lowlevel.checkpoint()
            if run.story == "prefill gives up":
                tx.abort("test: the prefill scheduler gives up")
            tx.send(src[1:], last=True)
        except AdmissionClosed:
            pass  # the room failed meanwhile
        run.at["prefill"] = "waiting"
        await tx.wait()


async def sweep_trio(
    pair: Pair, victim: str, story: str,
    handlers: dict[str, Callable[[Pair, Books, Run], Awaitable[None]]],
) -> set[str]:
    """Cancel ``victim``'s handler at step k = 1, 2, ... until a run ends uncancelled; after
    each run, wait until every page is back. Returns the awaits the cancel landed at."""
    books = Books.of(pair.src, pair.dst)
    covered: set[str] = set()
    for k in range(1, MAX_STEPS):
        run = Run(k, (1 << 20) + k, story)
        cancel, cancelled = await run_trio_once(pair, books, run, victim, handlers)
        if cancelled:
            covered.add(run.at.get(victim, "not started"))
        with trio.move_on_after(BOUND):
            await poll_until(lambda: books.outstanding == 0)
        books.check_run(run, f"k={k}")
        if not cancelled and not cancel.fired:  # the cancel came too late: every await tried
            books.check_all_back()
            return covered
    raise AssertionError(f"no run ended uncancelled within {MAX_STEPS} steps")


async def run_trio_once(
    pair: Pair, books: Books, run: Run, victim: str,
    handlers: dict[str, Callable[[Pair, Books, Run], Awaitable[None]]],
) -> tuple[CancelAt, bool]:
    """Both handlers of ``run``, ``victim``'s cancelled before step ``run.k``. Returns the
    instrument and whether the cancel reached the victim."""
    scopes = {side: trio.CancelScope() for side in handlers}

    async def one(side: str) -> None:
        with scopes[side]:
            await handlers[side](pair, books, run)
        if side == victim:
            run.ended(side)

    cancel = CancelAt(run.k, scopes[victim].cancel)
    trio.lowlevel.add_instrument(cancel)
    try:
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                for side in handlers:
                    nursery.start_soon(one, side)
    finally:
        trio.lowlevel.remove_instrument(cancel)
    return cancel, scopes[victim].cancelled_caught


@pytest.mark.parametrize("free_at_first", [True, False])
async def test_a_cancelled_alloc_takes_no_row(free_at_first: bool) -> None:
    """``PageAllocator.alloc`` cancelled at any of its schedule points, with rows free at
    once or only after another task frees them: the rows it took are exactly the rows it
    returned. It used to take them and then checkpoint: a cancel there lost them."""
    for k in range(1, 50):
        if await alloc_once(k, free_at_first):
            return
    raise AssertionError("alloc never ran uncancelled")


async def alloc_once(k: int, free_at_first: bool) -> bool:
    """One ``alloc(2)`` of 4 rows, cancelled before step ``k``; True if it ran uncancelled."""
    alloc = PageAllocator(np.zeros((4, 8), dtype=np.uint8), DEST_POISON)
    held = None if free_at_first else alloc.alloc_nowait(4)
    got: list[npt.NDArray[np.int64]] = []
    scope = trio.CancelScope()

    async def take() -> None:
        with scope:
            got.append(await alloc.alloc(2))

    async def give_back() -> None:
        await trio.lowlevel.checkpoint()
        if held is not None:
            alloc.free(held)

    cancel = CancelAt(k, scope.cancel)
    trio.lowlevel.add_instrument(cancel)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take)
            nursery.start_soon(give_back)
    finally:
        trio.lowlevel.remove_instrument(cancel)
    assert alloc.outstanding == sum(len(ids) for ids in got), f"k={k}: rows lost"
    return not cancel.fired and not scope.cancelled_caught


#: where the victim's cancel must have landed, by (victim, story): the awaits of every host
AWAITS = {
    ("decode", "succeeds"): {"allocating", "waiting", "using the KV"},
    ("decode", "prefill gives up"): {"allocating", "waiting", "in the drain"},
    ("prefill", "succeeds"): {"allocating", "between chunks", "waiting"},
    ("prefill", "prefill gives up"): {"allocating", "between chunks", "waiting"},
}
#: and the steps the other hosts add, where the trio API makes a plain call. The asyncio
#: facade adds none: its calls run on the trio side at once, between trio's ticks, and never
#: suspend (``TrioHost._now``), so no cancel can land in them
MORE_AWAITS: dict[tuple[str, str], set[str]] = {
    ("asyncio", "decode"): set(),
    ("asyncio", "prefill"): set(),
    ("threads", "decode"): {"making the room", "before init"},
    ("threads", "prefill"): {"making the room", "sending"},
}


@pytest.mark.parametrize("story", ["succeeds", "prefill gives up"])
@pytest.mark.parametrize("victim", ["decode", "prefill"])
async def test_trio_a_cancel_at_every_schedule_point_loses_no_page(
    engine_name: str, bootstrap_url: str, victim: str, story: str
) -> None:
    """The room's ``async with`` on the trio API: a cancel at any await of either side's
    handler (allocating, waiting while the KV is written, using it after Success, waiting
    for the drain after a failure) loses no page and frees none twice."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        handlers = {"decode": decode_handler, "prefill": prefill_handler}
        covered = await sweep_trio(pair, victim, story, handlers)
        assert covered == AWAITS[victim, story]
        with trio.fail_after(BOUND):
            await poll_until(lambda: pair.decode.statistics().pages_held == 0)
        d = pair.decode.statistics()
        assert d.rooms_unproven_at_close == d.released_by_timeout == 0


async def prefill_handler_layers(pair: Pair, books: Books, run: Run) -> None:
    """:func:`prefill_handler` for a model loop that streams its layers
    (docs/layerwise.md): each layer of the whole request sent once computed, the last layer
    the last send; "prefill gives up" aborts after the first layer, so the request ends
    with some layers written and the others never."""
    run.at["prefill"] = "allocating"
    src = await books.src.alloc(PAGES)
    aux_slot = forward_pass(pair.src, src, run)
    async with pair.prefill.sender(
        run.room, num_pages=PAGES, aux_slot=aux_slot, epoch=run.epoch,
        on_release=lambda: books.free(books.src, src, "prefill on_release"),
    ) as tx:
        run.holds("prefill", tx)
        layers = pair.src.spec.num_layers
        try:
            for layer in range(layers):
                if layer:
                    run.at["prefill"] = "computing a layer"
                    await trio.lowlevel.checkpoint()
                    if run.story == "prefill gives up":
                        tx.abort("test: the prefill scheduler gives up between layers")
                tx.send(src, layers=range(layer, layer + 1), last=layer == layers - 1)
        except AdmissionClosed:
            pass  # the room failed meanwhile
        run.at["prefill"] = "waiting"
        await tx.wait()


@pytest.mark.parametrize("story", ["succeeds", "prefill gives up"])
@pytest.mark.parametrize("victim", ["decode", "prefill"])
async def test_trio_layerwise_a_cancel_at_every_schedule_point_loses_no_page(
    engine_name: str, bootstrap_url: str, victim: str, story: str
) -> None:
    """The same sweep with prefill streaming its layers: a cancel at any await of either
    handler, a layer's compute included, loses no page, frees none twice, and leaves no
    late write in a page that went back."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        handlers = {"decode": decode_handler, "prefill": prefill_handler_layers}
        covered = await sweep_trio(pair, victim, story, handlers)
        want = AWAITS[victim, story]
        if victim == "prefill":
            want = {"computing a layer" if a == "between chunks" else a for a in want}
        assert covered == want
        with trio.fail_after(BOUND):
            await poll_until(lambda: pair.decode.statistics().pages_held == 0)


# ------------------------------------------------------------------------ asyncio (trio_pd.aio)


class Steps(trio.abc.Instrument):
    """The schedule points of a run hosted in asyncio: each suspension of the victim's
    coroutine (:class:`Counted`) and, with ``trio_steps``, each trio task step too (this
    instrument, added to the guest run). ``cancel()`` runs just before the ``k``-th.

    Counting both loops lands cancels while the trio side is mid-way through a call the
    victim awaits; but how many trio steps run between two of the victim's awaits varies
    from run to run (timers, the engines' threads), so a sweep over both can step over one
    of the victim's awaits. Counting the victim's suspensions alone is deterministic: that
    sweep reaches every await of the handler."""

    def __init__(self, k: int, trio_steps: bool = True) -> None:
        self.k, self.steps, self.fired, self.trio_steps = k, 0, False, trio_steps
        self.cancel: Callable[[], object] = lambda: None

    def tick(self) -> None:
        self.steps += 1
        if self.steps == self.k:
            self.fired = True
            self.cancel()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.trio_steps:
            self.tick()


class Counted:
    """``await Counted(coro, steps)`` awaits ``coro``, ticking ``steps`` each time it
    suspends (a cancel requested at that tick lands at that very await)."""

    def __init__(self, coro: Coroutine[Any, Any, None], steps: Steps) -> None:
        self._coro, self._steps = coro, steps

    def __await__(self) -> Generator[Any, Any, None]:
        it = self._coro.__await__()
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = it.send(value) if error is None else it.throw(error)
            except StopIteration:
                return
            self._steps.tick()
            try:
                value, error = (yield yielded), None
            except BaseException as exc:  # (thrown in by the task: passed on to coro)
                value, error = None, exc


async def decode_handler_aio(a: AioAgents, books: Books, run: AioRun) -> None:
    """The decode handler of :func:`decode_handler`, on asyncio. ``init`` has run whenever
    it returns or raises CancelledError: the pages are the room's from then on."""
    run.at["decode"] = "allocating"
    await asyncio.sleep(0)
    pages, aux = books.alloc(books.dst, PAGES), books.alloc(books.aux, 1)
    handed = False

    def on_release() -> None:
        books.free(books.dst, pages, "decode on_release")
        books.free(books.aux, aux, "decode on_release (aux)")

    try:
        run.at["decode"] = "making the room"
        async with a.decode.receiver(run.room, bootstrap_url=a.url, epoch=run.epoch) as rx:
            run.holds("decode", rx)
            run.at["decode"] = "in init"
            try:
                await rx.init(pages, int(aux[0]), on_release=on_release)
            except asyncio.CancelledError:
                handed = True  # init ran whole before the cancel came out
                raise
            handed = True
            run.at["decode"] = "waiting"
            try:
                await rx.wait()
            except TransferError:
                run.at["decode"] = "in the drain"
                await rx.wait_released()
                return
            try:
                run.succeeded = True
                run.corrupt = not verify_room(a.src, a.dst, run.room, pages, int(aux[0]))
                run.at["decode"] = "using the KV"
                for _ in range(3):  # (tokens streamed to the client, say)
                    await asyncio.sleep(0)
            finally:
                books.free(books.dst, pages, "decode handler, after Success")
                books.free(books.aux, aux, "decode handler, after Success (aux)")
    finally:
        if not handed:
            books.free(books.dst, pages, "decode handler, never handed over")
            books.free(books.aux, aux, "decode handler, never handed over (aux)")


async def prefill_handler_aio(a: AioAgents, books: Books, run: AioRun) -> None:
    """The prefill handler of :func:`prefill_handler`, on asyncio: from the call to
    ``sender()`` the pages are ``on_release``'s (a creation that is cancelled still creates
    the sender, and aborts it)."""
    run.at["prefill"] = "allocating"
    await asyncio.sleep(0)
    src = books.alloc(books.src, PAGES)
    aux_slot = forward_pass(a.src, src, run)
    run.at["prefill"] = "making the room"
    async with a.prefill.sender(
        run.room, num_pages=PAGES, aux_slot=aux_slot, epoch=run.epoch,
        on_release=lambda: books.free(books.src, src, "prefill on_release"),
    ) as tx:
        run.holds("prefill", tx)
        try:
            run.at["prefill"] = "sending"
            await tx.send(src[:1])
            run.at["prefill"] = "between chunks"
            await asyncio.sleep(0)
            if run.story == "prefill gives up":
                tx.abort("test: the prefill scheduler gives up")
            run.at["prefill"] = "sending"
            await tx.send(src[1:], last=True)
        except AdmissionClosed:
            pass  # the room failed meanwhile
        run.at["prefill"] = "waiting"
        with contextlib.suppress(TransferError):
            await tx.wait()


@dataclass
class AioRun(Run):
    sender: AioSender | None = None  # type: ignore[assignment]
    receiver: AioReceiver | None = None  # type: ignore[assignment]


AioHandler = Callable[[AioAgents, Books, AioRun], Coroutine[Any, Any, None]]


async def sweep_aio(a: AioAgents, victim: str, story: str) -> set[str]:
    """:func:`sweep_trio` on asyncio, twice: the victim is an asyncio task, cancelled at the
    k-th schedule point of either loop, then at the k-th of its own awaits (see
    :class:`Steps`). Returns the awaits either sweep's cancels landed at."""
    covered: set[str] = set()
    for trio_steps in (True, False):
        covered |= await sweep_aio_once(a, victim, story, trio_steps)
    return covered


async def sweep_aio_once(a: AioAgents, victim: str, story: str, trio_steps: bool) -> set[str]:
    handlers: dict[str, AioHandler] = {"decode": decode_handler_aio,
                                       "prefill": prefill_handler_aio}
    books = Books.of(a.src, a.dst)
    covered: set[str] = set()
    for k in range(1, MAX_STEPS):
        run = AioRun(k, (1 << 21) + (0 if trio_steps else 1 << 16) + k, story)
        steps, cancelled = await run_aio_once(a, books, run, victim, handlers, trio_steps)
        if cancelled:
            covered.add(run.at.get(victim, "not started"))
        async with asyncio.timeout(BOUND):
            while books.outstanding:  # noqa: ASYNC110 - the allocators have no asyncio.Event
                await asyncio.sleep(0.005)
        books.check_run(run, f"k={k}")
        if not cancelled and not steps.fired:
            books.check_all_back()
            return covered
    raise AssertionError(f"no run ended uncancelled within {MAX_STEPS} steps")


async def run_aio_once(
    a: AioAgents, books: Books, run: AioRun, victim: str, handlers: dict[str, AioHandler],
    trio_steps: bool,
) -> tuple[Steps, bool]:
    steps = Steps(run.k, trio_steps)
    cancelled = False

    async def the_victim() -> None:
        nonlocal cancelled
        task = asyncio.current_task()
        assert task is not None
        steps.cancel = task.cancel  # (from its first step: a cancel before it is no cancel)
        try:
            await Counted(handlers[victim](a, books, run), steps)
        except asyncio.CancelledError:
            cancelled = True
        run.ended(victim)

    await a.host.call(trio.lowlevel.add_instrument, steps)
    try:
        peer = "prefill" if victim == "decode" else "decode"
        tasks = [
            asyncio.create_task(the_victim()),
            asyncio.create_task(handlers[peer](a, books, run)),
        ]
        done, _ = await asyncio.wait(tasks, timeout=BOUND)
        assert len(done) == 2, f"k={run.k}: a handler hangs at {run.at}"
        if tasks[0].cancelled():  # (cancelled as it returned: it ran uncancelled)
            assert steps.fired
        else:
            tasks[0].result()
        tasks[1].result()
    finally:
        await a.host.call(trio.lowlevel.remove_instrument, steps)
    return steps, cancelled


@pytest.mark.parametrize("story", ["succeeds", "prefill gives up"])
@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_asyncio_a_cancel_at_every_schedule_point_loses_no_page(
    engine_name: str, victim: str, story: str
) -> None:
    """The room's ``async with`` on ``trio_pd.aio``: a cancel at any schedule point of either
    loop while one side's asyncio handler runs (allocating, making the room, in ``init``,
    sending, waiting, using the KV, in the drain) loses no page and frees none twice."""

    async def scenario() -> None:
        async with open_aio_agents(engine_name=engine_name) as a:
            covered = await sweep_aio(a, victim, story)
            assert covered == AWAITS[victim, story] | MORE_AWAITS["asyncio", victim]
            async with asyncio.timeout(BOUND):
                while a.decode.statistics().pages_held:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
            d = a.decode.statistics()
            assert d.rooms_unproven_at_close == d.released_by_timeout == 0

    asyncio.run(scenario())


# ------------------------------------------------------------------------ threads (trio_pd.sync)


class ClientGone(Exception):
    """A thread's "cancel": the handler gives the request up at its next step."""


class ThreadSteps(trio.abc.Instrument):
    """Where a handler thread gives up. Two counts, one per sweep (``mode``): ``"own"``, the
    victim's own steps (:meth:`point`; a wait loop is one step), so that it gives up at
    each of them in turn; ``"trio"``, the task steps of the facades' trio thread (this
    instrument), so that it gives up wherever the trio thread is at that moment (a STATUS
    just handled, a release just published...). From the ``k``-th on, the victim's next
    :meth:`point` or :meth:`check` raises :class:`ClientGone`."""

    def __init__(self, k: int, victim: str, mode: str) -> None:
        self.k, self.victim, self.mode, self.steps = k, victim, mode, 0
        self.fired = False
        self._lock = threading.Lock()

    def _tick(self) -> None:
        with self._lock:
            self.steps += 1
            if self.steps >= self.k:
                self.fired = True

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.mode == "trio":
            self._tick()

    def point(self, run: ThreadRun, side: str, where: str) -> None:
        """A step of a handler thread at ``where``."""
        run.at[side] = where
        if side == self.victim and self.mode == "own":
            self._tick()
        self.check(side)

    def check(self, side: str) -> None:
        """A look, within a step, at whether the client has gone."""
        if side == self.victim and self.fired:
            raise ClientGone(side)


@dataclass
class ThreadRun(Run):
    sender: sync.SyncSender | None = None  # type: ignore[assignment]
    receiver: sync.SyncReceiver | None = None  # type: ignore[assignment]
    #: set once the room's pages came out of pop_released (and were freed)
    dst_back: threading.Event = field(default_factory=threading.Event)


def wait_for(
    pred: Callable[[], bool], steps: ThreadSteps, run: ThreadRun, side: str, where: str
) -> None:
    """A scheduler's wait for ``pred``: one step at ``where``, then a look at the client
    before each poll; AssertionError after BOUND."""
    steps.point(run, side, where)
    deadline = time.monotonic() + BOUND
    while not pred():
        assert time.monotonic() < deadline, "a handler thread waited too long"
        time.sleep(0.001)
        steps.check(side)


def decode_handler_thread(a: SyncAgents, books: Books, run: ThreadRun, steps: ThreadSteps) -> None:
    """The decode handler on a thread of its own, with the facade's ``with receiver:``
    block: the pages are the handler's once ``poll()`` returned Success, else they come out
    of ``pop_released`` (freed by the collector)."""
    steps.point(run, "decode", "allocating")
    pages, aux = books.alloc(books.dst, PAGES), books.alloc(books.aux, 1)
    handed = False
    try:
        steps.point(run, "decode", "making the room")
        with a.decode.receiver(run.room, bootstrap_url=a.boot.url, epoch=run.epoch) as rx:
            run.holds("decode", rx)
            steps.point(run, "decode", "before init")
            books.given[run.room] = [(books.dst, pages), (books.aux, aux)]
            rx.init(pages, int(aux[0]))
            handed = True
            wait_for(lambda: rx.poll() in (KVPoll.Success, KVPoll.Failed),
                     steps, run, "decode", "waiting")
            if rx.poll() is KVPoll.Failed:
                wait_for(run.dst_back.is_set, steps, run, "decode", "in the drain")
                return
            del books.given[run.room]  # the collector must not free them: they are ours
            try:
                run.succeeded = True
                run.corrupt = not verify_room(a.src, a.dst, run.room, pages, int(aux[0]))
                steps.point(run, "decode", "using the KV")
            finally:
                books.free(books.dst, pages, "decode handler, after Success")
                books.free(books.aux, aux, "decode handler, after Success (aux)")
    finally:
        if not handed:
            books.given.pop(run.room, None)
            books.free(books.dst, pages, "decode handler, never handed over")
            books.free(books.aux, aux, "decode handler, never handed over (aux)")


def prefill_handler_thread(
    a: SyncAgents, books: Books, run: ThreadRun, steps: ThreadSteps
) -> None:
    """The prefill handler on a thread, with ``with sender:``: from ``init`` the source
    pages come out of ``pop_released`` whatever the outcome."""
    steps.point(run, "prefill", "allocating")
    src = books.alloc(books.src, PAGES)
    aux_slot = forward_pass(a.src, src, run)
    handed = False
    try:
        steps.point(run, "prefill", "making the room")
        with a.prefill.sender(run.room, epoch=run.epoch) as tx:
            books.src_given[run.room] = src
            tx.init(PAGES, aux_slot)
            handed = True
            run.holds("prefill", tx)
            steps.point(run, "prefill", "sending")
            tx.send(src[:1])
            steps.point(run, "prefill", "between chunks")
            if run.story == "prefill gives up":
                tx.abort("test: the prefill scheduler gives up")
            tx.send(src[1:], last=True)
            wait_for(lambda: tx.poll() in (KVPoll.Success, KVPoll.Failed),
                     steps, run, "prefill", "waiting")
    finally:
        if not handed:
            books.src_given.pop(run.room, None)
            books.free(books.src, src, "prefill handler, never handed over")


ThreadHandler = Callable[[SyncAgents, Books, ThreadRun, ThreadSteps], None]


def collect(a: SyncAgents, books: Books, runs: dict[int, ThreadRun]) -> None:
    """The schedulers' own step: free what ``pop_released`` hands back."""
    for room in a.prefill.pop_released():
        books.free(books.src, books.src_given.pop(room), "prefill pop_released")
    for room in a.decode.pop_released():
        for alloc, ids in books.given.pop(room):
            books.free(alloc, ids, "decode pop_released")
        runs[room].dst_back.set()


def run_threads_once(
    a: SyncAgents, books: Books, run: ThreadRun, victim: str, mode: str,
    handlers: dict[str, ThreadHandler], runs: dict[int, ThreadRun],
) -> tuple[ThreadSteps, bool]:
    steps = ThreadSteps(run.k, victim, mode)
    gone: list[ClientGone] = []
    errors: list[BaseException] = []

    def one(side: str) -> None:
        try:
            handlers[side](a, books, run, steps)
        except ClientGone as exc:
            gone.append(exc)
        except BaseException as exc:
            errors.append(exc)
        if side == victim:
            run.ended(side)

    a.prefill.thread.call(trio.lowlevel.add_instrument, steps)
    try:
        threads = [threading.Thread(target=one, args=(side,)) for side in handlers]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            collect(a, books, runs)
            time.sleep(0.001)
        for t in threads:
            t.join()
    finally:
        a.prefill.thread.call(trio.lowlevel.remove_instrument, steps)
    assert errors == [], errors
    return steps, bool(gone)


def sweep_threads(a: SyncAgents, victim: str, story: str, mode: str, base: int) -> set[str]:
    handlers: dict[str, ThreadHandler] = {"decode": decode_handler_thread,
                                          "prefill": prefill_handler_thread}
    books = Books.of(a.src, a.dst)
    covered: set[str] = set()
    runs: dict[int, ThreadRun] = {}
    for k in range(1, MAX_STEPS):
        run = runs[base + k] = ThreadRun(k, base + k, story)
        steps, gave_up = run_threads_once(a, books, run, victim, mode, handlers, runs)
        if gave_up:
            covered.add(run.at[victim])
        deadline = time.monotonic() + BOUND
        while books.outstanding and time.monotonic() < deadline:
            collect(a, books, runs)
            time.sleep(0.002)
        books.check_run(run, f"k={k} ({mode})")
        if not gave_up and not steps.fired:
            books.check_all_back()
            return covered
    raise AssertionError(f"no run ended uncancelled within {MAX_STEPS} steps")


@pytest.mark.parametrize("story", ["succeeds", "prefill gives up"])
@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_threads_a_handler_giving_up_at_every_step_loses_no_page(
    engine_name: str, victim: str, story: str
) -> None:
    """The facade's ``with receiver:`` / ``with sender:`` from a handler thread that gives
    the request up (an exception) at its own k-th step, then at the trio thread's k-th task
    step, k = 1, 2, ...: every page comes back exactly once, to the handler (a Success
    ``poll()`` returned) or through ``pop_released``."""
    with sync_agents(engine_name, shared=True, num_pages=64, aux_slots=32) as a:
        own = sweep_threads(a, victim, story, "own", 1 << 22)
        expected = AWAITS[victim, story] | MORE_AWAITS["threads", victim]
        assert own == expected
        raced = sweep_threads(a, victim, story, "trio", 1 << 23)
        assert raced <= expected
        d = a.decode.statistics()
        assert d.pages_held == d.rooms_unproven_at_close == d.released_by_timeout == 0
