"""The decode agent: owns the destination pools, finds prefill ranks through the bootstrap
service, asks them for KV, decides each room's outcome, and holds the pages of a failed room
until every prefill rank that may write them has acked its drain.

How a room lives here (SPEC §4, §5.5):

* ``decode.receiver(room, bootstrap_url)`` resolves the prefill instance (once per instance,
  shared by all rooms) and registers this rank with each prefill rank it reads from.
* ``receiver.init(pages, aux_slot)`` sends TRANSFER to every source rank, dummy ranks included.
* Success needs every required rank's Success (distinct rank ids) **and** the aux row stamped
  with this room and epoch.
* Any failure — abort, a Failed STATUS, a deadline, a lost peer — goes through
  :meth:`DecodeAgent._fail_and_drain`: mark Failed, send ABORT to every contacted rank, hold the
  pages until each of them acked. Deadlines report; they do not free.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt
import trio
import trio.lowlevel

from . import _wire
from ._bootstrap_client import BootstrapClient, Topology
from ._control import ControlPlane
from ._errors import (
    BootstrapError,
    PeerLost,
    ProtocolError,
    RemoteFailure,
    TransferAborted,
    TransferError,
)
from ._lazy import LazyEvent
from ._memory import PoolSpec, read_aux_stamp, validate_pages
from ._state import DecodeBook, KVPoll, RankSet
from ._stats import AgentStatistics, Counters
from ._timers import Timers
from ._topology import source_ranks
from .engines import TransferEngine

if TYPE_CHECKING:
    from .metrics import AgentMetrics

log = logging.getLogger("trio_pd.decode")


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Knobs of a decode agent. Deadlines are in seconds."""

    #: resolving a prefill instance through its bootstrap service
    bootstrap_timeout: float = 30.0
    #: a room not terminal this long after ``init`` fails (and waits for its drain acks)
    waiting_timeout: float = 120.0
    #: how long to wait for drain acks before re-sending ABORT and probing the writers
    ack_timeout: float = 10.0
    heartbeat_interval: float = 1.0
    heartbeat_misses: int = 3
    #: "drain": pages of a failed room go back only on every ack, or when the writing peer is
    #: proven gone. "timeout": also when ``ack_timeout`` passes (counted released_by_timeout).
    release_policy: Literal["drain", "timeout"] = "drain"
    sndhwm: int = 10_000


@dataclass(eq=False, slots=True)
class _PrefillRank:
    endpoint: str
    tp_rank: int
    session: str
    ping_id: int = 0
    heartbeat_endpoint: str = ""
    rooms: set[int] = field(default_factory=set)
    unanswered: int = 0  # pings sent since the last pong
    lost: bool = False


@dataclass(eq=False, slots=True)
class _Instance:
    url: str
    sources: list[_PrefillRank] = field(default_factory=list)
    ready: bool = False
    waiting: list[_Room] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class _Room:
    room: int
    epoch: int
    instance: _Instance
    book: DecodeBook | None = None
    pages: npt.NDArray[np.int32] | None = None
    aux_slot: int = -1
    on_release: Callable[[], None] | None = None
    sources: list[_PrefillRank] = field(default_factory=list)
    terminal: LazyEvent = field(default_factory=LazyEvent)
    released: LazyEvent = field(default_factory=LazyEvent)
    #: a failure seen before the prefill instance was resolved (no rank contacted yet)
    early_failure: TransferError | None = None

    @property
    def status(self) -> KVPoll:
        if self.book is not None:
            return self.book.cell.status
        if self.early_failure is not None:
            return KVPoll.Failed
        return KVPoll.Bootstrapping


class DecodeReceiver:
    """The scheduler's handle for one room on a decode rank (≈ SGLang's ``KVReceiver``).

    Ownership of the destination pages: from :meth:`init` they belong to trio_pd. After
    Success they hold the request's KV and are the caller's again. After a failure,
    ``on_release`` runs exactly once, when no prefill rank can still write them.
    """

    def __init__(self, agent: DecodeAgent, room: _Room) -> None:
        self._agent = agent
        self._room = room

    @property
    def room(self) -> int:
        return self._room.room

    @property
    def epoch(self) -> int:
        return self._room.epoch

    def init(
        self,
        pages: npt.ArrayLike,
        aux_slot: int,
        *,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        """Ask the prefill ranks for the room's KV into ``pages`` and aux row ``aux_slot``."""
        self._agent._init(self._room, np.asarray(pages).reshape(-1), aux_slot, on_release)

    def poll(self) -> KVPoll:
        """The room's status now. Never blocks; a terminal status never changes again."""
        return self._room.status

    @property
    def failure(self) -> TransferError | None:
        """Why the room failed (None unless Failed)."""
        if self._room.book is not None:
            return self._room.book.cell.failure
        return self._room.early_failure

    @property
    def propagated(self) -> bool:
        """True if this rank saw Failed only because another rank failed."""
        return self._room.book is not None and self._room.book.cell.propagated

    def abort(self, reason: str = "aborted by the decode scheduler") -> None:
        """Fail the room and ask every prefill rank it contacted to drain. The pages stay held
        until each has acked; then ``on_release`` runs. Idempotent."""
        self._agent._fail_and_drain(self._room, TransferAborted(reason))

    def abort_from_thread(self, reason: str = "aborted from a thread") -> None:
        """:meth:`abort` for code that runs in a thread outside trio."""
        trio.from_thread.run_sync(self.abort, reason, trio_token=self._agent._token)

    async def wait(self) -> KVPoll:
        """Wait until the room is terminal; return Success or Failed.

        **Cancellation:** cancelling the wait does not abort the room.
        """
        await self._room.terminal.wait()
        return self._room.status

    async def wait_released(self) -> None:
        """Wait until a failed room's pages have been handed back.

        **Cancellation:** cancelling the wait changes nothing.
        """
        await self._room.released.wait()


class DecodeAgent:
    """One decode rank. Make one with :func:`open_decode`."""

    def __init__(
        self,
        *,
        engine: TransferEngine,
        pool: PoolSpec,
        tp_rank: int,
        tp_size: int,
        host: str,
        config: DecodeConfig,
        control: ControlPlane | None = None,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.metrics = metrics  # prometheus hooks (trio_pd.metrics), optional
        self.engine = engine
        self.pool = pool
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.config = config
        self.counters = Counters()
        self.control = control or ControlPlane(host, self.counters, sndhwm=config.sndhwm)
        self._rooms: dict[int, _Room] = {}
        self._instances: dict[str, _Instance] = {}
        self._ranks: dict[str, _PrefillRank] = {}  # endpoint -> rank we registered with
        self.timers = Timers()
        self._ping_ids = itertools.count(1)
        #: probes run in their own thread: one of a hung peer can take a minute
        self._probe_limiter = trio.CapacityLimiter(1)
        self._nursery: trio.Nursery | None = None
        self._token = trio.lowlevel.current_trio_token()

    @property
    def endpoint(self) -> str:
        return self.control.endpoint

    def receiver(
        self, room: int, *, bootstrap_url: str, epoch: int | None = None
    ) -> DecodeReceiver:
        """Create the handle for ``room`` served by the prefill instance at ``bootstrap_url``.
        ``epoch`` tells this use of the room from earlier ones; every decode rank of one
        request must pass the same one (default: a fresh random nonce)."""
        if room in self._rooms:
            raise TransferError(f"room {room} is still in use on decode rank {self.tp_rank}")
        if epoch is None:
            epoch = secrets.randbits(62)
        inst = self._instances.get(bootstrap_url)
        if inst is None:
            inst = self._instances[bootstrap_url] = _Instance(bootstrap_url)
            assert self._nursery is not None, "the decode agent is closed"
            self._nursery.start_soon(self._resolve, inst)
        r = _Room(room, epoch, inst)
        self._rooms[room] = r
        if inst.ready:
            self._bind(r)
        else:
            inst.waiting.append(r)
        return DecodeReceiver(self, r)

    def statistics(self) -> AgentStatistics:
        held = sum(
            len(r.pages)
            for r in self._rooms.values()
            if r.pages is not None and r.book is not None and r.book.aborting
        )
        return self.counters.snapshot(rooms_active=len(self._rooms), pages_held=held)

    # ------------------------------------------------------------------ room flow

    def _init(
        self,
        room: _Room,
        pages: npt.NDArray[np.generic],
        aux_slot: int,
        on_release: Callable[[], None] | None,
    ) -> None:
        if room.pages is not None:
            raise ProtocolError(f"room {room.room}: init called twice")
        validate_pages(pages, self.pool.num_pages)
        if not 0 <= aux_slot < self.pool.aux_slots:
            raise ProtocolError(f"aux slot {aux_slot} outside [0, {self.pool.aux_slots})")
        room.pages = pages.astype(np.int32)
        room.aux_slot = aux_slot
        room.on_release = on_release
        if room.released.is_set():
            # Failed and drained before init: no prefill rank was ever told these pages.
            self._run_on_release(room)
        elif room.early_failure is not None and room.book is None:
            pass  # the instance never resolved; nothing was sent: released on failure below
        elif room.book is not None and room.book.cell.status is KVPoll.WaitingForInput:
            self._send_transfers(room)
        if room.early_failure is not None and room.book is None:
            self._release(room)

    def _bind(self, room: _Room) -> None:
        """The instance is resolved: the room knows its source ranks."""
        room.sources = list(room.instance.sources)
        room.book = DecodeBook(room.room, room.epoch, RankSet(r.tp_rank for r in room.sources))
        if self._rooms.get(room.room) is room:
            for rank in room.sources:
                rank.rooms.add(room.room)
        if room.early_failure is not None:
            room.book.cell.fail(room.early_failure)  # counted when it happened
            self._fail_and_drain(room, room.early_failure)
            return
        room.book.cell.advance(KVPoll.WaitingForInput)
        if room.pages is not None:
            self._send_transfers(room)

    def _send_transfers(self, room: _Room) -> None:
        assert room.pages is not None and room.book is not None
        self.timers.after(self.config.waiting_timeout, partial(self._waiting_due, room))
        for rank in room.sources:
            if rank.lost:
                self._fail_and_drain(room, PeerLost(f"prefill rank {rank.tp_rank} is lost"))
                return
            msg = _wire.Transfer(
                v=_wire.WIRE_VERSION,
                room=room.room,
                epoch=room.epoch,
                endpoint=self.endpoint,
                decode_rank=self.tp_rank,
                aux_slot=room.aux_slot,
                required=len(room.sources),
                num_pages=len(room.pages),
            )
            room.book.contacted.add(rank.tp_rank)
            if not self.control.send_nowait(rank.endpoint, msg, room.pages):
                self._fail_and_drain(
                    room, PeerLost(f"prefill rank {rank.tp_rank} is not reading (socket full)")
                )
                return

    def _fail_and_drain(
        self, room: _Room, error: TransferError, *, propagated: bool = False
    ) -> None:
        """The one failure path: mark Failed, ask every source rank to drain (also those not
        sent a TRANSFER yet, so their senders fail now rather than at their bootstrap
        deadline), hold the pages until each acked (SPEC §5.5)."""
        book = room.book
        if book is None:  # the instance is not resolved: no prefill rank knows this room
            if room.early_failure is None:
                room.early_failure = error
                self._count_failure(error)
                room.terminal.set()
            return
        if book.cell.fail(error, propagated=propagated):
            self._count_failure(error)
            room.terminal.set()
        if book.aborting or book.cell.status is not KVPoll.Failed:
            return
        book.aborting = True
        if self.metrics is not None:
            self.metrics.drain_started(room)
        book.contacted.update(r.tp_rank for r in room.sources)
        self._send_aborts(room)
        self.timers.after(self.config.ack_timeout, partial(self._ack_due, room))
        self._maybe_release(room)

    def _count_failure(self, error: TransferError) -> None:
        self.counters.bump("aborted" if isinstance(error, TransferAborted) else "failed")
        if self.metrics is not None:
            self.metrics.observe_failure(error)

    def _send_aborts(self, room: _Room) -> None:
        assert room.book is not None
        for rank in room.sources:
            if rank.tp_rank in room.book.contacted and rank.tp_rank not in room.book.acked:
                msg = _wire.Abort(
                    v=_wire.WIRE_VERSION, room=room.room, epoch=room.epoch, endpoint=self.endpoint
                )
                if not self.control.send_nowait(rank.endpoint, msg):
                    self.timers.after(0.05, partial(self._send_aborts, room))

    def _maybe_release(self, room: _Room) -> None:
        if room.book is not None and room.book.take_release():
            self._release(room)

    def _release(self, room: _Room) -> None:
        if room.released.is_set():
            return
        room.released.set()
        if self.metrics is not None:
            self.metrics.drain_released(room)
        self._run_on_release(room)
        self._forget(room)

    def _run_on_release(self, room: _Room) -> None:
        callback, room.on_release = room.on_release, None
        if callback is not None and room.pages is not None:
            try:
                callback()
            except Exception:
                log.exception("room %d: on_release raised", room.room)

    def _forget(self, room: _Room) -> None:
        if self._rooms.get(room.room) is room:
            del self._rooms[room.room]
        for rank in room.sources:
            rank.rooms.discard(room.room)

    def _succeed(self, room: _Room) -> None:
        assert room.book is not None
        if room.book.cell.advance(KVPoll.Success):
            self.counters.bump("succeeded")
            room.terminal.set()
            self._forget(room)

    def _aux_matches(self, room: _Room) -> bool:
        return read_aux_stamp(self.pool, room.aux_slot) == (room.room, room.epoch)

    # ------------------------------------------------------------------ deadlines

    def _waiting_due(self, room: _Room) -> None:
        if room.book is not None and not room.book.cell.terminal:
            self.counters.bump("timeouts")
            self._fail_and_drain(
                room,
                TransferAborted(
                    f"room {room.room}: not done within {self.config.waiting_timeout:g} s "
                    "(waiting timeout)"
                ),
            )

    def _ack_due(self, room: _Room) -> None:
        """Acks are late. Report; re-ask; free only under the configured policy."""
        if room.released.is_set() or room.book is None:
            return
        self.counters.bump("timeouts")
        if self.config.release_policy == "timeout":
            room.book.acked |= room.book.contacted
            self.counters.bump("released_by_timeout")
            self._maybe_release(room)
            return
        self._send_aborts(room)
        assert self._nursery is not None
        for rank in room.sources:
            if rank.tp_rank not in room.book.acked:
                self._nursery.start_soon(self._probe_writer, room, rank)
        self.timers.after(self.config.ack_timeout, partial(self._ack_due, room))

    async def _probe_writer(self, room: _Room, rank: _PrefillRank) -> None:
        """If the writer's engine is provably gone, its writes are over: count its ack."""
        alive = True
        with trio.move_on_after(self.config.ack_timeout):
            alive = await trio.to_thread.run_sync(
                self.engine.probe, rank.session, limiter=self._probe_limiter
            )
        if not alive and room.book is not None and not room.released.is_set():
            room.book.acked.add(rank.tp_rank)
            if room.book.drained and room.book.take_release():
                self.counters.bump("released_peer_gone")
                self._release(room)

    # ------------------------------------------------------------------ instances and peers

    async def _resolve(self, inst: _Instance) -> None:
        """Find the instance's topology and register with the ranks we read from."""
        try:
            async with BootstrapClient(inst.url) as client:
                with trio.fail_after(self.config.bootstrap_timeout):
                    topo = await client.wait_topology()
            inst.sources = [self._register_with(topo, p) for p in self._source_ranks(topo)]
        except (BootstrapError, trio.TooSlowError, ProtocolError, OSError) as exc:
            error = BootstrapError(f"prefill instance {inst.url}: {exc}")
            log.warning("%s", error)
            if self._instances.get(inst.url) is inst:
                del self._instances[inst.url]
            for room in [r for r in self._rooms.values() if r.instance is inst]:
                self._fail_and_drain(room, error)
                if room.pages is not None:
                    self._release(room)  # no prefill rank was ever told about these pages
                else:
                    self._forget(room)
            await trio.lowlevel.checkpoint()
            return
        inst.ready = True
        waiting, inst.waiting = inst.waiting, []
        for room in waiting:
            if room.book is None:
                # also rooms already failed and forgotten here: their prefill ranks must hear
                # the ABORT, or their senders would wait for the bootstrap deadline
                self._bind(room)

    def _source_ranks(self, topo: Topology) -> range:
        first = topo.ranks[0]
        if first.engine != self.engine.name:
            raise ProtocolError(f"prefill uses engine {first.engine!r}, we {self.engine.name!r}")
        if first.layout != self.pool.layout:
            raise ProtocolError(f"prefill layout {first.layout}, ours {self.pool.layout}")
        return source_ranks(self.tp_rank, topo.tp_size, self.tp_size)

    def _register_with(self, topo: Topology, p: int) -> _PrefillRank:
        info = topo.ranks[p]
        rank = self._ranks.get(info.endpoint)
        if rank is not None and rank.session == info.engine_session and not rank.lost:
            return rank
        rank = _PrefillRank(
            info.endpoint,
            info.tp_rank,
            info.engine_session,
            next(self._ping_ids),
            info.heartbeat_endpoint or info.endpoint,
        )
        self._ranks[info.endpoint] = rank
        msg = _wire.Register(
            v=_wire.WIRE_VERSION,
            endpoint=self.endpoint,
            decode_rank=self.tp_rank,
            decode_tp=self.tp_size,
            engine=self.engine.name,
            session=self.engine.session_id,
            engine_meta=self.engine.metadata(),
            pool=_wire.PoolWire.from_spec(self.pool),
        )
        if not self.control.send_nowait(info.endpoint, msg):
            raise ProtocolError(f"prefill rank {p} at {info.endpoint} is not reading")
        return rank

    async def _heartbeat(self) -> None:
        """Ping every prefill rank we use; one that leaves ``heartbeat_misses`` pings in a row
        unanswered is lost, and its rooms fail (they still wait for its drain, or for proof
        that it is gone). Misses are counted in pings, not seconds, so a stall of this process
        (a pong waiting unread) costs at most one miss."""
        while True:
            await trio.sleep(self.config.heartbeat_interval)
            for rank in list(self._ranks.values()):
                if rank.lost:
                    continue
                if rank.unanswered >= self.config.heartbeat_misses:
                    self._lose(rank)
                    continue
                rank.unanswered += 1
                ping = _wire.Ping(
                    v=_wire.WIRE_VERSION,
                    nonce=rank.ping_id,
                    endpoint=self.control.heartbeat_endpoint,
                )
                self.control.send_nowait(rank.heartbeat_endpoint, ping)

    def _lose(self, rank: _PrefillRank) -> None:
        rank.lost = True
        self.counters.bump("peers_lost")
        if self._ranks.get(rank.endpoint) is rank:
            del self._ranks[rank.endpoint]
        self.control.forget(rank.endpoint)
        self.control.forget(rank.heartbeat_endpoint)
        for url, inst in list(self._instances.items()):
            if rank in inst.sources:
                del self._instances[url]  # the next receiver re-resolves the instance
        error = PeerLost(f"prefill rank {rank.tp_rank} at {rank.endpoint} stopped answering")
        for room_id in list(rank.rooms):
            room = self._rooms.get(room_id)
            if room is not None and room.book is not None and rank.tp_rank in room.book.succeeded:
                continue  # it delivered its part and will write nothing more
            if room is not None:
                self._fail_and_drain(room, error)
                assert self._nursery is not None
                self._nursery.start_soon(self._probe_writer, room, rank)

    # ------------------------------------------------------------------ control messages

    def _handle(self, msg: _wire.Message, pages: npt.NDArray[np.int32] | None) -> None:
        if isinstance(msg, _wire.Status):
            self._on_status(msg)
        elif isinstance(msg, _wire.AbortAck):
            self._on_ack(msg)
        elif isinstance(msg, _wire.Pong):
            for rank in self._ranks.values():
                if rank.ping_id == msg.nonce:
                    rank.unanswered = 0
        else:
            raise ProtocolError(f"decode does not take {type(msg).__name__}")

    def _room_for(self, room_id: int, epoch: int) -> _Room | None:
        room = self._rooms.get(room_id)
        if room is None or room.epoch != epoch or room.book is None:
            self.counters.bump("late_messages")  # I4: a late message for another use of the room
            return None
        return room

    def _on_status(self, msg: _wire.Status) -> None:
        room = self._room_for(msg.room, msg.epoch)
        if room is None:
            return
        book = room.book
        assert book is not None
        if msg.rank not in book.required:
            raise ProtocolError(f"room {msg.room}: STATUS from rank {msg.rank}, not a source")
        if not msg.ok:
            self._fail_and_drain(
                room, RemoteFailure(f"prefill rank {msg.rank}: {msg.reason}"), propagated=True
            )
            return
        book.on_status(msg.rank, True)
        if book.all_succeeded and not book.cell.terminal:
            if self._aux_matches(room):
                self._succeed(room)
            else:
                self._fail_and_drain(
                    room, ProtocolError(f"room {room.room}: aux row does not carry this epoch")
                )
        # after an abort, a rank's Success proves its drain (DecodeBook.drained) and may be
        # the last proof the held pages wait for
        self._maybe_release(room)

    def _on_ack(self, msg: _wire.AbortAck) -> None:
        room = self._room_for(msg.room, msg.epoch)
        if room is None:
            return
        assert room.book is not None
        self.counters.bump("acks_received")
        room.book.on_ack(msg.rank)
        self._maybe_release(room)

    def _shutdown_rooms(self) -> None:
        """The engine no longer accepts writes into our memory (it is deregistered): whatever
        is still held can go back."""
        for room in list(self._rooms.values()):
            if room.status not in (KVPoll.Success, KVPoll.Failed):
                if room.book is not None:
                    room.book.cell.fail(TransferAborted("decode agent closed"))
                room.terminal.set()
            if (
                room.pages is not None
                and not room.released.is_set()
                and (room.book is None or room.book.cell.status is KVPoll.Failed)
            ):
                self._release(room)


@asynccontextmanager
async def open_decode(
    *,
    engine: TransferEngine,
    pool: PoolSpec,
    tp_rank: int = 0,
    tp_size: int = 1,
    host: str = "127.0.0.1",
    config: DecodeConfig | None = None,
    metrics: AgentMetrics | None = None,
) -> AsyncIterator[DecodeAgent]:
    """Run a decode rank: register ``pool`` with ``engine``, bind the control socket, and serve
    until the block exits. On exit the memory is deregistered first (so no late write can land)
    and only then are pages still held handed back.

    **Cancellation:** cancelling the enclosing scope closes the agent as above.
    """
    config = config or DecodeConfig()
    agent = DecodeAgent(
        engine=engine, pool=pool, tp_rank=tp_rank, tp_size=tp_size, host=host, config=config
    )
    if metrics is not None:
        metrics.attach(agent)  # sets agent.metrics; exports statistics() at scrape time
    regions = pool.regions()
    try:
        await trio.to_thread.run_sync(engine.register, regions)
        async with trio.open_nursery() as nursery:
            agent._nursery = nursery
            nursery.start_soon(agent.control.serve, agent._handle)
            nursery.start_soon(agent.timers.run)
            nursery.start_soon(agent._heartbeat)
            try:
                yield agent
            finally:
                nursery.cancel_scope.cancel("decode agent closing")
    finally:
        agent._nursery = None
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await trio.to_thread.run_sync(engine.unregister, regions)
            agent._shutdown_rooms()
            await agent.control.aclose()
