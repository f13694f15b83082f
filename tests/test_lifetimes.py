"""Page lifetimes on real engines, real ZeroMQ and the real bootstrap server (SPEC §5, §7, §8).

Each test forces one interleaving of SPEC §8 and checks what a user of trio_pd would notice:
when a room's release callback runs and how often, which status each side reports, which
acks flow, which bytes landed, and the agents' statistics.

How the interleavings are forced, without sleeping:

* :class:`~trio_pd.engines.fault.FaultEngine` wraps the real prefill engine. A ``stall``
  fault holds that engine call inside the engine (in its thread) until the test releases the
  gate; ``gate.wait_stalled_async(n)`` says the n-th call has got there. ``fail`` and
  ``partial`` make a call raise :class:`~trio_pd.EngineError`.
* :class:`EngineCalls` wraps the prefill agent's ``run_engine_call`` (the one seam through
  which engine calls reach their thread) and :class:`Handled` wraps one of an agent's
  synchronous message handlers; both let the test wait for "the n-th engine call has returned
  to trio" / "the n-th ABORT has been handled" as events.
* Every wait is bounded by ``trio.fail_after``. Where a test must show that something does
  *not* happen (no release while a write is in flight, no ack), it checks the state and then
  watches for :data:`QUIET` seconds (:func:`stays_pending`): with correct code the awaited
  thing can never happen in that window, so the check cannot flake; a broken rule shows up
  within milliseconds.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio

from trio_pd import (
    AdmissionClosed,
    DecodeAgent,
    DecodeConfig,
    EngineError,
    KVPoll,
    PeerLost,
    PrefillAgent,
    PrefillConfig,
    RemoteFailure,
    TransferAborted,
    open_decode,
    open_prefill,
)
from trio_pd.agents._chunks import Write
from trio_pd.core import _wire as wire
from trio_pd.core._rooms import Chunk, PrefillRoom
from trio_pd.core._topology import head_range
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.engines.fault import Fault, FaultEngine, Policy, StallGate
from trio_pd.testing.pools import DEST_POISON, SOURCE_POISON, HostKVPool

from .helpers.agents import Pair, host_pool, open_pair, poll_until

#: bound on every wait for something that must happen
BOUND = 15.0
#: how long a test watches for something that must not happen
QUIET = 0.3
KV_HEADS = 2


# ------------------------------------------------------------------------------ helpers


def stall_all(_i: int, _peer: str, _n: int) -> Fault | None:
    return Fault("stall")


def stall_everything(_rank: int, fault: FaultEngine, _sessions: list[str]) -> None:
    fault.policy = stall_all


async def stalled(gate: StallGate, n: int = 1) -> None:
    """Wait until ``n`` engine calls in all have reached the stall gate."""
    with trio.fail_after(BOUND):
        await gate.wait_stalled_async(n)


def stall_call(index: int) -> Policy:
    """Stall the engine call with this index (0-based, in the order calls reach the engine)."""
    return lambda i, _peer, _n: Fault("stall") if i == index else None


async def watch() -> None:
    """Give stray events (a second ack, a second release) :data:`QUIET` seconds to show."""
    await trio.sleep(QUIET)


async def stays_pending(wait: Callable[[], Awaitable[object]], what: str) -> None:
    """Assert that ``wait()`` does not finish within :data:`QUIET` seconds."""
    with trio.move_on_after(QUIET) as cs:
        await wait()
    assert cs.cancelled_caught, f"{what} happened, but must not yet"


class EngineCalls:
    """Wraps ``agent.peers.run_engine_call``: counts engine calls that returned to trio (done or
    failed; not those cancelled before they started) and appends ``"write returned"`` to
    ``log`` for each, so a test can order them against release callbacks."""

    def __init__(self, agent: PrefillAgent, log: list[str]) -> None:
        self.returned = 0
        self.errors = 0
        self._log = log
        self._changed = trio.Event()
        inner = agent.peers.run_engine_call

        async def tracked(lane: Any, fn: Callable[[], Any]) -> Any:
            if not isinstance(fn, Write):
                return await inner(lane, fn)  # add_peer: not a write
            try:
                result = await inner(lane, fn)
            except trio.Cancelled:
                raise  # never started
            except BaseException:
                self.errors += 1
                self._returned()
                raise
            self._returned()
            return result

        agent.peers.run_engine_call = tracked

    def _returned(self) -> None:
        self.returned += 1
        self._log.append("write returned")
        self._changed.set()
        self._changed = trio.Event()

    async def wait_returned(self, n: int) -> None:
        with trio.fail_after(BOUND):
            while self.returned < n:
                await self._changed.wait()


class Handled:
    """Wraps one synchronous handler of an agent (``_on_abort``, ``_on_ack``, ...) in place
    and counts the messages it has handled."""

    def __init__(self, agent: object, name: str) -> None:
        self.calls = 0
        self._changed = trio.Event()
        inner = getattr(agent, name)

        def wrapper(*args: Any) -> Any:
            try:
                return inner(*args)
            finally:
                self.calls += 1
                self._changed.set()
                self._changed = trio.Event()

        setattr(agent, name, wrapper)

    async def wait(self, n: int = 1) -> None:
        with trio.fail_after(BOUND):
            while self.calls < n:
                await self._changed.wait()


@asynccontextmanager
async def stalling_pair(
    engine_name: str,
    url: str,
    policy: Policy,
    *,
    probe_override: bool | None = None,
    prefill_config: PrefillConfig | None = None,
    decode_config: DecodeConfig | None = None,
) -> AsyncIterator[tuple[Pair, FaultEngine]]:
    """:func:`open_pair` with a FaultEngine around the prefill engine. The stall gate is
    opened on the way out, so a failing test never leaves an engine thread stuck."""
    faults: list[FaultEngine] = []

    def wrap(engine: TransferEngine) -> TransferEngine:
        faults.append(FaultEngine(engine, policy, probe_override=probe_override))
        return faults[0]

    async with open_pair(
        engine_name, url, wrap=wrap, prefill_config=prefill_config, decode_config=decode_config
    ) as pair:
        try:
            yield pair, faults[0]
        finally:
            faults[0].stalls.release_all()


@dataclass
class Cluster:
    """P prefill ranks and D decode ranks of one instance, each with its own real engine."""

    url: str
    prefills: list[PrefillAgent]
    decodes: list[DecodeAgent]
    srcs: list[HostKVPool]
    dsts: list[HostKVPool]
    faults: list[FaultEngine]
    decode_sessions: list[str] = field(default_factory=list)


def _rank_pool(rank: int, tp: int) -> HostKVPool:
    first, heads = head_range(rank, tp, KV_HEADS)
    return host_pool("mha", heads=heads, first_head=first)


@asynccontextmanager
async def open_cluster(
    engine_name: str,
    url: str,
    *,
    prefill_tp: int,
    decode_tp: int,
    setup: Callable[[int, FaultEngine, list[str]], None],
    prefill_config: PrefillConfig | None = None,
) -> AsyncIterator[Cluster]:
    """``setup(prefill_rank, fault_engine, decode_sessions)`` sets that prefill rank's fault
    policy (and whatever else of its FaultEngine a test needs)."""
    srcs = [_rank_pool(r, prefill_tp) for r in range(prefill_tp)]
    dsts = [_rank_pool(r, decode_tp) for r in range(decode_tp)]
    d_engines = [make_engine(engine_name) for _ in range(decode_tp)]
    sessions = [e.session_id for e in d_engines]
    faults = [FaultEngine(make_engine(engine_name)) for _ in range(prefill_tp)]
    for r, f in enumerate(faults):
        setup(r, f, sessions)
    try:
        async with AsyncExitStack() as stack:
            prefills = [
                await stack.enter_async_context(
                    open_prefill(
                        engine=faults[r], pool=srcs[r].spec, bootstrap_url=url, tp_rank=r,
                        tp_size=prefill_tp, kv_heads=KV_HEADS, config=prefill_config,
                    )
                )
                for r in range(prefill_tp)
            ]
            decodes = [
                await stack.enter_async_context(
                    open_decode(
                        engine=d_engines[r], pool=dsts[r].spec, tp_rank=r, tp_size=decode_tp
                    )
                )
                for r in range(decode_tp)
            ]
            try:
                yield Cluster(url, prefills, decodes, srcs, dsts, faults, sessions)
            finally:
                for f in faults:
                    f.stalls.release_all()
    finally:
        for e in [*faults, *d_engines]:
            e.close()


def bytes_ok(dst: HostKVPool, room: int, dst_pages: npt.NDArray[Any]) -> bool:
    """``dst`` holds the request's KV bytes (for its own heads) in ``dst_pages``."""
    return bool((dst.kv[:, dst_pages, :] == dst.expected(room, len(dst_pages))).all())


def poison_src(pool: HostKVPool, pages: npt.NDArray[Any], log: list[str]) -> Callable[[], None]:
    """A source release callback that behaves like a real allocator's free: the pages are
    overwritten (so a write that still reads them would carry poison)."""

    def release() -> None:
        log.append("src released")
        pool.kv[:, pages, :] = SOURCE_POISON

    return release


def send_whole_room(
    pair: Any, room: int, src_pages: npt.NDArray[Any], dst_pages: npt.NDArray[Any],
    log: list[str], *, chunks: int = 1,
) -> tuple[Any, Any]:
    """Fill the source pages, open both handles (each logging its release) and send the whole
    room, as one last chunk or as ``chunks`` chunks admitted together (which the agent
    coalesces into one engine call)."""
    pair.src.fill(src_pages, room)
    sender = pair.prefill.sender(
        room, num_pages=len(src_pages), aux_slot=0,
        on_release=poison_src(pair.src, src_pages, log),
    )
    receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
    receiver.init(dst_pages, 0, on_release=lambda: log.append("dst released"))
    parts = np.array_split(src_pages, chunks)
    for i, pages in enumerate(parts):
        sender.send(pages, last=i == len(parts) - 1)
    return sender, receiver


def record_dst(
    pool: HostKVPool, pages: npt.NDArray[Any], log: list[str], seen: list[npt.NDArray[Any]]
) -> Callable[[], None]:
    """A destination release callback: keeps a copy of what the pages held when they were
    handed back, then poisons them (the next owner's view)."""

    def release() -> None:
        log.append("dst released")
        seen.append(pool.kv[:, pages, :].copy())
        pool.kv[:, pages, :] = DEST_POISON

    return release


# ------------------------------------------------------------------------------ §8.1, §8.2


async def test_failed_part_drains_slow_sibling_before_release(
    engine_name: str, bootstrap_url: str
) -> None:
    """SPEC §8.1, I3: one part of a chunk fails while its sibling is still inside the engine.
    The chunk (and the room's failure) ends only when the slow part returns; the release
    runs after that, and the slow part's bytes did land."""

    def setup(_rank: int, fault: FaultEngine, sessions: list[str]) -> None:
        def policy(_i: int, peer: str, _n: int) -> Fault:
            if peer == sessions[0]:
                return Fault("stall")  # decode rank 0's part is slow...
            # ... and rank 1's fails once that one is inside the engine (this runs in the
            # failing call's engine thread, so it waits there).
            fault.stalls.wait_stalled(1, timeout=BOUND)
            return Fault("fail")

        fault.policy = policy

    async with open_cluster(
        engine_name, bootstrap_url, prefill_tp=1, decode_tp=2, setup=setup,
        prefill_config=PrefillConfig(quarantine_fence=0.2),
    ) as c:
        log: list[str] = []
        prefill, gate = c.prefills[0], c.faults[0].stalls
        calls = EngineCalls(prefill, log)
        room, n = 11, 6
        src_pages = np.arange(10, 10 + n)
        dst_pages = np.arange(40, 40 + n)
        c.srcs[0].fill(src_pages, room)
        sender = prefill.sender(
            room, num_pages=n, aux_slot=1, on_release=poison_src(c.srcs[0], src_pages, log)
        )
        receivers = [d.receiver(room, bootstrap_url=c.url, epoch=5) for d in c.decodes]
        for r in receivers:
            r.init(dst_pages, 2)
        sender.send(src_pages, last=True)

        await stalled(gate)  # the slow part is inside the engine
        await calls.wait_returned(1)  # the failing part has returned its error to trio
        assert calls.errors == 1
        # The chunk is still running: nothing is decided, nothing released.
        await stays_pending(sender.wait, "the room's outcome while a sibling runs")
        assert prefill.statistics().leases_live == 1
        assert "src released" not in log
        assert all(r.poll() is KVPoll.WaitingForInput for r in receivers)

        gate.release_all()
        with trio.fail_after(BOUND):
            assert await sender.wait() is KVPoll.Failed
            await sender.wait_released()
            for r in receivers:
                assert await r.wait() is KVPoll.Failed
                await r.wait_released()
        assert isinstance(sender.failure, EngineError)
        assert log == ["write returned", "write returned", "src released"]
        # The slow part wrote its bytes before anything was handed back (poison would show).
        assert bytes_ok(c.dsts[0], room, dst_pages)
        stats = prefill.statistics()
        assert stats.quarantined == 1 and stats.released_after_quarantine == 1
        assert stats.leases_live == stats.leases_quarantined == 0


async def test_error_while_submitting_awaits_submitted_parts(
    engine_name: str, bootstrap_url: str
) -> None:
    """SPEC §8.2: the chunk's part for decode rank 0 is handed to the engine, then submitting
    the part for rank 1 fails: that peer could not be added (its ``add_peer`` fails only once
    rank 0's part is inside the engine), so it is marked failed and its part raises PeerLost
    (SPEC §5.7). The submitted part is awaited: the room fails, and its pages go back, only
    after that part returned."""

    def setup(_rank: int, fault: FaultEngine, sessions: list[str]) -> None:
        fault.policy = stall_all
        inner_add_peer = fault.add_peer

        def add_peer(session: str, meta: bytes) -> None:
            if session == sessions[1]:
                fault.stalls.wait_stalled(1, timeout=BOUND)  # in the add_peer thread
                raise EngineError(f"injected: cannot reach {session}")
            inner_add_peer(session, meta)

        fault.add_peer = add_peer  # type: ignore[method-assign]
        fault.probe_override = False  # and it stays unreachable

    async with open_cluster(
        engine_name, bootstrap_url, prefill_tp=1, decode_tp=2, setup=setup
    ) as c:
        log: list[str] = []
        prefill, gate = c.prefills[0], c.faults[0].stalls
        EngineCalls(prefill, log)
        transfers = Handled(prefill, "_on_transfer")
        room, n = 12, 4
        src_pages = np.arange(20, 20 + n)
        dst_pages = np.arange(60, 60 + n)
        c.srcs[0].fill(src_pages, room)
        sender = prefill.sender(
            room, num_pages=n, aux_slot=1, on_release=poison_src(c.srcs[0], src_pages, log)
        )
        receivers = [d.receiver(room, bootstrap_url=c.url, epoch=6) for d in c.decodes]
        # Parts are submitted in the order the metadata arrived: rank 0's first.
        receivers[0].init(dst_pages, 2)
        await transfers.wait(1)
        receivers[1].init(dst_pages, 2)
        await transfers.wait(2)

        sender.send(src_pages, last=True)
        await stalled(gate)
        await stays_pending(sender.wait, "the room's outcome while a submitted part runs")
        assert "src released" not in log
        assert prefill.statistics().leases_live == 1

        gate.release_all()
        with trio.fail_after(BOUND):
            assert await sender.wait() is KVPoll.Failed
            await sender.wait_released()
        assert isinstance(sender.failure, PeerLost)
        assert log == ["write returned", "src released"]
        assert bytes_ok(c.dsts[0], room, dst_pages)
        # The submitted part completed (proof of drain): its lease retired, nothing quarantined.
        stats = prefill.statistics()
        assert stats.quarantined == 0 and stats.engine_calls == 1 and stats.leases_live == 0
        assert stats.peers_failed == 1


# ------------------------------------------------------------------------------ §8.3


async def test_abort_before_publication_publishes_failed(
    engine_name: str, bootstrap_url: str
) -> None:
    """SPEC §8.3: the prefill scheduler aborts while the last chunk is in the engine. The
    chunk finishes (its bytes land) but the room's published outcome is Failed, not Success."""
    async with stalling_pair(engine_name, bootstrap_url, stall_all) as (pair, fault):
        log: list[str] = []
        EngineCalls(pair.prefill, log)
        room, n = 21, 5
        src_pages, dst_pages = np.arange(n), np.arange(100, 100 + n)
        sender, receiver = send_whole_room(pair, room, src_pages, dst_pages, log)
        await stalled(fault.stalls)

        sender.abort("the scheduler changed its mind")
        assert sender.poll() is KVPoll.Failed  # local status at once
        # Nothing is published while the chunk is in the engine.
        await stays_pending(receiver.wait, "a STATUS while the chunk runs")

        fault.stalls.release_all()
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Failed
            await sender.wait_released()
            await receiver.wait_released()
        assert isinstance(receiver.failure, RemoteFailure)
        assert "the scheduler changed its mind" in str(receiver.failure)
        assert log.index("write returned") < log.index("src released")
        assert pair.prefill.statistics().succeeded == 0
        assert pair.decode.statistics().succeeded == 0


async def test_publication_before_abort_success_stands(
    engine_name: str, bootstrap_url: str
) -> None:
    """SPEC §8.3, I5: once Success is published, an abort on either side changes nothing:
    both handles keep reporting Success, nothing is released as if failed, no ABORT flows."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        released: list[str] = []
        room, n = 22, 3
        src_pages, dst_pages = np.arange(30, 30 + n), np.arange(7, 7 + n)
        pair.src.fill(src_pages, room)
        pair.src.fill_aux(4, room)
        sender = pair.prefill.sender(
            room, num_pages=n, aux_slot=4, on_release=lambda: released.append("src")
        )
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        receiver.init(dst_pages, 6, on_release=lambda: released.append("dst"))
        sender.send(src_pages, last=True)
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Success
            assert await sender.wait() is KVPoll.Success
            await sender.wait_released()

        sender.abort("too late")
        receiver.abort("too late")
        assert sender.poll() is KVPoll.Success and sender.failure is None
        assert receiver.poll() is KVPoll.Success and receiver.failure is None
        assert pair.prefill.statistics().aborted == 0
        assert pair.decode.statistics().aborted == 0
        await stays_pending(receiver.wait_released, "a Success room's pages released as failed")
        assert released == ["src"]
        assert pair.prefill.statistics().acks_sent == 0
        assert pair.verify(room, dst_pages, 6)


# ------------------------------------------------------------------------------ §8.4


def _dead_endpoint() -> str:
    """A tcp endpoint nobody listens on: messages queued for it are never read."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


async def test_full_status_socket_fails_room_locally(
    engine_name: str, insecure: None, bootstrap_url: str
) -> None:
    """SPEC §8.4: the decode peer does not read its control socket, which is full. The
    prefill room's bytes are written, but its STATUS cannot be queued: the room is Failed
    locally, with a reason, at once; nothing waits for the peer, and the agent goes on.

    The peer is a real decode engine with registered memory whose control endpoint nobody
    reads (REGISTER and TRANSFER are handed to the prefill agent's handler directly)."""
    src, dst = host_pool(), host_pool()
    pe, mute = make_engine(engine_name), make_engine(engine_name)
    try:
        await trio.to_thread.run_sync(mute.register, dst.spec.regions())
        async with open_prefill(
            engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=KV_HEADS,
            config=PrefillConfig(sndhwm=1, failed_status_retry=0.3),
        ) as prefill:
            endpoint = _dead_endpoint()
            prefill._handle(
                wire.Register(
                    v=wire.WIRE_VERSION, endpoint=endpoint, decode_rank=0, decode_tp=1,
                    engine=mute.name, session=mute.session_id, engine_meta=mute.metadata(),
                    pool=wire.PoolWire.from_spec(dst.spec),
                ),
                None,
            )
            # Fill the peer's socket: PINGs make the prefill answer PONGs nobody reads.
            for nonce in range(1, 100):
                before = prefill.statistics().send_backpressure
                ping = wire.Ping(v=wire.WIRE_VERSION, nonce=nonce, endpoint=endpoint)
                prefill._handle(ping, None)
                if prefill.statistics().send_backpressure > before:
                    break
            else:
                pytest.fail("the peer's socket never filled up")
            backpressure = prefill.statistics().send_backpressure

            released: list[str] = []
            room, n = 31, 4
            src_pages, dst_pages = np.arange(n), np.arange(50, 50 + n)
            src.fill(src_pages, room)
            sender = prefill.sender(
                room, num_pages=n, aux_slot=0, on_release=lambda: released.append("src")
            )
            prefill._handle(_transfer(room, endpoint, dst_pages), dst_pages.astype(np.int32))
            sender.send(src_pages, last=True)
            with trio.fail_after(BOUND):
                assert await sender.wait() is KVPoll.Failed
                await sender.wait_released()
            assert "socket is full" in str(sender.failure)
            stats = prefill.statistics()
            assert stats.succeeded == 0 and stats.send_backpressure > backpressure
            assert stats.engine_calls == 1 and released == ["src"]
            # The write itself landed: only the status could not be delivered.
            assert bool((dst.kv[:, dst_pages, :] == src.expected(room, n)).all())
            # Nothing is wedged: a second room to the same peer fails just as fast.
            sender2 = prefill.sender(32, num_pages=0, aux_slot=1)
            empty = np.zeros(0, np.int32)
            prefill._handle(_transfer(32, endpoint, empty), empty)
            sender2.send([], last=True)
            with trio.fail_after(BOUND):
                assert await sender2.wait() is KVPoll.Failed
            # The two Failed STATUSes are retried for failed_status_retry, then dropped and
            # counted: no timer keeps retrying a peer that never reads.
            with trio.fail_after(BOUND):
                while prefill.statistics().outbox_dropped < 2:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            tries = prefill.statistics().send_backpressure
            await trio.sleep(0.3)  # six retry periods
            assert prefill.statistics().outbox_dropped == 2
            assert prefill.statistics().send_backpressure == tries, "still retrying"
        await trio.to_thread.run_sync(mute.unregister, dst.spec.regions())
    finally:
        pe.close()
        mute.close()


def _transfer(room: int, endpoint: str, dst_pages: npt.NDArray[Any]) -> wire.Transfer:
    return wire.Transfer(
        v=wire.WIRE_VERSION, room=room, epoch=9, endpoint=endpoint, decode_rank=0,
        aux_slot=room % 8, required=1, num_pages=len(dst_pages),
    )


# ------------------------------------------------------------------------------ §8.5


async def test_two_batches_release_once_after_both(engine_name: str, bootstrap_url: str) -> None:
    """SPEC §8.5, I1, I3: one chunk of a room has returned, the room's last chunk is still in
    the engine. Nothing is released or published until that one returns; then the release
    runs exactly once, and the bytes are intact. (Calls to one peer return in order, on its
    lane: the first chunk returns before the last one is sent, so the stall is the last's.)"""
    first_pages = np.array([3, 7, 11])  # not consecutive: more blocks than the last chunk
    last_pages = np.array([40, 41])

    def policy(_i: int, _peer: str, nblocks: int) -> Fault | None:
        return Fault("stall") if nblocks != 4 * len(first_pages) else None

    async with stalling_pair(engine_name, bootstrap_url, policy) as (pair, fault):
        log: list[str] = []
        calls = EngineCalls(pair.prefill, log)
        room, n = 51, 5
        src_pages = np.concatenate([first_pages, last_pages])
        dst_pages = np.arange(200, 200 + n)
        pair.src.fill(src_pages, room)
        pair.src.fill_aux(2, room)
        sender = pair.prefill.sender(
            room, num_pages=n, aux_slot=2, on_release=poison_src(pair.src, src_pages, log)
        )
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        receiver.init(dst_pages, 3)
        sender.send(first_pages)
        await calls.wait_returned(1)  # the first chunk has completed
        sender.send(last_pages, last=True)

        await stalled(fault.stalls)  # the last chunk is in the engine
        await stays_pending(sender.wait_released, "the release while a batch is in flight")
        assert sender.poll() is KVPoll.Transferring
        assert receiver.poll() is KVPoll.WaitingForInput
        assert pair.prefill.statistics().leases_live == 1

        fault.stalls.release_all()
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Success
            await sender.wait_released()
        await watch()  # a second release would show here
        assert log == ["write returned", "write returned", "src released"]
        assert pair.verify(room, dst_pages, 3)


# ------------------------------------------------------------------------------ coalescing


def two_page_chunks(n: int) -> list[npt.NDArray[np.int64]]:
    """Pages 0..n-1 as chunks of two, the last one marked by the caller."""
    return [np.arange(a, min(a + 2, n)) for a in range(0, n, 2)]


@pytest.mark.parametrize(("coalesce", "calls"), [(1, 4), (4, 2), (64, 1)])
async def test_backlogged_chunks_share_engine_calls(
    engine_name: str, bootstrap_url: str, coalesce: int, calls: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A room's chunks queued behind the one a worker takes join its engine call, whole
    chunks only, up to ``coalesce_pages`` pages (one lease, one call); every byte lands and
    the release runs once, after the last call. A worker is woken per engine call, not per
    chunk: as many takes as calls, none finding its chunks gone. (Batching on the lane is
    off here: it would join the uncoalesced chunks' calls too, see tests/test_batching.py.)"""
    takes: list[bool] = []
    take_chunks = PrefillRoom.take_chunks

    def counted(self: PrefillRoom, limit: int) -> tuple[Chunk, int] | None:
        taken = take_chunks(self, limit)
        takes.append(taken is not None)
        return taken

    monkeypatch.setattr(PrefillRoom, "take_chunks", counted)
    async with stalling_pair(
        engine_name, bootstrap_url, lambda *_: None,
        prefill_config=PrefillConfig(coalesce_pages=coalesce, batch_blocks=0),
    ) as (pair, fault):
        log: list[str] = []
        room, n = 55, 8
        src_pages, dst_pages = np.arange(n), np.arange(100, 100 + n)
        pair.src.fill(src_pages, room)
        pair.src.fill_aux(1, room)
        transfers = Handled(pair.prefill, "_on_transfer")
        sender = pair.prefill.sender(
            room, num_pages=n, aux_slot=1, on_release=poison_src(pair.src, src_pages, log)
        )
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        receiver.init(dst_pages, 2)
        await transfers.wait()
        assert sender.poll() is KVPoll.WaitingForInput  # ready: each send queues at once
        chunks = two_page_chunks(n)
        for i, pages in enumerate(chunks):  # no checkpoint between: a backlog of four
            sender.send(pages, last=i == len(chunks) - 1)
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Success
            await sender.wait_released()
        await watch()
        assert fault.statistics().calls == calls
        stats = pair.prefill.statistics()
        assert stats.engine_calls == calls
        assert stats.chunks_coalesced == len(chunks) - calls
        assert takes == [True] * calls
        assert stats.leases_live == 0
        assert log == ["src released"]
        assert pair.verify(room, dst_pages, 2)


async def test_abort_with_coalesced_call_in_flight_holds_every_chunk(
    engine_name: str, bootstrap_url: str
) -> None:
    """I1 through a coalesced call: the chunks admitted before decode's metadata arrived go
    out as one call; decode aborts while it is in the engine. Neither side lets any of the
    pages go (one live lease covers them all) until that call returns; then one ack."""
    async with stalling_pair(engine_name, bootstrap_url, stall_all) as (pair, fault):
        log: list[str] = []
        EngineCalls(pair.prefill, log)
        room, n = 57, 6
        src_pages, dst_pages = np.arange(n), np.arange(40, 40 + n)
        pair.src.fill(src_pages, room)
        sender = pair.prefill.sender(
            room, num_pages=n, aux_slot=0, on_release=poison_src(pair.src, src_pages, log)
        )
        chunks = two_page_chunks(n)
        for i, pages in enumerate(chunks):  # no metadata yet: they wait, then queue at once
            sender.send(pages, last=i == len(chunks) - 1)
        assert pair.prefill.statistics().leases_live == 3
        seen: list[npt.NDArray[Any]] = []
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        receiver.init(dst_pages, 1, on_release=record_dst(pair.dst, dst_pages, log, seen))
        await stalled(fault.stalls)
        assert pair.prefill.statistics().leases_live == 1  # merged into the call's lease
        assert pair.prefill.statistics().chunks_coalesced == 2

        receiver.abort()
        with trio.fail_after(BOUND):
            assert await sender.wait() is KVPoll.Failed
        await stays_pending(sender.wait_released, "the source release while the call runs")
        await stays_pending(receiver.wait_released, "an ack while the call is in the engine")
        assert pair.decode.statistics().pages_held == n

        fault.stalls.release_all()
        with trio.fail_after(BOUND):
            await receiver.wait_released()
            await sender.wait_released()
        await watch()
        assert fault.statistics().calls == 1
        assert pair.prefill.statistics().acks_sent == 1
        assert log[0] == "write returned" and sorted(log[1:]) == ["dst released", "src released"]
        assert bool((seen[0] == pair.dst.expected(room, n)).all())  # all of it had landed


# ------------------------------------------------------------------------------ §8.6, §8.7


async def test_abort_with_chunk_in_flight_acks_after_drain(
    engine_name: str, bootstrap_url: str
) -> None:
    """SPEC §8.6, I1: decode aborts while prefill's chunk is inside the engine. No ack (and
    so no release of the destination pages) until that chunk returns; then exactly one ack,
    and both sides' pages go back after the write."""
    async with stalling_pair(engine_name, bootstrap_url, stall_all) as (pair, fault):
        log: list[str] = []
        EngineCalls(pair.prefill, log)
        room, n = 61, 4
        src_pages, dst_pages = np.arange(8, 8 + n), np.arange(30, 30 + n)
        pair.src.fill(src_pages, room)
        seen: list[npt.NDArray[Any]] = []
        sender = pair.prefill.sender(
            room, num_pages=n, aux_slot=0, on_release=poison_src(pair.src, src_pages, log)
        )
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        receiver.init(dst_pages, 1, on_release=record_dst(pair.dst, dst_pages, log, seen))
        sender.send(src_pages, last=True)
        await stalled(fault.stalls)

        receiver.abort()
        assert receiver.poll() is KVPoll.Failed
        with trio.fail_after(BOUND):
            assert await sender.wait() is KVPoll.Failed  # the ABORT arrived
        await stays_pending(receiver.wait_released, "an ack while the chunk is in the engine")
        assert pair.prefill.statistics().acks_sent == 0
        assert pair.decode.statistics().acks_received == 0
        assert pair.decode.statistics().pages_held == n

        fault.stalls.release_all()
        with trio.fail_after(BOUND):
            await receiver.wait_released()
            await sender.wait_released()
        await watch()  # a second ack would show here
        assert pair.prefill.statistics().acks_sent == 1
        assert pair.decode.statistics().acks_received == 1
        assert log[0] == "write returned" and sorted(log[1:]) == ["dst released", "src released"]
        # The write landed before the destination pages were handed back.
        assert bool((seen[0] == pair.dst.expected(room, n)).all())
        assert pair.decode.statistics().pages_held == 0


async def test_abort_idle_room_acks_at_once_and_closes_admission(
    engine_name: str, bootstrap_url: str
) -> None:
    """SPEC §8.7, I2: ABORT for a room that has its metadata but no chunk in flight is acked
    at once (well before any ack deadline), and the prefill side admits nothing after it."""
    async with stalling_pair(
        engine_name, bootstrap_url, lambda *_: None,
        decode_config=DecodeConfig(ack_timeout=60.0),
    ) as (pair, fault):
        released: list[str] = []
        room, n = 71, 3
        transfers = Handled(pair.prefill, "_on_transfer")
        sender = pair.prefill.sender(
            room, num_pages=n, aux_slot=0, on_release=lambda: released.append("src")
        )
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        receiver.init(np.arange(n), 0, on_release=lambda: released.append("dst"))
        await transfers.wait()
        assert sender.poll() is KVPoll.WaitingForInput

        receiver.abort()
        with trio.fail_after(5):
            await receiver.wait_released()
            await sender.wait_released()
        assert sender.poll() is KVPoll.Failed
        with pytest.raises(AdmissionClosed):
            sender.send(np.arange(n), last=True)
        assert fault.statistics().calls == 0
        assert sorted(released) == ["dst", "src"]
        assert pair.prefill.statistics().acks_sent == 1
        assert pair.decode.statistics().acks_received == 1


async def test_abort_unknown_room_acks(engine_name: str, bootstrap_url: str) -> None:
    """SPEC §8.7: decode aborts a request the prefill scheduler never started. The prefill
    rank holds nothing for it and acks at once; the destination pages go back."""
    async with open_pair(
        engine_name, bootstrap_url, decode_config=DecodeConfig(ack_timeout=60.0)
    ) as pair:
        released: list[str] = []
        transfers = Handled(pair.prefill, "_on_transfer")
        receiver = pair.decode.receiver(72, bootstrap_url=pair.url)
        receiver.init(np.arange(4), 0, on_release=lambda: released.append("dst"))
        await transfers.wait()
        receiver.abort()
        with trio.fail_after(5):
            await receiver.wait_released()
        assert released == ["dst"]
        assert pair.prefill.statistics().acks_sent == 1
        assert pair.prefill.statistics().rooms_active == 0


async def test_late_transfer_after_abort_fails_that_rank_at_once(
    engine_name: str, bootstrap_url: str
) -> None:
    """Found by the demo (TP 1 -> 4, prefill aborts after its last chunk): prefill concludes a
    room as Failed while one decode rank's TRANSFER is still on its way. The ranks that heard
    the Failed STATUS send ABORTs, which meet no room and leave a tombstone for the (room,
    epoch). The late TRANSFER that meets the tombstone must be answered with a Failed STATUS:
    dropped, it left that decode rank waiting for its waiting deadline with its pages held."""
    async with open_cluster(
        engine_name, bootstrap_url, prefill_tp=1, decode_tp=2, setup=lambda *_: None
    ) as c:
        prefill = c.prefills[0]
        transfers = Handled(prefill, "_on_transfer")
        aborts = Handled(prefill, "_on_abort")
        room, n = 14, 4
        dst_pages = np.arange(30, 30 + n)
        sender = prefill.sender(room, num_pages=n, aux_slot=1)
        first = c.decodes[0].receiver(room, bootstrap_url=c.url, epoch=8)
        first.init(dst_pages, 2)
        await transfers.wait(1)
        sender.abort("the scheduler dropped the request")
        with trio.fail_after(BOUND):
            assert await first.wait() is KVPoll.Failed
            await first.wait_released()  # its ABORT was acked: the room is gone, tombstoned
        await aborts.wait(1)
        assert prefill.statistics().rooms_active == 0

        late = c.decodes[1].receiver(room, bootstrap_url=c.url, epoch=8)
        late.init(dst_pages, 2)
        # BOUND is far below the decode rank's waiting deadline (DecodeConfig: 120 s)
        with trio.fail_after(BOUND):
            assert await late.wait() is KVPoll.Failed
            await late.wait_released()
        assert "aborted" in str(late.failure)
        assert prefill.statistics().late_messages == 1


async def test_refused_transfer_is_retried_when_the_socket_is_full(
    engine_name: str, bootstrap_url: str
) -> None:
    """The Failed STATUS that answers a refused TRANSFER (here: one that meets an abort
    tombstone) is retried like any Failed STATUS when the decode rank's socket is full at
    that moment, not dropped."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        transfers = Handled(pair.prefill, "_on_transfer")
        statuses = Handled(pair.decode, "_on_status")
        endpoint = pair.decode.endpoint
        pair.decode.receiver(89, bootstrap_url=pair.url).init(np.arange(2), 0)
        await transfers.wait(1)  # decode is registered with prefill
        room, pages = 90, np.arange(4, 6)
        pair.prefill._handle(
            wire.Abort(v=wire.WIRE_VERSION, room=room, epoch=9, endpoint=endpoint), None
        )
        real = pair.prefill.control.send_nowait
        refused: list[wire.Status] = []

        def full_once(ep: str, msg: wire.Message, pages: Any = None) -> bool:
            if isinstance(msg, wire.Status) and msg.room == room and not refused:
                refused.append(msg)
                return False  # the decode rank's socket is full, this once
            return real(ep, msg, pages)

        pair.prefill.control.send_nowait = full_once  # type: ignore[method-assign]
        pair.prefill._handle(_transfer(room, endpoint, pages), pages.astype(np.int32))
        assert len(refused) == 1 and not refused[0].ok
        await statuses.wait(1)  # the retry got through (decode holds no such room: late)
        assert pair.prefill.statistics().late_messages == 1


@asynccontextmanager
async def decode_beside(
    engine_name: str, bootstrap_url: str
) -> AsyncIterator[tuple[DecodeAgent, Callable[[], Any]]]:
    """A decode agent, and a way to open a prefill agent beside it (``async with
    open_one() as prefill``) whose engine outlives it, as an embedding may keep it."""
    src, dst = host_pool("mha"), host_pool("mha")
    pe, de = make_engine(engine_name), make_engine(engine_name)

    def open_one() -> Any:
        return open_prefill(
            engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=KV_HEADS
        )

    try:
        async with open_decode(engine=de, pool=dst.spec) as decode:
            yield decode, open_one
    finally:
        pe.close()
        de.close()


async def test_closing_prefill_tells_the_decode_rooms_it_knows(
    engine_name: str, bootstrap_url: str
) -> None:
    """A prefill agent closes while decode rooms wait on it, and its engine stays up (an
    embedding that keeps the engine for its next agent; the in-process demo). Every decode rank
    it knows of hears a Failed STATUS and an ack: nothing of this agent's can be in flight any
    more, so their pages go back now. Before, they failed on the heartbeat and then waited for
    the writer to be proven gone, which never happens while its engine is up. Both kinds of
    room: one the scheduler created, one whose TRANSFER came before any sender existed."""
    released: list[int] = []
    async with decode_beside(engine_name, bootstrap_url) as (decode, open_one):
        async with open_one() as prefill:
            transfers = Handled(prefill, "_on_transfer")
            prefill.sender(31, num_pages=2, aux_slot=0)  # created, nothing sent yet
            receivers = []
            for room in (31, 32):
                rx = decode.receiver(room, bootstrap_url=bootstrap_url)
                rx.init(
                    np.arange(2) + 2 * (room - 31), room - 31,
                    on_release=lambda room=room: released.append(room),  # type: ignore[misc]
                )
                receivers.append(rx)
            await transfers.wait(2)
        # the prefill agent is closed; its engine is not
        with trio.fail_after(BOUND):
            for rx in receivers:
                assert await rx.wait() is KVPoll.Failed
                await rx.wait_released()
        assert sorted(released) == [31, 32]
        assert all("prefill agent closed" in str(rx.failure) for rx in receivers)
        assert decode.statistics().acks_received == 2


async def test_closing_prefill_says_goodbye_for_rooms_it_will_never_read(
    engine_name: str, bootstrap_url: str
) -> None:
    """A decode room is made after its prefill agent closed (engine up), its TRANSFER to
    a socket nobody reads any more: the BYE the agent sent after its last engine call
    counts it drained, so the room fails (PeerLost) and its pages go back at once. Before,
    the room failed on the heartbeat and then held its pages until decode closed. Rooms
    after it are refused before any TRANSFER: the service still publishes the closed rank,
    and decode remembers that record as closed."""
    released: list[int] = []
    async with decode_beside(engine_name, bootstrap_url) as (decode, open_one):
        async with open_one() as prefill:
            transfers = Handled(prefill, "_on_transfer")
            warm = decode.receiver(40, bootstrap_url=bootstrap_url)  # resolves, registers
            warm.init(np.arange(2), 0, on_release=lambda: released.append(40))
            with trio.fail_after(BOUND):
                await transfers.wait(1)
            assert len(prefill.peers.all()) == 1
        receivers = []
        for room in (41, 42):
            rx = decode.receiver(room, bootstrap_url=bootstrap_url)
            rx.init(np.arange(2) + 2 * (room - 40), room - 40,
                    on_release=lambda room=room: released.append(room))  # type: ignore[misc]
            receivers.append(rx)
            await trio.sleep(0.05)
        with trio.fail_after(BOUND / 2):  # (well before the heartbeat could say anything)
            for rx in [warm, *receivers]:
                assert await rx.wait() is KVPoll.Failed
                await rx.wait_released()
        assert sorted(released) == [40, 41, 42]
        assert isinstance(receivers[-1].failure, PeerLost)
        assert "closed" in str(receivers[-1].failure), receivers[-1].failure
        stats = decode.statistics()
        assert stats.peers_closed == 1 and stats.peers_lost == 0, stats
        assert stats.rooms_unproven_at_close == 0


async def test_closing_prefill_does_not_ack_a_quarantined_room(
    engine_name: str, bootstrap_url: str
) -> None:
    """...except a room whose write failed: its lease is quarantined, the write's bytes may
    still land (Mooncake), so neither the goodbye nor the ABORT decode sent is acked when the
    agent closes, if the quarantine is still unproven when the close stops waiting for it
    (``close_timeout``; counted ``rooms_unacked_at_close``). Decode keeps the pages until
    the writer is proven gone."""
    src, dst = host_pool("mha"), host_pool("mha")
    pe = FaultEngine(make_engine(engine_name))
    pe.policy = lambda *_: Fault("fail")
    de = make_engine(engine_name)
    try:
        async with open_decode(engine=de, pool=dst.spec) as decode:
            async with open_prefill(
                engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=KV_HEADS,
                config=PrefillConfig(quarantine_fence=60.0, close_timeout=0.3),
            ) as prefill:
                aborts = Handled(prefill, "_on_abort")
                sender = prefill.sender(33, num_pages=2, aux_slot=0)
                receiver = decode.receiver(33, bootstrap_url=bootstrap_url)
                receiver.init(np.arange(2), 0)
                sender.send(np.arange(2), last=True)
                with trio.fail_after(BOUND):
                    assert await sender.wait() is KVPoll.Failed
                    assert await receiver.wait() is KVPoll.Failed
                await aborts.wait(1)  # decode asked for the drain; nothing acks it yet
                assert prefill.statistics().leases_quarantined == 1
            assert prefill.statistics().rooms_unacked_at_close == 1
            await stays_pending(receiver.wait_released, "decode's release after a failed write")
            assert decode.statistics().acks_received == 0
            assert decode.statistics().peers_closed == 0  # (no BYE: a write is not proven over)
    finally:
        pe.close()
        de.close()


async def test_closing_prefill_waits_for_a_started_call_and_fails_a_queued_one(
    engine_name: str, bootstrap_url: str
) -> None:
    """The agent closes (its workers cancelled from outside) while room 51's write is in the
    engine and room 52's is queued behind it on the same lane. Each chunk has one
    destination, so its call is awaited without a nursery (docs/lifetimes.md, section 2);
    the started call is waited for all the same, the close with it, and room 51's pages go
    back only once it returned; the queued call never starts: room 52 fails with
    :class:`TransferAborted` (the agent is closing) and its pages go back at once."""
    log: list[str] = []
    src, dst = host_pool("mha"), host_pool("mha")
    pe, de = FaultEngine(make_engine(engine_name), stall_call(0)), make_engine(engine_name)

    async def let_go() -> None:
        await watch()  # the close waits for the stalled write meanwhile
        log.append("write let go")
        pe.stalls.release_all()

    try:
        async with (
            open_decode(engine=de, pool=dst.spec) as decode,
            trio.open_nursery() as side,
            open_prefill(
                engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=KV_HEADS,
                config=PrefillConfig(inflight_per_peer=1, batch_blocks=0),
            ) as prefill,
        ):
            senders = {}
            for room in (51, 52):
                k = room - 51
                senders[room] = prefill.sender(
                    room, num_pages=2, aux_slot=k,
                    on_release=lambda room=room: log.append(f"{room} released"),
                )
                decode.receiver(room, bootstrap_url=bootstrap_url).init(
                    np.arange(2) + 2 * k, k
                )
            senders[51].send(np.arange(2), last=True)
            await stalled(pe.stalls)  # 51's write is in the engine
            senders[52].send(np.arange(2) + 2, last=True)
            (peer,) = prefill.peers.all()
            with trio.fail_after(BOUND):  # 52's write is queued on the lane behind it
                await poll_until(lambda: peer.lane.outstanding == 2)
            side.start_soon(let_go)
        assert log == ["52 released", "write let go", "51 released"], log
        failure = senders[52].failure
        assert isinstance(failure, TransferAborted) and "is closing" in str(failure), failure
        # 51's write returned during the close: no worker publishes then, the close fails it
        assert "prefill agent closed" in str(senders[51].failure)
        assert pe.statistics().calls == 1  # 52's never reached the engine
    finally:
        pe.stalls.release_all()
        pe.close()
        de.close()


async def test_abort_room_with_waiting_chunk_cancels_and_acks(
    engine_name: str, insecure: None, bootstrap_url: str
) -> None:
    """SPEC §8.7: a chunk admitted before decode's metadata arrived holds a lease but never
    reached the engine. An ABORT naming an epoch this room has not seen (its TRANSFER never
    came, so the ABORT may be for an older use of the room id: I4) is acked at once and
    leaves the room alone; the scheduler's abort then cancels the waiting chunk (retired, not
    quarantined) and the pages go back at once."""
    async with stalling_pair(engine_name, bootstrap_url, lambda *_: None) as (pair, fault):
        released: list[str] = []
        acks = Handled(pair.decode, "_on_ack")
        room, n = 73, 2
        sender = pair.prefill.sender(
            room, num_pages=n, aux_slot=0, on_release=lambda: released.append("src")
        )
        sender.send(np.arange(n), last=True)
        assert pair.prefill.statistics().leases_live == 1
        pair.prefill._handle(
            wire.Abort(v=wire.WIRE_VERSION, room=room, epoch=3, endpoint=pair.decode.endpoint),
            None,
        )
        assert sender.poll() is KVPoll.Bootstrapping  # this use is untouched
        stats = pair.prefill.statistics()
        assert stats.leases_live == 1 and stats.acks_sent == 1
        await acks.wait()  # the ack reached decode, which holds no such room: dropped
        assert pair.decode.statistics().late_messages == 1
        sender.abort("the scheduler gives up")
        assert sender.poll() is KVPoll.Failed
        assert released == ["src"]
        stats = pair.prefill.statistics()
        assert stats.leases_live == stats.leases_quarantined == 0
        assert fault.statistics().calls == 0


# ------------------------------------------------------------------------------ §8.8


async def test_two_prefill_ranks_release_after_both_acks(
    engine_name: str, bootstrap_url: str
) -> None:
    """SPEC §8.8: a decode rank reads from two prefill ranks and aborts while both are
    writing. One rank's ack does not release the pages, nor does a duplicate of it; an ack
    for a room it does not hold is dropped; the second rank's ack releases them, once."""
    async with open_cluster(
        engine_name, bootstrap_url, prefill_tp=2, decode_tp=1,
        setup=stall_everything,
    ) as c:
        decode = c.decodes[0]
        log: list[str] = []
        acks = Handled(decode, "_on_ack")
        aborts = [Handled(p, "_on_abort") for p in c.prefills]
        room, n, epoch = 81, 3, 77
        dst_pages = np.arange(90, 90 + n)
        senders = []
        for r, p in enumerate(c.prefills):
            pages = np.arange(5, 5 + n)
            c.srcs[r].fill(pages, room)
            release = poison_src(c.srcs[r], pages, log)
            s = p.sender(room, num_pages=n, aux_slot=0, on_release=release)
            s.send(pages, last=True)
            senders.append(s)
        receiver = decode.receiver(room, bootstrap_url=c.url, epoch=epoch)
        receiver.init(dst_pages, 0, on_release=lambda: log.append("dst released"))
        for f in c.faults:
            await stalled(f.stalls)

        receiver.abort()
        for a in aborts:
            await a.wait()
        c.faults[0].stalls.release_all()
        await acks.wait(1)  # rank 0 drained and acked
        await stays_pending(receiver.wait_released, "the release after one rank's ack")
        assert decode.statistics().pages_held == n
        # A duplicate ack from rank 0 counts once.
        decode._handle(wire.AbortAck(v=wire.WIRE_VERSION, room=room, epoch=epoch, rank=0), None)
        assert "dst released" not in log and decode.statistics().pages_held == n
        # An ack for a room this rank does not hold is dropped.
        late = decode.statistics().late_messages
        decode._handle(wire.AbortAck(v=wire.WIRE_VERSION, room=999, epoch=epoch, rank=1), None)
        assert decode.statistics().late_messages == late + 1

        c.faults[1].stalls.release_all()
        with trio.fail_after(BOUND):
            await receiver.wait_released()
            for s in senders:
                await s.wait_released()
        assert log.count("dst released") == 1
        assert decode.statistics().acks_received == 3  # rank 0, its duplicate, rank 1
        assert decode.statistics().pages_held == 0


# ------------------------------------------------------------------------------ §8.9


@pytest.mark.parametrize("chunks", [1, 2])
async def test_engine_error_quarantines_lease(
    engine_name: str, bootstrap_url: str, chunks: int
) -> None:
    """SPEC §8.9: an engine error (half the blocks written, outcome unknown) fails the room
    and quarantines its lease: no ack to decode and no source release by the error path.
    Only the quarantine fence ends it; then the pages go back and the ack flows. With two
    chunks coalesced into the failing call, their one lease covers both."""
    fence = 2.0
    async with stalling_pair(
        engine_name, bootstrap_url, lambda *_: Fault("partial"), probe_override=True,
        prefill_config=PrefillConfig(quarantine_fence=fence),
    ) as (pair, _fault):
        log: list[str] = []
        aborts = Handled(pair.prefill, "_on_abort")
        room, n = 91, 4
        src_pages, dst_pages = np.arange(n), np.arange(10, 10 + n)
        sender, receiver = send_whole_room(pair, room, src_pages, dst_pages, log, chunks=chunks)
        with trio.fail_after(BOUND):
            assert await sender.wait() is KVPoll.Failed
            failed_at = trio.current_time()
            assert await receiver.wait() is KVPoll.Failed  # prefill's Failed STATUS
        assert isinstance(sender.failure, EngineError)
        await aborts.wait()  # decode asked for the drain
        stats = pair.prefill.statistics()
        assert stats.quarantined == 1 and stats.leases_quarantined == 1
        assert stats.chunks_coalesced == chunks - 1 and stats.leases_live == 0
        assert stats.acks_sent == 0 and log == []
        assert pair.decode.statistics().pages_held == n
        assert trio.current_time() - failed_at < fence - QUIET, "machine too slow for this test"
        await stays_pending(receiver.wait_released, "an ack while the lease is quarantined")

        with trio.fail_after(fence + BOUND):
            await sender.wait_released()
            await receiver.wait_released()
        assert trio.current_time() - failed_at >= fence * 0.9
        stats = pair.prefill.statistics()
        assert stats.released_after_quarantine == 1 and stats.acks_sent == 1
        assert stats.leases_quarantined == 0
        assert sorted(log) == ["dst released", "src released"]


# ------------------------------------------------------------------------------ I4, I5


async def test_reused_room_ignores_old_epoch(engine_name: str, bootstrap_url: str) -> None:
    """I4: room 101 is used twice (epochs 1 and 2). Late ABORT, ACK and STATUS of epoch 1
    reach the second use: prefill acks the old epoch without touching the new room, and
    decode drops them (they neither fail the room nor release its held pages)."""
    async with stalling_pair(engine_name, bootstrap_url, stall_call(1)) as (pair, fault):
        room, n = 101, 2
        src_pages, dst_pages = np.arange(n), np.arange(20, 20 + n)
        pair.src.fill(src_pages, room)
        pair.src.fill_aux(0, room)
        # Use 1: completes normally.
        s1 = pair.prefill.sender(room, num_pages=n, aux_slot=0)
        r1 = pair.decode.receiver(room, bootstrap_url=pair.url, epoch=1)
        r1.init(dst_pages, 0)
        s1.send(src_pages, last=True)
        with trio.fail_after(BOUND):
            assert await r1.wait() is KVPoll.Success
            await s1.wait_released()
        # Use 2: its chunk stalls in the engine.
        acks = Handled(pair.decode, "_on_ack")
        released: list[str] = []
        s2 = pair.prefill.sender(room, num_pages=n, aux_slot=0)
        r2 = pair.decode.receiver(room, bootstrap_url=pair.url, epoch=2)
        r2.init(dst_pages, 0, on_release=lambda: released.append("dst"))
        s2.send(src_pages, last=True)
        await stalled(fault.stalls)

        late = pair.decode.statistics().late_messages
        pair.prefill._handle(
            wire.Abort(v=wire.WIRE_VERSION, room=room, epoch=1, endpoint=pair.decode.endpoint),
            None,
        )
        assert s2.poll() is KVPoll.Transferring  # the old epoch's ABORT spares the new room
        await acks.wait(1)  # its ack (epoch 1) reached decode: dropped
        pair.decode._handle(
            wire.Status(v=wire.WIRE_VERSION, room=room, epoch=1, rank=0, ok=False, reason="old"),
            None,
        )
        assert r2.poll() is KVPoll.WaitingForInput
        assert pair.decode.statistics().late_messages == late + 2

        r2.abort()
        pair.decode._handle(wire.AbortAck(v=wire.WIRE_VERSION, room=room, epoch=1, rank=0), None)
        assert released == [] and pair.decode.statistics().pages_held == n
        assert pair.decode.statistics().late_messages == late + 3

        fault.stalls.release_all()
        with trio.fail_after(BOUND):
            await r2.wait_released()
        assert released == ["dst"]
        assert r1.poll() is KVPoll.Success  # the first use's terminal status is cached


async def test_failed_is_absorbing_and_cached(engine_name: str, bootstrap_url: str) -> None:
    """I5: decode aborts while prefill's last chunk is in the engine, and its ABORT crosses
    prefill's Success on the wire (held back here until the Success has arrived). The KV and
    the aux row did land, yet the room stays Failed with its first reason; its pages go back
    once; after it is forgotten, the handle still reports Failed."""
    async with stalling_pair(engine_name, bootstrap_url, stall_all) as (pair, fault):
        room, n, epoch, slot = 111, 2, 42, 5
        src_pages, dst_pages = np.arange(n), np.arange(70, 70 + n)
        pair.src.fill(src_pages, room)
        pair.src.fill_aux(0, room)
        released: list[str] = []
        statuses = Handled(pair.decode, "_on_status")
        held: list[tuple[str, wire.Message]] = []
        send = pair.decode.control.send_nowait

        def hold_aborts(endpoint: str, msg: wire.Message, pages: Any = None) -> bool:
            if isinstance(msg, wire.Abort):
                held.append((endpoint, msg))
                return True
            return send(endpoint, msg, pages)

        pair.decode.control.send_nowait = hold_aborts  # type: ignore[method-assign]
        sender = pair.prefill.sender(room, num_pages=n, aux_slot=0)
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url, epoch=epoch)
        receiver.init(dst_pages, slot, on_release=lambda: released.append("dst"))
        sender.send(src_pages, last=True)
        await stalled(fault.stalls)

        receiver.abort("first reason")
        fault.stalls.release_all()
        with trio.fail_after(BOUND):
            assert await sender.wait() is KVPoll.Success
        await statuses.wait()  # prefill's Success reached decode after its abort
        assert pair.verify(room, dst_pages, slot)  # everything landed...
        assert receiver.poll() is KVPoll.Failed  # ...but Failed is absorbing
        assert "first reason" in str(receiver.failure)
        assert pair.decode.statistics().succeeded == 0

        pair.decode.control.send_nowait = send  # type: ignore[method-assign]
        for endpoint, msg in held:
            assert send(endpoint, msg)
        with trio.fail_after(BOUND):
            await receiver.wait_released()
        await watch()
        assert released == ["dst"]
        assert receiver.poll() is KVPoll.Failed
        assert "first reason" in str(receiver.failure)
        assert pair.decode.statistics().rooms_active == 0


# ------------------------------------------------------------------------------ I9, timeouts


@pytest.mark.serial
async def test_waiting_timeout_fails_but_holds_pages(
    engine_name: str, bootstrap_url: str
) -> None:
    """I9, SPEC §5.6: a room whose prefill chunk never finishes fails on decode within the
    waiting timeout, with a reason; its pages stay held until the writer drained."""
    timeout = 0.5
    async with stalling_pair(
        engine_name, bootstrap_url, stall_all,
        decode_config=DecodeConfig(waiting_timeout=timeout, ack_timeout=60.0),
    ) as (pair, fault):
        log: list[str] = []
        EngineCalls(pair.prefill, log)
        room, n = 121, 3
        dst_pages = np.arange(n)
        sender = pair.prefill.sender(room, num_pages=n, aux_slot=0)
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        start = trio.current_time()
        receiver.init(dst_pages, 0, on_release=lambda: log.append("dst released"))
        sender.send(np.arange(n), last=True)
        await stalled(fault.stalls)
        with trio.fail_after(timeout + BOUND):
            assert await receiver.wait() is KVPoll.Failed
        assert trio.current_time() - start < timeout + 2.0
        assert "waiting timeout" in str(receiver.failure)
        assert pair.decode.statistics().timeouts == 1
        await stays_pending(receiver.wait_released, "the release on a timeout")
        assert pair.decode.statistics().pages_held == n and log == []

        fault.stalls.release_all()
        with trio.fail_after(BOUND):
            await receiver.wait_released()
        assert log == ["write returned", "dst released"]
        assert pair.decode.statistics().released_by_timeout == 0


@pytest.mark.serial
async def test_bootstrap_timeout_fails_only_rooms_without_metadata(
    engine_name: str, bootstrap_url: str
) -> None:
    """SPEC §8.10: a prefill room whose decode metadata never comes fails at the bootstrap
    deadline with a reason; its admitted chunk never reaches the engine and its pages go
    back. A room that had its metadata (its chunk still in the engine) is untouched."""
    timeout = 0.5
    async with stalling_pair(
        engine_name, bootstrap_url, stall_all,
        prefill_config=PrefillConfig(bootstrap_timeout=timeout),
    ) as (pair, fault):
        released: list[int] = []
        transfers = Handled(pair.prefill, "_on_transfer")
        n = 2
        good = pair.decode.receiver(131, bootstrap_url=pair.url)
        good.init(np.arange(n), 0)
        await transfers.wait()  # its metadata is here before its sender exists
        pair.src.fill(np.arange(n), 131)
        pair.src.fill_aux(0, 131)
        s_good = pair.prefill.sender(131, num_pages=n, aux_slot=0)
        s_lone = pair.prefill.sender(
            132, num_pages=n, aux_slot=1, on_release=lambda: released.append(132)
        )
        s_good.send(np.arange(n), last=True)
        s_lone.send(np.arange(10, 10 + n), last=True)
        await stalled(fault.stalls)

        with trio.fail_after(timeout + BOUND):
            assert await s_lone.wait() is KVPoll.Failed
        assert "bootstrap timeout" in str(s_lone.failure)
        assert released == [132]
        assert pair.prefill.statistics().timeouts == 1
        assert s_good.poll() is KVPoll.Transferring

        fault.stalls.release_all()
        with trio.fail_after(BOUND):
            assert await good.wait() is KVPoll.Success
            assert await s_good.wait() is KVPoll.Success
        assert fault.statistics().calls == 1  # the lone room never reached the engine
        assert pair.verify(131, np.arange(n), 0)
