"""Faults a test injects: every write stalled inside a FaultEngine, an abort while one is held,
and the broken drain (an engine call abandoned on abort) that the sanitizer must catch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio

from trio_pd import DecodeReceiver, PrefillSender
from trio_pd.agents import _prefill
from trio_pd.engines import TransferEngine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.io._lane import run_to_end


def stall_every_write(
    drain: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[FaultEngine], Callable[[TransferEngine], TransferEngine]]:
    """Set-up of a drain test: the drain broken if ``drain == "broken"``
    (:func:`break_the_drain`), and a ``wrap`` for prefill's engine that stalls every write
    in a :class:`FaultEngine`, which lands in the returned list."""
    if drain == "broken":
        break_the_drain(monkeypatch)
    faults: list[FaultEngine] = []

    def wrap(engine: TransferEngine) -> TransferEngine:
        faults.append(FaultEngine(engine, lambda _i, _p, _n: Fault("stall")))
        return faults[0]

    return faults, wrap


async def abort_a_stalled_write(
    drain: str, fault: FaultEngine, receiver: DecodeReceiver, sender: PrefillSender,
    released: trio.Event, *, bound: float = 15.0, quiet: float = 0.3,
) -> None:
    """With the room's last write stalled inside ``fault`` (a stalling :class:`FaultEngine`
    around prefill's engine), abort it on decode; then check when decode released its
    memory (``released``, set by the room's ``on_release``): not while the write is held
    with the real drain; at once with the drain broken (:func:`break_the_drain`). Then let
    the write go and wait until it has returned and both sides released, and a moment more,
    so that a late write has landed before the caller looks for it."""
    gate = fault.stalls
    with trio.fail_after(bound):
        await gate.wait_stalled_async(1)  # the write is inside the engine
    receiver.abort("test: abort while the write is under way")
    if drain == "real":
        with trio.move_on_after(quiet):
            await released.wait()
        assert not released.is_set(), "released while a write could still land"
    else:
        with trio.fail_after(bound):
            await released.wait()  # the bug: released at once
    gate.release_all()
    with trio.fail_after(bound):
        await released.wait()
        await sender.wait_released()
        # the write has returned (a counter: no event to wait on)
        while fault.statistics().blocks_written == 0:  # noqa: ASYNC110
            await trio.sleep(0.01)
    await trio.sleep(quiet)


def break_the_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every prefill agent made from now on abandon an engine call that already reached
    its thread when its room is aborted (the bug the sanitizer exists to catch)."""
    real_init = _prefill.PrefillAgent.__init__

    def abandoning_init(self: _prefill.PrefillAgent, *args: Any, **kw: Any) -> None:
        real_init(self, *args, **kw)
        # the bug: an abort no longer waits for a call that already reached its thread
        self.peers.run_engine_call = lambda _lane, fn: trio.to_thread.run_sync(
            run_to_end, fn, abandon_on_cancel=True
        )

    monkeypatch.setattr(_prefill.PrefillAgent, "__init__", abandoning_init)
