"""The lane: one thread per destination, calls in order, the to_thread cancellation contract,
and writes started ahead of the one being waited for (``Pending``)."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import pytest
import trio
import trio.testing

from trio_pd.io._lane import Lane, LaneClosed, run_to_end

BOUND = 10.0  # seconds; nothing here should take more than a fraction of it


class Held:
    """A blocking call the test lets go of: ``entered`` is set once the lane's thread runs it."""

    def __init__(self, value: Any = None) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.value = value

    def __call__(self) -> Any:
        self.entered.set()
        assert self.go.wait(BOUND)
        return self.value

    async def wait_entered(self) -> None:
        assert await trio.to_thread.run_sync(self.entered.wait, BOUND)


class FakePending:
    """A started write: ``wait()`` blocks until released; the log says what happened when."""

    def __init__(self, name: str, log: list[str], error: Exception | None = None) -> None:
        self.name = name
        self.log = log
        self.error = error
        self.release = threading.Event()

    def wait(self) -> str:
        self.log.append(f"wait {self.name}")
        assert self.release.wait(BOUND)
        self.log.append(f"done {self.name}")
        if self.error is not None:
            raise self.error
        return self.name


async def test_calls_run_in_order_on_one_thread() -> None:
    lane = Lane("t")
    seen: list[tuple[int, int]] = []
    results: list[int] = []

    async def call(i: int) -> None:
        results.append(await lane.run_sync(lambda: seen.append((i, threading.get_ident())) or i))

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(call, i)
            await trio.testing.wait_all_tasks_blocked()  # queued in this order
    assert [i for i, _ in seen] == list(range(20))
    assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()
    assert sorted(results) == list(range(20))
    lane.close()


async def test_a_call_wakes_a_waiting_thread_and_a_busy_one_finds_it() -> None:
    """A call is notified to the thread only while it waits (``Lane._idle``): one made while
    the thread is in a call is found in the queue when that call returns, and one made while
    it waits wakes it at once, not when its wait for calls runs out (``idle_exit``)."""
    lane = Lane("t", idle_exit=60.0)  # (far past BOUND: a missed wake-up fails the test)
    held = Held(1)
    got: list[Any] = []

    async def call(fn: Any) -> None:
        got.append(await lane.run_sync(fn))

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, held)
            await held.wait_entered()
            assert not lane._idle
            nursery.start_soon(call, lambda: 2)  # queued while the thread is busy
            await trio.testing.wait_all_tasks_blocked()
            held.go.set()
        assert sorted(got) == [1, 2]
        while not lane._idle:  # noqa: ASYNC110 (a thread's state: no trio event to wait on)
            await trio.sleep(0.001)
        assert await lane.run_sync(lambda: 3) == 3  # the thread was waiting for calls
    lane.close()


async def test_errors_reach_the_caller_and_the_lane_goes_on() -> None:
    lane = Lane("t")

    def boom() -> None:
        raise ValueError("engine said no")

    with pytest.raises(ValueError, match="engine said no"):
        await lane.run_sync(boom)
    assert await lane.run_sync(lambda: 7) == 7
    lane.close()


async def test_cancelled_while_queued_never_runs() -> None:
    lane = Lane("t", depth=1)
    held = Held("first")
    ran: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lane.run_sync, held)
        await held.wait_entered()
        with trio.move_on_after(0.05) as scope:
            await lane.run_sync(lambda: ran.append("second"))
        assert scope.cancelled_caught
        held.go.set()
    assert await lane.run_sync(lambda: "third") == "third"
    assert ran == []  # the cancelled call was skipped, not run late


async def test_cancelled_after_start_waits_for_the_result() -> None:
    lane = Lane("t")
    held = Held("landed")
    got: list[Any] = []

    async def caller(scope: trio.CancelScope) -> None:
        with scope:
            got.append(await lane.run_sync(held))
            await trio.lowlevel.checkpoint()  # the cancellation is seen here, after the result

    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(caller, scope)
        await held.wait_entered()
        scope.cancel()
        await trio.sleep(0.05)
        assert got == []  # still waiting for the call: not abandoned
        held.go.set()
    assert got == ["landed"]
    assert scope.cancelled_caught
    lane.close()


async def test_the_next_write_starts_before_the_first_is_waited() -> None:
    """depth 2: B is started while A is in flight; C waits until A is done. (All three are
    queued before the thread looks: with nothing queued, it waits for A at once.)"""
    lane = Lane("t", depth=2)
    log: list[str] = []
    pend = {n: FakePending(n, log) for n in "ABC"}
    results: dict[str, Any] = {}

    def start(name: str) -> FakePending:
        log.append(f"start {name}")
        return pend[name]

    async def call(name: str) -> None:
        results[name] = await lane.run_sync(start, name)

    held = Held()  # keeps the thread busy until A, B and C are all queued
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lane.run_sync, held)
        await held.wait_entered()
        for n in "ABC":
            nursery.start_soon(call, n)
            await trio.testing.wait_all_tasks_blocked()
        held.go.set()
        await trio.to_thread.run_sync(_until, lambda: "wait A" in log)
        assert log == ["start A", "start B", "wait A"]  # C is not started: depth 2
        assert results == {}
        pend["A"].release.set()
        await trio.to_thread.run_sync(_until, lambda: "wait B" in log)
        assert log[:6] == ["start A", "start B", "wait A", "done A", "start C", "wait B"]
        pend["B"].release.set()
        pend["C"].release.set()
    assert results == {"A": "A", "B": "B", "C": "C"}  # each caller got its own wait()
    lane.close()


async def test_depth_one_waits_before_starting_the_next() -> None:
    lane = Lane("t", depth=1)
    log: list[str] = []
    pend = {n: FakePending(n, log) for n in "AB"}
    for p in pend.values():
        p.release.set()
    for n in "AB":
        await lane.run_sync(lambda n=n: (log.append(f"start {n}"), pend[n])[1])
    assert log == ["start A", "wait A", "done A", "start B", "wait B", "done B"]
    lane.close()


async def test_a_failed_wait_fails_only_its_caller() -> None:
    lane = Lane("t", depth=2)
    log: list[str] = []
    bad = FakePending("A", log, error=RuntimeError("outcome unknown"))
    good = FakePending("B", log)
    bad.release.set()
    good.release.set()
    outcomes: dict[str, Any] = {}

    async def call(name: str, p: FakePending) -> None:
        try:
            outcomes[name] = await lane.run_sync(lambda: p)
        except RuntimeError as exc:
            outcomes[name] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, "A", bad)
        nursery.start_soon(call, "B", good)
    assert isinstance(outcomes["A"], RuntimeError) and outcomes["B"] == "B"
    lane.close()


async def test_close_runs_what_is_queued_then_refuses() -> None:
    lane = Lane("t")
    held = Held(1)
    got: list[Any] = []

    async def call(fn: Any) -> None:
        got.append(await lane.run_sync(fn))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, held)
        await held.wait_entered()
        nursery.start_soon(call, lambda: 2)
        await trio.testing.wait_all_tasks_blocked()
        lane.close()
        with pytest.raises(LaneClosed):
            await lane.run_sync(lambda: 3)
        held.go.set()
    assert sorted(got) == [1, 2]  # (trio wakes the two callers in either order)
    thread = lane._thread
    assert thread is not None
    await trio.to_thread.run_sync(thread.join, BOUND)
    assert not thread.is_alive()


def test_run_to_end_waits_a_pending() -> None:
    log: list[str] = []
    p = FakePending("A", log)
    p.release.set()
    assert run_to_end(lambda: p) == "A" and log == ["wait A", "done A"]
    assert run_to_end(lambda: 5) == 5


def _until(cond: Any) -> None:
    for _ in range(int(BOUND / 0.001)):
        if cond():
            return
        threading.Event().wait(0.001)
    raise AssertionError("condition never came true")


@pytest.mark.skipif(sys.platform != "linux", reason="a per-thread nice value is Linux's")
async def test_lane_thread_runs_at_the_nice_value_asked() -> None:
    """``nice=N``: the lane's thread runs N nice levels below its creator; the caller's own
    thread is untouched."""
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def own_nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    lane = Lane("t", nice=3)
    try:
        assert await lane.run_sync(own_nice) == min(here + 3, 19)
    finally:
        lane.close()
    plain = Lane("t")
    try:
        assert await plain.run_sync(own_nice) == here
    finally:
        plain.close()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == here
    with pytest.raises(ValueError, match="nice"):
        Lane("t", nice=-1)


@pytest.mark.skipif(sys.platform != "linux", reason="a per-thread nice value is Linux's")
async def test_lane_runs_when_its_priority_cannot_be_lowered(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sandbox that refuses ``setpriority``: the lane logs it and runs its calls anyway."""

    def refuse(*_: object) -> None:
        raise PermissionError("injected: setpriority refused")

    monkeypatch.setattr(os, "setpriority", refuse)
    lane = Lane("t", nice=5)
    try:
        with trio.fail_after(10):
            assert await lane.run_sync(lambda: 7) == 7
    finally:
        lane.close()
    assert "could not lower" in caplog.text


# ------------------------------------------------------------------------ joining (batching)


class FakeWrite:
    """A joinable call: ``blocks`` blocks for ``key``; running it (alone or as the head of a
    joined call) appends the names it carried to ``calls`` and returns a value or raises."""

    def __init__(self, name: str, key: str, blocks: int, calls: list[list[str]],
                 error: Exception | None = None, nbytes: int = 1) -> None:
        self.name, self.join_key, self.num_blocks, self.nbytes = name, key, blocks, nbytes
        self.joined = False
        self.calls = calls
        self.error = error

    def _run(self, names: list[str]) -> str:
        self.calls.append(names)
        if self.error is not None:
            raise self.error
        return "+".join(names)

    def __call__(self) -> str:
        return self._run([self.name])

    def join(self, others: Any) -> Any:
        return lambda: self._run([self.name, *(o.name for o in others)])


async def _queued_behind_a_held_call(
    lane: Lane, writes: list[FakeWrite], cancel: set[str] = frozenset()  # type: ignore[assignment]
) -> dict[str, Any]:
    """Queue ``writes`` (cancelling those named in ``cancel`` while queued) behind a call
    that holds the lane's thread, then let it go; each caller's result or error."""
    got: dict[str, Any] = {}
    held = Held()

    async def call(w: FakeWrite, scope: trio.CancelScope) -> None:
        with scope:
            try:
                got[w.name] = await lane.run_sync(w)
            except Exception as exc:  # (the test looks at it)
                got[w.name] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lane.run_sync, held)
        await held.wait_entered()
        scopes = {}
        for w in writes:
            scopes[w.name] = trio.CancelScope()
            nursery.start_soon(call, w, scopes[w.name])
            await trio.testing.wait_all_tasks_blocked()  # queued in this order
        for name in cancel:
            scopes[name].cancel()
        await trio.testing.wait_all_tasks_blocked()
        held.go.set()
    return got


async def test_queued_writes_for_one_peer_share_one_call() -> None:
    """Four writes queued while the thread is busy: A, B, C for peer p join one call (up to
    ``join_blocks``); D, for another peer, runs on its own; E for p does not fit the block
    limit and starts the next joined call. Each caller gets the shared call's result, and
    every write that rode in another's call is marked ``joined``."""
    calls: list[list[str]] = []
    lane = Lane("t", depth=2, join_blocks=100)
    writes = [FakeWrite("A", "p", 40, calls), FakeWrite("B", "p", 30, calls),
              FakeWrite("C", "p", 30, calls), FakeWrite("D", "q", 10, calls),
              FakeWrite("E", "p", 50, calls), FakeWrite("F", "p", 60, calls)]
    got = await _queued_behind_a_held_call(lane, writes)
    assert calls == [["A", "B", "C"], ["D"], ["E"], ["F"]]  # E+F = 110 > 100
    assert got == {"A": "A+B+C", "B": "A+B+C", "C": "A+B+C", "D": "D", "E": "E", "F": "F"}
    assert [w.joined for w in writes] == [False, True, True, False, False, False]
    lane.close()


async def test_a_write_cancelled_while_queued_does_not_join() -> None:
    calls: list[list[str]] = []
    lane = Lane("t", join_blocks=100)
    writes = [FakeWrite(n, "p", 10, calls) for n in "ABC"]
    got = await _queued_behind_a_held_call(lane, writes, cancel={"B"})
    assert calls == [["A", "C"]]
    assert got == {"A": "A+C", "C": "A+C"}  # (B's caller was cancelled: no result)
    lane.close()


async def test_a_shared_call_that_fails_fails_each_caller_with_its_own_error() -> None:
    calls: list[list[str]] = []
    lane = Lane("t", join_blocks=100)
    boom = RuntimeError("outcome unknown")
    writes = [FakeWrite("A", "p", 10, calls, error=boom), FakeWrite("B", "p", 10, calls)]
    got = await _queued_behind_a_held_call(lane, writes)
    assert calls == [["A", "B"]]
    assert isinstance(got["A"], RuntimeError) and isinstance(got["B"], RuntimeError)
    assert got["A"] is not got["B"] and str(got["B"]) == "outcome unknown"
    lane.close()


class UncopyableError(Exception):
    """An engine's own error type whose ``__init__`` takes other arguments than its
    ``args``: ``copy.copy`` cannot rebuild it (TypeError)."""

    def __init__(self, message: str, peer: str) -> None:
        super().__init__(message)
        self.peer = peer


async def test_a_shared_call_error_that_cannot_be_copied_still_reaches_every_caller() -> None:
    """The copy for the second caller raised TypeError inside trio's run_sync_soon callback:
    trio's run crashed and then waited for good on the callers (found by a review; the end
    to end case hung an agent's whole event loop). Now the first caller gets the error
    itself, the others a TransferError naming it, chained from it."""
    from trio_pd import TransferError

    calls: list[list[str]] = []
    lane = Lane("t", join_blocks=100)
    odd = UncopyableError("outcome unknown", "p")
    writes = [FakeWrite("A", "p", 10, calls, error=odd), FakeWrite("B", "p", 10, calls),
              FakeWrite("C", "p", 10, calls)]
    with trio.fail_after(BOUND):
        got = await _queued_behind_a_held_call(lane, writes)
    assert calls == [["A", "B", "C"]]
    assert got["A"] is odd
    for name in "BC":
        assert type(got[name]) is TransferError and got[name].__cause__ is odd
        assert "UncopyableError: outcome unknown" in str(got[name])
    lane.close()


async def test_a_join_that_fails_fails_every_caller_and_the_lane_goes_on() -> None:
    """``join`` ran outside the lane's capture: a MemoryError there killed the lane's
    thread, and every caller of the group waited for good, uncancellably."""
    calls: list[list[str]] = []
    lane = Lane("t", join_blocks=100)

    class Unjoinable(FakeWrite):
        def join(self, others: Any) -> Any:
            raise MemoryError("no room to join")

    writes = [Unjoinable("A", "p", 10, calls), FakeWrite("B", "p", 10, calls)]
    with trio.fail_after(BOUND):
        got = await _queued_behind_a_held_call(lane, writes)
        assert await lane.run_sync(FakeWrite("C", "p", 10, calls)) == "C"
    assert isinstance(got["A"], MemoryError) and isinstance(got["B"], MemoryError)
    lane.close()


async def test_writes_do_not_join_when_joining_is_off() -> None:
    calls: list[list[str]] = []
    lane = Lane("t")  # join_blocks=0
    got = await _queued_behind_a_held_call(lane, [FakeWrite(n, "p", 1, calls) for n in "AB"])
    assert calls == [["A"], ["B"]] and got == {"A": "A", "B": "B"}
    lane.close()


async def test_large_writes_do_not_join() -> None:
    """The byte bound: writes join only while their bytes together stay within
    ``join_bytes`` (small writes, whose cost is the call); a write over it runs alone."""
    calls: list[list[str]] = []
    lane = Lane("t", join_blocks=100, join_bytes=1000)
    writes = [FakeWrite("A", "p", 1, calls, nbytes=400), FakeWrite("B", "p", 1, calls, nbytes=500),
              FakeWrite("C", "p", 1, calls, nbytes=200), FakeWrite("D", "p", 1, calls, nbytes=5000),
              FakeWrite("E", "p", 1, calls, nbytes=10)]
    got = await _queued_behind_a_held_call(lane, writes)
    assert calls == [["A", "B"], ["C"], ["D"], ["E"]]
    assert got["A"] == got["B"] == "A+B" and got["D"] == "D"
    lane.close()
