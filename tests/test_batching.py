"""Batching across rooms: chunk writes of several rooms queued at once for the same decode peer
share one engine call (``PrefillConfig.batch_blocks``; the lane's "joining", trio_pd/io/_lane.py).

Real engines, real ZeroMQ, the real bootstrap. The first write is held at a
:class:`~trio_pd.engines.fault.FaultEngine` stall gate, so the next rooms' chunks are queued on
the lane when it lets go: what the lane then finds queued is what joins, never more.
"""

from __future__ import annotations

import numpy as np
import trio

from trio_pd import EngineError, KVPoll, PrefillConfig
from trio_pd.engines import TransferEngine
from trio_pd.engines.fault import Fault, FaultEngine, Policy

from .helpers.agents import Pair, host_pool, open_pair

BOUND = 10.0
ROOMS = 5


def faults(policy: Policy) -> tuple[list[FaultEngine], object]:
    made: list[FaultEngine] = []

    def wrap(inner: TransferEngine) -> TransferEngine:
        made.append(FaultEngine(inner, policy))
        return made[-1]

    return made, wrap


async def _rooms_behind_a_stall(
    pair: Pair, gate_engine: FaultEngine, n: int = 2
) -> tuple[dict[int, KVPoll], dict[int, BaseException | None]]:
    """Room 0's write is held at the gate; rooms 1..ROOMS-1 send one ``n``-page chunk each
    while it is held; then the gate opens. Each room's outcome (byte-verified where Success),
    and each prefill sender's failure."""
    senders, receivers = {}, {}
    for room in range(ROOMS):
        pages = np.arange(room * n, room * n + n)
        dst_pages = pages + 100
        pair.src.fill(pages, room=room)
        pair.src.fill_aux(room, room=room)
        senders[room] = pair.prefill.sender(room, num_pages=n, aux_slot=room)
        receivers[room] = pair.decode.receiver(room, bootstrap_url=pair.url)
        receivers[room].init(dst_pages, room)
    with trio.fail_after(BOUND):
        while any(s.poll() is not KVPoll.WaitingForInput for s in senders.values()):  # noqa: ASYNC110
            await trio.sleep(0.005)
    senders[0].send(np.arange(n), last=True)
    with trio.fail_after(BOUND):
        await gate_engine.stalls.wait_stalled_async(1)
    for room in range(1, ROOMS):
        senders[room].send(np.arange(room * n, room * n + n), last=True)
    await trio.sleep(0.05)  # (every chunk is queued on the lane: nothing waits on a batch)
    gate_engine.stalls.release_all()
    out = {}
    with trio.fail_after(BOUND):
        for room in range(ROOMS):
            out[room] = await receivers[room].wait()
            await senders[room].wait()
            if out[room] is KVPoll.Success:
                pages = np.arange(room * n, room * n + n) + 100
                assert pair.verify(room, pages, room), f"room {room}: bytes differ"
    return out, {room: s.failure for room, s in senders.items()}


async def test_queued_rooms_share_engine_calls(engine_name: str, bootstrap_url: str) -> None:
    """Rooms 1..4 queue behind the held write; the lane starts one of them (two writes in
    flight), and the others join one call: fewer engine calls than chunks, each joined chunk
    counted ``chunks_batched``, every room Success and verified. (With ``batch_blocks=0``:
    one call per chunk, nothing batched.)"""
    for batch_blocks, want_batched in ((1024, True), (0, False)):
        made, wrap = faults(lambda i, _p, _n: Fault("stall") if i == 0 else None)
        cfg = PrefillConfig(batch_blocks=batch_blocks, coalesce_pages=1)
        async with open_pair(engine_name, bootstrap_url, wrap=wrap,  # type: ignore[arg-type]
                             prefill_config=cfg) as pair:
            out, _ = await _rooms_behind_a_stall(pair, made[0])
            stats = pair.prefill.statistics()
        assert all(s is KVPoll.Success for s in out.values()), out
        if want_batched:
            assert stats.chunks_batched >= 2, stats
            assert stats.engine_calls + stats.chunks_batched == ROOMS
            assert made[0].statistics().calls < ROOMS
        else:
            assert stats.chunks_batched == 0 and stats.engine_calls == ROOMS


async def test_how_large_joined_writes_may_be_is_the_engines_call(
    engine_name: str, bootstrap_url: str
) -> None:
    """Rooms of 1.5 MiB each, queued behind a held write. By default the engine says how
    large a joined call may be (``trio_pd.engines.join_bytes``): NIXL joins them (32 MiB),
    Mooncake sends each alone (1 MiB: its TCP transport finishes a joined call's rooms
    together). ``PrefillConfig.batch_bytes`` overrides the engine's figure either way."""
    engine_joins = {"nixl": True, "mooncake": False}[engine_name]
    pool = dict(num_pages=192, page_size=16, head_bytes=1024)  # 128 KiB a page, 4 buffers
    for batch_bytes, want_batched in ((None, engine_joins), (1 << 20, False), (64 << 20, True)):
        made, wrap = faults(lambda i, _p, _n: Fault("stall") if i == 0 else None)
        cfg = PrefillConfig(batch_bytes=batch_bytes, coalesce_pages=1)
        async with open_pair(engine_name, bootstrap_url, wrap=wrap,  # type: ignore[arg-type]
                             prefill_config=cfg, src=host_pool(**pool),
                             dst=host_pool(**pool)) as pair:
            assert sum(pair.src.spec.item_lens) * 12 >= 1.5 * (1 << 20)
            out, _ = await _rooms_behind_a_stall(pair, made[0], n=12)
            stats = pair.prefill.statistics()
        assert all(s is KVPoll.Success for s in out.values()), (batch_bytes, out)
        assert (stats.chunks_batched > 0) is want_batched, (batch_bytes, stats)
        assert stats.engine_calls + stats.chunks_batched == ROOMS


async def test_a_shared_call_that_fails_fails_every_room_in_it(
    engine_name: str, bootstrap_url: str
) -> None:
    """The joined call fails in the engine (its outcome is unknown): every room whose chunk
    rode in it fails with the engine's error and quarantines its own lease; the rooms of the
    other calls succeed, verified."""
    made, wrap = faults(lambda i, _p, _n: Fault("stall") if i == 0 else (
        Fault("fail") if i == 1 else None))  # (call 1: the rooms queued behind call 0)
    cfg = PrefillConfig(batch_blocks=1024, coalesce_pages=1, quarantine_fence=0.2)
    async with open_pair(engine_name, bootstrap_url, wrap=wrap,  # type: ignore[arg-type]
                         prefill_config=cfg) as pair:
        out, failures = await _rooms_behind_a_stall(pair, made[0])
        stats = pair.prefill.statistics()
    failed = [r for r, s in out.items() if s is not KVPoll.Success]
    assert made[0].statistics().calls == 2  # rooms 1..4 rode in one engine call, which failed
    assert failed == list(range(1, ROOMS)), out
    assert stats.quarantined == stats.engine_errors == ROOMS - 1, stats
    assert all(isinstance(failures[r], EngineError) for r in failed), failures
