"""Pipeline parallelism (issue 18, item 3): a prefill instance of S PP stages, each a TP group
holding a contiguous range of the model's layers; decode (no PP) holds every layer and gathers
each range from the stage that owns it.

Real bootstrap service on loopback, real prefill and decode agents on real engines (Mooncake,
and NIXL where installed), host pools whose bytes are a function of the *model* layer
(``HostKVPool(first_layer=, model_layers=)``), so a layer written into the wrong decode layer
shows. Every wait is bounded.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytest
import trio

from trio_pd import (
    BootstrapError,
    DecodeConfig,
    IncompatiblePeer,
    KVPoll,
    PrefillConfig,
    RemoteFailure,
    open_prefill,
)
from trio_pd.bootstrap._bootstrap_client import BootstrapClient, PrefillRankInfo
from trio_pd.core._errors import ConfigurationError, NotReady
from trio_pd.core._memory import layer_buffers, layer_view
from trio_pd.core._topology import pairing_problem, source_ranks, writes_aux
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.testing.pools import AUX_ITEM_LEN, HostKVPool

from .helpers.agents import poll_until
from .helpers.pp import (
    BOUND,
    HEAD_BYTES,
    PAGE,
    PAGES,
    Cluster,
    check_layers,
    open_pp,
    pp_pool,
)


async def _one_request(c: Cluster, room: int, n: int, *, aux: int = 3, dst_aux: int = 5,
                       ) -> list[KVPoll]:
    src = np.arange(n)
    dst = np.arange(PAGES - n, PAGES)[::-1].copy()  # reversed: no run shared with src
    senders = []
    for st in c.stages:
        st.pool.fill(src, room)
        st.pool.fill_aux(aux, room)
        senders.append(st.agent.sender(room, num_pages=n, aux_slot=aux))
    # every decode rank of one request passes the same epoch
    receivers = [d.receiver(room, bootstrap_url=c.url, epoch=room * 7) for d in c.decode]
    for r in receivers:
        r.init(dst, dst_aux)
    for s in senders:
        s.send(src[: n // 2])
        s.send(src[n // 2:], last=True)
    with trio.fail_after(BOUND):
        out = [await r.wait() for r in receivers]
        out += [await s.wait() for s in senders]
    for r in receivers:
        assert r.poll() is KVPoll.Success, r.failure
    check_layers(c, room, dst)
    for pool in c.decode_pools:
        assert pool.aux_ok(dst_aux, room)
    return out


# ------------------------------------------------------------------------------ moving bytes

CASES = [
    pytest.param(2, 1, 1, "mha", id="PP2-P1-D1-mha"),
    pytest.param(2, 1, 1, "mla", id="PP2-P1-D1-mla"),
    pytest.param(2, 2, 1, "mha", id="PP2-P2-D1-mha"),
    pytest.param(2, 2, 2, "mha", id="PP2-P2-D2-mha"),
    pytest.param(2, 2, 1, "mla", id="PP2-P2-D1-mla"),
    pytest.param(2, 2, 2, "mla", id="PP2-P2-D2-mla"),
    pytest.param(4, 1, 2, "mha", id="PP4-P1-D2-mha"),
]


@pytest.mark.parametrize(("pp", "p", "d", "layout"), CASES)
async def test_stages_write_their_layers_into_decode(
    engine_name: str, bootstrap_url: str, pp: int, p: int, d: int, layout: str
) -> None:
    """Every stage writes its layers into decode's buffers of the same layer ids, K and V
    (MLA one per layer), bytes verified layer by layer; decode's room succeeds only with a
    Success from every (stage, TP rank); the aux row comes from the last stage alone: its
    bytes are counted there, and no other stage writes a byte of aux."""
    async with open_pp(engine_name, bootstrap_url, pp=pp, prefill_tp=p, decode_tp=d,
                       layout=layout) as c:
        n = 6
        statuses = await _one_request(c, room=4242, n=n)
        assert all(s is KVPoll.Success for s in statuses)
        # each decode rank counted every (stage, TP source rank) as a rank of its own
        for agent in c.decode:
            want = {s * p + t for s in range(pp) for t in source_ranks(agent.tp_rank, p, d)}
            assert {r.rank_id for r in agent.sources.ranks.values()} == want
        # bytes per prefill rank: its layers' heads for each decode rank it writes, plus the
        # aux row only on the last stage's aux writers
        for st in c.stages:
            pool = st.pool.spec
            kv = aux = 0
            for dec in c.decode:
                peer = st.agent.peers.get(dec.endpoint)
                if peer is None:
                    assert st.tp_rank not in source_ranks(dec.tp_rank, p, d)
                    continue
                if peer.heads is not None:
                    heads = peer.heads[1] - peer.heads[0]
                    kv += n * pool.num_buffers * PAGE * heads * HEAD_BYTES
                if peer.writes_aux:
                    assert st.pp_rank == pp - 1, "an aux row written by a stage not the last"
                    aux += AUX_ITEM_LEN
            assert st.agent.statistics().bytes_written == kv + aux, (st.pp_rank, st.tp_rank)
        # exactly one writer of each decode rank's aux row, in the last stage
        for dec in c.decode:
            writers = [
                (st.pp_rank, st.tp_rank) for st in c.stages
                if (peer := st.agent.peers.get(dec.endpoint)) is not None and peer.writes_aux
            ]
            assert len(writers) == 1 and writers[0][0] == pp - 1, writers


@pytest.mark.parametrize(("pp", "p", "d", "layout"), [
    pytest.param(2, 2, 1, "mla", id="PP2-P2-D1-mla"),
    pytest.param(2, 2, 2, "mha", id="PP2-P2-D2-mha"),
    pytest.param(4, 1, 2, "mha", id="PP4-P1-D2-mha"),
])
async def test_stages_write_their_layers_into_landing_pages(
    engine_name: str, bootstrap_url: str, pp: int, p: int, d: int, layout: str
) -> None:
    """With a landing area on decode (trio_pd.core._landing) the room's scattered pages
    land: each stage writes its layers into the landing pages' buffers of those layers, and
    decode copies them out once every (stage, TP rank) reported Success: the bytes are
    verified layer by layer, the area is empty after."""
    async with open_pp(engine_name, bootstrap_url, pp=pp, prefill_tp=p, decode_tp=d,
                       layout=layout, decode_config=DecodeConfig(landing_bytes=1 << 20)) as c:
        for room in (4242, 4243):
            statuses = await _one_request(c, room=room, n=6)
            assert all(s is KVPoll.Success for s in statuses)
        for agent in c.decode:
            assert agent.statistics().rooms_landed == 2
            assert agent.landing is not None and agent.landing.reserved == 0


async def test_rank_ids_on_the_wire(engine_name: str, bootstrap_url: str) -> None:
    """A stage's ranks say ``pp_rank * tp_size + tp_rank`` in STATUS and ABORT_ACK; without
    pipeline parallelism the id is the TP rank, as it always was."""
    async with open_pp(engine_name, bootstrap_url, pp=2, prefill_tp=2, decode_tp=1) as c:
        assert [st.agent.rank_id for st in c.stages] == [0, 1, 2, 3]
        status = c.stages[3].agent._status(1, 2, True, "")
        ack_rank = c.stages[2].agent.rank_id
        assert status.rank == 3 and ack_rank == 2


# ------------------------------------------------------------------------------ faults


def _fail_every_write(_index: int, _peer: str, _nblocks: int) -> Fault:
    return Fault("fail")


def _stall_every_write(_index: int, _peer: str, _nblocks: int) -> Fault:
    return Fault("stall")


async def test_engine_fault_on_one_stage_fails_the_request_and_waits_for_every_stage(
    engine_name: str, bootstrap_url: str
) -> None:
    """PP 2, TP 1 -> decode TP 1. Stage 0's engine fails every write, stage 1's write is held
    inside its engine. The request fails on decode (RemoteFailure from stage 0); decode's
    pages stay held while stage 1's write can still land (stage 0's ack alone is not enough:
    each stage is a rank of its own), and come back once stage 1 has acked too."""
    wrapped: dict[str, FaultEngine] = {}

    def failing(engine: TransferEngine) -> TransferEngine:
        wrapped["fail"] = FaultEngine(engine, _fail_every_write)
        return wrapped["fail"]

    def stalling(engine: TransferEngine) -> TransferEngine:
        wrapped["stall"] = FaultEngine(engine, _stall_every_write)
        return wrapped["stall"]

    async with open_pp(
        engine_name, bootstrap_url, pp=2, prefill_tp=1, decode_tp=1,
        wrap={(0, 0): failing, (1, 0): stalling},
        prefill_config=PrefillConfig(quarantine_fence=0.3),
    ) as c:
        gate = wrapped["stall"].stalls
        try:
            room, n = 9001, 4
            src, dst = np.arange(n), np.arange(20, 20 + n)
            released = {k: trio.Event() for k in ("s0", "s1", "d")}
            senders = []
            for st in c.stages:
                st.pool.fill(src, room)
                st.pool.fill_aux(1, room)
                senders.append(st.agent.sender(room, num_pages=n, aux_slot=1,
                                               on_release=released[f"s{st.pp_rank}"].set))
            receiver = c.decode[0].receiver(room, bootstrap_url=bootstrap_url)
            receiver.init(dst, 2, on_release=released["d"].set)
            senders[1].send(src, last=True)
            with trio.fail_after(BOUND):
                await gate.wait_stalled_async(1)  # stage 1's write is inside its engine
            senders[0].send(src, last=True)  # stage 0's write fails in the engine
            with trio.fail_after(BOUND):
                assert await receiver.wait() is KVPoll.Failed
                assert await senders[0].wait() is KVPoll.Failed
                await released["s0"].wait()  # stage 0 drained (its fence passed) and acked
                machine = receiver._room.machine
                await poll_until(lambda: 0 in machine.acked)
            assert isinstance(receiver.failure, RemoteFailure), receiver.failure
            assert "prefill rank 0" in str(receiver.failure)
            await trio.sleep(0.3)
            assert 1 not in machine.acked
            assert not released["d"].is_set(), "decode's pages went back with a stage writing"
            assert c.decode[0].statistics().pages_held == n
            gate.release_all()
            with trio.fail_after(BOUND):
                await released["d"].wait()
                await released["s1"].wait()
            d = c.decode[0].statistics()
            assert d.acks_received == 2 and d.pages_held == 0 and d.released_by_timeout == 0
            assert senders[1].poll() is KVPoll.Failed
        finally:
            gate.release_all()


# ------------------------------------------------------------------------------ refusals


async def test_stage_outside_decode_layers_is_refused_at_register(
    engine_name: str, bootstrap_url: str
) -> None:
    """Stages of layers 0..1 and 2..3 (a 4-layer model) against a decode pool of 3 layers:
    stage 1 does not fit. Stage 1's rank refuses decode's REGISTER naming itself, stage 0's
    accepts it; decode fails the room with IncompatiblePeer naming stage 1, nothing written."""
    async with open_pp(engine_name, bootstrap_url, pp=2, prefill_tp=1, decode_tp=1,
                       decode_layers=3) as c:
        receiver = c.decode[0].receiver(5, bootstrap_url=bootstrap_url)
        receiver.init(np.arange(4), 0)
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Failed
            await poll_until(lambda: c.stages[1].agent.statistics().refused_messages >= 1)
        assert isinstance(receiver.failure, IncompatiblePeer), receiver.failure
        assert "PP stage 1 of 2 holds layers 2..3" in str(receiver.failure)
        refused = c.stages[1].agent.peers.refused
        assert c.decode[0].endpoint in refused
        assert "PP stage 1 of 2 holds layers 2..3" in refused[c.decode[0].endpoint]
        assert c.stages[1].agent.peers.get(c.decode[0].endpoint) is None
        with trio.fail_after(BOUND):
            await poll_until(lambda: c.stages[0].agent.peers.get(c.decode[0].endpoint)
                             is not None)
        assert c.stages[0].agent.statistics().refused_messages == 0
        assert (c.decode_pools[0].kv == 0).all()  # nothing written


def _info(tp_rank: int, pp_rank: int, first: int, layers: int, *, pp_size: int = 2,
          tp_size: int = 1, port: int = 5000) -> PrefillRankInfo:
    return PrefillRankInfo(
        tp_rank=tp_rank, tp_size=tp_size,
        endpoint=f"tcp://127.0.0.1:{port + 10 * pp_rank + tp_rank}",
        engine="mooncake", engine_session=f"s{pp_rank}.{tp_rank}", layout="mha", kv_heads=2,
        page_size=4, head_bytes=16, num_layers=layers, aux_item_len=64, pp_rank=pp_rank,
        pp_size=pp_size, first_layer=first,
    )


async def test_bootstrap_refuses_overlapping_and_gapped_stages(bootstrap_url: str) -> None:
    """Stage 0 holds layers 0..3. A stage 1 from layer 2 overlaps it, one from layer 5 leaves
    a gap, one of another TP rank with other layers disagrees within the stage, one saying
    another pp_size disagrees with the instance: 409 each, naming the stages. Stage 0 from a
    layer other than 0, or a pp_rank outside pp_size: 400. The topology is complete (stage by
    stage) only once every TP rank of every stage registered."""
    async with BootstrapClient(bootstrap_url) as client:
        await client.register(_info(0, 0, 0, 4, tp_size=2))
        for bad, words in (
            (_info(0, 1, 2, 4, tp_size=2), "PP stage 1 (layers 2..5) overlaps PP stage 0"),
            (_info(0, 1, 5, 4, tp_size=2), "does not follow on"),
            (_info(1, 0, 0, 3, tp_size=2), "one stage holds one range of layers"),
            (_info(0, 1, 4, 4, tp_size=2, pp_size=3), "pp_size 3 disagrees with 2"),
        ):
            with pytest.raises(BootstrapError, match="409") as info:
                await client.register(bad)
            assert words in str(info.value), info.value
        for bad, words in (
            (_info(1, 0, 2, 2, tp_size=2), "PP stage 0 starts at layer 0"),
            (_info(0, 2, 8, 4, tp_size=2), "pp_rank 2 is outside"),
        ):
            with pytest.raises(BootstrapError, match="400") as info:
                await client.register(bad)
            assert words in str(info.value), info.value
        await client.register(_info(0, 1, 4, 4, tp_size=2))
        await client.register(_info(1, 1, 4, 4, tp_size=2))
        with pytest.raises(NotReady, match="3 of 2 x 2"):
            await client.topology()
        await client.register(_info(1, 0, 0, 4, tp_size=2))
        topo = await client.topology()
        assert topo.pp_size == 2
        assert [(r.pp_rank, r.tp_rank) for r in topo.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [r.first_layer for r in topo.stage(1)] == [4, 4]
        one = await client.rank(1, pp_rank=1)
        assert (one.pp_rank, one.tp_rank, one.first_layer) == (1, 1, 4)


async def test_open_prefill_checks_its_stage(bootstrap_url: str) -> None:
    """pp_rank outside pp_size, stage 0 not at layer 0, a negative first layer, a bool:
    ConfigurationError before anything starts."""
    pool = pp_pool("mha", 0, 1, 2, 2)
    engine = make_engine("mooncake")
    try:
        for kwargs in ({"pp_rank": 2, "pp_size": 2}, {"pp_rank": 0, "pp_size": 2,
                       "first_layer": 2}, {"pp_rank": 1, "pp_size": 2, "first_layer": -1},
                       {"pp_rank": True, "pp_size": 2}):
            with pytest.raises(ConfigurationError):
                async with open_prefill(engine=engine, pool=pool.spec, bootstrap_url=bootstrap_url,
                                        kv_heads=2, **kwargs):  # type: ignore[arg-type]
                    pass
    finally:
        engine.close()


# ------------------------------------------------------------------------------ pure rules


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_exactly_one_aux_writer_per_decode_rank(pp: int) -> None:
    """For every TP pairing and PP size, each decode rank's aux row has exactly one writer:
    the aux writer of the last stage."""
    for p, d in [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (8, 2), (2, 8)]:
        for dec in range(d):
            writers = [(s, t) for s in range(pp) for t in range(p)
                       if writes_aux(t, dec, p, d, s, pp)]
            assert len(writers) == 1, (pp, p, d, dec, writers)
            assert writers[0][0] == pp - 1


@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_layer_view_keeps_the_layers_buffers(layout: Literal["mha", "mla"]) -> None:
    """The view of layers 2..3 of a 5-layer pool has exactly those layers' buffers, K then V
    (MLA one each), with their own per-buffer bytes; the whole range is the pool itself."""
    pool = HostKVPool(layout=layout, num_pages=8, num_layers=5, page_size=4, head_bytes=8,
                      buffer_head_bytes=tuple(8 + i for i in range(10 if layout == "mha" else 5)))
    spec = pool.spec
    view = layer_view(spec, 2, 2)
    picks = [2, 3, 7, 8] if layout == "mha" else [2, 3]
    assert view.num_layers == 2
    assert view.buffer_bases == tuple(spec.buffer_bases[b] for b in picks)
    assert view.buffer_head_bytes == tuple(spec.buffer_head_bytes[b] for b in picks)
    assert view.aux_base == spec.aux_base and view.num_pages == spec.num_pages
    assert layer_view(spec, 0, 5) is spec
    with pytest.raises(ValueError, match="not inside"):
        layer_view(spec, 4, 2)


def test_pairing_by_layer_range() -> None:
    """A stage inside decode's layers pairs; one reaching past them is refused, naming the
    stage; one stage (the whole model) still needs the same layer count."""
    def problem(num_layers: int, first: int, pp_rank: int, pp_size: int,
                peer_layers: int) -> str | None:
        return pairing_problem(
            layout="mha", page_size=4, head_bytes=16, num_layers=num_layers, aux_item_len=64,
            kv_heads=2, prefill_tp=1, peer_layout="mha", peer_page_size=4, peer_head_bytes=16,
            peer_num_layers=peer_layers, peer_aux_item_len=64, peer_rank=0, peer_tp=1,
            peer_heads=2, peer_first_head=0, first_layer=first, pp_rank=pp_rank,
            pp_size=pp_size,
        )

    assert problem(2, 2, 1, 2, 4) is None
    assert problem(2, 0, 0, 2, 4) is None
    refused = problem(2, 3, 1, 2, 4)
    assert refused is not None and "PP stage 1 of 2 holds layers 3..4" in refused
    assert problem(2, 0, 0, 1, 4) == "layer count: prefill 2, decode 4"


# ------------------------------------------------------------------------------ the demo


async def test_the_demo_runs_pp_with_aborts_and_faults() -> None:
    """`trio-pd demo --prefill-pp 2 --prefill-tp 2 --decode-tp 2`: every decode rank gathers
    both stages' layers, verified byte for byte (the pools' bytes are the model layer's);
    aborts and faults included: nothing late, corrupt or leaked, nothing freed by timeout."""
    from trio_pd.tools._demo import DemoOptions, check, run_in_process

    opts = DemoOptions(requests=24, concurrency=6, min_tokens=1, max_tokens=48, page_size=4,
                       chunk_pages=3, layers=4, head_bytes=16, kv_heads=4, prefill_tp=2,
                       decode_tp=2, prefill_pp=2, abort_rate=0.2, fault_rate=0.05, seed=3,
                       request_bound=20.0, quarantine_fence=1.0)
    assert opts.option_problem() is None
    assert "--prefill-pp" in (DemoOptions(layers=3, prefill_pp=2).option_problem() or "")
    with trio.fail_after(90):
        summary = await run_in_process(opts)
    assert summary["succeeded"] >= 8, summary
    for key in ("corrupt_pages", "late_writes", "leaked_pages", "hung", "released_by_timeout"):
        assert summary[key] == 0, (key, summary)
    assert check(opts, summary) == []


async def test_the_demo_runs_pp_in_processes() -> None:
    """The same with every rank a process of its own (`--processes`), MLA."""
    import json
    import sys

    cmd = [sys.executable, "-m", "trio_pd.cli", "demo", "--json", "--processes",
           "--requests", "12", "--concurrency", "4", "--max-tokens", "64", "--layers", "4",
           "--layout", "mla", "--prefill-pp", "2", "--prefill-tp", "2", "--decode-tp", "1"]
    with trio.fail_after(120):
        proc = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    summary = json.loads(proc.stdout.decode())
    assert summary["succeeded"] == summary["requests"] == 12, summary
    assert summary["prefill_pp"] == 2 and summary["corrupt_pages"] == 0


# ------------------------------------------------------------------------------ SGLang


def test_sglang_prefill_stages_map_to_pp(engine_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two SGLang prefill managers of ``server_args.pp_size=2``, each with the KV buffers of
    its layer only (``KVArgs.pp_rank``, ``prefill_start_layer``), and one decode manager of
    both layers: the request's every layer and metadata row arrive. A KVSender of another PP
    stage than its manager's is refused."""
    monkeypatch.setenv("TRIO_PD_TOKEN", "pp-sglang-test-token")  # (as SGLang's processes)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "0")
    from contextlib import ExitStack

    from trio_pd.compat.sglang import KVBootstrapServer, KVManager, KVReceiver, KVSender

    from .helpers.sglang import LAYERS, Memory, server_args
    from .helpers.threads import poll_until

    src = Memory(num_pages=16, heads=2, aux_slots=4)  # stages' buffers are slices of it
    dst = Memory(num_pages=16, heads=2, aux_slots=4)
    with ExitStack() as stack:
        boot = stack.enter_context(KVBootstrapServer("127.0.0.1", 0))
        managers = []
        for s in range(2):
            args = src.kvargs()
            picks = layer_buffers("mha", LAYERS, s * LAYERS // 2, LAYERS // 2)
            for name in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens"):
                setattr(args, name, [getattr(args, name)[b] for b in picks])
            args.pp_rank, args.prefill_start_layer = s, s * LAYERS // 2
            engine = stack.enter_context(make_engine(engine_name))
            managers.append(stack.enter_context(KVManager(
                args, "prefill", server_args(pp_size=2), False, engine=engine,
                bootstrap_url=boot.url,
            )))
        assert [(m.pp_rank, m.pp_size, m.first_layer) for m in managers] == [(0, 2, 0),
                                                                            (1, 2, 1)]
        de = stack.enter_context(make_engine(engine_name))
        decode = stack.enter_context(KVManager(dst.kvargs(), "decode", server_args(), False,
                                               engine=de))
        addr = f"127.0.0.1:{boot.port}"
        src.fill(7, np.array([0, 1]), 0)
        senders = [KVSender(m, addr, 7) for m in managers]
        for sender in senders:
            sender.init(2, 0)
        receiver = KVReceiver(decode, addr, 7)
        receiver.init()
        poll_until(lambda: receiver.poll() == KVPoll.WaitingForInput)
        receiver.send_metadata([5, 9], aux_index=2)
        for sender in senders:
            sender.send(np.array([0, 1], np.int32))
        poll_until(lambda: receiver.poll() == KVPoll.Success)
        assert dst.holds(7, np.array([5, 9]), 2)
