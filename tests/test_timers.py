"""The agent's one timers task (``io/_timers.py``): deadline order, ties in arming order, and
the clock it reads (the run's own: under a mock clock, that one)."""

from __future__ import annotations

import gc
import weakref

import pytest
import trio
import trio.testing

from trio_pd.io._timers import Timers


def nothing(_: object) -> None:
    """An action for deadlines that never come up in the test."""


async def test_after_runs_in_deadline_order_ties_in_arming_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    timers = Timers()
    fired: list[tuple[str, float]] = []

    def mark(name: str) -> None:
        fired.append((name, trio.current_time()))

    start = trio.current_time()
    timers.after(2.0, mark, "late")  # armed before the task runs: still this clock
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        await trio.testing.wait_all_tasks_blocked()
        for name in ("a", "b", "c"):
            timers.after(1.0, mark, name)
        timers.at(start + 0.5, mark, "early")
        await trio.sleep(3.0)
        nursery.cancel_scope.cancel()
    assert [name for name, _ in fired] == ["early", "a", "b", "c", "late"]
    assert [round(t - start, 6) for _, t in fired] == [0.5, 1.0, 1.0, 1.0, 2.0]
    assert len(timers) == 0


async def test_the_clock_is_the_runs_while_running_and_the_plain_call_after(
    autojump_clock: trio.abc.Clock,
) -> None:
    timers = Timers()
    assert timers.clock is trio.current_time
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        await trio.testing.wait_all_tasks_blocked()
        assert timers.clock == autojump_clock.current_time
        await trio.sleep(5.0)
        assert timers.clock() == trio.current_time()
        nursery.cancel_scope.cancel()
    assert timers.clock is trio.current_time


async def test_a_cancelled_deadline_never_runs_and_lets_its_action_go_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """What a deadline holds (its action's argument: a room's record) is let go when it is
    cancelled, not when its deadline comes; cancelling twice, or after it ran, changes
    nothing."""

    class Held:
        pass

    timers = Timers()
    fired: list[object] = []
    held = Held()
    gone = weakref.ref(held)
    keep = timers.after(1.0, fired.append, "kept")
    drop = timers.after(300.0, fired.append, held)
    del held
    timers.cancel(drop)
    gc.collect()
    assert gone() is None, "a cancelled deadline still holds its action"
    timers.cancel(drop)
    assert len(timers) == 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        await trio.sleep(400.0)
        timers.cancel(keep)  # (ran already)
        nursery.cancel_scope.cancel()
    assert fired == ["kept"] and len(timers) == 0


async def test_a_deadline_that_ran_lets_its_argument_go_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Once an action has run, neither its handle (kept in a room's list until the room is
    forgotten) nor the timer task, asleep until the next deadline, holds its argument."""

    class Held:
        pass

    timers = Timers()
    held = Held()
    gone = weakref.ref(held)
    handle = timers.after(1.0, nothing, held)
    del held
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        await trio.sleep(2.0)  # it ran; run() now sleeps with nothing armed
        gc.collect()
        assert gone() is None and handle[2:] == [None, None]
        nursery.cancel_scope.cancel()


async def test_an_action_that_raises_is_logged_and_the_next_ones_still_run(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """One deadline's bug must not end the agent's timer task: it is logged with its
    argument, and the deadlines after it run."""

    def boom(key: str) -> None:
        raise RuntimeError(key)

    timers = Timers()
    fired: list[str] = []
    timers.after(1.0, boom, "room 7")
    timers.after(1.0, fired.append, "same deadline")
    timers.after(2.0, fired.append, "later")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        await trio.sleep(3.0)
        nursery.cancel_scope.cancel()
    assert fired == ["same deadline", "later"]
    [record] = [r for r in caplog.records if r.name == "trio_pd.timers"]
    assert "'room 7'" in record.getMessage() and record.exc_info is not None


def test_cancelled_deadlines_never_grow_the_heap_past_twice_the_armed_ones() -> None:
    """100,000 rooms, each arming one long deadline cancelled when the room ends: the heap
    stays bounded by the deadlines still armed (what a server with 300-second timeouts
    would otherwise hold for five minutes)."""
    timers = Timers()
    timers.clock = lambda: 0.0
    armed = [timers.after(300.0 + k, nothing, None) for k in range(10)]
    biggest = 0
    for k in range(100_000):
        timers.cancel(timers.after(300.0 + k % 7, nothing, None))
        biggest = max(biggest, len(timers._heap))
    assert len(timers) == len(armed) == 10
    assert biggest <= 2 * 10 + 66


async def test_cancel_all_cancels_each_once_clears_the_list_and_keeps_the_heap_bounded(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A room's deadlines, cancelled together when it is forgotten (``cancel_all``): none
    runs, the room's list is emptied, one that ran or was cancelled already is not counted
    twice, and rooms forgotten by the thousand leave the heap bounded as single cancels do."""
    timers = Timers()
    fired: list[str] = []
    ran = timers.after(1.0, fired.append, "ran")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        await trio.sleep(2.0)
        room = [timers.after(5.0, fired.append, "a"), ran,
                timers.after(9.0, fired.append, "b")]
        timers.cancel(room[2])  # (cancelled once already: counted once)
        timers.cancel_all(room)
        assert room == [] and len(timers) == 0
        await trio.sleep(20.0)
        nursery.cancel_scope.cancel()
    assert fired == ["ran"]
    timers.clock = lambda: 0.0
    kept = [timers.after(300.0 + k, nothing, None) for k in range(10)]
    biggest = 0
    for _ in range(10_000):
        timers.cancel_all([timers.after(300.0, nothing, None), timers.after(301.0, nothing, None)])
        biggest = max(biggest, len(timers._heap))
    assert len(timers) == len(kept) == 10
    assert biggest <= 2 * 10 + 66 + 2
