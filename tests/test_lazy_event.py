"""A room's LazyEvent: its hooks (how the thread facade learns a room ended without a task)."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from trio_pd.agents._lazy import LazyEvent


def test_hooks_run_once_in_order_inside_set() -> None:
    event, seen = LazyEvent(), []
    event.when_set(lambda: seen.append("a"))
    event.when_set(lambda: seen.append("b"))
    assert seen == []
    event.set()
    assert seen == ["a", "b"]
    event.set()  # (a second set runs nothing again)
    assert seen == ["a", "b"]


def test_a_hook_given_after_set_runs_at_once() -> None:
    event, seen = LazyEvent(), []
    event.set()
    event.when_set(lambda: seen.append("late"))
    assert seen == ["late"]


def test_a_raising_hook_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    event, seen = LazyEvent(), []

    def bad() -> None:
        raise RuntimeError("hook bug")

    event.when_set(bad)
    event.when_set(lambda: seen.append("after"))
    with caplog.at_level(logging.ERROR, logger="trio_pd.agents._lazy"):
        event.set()  # (raises nothing into the code that set it)
    assert seen == ["after"]
    assert "hook bug" in caplog.text


async def test_waiters_and_hooks_both_see_set() -> None:
    event, seen = LazyEvent(), []
    event.when_set(lambda: seen.append("hook"))
    async with trio.open_nursery() as nursery:

        async def waiter() -> None:
            await event.wait()
            seen.append("waiter")

        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        event.set()
        assert seen == ["hook"]  # (the hook ran inside set; the waiter is only woken)
    assert seen == ["hook", "waiter"]
