"""Topologies P == D, P > D, P < D for MHA (with GQA head replication) and MLA (with dummy
ranks), on real engines through the demo driver; and failures that start on one prefill rank
of several (scenario 9, 12; SPEC §2, §4 I6).
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from trio_pd import (
    AdmissionClosed,
    DecodeConfig,
    EngineError,
    KVPoll,
    PrefillConfig,
    RemoteFailure,
    TransferAborted,
)
from trio_pd.engines import TransferEngine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.tools._demo import DemoOptions, check, run_in_process

from .helpers.agents import poll_until
from .helpers.cluster import open_cluster
from .helpers.engines import ENGINES

# ------------------------------------------------------------------------ the matrix

MHA = [(1, 1, 8), (2, 1, 8), (1, 2, 8), (4, 2, 8), (2, 4, 8), (8, 2, 4), (2, 8, 4)]
MLA = [(4, 1), (1, 4), (2, 2)]
#: pipeline parallelism: (PP stages, P, D, heads, layout), one layer per stage
PP = [(2, 2, 1, 8, "mha"), (2, 1, 2, 1, "mla")]
#: state components (Mamba, sliding window, NSA index pages) on shapes whose slots split
#: differently on the two sides: (P, D, heads, layout)
STATES = [(4, 2, 8, "mha"), (1, 4, 1, "mla")]


def _engines() -> list[tuple[str, list[pytest.MarkDecorator]]]:
    """(name, marks) of every engine in conftest's ENGINES (NIXL is skipped if missing)."""
    out = []
    for e in ENGINES:
        if isinstance(e, str):
            out.append((e, []))
        else:
            out.append((str(e.values[0]), list(e.marks)))
    return out


def _matrix() -> list[object]:
    out = []
    for engine, engine_marks in _engines():
        cases = [(p, d, h, "mha") for p, d, h in MHA] + [(p, d, 1, "mla") for p, d in MLA]
        for p, d, h, layout in cases:
            name = f"{engine}-{layout}-P{p}-D{d}" + (f"-H{h}" if layout == "mha" else "")
            out.append(pytest.param(p, d, h, layout, engine, 1, (), marks=engine_marks,
                                    id=name))
        for pp, p, d, h, layout in PP:
            name = f"{engine}-{layout}-PP{pp}-P{p}-D{d}" + (f"-H{h}" if layout == "mha" else "")
            out.append(pytest.param(p, d, h, layout, engine, pp, (), marks=engine_marks,
                                    id=name))
        for p, d, h, layout in STATES:
            name = f"{engine}-{layout}-P{p}-D{d}-states"
            out.append(pytest.param(p, d, h, layout, engine, 1, ("mamba", "swa", "nsa"),
                                    marks=engine_marks, id=name))
    return out


@pytest.mark.parametrize(("p", "d", "heads", "layout", "engine", "pp", "states"), _matrix())
async def test_topology_matrix(
    p: int, d: int, heads: int, layout: str, engine: str, pp: int, states: tuple[str, ...]
) -> None:
    """Every request succeeds and every destination byte is the right head's byte (the demo
    verifies each decode rank's pages against the bytes its heads must hold). MLA passes
    ``kv_heads=1`` (an MLA rank holds one replicated latent). With ``pp`` PP stages each
    stage holds one layer, and decode's bytes of each layer must be that layer's. With
    ``states``, every slot of every state component is verified too (the demo counts a bad
    one as a corrupt page)."""
    opts = DemoOptions(
        prefill_tp=p, decode_tp=d, kv_heads=heads, layout=layout,  # type: ignore[arg-type]
        requests=6, concurrency=3, min_tokens=1, max_tokens=64, page_size=4, chunk_pages=4,
        layers=pp, head_bytes=16, engine=engine, prefill_pp=pp, states=states,
    )
    with trio.fail_after(40):
        summary = await run_in_process(opts)
    assert summary["corrupt_pages"] == 0
    assert summary["succeeded"] == opts.requests, summary
    assert check(opts, summary) == []
    assert summary["bytes"] > 0


# ------------------------------------------------------------------------ hand-built clusters


def _fail_every_write(_index: int, _peer: str, _nblocks: int) -> Fault:
    return Fault("fail")


def _stall_every_write(_index: int, _peer: str, _nblocks: int) -> Fault:
    return Fault("stall")


async def test_engine_error_on_one_prefill_rank_fails_the_request(
    engine_name: str, bootstrap_url: str
) -> None:
    """P=2, D=1 (MHA, each prefill rank writes its own heads). Prefill rank 0's engine fails
    every write. The request fails on decode (a RemoteFailure, marked propagated); decode's
    ABORT fails the healthy rank 1's room too (it admits nothing more); rank 0's errored lease
    is quarantined, not released by the error; once both ranks acked, decode's pages come
    back."""
    opts = DemoOptions(prefill_tp=2, decode_tp=1, kv_heads=2, layers=1, page_size=4,
                       max_tokens=64, concurrency=2, head_bytes=16, engine=engine_name)
    faulty: list[FaultEngine] = []

    def wrap(engine: TransferEngine) -> TransferEngine:
        faulty.append(FaultEngine(engine, _fail_every_write))
        return faulty[0]

    async with open_cluster(
        engine_name, bootstrap_url, opts, wrap={0: wrap},
        prefill_config=PrefillConfig(quarantine_fence=0.5),
    ) as c:
        room, n = 9001, 8
        src = np.arange(8, 8 + n)
        dst = np.arange(20, 20 + n)[::-1].copy()
        released: dict[str, trio.Event] = {k: trio.Event() for k in ("p0", "p1", "d")}
        senders = []
        for i, r in enumerate(c.prefill):
            r.pool.fill(src, room)
            r.pool.fill_aux(2, room)
            senders.append(
                r.agent.sender(room, num_pages=n, aux_slot=2, on_release=released[f"p{i}"].set)
            )
        receiver = c.decode[0].receiver(room, bootstrap_url=bootstrap_url)
        receiver.init(dst, 3, on_release=released["d"].set)
        senders[1].send(src[:4])  # the healthy rank is mid-request
        senders[0].send(src, last=True)  # the faulty rank's only chunk fails in the engine
        with trio.fail_after(15):
            assert await receiver.wait() is KVPoll.Failed
            assert await senders[0].wait() is KVPoll.Failed
            assert await senders[1].wait() is KVPoll.Failed
            with pytest.raises(AdmissionClosed):
                senders[1].send(src[4:], last=True)
            await released["d"].wait()
            await released["p0"].wait()
            await released["p1"].wait()
        # decode: the failure came from another rank: RemoteFailure, propagated
        assert isinstance(receiver.failure, RemoteFailure), receiver.failure
        assert receiver.propagated
        assert "prefill rank 0" in str(receiver.failure)
        assert "EngineError" in str(receiver.failure)
        # the faulty rank failed on its own engine error
        assert isinstance(senders[0].failure, EngineError), senders[0].failure
        # the healthy rank failed because decode aborted the request
        assert isinstance(senders[1].failure, TransferAborted), senders[1].failure
        assert "aborted by decode" in str(senders[1].failure)
        p0, p1 = c.prefill[0].agent.statistics(), c.prefill[1].agent.statistics()
        assert p0.engine_errors >= 1 and p0.quarantined >= 1
        assert p0.released_after_quarantine >= 1  # the fence, not the error, released it
        assert p1.engine_errors == 0
        d = c.decode[0].statistics()
        assert d.acks_received == 2 and d.pages_held == 0 and d.released_by_timeout == 0
        assert faulty[0].statistics().faults.get("fail", 0) >= 1


@pytest.mark.parametrize("how", ["closes", "crashes"])
async def test_rank_lost_after_its_success_does_not_fail_the_room(
    engine_name: str, bootstrap_url: str, how: str
) -> None:
    """MLA, P=2, D=1: rank 1 is a dummy (writes nothing) and reports Success at once; rank 0's
    write is held in the engine. Rank 1 then goes away: it closes and says so (a BYE), or
    it crashes, says nothing, and the heartbeat declares it lost. Rank 1 owes nothing for
    the room any more, so once rank 0's write completes the room should succeed."""
    opts = DemoOptions(prefill_tp=2, decode_tp=1, layout="mla", kv_heads=1, layers=1,
                       page_size=4, max_tokens=64, concurrency=2, head_bytes=16,
                       engine=engine_name)
    stalling: list[FaultEngine] = []

    def wrap(engine: TransferEngine) -> TransferEngine:
        stalling.append(FaultEngine(engine, _stall_every_write))
        return stalling[0]

    config = DecodeConfig(heartbeat_interval=0.2, heartbeat_misses=3)
    async with open_cluster(
        engine_name, bootstrap_url, opts, wrap={0: wrap}, decode_config=config
    ) as c:
        gate = stalling[0].stalls
        try:
            room, n = 77, 4
            src, dst = np.arange(n), np.arange(10, 10 + n)
            senders = []
            for r in c.prefill:
                r.pool.fill(src, room)
                r.pool.fill_aux(0, room)
                senders.append(r.agent.sender(room, num_pages=n, aux_slot=0))
            receiver = c.decode[0].receiver(room, bootstrap_url=bootstrap_url)
            receiver.init(dst, 0)
            for s in senders:
                s.send(src, last=True)
            with trio.fail_after(10):
                assert await senders[1].wait() is KVPoll.Success  # the dummy is done
                await gate.wait_stalled_async(1)  # rank 0's write is inside the engine
                machine = receiver._room.machine
                await poll_until(lambda: 1 in machine.succeeded)  # decode has rank 1's Success
                gone = c.prefill[1]
                if how == "crashes":  # (no STATUS, ack or BYE)
                    gone.agent._shutdown_rooms = lambda: None  # type: ignore[method-assign]
                    gone.agent._say_goodbye = lambda: None  # type: ignore[method-assign]
                gone.scope.cancel()
                await gone.closed.wait()
                counter = "peers_closed" if how == "closes" else "peers_lost"
                await poll_until(lambda: getattr(c.decode[0].statistics(), counter) >= 1)
            gate.release_all()
            with trio.fail_after(10):
                status = await receiver.wait()
            assert status is KVPoll.Success, receiver.failure
            assert (c.decode_pools[0].kv[:, dst, :] == c.decode_pools[0].expected(room, n)).all()
        finally:
            gate.release_all()
