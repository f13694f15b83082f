"""Every schedule of the races in the publication / abort / ack protocol (SPEC §5, I1-I3, I5).

These run the REAL agent code (:class:`~trio_pd.PrefillAgent`, :class:`~trio_pd.DecodeAgent`)
under :mod:`trio_pd.testing.explorer`, which runs a small scenario once per task schedule. The
explorer needs an I/O-free, thread-free, deterministic program on a virtual clock, so the
agents' three outside parts are swapped for in-memory twins:

* control plane: :class:`FakeControl` (``endpoint``, ``send_nowait``, ``forget``, ``close``)
  records every message an agent sends; messages *to* an agent are injected by calling its
  synchronous handler ``agent._handle(msg, pages)``, as its listener would;
* engine: :class:`MemEngine` copies the blocks in process memory (``ctypes.memmove`` between
  the numpy pools' addresses), as a one-sided write would;
* threads: :func:`inline_engine_call` replaces ``agent.peers.run_engine_call`` (the lanes), and
  :func:`inline_run_sync` ``trio.to_thread.run_sync`` (the agents' ``probe`` calls). Both keep
  the contract of a lane and of ``to_thread.run_sync(..., abandon_on_cancel=False)``: a
  cancellation is seen only *before* the call starts (``checkpoint_if_cancelled``, then the
  wait for the lane or the limiter, so a call that got its turn starts even if its scope was
  cancelled meanwhile); once started, the call runs to the end and its result is always
  delivered. A lane is modelled as a limiter of one, in FIFO order like its thread's queue.
  The thread's duration is modelled by ``cancel_shielded_checkpoint()`` yields after the
  call, during which every other task may run but no cancellation can interrupt the wait.

Keeping it exhaustive in seconds: the set-up (peer registration, worker and timer tasks) runs
one task at a time, so it adds no scheduling decisions; the racing action (an abort) is let
go at a *point* of the room's life (at once, once the engine call started, once it returned,
once the STATUS went out), parked on an event until then, plus a few extra checkpoints; and
scenarios with more than two busy tasks explore with ``first_only=True`` (every pair of tasks
in a batch still meets in both orders). Each scenario checks its invariant on the final state.

Plain ``def`` tests: the explorer calls ``trio.run`` itself, once per schedule.
"""

from __future__ import annotations

import ctypes
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import outcome
import pytest
import trio
import trio.lowlevel

from trio_pd import (
    AdmissionClosed,
    DecodeAgent,
    DecodeConfig,
    EngineError,
    KVPoll,
    PrefillAgent,
    PrefillConfig,
)
from trio_pd.agents._chunks import Write
from trio_pd.agents._prefill import _Room
from trio_pd.agents._sources import Instance as _Instance
from trio_pd.agents._sources import PrefillRank as _PrefillRank
from trio_pd.core import _wire as wire
from trio_pd.core._memory import stamp_aux_row
from trio_pd.engines import start_write
from trio_pd.io._lane import run_to_end
from trio_pd.testing import explore, replay
from trio_pd.testing.pools import HostKVPool

PREFILL = "inproc://prefill"
DECODE = "inproc://decode"
EPOCH = 7
ROOM = 1
#: A scenario's main task starts the race, then sleeps this long in *virtual* time. The
#: clock only jumps once every task is blocked, so when the sleep ends everything that could
#: happen has happened (acks, releases, quarantine fences, retries); the invariants are then
#: checked on the final state, which also checks that it was reached (liveness).
SETTLE = 60.0


# ------------------------------------------------------------------------------ twins


@dataclass
class Trace:
    """What happened, in order, in one run: engine calls starting and returning, messages
    sent, release callbacks. The fakes append to it; invariants are checked against it."""

    events: list[tuple[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    _waiters: dict[tuple[str, int], trio.Event] = field(default_factory=dict)

    def add(self, kind: str, what: Any = None) -> None:
        self.events.append((kind, what))
        event = self._waiters.get((kind, self.kinds().count(kind)))
        if event is not None:
            event.set()

    async def reached(self, kind: str, n: int = 1) -> None:
        """Wait until the n-th event of ``kind``. Only that event wakes the waiter, so a
        task parked here adds no scheduling decisions until then."""
        if self.kinds().count(kind) < n:
            await self._waiters.setdefault((kind, n), trio.Event()).wait()

    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]

    def index(self, kind: str) -> int:
        return self.kinds().index(kind)

    def sent(self, msg_type: type) -> list[Any]:
        return [m for k, m in self.events if k == "send" and isinstance(m, msg_type)]


def inline_run_sync(trace: Trace, *, duration: int = 1) -> Callable[..., Awaitable[Any]]:
    """A thread-free ``trio.to_thread.run_sync`` (see the module docstring)."""

    async def run_sync(
        fn: Callable[..., Any],
        *args: Any,
        limiter: trio.CapacityLimiter | None = None,
        abandon_on_cancel: bool = False,
        thread_name: str | None = None,
    ) -> Any:
        # trio_pd never abandons an engine call; a probe or a fence (which touch no page) are
        # the calls it may abandon (trio_pd.io._probe: the probe's thread function; decode's
        # fence_writer)
        abandonable = {"probe", "_probe_in_thread", "fence_writer"}
        assert not abandon_on_cancel or getattr(fn, "__name__", "") in abandonable, fn
        await trio.lowlevel.checkpoint_if_cancelled()  # cancelled: never started
        token = object()
        if limiter is not None:
            await limiter.acquire_on_behalf_of(token)  # waiting for a thread: cancellable
        try:
            trace.in_flight += 1
            trace.add("start", _called(fn))
            result = outcome.capture(fn, *args)  # "the thread runs"
            for _ in range(duration):
                await trio.lowlevel.cancel_shielded_checkpoint()  # it takes a while
            trace.in_flight -= 1
            trace.add("return", result)
        finally:
            if limiter is not None:
                limiter.release_on_behalf_of(token)
        return result.unwrap()

    return run_sync


def _called(fn: Any) -> Any:
    """The function a (nested) partial calls in the end, for the trace."""
    while hasattr(fn, "func"):
        fn = fn.args[0] if fn.func is run_to_end else fn.func
    return start_write if isinstance(fn, Write) else fn


def inline_engine_call(trace: Trace, *, duration: int = 1) -> Callable[..., Awaitable[Any]]:
    """A thread-free ``agent.run_engine_call(lane, fn)``: each lane is a limiter of one.
    Only writes are traced (not the peer's ``add_peer``, which shares its lane)."""
    run_write = inline_run_sync(trace, duration=duration)
    run_other = inline_run_sync(Trace())
    lanes: dict[object, trio.CapacityLimiter] = {}

    async def run(lane: object, fn: Callable[[], Any]) -> Any:
        limiter = lanes.setdefault(lane, trio.CapacityLimiter(1))
        run_sync = run_write if isinstance(fn, Write) else run_other
        return await run_sync(partial(run_to_end, fn), limiter=limiter)

    return run


class FakeControl:
    """The control-plane surface an agent uses; records what it sends."""

    def __init__(self, endpoint: str, trace: Trace) -> None:
        self.endpoint = endpoint
        self.trace = trace
        self.full: set[str] = set()
        self.on_send: Callable[[str, wire.Message], None] = lambda _e, _m: None

    def send_nowait(self, endpoint: str, msg: wire.Message, pages: Any = None) -> bool:
        if endpoint in self.full:
            return False
        self.on_send(endpoint, msg)
        self.trace.add("send", msg)
        return True

    def forget(self, endpoint: str) -> None:
        pass

    def close(self) -> None:
        pass


class MemEngine:
    """An in-memory one-sided engine: ``write`` copies each block in process memory.
    ``fail_writes`` makes the n-th write (0-based) raise after copying half its blocks."""

    name = "mem"

    def __init__(self, session_id: str, *, fail_writes: frozenset[int] = frozenset()) -> None:
        self.session_id = session_id
        self.fail_writes = fail_writes
        self.writes = 0

    def register(self, regions: Any) -> None:
        pass

    def unregister(self, regions: Any) -> None:
        pass

    def metadata(self) -> bytes:
        return b""

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        pass

    def remove_peer(self, session_id: str) -> None:
        pass

    def write(self, peer: str, src: Any, dst: Any, lens: Any) -> None:
        index = self.writes
        self.writes += 1
        n = len(lens) // 2 if index in self.fail_writes else len(lens)
        for s, d, ln in zip(src[:n].tolist(), dst[:n].tolist(), lens[:n].tolist(), strict=True):
            ctypes.memmove(d, s, ln)
        if index in self.fail_writes:
            raise EngineError(f"mem write #{index}: half the blocks written")

    def probe(self, peer: str) -> bool:
        return True

    def close(self) -> None:
        pass


def small_pool(layers: int = 1) -> HostKVPool:
    return HostKVPool(
        layout="mla", num_pages=8, num_layers=layers, page_size=2, head_bytes=4, aux_slots=2,
        aux_item_len=32,
    )


@pytest.fixture(autouse=True)
def _no_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Agents also reach threads for ``add_peer`` and ``probe`` through
    ``trio.to_thread.run_sync``; in these tests that is the inline twin too."""
    trace = Trace()  # those calls are not traced
    monkeypatch.setattr(trio.to_thread, "run_sync", inline_run_sync(trace))
    yield


# ------------------------------------------------------------------------------ prefill rig


@dataclass
class PrefillRig:
    agent: PrefillAgent
    trace: Trace
    control: FakeControl
    engine: MemEngine
    src: HostKVPool
    dst: HostKVPool
    released: list[int] = field(default_factory=list)

    def room(self, num_pages: int, *, with_target: bool = True, landing: bool = False) -> Any:
        """A sender for ROOM whose release callback is traced; with its decode metadata
        (``landing``: decode's landing pages 0.., see tests/test_landing.py)."""

        def on_release() -> None:
            self.released.append(self.trace.in_flight)
            self.trace.add("release")

        sender = self.agent.sender(ROOM, num_pages=num_pages, aux_slot=0, on_release=on_release)
        if with_target:
            pages = np.arange(num_pages, dtype=np.int32) + (0 if landing else 4)
            msg = wire.Transfer(
                v=wire.WIRE_VERSION, room=ROOM, epoch=EPOCH, endpoint=DECODE, decode_rank=0,
                aux_slot=1, required=1, num_pages=num_pages, landing=landing,
            )
            self.agent._handle(msg, pages)
        return sender

    def abort_from_decode(self) -> None:
        self.trace.add("ABORT handled")
        self.agent._handle(
            wire.Abort(v=wire.WIRE_VERSION, room=ROOM, epoch=EPOCH, endpoint=DECODE), None
        )


async def start_prefill(
    nursery: trio.Nursery,
    *,
    cls: type[PrefillAgent] = PrefillAgent,
    workers: int = 1,
    duration: int = 1,
    fail_writes: frozenset[int] = frozenset(),
    fence: float = 5.0,
    timers: bool = False,
    layers: int = 1,
    landing: tuple[tuple[int, ...], int] = ((), 0),
    coalesce_pages: int = PrefillConfig().coalesce_pages,
) -> PrefillRig:
    """A real PrefillAgent on the twins, its workers and timer task running in ``nursery``,
    with one decode peer registered (through its real REGISTER handler; ``landing``: the
    landing area it advertises, each buffer's base and the pages)."""
    trace = Trace()
    control = FakeControl(PREFILL, trace)
    engine = MemEngine("mem-prefill", fail_writes=fail_writes)
    src, dst = small_pool(layers), small_pool(layers)
    agent = cls(
        engine=engine, pool=src.spec, tp_rank=0, tp_size=1, kv_heads=1, host="unused",
        config=PrefillConfig(
            workers=workers, bootstrap_timeout=1e4, quarantine_fence=fence, tombstone_ttl=1e4,
            coalesce_pages=coalesce_pages,
        ),
        control=control,  # type: ignore[arg-type]
    )
    agent.peers.run_engine_call = inline_engine_call(trace, duration=duration)
    agent.peers.nursery = nursery
    # Set-up runs one task at a time (each then blocks), so it adds no scheduling decisions:
    # the explorer spends its schedules on the race itself.
    agent._handle(
        wire.Register(
            v=wire.WIRE_VERSION, endpoint=DECODE, decode_rank=0, decode_tp=1,
            engine=engine.name, session="mem-decode", engine_meta=b"",
            pool=wire.PoolWire.from_spec(dst.spec),
            landing_bases=landing[0], landing_pages=landing[1],
        ),
        None,
    )
    await quiesce()
    agent.jobs.start(nursery)  # (its tasks start as jobs come)
    await quiesce()
    if timers:
        nursery.start_soon(agent.timers.run)
        await quiesce()
    return PrefillRig(agent, trace, control, engine, src, dst)


async def quiesce() -> None:
    """Return once every other task is blocked (virtual time jumps only then)."""
    await trio.sleep(0.001)


#: Where in the room's life a racing action (an abort) is let go. ``("begin", 0)``: at once,
#: racing the chunk from its first step; otherwise once the trace has seen the n-th event of
#: that kind ("start"/"return": an engine call; "send": a message). The explorer then runs
#: every order of the action against whatever else is runnable from there on.
Point = tuple[str, int]
POINTS_ONE_CALL: list[Point] = [("begin", 0), ("start", 1), ("return", 1), ("send", 1)]


async def at(trace: Trace, point: Point, steps: int = 0) -> None:
    """Wait for ``point``, then ``steps`` more checkpoints (to land a little later)."""
    kind, n = point
    if n:
        await trace.reached(kind, n)
    for _ in range(steps):
        await trio.lowlevel.checkpoint()


def assert_explored(
    scenario: Callable[[], Awaitable[None]], *, first_only: bool = False
) -> int:
    """Every schedule of ``scenario`` passes; returns how many there were. ``first_only``
    (for scenarios with more than two busy tasks) explores which task of each batch runs
    first, so every pair of tasks still meets in both orders, in far fewer schedules."""
    result = explore(scenario, max_schedules=5000, first_only=first_only)
    if result.failures:
        f = result.failures[0]
        raise AssertionError(f"{f.schedule} failed: {f.exception!r}") from f.exception
    assert result.exhaustive, f"not exhaustive after {result.schedules_run} schedules"
    return result.schedules_run


# ------------------------------------------------------------------------- publication vs abort


def publication_vs_abort(
    point: Point,
    steps: int,
    *,
    via: str,
    cls: type[PrefillAgent] = PrefillAgent,
    seen: set[str] | None = None,
) -> Callable[[], Awaitable[None]]:
    """One room, one chunk (the last) in flight; an abort (by the prefill scheduler or by a
    decode ABORT) is let go at ``point`` and races the worker in every order.

    Invariant (SPEC §5.4, §8.3): exactly one STATUS; it says Failed if the abort came before
    any STATUS was sent, and Success stands if it came after; the local status agrees with the
    one published; the release runs once, after the write returned; a decode ABORT is acked
    once."""

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            rig = await start_prefill(nursery, cls=cls)
            sender = rig.room(2)
            sender.send(np.array([0, 1]), last=True)
            published_before_abort: list[bool] = []

            async def abort() -> None:
                await at(rig.trace, point, steps)
                published_before_abort.append(bool(rig.trace.sent(wire.Status)))
                if via == "sender":
                    sender.abort("scheduler abort")
                else:
                    rig.abort_from_decode()

            nursery.start_soon(abort)
            await trio.sleep(SETTLE)
            nursery.cancel_scope.cancel()

        assert len(published_before_abort) == 1, "the abort never ran"
        statuses = rig.trace.sent(wire.Status)
        assert len(statuses) == 1, statuses
        ok = statuses[0].ok
        if seen is not None:
            seen.add("abort after STATUS" if published_before_abort[0] else "abort first")
        if published_before_abort[0]:
            assert ok and sender.poll() is KVPoll.Success, "abort undid a published Success"
        else:
            assert not ok, "Success published after the abort"
        assert (sender.poll() is KVPoll.Success) == ok, "local status disagrees with STATUS"
        assert rig.released == [0], "release ran while a write was in flight, or not once"
        if via == "decode":
            acks = rig.trace.sent(wire.AbortAck)
            assert len(acks) == 1 and acks[0].epoch == EPOCH

    return scenario


@pytest.mark.parametrize("via", ["sender", "decode"])
def test_publication_vs_abort_every_schedule(via: str) -> None:
    seen: set[str] = set()
    for point in POINTS_ONE_CALL:
        for steps in range(3):
            assert_explored(publication_vs_abort(point, steps, via=via, seen=seen))
    assert seen == {"abort first", "abort after STATUS"}  # both sides of the race were run


class CheckOutsideLock(PrefillAgent):
    """A planted bug: decides the outcome, then awaits before it acts on it (the
    check-then-act race SPEC §5.4 forbids; a lock taken only around the act, as this class
    once did, would not close it)."""

    async def _publish(self, rec: _Room) -> None:
        room = rec.machine
        if not room.publish_due:
            return
        ok = room.cell.status is not KVPoll.Failed  # checked before the await...
        await trio.lowlevel.checkpoint()  # ...and an abort can land here
        if room.published:
            return
        room.published = True
        for target in room.targets.values():
            self.control.send_nowait(
                target.endpoint,
                wire.Status(
                    v=wire.WIRE_VERSION, room=room.room, epoch=target.epoch,
                    rank=self.tp_rank, ok=ok,
                ),
            )
        if ok:
            room.cell.advance(KVPoll.Success)
            rec.terminal.set()


def test_planted_check_outside_lock_is_found_and_replays() -> None:
    found = None
    for point in POINTS_ONE_CALL:
        for steps in range(3):
            scenario = publication_vs_abort(point, steps, via="sender", cls=CheckOutsideLock)
            result = explore(scenario, stop_on_first_failure=False)
            if result.failures:
                found = (point, steps, scenario, result)
                break
        if found:
            break
    assert found is not None, "the explorer missed the check-outside-the-lock race"
    point, steps, scenario, result = found
    assert result.exhaustive
    # A race, not a plain bug: some orders of the same scenario pass, others fail.
    assert 0 < len(result.failures) < result.schedules_run
    failure = result.failures[0]
    assert "Success published after the abort" in str(failure.exception)
    with pytest.raises(AssertionError) as info:
        replay(scenario, failure.schedule)
    assert str(info.value) == str(failure.exception)
    # The real agent passes under exactly that schedule.
    replay(publication_vs_abort(point, steps, via="sender"), failure.schedule)


# ---------------------------------------------------------------------- abort vs admission (I2)


def abort_vs_admission(point: Point, steps: int) -> Callable[[], Awaitable[None]]:
    """The prefill scheduler hands over two one-page chunks, one checkpoint apart; a decode
    ABORT is let go at ``point``.

    Invariant (I2, SPEC §5.5): no chunk is admitted after the ABORT was handled; the ack is
    sent once, and only after every engine call that started (before or after the ABORT: a
    call past trio's "not started" point still starts) returned; the release runs once,
    after that."""

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            rig = await start_prefill(nursery)
            sender = rig.room(2)
            admitted_after_abort: list[int] = []
            aborted = trio.Event()

            async def scheduler() -> None:
                for i in range(2):
                    if i:
                        await trio.lowlevel.checkpoint()
                    try:
                        sender.send(np.array([i]), last=i == 1)
                    except AdmissionClosed:
                        return
                    rig.trace.add("admitted", i)
                    if aborted.is_set():
                        admitted_after_abort.append(i)

            async def abort() -> None:
                await at(rig.trace, point, steps)
                rig.abort_from_decode()
                aborted.set()

            nursery.start_soon(scheduler)
            nursery.start_soon(abort)
            await trio.sleep(SETTLE)
            nursery.cancel_scope.cancel()

        assert aborted.is_set(), "the abort never ran"
        assert admitted_after_abort == [], "a chunk was admitted after the ABORT"
        kinds = rig.trace.kinds()
        acks = rig.trace.sent(wire.AbortAck)
        assert len(acks) == 1, "not exactly one ack"
        ack_at = next(i for i, (_k, m) in enumerate(rig.trace.events) if m is acks[0])
        assert kinds.count("start") == kinds[:ack_at].count("return"), "ack before the drain"
        assert rig.released == [0], "release ran while a write was in flight, or not once"
        release_at = kinds.index("release")
        assert kinds.count("start") == kinds[:release_at].count("return")

    return scenario


def test_abort_vs_admission_every_schedule() -> None:
    for point in [("begin", 0), ("admitted", 1), ("start", 1), ("return", 1)]:
        for steps in range(2):
            assert_explored(abort_vs_admission(point, steps))


# ---------------------------------------------------------------------- ack vs lease retirement


def ack_vs_lease(point: Point, steps: int, *, fail: bool) -> Callable[[], Awaitable[None]]:
    """One chunk whose engine call takes a while (two yields); a decode ABORT is let go at
    ``point``. With ``fail`` the call fails (outcome unknown: quarantine).

    Invariant (SPEC §5.3, §5.5, §8.6, §8.9): the ack is sent exactly once, never while an
    engine call is in flight or a lease is live or quarantined; after an engine error, only
    once the quarantine ended."""

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            rig = await start_prefill(
                nursery, duration=2, fail_writes=frozenset({0}) if fail else frozenset(),
                timers=fail,  # the quarantine fence is a timer
            )
            agent = rig.agent
            acked_with: list[tuple[int, int, int, int]] = []

            def on_send(_endpoint: str, msg: wire.Message) -> None:
                if isinstance(msg, wire.AbortAck):
                    s = agent.statistics()
                    acked_with.append(
                        (
                            rig.trace.in_flight, s.leases_live, s.leases_quarantined,
                            s.released_after_quarantine,
                        )
                    )

            rig.control.on_send = on_send
            sender = rig.room(2)
            sender.send(np.array([2, 3]), last=True)

            async def abort() -> None:
                await at(rig.trace, point, steps)
                rig.abort_from_decode()

            nursery.start_soon(abort)
            await trio.sleep(SETTLE)
            nursery.cancel_scope.cancel()

        assert len(acked_with) == 1, acked_with
        in_flight, live, quarantined, fenced = acked_with[0]
        assert (in_flight, live, quarantined) == (0, 0, 0), "ack while the pages may be in use"
        if fail and rig.engine.writes:
            assert fenced == 1, "ack after an engine error without the quarantine's end"
        assert rig.released == [0]

    return scenario


def test_ack_vs_lease_retirement_every_schedule() -> None:
    for point in POINTS_ONE_CALL:
        for steps in range(3):
            assert_explored(ack_vs_lease(point, steps, fail=False))


def test_ack_vs_quarantine_every_schedule() -> None:
    # The engine error also starts a probe of the peer and wakes the timer task: more busy
    # tasks, so only the first of each batch is chosen.
    cases = [(("begin", 0), 0), (("begin", 0), 1), *((p, 0) for p in POINTS_ONE_CALL[1:])]
    for point, steps in cases:
        assert_explored(ack_vs_lease(point, steps, fail=True), first_only=True)


# ------------------------------------------------------------------- release vs draining chunks


def release_vs_drain(point: Point, *, how: str) -> Callable[[], Awaitable[None]]:
    """Two chunks of one room on two workers, in flight together; the room is concluded by
    its last chunk, or aborted (by the scheduler or by decode) at ``point``. (Each chunk is
    its own engine call: coalesced into one, the two would be a single call, and the abort at
    ``("return", 1)`` would race publication instead, which publication_vs_abort covers.)

    Invariant (I1, I3, SPEC §5.3, §8.5): the release callback runs exactly once, with no
    engine call in flight, after every engine call that started has returned."""

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            rig = await start_prefill(nursery, workers=2, coalesce_pages=1)
            sender = rig.room(3)
            sender.send(np.array([0, 1]))
            sender.send(np.array([2]), last=True)

            async def abort() -> None:
                await at(rig.trace, point)
                if how == "sender":
                    sender.abort()
                else:
                    rig.abort_from_decode()

            if how != "concluded":
                nursery.start_soon(abort)
            await trio.sleep(SETTLE)
            nursery.cancel_scope.cancel()

        kinds = rig.trace.kinds()
        assert rig.released == [0], f"release ran {len(rig.released)} times / mid-write"
        release_at = kinds.index("release")
        assert kinds.count("start") == kinds[:release_at].count("return")
        assert sender.poll() is (KVPoll.Success if how == "concluded" else KVPoll.Failed)

    return scenario


@pytest.mark.parametrize(
    ("how", "points"),
    [
        ("concluded", [("begin", 0)]),
        ("sender", [("begin", 0), ("start", 1)]),  # one call in the engine, one not yet
        ("decode", [("begin", 0), ("return", 1)]),  # one call returned, one in the engine
    ],
    ids=["concluded", "sender-abort", "decode-abort"],
)
def test_release_vs_draining_chunks_every_schedule(how: str, points: list[Point]) -> None:
    # Two chunk chains run side by side: only the first task of each batch is chosen.
    for point in points:
        assert_explored(release_vs_drain(point, how=how), first_only=True)


# ---------------------------------------------------------------------- decode: acks vs release


#: what the prefill ranks send once decode's ABORT is out: one list per concurrent sender,
#: sent back to back; ("ack", r) is rank r's ABORT_ACK, ("success", r) a late Success STATUS
DECODE_CASES = {
    "acks": [[("ack", 0)], [("ack", 1)], [("success", 1)]],
    "duplicate-ack": [[("ack", 0), ("ack", 0)], [("ack", 1)]],
    "late-successes": [[("success", 0)], [("success", 1)], [("ack", 0)]],
}


def decode_acks(senders: list[list[tuple[str, int]]]) -> Callable[[], Awaitable[None]]:
    """A decode rank reads room ROOM from two prefill ranks and aborts it; then ``senders``
    deliver their messages concurrently. The room's aux row carries its room and epoch, as if
    the KV had landed, so a late Success from every rank would complete it if Failed were not
    absorbing.

    Invariant (SPEC §8.8, I5): the pages go back exactly once, only after both ranks drained
    (acked, or reported Success: a rank does that only once all its writes returned); a
    duplicate ack counts once; the room stays Failed."""

    async def scenario() -> None:
        trace = Trace()
        control = FakeControl(DECODE, trace)
        dst = small_pool()
        stamp_aux_row(dst.spec, 0, ROOM, EPOCH)
        async with trio.open_nursery() as nursery:
            agent = DecodeAgent(
                engine=MemEngine("mem-decode"),  # type: ignore[arg-type]
                pool=dst.spec, tp_rank=0, tp_size=1, host="unused",
                config=DecodeConfig(waiting_timeout=1e4, ack_timeout=1e4),
                control=control,  # type: ignore[arg-type]
            )
            agent.sources.nursery = nursery
            url = "http://bootstrap.invalid"
            sources = [_PrefillRank("inproc://p0", 0, "s0"), _PrefillRank("inproc://p1", 1, "s1")]
            agent._instances[url] = _Instance(url, sources, ready=True)
            receiver = agent.receiver(ROOM, bootstrap_url=url, epoch=EPOCH)
            drained: set[int] = set()
            released: list[frozenset[int]] = []
            receiver.init(
                np.array([0, 1]), 0, on_release=lambda: released.append(frozenset(drained))
            )
            abort_out = trio.Event()

            async def send(messages: list[tuple[str, int]]) -> None:
                await abort_out.wait()
                for kind, rank in messages:
                    drained.add(rank)
                    if kind == "ack":
                        msg: wire.Message = wire.AbortAck(
                            v=wire.WIRE_VERSION, room=ROOM, epoch=EPOCH, rank=rank
                        )
                    else:
                        msg = wire.Status(
                            v=wire.WIRE_VERSION, room=ROOM, epoch=EPOCH, rank=rank, ok=True
                        )
                    agent._handle(msg, None)

            for messages in senders:
                nursery.start_soon(send, messages)
            await quiesce()
            receiver.abort()
            abort_out.set()
            await trio.sleep(SETTLE)
            nursery.cancel_scope.cancel()

        assert released == [frozenset({0, 1})], released
        assert receiver.poll() is KVPoll.Failed
        assert agent.statistics().succeeded == 0
        assert len(trace.sent(wire.Abort)) == 2

    return scenario


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_release_needs_every_rank_drained_every_schedule(case: str) -> None:
    assert_explored(decode_acks(DECODE_CASES[case]))


# ------------------------------------------------------------------ layer-wise: abort vs layers


def layers_vs_abort(
    point: Point, steps: int, seen: set[str] | None = None
) -> Callable[[], Awaitable[None]]:
    """Layer-wise streaming (docs/layerwise.md): a model loop sends a two-page room layer by
    layer (two layers, one checkpoint of "compute" between them, the second ``last``), on two
    workers; a decode ABORT is let go at ``point``.

    Invariant (SPEC §5.3, §5.5, I1, I6): a Success STATUS goes out only when every layer of
    every page has landed at decode (checked at the send); no layer is admitted after the
    ABORT; the ack goes out once, after every started write returned; the release runs
    once, after that, with no write in flight."""

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            rig = await start_prefill(nursery, workers=2, layers=2)
            src_pages = np.array([0, 1])
            rig.src.fill(src_pages, ROOM)
            dst_pages = np.arange(2) + 4  # (rig.room's destination pages)
            want = rig.src.expected(ROOM, 2)
            landed_at_success: list[bool] = []

            def on_send(_endpoint: str, msg: wire.Message) -> None:
                if isinstance(msg, wire.Status) and msg.ok:
                    landed_at_success.append(bool((rig.dst.kv[:, dst_pages, :] == want).all()))

            rig.control.on_send = on_send
            sender = rig.room(2)
            aborted = trio.Event()
            admitted_after_abort: list[int] = []

            async def model_loop() -> None:
                for layer in range(2):
                    if layer:
                        await trio.lowlevel.checkpoint()  # computing the next layer
                    try:
                        sender.send(src_pages, layers=range(layer, layer + 1), last=layer == 1)
                    except AdmissionClosed:
                        return
                    rig.trace.add("admitted", layer)
                    if aborted.is_set():
                        admitted_after_abort.append(layer)

            async def abort() -> None:
                # (a point a schedule never reaches, such as a second engine call where the
                # two layers coalesced into one: the abort comes after everything else)
                with trio.move_on_after(SETTLE / 2):
                    await at(rig.trace, point, steps)
                rig.abort_from_decode()
                aborted.set()

            nursery.start_soon(model_loop)
            nursery.start_soon(abort)
            await trio.sleep(SETTLE)
            nursery.cancel_scope.cancel()

        assert aborted.is_set(), "the abort never ran"
        assert admitted_after_abort == [], "a layer was admitted after the ABORT"
        assert all(landed_at_success), "Success sent before every layer had landed"
        statuses = rig.trace.sent(wire.Status)
        assert len(statuses) == 1, statuses
        kinds = rig.trace.kinds()
        acks = rig.trace.sent(wire.AbortAck)
        assert len(acks) == 1, "not exactly one ack"
        ack_at = next(i for i, (_k, m) in enumerate(rig.trace.events) if m is acks[0])
        assert kinds.count("start") == kinds[:ack_at].count("return"), "ack before the drain"
        assert rig.released == [0], "release ran while a write was in flight, or not once"
        release_at = kinds.index("release")
        assert kinds.count("start") == kinds[:release_at].count("return")
        if seen is not None:
            seen.add("Success" if statuses[0].ok else "Failed")
            seen.add(f"{kinds.count('start')} writes")

    return scenario


def test_layers_vs_abort_every_schedule() -> None:
    points: list[Point] = [("begin", 0), ("admitted", 1), ("start", 1), ("return", 1),
                           ("admitted", 2), ("start", 2)]
    seen: set[str] = set()
    for point in points:
        for steps in range(2):
            assert_explored(layers_vs_abort(point, steps, seen), first_only=True)
    # both outcomes, and layers written in one call (coalesced), in two, and not at all
    assert seen == {"Success", "Failed", "0 writes", "1 writes", "2 writes"}, seen
