"""trio_pd.sync: the agents on a trio thread, driven by schedulers on plain threads.

The schedulers here are what a serving engine runs: loops on ordinary threads that poll their
requests each step without blocking, take the rooms whose pages came back from
``pop_released()`` and free those pages themselves, while another thread aborts requests. No
trio code runs in them. Real engines, real ZeroMQ, the real bootstrap service, and page
allocators with the lifetime sanitizer of :mod:`trio_pd.testing.pools`.

Nothing sleeps to synchronise: the scheduler loops sleep between steps as a model's forward
pass would, and conditions are polled under a deadline (:func:`poll_until`).
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import trio_pd.sync as sync
from trio_pd import (
    ConfigurationError,
    DecodeConfig,
    KVPoll,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferTimeout,
)
from trio_pd.engines import make_engine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.testing.pools import DEST_POISON, SOURCE_POISON, HostKVPool, PageAllocator, page_rows

from .helpers.agents import host_pool
from .helpers.threads import BOUND, Agents, Books, aborter, agents, guarded, poll_until

TERMINAL = (KVPoll.Success, KVPoll.Failed)


def one_room(
    a: Agents, room: int, *, npages: int = 4, send: bool = True, epoch: int | None = None
) -> tuple[sync.SyncSender, sync.SyncReceiver]:
    """A room on both sides: the receiver initialised once WaitingForInput, the sender given
    its pages (and, with ``send``, all of them)."""
    epoch = epoch if epoch is not None else room + 1000
    src_pages, dst_pages = np.arange(npages), np.arange(npages) + npages
    a.src.fill(src_pages, room)
    a.src.fill_aux(1, room)
    sender = a.prefill.sender(room, epoch=epoch)
    sender.init(npages, 1)
    receiver = a.decode.receiver(room, bootstrap_url=a.boot.url, epoch=epoch)
    poll_until(lambda: receiver.poll() is not KVPoll.Bootstrapping)
    receiver.init(dst_pages, 2)
    if send:
        sender.send(src_pages, last=True)
    return sender, receiver


# ------------------------------------------------------------------ the scheduler loop


N_REQUESTS = 200
ABORT_RATE = 0.3
CONCURRENCY = 24
STEP = 0.001  # the scheduler's "forward pass"


@dataclass(frozen=True)
class Request:
    index: int
    room: int
    epoch: int
    npages: int
    chunk: int
    #: which side's handle the second thread aborts, and how long after it exists
    abort: str | None
    abort_after: float


def plan(seed: int) -> list[Request]:
    rng = random.Random(seed)
    rooms = rng.sample(range(1, 1 << 40), N_REQUESTS)
    aborted = set(rng.sample(range(N_REQUESTS), int(N_REQUESTS * ABORT_RATE)))
    out = []
    for i in range(N_REQUESTS):
        side = rng.choice(("prefill", "decode")) if i in aborted else None
        if side == "decode" and not i % 2:  # (its handle reaches the aborter after init)
            after = rng.uniform(0.0, 0.012)  # often while the KV is being written
        else:
            after = rng.uniform(0.0, 0.03) if rng.random() < 0.8 else 0.2  # (0.2: after Success)
        npages, chunk = rng.randint(1, 16), rng.randint(1, 6)
        out.append(Request(i, rooms[i], rng.getrandbits(62), npages, chunk, side, after))
    return out


@dataclass
class _Src:
    req: Request
    sender: sync.SyncSender
    pages: npt.NDArray[np.int64]
    aux: npt.NDArray[np.int64]
    sent: int = 0


def prefill_scheduler(
    prefill: sync.SyncPrefill, src: HostKVPool, reqs: list[Request], books: Books,
    pages: PageAllocator, aux: PageAllocator, deadline: float,
) -> None:
    """SGLang's prefill loop, reduced: admit, send one chunk per room per step, free what
    pop_released() hands back."""
    pending = collections.deque(reqs)
    active: dict[int, _Src] = {}
    while pending or active:
        assert time.monotonic() < deadline, f"prefill: {len(active)} rooms hung"
        while pending and len(active) < CONCURRENCY:
            req = pending[0]
            ids = pages.alloc_nowait(req.npages)
            if ids is None:
                break
            slot = aux.alloc_nowait(1)
            if slot is None:
                pages.free(ids)
                break
            pending.popleft()
            src.fill(ids, req.room)
            src.fill_aux(int(slot[0]), req.room)
            sender = prefill.sender(req.room, epoch=req.epoch)
            assert sender.poll() is KVPoll.WaitingForInput  # (chunks may come before decode)
            sender.init(req.npages, int(slot[0]))
            active[req.room] = _Src(req, sender, ids, slot)
            books.handles.put(("prefill", req, sender))
        for st in active.values():
            if st.sent < st.req.npages and st.sender.poll() is not KVPoll.Failed:
                end = min(st.sent + st.req.chunk, st.req.npages)
                st.sender.send(st.pages[st.sent:end], last=end == st.req.npages)
                st.sent = end
        for room in prefill.pop_released():
            st = active.pop(room)  # KeyError: a room twice, or one never handed over
            status = st.sender.poll()
            assert status in TERMINAL, f"room {room} released while {status.name}"
            if status is KVPoll.Failed:
                with pytest.raises(TransferError):
                    st.sender.failure_exception()
            books.prefill_outcome[room] = status
            books.prefill_popped[room] += 1
            pages.free(st.pages)
            aux.free(st.aux)
        time.sleep(STEP)


@dataclass
class _Dst:
    req: Request
    receiver: sync.SyncReceiver
    pages: npt.NDArray[np.int64] | None = None
    aux: npt.NDArray[np.int64] | None = None


def decode_scheduler(
    decode: sync.SyncDecode, dst: HostKVPool, url: str, reqs: list[Request], books: Books,
    pages: PageAllocator, aux: PageAllocator, deadline: float,
) -> None:
    """SGLang's decode loop, reduced: a receiver per request, pages allocated and ``init``
    once it is WaitingForInput, the KV checked on Success, pages freed on Success or when
    pop_released() hands them back."""
    pending = collections.deque(reqs)
    active: dict[int, _Dst] = {}
    while pending or active:
        assert time.monotonic() < deadline, f"decode: {len(active)} rooms hung"
        while pending and len(active) < CONCURRENCY:
            req = pending.popleft()
            receiver = decode.receiver(req.room, bootstrap_url=url, epoch=req.epoch)
            active[req.room] = _Dst(req, receiver)
            if req.index % 2:  # (the others go to the aborter once they have pages)
                books.handles.put(("decode", req, receiver))
        over = []
        for room, d in active.items():
            status = d.receiver.poll()
            if d.pages is None:
                if status is KVPoll.Failed:  # before init: no pages were handed over
                    books.decode_outcome[room] = status
                    over.append(room)
                elif status is not KVPoll.Bootstrapping:
                    ids = pages.alloc_nowait(d.req.npages)
                    if ids is None:
                        continue
                    slot = aux.alloc_nowait(1)
                    if slot is None:
                        pages.free(ids)
                        continue
                    d.pages, d.aux = ids, slot
                    books.decode_inited.add(room)
                    if not d.req.index % 2:
                        books.handles.put(("decode", d.req, d.receiver))
                    (d.receiver.init if room % 2 else d.receiver.send_metadata)(
                        ids, int(slot[0])
                    )
            elif status is KVPoll.Success:
                want = dst.expected(room, d.req.npages)
                ok = bool((dst.kv[:, d.pages, :] == want).all()) and dst.aux_ok(
                    int(d.aux[0]), room
                )
                books.verified += ok
                books.corrupt += not ok
                books.decode_outcome[room] = status
                pages.free(d.pages)
                aux.free(d.aux)
                over.append(room)
        for room in over:
            del active[room]
        for room in decode.pop_released():
            d = active.pop(room)  # KeyError: a room twice, or one that holds nothing
            assert d.pages is not None and d.aux is not None
            assert d.receiver.poll() is KVPoll.Failed
            books.decode_outcome[room] = KVPoll.Failed
            books.decode_popped[room] += 1
            pages.free(d.pages)
            aux.free(d.aux)
        time.sleep(STEP)


def slow_writes(index: int, _peer: str, _n: int) -> Fault | None:
    """One write in four waits 10 ms before it writes: an abort often comes while a write
    is under way, and a page handed back too early would then be written late."""
    return Fault("delay_before", delay_s=0.01)


def test_scheduler_threads_move_200_requests(engine_name: str) -> None:
    """The acceptance test: a prefill and a decode scheduler on plain threads move 200
    requests through trio_pd.sync while a third thread aborts 30% of them; one write in four
    is slowed down. Every Success is byte-compared; no page is corrupt or leaked or written
    late; every prefill room, and
    every decode room that failed holding pages, comes out of pop_released() exactly once."""
    reqs = plan(seed=15)
    books = Books()
    src = host_pool(num_pages=512, aux_slots=64)
    dst = host_pool(num_pages=512, aux_slots=64)
    src_pages, src_aux = PageAllocator(page_rows(src), SOURCE_POISON), PageAllocator(
        src.aux, SOURCE_POISON
    )
    dst_pages, dst_aux = PageAllocator(page_rows(dst), DEST_POISON), PageAllocator(
        dst.aux, DEST_POISON
    )
    started = time.monotonic()
    with (
        make_engine(engine_name) as pe, make_engine(engine_name) as de,
        sync.TrioThread("test-prefill-side") as prefill_side,
        sync.open_bootstrap_server(thread=prefill_side) as boot,
        sync.open_prefill(
            engine=FaultEngine(pe, slow_writes), pool=src.spec, bootstrap_url=boot.url,
            kv_heads=2, thread=prefill_side,
        ) as prefill,
        sync.open_decode(engine=de, pool=dst.spec) as decode,
    ):
        deadline = time.monotonic() + 60
        threads = [
            threading.Thread(target=guarded(
                books, prefill_scheduler, prefill, src, reqs, books, src_pages, src_aux,
                deadline,
            )),
            threading.Thread(target=guarded(
                books, decode_scheduler, decode, dst, boot.url, reqs, books, dst_pages,
                dst_aux, deadline,
            )),
        ]
        second = threading.Thread(target=guarded(books, aborter, books))
        for t in [*threads, second]:
            t.start()
        for t in threads:
            t.join(70)
        books.done.set()
        second.join(10)
        assert not books.errors, books.errors
        assert not any(t.is_alive() for t in [*threads, second])
        p, d = prefill.statistics(), decode.statistics()
        assert p.rooms_active == d.rooms_active == 0
        assert p.leases_live == p.leases_quarantined == 0
        assert d.pages_held == 0
        moved = time.monotonic() - started
    assert prefill.pop_released() == [] and decode.pop_released() == []  # nothing twice

    rooms = {r.room for r in reqs}
    aborted_plan = {r.room for r in reqs if r.abort}
    assert books.aborted == aborted_plan and len(aborted_plan) == N_REQUESTS * ABORT_RATE
    assert books.corrupt == 0
    # every prefill room came back exactly once; on decode, exactly the failed ones holding
    # pages did, once each
    assert books.prefill_popped == collections.Counter(rooms)
    assert set(books.decode_outcome) == rooms and set(books.prefill_outcome) == rooms
    failed_holding = {
        r for r in books.decode_inited if books.decode_outcome[r] is KVPoll.Failed
    }
    assert books.decode_popped == collections.Counter(failed_holding)
    succeeded = {r for r, s in books.decode_outcome.items() if s is KVPoll.Success}
    assert books.verified == len(succeeded)
    # only aborts fail rooms, and most aborts landed before the room ended
    failed = {r for r, s in books.decode_outcome.items() if s is KVPoll.Failed}
    failed |= {r for r, s in books.prefill_outcome.items() if s is KVPoll.Failed}
    assert failed <= aborted_plan
    assert len(failed) >= len(aborted_plan) // 2
    assert len(succeeded) >= N_REQUESTS - len(aborted_plan)
    # no leak, no late write: every page is back and its poison intact
    for alloc in (src_pages, src_aux, dst_pages, dst_aux):
        assert alloc.outstanding == 0
        assert alloc.late_writes == 0 and alloc.late_in_free_rows() == 0
    assert len(books.abort_points) >= 3  # aborts at several points of a room's life
    print(f"{N_REQUESTS} requests, {len(failed)} failed by aborts, in {moved:.2f} s;",
          dict(books.abort_points))


# ------------------------------------------------------------------ thread rules


def test_a_blocking_call_on_the_trio_thread_raises() -> None:
    """Every method that waits for the trio thread refuses to run on it (it would wait for
    itself); the non-blocking ones work there."""
    with agents(decode_kw={"call_timeout": 2.0}, prefill_kw={"call_timeout": 2.0}) as a:
        sender, receiver = one_room(a, 3, send=False)
        calls: list[tuple[str, sync.TrioThread, Callable[[], object]]] = [
            ("receiver", a.decode.thread, lambda: a.decode.receiver(4, bootstrap_url=a.boot.url)),
            ("init", a.prefill.thread, lambda: a.prefill.sender(5).init(1, 0)),
            ("statistics", a.prefill.thread, a.prefill.statistics),
            ("decode close", a.decode.thread, a.decode.close),
            ("thread call", a.decode.thread, lambda: a.decode.thread.call(lambda: None)),
            ("thread close", a.prefill.thread, a.prefill.thread.close),
        ]
        for name, thread, call in calls:

            def on_trio_thread(
                thread: sync.TrioThread = thread, call: Callable[[], object] = call
            ) -> str:
                assert thread.in_trio_thread
                try:
                    call()
                except RuntimeError as exc:
                    return str(exc)
                return "returned"

            said = thread.call(on_trio_thread)
            assert "would deadlock" in said, (name, said)

        def non_blocking() -> tuple[KVPoll, KVPoll, list[int]]:
            sender.send(np.arange(4), last=True)
            return sender.poll(), receiver.poll(), a.decode.pop_released()

        assert a.prefill.thread.call(non_blocking)[0] in (
            KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success,
        )
        poll_until(lambda: receiver.poll() is KVPoll.Success)
        assert a.decode.statistics().succeeded == 1  # the facade still works


def test_poll_never_waits_for_the_trio_thread() -> None:
    """With the trio thread stuck for 0.5 s, poll(), failure, abort(), send() and
    pop_released() still return at once; a blocking call gives up at its bound, and the call
    it gave up on never runs."""
    with agents(decode_kw={"call_timeout": 0.1}) as a:
        sender, receiver = one_room(a, 3, send=False)
        a.decode.thread.post(time.sleep, 0.5)  # the decode trio thread is busy
        a.prefill.thread.post(time.sleep, 0.5)
        t = time.perf_counter()
        for _ in range(1000):
            receiver.poll()
            sender.poll()
            assert receiver.failure is None
        receiver.failure_exception()
        a.decode.pop_released()
        a.prefill.pop_released()
        sender.send(np.arange(2))
        took = time.perf_counter() - t
        # a room with a free id is made without waiting for the trio thread, on either side
        late = a.decode.receiver(9, bootstrap_url=a.boot.url)
        early = a.prefill.sender(10)
        early.init(2, 0)
        took = time.perf_counter() - t
        assert took < 0.1, f"the non-blocking calls took {took:.3f} s"
        # one that is in use needs the trio thread's answer: a hop, which gives up at its
        # bound; so does any other hop, and the call it gave up on never runs
        with pytest.raises(TransferTimeout, match="was not done"):
            a.decode.receiver(3, bootstrap_url=a.boot.url)
        ran: list[int] = []
        with pytest.raises(TransferTimeout, match="was not done"):
            a.decode.thread.call(ran.append, 9, timeout=0.1)
        assert time.perf_counter() - t < 0.4  # (they gave up at their bound, not after the stall)
        a.decode.thread.call(lambda: None, timeout=BOUND)  # (the stall is over)
        assert ran == []
        with pytest.raises(TransferError, match="still in use"):
            a.decode.receiver(3, bootstrap_url=a.boot.url)
        assert a.decode.statistics().rooms_active == 2
        assert a.prefill.statistics().rooms_active == 2  # (3 and 10)
        late.abort()
        early.abort()
        sender.send(np.arange(2, 4), last=True)
        poll_until(lambda: receiver.poll() is KVPoll.Success)
        assert (a.dst.kv[:, 4:8] == a.src.expected(3, 4)).all()


def test_abort_from_another_thread_and_the_rules_of_send() -> None:
    """send() checks its chunk on the caller's thread; an abort from another thread fails
    the room on both sides, and each side's pages come back through pop_released() once."""
    with agents() as a:
        sender, receiver = one_room(a, 7, send=False)
        for bad in (
            lambda: sender.send([0, 0]),  # repeated
            lambda: sender.send([a.src.spec.num_pages]),  # outside the pool
            lambda: sender.send(np.arange(5), last=True),  # past num_pages
            lambda: sender.send(np.arange(2), last=True),  # last, short of num_pages
            lambda: sender.init(4, 1),  # twice
            lambda: receiver.init(np.arange(2), 0),  # twice
            lambda: a.prefill.sender(8).send([0]),  # before init
            lambda: a.prefill.sender(8).init(1, a.src.spec.aux_slots),
        ):
            with pytest.raises(ProtocolError):
                bad()
        with pytest.raises(TransferError, match="still in use"):
            a.prefill.sender(7).init(4, 1)
        sender.send(np.arange(2))
        other = threading.Thread(target=receiver.abort, args=("the client went away",))
        other.start()
        other.join()
        poll_until(lambda: receiver.poll() is KVPoll.Failed and sender.poll() is KVPoll.Failed)
        assert isinstance(receiver.failure, TransferAborted)
        with pytest.raises(TransferAborted, match="the client went away"):
            receiver.failure_exception()
        popped: collections.Counter[str] = collections.Counter()

        def both_back() -> bool:
            popped.update(f"p{r}" for r in a.prefill.pop_released())
            popped.update(f"d{r}" for r in a.decode.pop_released())
            return len(popped) == 2

        poll_until(both_back)
        assert popped == {"p7": 1, "d7": 1}
        sender.send(np.arange(2, 4), last=True)  # a chunk for a failed room is dropped
        sender.abort()
        receiver.abort()  # idempotent
        time.sleep(0.05)
        assert a.prefill.pop_released() == [] and a.decode.pop_released() == []
        assert a.prefill.statistics().rooms_active == a.decode.statistics().rooms_active == 0


def test_an_abort_is_final_once_it_returns() -> None:
    """The room has succeeded and the trio thread has published it, but ``poll()`` has not
    returned it yet, when another thread aborts: ``abort()`` decides there and then. The
    room reads Failed from that call on, and its pages come out of ``pop_released()``,
    once. Before, Success stood (``poll()`` said Success after the abort) and the room never
    came out of ``pop_released()``: a scheduler that counted on it lost the pages. After
    ``poll()`` has returned Success, ``abort()`` does nothing: the pages are the
    scheduler's; nor once the trio thread has ended (nobody could hand them back)."""
    with agents() as a:
        _, receiver = one_room(a, 21)
        poll_until(lambda: receiver._final is not None)  # published; poll() not yet called
        threading.Thread(target=receiver.abort, args=("the client went away",)).start()
        poll_until(lambda: receiver._final is not None and receiver._final[0] is KVPoll.Failed)
        assert receiver.poll() is KVPoll.Failed
        assert isinstance(receiver.failure, TransferAborted)
        popped: list[int] = []
        poll_until(lambda: bool(popped.extend(a.decode.pop_released()) or popped))
        assert popped == [21]
        assert a.decode.statistics().released_unclaimed == 1

        _, receiver = one_room(a, 22)
        poll_until(lambda: receiver.poll() is KVPoll.Success)
        receiver.abort()
        assert receiver.poll() is KVPoll.Success and receiver.failure is None
        assert a.decode.statistics().released_unclaimed == 1  # (after a hop: nothing came)
        assert a.decode.pop_released() == []

        _, receiver = one_room(a, 23)
        poll_until(lambda: receiver._final is not None)  # published, unseen
        a.decode.close()
        a.decode.thread.close()
        receiver.abort()  # nobody is left to hand the pages back: it changes nothing
        assert receiver.poll() is KVPoll.Success and a.decode.pop_released() == []


def test_decode_pages_come_back_only_after_the_drain() -> None:
    """An abort from another thread while prefill's write is in the engine: decode's room
    fails at once, but its pages come out of pop_released() only after the write returned
    and prefill acked (they hold the whole write by then)."""
    fault: list[FaultEngine] = []

    def wrap(engine: Any) -> FaultEngine:
        fault.append(FaultEngine(engine, lambda i, peer, n: Fault("stall")))
        return fault[0]

    with agents(wrap=wrap) as a:
        try:
            _sender, receiver = one_room(a, 13)
            assert fault[0].stalls.wait_stalled(1, timeout=BOUND)
            other = threading.Thread(target=receiver.abort)
            other.start()
            other.join()
            poll_until(lambda: receiver.poll() is KVPoll.Failed)
            deadline = time.monotonic() + 0.3  # watch: nothing may come back meanwhile
            while time.monotonic() < deadline:
                assert a.decode.pop_released() == [] and a.prefill.pop_released() == []
                time.sleep(0.01)
        finally:
            fault[0].stalls.release_all()
        poll_until(lambda: a.decode.pop_released() == [13])
        assert (a.dst.kv[:, 4:8] == a.src.expected(13, 4)).all()  # the write had finished
        poll_until(lambda: a.prefill.pop_released() == [13])
        assert a.decode.statistics().acks_received == 1


def test_abort_before_init_fails_both_sides_at_once() -> None:
    """A sender aborted before init is Failed; the init that follows tells decode (its
    receiver fails now, not at the bootstrap deadline), and the room comes back once."""
    with agents() as a:
        sender = a.prefill.sender(11, epoch=5)
        sender.abort("dropped before prefill ran")
        poll_until(lambda: sender.poll() is KVPoll.Failed)
        sender.init(2, 0)
        receiver = a.decode.receiver(11, bootstrap_url=a.boot.url, epoch=5)
        poll_until(lambda: receiver.poll() is not KVPoll.Bootstrapping)
        receiver.init([0, 1], 0)
        poll_until(lambda: receiver.poll() is KVPoll.Failed, bound=5)
        got: list[int] = []
        poll_until(lambda: bool(got.extend(a.prefill.pop_released()) or got))
        assert got == [11]
        poll_until(lambda: a.decode.pop_released() == [11])
        assert "dropped before prefill ran" in str(sender.failure)


# ------------------------------------------------------------------ closing


def test_close_fails_open_rooms_and_stops_the_thread() -> None:
    """Closing a facade fails its open rooms, hands back what the close released (through
    the last pop_released()), and stops its own trio thread; a closed facade refuses new
    rooms, and its handles keep their final status."""
    with agents() as a:
        sender, receiver = one_room(a, 21, send=False)
        sender.send(np.arange(2))  # half of the room
        # prefill has decode's TRANSFER (init is posted: it may still be on its way). One
        # that reaches a closed agent is never answered, and decode then keeps the pages:
        # nothing proves that agent's engine, alive in this process, quiet.
        poll_until(lambda: sender.poll() is KVPoll.Transferring)
        t = time.perf_counter()
        a.prefill.close()
        assert time.perf_counter() - t < 5
        assert not a.prefill.thread.alive
        assert sender.poll() is KVPoll.Failed
        assert isinstance(sender.failure, TransferAborted) and "clos" in str(sender.failure)
        assert a.prefill.pop_released() == [21]  # every call returned: the pages are free
        assert a.prefill.statistics().rooms_active == 0  # (the final statistics)
        with pytest.raises(RuntimeError, match="closed"):
            a.prefill.sender(22).init(1, 0)
        sender.send(np.arange(2, 4), last=True)  # raises nothing, does nothing
        sender.abort()
        # prefill's goodbye (a Failed STATUS and an ack) fails and releases decode's room
        poll_until(lambda: receiver.poll() is KVPoll.Failed)
        poll_until(lambda: a.decode.pop_released() == [21])
        a.decode.close()
        a.decode.close()  # idempotent
        assert not a.decode.thread.alive
        with pytest.raises(RuntimeError, match="closed"):
            a.decode.receiver(23, bootstrap_url=a.boot.url)
        assert a.prefill.pop_released() == [] and a.decode.pop_released() == []


def test_decode_close_keeps_pages_a_write_may_still_reach() -> None:
    """A decode facade closing while prefill's write is stuck in the engine: the close
    waits at most DecodeConfig.close_timeout, the room fails, and its pages are *not*
    handed back (pop_released never returns it). Prefill's pages come back once the write
    returns."""
    fault: list[FaultEngine] = []

    def wrap(engine: Any) -> FaultEngine:
        fault.append(FaultEngine(engine, lambda i, peer, n: Fault("stall")))
        return fault[0]

    with agents(wrap=wrap, decode_kw={"config": DecodeConfig(close_timeout=0.5)}) as a:
        try:
            _sender, receiver = one_room(a, 31)
            assert fault[0].stalls.wait_stalled(1, timeout=BOUND)
            t = time.perf_counter()
            a.decode.close()
            took = time.perf_counter() - t
            assert 0.5 <= took < 5, took
            assert receiver.poll() is KVPoll.Failed
            assert a.decode.pop_released() == []
            assert a.decode.statistics().rooms_unproven_at_close == 1
            assert a.prefill.pop_released() == []  # still read by the stuck write
        finally:
            fault[0].stalls.release_all()
        a.prefill.close()  # (waits for the write; it fails: decode's memory is deregistered)
        assert a.prefill.pop_released() == [31]
    assert a.decode.pop_released() == []


def test_shared_thread_outlives_its_services() -> None:
    """Three services on one trio thread: each closes on its own, the thread runs on until
    it is closed."""
    with agents(shared=True) as a:
        assert a.prefill.thread is a.decode.thread
        _sender, receiver = one_room(a, 41)
        poll_until(lambda: receiver.poll() is KVPoll.Success)
        poll_until(lambda: a.prefill.pop_released() == [41])
        a.decode.close()
        assert a.decode.statistics().rooms_active == 0  # (what it closed with: it has closed)
        assert a.prefill.thread.alive
        assert a.prefill.statistics().succeeded == 1
    assert not a.prefill.thread.alive


def test_a_failed_start_raises_and_leaves_no_thread() -> None:
    before = {t.name for t in threading.enumerate()}
    with make_engine("mooncake") as engine, sync.open_bootstrap_server() as boot:
        pool = host_pool()
        with pytest.raises(ConfigurationError):
            sync.open_prefill(engine=engine, pool=pool.spec, bootstrap_url=boot.url, kv_heads=3)
        assert {t.name for t in threading.enumerate()} - before == {"trio_pd-bootstrap"}


def test_poll_never_moves_back_when_two_threads_poll_one_handle() -> None:
    """Thread A reads WaitingForInput and is preempted right before it raises the handle's
    floor; thread B reads Transferring and raises it; A then wrote its older status over
    B's, and once the room ended on the trio side (terminal, not yet published: poll
    answers the floor) B saw WaitingForInput after Transferring. The read and the raise
    are now one step under a lock (held for a few loads, never across a wait)."""
    import inspect
    import sys as _sys

    class Inner:
        status = KVPoll.WaitingForInput

        def _status(self) -> KVPoll:  # (what the facade reads: it delivers nothing)
            return self.status

    handle = sync.SyncReceiver.__new__(sync.SyncReceiver)
    sync._Handle.__init__(handle, None, 1)  # type: ignore[arg-type]
    inner = Inner()
    handle._inner = inner  # type: ignore[assignment]
    code = sync._Handle.poll.__code__
    lines, first = inspect.getsourcelines(sync._Handle.poll)
    write = first + next(i for i, text in enumerate(lines) if "self._floor = live" in text)
    at_write, go = threading.Event(), threading.Event()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is code:
            if event == "line" and frame.f_lineno == write:
                at_write.set()
                go.wait(5)
            return tracer
        return None

    def a() -> None:
        _sys.settrace(tracer)
        try:
            handle.poll()
        finally:
            _sys.settrace(None)

    seen: list[KVPoll] = []
    ta = threading.Thread(target=a)
    ta.start()
    assert at_write.wait(5)  # A read WaitingForInput and is about to raise the floor
    inner.status = KVPoll.Transferring
    tb = threading.Thread(target=lambda: seen.append(handle.poll()))
    tb.start()
    tb.join(0.3)  # (with the lock, B waits for A here)
    go.set()
    ta.join(5)
    tb.join(5)
    inner.status = KVPoll.Success  # ended on the trio side, not yet published
    seen.append(handle.poll())
    assert seen == [KVPoll.Transferring, KVPoll.Transferring], seen


class _CountingToken:
    """A TrioToken stand-in that counts ``run_sync_soon`` calls (each one a wake-up of the
    trio thread) and passes them on."""

    def __init__(self, token: Any) -> None:
        self.token, self.calls = token, 0

    def run_sync_soon(self, fn: Callable[..., object], *args: Any) -> None:
        self.calls += 1
        self.token.run_sync_soon(fn, *args)


def test_calls_made_before_the_trio_thread_drains_share_one_wakeup() -> None:
    """Posts and hops go through one inbox that the trio thread drains whole: 100 posts made
    while the trio thread is busy wake it once, and run in the order posted, before a hop
    made after them."""
    thread = sync.TrioThread("test-inbox")
    busy, go = threading.Event(), threading.Event()
    try:

        def hold() -> None:  # (blocks the trio thread: a test's stand-in for a busy loop)
            busy.set()
            go.wait(10)

        assert thread.post(hold)
        assert busy.wait(10)
        counting = _CountingToken(thread._token)
        thread._token = counting  # type: ignore[assignment]
        ran: list[int] = []
        for i in range(100):
            assert thread.post(ran.append, i)
        assert counting.calls == 1, counting.calls
        go.set()
        assert thread.call(lambda: list(ran)) == list(range(100))
    finally:
        go.set()
        thread.close()


def test_a_room_made_on_the_trio_side_meanwhile_fails_the_facade_room() -> None:
    """``init`` of a free room id does not wait for the trio thread; if trio-side code makes
    a room with that id before the creation runs there, the facade's room fails with the
    agent's reason (poll() Failed, TransferError "still in use"), its chunks are dropped
    (its pages never become trio_pd's), and it comes out of pop_released once; the other
    room is left alone. A second init of an id held meanwhile is answered exactly (a hop)."""
    with agents(prefill_kw={"call_timeout": 5.0}) as a:
        go = threading.Event()
        theirs: list[Any] = []

        def trio_side() -> None:  # (on the trio thread: the agent's own API)
            go.wait(5)
            theirs.append(a.prefill.agent.sender(7, num_pages=1, aux_slot=0))

        assert a.prefill.thread.post(trio_side)
        sender = a.prefill.sender(7)
        sender.init(1, 0)  # (returns while the trio thread is held: nothing waits)
        go.set()
        sender.send(np.arange(1), last=True)
        poll_until(lambda: sender.poll() is KVPoll.Failed)
        assert isinstance(sender.failure, TransferError)
        assert "still in use" in str(sender.failure)
        poll_until(lambda: a.prefill.pop_released() == [7])
        assert theirs and theirs[0].poll() is not KVPoll.Failed  # (the trio-side room stands)
        with pytest.raises(TransferError, match="still in use"):
            a.prefill.sender(7).init(1, 0)  # (held: the trio thread's exact answer)
        theirs[0].abort_from_thread("test over")
        assert a.prefill.pop_released() == []
