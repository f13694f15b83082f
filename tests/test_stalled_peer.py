"""A decode peer that stops taking writes holds up only the rooms that write to it.

Real engines (both), real ZeroMQ, the real bootstrap service: one prefill rank and two decode
instances (each TP 1, so both are decode rank 0: what tells their rooms apart is the endpoint).
The prefill engine is wrapped in a :class:`~trio_pd.engines.fault.FaultEngine` that holds
every write to the second decode instance, as a stopped process or a black-holed host would.
More rooms go to it than the prefill rank has workers, so with one job queue for every
destination all the workers wait on it; the first decode instance's rooms must still finish
at once. (The chaos suite's ``test_stalled_reader`` is the same with a SIGSTOPped process.)
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import numpy as np
import pytest
import trio
import trio.testing

from trio_pd import (
    DecodeAgent,
    DecodeReceiver,
    KVPoll,
    PrefillConfig,
    PrefillSender,
    open_decode,
    open_prefill,
)
from trio_pd.agents._jobs import JobQueues
from trio_pd.engines import make_engine
from trio_pd.engines.fault import Fault, FaultEngine

from .helpers.agents import host_pool, poll_until, verify_room

BOUND = 15.0
WORKERS = 2


def pages_of(room: int) -> np.ndarray:
    return np.arange(4 * room, 4 * room + 4)


async def test_a_stalled_decode_peer_holds_up_only_its_own_rooms(
    engine_name: str, bootstrap_url: str
) -> None:
    src, healthy_pool, stalled_pool = host_pool(), host_pool(), host_pool()
    healthy_engine, stalled_engine = make_engine(engine_name), make_engine(engine_name)
    stalled_session = stalled_engine.session_id

    def stall_the_second(_i: int, peer: str, _n: int) -> Fault | None:
        return Fault("stall") if peer == stalled_session else None

    fault = FaultEngine(make_engine(engine_name), stall_the_second)
    released: list[int] = []
    async with AsyncExitStack() as stack:
        stack.callback(fault.close)
        stack.callback(healthy_engine.close)
        stack.callback(stalled_engine.close)
        prefill = await stack.enter_async_context(
            open_prefill(
                engine=fault,
                pool=src.spec,
                bootstrap_url=bootstrap_url,
                kv_heads=2,
                config=PrefillConfig(workers=WORKERS, coalesce_pages=1),
            )
        )
        healthy = await stack.enter_async_context(
            open_decode(engine=healthy_engine, pool=healthy_pool.spec)
        )
        stalled = await stack.enter_async_context(
            open_decode(engine=stalled_engine, pool=stalled_pool.spec)
        )

        def start(room: int, decode: DecodeAgent) -> tuple[PrefillSender, DecodeReceiver]:
            """Room ``room`` (below 50): its own 4 pages and aux row on every pool."""
            pages, slot = pages_of(room), room
            src.fill(pages, room)
            src.fill_aux(slot, room)
            sender = prefill.sender(
                room, num_pages=4, aux_slot=slot, on_release=lambda: released.append(room)
            )
            receiver = decode.receiver(room, bootstrap_url=bootstrap_url)
            receiver.init(pages, slot, on_release=lambda: released.append(-room))
            sender.send(pages, last=True)
            return sender, receiver

        stuck = [start(room, stalled) for room in range(1, 2 * WORKERS + 2)]
        try:
            with trio.fail_after(BOUND):  # a write is held; every worker for that peer waits on it
                await fault.stalls.wait_stalled_async(1)
                await poll_until(lambda: prefill.jobs.tasks == WORKERS and len(prefill.jobs) > 0)
            for room in range(21, 24):  # the healthy peer's rooms, one after the other
                sender, receiver = start(room, healthy)
                with trio.fail_after(BOUND / 3):
                    assert await receiver.wait() is KVPoll.Success, receiver.failure
                    assert await sender.wait() is KVPoll.Success, sender.failure
                assert verify_room(src, healthy_pool, room, pages_of(room), room)
            assert all(s.poll() is KVPoll.Transferring for s, _ in stuck)
        finally:
            fault.stalls.release_all()  # the stalled peer takes its writes again
        with trio.fail_after(BOUND):
            for (sender, receiver), room in zip(stuck, range(1, 2 * WORKERS + 2), strict=True):
                assert await receiver.wait() is KVPoll.Success, receiver.failure
                assert await sender.wait() is KVPoll.Success, sender.failure
                await sender.wait_released()
                assert verify_room(src, stalled_pool, room, pages_of(room), room)
    rooms = [*range(1, 2 * WORKERS + 2), *range(21, 24)]
    # every source page back once; decode's pages are the caller's after Success (no release)
    assert sorted(released) == sorted(rooms)


async def test_job_queues_bound_their_tasks_per_destination() -> None:
    """At most ``per_key`` tasks per destination, started as jobs come, gone with the work;
    a destination's jobs run in the order they were put."""
    gates = {key: trio.Event() for key in ("a", "b")}
    ran: list[tuple[str, int]] = []
    most: dict[str, int] = {"a": 0, "b": 0}
    running: dict[str, int] = {"a": 0, "b": 0}

    async def run(job: tuple[str, int]) -> None:
        key, _ = job
        ran.append(job)
        running[key] += 1
        most[key] = max(most[key], running[key])
        await gates[key].wait()
        running[key] -= 1

    queues = JobQueues[tuple[str, int]](run, per_key=3)
    async with trio.open_nursery() as nursery:
        queues.start(nursery)
        for n in range(10):
            queues.put("a", ("a", n))
        queues.put("b", ("b", 0))
        await trio.testing.wait_all_tasks_blocked()
        assert queues.tasks == 4 and len(queues) == 7  # 3 for a, 1 for b; a's 7 wait
        assert ("b", 0) in ran  # b's job did not wait behind a's
        gates["b"].set()
        gates["a"].set()
    assert most == {"a": 3, "b": 1}
    assert [n for key, n in ran if key == "a"] == list(range(10))
    assert queues.tasks == 0 and len(queues) == 0 and not queues._queues


def test_job_queues_need_a_task_per_destination() -> None:
    with pytest.raises(ValueError, match="per_key"):
        JobQueues[int](trio.sleep, per_key=0)
