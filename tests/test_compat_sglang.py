"""trio_pd.compat.sglang: scheduler loops written against SGLang's connector API drive
trio_pd unchanged.

Memory is laid out the way SGLang allocates it: one array per K and per V layer buffer, one
per metadata buffer (output ids, logprobs, hidden states), their raw pointers handed over in a
KVArgs. The scheduler loops are SGLang's, reduced: create the sender / receiver, poll until
WaitingForInput, ``init`` / ``send_metadata``, send chunks until the total, poll every step
until Success or Failed, ``failure_exception()`` on Failed, ``clear()``. They run on plain
threads while a third aborts requests. Real engines, real ZeroMQ, the real bootstrap service,
page and slot allocators with the lifetime sanitizer of :mod:`trio_pd.testing.pools`.
"""

from __future__ import annotations

import collections
import enum
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import trio_pd
import trio_pd.io._cuda
from trio_pd import (
    ConfigurationError,
    DecodeConfig,
    PrefillConfig,
    ProtocolError,
    TransferAborted,
    TransferError,
)
from trio_pd.compat import sglang
from trio_pd.compat.sglang import (
    LANDING_BYTES,
    LANDING_ENV,
    AuxRows,
    KVArgs,
    KVBootstrapServer,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    config_from_env,
    pool_from_kvargs,
    states_from_kvargs,
)
from trio_pd.core._memory import MemoryKind
from trio_pd.engines import make_engine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.testing.pools import DEST_POISON, SOURCE_POISON, PageAllocator

from .helpers.sglang import (
    LAYERS,
    PAGE_SIZE,
    Memory,
    SplitRows,
    States,
    StateType,
    kv_pattern,
    server_args,
)
from .helpers.threads import aborter, guarded, poll_until  # (any books with the fields they use)


@pytest.fixture(autouse=True)
def _frees_on_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests drive the adapter as a scheduler that frees a request's pages when
    poll() says Failed: SGLang with its deferred decode KV release off. (The deferred
    release itself: tests/sglang, against SGLang's own scheduler code.)"""
    monkeypatch.setenv(sglang.DEFERRED_RELEASE_ENV, "0")


@pytest.fixture(autouse=True)
def _cluster_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Security is on, and SGLang's processes share the token through the environment:
    so do these tests (one process here, but the adapter asks for it as for several)."""
    monkeypatch.setenv("TRIO_PD_TOKEN", "sglang-test-cluster-token")
    monkeypatch.delenv("TRIO_PD_SECURE", raising=False)


def test_sglang_without_a_shared_token_says_how_to_share_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's bootstrap service, prefill and decode ranks are separate processes: a token
    made in one is known to no other, so without ``TRIO_PD_TOKEN`` (or security turned
    off explicitly) the adapter refuses at once, naming the variable."""
    monkeypatch.delenv("TRIO_PD_TOKEN")
    with pytest.raises(trio_pd.ConfigurationError, match="TRIO_PD_TOKEN"):
        KVBootstrapServer("127.0.0.1", 0)
    assert sglang.shared_token_problem({}, "x") is not None
    assert sglang.shared_token_problem({"token": "t"}, "x") is None
    assert sglang.shared_token_problem({"secure": False}, "x") is None
    monkeypatch.setenv("TRIO_PD_SECURE", "0")
    assert sglang.shared_token_problem({}, "x") is None


def _abort_as_sglang(handle: Any) -> None:
    handle.abort()  # (SGLang's schedulers call abort() with no reason)

BOUND = 20.0
TERMINAL = (KVPoll.Success, KVPoll.Failed)



class Mode(enum.Enum):  # (SGLang passes its own enum: anything with .value works)
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Side:
    prefill: KVManager
    decode: KVManager
    src: Memory
    dst: Memory
    boot: KVBootstrapServer
    #: the state buffers of each side (:class:`States`), when the pair has them
    src_states: States | None = None
    dst_states: States | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.boot.port}"  # as SGLang's decode forms bootstrap_addr


@contextmanager
def pair(
    engine_name: str = "mooncake", *, num_pages: int = 64, aux_slots: int = 16,
    wrap: Callable[[Any], Any] | None = None, decode_frees_on_terminal: bool = True,
    decode_config: DecodeConfig | None = None, states: bool = False,
) -> Iterator[Side]:
    """A bootstrap service, a prefill and a decode manager over SGLang-shaped memory and two
    real engines (closed last); ``states``: with a Mamba and an SWA state type each
    (:class:`States`, ``aux_slots`` Mamba slots)."""
    src = Memory(num_pages=num_pages, heads=2, aux_slots=aux_slots)
    dst = Memory(num_pages=num_pages, heads=2, aux_slots=aux_slots)
    st = ((States(slots=aux_slots, poison=SOURCE_POISON),
           States(slots=aux_slots, poison=DEST_POISON)) if states else (None, None))
    with ExitStack() as stack:
        pe = stack.enter_context(make_engine(engine_name))
        de = stack.enter_context(make_engine(engine_name))
        boot = stack.enter_context(KVBootstrapServer("127.0.0.1", 0))
        src_args, dst_args = src.kvargs(), dst.kvargs()
        if st[0] is not None and st[1] is not None:
            src_args, dst_args = st[0].add_to(src_args), st[1].add_to(dst_args)
        prefill = stack.enter_context(KVManager(
            src_args, Mode.PREFILL, server_args(), False,
            engine=wrap(pe) if wrap else pe, bootstrap_url=boot.url,
        ))
        decode = stack.enter_context(KVManager(
            dst_args, "decode", server_args(), False, engine=de,
            free_on_terminal=decode_frees_on_terminal, config=decode_config,
        ))
        yield Side(prefill, decode, src, dst, boot, *st)


# ------------------------------------------------------------------ the scheduler loops

N_REQUESTS = 200
ABORT_RATE = 0.3
CONCURRENCY = 16
STEP = 0.001


@dataclass(frozen=True)
class Request:
    index: int
    room: int
    npages: int
    chunk: int
    abort: str | None  # which side's handle the aborter aborts
    #: the handle goes to the aborter once its pages were handed over (init /
    #: send_metadata), else as soon as it exists
    late: bool
    abort_after: float


def plan(seed: int) -> list[Request]:
    rng = random.Random(seed)
    rooms = rng.sample(range(1, 1 << 62), N_REQUESTS)  # SGLang draws random room ids
    aborted = set(rng.sample(range(N_REQUESTS), int(N_REQUESTS * ABORT_RATE)))
    out = []
    for i in range(N_REQUESTS):
        side = rng.choice(("prefill", "decode")) if i in aborted else None
        late = rng.random() < 0.5
        if late:
            after = rng.uniform(0.0, 0.012)  # often while the KV is being written
        else:
            after = rng.uniform(0.0, 0.03) if rng.random() < 0.85 else 0.2
        out.append(Request(i, rooms[i], rng.randint(1, 12), rng.randint(1, 5), side, late,
                           after))
    return out


@dataclass
class Books:
    errors: list[BaseException] = field(default_factory=list)
    handles: queue.SimpleQueue[tuple[str, Request, Any]] = field(
        default_factory=queue.SimpleQueue)
    aborted: set[int] = field(default_factory=set)
    abort_points: collections.Counter[str] = field(default_factory=collections.Counter)
    prefill_outcome: dict[int, KVPoll] = field(default_factory=dict)
    decode_outcome: dict[int, KVPoll] = field(default_factory=dict)
    #: rooms whose pages (and slot) the scheduler freed after handing them over, and how often
    prefill_freed: collections.Counter[int] = field(default_factory=collections.Counter)
    decode_failed_freed: collections.Counter[int] = field(default_factory=collections.Counter)
    prefill_inited: set[int] = field(default_factory=set)
    decode_given: set[int] = field(default_factory=set)
    verified: int = 0
    corrupt: list[int] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


def take(slots: PageAllocator, pages: PageAllocator, n: int) -> tuple[Any, Any] | None:
    """A metadata slot and ``n`` pages, as the loops' allocators hand them out, or None (and
    nothing held) when either is short now."""
    slot = slots.alloc_nowait(1)
    ids = pages.alloc_nowait(n) if slot is not None else None
    if ids is None or slot is None:
        if slot is not None:
            slots.free(slot)
        return None
    return ids, slot


@dataclass
class _P:
    req: Request
    sender: KVSender
    pages: npt.NDArray[np.int64] | None = None
    slot: npt.NDArray[np.int64] | None = None
    sent: int = 0
    held: list[npt.NDArray[np.int64]] = field(default_factory=list)  # state slots


def _take_states(states: States | None, npages: int, pages: PageAllocator,
                 slots: PageAllocator, taken: tuple[Any, Any]) -> list[Any] | None:
    """The request's state slots (none without states), or None after handing the pages
    and slot just taken back when a state type is short now."""
    held = states.take(npages) if states is not None else []
    if held is None:
        pages.free(taken[0])
        slots.free(taken[1])
    return held


def prefill_loop(mgr: KVManager, mem: Memory, addr: str, reqs: list[Request], books: Books,
                 pages: PageAllocator, slots: PageAllocator, deadline: float,
                 states: States | None = None) -> None:
    """SGLang's prefill scheduler, reduced: a bootstrap queue (sender made, polled until
    WaitingForInput, then a metadata slot and pages, the KV and metadata written, ``init``),
    one chunk per request per step, the last one bringing the total to the pages given to
    init, and every request polled each step; on Success or Failed its pages and slot are
    freed at once, as SGLang's loop does. ``states``: each request also takes its state
    slots, writes them, and names them in the last chunk's ``state_indices``; they are
    freed with the pages."""
    pending = collections.deque(reqs)
    queued: dict[int, _P] = {}
    running: dict[int, _P] = {}
    while pending or queued or running:
        assert time.monotonic() < deadline, f"prefill: {len(queued) + len(running)} hung"
        while pending and len(queued) + len(running) < CONCURRENCY:
            req = pending.popleft()
            sender = KVSender(mgr, addr, req.room)
            queued[req.room] = _P(req, sender)
            if not req.late:
                books.handles.put(("prefill", req, sender))
        for room, st in list(queued.items()):
            status = st.sender.poll()
            if status == KVPoll.Failed:  # aborted before init: nothing was handed over
                books.prefill_outcome[room] = status
                del queued[room]
            elif status == KVPoll.WaitingForInput:
                taken = take(slots, pages, st.req.npages)
                if taken is None:
                    continue
                held = _take_states(states, st.req.npages, pages, slots, taken)
                if held is None:
                    continue
                st.pages, st.slot = ids, slot = taken
                st.held = held
                mem.fill(room, ids, int(slot[0]))
                if states is not None:
                    states.fill(room, held)
                st.sender.init(st.req.npages, aux_index=int(slot[0]))
                books.prefill_inited.add(room)
                if st.req.late:
                    books.handles.put(("prefill", st.req, st.sender))
                running[room] = queued.pop(room)
        for room, st in list(running.items()):
            assert st.pages is not None and st.slot is not None
            if st.sent < st.req.npages:
                end = min(st.sent + st.req.chunk, st.req.npages)
                chunk = st.pages[st.sent:end].astype(np.int32)  # (SGLang's dtype)
                if states is not None and end == st.req.npages:  # the last chunk
                    st.sender.send(chunk, state_indices=states.indices(st.held))
                else:
                    st.sender.send(chunk)
                st.sent = end
            status = st.sender.poll()
            if status in TERMINAL:
                if status == KVPoll.Failed:
                    with pytest.raises(TransferError):
                        st.sender.failure_exception()
                st.sender.clear()
                pages.free(st.pages)
                slots.free(st.slot)
                if states is not None:
                    states.free(st.held)
                books.prefill_freed[room] += 1
                books.prefill_outcome[room] = status
                del running[room]
        time.sleep(STEP)


@dataclass
class _D:
    req: Request
    receiver: KVReceiver
    pages: npt.NDArray[np.int64] | None = None
    slot: npt.NDArray[np.int64] | None = None
    held: list[npt.NDArray[np.int64]] = field(default_factory=list)  # state slots


def decode_loop(mgr: KVManager, mem: Memory, addr: str, reqs: list[Request], books: Books,
                pages: PageAllocator, slots: PageAllocator, deadline: float,
                states: States | None = None) -> None:
    """SGLang's decode scheduler, reduced: a receiver per request (half ``init(0)``, the
    newer form), polled until WaitingForInput, then pages and a slot and ``send_metadata``
    (or the older ``init(kv_indices, aux_index)``); every request polled each step. On
    Success the KV and every metadata row are checked and freed. On Failed: freed at once
    when the manager frees on terminal, else once ``pop_released()`` returns the room.
    ``states``: each request also takes its state slots and names them in
    ``state_indices`` (the older ``init`` positionally); every byte of them is checked on
    Success, and they are freed with the pages."""
    on_terminal = mgr.free_on_terminal
    pending = collections.deque(reqs)
    queued: dict[int, _D] = {}
    transfer: dict[int, _D] = {}
    failed: dict[int, _D] = {}  # failed holding pages, waiting for pop_released
    while pending or queued or transfer or failed:
        assert time.monotonic() < deadline, f"decode: {len(queued) + len(transfer)} hung"
        while pending and len(queued) + len(transfer) + len(failed) < CONCURRENCY:
            req = pending.popleft()
            receiver = KVReceiver(mgr, addr, req.room)
            receiver.init(0)  # (SGLang picks the prefill DP rank before anything else)
            queued[req.room] = _D(req, receiver)
            if not req.late:
                books.handles.put(("decode", req, receiver))
        for room, d in list(queued.items()):
            status = d.receiver.poll()
            if status == KVPoll.Failed:
                books.decode_outcome[room] = status
                del queued[room]
            elif status == KVPoll.WaitingForInput:
                taken = take(slots, pages, d.req.npages)
                if taken is None:
                    continue
                held = _take_states(states, d.req.npages, pages, slots, taken)
                if held is None:
                    continue
                d.pages, d.slot = ids, slot = taken
                d.held = held
                extra = [States.indices(held)] if states is not None else []
                if d.req.index % 2:
                    d.receiver.send_metadata(ids.astype(np.int32), int(slot[0]), *extra)
                else:  # the older form
                    d.receiver.init(ids.astype(np.int32), int(slot[0]), *extra)
                books.decode_given.add(room)
                if d.req.late:
                    books.handles.put(("decode", d.req, d.receiver))
                transfer[room] = queued.pop(room)
        for room, d in list(transfer.items()):
            assert d.pages is not None and d.slot is not None
            status = d.receiver.poll()
            if status == KVPoll.Success:
                if mem.holds(room, d.pages, int(d.slot[0])) and (
                    states is None or states.holds(room, d.held)
                ):
                    books.verified += 1
                else:
                    books.corrupt.append(room)
                d.receiver.clear()
                pages.free(d.pages)
                slots.free(d.slot)
                if states is not None:
                    states.free(d.held)
                books.decode_outcome[room] = status
                del transfer[room]
            elif status == KVPoll.Failed:
                with pytest.raises(TransferError):
                    d.receiver.failure_exception()
                d.receiver.clear()
                books.decode_outcome[room] = status
                del transfer[room]
                if on_terminal:
                    pages.free(d.pages)
                    slots.free(d.slot)
                    if states is not None:
                        states.free(d.held)
                    books.decode_failed_freed[room] += 1
                else:
                    failed[room] = d
        if not on_terminal:
            for room in mgr.pop_released():
                d = failed.pop(room) if room in failed else transfer.pop(room)  # KeyError: not held
                assert d.receiver.poll() == KVPoll.Failed and d.pages is not None
                assert d.slot is not None
                books.decode_outcome[room] = KVPoll.Failed
                pages.free(d.pages)
                slots.free(d.slot)
                if states is not None:
                    states.free(d.held)
                books.decode_failed_freed[room] += 1
        time.sleep(STEP)


def slow_writes(index: int, _peer: str, _n: int) -> Fault | None:
    """One write in three waits 10 ms first: aborts often land while a write is under way."""
    return Fault("delay_before", delay_s=0.01) if index % 3 == 0 else None


@pytest.mark.parametrize("decode_frees", ["pop_released", "on_terminal"])
def test_sglang_loops_move_requests_with_aborts(engine_name: str, decode_frees: str) -> None:
    """SGLang-shaped prefill and decode loops on plain threads move 200 requests while a
    third thread aborts 30% of them at random points. Every Success holds exactly what
    prefill wrote, in every KV buffer and every metadata buffer; no page or slot leaks or is
    written after it was freed; every room handed over is freed exactly once (decode: each
    failed one, through pop_released or on its Failed poll)."""
    run_loops(engine_name, decode_frees)


@pytest.mark.parametrize("decode_frees", ["pop_released", "on_terminal"])
def test_sglang_loops_move_state_slots_with_aborts(engine_name: str, decode_frees: str) -> None:
    """The same loops over a pool with a Mamba and a sliding-window state type: every
    request names its state slots in ``state_indices`` (prefill's last ``send``, decode's
    ``send_metadata`` or older ``init``). Every Success holds every byte prefill wrote in
    each of its state slots, of every buffer of both types; every state slot is freed
    exactly once with its pages, and no freed slot is written (its poison intact), while
    30% of the requests are aborted from the third thread."""
    s = run_loops(engine_name, decode_frees, states=True)
    assert [st.split for st in s.decode.pool.states] == ["segments", "rank"]


def run_loops(engine_name: str, decode_frees: str, *, states: bool = False) -> Side:
    """Run :func:`prefill_loop` and :func:`decode_loop` on threads, :func:`aborter` on a
    third, over :func:`pair` (with its state types when ``states``), and check what the
    loop tests promise. Returns the (closed) pair."""
    reqs = plan(seed=15)
    books = Books()
    with pair(engine_name, num_pages=256, aux_slots=48, wrap=lambda e: FaultEngine(e, slow_writes),
              decode_frees_on_terminal=decode_frees == "on_terminal", states=states) as s:
        src_pages = PageAllocator(SplitRows(s.src.pages), SOURCE_POISON)
        dst_pages = PageAllocator(SplitRows(s.dst.pages), DEST_POISON)
        # a slot is each metadata buffer's row and the adapter's own aux row
        src_slots = PageAllocator(SplitRows([*s.src.slots, s.prefill.aux.rows]), SOURCE_POISON)
        dst_slots = PageAllocator(SplitRows([*s.dst.slots, s.decode.aux.rows]), DEST_POISON)
        started = time.monotonic()
        deadline = started + 45
        loops = [
            threading.Thread(target=guarded(books, prefill_loop, s.prefill, s.src, s.addr, reqs,
                                            books, src_pages, src_slots, deadline,
                                            s.src_states)),
            threading.Thread(target=guarded(books, decode_loop, s.decode, s.dst, s.addr, reqs,
                                            books, dst_pages, dst_slots, deadline,
                                            s.dst_states)),
        ]
        second = threading.Thread(target=guarded(books, aborter, books, _abort_as_sglang))
        for t in [*loops, second]:
            t.start()
        for t in loops:
            t.join(50)
        books.done.set()
        second.join(10)
        assert not books.errors, books.errors
        p, d = s.prefill.statistics(), s.decode.statistics()
        assert p.rooms_active == d.rooms_active == 0
        assert p.leases_live == p.leases_quarantined == 0 and d.pages_held == 0
        # the adapter's decode rank lands scattered pages (a landing area by default)
        assert d.rooms_landed > 0 and d.landing_held == 0, d
        moved = time.monotonic() - started
    rooms = {r.room for r in reqs}
    planned = {r.room for r in reqs if r.abort}
    assert books.aborted == planned
    assert set(books.prefill_outcome) == set(books.decode_outcome) == rooms
    assert books.corrupt == []
    succeeded = {r for r, st in books.decode_outcome.items() if st == KVPoll.Success}
    assert books.verified == len(succeeded) >= N_REQUESTS - len(planned)
    failed = {r for r, st in books.decode_outcome.items() if st == KVPoll.Failed}
    assert failed <= planned and len(failed) >= len(planned) // 2
    # every room handed over is freed exactly once
    assert books.prefill_freed == collections.Counter(books.prefill_inited)
    assert books.decode_failed_freed == collections.Counter(books.decode_given & failed)
    for alloc in (src_pages, src_slots, dst_pages, dst_slots):
        assert alloc.outstanding == 0
        assert alloc.late_writes == 0 and alloc.late_in_free_rows() == 0
    for side in (s.src_states, s.dst_states):
        # every state slot back once, none written after it was freed
        assert side is None or side.clean()
    assert len(books.abort_points) >= 3
    print(f"{N_REQUESTS} requests, {len(failed)} failed by aborts, in {moved:.2f} s;",
          dict(books.abort_points))
    return s


# ------------------------------------------------------------------ the release gate


def _stalled(fault: list[FaultEngine]) -> Callable[[Any], FaultEngine]:
    def wrap(engine: Any) -> FaultEngine:
        fault.append(FaultEngine(engine, lambda i, peer, n: Fault("stall")))
        return fault[0]

    return wrap


def _one_room(s: Side, room: int, npages: int = 4) -> tuple[KVSender, KVReceiver]:
    pages = np.arange(npages)
    s.src.fill(room, pages, 1)
    sender = KVSender(s.prefill, s.addr, room)
    sender.init(npages, 1)
    receiver = KVReceiver(s.decode, s.addr, room)
    receiver.init(0)  # (SGLang picks the prefill DP rank first)
    poll_until(lambda: receiver.poll() == KVPoll.WaitingForInput)
    receiver.send_metadata(pages + npages, 2)
    sender.send(pages[:1])
    sender.send(pages[1:])
    return sender, receiver


def test_sglang_sender_streams_layers(engine_name: str) -> None:
    """``KVSender.send(layers=)`` (trio_pd's layer-wise streaming through the adapter): a
    chunk's layers sent one at a time, the send that completes every layer is the last
    (it carries the metadata rows); a layer of a page sent again is refused."""
    with pair(engine_name) as s:
        room, n = 93, 4
        pages = np.arange(n)
        s.src.fill(room, pages, 1)
        sender = KVSender(s.prefill, s.addr, room)
        sender.init(n, 1)
        receiver = KVReceiver(s.decode, s.addr, room)
        receiver.init(0)
        poll_until(lambda: receiver.poll() == KVPoll.WaitingForInput)
        receiver.send_metadata(pages + n, 2)
        for chunk in (pages[:2], pages[2:]):
            for layer in range(LAYERS):
                sender.send(chunk, layers=range(layer, layer + 1))
                if layer == 0 and chunk[0] == 0:
                    with pytest.raises(ProtocolError):
                        sender.send(chunk, layers=range(0, 1))
        poll_until(lambda: receiver.poll() == KVPoll.Success)
        assert s.dst.holds(room, pages + n, 2)
        poll_until(lambda: sender.poll() == KVPoll.Success)


def _watch(what: Callable[[], object], want: object, seconds: float = 0.3) -> None:
    """``what()`` keeps returning ``want`` for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert what() == want
        time.sleep(0.01)


def test_decode_abort_is_failed_at_once_and_held_until_the_drain(
    engine_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang 0.5.23's deferred decode KV release: a receiver aborted while prefill's write
    is inside the engine says Failed at once (SGLang's scheduler then holds the pages), and
    the manager's is_abort_release_safe stays False until trio_pd drained the room."""
    monkeypatch.setenv(sglang.DEFERRED_RELEASE_ENV, "1")
    monkeypatch.setenv(sglang.DEFERRED_RELEASE_TIMEOUT_ENV, "inf")
    fault: list[FaultEngine] = []
    with pair(engine_name, wrap=_stalled(fault)) as s:
        try:
            _sender, receiver = _one_room(s, 78)
            assert fault[0].stalls.wait_stalled(1, timeout=BOUND)
            receiver.abort()
            assert receiver.poll() == KVPoll.Failed  # at once, as SGLang's receiver
            assert receiver.abort_notified
            _watch(lambda: s.decode.is_abort_release_safe(78, 1), False)
        finally:
            fault[0].stalls.release_all()
        poll_until(lambda: s.decode.is_abort_release_safe(78, 1))
        s.decode.clear_deferred_abort_state(78)
        assert s.decode.released_before_drain == 0


def test_decode_abort_before_success_was_polled_fails_the_request_and_frees_at_once(
    engine_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SGLang's deferred release: a request whose KV has all arrived but whose Success
    poll() has not returned is the scheduler's to give up. Aborted, it reads Failed (what
    SGLang's scheduler then sees), its pages are held for the release check, and that check
    says safe at once, with no drain: every write had landed before Success, so trio_pd
    hands the pages back unclaimed."""
    monkeypatch.setenv(sglang.DEFERRED_RELEASE_ENV, "1")
    monkeypatch.setenv(sglang.DEFERRED_RELEASE_TIMEOUT_ENV, "inf")
    with pair(engine_name) as s:
        _sender, receiver = _one_room(s, 83)
        poll_until(lambda: s.decode.statistics().succeeded == 1)  # done, not yet polled
        receiver.abort()
        assert receiver.poll() == KVPoll.Failed
        with pytest.raises(TransferAborted):
            receiver.failure_exception()
        assert receiver.abort_notified
        poll_until(lambda: s.decode.is_abort_release_safe(83, 1))
        assert s.decode.statistics().released_unclaimed == 1
        assert s.decode.statistics().acks_received == 0  # no drain was needed
        s.decode.clear_deferred_abort_state(83)
        assert s.decode.released_before_drain == 0


def test_decode_abort_after_success_was_polled_changes_nothing(
    engine_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once poll() has returned Success the pages are the scheduler's: an abort then leaves
    Success standing, arms no deferred release and hands nothing back."""
    monkeypatch.setenv(sglang.DEFERRED_RELEASE_ENV, "1")
    monkeypatch.setenv(sglang.DEFERRED_RELEASE_TIMEOUT_ENV, "inf")
    with pair(engine_name) as s:
        _sender, receiver = _one_room(s, 84)
        poll_until(lambda: receiver.poll() == KVPoll.Success)
        receiver.abort()
        receiver.ensure_abort_notified(force_arm=True)
        assert receiver.poll() == KVPoll.Success
        assert receiver.failure is None
        assert not receiver.abort_notified
        assert s.decode.is_abort_release_safe(84, 1)
        _watch(lambda: s.decode.statistics().released_unclaimed, 0)
        assert s.dst.holds(84, np.arange(4, 8), 2)


def test_prefill_poll_is_bootstrapping_until_decode_sent_its_metadata(engine_name: str) -> None:
    """SGLang's back-pressure: a prefill sender says Bootstrapping (its bootstrap queue
    holds the request) until decode has sent the request's metadata, then WaitingForInput."""
    with pair(engine_name) as s:
        sender = KVSender(s.prefill, s.addr, 79)
        receiver = KVReceiver(s.decode, s.addr, 79)
        receiver.init(0)
        poll_until(lambda: receiver.poll() == KVPoll.WaitingForInput)  # decode registered
        _watch(sender.poll, KVPoll.Bootstrapping)
        receiver.send_metadata(np.arange(2), 1)
        poll_until(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.init(2, 1)
        sender.send(np.arange(2))
        poll_until(lambda: receiver.poll() == KVPoll.Success)


def test_prefill_poll_holds_failure_until_the_source_pages_are_free(engine_name: str) -> None:
    """A sender aborted while its write is inside the engine reads Transferring, not Failed,
    until the write returned and trio_pd handed its source pages back: SGLang's loop frees
    them on Failed."""
    fault: list[FaultEngine] = []
    with pair(engine_name, wrap=_stalled(fault)) as s:
        try:
            sender, receiver = _one_room(s, 77)
            assert fault[0].stalls.wait_stalled(1, timeout=BOUND)
            sender.abort()
            poll_until(lambda: sender.failure is not None)  # trio_pd has failed the room
            _watch(sender.poll, KVPoll.Transferring)
        finally:
            fault[0].stalls.release_all()
        poll_until(lambda: sender.poll() == KVPoll.Failed)
        poll_until(lambda: receiver.poll() == KVPoll.Failed)


@pytest.mark.parametrize("on_terminal", [True, False])
def test_decode_failure_waits_for_the_drain(engine_name: str, on_terminal: bool) -> None:
    """A receiver aborted while prefill's write is inside the engine: freeing on terminal, it
    reads Transferring until no prefill rank can write its pages, then Failed; otherwise it
    reads Failed at once and its pages come out of pop_released() only after the drain."""
    fault: list[FaultEngine] = []
    with pair(engine_name, wrap=_stalled(fault), decode_frees_on_terminal=on_terminal) as s:
        try:
            _sender, receiver = _one_room(s, 78)
            assert fault[0].stalls.wait_stalled(1, timeout=BOUND)
            receiver.abort()
            poll_until(lambda: receiver.failure is not None)
            if on_terminal:
                _watch(receiver.poll, KVPoll.Transferring)
                with pytest.raises(RuntimeError, match="free_on_terminal"):
                    s.decode.pop_released()
            else:
                assert receiver.poll() == KVPoll.Failed
                _watch(s.decode.pop_released, [])
        finally:
            fault[0].stalls.release_all()
        if on_terminal:
            poll_until(lambda: receiver.poll() == KVPoll.Failed)
        else:
            poll_until(lambda: s.decode.pop_released() == [78])
        # the stalled write has landed by now, whole
        want = kv_pattern(78, len(s.dst.kv), 4, 0, 2)
        assert all((rows[4:8] == want[b]).all() for b, rows in enumerate(s.dst.pages))


def test_success_shows_only_with_the_metadata_in_place(engine_name: str) -> None:
    """The first poll() that says Success finds the metadata in every metadata buffer at the
    receiver's slot; natively (the default) the adapter's row is the stamp alone and the
    metadata buffers are the pool's further aux buffers, written in place."""
    with pair(engine_name) as s:
        _sender, receiver = _one_room(s, 79)
        poll_until(lambda: receiver.poll() == KVPoll.Success)
        assert s.dst.holds(79, np.arange(4, 8), 2)
        aux = s.decode.aux
        assert aux.native and aux.offsets == () and aux.row_len == 16
        assert aux.bytes_per_request == 0  # nothing copied
        assert s.decode.pool.extra_aux == tuple(
            (int(m.ctypes.data), int(r.shape[1]))
            for m, r in zip(s.dst.meta, s.dst.slots, strict=True))


def test_an_abort_in_the_bootstrap_queue_fails_decode_at_once(engine_name: str) -> None:
    """A sender aborted before init (SGLang's bootstrap queue then drops the request and
    never calls init) fails decode's request within a moment, not at its waiting deadline;
    an init and chunks after the abort are taken and dropped, and nothing is held."""
    with pair(engine_name, decode_config=DecodeConfig(waiting_timeout=60)) as s:
        sender = KVSender(s.prefill, s.addr, 81)
        receiver = KVReceiver(s.decode, s.addr, 81)
        receiver.init(0)  # (SGLang picks the prefill DP rank first)
        sender.abort()
        poll_until(lambda: sender.poll() == KVPoll.Failed)
        poll_until(lambda: receiver.poll() == KVPoll.WaitingForInput)
        receiver.send_metadata(np.arange(3), 0)
        poll_until(lambda: receiver.poll() == KVPoll.Failed, bound=5)
        with pytest.raises(TransferError, match="abort"):
            receiver.failure_exception()
        late = KVSender(s.prefill, s.addr, 82)  # aborted from another thread ...
        threading.Thread(target=late.abort).start()
        poll_until(lambda: late.poll() == KVPoll.Failed)
        late.init(2, aux_index=1)  # ... while the scheduler goes on: nothing breaks
        late.send([0, 1])
        assert late.poll() == KVPoll.Failed
        poll_until(lambda: s.prefill.statistics().rooms_active == 0)
        poll_until(lambda: s.decode.statistics().rooms_active == 0)
        assert s.prefill.statistics().aborted == 2  # the two empty rooms, nothing more


def test_the_example_in_docs_sglang_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/sglang.md's complete example runs as it is and prints what the page shows."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "sglang.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    shown = re.findall(r"^```\n(decode:.*?)^```", text, re.DOTALL | re.MULTILINE)
    exec(compile(blocks[1], "docs/sglang.md", "exec"), {"__name__": "docs_sglang"})
    assert capsys.readouterr().out == shown[0]


# ------------------------------------------------------------------ tensor parallelism


def test_two_prefill_ranks_fill_one_decode_rank(engine_name: str) -> None:
    """Prefill TP 2 (one KV head each) into decode TP 1 (both heads): each prefill rank's
    head range comes from its engine_rank, and the decode pages hold both heads."""
    srcs = [Memory(num_pages=32, heads=1, aux_slots=8) for _ in range(2)]
    dst = Memory(num_pages=32, heads=2, aux_slots=8)
    with ExitStack() as stack:
        boot = stack.enter_context(KVBootstrapServer("127.0.0.1", 0))
        prefills = [
            stack.enter_context(KVManager(
                m.kvargs(rank=r, total_heads=2), "prefill", server_args(tp_size=2),
                engine=stack.enter_context(make_engine(engine_name)), bootstrap_url=boot.url,
            ))
            for r, m in enumerate(srcs)
        ]
        assert [p.pool.first_head for p in prefills] == [0, 1]
        decode = stack.enter_context(KVManager(
            dst.kvargs(), "decode", server_args(), engine=stack.enter_context(
                make_engine(engine_name))))
        addr = f"127.0.0.1:{boot.port}"
        for room in (5, 6):
            pages = np.arange(3) + room * 3
            senders = []
            for r, (mgr, m) in enumerate(zip(prefills, srcs, strict=True)):
                m.fill(room, pages, room, first_head=r)
                sender = KVSender(mgr, addr, room)
                sender.init(3, room)
                senders.append(sender)
            receiver = KVReceiver(decode, addr, room)
            receiver.init(0)  # (SGLang picks the prefill DP rank first)
            poll_until(lambda: receiver.poll() == KVPoll.WaitingForInput)  # noqa: B023
            receiver.send_metadata(pages, room)
            for sender in senders:
                sender.send(pages)
            poll_until(lambda: receiver.poll() in TERMINAL)  # noqa: B023
            assert receiver.poll() == KVPoll.Success, receiver.failure
            assert dst.holds(room, pages, room)
            poll_until(lambda: all(x.poll() == KVPoll.Success for x in senders))  # noqa: B023


# ------------------------------------------------------------------ pool_from_kvargs


def _raw(n_buffers: int, nbytes: int) -> list[npt.NDArray[np.uint8]]:
    return [np.zeros(nbytes, dtype=np.uint8) for _ in range(n_buffers)]


def _args(kv: Sequence[npt.NDArray[Any]], item: int | Sequence[int],
          meta: Sequence[npt.NDArray[Any]] | None = None, **kw: Any) -> SimpleNamespace:
    meta = list(meta) if meta is not None else [np.zeros((8, 16), np.int32)]
    items = [item] * len(kv) if isinstance(item, int) else list(item)
    fields = dict(
        engine_rank=0, kv_data_ptrs=[int(b.ctypes.data) for b in kv],
        kv_data_lens=[int(b.nbytes) for b in kv], kv_item_lens=items,
        aux_data_ptrs=[int(m.ctypes.data) for m in meta],
        aux_data_lens=[int(m.nbytes) for m in meta],
        aux_item_lens=[int(m.nbytes) // m.shape[0] for m in meta],
        kv_head_num=1, total_kv_head_num=1, page_size=4,
    )
    fields.update(kw)
    return SimpleNamespace(**fields)  # a KVArgs-like object


def test_pool_from_kvargs_mha() -> None:
    kv = _raw(6, 10 * 256)  # 3 layers, 10 pages of 4 tokens x 2 heads x 32 bytes
    meta: list[npt.NDArray[Any]] = [np.zeros((12, 16), np.int32), np.zeros((12, 5), np.float64)]
    args = _args(kv, 256, meta, engine_rank=1, kv_head_num=2, total_kv_head_num=4)
    aux = AuxRows(args)
    pool = pool_from_kvargs(args, is_mla=False, aux=aux)
    assert (pool.layout, pool.num_layers, pool.page_size, pool.num_pages) == ("mha", 3, 4, 10)
    assert (pool.heads, pool.first_head, pool.head_bytes) == (2, 2, 32)
    assert pool.buffer_bases == tuple(args.kv_data_ptrs)
    assert (pool.aux_base, pool.aux_item_len, pool.aux_slots) == (
        int(aux.rows.ctypes.data), 16 + 64 + 40, 12)
    assert pool_from_kvargs(args, is_mla=False, aux=aux, num_pages=4).num_pages == 4
    # with the TP size: GQA replication (TP 4 over 2 heads) puts rank 3 on head 1
    rep = _args(kv, 256, meta, engine_rank=3, kv_head_num=1, total_kv_head_num=2, page_size=8)
    assert pool_from_kvargs(rep, is_mla=False, aux=aux, tp_size=4).first_head == 1
    # TP 1 (total == kv_head_num): head 0
    assert pool_from_kvargs(_args(kv, 256, meta, kv_head_num=2, total_kv_head_num=2),
                            is_mla=False, aux=aux).first_head == 0


def test_pool_from_kvargs_mla() -> None:
    kv = _raw(3, 16 * 4 * 72)  # 3 layers, 16 pages of 4 tokens x 72-byte latent
    args = _args(kv, 4 * 72)
    pool = pool_from_kvargs(args, is_mla=True, aux=AuxRows(args))
    assert (pool.layout, pool.num_layers, pool.num_pages) == ("mla", 3, 16)
    assert (pool.heads, pool.first_head, pool.head_bytes) == (1, 0, 72)


@pytest.mark.parametrize(("what", "make", "match"), [
    ("K and V items differ", lambda kv: _args(kv, [256, 256, 128, 128]), r"kv_item_lens\[2\]"),
    ("one buffer shorter", lambda kv: _args([*kv[:3], np.zeros(9 * 256, np.uint8)], 256),
     "buffer 3 holds 9 pages"),
    ("odd MHA buffers", lambda kv: _args(kv[:3], 256), "K and a V buffer per layer"),
    ("lens list short", lambda kv: _args(kv, 256, kv_data_lens=[2560] * 3),
     "one entry per KV buffer"),
    ("not whole heads", lambda kv: _args(kv, 250, kv_head_num=2, total_kv_head_num=2),
     "not page_size 4 x 2 head"),
    ("heads past the model", lambda kv: _args(kv, 256, engine_rank=2, kv_head_num=2,
                                              total_kv_head_num=4), "past the model's 4"),
    ("overlapping", lambda kv: _args([kv[0], kv[0], kv[1], kv[1]], 256), "overlap"),
    ("too many pages asked", lambda kv: _args(kv, 256), "hold 10 pages"),
    ("no buffers", lambda kv: _args([], 256), "kv_data_ptrs is empty"),
])
def test_pool_from_kvargs_refuses_buffers_that_disagree(
    what: str, make: Callable[[list[npt.NDArray[np.uint8]]], Any], match: str
) -> None:
    args = make(_raw(4, 10 * 256))
    with pytest.raises(ConfigurationError, match=match):
        pool_from_kvargs(args, is_mla=False, aux=AuxRows(args),
                         num_pages=11 if what == "too many pages asked" else None)


def test_aux_rows_gather_and_scatter_each_metadata_buffer() -> None:
    meta: list[npt.NDArray[Any]] = [np.arange(8 * 4, dtype=np.int32).reshape(8, 4),
                                    np.linspace(0, 1, 8 * 3).reshape(8, 3)]
    args = _args(_raw(2, 1024), 256, meta)
    aux = AuxRows(args)
    assert (aux.slots, aux.offsets, aux.row_len, aux.bytes_per_request) == (8, (16, 32), 56, 40)
    aux.rows[5, :16] = 0xAB  # trio_pd's stamp: never touched by gather
    aux.gather(5)
    assert bytes(aux.rows[5, :16]) == b"\xab" * 16
    assert bytes(aux.rows[5, 16:32]) == meta[0][5].tobytes()
    assert bytes(aux.rows[5, 32:]) == meta[1][5].tobytes()
    before = [m.copy() for m in meta]
    aux.rows[5, 16:] = 7
    aux.scatter(5)
    assert (meta[0][5].view(np.uint8) == 7).all() and (meta[1][5].view(np.uint8) == 7).all()
    assert all((m[:5] == b[:5]).all() and (m[6:] == b[6:]).all() for m, b in zip(
        meta, before, strict=True))
    with pytest.raises(ProtocolError):
        aux.gather(8)
    uneven = _args(_raw(2, 1024), 256, [np.zeros((8, 4), np.int32), np.zeros((9, 4), np.int32)])
    with pytest.raises(ConfigurationError, match="same aux slot"):
        AuxRows(uneven)
    with pytest.raises(ConfigurationError, match="aux_data_ptrs is empty"):
        AuxRows(_args(_raw(2, 1024), 256, []))


def test_device_metadata_buffers_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A metadata buffer CUDA reports as device memory is refused (the adapter's copies are
    host memcpys); the KV buffers may live anywhere. (CUDA's answer is stood in for.)"""
    meta = [np.zeros((8, 16), np.int32), np.zeros((8, 4), np.float32)]
    device_ptr = int(meta[1].ctypes.data)
    monkeypatch.setattr(trio_pd.io._cuda, "classify", lambda address: MemoryKind(
        0 if address == device_ptr else None))
    with pytest.raises(ConfigurationError, match=r"aux_data_ptrs\[1\] is in cuda:0 memory"):
        AuxRows(_args(_raw(2, 1024), 256, meta))


# ------------------------------------------------------------------ what is not supported


@pytest.mark.parametrize(("kvargs_kw", "server_kw", "knob"), [
    ({"pp_rank": 1}, {}, "KVArgs.pp_rank=1"),
    ({"prefill_start_layer": 2}, {}, "KVArgs.prefill_start_layer=2"),
    ({"system_dp_rank": 1}, {}, "KVArgs.system_dp_rank=1"),
    ({"state_types": ["minimax_index_k"], "state_data_ptrs": [[4096]],
      "state_data_lens": [[64]], "state_item_lens": [[64]]}, {}, "KVArgs.state_types[0]"),
    ({}, {"pp_size": 2}, "server_args.pp_size=2"),
    ({}, {"disaggregation_transfer_backend": "fake"}, "--disaggregation-transfer-backend"),
])
def test_unsupported_manager_knobs_are_named(
    kvargs_kw: dict[str, Any], server_kw: dict[str, Any], knob: str
) -> None:
    mem = Memory(num_pages=4, heads=2, aux_slots=4)
    args = mem.kvargs()
    for k, v in kvargs_kw.items():
        setattr(args, k, v)
    with pytest.raises(ConfigurationError, match="not supported") as info:
        KVManager(args, "decode", server_args(**server_kw))
    assert knob in str(info.value)
    with pytest.raises(ConfigurationError, match="disaggregation_mode"):
        KVManager(mem.kvargs(), "null", server_args())


def test_unsupported_call_knobs_are_named() -> None:
    with pair(num_pages=16, aux_slots=4) as s:
        calls: list[tuple[str, Callable[[], object]]] = [
            ("bootstrap_room=None", lambda: KVReceiver(s.decode, s.addr)),
            ("aux_index=None", lambda: KVSender(s.prefill, s.addr, 2).init(1)),
            ("needs a decode KVManager", lambda: KVReceiver(s.prefill, s.addr, 3)),
        ]
        sender = KVSender(s.prefill, s.addr, 4)
        sender.init(2, 0)
        receiver = KVReceiver(s.decode, s.addr, 4)
        receiver.init(0)  # (SGLang picks the prefill DP rank first)
        calls += [
            ("aux_index=None", lambda: receiver.send_metadata([0])),
        ]
        for knob, call in calls:
            with pytest.raises(ConfigurationError, match=r"not supported|needs a") as info:
                call()
            assert knob in str(info.value), (knob, info.value)
        # a decode prefix that is not whole pages: a ProtocolError
        with pytest.raises(ProtocolError, match="decode_prefix_len 5 is not a whole number"):
            receiver.send_metadata([0], 0, None, PAGE_SIZE + 1)
        # state slots for a pool without state types: a ProtocolError naming both counts
        for call in (lambda: sender.send([0], state_indices=[1]),
                     lambda: receiver.send_metadata([0], 0, state_indices=[3])):
            with pytest.raises(ProtocolError, match=r"1 entries, but KVArgs.state_types "
                               r"names 0 state type\(s\)"):
                call()
        # what is allowed in their place goes through
        receiver.init(prefill_dp_rank=0)
        poll_until(lambda: receiver.poll() == KVPoll.WaitingForInput)
        receiver.send_metadata([8, 9], aux_index=1, state_indices=None, decode_prefix_len=0)
        s.src.fill(4, np.array([0, 1]), 0)
        sender.send(np.array([0], np.int32), state_indices=None)
        with pytest.raises(ProtocolError, match="last chunk must end"):
            sender.send([1, 2])  # past the total given to init
        sender.send([1])
        poll_until(lambda: receiver.poll() == KVPoll.Success)
        assert s.dst.holds(4, np.array([8, 9]), 1)


# ------------------------------------------------------------------ small shapes


def test_a_decode_prefix_is_skipped_by_the_prefill_rank(engine_name: str) -> None:
    """SGLang's decode radix cache: the decode side holds the request's first two pages
    (``decode_prefix_len`` in tokens) and names pages for the rest. The prefill scheduler
    asks ``pop_decode_prefix_len()`` (0) and sends the whole request; the prefill rank
    skips the prefix, so decode's pages hold exactly the request's pages 2..5 and the pages
    it holds of its own are never written."""
    with pair(engine_name) as s:
        room, pages = 83, np.arange(6)
        s.src.fill(room, pages, 1)
        sender = KVSender(s.prefill, s.addr, room)
        assert sender.pop_decode_prefix_len() == 0
        sender.init(6, 1)
        receiver = KVReceiver(s.decode, s.addr, room)
        receiver.init(0)  # (SGLang picks the prefill DP rank first)
        poll_until(lambda: receiver.poll() == KVPoll.WaitingForInput)
        own = np.array([40, 41])  # the prefix pages decode holds (its cache): not written
        for rows in s.dst.pages:
            rows[own] = 0x33
        dst_pages = np.arange(20, 24)
        receiver.send_metadata(dst_pages, 2, decode_prefix_len=2 * PAGE_SIZE)
        sender.send(pages[:3])
        sender.send(pages[3:])
        poll_until(lambda: receiver.poll() in TERMINAL)
        assert receiver.poll() == KVPoll.Success, receiver.failure
        want = kv_pattern(room, len(s.dst.kv), 6, 0, s.dst.heads)
        for b, rows in enumerate(s.dst.pages):
            assert (rows[dst_pages] == want[b][2:]).all()
            assert (rows[own] == 0x33).all()
        poll_until(lambda: sender.poll() == KVPoll.Success)



def test_kvpoll_compares_equal_to_sglang_ints() -> None:
    assert sglang.KVPoll is trio_pd.KVPoll
    assert [int(KVPoll.Failed), KVPoll.Bootstrapping, KVPoll.WaitingForInput,
            KVPoll.Transferring, KVPoll.Success] == [0, 1, 2, 3, 4]
    assert min(KVPoll.Success, 3) == KVPoll.Transferring  # SGLang's all-reduce over ranks


def test_config_from_env_maps_sglang_variables() -> None:
    env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "45",
           "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE": "3",
           "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "200",
           "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2.5",
           "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "4"}
    p = config_from_env(Mode.PREFILL, env)
    assert isinstance(p, PrefillConfig) and (p.bootstrap_timeout, p.workers) == (45.0, 3)
    d = config_from_env("decode", env)
    assert isinstance(d, DecodeConfig)
    assert (d.waiting_timeout, d.heartbeat_interval, d.heartbeat_misses) == (200.0, 2.5, 4)
    assert config_from_env("decode", {}) == DecodeConfig(landing_bytes=LANDING_BYTES)
    assert config_from_env("decode", {LANDING_ENV: "0"}).landing_bytes == 0  # type: ignore[union-attr]
    assert config_from_env("prefill", {LANDING_ENV: "0"}) == PrefillConfig()
    with pytest.raises(ConfigurationError, match=LANDING_ENV):
        config_from_env("decode", {LANDING_ENV: "-1"})
    with pytest.raises(ConfigurationError, match="SGLANG_DISAGGREGATION_WAITING_TIMEOUT"):
        config_from_env("decode", {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "soon"})


def test_bootstrap_server_shape() -> None:
    server = KVBootstrapServer("127.0.0.1", 0)
    try:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
    finally:
        server.close()
    server.close()  # idempotent


# ------------------------------------------------------------------ metadata buffers, natively


def test_native_aux_maps_each_metadata_buffer_to_an_aux_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Natively the adapter's row is the 16-byte stamp and each metadata buffer is an aux
    buffer of its own, in the order of aux_data_ptrs, with its own row size; nothing is
    copied, and a metadata buffer may live on a device (its kind is CUDA's answer, which is
    stood in for here)."""
    meta = [np.zeros((12, 16), np.int32), np.zeros((12, 5), np.float64)]
    device_ptr = int(meta[1].ctypes.data)
    monkeypatch.setattr(trio_pd.io._cuda, "classify", lambda address: MemoryKind(
        0 if address == device_ptr else None))
    args = _args(_raw(2, 1024), 256, meta)
    aux = AuxRows(args, native=True)
    pool = pool_from_kvargs(args, is_mla=False, aux=aux)
    assert (pool.aux_base, pool.aux_item_len, pool.aux_slots) == (
        int(aux.rows.ctypes.data), 16, 12)
    assert pool.extra_aux == ((int(meta[0].ctypes.data), 64), (device_ptr, 40))
    assert pool.region_kinds is not None
    assert [str(k) for k in pool.region_kinds[2:]] == ["host", "host", "cuda:0"]
    meta[0][3] = 7
    aux.gather(3)
    aux.scatter(3)  # no copies either way
    assert not aux.rows.any() and (meta[0][3] == 7).all()
    with pytest.raises(ProtocolError, match="aux slot 12"):
        aux.gather(12)


def test_copying_aux_rows_still_work_and_do_not_pair_with_native(engine_name: str) -> None:
    """``native_aux=False`` on both sides: the older mapping (the adapter's rows carry the
    metadata), end to end. A native decode manager does not pair with a copying prefill one
    (their first aux buffers' rows differ): refused at once, nothing written."""
    src = Memory(num_pages=16, heads=2, aux_slots=4)
    dsts = [Memory(num_pages=16, heads=2, aux_slots=4) for _ in range(2)]
    with ExitStack() as stack:
        engines = [stack.enter_context(make_engine(engine_name)) for _ in range(3)]
        boot = stack.enter_context(KVBootstrapServer("127.0.0.1", 0))
        addr = f"127.0.0.1:{boot.port}"
        prefill = stack.enter_context(KVManager(
            src.kvargs(), Mode.PREFILL, server_args(), False, engine=engines[0],
            bootstrap_url=boot.url, native_aux=False))
        copying, native = (stack.enter_context(KVManager(
            dst.kvargs(), "decode", server_args(), False, engine=engine, native_aux=flag))
            for dst, engine, flag in ((dsts[0], engines[1], False), (dsts[1], engines[2], True)))
        assert prefill.pool.extra_aux == () and prefill.aux.row_len == 16 + 64 + 64 + 80
        for room, decode in ((91, copying), (92, native)):
            src.fill(room, np.arange(4), 1)
            sender = KVSender(prefill, addr, room)
            sender.init(4, 1)
            receiver = KVReceiver(decode, addr, room)
            receiver.init(0)  # (SGLang picks the prefill DP rank first)
            if decode is native:
                poll_until(lambda r=receiver: r.poll() == KVPoll.Failed, bound=5)
                with pytest.raises(TransferError, match="aux row bytes"):
                    receiver.failure_exception()
                sender.abort()
                continue
            poll_until(lambda r=receiver: r.poll() == KVPoll.WaitingForInput)
            receiver.send_metadata(np.arange(4, 8), 2)
            sender.send(np.arange(4))
            poll_until(lambda r=receiver: r.poll() == KVPoll.Success)
            assert dsts[0].holds(room, np.arange(4, 8), 2)
        assert not any(m.any() for m in dsts[1].meta)


# ------------------------------------------------------------------ state types (hybrid models)


def test_kvargs_state_types_become_the_pools_state_components() -> None:
    """A Mamba-like state type (conv and SSM states per layer, with SGLang's per-tensor
    dims) and an SWA-like one (K and V pages per layer) become the pool's two state
    components, in order: named by the type, ``data_lens // item_lens`` slots, the buffers
    as SGLang lists them; Mamba with dims split by segments (the dim's rows), SWA rank-local.
    Without dims, or with conv sub-blocks sharded one by one, Mamba is rank-local too; DSA
    index pages are replicated on an MLA backend; a type named twice gets numbered names."""
    mem = Memory(num_pages=8, heads=2, aux_slots=4)
    st = States(slots=5, poison=SOURCE_POISON)
    args = st.add_to(mem.kvargs())
    pool = pool_from_kvargs(args, is_mla=False, aux=AuxRows(args, native=True))
    mamba, swa = pool.states
    assert (mamba.name, mamba.slots, mamba.split) == ("mamba", 5, "segments")
    assert mamba.buffers == tuple((int(a.ctypes.data), int(a.shape[1])) for a in st.arrays[0])
    assert mamba.item_lens == (96, 96, 256, 256)
    assert mamba.segments == (((16, 6),), ((16, 6),), ((64, 4),), ((64, 4),))
    assert (swa.name, swa.slots, swa.split) == ("swa", 15, "rank")
    assert swa.buffers == tuple((int(a.ctypes.data), 128) for a in st.arrays[1])
    assert pool.region_kinds is not None and len(pool.region_kinds) == 4 + 4 + 4 + 4
    assert [x.split for x in states_from_kvargs(
        States(slots=5, poison=SOURCE_POISON, dims=False).add_to(mem.kvargs()))] == [
        "rank", "rank"]
    args.state_conv_shard_groups = [[None] * 4, []]  # None: one block, still segments
    assert states_from_kvargs(args)[0].split == "segments"
    args.state_conv_shard_groups = [[[2, 2, 2], [2, 2, 2], None, None], []]
    assert states_from_kvargs(args)[0].split == "rank"
    index = [np.zeros((16, 64), np.uint8) for _ in range(4)]
    three = SimpleNamespace(
        state_types=[StateType.DSA, "swa", StateType.SWA],
        state_data_ptrs=[[int(index[0].ctypes.data)], [int(index[1].ctypes.data)],
                         [int(a.ctypes.data) for a in index[2:]]],
        state_data_lens=[[1024], [1024], [1024, 1024]], state_item_lens=[[64], [64], [64, 64]],
    )
    on_mla = states_from_kvargs(three, is_mla=True)
    assert [(x.name, x.slots, x.split) for x in on_mla] == [
        ("dsa", 16, "replicated"), ("swa.0", 16, "rank"), ("swa.1", 16, "rank")]
    assert states_from_kvargs(three)[0].split == "rank"  # SGLang: MHA needs the same TP
    assert states_from_kvargs(mem.kvargs()) == () and mem.kvargs().state_types == []


def _state_kvargs(change: Callable[[KVArgs], None]) -> tuple[KVArgs, list[object]]:
    mem = Memory(num_pages=8, heads=2, aux_slots=4)
    st = States(slots=5, poison=SOURCE_POISON)
    args = st.add_to(mem.kvargs())
    change(args)
    return args, [mem, st]  # (the memory lives as long as the caller keeps these)


def _setitem(name: str, i: int, value: Any) -> Callable[[KVArgs], None]:
    return lambda a: getattr(a, name).__setitem__(i, value)


@pytest.mark.parametrize(("change", "match"), [
    (lambda a: setattr(a, "state_types", a.state_types[:1]),
     "need one entry per state type, got 1, 2, 2 and 2"),
    (lambda a: setattr(a, "state_data_lens", a.state_data_lens[:1]),
     "need one entry per state type, got 2, 2, 1 and 2"),
    (lambda a: a.state_item_lens[1].pop(),
     r"state type 1 \(swa\): .* need one entry per buffer, got 4, 4 and 3"),
    (lambda a: setattr(a, "state_dim_per_tensor", a.state_dim_per_tensor[:1]),
     r"state_dim_per_tensor needs one entry per state type \(2\), got 1"),
    (lambda a: a.state_dim_per_tensor[0].pop(), "has 3 entries, but the type has 4 buffers"),
    (_setitem("state_dim_per_tensor", 0, [5, 6, 4, 4]), "5 does not cut its 96-byte slot"),
    (lambda a: a.state_data_lens[0].__setitem__(1, 4 * 96),
     "buffer 1 holds 4 slots of 96 bytes, buffer 0 holds 5"),
    (_setitem("state_data_ptrs", 1, []), r"state_data_ptrs\[1\] is empty"),
    (lambda a: a.state_data_ptrs[1].__setitem__(0, 0), "needs an address"),
    (lambda a: setattr(a, "state_data_ptrs", [4096, 8192]),  # (one list per type, not ints)
     "state_data_ptrs must be a list .* of lists of ints"),
    (_setitem("state_types", 1, 7), r"state_types\[1\] must be a StateType"),
    (lambda a: a.state_data_ptrs[1].__setitem__(0, a.kv_data_ptrs[0]),  # (unified memory)
     "overlap"),
])
def test_state_kvargs_that_disagree_are_refused(
    change: Callable[[KVArgs], None], match: str
) -> None:
    """State fields whose lists disagree in length (across types, or across one type's
    buffers), or that describe no usable buffers, are refused by the manager before
    anything starts, with a ConfigurationError that says which."""
    args, _keep = _state_kvargs(change)
    with pytest.raises(ConfigurationError, match=match):
        KVManager(args, "decode", server_args())


def test_state_indices_that_do_not_fit_are_refused_and_slots_move(engine_name: str) -> None:
    """``state_indices`` are one list of slots per state type: another count, a list of
    lists, a string, slots outside their type or repeated, or slots on a chunk before the
    last are refused with a ProtocolError on the scheduler's thread, and the room goes on;
    then its slots move, each prefill slot to the decode slot of the same place. Two sides
    that name different numbers of slots of a type fail the room (SGLang would cut the
    longer list short)."""
    with pair(engine_name, num_pages=16, aux_slots=4, states=True) as s:
        assert s.src_states is not None and s.dst_states is not None
        src_held = [np.array([2]), np.array([7, 1, 9])]
        dst_held = [np.array([0]), np.array([4, 11, 5])]
        s.src.fill(41, np.arange(3), 1)
        s.src_states.fill(41, src_held)
        sender = KVSender(s.prefill, s.addr, 41)
        sender.init(3, 1)
        receiver = KVReceiver(s.decode, s.addr, 41)
        receiver.init(0)  # (SGLang picks the prefill DP rank first)
        poll_until(lambda: receiver.poll() == KVPoll.WaitingForInput)
        bad: list[tuple[Any, str]] = [
            ([[0]], r"1 entries, but KVArgs.state_types names 2 state type\(s\) "
                    r"\['mamba', 'swa'\]"),
            ([[0], [[1, 2]]], "for 'swa' must be a list of slot ids"),
            ([["a"], None], "for 'mamba' must be a list of slot ids"),
            ("ab", "must be a list, one entry per state type"),
            ([[5], None], r"slot 5 of state component 0 is outside \[0, 4\)"),
            ([None, [3, 3]], "state component 1 repeat a slot"),
        ]
        for indices, match in bad:
            with pytest.raises(ProtocolError, match=match):
                receiver.send_metadata(np.arange(3, 6), 2, indices)
        with pytest.raises(ProtocolError, match="aux_index and state_indices go to"):
            receiver.init(0, state_indices=[None, None])
        receiver.send_metadata(np.arange(3, 6), 2, States.indices(dst_held))
        for indices, match in bad:
            with pytest.raises(ProtocolError, match=match):
                sender.send(np.arange(3), state_indices=indices)
        with pytest.raises(ProtocolError, match="state slots go with the last chunk"):
            sender.send([0], state_indices=States.indices(src_held))
        sender.send([0], state_indices=[None, None])  # (no slot named: taken)
        sender.send([1, 2], state_indices=States.indices(src_held))
        poll_until(lambda: receiver.poll() in TERMINAL)
        assert receiver.poll() == KVPoll.Success, receiver.failure
        assert s.dst.holds(41, np.arange(3, 6), 2) and s.dst_states.holds(41, dst_held)
        poll_until(lambda: sender.poll() == KVPoll.Success)
        # a sliding window one page longer on decode than on prefill: the room fails
        sender = KVSender(s.prefill, s.addr, 42)
        sender.init(1, 0)
        receiver = KVReceiver(s.decode, s.addr, 42)
        receiver.init(0)  # (SGLang picks the prefill DP rank first)
        poll_until(lambda: receiver.poll() == KVPoll.WaitingForInput)
        receiver.send_metadata([8], 3, [[1], [2, 3]])
        sender.send([5], state_indices=[[3], [10]])
        poll_until(lambda: receiver.poll() == KVPoll.Failed)
        with pytest.raises(TransferError, match="'swa': prefill has 1 slots for the room, "
                                                "decode 2"):
            receiver.failure_exception()
        poll_until(lambda: sender.poll() == KVPoll.Failed)


@pytest.mark.parametrize("dims", [True, False])
def test_mamba_dims_let_two_prefill_ranks_fill_one_decode_rank(
    engine_name: str, dims: bool
) -> None:
    """With ``state_dim_per_tensor`` a Mamba slot is split by its rows: prefill TP 2 (3 conv
    rows and 2 SSM heads a rank) fills decode TP 1 (all of them), each prefill rank's rows
    landing after the ranks before it, as SGLang's sliced transfer puts them. Without dims
    the slots are rank-local and the pairing is refused: the room fails, nothing written."""
    srcs = [Memory(num_pages=8, heads=1, aux_slots=4) for _ in range(2)]
    dst = Memory(num_pages=8, heads=2, aux_slots=4)
    src_states = [States(slots=4, poison=SOURCE_POISON, kinds=("mamba",), tp_rank=r,
                         tp_size=2, dims=dims) for r in range(2)]
    dst_states = States(slots=4, poison=DEST_POISON, kinds=("mamba",), dims=dims)
    with ExitStack() as stack:
        boot = stack.enter_context(KVBootstrapServer("127.0.0.1", 0))
        prefills = [
            stack.enter_context(KVManager(
                st.add_to(m.kvargs(rank=r, total_heads=2)), "prefill", server_args(tp_size=2),
                engine=stack.enter_context(make_engine(engine_name)), bootstrap_url=boot.url,
            ))
            for r, (m, st) in enumerate(zip(srcs, src_states, strict=True))
        ]
        mamba = prefills[1].pool.states[0]
        assert mamba.segments[:1] == ((((16, 3),),) if dims else ())
        decode = stack.enter_context(KVManager(
            dst_states.add_to(dst.kvargs()), "decode", server_args(),
            engine=stack.enter_context(make_engine(engine_name))))
        addr = f"127.0.0.1:{boot.port}"
        pages = np.arange(3)
        senders = []
        for r, (mgr, m, st) in enumerate(zip(prefills, srcs, src_states, strict=True)):
            m.fill(7, pages, 1, first_head=r)
            st.fill(7, [np.array([r + 1])])  # (each prefill rank's own slot)
            sender = KVSender(mgr, addr, 7)
            sender.init(3, 1)
            senders.append(sender)
        receiver = KVReceiver(decode, addr, 7)
        receiver.init(0)  # (SGLang picks the prefill DP rank first)
        if not dims:
            poll_until(lambda: receiver.poll() == KVPoll.Failed, bound=5)
            with pytest.raises(TransferError, match="split by TP rank with no segments"):
                receiver.failure_exception()
            assert all((a == DEST_POISON).all() for a in dst_states.arrays[0])
            for sender in senders:
                sender.abort()
            return
        poll_until(lambda: receiver.poll() == KVPoll.WaitingForInput)
        receiver.send_metadata(pages + 4, 2, [[3]])
        for r, sender in enumerate(senders):
            sender.send(pages, state_indices=[[r + 1]])
        poll_until(lambda: receiver.poll() in TERMINAL)
        assert receiver.poll() == KVPoll.Success, receiver.failure
        assert dst.holds(7, pages + 4, 2) and dst_states.holds(7, [np.array([3])])
        assert all((a[[0, 1, 2]] == DEST_POISON).all() for a in dst_states.arrays[0])
        poll_until(lambda: all(x.poll() == KVPoll.Success for x in senders))
