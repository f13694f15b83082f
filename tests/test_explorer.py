"""The schedule explorer: it really controls trio's order, finds races, and replays them.

These are plain ``def`` tests: the explorer calls ``trio.run`` itself, once per schedule.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.lowlevel

from trio_pd.testing import (
    Deadlock,
    Livelock,
    Schedule,
    ScheduleMismatch,
    assert_all_schedules,
    explore,
    hook_available,
    replay,
)


def test_hook_available_on_pinned_trio() -> None:
    # The canary: if a trio upgrade moves the private scheduling hook, this fails first.
    assert hook_available()


def _appenders(
    names: str, steps: int, seen: list[tuple[str, ...]]
) -> Callable[[], Awaitable[None]]:
    """Tasks ``names`` each append ``<name><i>`` for ``steps`` steps, one checkpoint apart."""

    async def scenario() -> None:
        out: list[str] = []

        async def task(name: str) -> None:
            for i in range(steps):
                if i:
                    await trio.lowlevel.checkpoint()
                out.append(f"{name}{i}")

        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(task, name)
        seen.append(tuple(out))

    return scenario


def test_two_tasks_run_in_both_orders() -> None:
    seen: list[tuple[str, ...]] = []
    result = explore(_appenders("ab", 1, seen))
    # One batch {a, b}: two orders, each visited once.
    assert result.schedules_run == 2
    assert result.exhaustive
    assert result.failures == []
    assert sorted(seen) == [("a0", "b0"), ("b0", "a0")]


def test_every_interleaving_of_two_steps_visited_exactly_once() -> None:
    seen: list[tuple[str, ...]] = []
    result = explore(_appenders("ab", 2, seen))
    # Two batches {a, b} in a row, 2 orders each: 4 schedules, all different.
    assert result.schedules_run == 4
    assert result.exhaustive
    assert sorted(seen) == sorted(
        (*first, *second)
        for first in itertools.permutations(["a0", "b0"])
        for second in itertools.permutations(["a1", "b1"])
    )


def test_full_permutations_and_first_only() -> None:
    seen: list[tuple[str, ...]] = []
    full = explore(_appenders("abc", 1, seen))
    assert full.schedules_run == 6  # 3! orders of one batch of three
    assert sorted(seen) == sorted(itertools.permutations(["a0", "b0", "c0"]))

    seen.clear()
    first = explore(_appenders("abc", 1, seen), first_only=True)
    assert first.schedules_run == 3  # which task runs first; the rest in spawn order
    assert first.exhaustive
    assert sorted(seen) == [("a0", "b0", "c0"), ("b0", "a0", "c0"), ("c0", "a0", "b0")]


def test_replay_runs_exactly_the_given_schedule() -> None:
    seen: list[tuple[str, ...]] = []
    replay(_appenders("abc", 1, seen), Schedule((2, 1)))
    replay(_appenders("abc", 1, seen), Schedule((2,), first_only=True))
    assert seen == [("c0", "b0", "a0"), ("c0", "a0", "b0")]


# --- lost update ----------------------------------------------------------------------------


def _counter_scenario(*, locked: bool) -> Callable[[], Awaitable[None]]:
    async def scenario() -> None:
        value = 0
        lock = trio.Lock()

        async def increment(head_start: int) -> None:
            nonlocal value
            for _ in range(head_start):
                await trio.lowlevel.checkpoint()
            if locked:
                async with lock:
                    x = value
                    await trio.lowlevel.checkpoint()
                    value = x + 1
            else:
                x = value
                await trio.lowlevel.checkpoint()
                value = x + 1

        async with trio.open_nursery() as nursery:
            # The first reads in the first batch, the second one batch later, while the
            # first is writing: only some orders of that batch lose the update.
            nursery.start_soon(increment, 0)
            nursery.start_soon(increment, 1)
        assert value == 2, f"lost update: value == {value}"

    return scenario


def test_lost_update_found_and_replayed() -> None:
    result = explore(_counter_scenario(locked=False))
    assert len(result.failures) == 1
    failure = result.failures[0]
    assert isinstance(failure.exception, AssertionError)
    assert "value == 1" in str(failure.exception)
    # Batch 2 holds {first writes, second reads}; the FIFO order is fine, the next one
    # (second reads first) loses the update.
    assert failure.schedule == Schedule((0, 1))
    assert result.schedules_run == 2
    assert not result.exhaustive

    for _ in range(2):
        with pytest.raises(AssertionError, match="lost update: value == 1"):
            replay(_counter_scenario(locked=False), failure.schedule)
    replay(_counter_scenario(locked=False), Schedule((0, 0)))  # and the other order passes


def test_lost_update_needs_the_read_before_the_write() -> None:
    result = explore(_counter_scenario(locked=False), stop_on_first_failure=False)
    # Two batches of two tasks: 4 schedules; the 2 where the second task reads first fail.
    assert result.schedules_run == 4
    assert result.exhaustive
    assert [f.schedule.choices for f in result.failures] == [(0, 1), (1, 1)]


def test_lock_fixes_lost_update() -> None:
    result = assert_all_schedules(_counter_scenario(locked=True))
    assert result.exhaustive
    assert result.schedules_run == 4


# --- publication race: check outside the lock -----------------------------------------------


def _publication_scenario(*, check_inside_lock: bool) -> Callable[[], Awaitable[None]]:
    """A publisher announces "Success" unless the room was cancelled; an aborter cancels it.

    Invariant: once the aborter has set ``cancelled`` (under the lock), "Success" is never
    published.
    """

    async def scenario() -> None:
        lock = trio.Lock()
        cancelled = False
        published: list[str] = []
        published_when_aborted: int | None = None

        async def publisher() -> None:
            await trio.lowlevel.checkpoint()  # the transfer itself
            if check_inside_lock:
                async with lock:
                    if not cancelled:
                        published.append("Success")
            elif not cancelled:
                await trio.lowlevel.checkpoint()  # e.g. recording the transfer's statistics
                async with lock:
                    published.append("Success")

        async def aborter() -> None:
            nonlocal cancelled, published_when_aborted
            async with lock:
                cancelled = True
                published_when_aborted = len(published)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher)
            nursery.start_soon(aborter)
        assert published_when_aborted is not None
        late = published[published_when_aborted:]
        assert late == [], f"published {late} after the abort"

    return scenario


def test_check_outside_lock_race_found_and_replayed() -> None:
    scenario = _publication_scenario(check_inside_lock=False)
    result = explore(scenario)
    assert len(result.failures) == 1
    schedule = result.failures[0].schedule
    for _ in range(2):
        with pytest.raises(AssertionError, match=r"published \['Success'\] after the abort"):
            replay(scenario, schedule)

    with pytest.raises(AssertionError, match="Schedule") as excinfo:
        assert_all_schedules(scenario)
    assert repr(schedule) in str(excinfo.value)
    assert isinstance(excinfo.value.__cause__, AssertionError)


def test_check_outside_lock_fails_only_in_some_schedules() -> None:
    result = explore(_publication_scenario(check_inside_lock=False), stop_on_first_failure=False)
    assert result.exhaustive
    assert result.schedules_run == 4
    # It fails when the publisher checks the flag before the aborter sets it.
    assert [f.schedule.choices for f in result.failures] == [(0, 0), (1, 0)]


def test_check_inside_lock_is_correct_in_every_schedule() -> None:
    result = assert_all_schedules(_publication_scenario(check_inside_lock=True))
    assert result.exhaustive
    assert result.schedules_run == 4


# --- determinism, bounds, harness errors ----------------------------------------------------


def test_exploration_is_deterministic() -> None:
    runs = [
        explore(_publication_scenario(check_inside_lock=False), stop_on_first_failure=False)
        for _ in range(2)
    ]
    assert runs[0].schedules_run == runs[1].schedules_run
    assert [f.schedule for f in runs[0].failures] == [f.schedule for f in runs[1].failures]
    first = [explore(_counter_scenario(locked=False)).failures[0].schedule for _ in range(2)]
    assert first[0] == first[1]


def test_max_schedules_bounds_exploration() -> None:
    seen: list[tuple[str, ...]] = []
    result = explore(_appenders("abc", 2, seen), max_schedules=5)
    assert result.schedules_run == 5
    assert not result.exhaustive
    assert len(set(seen)) == 5
    with pytest.raises(AssertionError, match="max_schedules=5"):
        assert_all_schedules(_appenders("abc", 2, seen), max_schedules=5)


def test_lock_order_deadlock_is_reported() -> None:
    async def scenario() -> None:
        first, second = trio.Lock(), trio.Lock()

        async def take(a: trio.Lock, b: trio.Lock) -> None:
            async with a:
                await trio.lowlevel.checkpoint()
                async with b:
                    pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, first, second)
            nursery.start_soon(take, second, first)

    result = explore(scenario)
    assert len(result.failures) == 1
    assert isinstance(result.failures[0].exception, Deadlock)
    with pytest.raises(Deadlock):
        replay(scenario, result.failures[0].schedule)


def test_livelock_is_reported() -> None:
    async def scenario() -> None:
        while True:
            await trio.lowlevel.checkpoint()

    result = explore(scenario)
    assert result.schedules_run == 1
    assert isinstance(result.failures[0].exception, Livelock)


def test_replay_rejects_a_schedule_from_another_scenario() -> None:
    seen: list[tuple[str, ...]] = []
    with pytest.raises(ScheduleMismatch, match="only 2 alternatives"):
        replay(_appenders("ab", 1, seen), Schedule((5,)))
    with pytest.raises(ScheduleMismatch, match="made 1 decisions"):
        replay(_appenders("ab", 1, seen), Schedule((0, 0, 1)))


def test_nondeterministic_scenario_is_rejected() -> None:
    calls = itertools.count()

    async def scenario() -> None:
        # Spawns one more task each call: the same choices lead somewhere else.
        async with trio.open_nursery() as nursery:
            for _ in range(2 + next(calls)):
                nursery.start_soon(trio.lowlevel.checkpoint)

    with pytest.raises(ScheduleMismatch, match="not deterministic"):
        explore(scenario)


# --- trio primitives under the explorer -----------------------------------------------------


def test_nested_nurseries_events_and_memory_channels() -> None:
    orders: set[tuple[str, ...]] = set()

    async def scenario() -> None:
        log: list[str] = []
        ready = trio.Event()
        send, receive = trio.open_memory_channel[int](1)
        received: list[int] = []

        async def producer() -> None:
            await ready.wait()
            async with send:
                for i in range(3):
                    await send.send(i)
                    log.append(f"sent{i}")

        async def consumer() -> None:
            async with receive:
                ready.set()
                async for item in receive:
                    received.append(item)
                    log.append(f"got{item}")

        async def watcher() -> None:
            await ready.wait()
            log.append("watcher")

        async with trio.open_nursery() as outer:
            outer.start_soon(consumer)
            async with trio.open_nursery() as inner:
                inner.start_soon(producer)
                inner.start_soon(watcher)
            log.append("inner done")
        assert received == [0, 1, 2]
        assert log.index("inner done") > log.index("sent2")
        orders.add(tuple(log))

    result = assert_all_schedules(scenario)
    assert result.schedules_run > 1
    assert len(orders) > 1  # the explorer really varied the interleaving
