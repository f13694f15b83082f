"""The prefill agent: a facade that wires the parts of a prefill rank together.

* :class:`~trio_pd.core._rooms.PrefillRoom` (one per room) decides everything about a room;
  :class:`~trio_pd.core._tables.PrefillRooms` holds the rooms and decides what arrives at their
  edge: TRANSFERs and ABORTs for rooms this rank does not hold, and every room deadline.
  Both are pure: they return what is due.
* :class:`~trio_pd.agents._chunks.ChunkRunner` runs a chunk's engine calls in one nursery,
  inside the room's cancel scope (SPEC §5.1, §5.2).
* :class:`~trio_pd.agents._peers.PeerRegistry` holds the decode peers and their lanes; its
  :class:`~trio_pd.agents._peer_probes.PeerProbes` their failed marks, and its
  :class:`~trio_pd.agents._quarantine.Quarantines` the quarantine fences (three-valued
  liveness, §5.6).
* :class:`~trio_pd.io._outbox.Outbox` carries every message that must arrive (acks, Failed
  STATUS): one retry policy, bounded.

This module does the I/O the machines ask for (:meth:`PrefillAgent._carry`) and nothing
else: the worker tasks, publication (§5.4), the listener's dispatch, and the one
timers task that hands each deadline the table armed back to it.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import TYPE_CHECKING, Literal, cast

import numpy as np
import numpy.typing as npt
import trio
import trio.lowlevel
import trio_util

from ..bootstrap._bootstrap_client import (
    BootstrapClient,
    DpAnnouncer,
    PrefillRankInfo,
    check_dp,
    check_pp,
)
from ..core import _wire
from ..core._config import check_count, check_seconds
from ..core._errors import (
    AuthenticationError,
    ConfigurationError,
    ProtocolError,
    TransferAborted,
    TransferError,
    one_error,
)
from ..core._memory import (
    PoolSpec,
    as_index,
    check_aux_slot,
    check_num_pages,
)
from ..core._rooms import (
    Arm,
    CancelWork,
    Chunk,
    Count,
    Due,
    Effect,
    Failed,
    Forget,
    PeerPool,
    PrefillRoom,
    PublishDue,
    Quarantine,
    Refused,
    Reject,
    Release,
    RunChunks,
    SendAck,
    SendFailed,
    Succeeded,
)
from ..core._state import KVPoll, Lease, Outcome
from ..core._stats import AgentStatistics, Counters, count_room_end
from ..core._tables import (
    DecodePeerView,
    IdDeadline,
    PrefillDeadlines,
    PrefillRooms,
    RoomDeadline,
)
from ..core._topology import model_kv_heads, served_decode_ranks
from ..engines import TransferEngine, join_bytes
from ..io import _descriptors, _names
from ..io._control import ControlPlane, sweep_idle_sockets
from ..io._outbox import Outbox
from ..io._security import Keypair, Security, check_register_mac, resolve
from ..io._timers import Timer, Timers
from ._chunks import ChunkRunner
from ._close import bounded, unregister, wait_probe_threads
from ._handle import RoomHandle
from ._jobs import JobQueues
from ._lazy import LazyEvent
from ._peers import PeerRegistry
from ._service import serve, serve_nursery

if TYPE_CHECKING:
    from ..metrics import AgentMetrics

log = logging.getLogger("trio_pd.prefill")

#: a target's endpoint (the job queues' key is the tuple of a room's)
_ENDPOINT = attrgetter("endpoint")

#: why a closing agent fails the rooms it still holds (and tells their decode ranks)
CLOSED = "prefill agent closed"


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Knobs of a prefill agent. Deadlines are in seconds. Each knob's type and range is
    checked by ``open_prefill`` before anything starts (:meth:`check`): a bad one is a
    :class:`~trio_pd.ConfigurationError` naming it."""

    #: tasks that take admitted chunks (and rooms due to publish their outcome) off the
    #: agent's queues, per destination: at most this many rooms' chunks to the same decode
    #: peers are being written at once, and a peer that stops reading holds up only the
    #: rooms that write to it
    workers: int = 8
    #: writes to one decode peer that may be in flight at once (started, not yet waited for):
    #: 2 keeps the engine's queue fed while the lane waits for the oldest
    inflight_per_peer: int = 2
    #: a room's chunks queued behind the one a worker takes join its engine call, up to this
    #: many pages in all (1: one call per chunk). Only a backlog coalesces; a lone chunk goes
    #: as it is. An aborted room waits for at most one such call (docs/bench.md: what it buys)
    coalesce_pages: int = 64
    #: chunks of several rooms queued at once for the same decode peer join one engine call,
    #: up to this many blocks (0: one call per chunk) and ``batch_bytes`` bytes in all. Only
    #: what is already queued joins; a failure of the shared call fails each room in it
    #: (docs/lifetimes.md). How large the writes may be is the engine's call: see
    #: ``batch_bytes``
    batch_blocks: int = 1024
    #: the bytes one such shared engine call may carry in all (see ``batch_blocks``); None:
    #: what the engine says it is best given (:func:`trio_pd.engines.join_bytes`: 32 MiB for
    #: NIXL, 1 MiB for Mooncake, whose transport finishes a joined call's rooms together)
    batch_bytes: int | None = None
    #: host memory for gathering head slices for decode ranks of a larger TP (MHA, host
    #: pools), so each destination page goes as one block instead of one per token slot;
    #: allocated and registered the first time it is needed (0: never stage). A chunk that
    #: finds it full is written in place (``staging_full``). docs/topologies.md
    staging_bytes: int = 64 << 20
    #: raise the lanes' threads' nice value by this much (Linux; 0: leave them), so that on a
    #: host whose cores are all busy the event loop preempts threads waiting on engine calls
    lane_nice: int = 10
    #: a room whose decode metadata has not arrived by then fails (it frees nothing); and
    #: how long ``open_prefill`` retries a bootstrap service it cannot reach (it may start
    #: later): past it, :class:`~trio_pd.BootstrapError` with the reason
    bootstrap_timeout: float = 30.0
    #: how long after an engine error its pages stay quarantined before its peers are
    #: probed; None: the engine's own per-call deadline (``write_deadline_s``) plus a margin
    quarantine_fence: float | None = None
    #: how long a closing agent keeps serving (control socket open: PONGs, ABORTs, drain
    #: acks) while rooms still hold quarantined leases, so that their fences can end and
    #: decode gets its acks; None: twice ``quarantine_fence`` plus one second. Rooms still
    #: quarantined then are counted (``rooms_unacked_at_close``) and get no ack
    close_timeout: float | None = None
    #: how long an ABORT for a (room, epoch) this rank does not hold refuses its TRANSFER
    tombstone_ttl: float = 120.0
    #: ZeroMQ send high-water mark of each PUSH socket (messages queued per peer); a send
    #: that finds it reached counts ``send_backpressure`` instead of blocking
    sndhwm: int = 10_000
    #: bounded queue of TRANSFER metadata for rooms the scheduler has not created yet
    max_pending_meta: int = 100_000
    #: and at most this many page ids in all (4 bytes each: 64 MiB)
    max_pending_page_ids: int = 16 * 1024 * 1024
    #: a message that must arrive (a Failed STATUS, an ack) and finds the decode peer's socket
    #: full is retried for this long, then dropped and counted (``outbox_dropped``)
    failed_status_retry: float = 60.0
    #: PUSH sockets open at once (one per endpoint we answer: decode peers, and the reply
    #: address of any PING or ABORT); past it the least recently used is closed
    #: (``sockets_evicted``). Stay below libzmq's 1023 sockets per context
    max_peer_sockets: int = 512
    #: a PUSH socket nobody sent on for this long is closed by a periodic sweep
    peer_socket_idle: float = 300.0
    #: decode peers registered at once; past it a REGISTER replaces one proven gone or idle
    #: for ``peer_idle_timeout`` (``peers_evicted``), or is refused (``peers_refused``)
    max_decode_peers: int = 1024
    #: how long a registered decode peer must have been unused (no lookup, no engine call,
    #: probe or quarantine) before a new REGISTER may replace it when ``max_decode_peers``
    #: are held
    peer_idle_timeout: float = 300.0

    def check(self, what: str) -> None:
        """Raise :class:`~trio_pd.ConfigurationError` naming the first knob of the wrong type
        or out of its range, and its value: deadlines are seconds (an int or a float,
        infinity allowed) ``>= 0`` (``peer_socket_idle``: ``> 0``; ``quarantine_fence`` and
        ``close_timeout`` may be None); counts and sizes are ints (not bools): ``workers``,
        ``inflight_per_peer``, ``coalesce_pages``, ``max_pending_meta``,
        ``max_pending_page_ids``, ``max_peer_sockets`` and ``max_decode_peers`` ``>= 1``;
        ``batch_blocks``, ``batch_bytes`` (or None), ``staging_bytes``, ``lane_nice`` and
        ``sndhwm`` (0: ZeroMQ's no limit) ``>= 0``. ``open_prefill`` calls it before anything
        starts."""
        for name in ("workers", "inflight_per_peer", "coalesce_pages", "max_pending_meta",
                     "max_pending_page_ids", "max_peer_sockets", "max_decode_peers"):
            check_count(what, name, getattr(self, name), 1)
        for name in ("batch_blocks", "staging_bytes", "lane_nice", "sndhwm"):
            check_count(what, name, getattr(self, name), 0)
        if self.batch_bytes is not None:
            check_count(what, "batch_bytes", self.batch_bytes, 0)
        for name in ("bootstrap_timeout", "tombstone_ttl", "failed_status_retry",
                     "peer_idle_timeout"):
            check_seconds(what, name, getattr(self, name))
        for name in ("quarantine_fence", "close_timeout"):
            check_seconds(what, name, getattr(self, name), optional=True)
        check_seconds(what, "peer_socket_idle", self.peer_socket_idle, positive=True)


_Job = Literal["chunk", "publish"]


@dataclass(eq=False, slots=True)
class _Room:
    """The trio side of one room: what the pure machine must not hold."""

    machine: PrefillRoom
    on_release: Callable[[], None] | None
    #: cancel scopes of the room's chunks that are running (an abort cancels them)
    scopes: dict[trio.CancelScope, None] = field(default_factory=dict)
    terminal: LazyEvent = field(default_factory=LazyEvent)
    released: LazyEvent = field(default_factory=LazyEvent)
    #: metrics attached only: the ``time.perf_counter()`` the room's transfer latency runs
    #: from, its creation until the first ``send()`` (``sent``) moves it there, once
    started: float | None = None
    sent: bool = False
    #: DP attention: the (room, epoch) announced for this use, forgotten when it ends
    announced: tuple[int, int | None] | None = None
    #: a chunk of it rode in an engine call that raised (counted ``rooms_in_failed_calls``)
    in_failed_call: bool = False
    #: a "chunk" job for it waits in the workers' queue: set when one is queued, cleared
    #: when a worker takes it. While the room has queued chunks, one such job is queued or
    #: being taken (the worker that takes it queues the next if chunks remain): one worker
    #: wake-up per engine call, not one per chunk that coalescing then finds gone
    chunk_job: bool = False
    #: the room's deadlines armed (cancelled when it is forgotten: they hold the record)
    timers: list[Timer] = field(default_factory=list)


def layer_range(layers: range | None) -> tuple[int, int] | None:
    """``send``'s ``layers`` as ``(a, b)``; :class:`ProtocolError` unless a non-empty range
    of step 1 (the pool's bounds are the room machine's check)."""
    if layers is None:
        return None
    if not isinstance(layers, range) or layers.step != 1 or len(layers) == 0:
        raise ProtocolError(f"layers must be a non-empty range of step 1, got {layers!r}")
    return layers.start, layers.stop


class PrefillSender(RoomHandle["PrefillAgent", _Room]):
    """The scheduler's handle for one room on a prefill rank (≈ SGLang's ``KVSender``).

    Create with :meth:`PrefillAgent.sender`. Hand chunks over with :meth:`send`; the last one
    (``last=True``) also carries the aux row. The room's source pages belong to trio_pd from
    the first ``send`` until ``on_release`` runs (exactly once, when nothing can read them),
    whatever the outcome: Success or failure, seen or not.

    ``async with`` the handle holds the room for the block: leaving the block before the
    room ended aborts it, however the block ends (an exception, a cancellation landing at any
    await, a return); ``on_release`` then runs once no engine call can still read the pages.
    """

    @property
    def failure(self) -> TransferError | None:
        """Why the room failed (None unless Failed)."""
        return self._room.machine.cell.failure

    def send(
        self,
        pages: npt.ArrayLike,
        *,
        layers: range | None = None,
        last: bool = False,
        state_slots: Sequence[npt.ArrayLike] | None = None,
    ) -> None:
        """Admit the next chunk: ``pages`` are source page ids, in request order. Non-blocking.

        ``layers`` (layer-wise streaming, docs/layerwise.md): ``range(a, b)`` of the pool's
        layers (with pipeline stages, the stage's own: its layer 0 is ``first_layer``) says
        only those layers of ``pages`` are ready; they are written while the model computes
        the next. Each layer's pages go in request order, and a send's layers must all be at
        the same request page: the chunk is those layers of the request's next pages for
        them. Each layer of a page is admitted once. Left out: every layer.

        ``last=True`` marks the request's last send: after it every layer of every page must
        have been admitted. The aux row and the state slots go with it, so decode can see
        Success only once every layer of every page has landed.

        ``state_slots``, with the last chunk of a pool with state components
        (:class:`~trio_pd.StateSpec`): this rank's slots of each component for the request,
        one list per component, in the order decode names its own (slot ``i`` goes to
        decode's slot ``i``). They are the room's from then on, like its pages, until
        ``on_release``. Left out, the request has no slots of any component.

        Raises :class:`~trio_pd.AdmissionClosed` if the room was aborted or failed, and
        :class:`ProtocolError` (counted ``sends_refused``; the room is unchanged) for page
        ids outside the pool, a chunk past ``num_pages``, state slots that do not fit the
        pool's components (or come before the last chunk), a ``layers`` that is not a range
        of the pool's layers, a layer of a page admitted a second time, or a last send that
        leaves some layer of some page unadmitted.
        """
        room, agent = self._room, self._agent
        try:
            due = room.machine.admit(  # (checks and copies the pages: one intake check)
                pages, last, state_slots, None if layers is None else layer_range(layers)
            )
        except ProtocolError:
            agent.counters.bump("sends_refused")
            raise
        if not room.sent and agent.metrics is not None:
            room.sent, room.started = True, time.perf_counter()
        if due:  # (a chunk that waits for decode's metadata makes nothing due)
            agent._carry(room, due)

    def abort(self, reason: str = "aborted by the prefill scheduler") -> None:
        """Abort the room: close admission, cancel work not yet started, publish Failed.
        Engine calls already running finish; ``on_release`` runs once they have. Idempotent."""
        self._agent._carry(self._room, self._room.machine.close(TransferAborted(reason)))

    # -------------------------------------------------------------- for the facades

    def _status(self) -> KVPoll:
        """:meth:`poll` (a sender's outcome decides nothing about its pages)."""
        return self._room.machine.cell.status

    def _leave(self, why: str) -> None:
        if self._status() not in (KVPoll.Success, KVPoll.Failed):
            self.abort(f"the room's async with block was left before the room ended{why}")

def _raise_reject(due: Due) -> None:
    """Raise the error of a :class:`Reject` the table put last in ``due``. It is popped off
    the list first, and the caller holds no name for it: a frame in the error's traceback
    that still referred to it would make a cycle, and keep a refused TRANSFER's page ids
    (up to 16 MiB) alive until the garbage collector ran."""
    if due and isinstance(due[-1], Reject):
        raise cast(Reject, due.pop()).error


class PrefillAgent:
    """One prefill rank. Make one with :func:`open_prefill`."""

    #: DP attention (``open_prefill(dp_rank=, dp_size=)``): the DP rank this rank's TP group
    #: is, and how many the instance has
    dp_rank: int = 0
    dp_size: int = 1
    #: with ``dp_size > 1``, on TP rank 0 of the DP rank: tells the bootstrap service that
    #: this DP rank holds each room :meth:`sender` creates (None otherwise)
    dp_announcer: DpAnnouncer | None = None
    #: pipeline parallelism (``open_prefill(pp_rank=, pp_size=, first_layer=)``): this rank's
    #: PP stage, how many the instance has, and the model layer its pool's layer 0 is
    pp_rank: int = 0
    pp_size: int = 1
    first_layer: int = 0

    def __init__(
        self,
        *,
        engine: TransferEngine,
        pool: PoolSpec,
        tp_rank: int,
        tp_size: int,
        kv_heads: int,
        host: str,
        config: PrefillConfig,
        control: ControlPlane | None = None,
        metrics: AgentMetrics | None = None,
        security: Security | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        first_layer: int = 0,
    ) -> None:
        self.metrics = metrics  # prometheus hooks (trio_pd.metrics), optional
        self.engine, self.pool, self.config = engine, pool, config
        self.tp_rank, self.tp_size, self.kv_heads = tp_rank, tp_size, kv_heads
        self.pp_rank, self.pp_size, self.first_layer = pp_rank, pp_size, first_layer
        self.counters, self.timers = Counters(), Timers()
        self._deadline_passed = self._timer_due  # (one bound method for every deadline)
        #: authentication (docs/security.md); off unless open_prefill turned it on
        self.security = security or Security(curve=False, token=None)
        self.control = control or ControlPlane(
            host, self.counters, sndhwm=config.sndhwm, max_peers=config.max_peer_sockets,
            keys=Keypair.generate() if self.security.curve else None,
        )
        self.outbox = Outbox(
            lambda *send: self.control.send_nowait(*send), self.timers, self.counters,
            give_up_after=config.failed_status_retry,
        )
        sweep_idle_sockets(self.timers, self.control, config.peer_socket_idle)
        #: the messages from and to decode ranks; ``_handle`` is the listener's dispatch, and
        #: the handlers it calls are the agent's attributes (wrapped in place by tests)
        self.wire = PrefillWire(self)
        fence = config.quarantine_fence
        if fence is None:
            fence = float(getattr(engine, "write_deadline_s", 10.0)) + 1.0
        self.peers = PeerRegistry(
            engine=engine, pool=pool, tp_rank=tp_rank, tp_size=tp_size, kv_heads=kv_heads,
            inflight_per_peer=config.inflight_per_peer, lane_nice=config.lane_nice,
            fence=fence, counters=self.counters, timers=self.timers,
            batch_blocks=config.batch_blocks,
            batch_bytes=join_bytes(engine) if config.batch_bytes is None else config.batch_bytes,
            forget_endpoint=self.wire.forget_endpoint,
            max_peers=config.max_decode_peers, peer_idle=config.peer_idle_timeout,
            pp_rank=pp_rank, pp_size=pp_size, first_layer=first_layer,
        )
        self.runner = ChunkRunner(
            engine=engine, pool=pool, peers=self.peers, counters=self.counters,
            metrics=lambda: self.metrics, staging_bytes=config.staging_bytes,
        )
        self._closing = False  # set by _shutdown_rooms
        #: quarantined leases of every room: a closing agent waits for them (_wait_quarantines)
        self.quarantines = trio_util.AsyncValue(0)
        #: the rooms, what arrives for rooms not held, and every room deadline (pure)
        self.table: PrefillRooms[_Room] = PrefillRooms(
            PrefillDeadlines(bootstrap=config.bootstrap_timeout, tombstone=config.tombstone_ttl),
            max_rooms=config.max_pending_meta, max_page_ids=config.max_pending_page_ids,
        )
        #: chunk and publication jobs, queued per destination (a stalled peer holds up only
        #: the rooms that write to it) and run by at most ``config.workers`` tasks each
        self.workers = PrefillWorkers(self)
        self.jobs = JobQueues[tuple[_Room, _Job]](self.workers.run_job, config.workers)
        self._token = trio.lowlevel.current_trio_token()
        self._handle, self._handle_closing = self.wire.handle, self.wire.handle_closing
        self._on_transfer, self._on_abort = self.wire.on_transfer, self.wire.on_abort

    @property
    def _rooms(self) -> dict[int, _Room]:
        return self.table.rooms

    # ------------------------------------------------------------------ public API

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint (ZeroMQ)."""
        return self.control.endpoint

    @property
    def rank_id(self) -> int:
        """This rank's id in STATUS, ABORT_ACK and PONG: ``pp_rank * tp_size + tp_rank``
        (the TP rank, without pipeline parallelism: the single-stage wire is unchanged)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def sender(
        self,
        room: int,
        *,
        num_pages: int,
        aux_slot: int,
        on_release: Callable[[], None] | None = None,
        epoch: int | None = None,
    ) -> PrefillSender:
        """Create the handle for ``room``: ``num_pages`` source pages will be sent in chunks,
        and aux row ``aux_slot`` with the last one. ``on_release`` runs exactly once, when the
        room is over and no engine call can still read its pages.

        ``epoch``, when the scheduler knows it (the router chose it, and passed the same value
        to the decode side's ``receiver(epoch=...)``), tells this use of the room from earlier
        ones before decode's metadata arrives: an ABORT for it then fails the room at once. Left
        out, the use learns its epoch from its first TRANSFER, and an ABORT that comes before
        that is treated as one for another use of the room (acked, the room left alone: a late
        ABORT of an old use must not kill this one); the room then fails at its bootstrap
        deadline if no TRANSFER follows."""
        room = as_index(room, "room")
        if room in self.table.rooms:
            raise TransferError(f"room {room} is still in use on prefill rank {self.tp_rank}")
        pool = self.pool
        aux_slot = check_aux_slot(aux_slot, pool.aux_slots)
        num_pages = check_num_pages(num_pages)
        machine = PrefillRoom(
            room, num_pages, aux_slot, pool.num_pages,
            tuple(st.slots for st in pool.states) if pool.states else (), epoch=epoch,
            num_layers=pool.num_layers,
        )
        rec = _Room(machine, on_release)
        if self.metrics is not None:
            rec.started = time.perf_counter()
        if self.dp_announcer is not None:  # DP attention: decode routes the room by this
            self.dp_announcer.announce(room, epoch)
            rec.announced = (room, epoch)
        self._carry(rec, self.table.open(rec, self.wire.peer_view))
        return PrefillSender(self, rec)

    def decode_metadata(self, room: int, epoch: int | None) -> KVPoll:
        """What decode has said so far about a room this rank has not created yet (no
        :meth:`sender` for it): WaitingForInput once every decode rank this rank writes to
        has sent its metadata for that use of the room (parked until :meth:`sender`),
        Bootstrapping before, Failed if decode already aborted it. Read-only; for a
        scheduler that holds a request back until decode has reserved its pages (SGLang's
        bootstrap queue). A room this rank holds answers its own status."""
        return self.table.decode_metadata(room, epoch, self.wire.peer_view)

    def statistics(self) -> AgentStatistics:
        rooms = [r.machine for r in self._rooms.values()]
        return self.counters.snapshot(
            rooms_active=len(rooms),
            leases_live=sum(len(m.leases.live) for m in rooms),
            leases_quarantined=sum(len(m.leases.quarantined) for m in rooms),
        )

    # ------------------------------------------------------------------ doing what is due

    def _carry_at(self, room: int, due: Due) -> None:
        """Carry out what the table made due for ``room``, held here or not."""
        rec = self._rooms.get(room)
        if rec is not None:
            self._carry(rec, due)
            return
        effect: Effect | None = None
        for effect in due:
            self._carry_one(room, effect)
        effect = None  # (no name for a Reject's error in this frame: _raise_reject)
        _raise_reject(due)

    def _carry_one(self, room: int, effect: Effect) -> None:
        """An effect that needs no room record: what the table decides about a (room, epoch)
        this rank may not hold, and the timers and counts of any room."""
        match effect:
            case SendAck(endpoint=endpoint, epoch=epoch):
                self.wire.send_ack(room, epoch, endpoint)
            case SendFailed(endpoint=endpoint, epoch=epoch, reason=reason):
                self.wire.send_failed(room, epoch, endpoint, reason)
            case Arm(after=after, key=key):
                self.timers.after(after, self._deadline_passed, key)
            case Count(name=name):
                self.counters.bump(name)
            case Refused(error=error):
                self.counters.bump("refused_messages")
                log.warning("room %d: refused a TRANSFER: %s", room, error)
            case Reject():
                pass  # (raised by the caller once the rest is carried out: _raise_reject)
            case _:
                raise AssertionError(f"prefill cannot do {effect!r} (room {room})")

    def _timer_due(self, key: Hashable) -> None:
        """A deadline the table armed has passed: it decides what that means."""
        due = self.table.handle_timer(key)
        match key:
            case RoomDeadline(rec=rec):
                self._carry(rec, due)
            case IdDeadline(room=room):  # (a parked TRANSFER's senders are told Failed)
                self._carry_at(room, due)

    def _carry(self, rec: _Room, due: Due, *, in_worker: bool = False) -> None:
        """Carry out what a room machine made due. Synchronous: it never waits."""
        room = rec.machine.room
        effect: Effect | None = None
        for effect in due:
            match effect:  # (the success path's effects first: fewer checks)
                case RunChunks():
                    if not rec.chunk_job:
                        rec.chunk_job = True
                        self.workers.queue(rec, "chunk")
                case PublishDue():
                    if not in_worker:  # (a worker publishes inline, after its chunk)
                        self.workers.queue(rec, "publish")
                case Succeeded():
                    count_room_end(self.counters, self.metrics, rec.started)
                    rec.terminal.set()
                case Release():
                    if not self._closing:  # (closing: close_staging keeps what is held)
                        self.runner.planner.staging.release_held(rec.machine)
                    if rec.on_release is not None:
                        try:
                            rec.on_release()
                        except Exception:
                            log.exception("room %d: on_release raised", room)
                    rec.released.set()
                case Forget():
                    if rec.announced is not None and self.dp_announcer is not None:
                        self.dp_announcer.forget(*rec.announced)  # (a reuse is announced)
                    self.timers.cancel_all(rec.timers)  # (its deadlines let it go now)
                    self._carry(rec, self.table.forget(rec))
                case CancelWork(reason=reason):
                    for scope in list(rec.scopes):
                        scope.cancel(reason)
                case Failed(error=error):
                    count_room_end(self.counters, self.metrics, rec.started, error)
                    rec.terminal.set()
                case Quarantine(lease=lease):
                    self.workers.quarantine(rec, lease)
                case Arm(after=after, key=key) if type(key) is RoomDeadline and key.rec is rec:
                    rec.timers.append(self.timers.after(after, self._deadline_passed, key))
                case _:
                    self._carry_one(room, effect)
        effect = None  # (no name for a Reject's error in this frame: _raise_reject)
        if due and isinstance(due[-1], Reject):  # (the check inline: most dues have none)
            _raise_reject(due)

    def _status(self, room: int, epoch: int, ok: bool, reason: str) -> _wire.Status:
        return _wire.Status(
            v=_wire.WIRE_VERSION, room=room, epoch=epoch, rank=self.rank_id, ok=ok,
            reason=reason,
        )

    async def _publish(self, rec: _Room) -> None:
        """Decide and publish the room's outcome, once (SPEC §5.4): ``PrefillRoom.publish``
        checks and sends in one synchronous step, so no abort can come in between. (A
        method of the agent, which its workers call: a subclass may replace it.)

        No schedule point when it publishes: its callers just had one (the chunk's engine
        call; a publish job's own checkpoint), and one here would only cost a task step. A
        cancelled worker (the agent closing) publishes nothing, as before: the close fails
        what is left."""
        room = rec.machine
        if not room.publish_due:
            await trio.lowlevel.checkpoint()  # a checkpoint on every path
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        self._carry(rec, room.publish(partial(self.wire.send_status_now, room.room)))

    # ------------------------------------------------------------------ shutdown

    def _say_goodbye(self) -> None:
        """Closing, once every engine call has returned, every failed write is proven over
        and the control socket is read no more: tell each registered decode rank (a BYE), so
        that it counts us drained for every room of ours, also those whose TRANSFER we will
        never read. An agent with a write not proven over says nothing: decode keeps those
        pages until it acks (it will not) or is proven gone. Best effort, like the STATUSes
        before it: ``aclose``'s linger delivers it."""
        bye = _wire.Bye(v=_wire.WIRE_VERSION, rank=self.rank_id, endpoint=self.endpoint)
        for peer in self.peers.all():
            self.control.send_nowait(peer.endpoint, bye)

    def _shutdown_rooms(self) -> None:
        """After every task (and so every engine call) has finished: tell the decode ranks
        still waiting on us, fail what is left, hand every source page back. TRANSFERs that
        came before any sender are answered too. Best effort: the sockets get ``aclose``'s
        linger to deliver it (a crash says nothing).

        Source pages go back, but not the staging ranges of failed calls: the engine may
        still read them, and the area stays allocated for the life of the process once any
        range is held (``ChunkPlanner.close_staging``)."""
        self._closing = True
        self.peers.quarantines.drop_fences()
        for room, rec, due in self.table.shutdown(CLOSED):
            if rec is None:
                self._carry_at(room, due)
            else:
                self._carry(rec, due)


class PrefillWorkers:
    """The jobs the agent's worker tasks run (:attr:`PrefillAgent.jobs`): a room's oldest
    queued chunks taken as one, run by the :class:`ChunkRunner`, settled into the room, and
    the room's outcome published (:meth:`PrefillAgent._publish`) once it is due; and a failed
    call's lease held in quarantine until its writes are proven over. At most one chunk job
    per room is queued at a time (``_Room.chunk_job``).
    """

    def __init__(self, agent: PrefillAgent) -> None:
        self.agent = agent

    def queue(self, rec: _Room, job: _Job) -> None:
        """Queue a room's job behind the jobs for the same decode peers only (see _jobs)."""
        # (map with attrgetter: no generator frame to start and resume, a call each)
        self.agent.jobs.put(tuple(map(_ENDPOINT, rec.machine.targets.values())), (rec, job))

    async def run_job(self, item: tuple[_Room, _Job]) -> None:
        """One job, in a task of :attr:`PrefillAgent.jobs` (a job with nothing left to do
        returns without a checkpoint: the task's next job, or its end, follows)."""
        rec, job = item
        if job == "publish":
            await trio.lowlevel.checkpoint()  # (publication itself has none: _publish)
            await self.agent._publish(rec)
            return
        rec.chunk_job = False
        taken = rec.machine.take_chunks(self.agent.config.coalesce_pages)
        if taken is None:
            return  # noqa: ASYNC910 (cancelled)
        if rec.machine.queued:  # more than one call's worth: the next worker takes it
            rec.chunk_job = True
            self.queue(rec, "chunk")
        chunk, joined = taken
        if joined:
            self.agent.counters.bump("chunks_coalesced", joined)
        settle = partial(self.settled, rec, chunk)
        await self.agent.runner.run(rec.machine, rec.scopes, chunk, settle)
        if rec.machine.publish_due:  # (most chunks are not a room's last: no extra round)
            await self.agent._publish(rec)

    def settled(
        self, rec: _Room, chunk: Chunk, outcome: Outcome, failure: TransferError | None
    ) -> None:
        self.agent._carry(rec, rec.machine.chunk_settled(chunk, outcome, failure), in_worker=True)

    def quarantine(self, rec: _Room, lease: Lease) -> None:
        """A failed call's lease (its writes may still land): held, and counted in
        :attr:`PrefillAgent.quarantines`, until the peer registry proves them over."""
        agent = self.agent
        agent.counters.bump("quarantined")
        if not rec.in_failed_call:
            rec.in_failed_call = True
            agent.counters.bump("rooms_in_failed_calls")
        agent.quarantines.value += 1
        peers = [p for t in rec.machine.targets.values() if (p := agent.peers.get(t.endpoint))]
        log.info("room %d: %d pages quarantined after a failed engine call (outcome unknown): "
                 "held until no write of it to %s can land", rec.machine.room, lease.npages,
                 ", ".join(p.endpoint for p in peers) or "its decode peers")
        agent.peers.quarantines.quarantine(lease, peers, partial(self.end_quarantine, rec, lease))

    def end_quarantine(self, rec: _Room, lease: Lease) -> None:
        agent = self.agent
        if lease in rec.machine.leases.quarantined:
            agent.counters.bump("released_after_quarantine")
            log.info("room %d: quarantine of %d pages ended: they go back", rec.machine.room,
                     lease.npages)
            agent.quarantines.value -= 1
            agent._carry(rec, rec.machine.end_quarantine(lease))

class PrefillWire:
    """What a prefill rank hears from its decode ranks and the messages it owes them: the
    intake of TRANSFER, ABORT, REGISTER and PING with the check of who sent them
    (authentication on), the decode peer as the room table sees it, and the ABORT_ACK and
    STATUS sends. The rooms are the agent's table; what a message makes due is carried by
    :meth:`PrefillAgent._carry`.
    """

    def __init__(self, agent: PrefillAgent) -> None:
        self.agent = agent
        #: keys of registered decode ranks whose PINGs were answered (bounded; see
        #: :meth:`authenticate`)
        self._ping_keys: dict[str, None] = {}

    def peer_view(self, endpoint: str) -> DecodePeerView | None:
        """What the table needs of the decode peer registered at ``endpoint``."""
        peer = self.agent.peers.get(endpoint)
        if peer is None:
            return None
        if peer.view is not None:  # (one per registration: a TRANSFER reads it, per room)
            return peer.view
        pool = PeerPool(peer.pool.num_pages, peer.pool.aux_slots,
                        tuple(st.slots for st in peer.pool.states),
                        0 if peer.landing is None else peer.landing.num_pages)
        served = tuple(served_decode_ranks(self.agent.tp_rank, self.agent.tp_size, peer.decode_tp))
        peer.view = DecodePeerView(
            peer.endpoint, peer.session, peer.decode_rank, peer.decode_tp, pool, served,
            peer.registration,
        )
        return peer.view

    def forget_endpoint(self, endpoint: str) -> None:
        """The peer registry dropped ``endpoint``: its pending sends and socket go too."""
        self.agent.outbox.forget(endpoint)
        self.agent.control.forget(endpoint)

    def send_ack(self, room: int, epoch: int, endpoint: str) -> None:
        ack = _wire.AbortAck(v=_wire.WIRE_VERSION, room=room, epoch=epoch, rank=self.agent.rank_id)
        self.agent.outbox.send(endpoint, ("ack", room, epoch), ack)
        self.agent.counters.bump("acks_sent")

    def send_failed(self, room: int, epoch: int, endpoint: str, reason: str) -> None:
        """A Failed STATUS that must arrive, to a registered decode rank only (a stray
        endpoint gets no socket of ours)."""
        if self.agent.peers.get(endpoint) is None:
            return
        status = self.agent._status(room, epoch, False, reason)
        self.agent.outbox.send(endpoint, ("status", room, epoch), status)

    def send_status_now(self, room: int, endpoint: str, epoch: int, ok: bool, reason: str) -> bool:
        """Publication's send: non-blocking, no retry (a refusal fails the room there)."""
        return self.agent.control.send_nowait(endpoint, self.agent._status(room, epoch, ok, reason))


    def handle(
        self, msg: _wire.Message, pages: npt.NDArray[np.int32] | None, sender: str | None = None
    ) -> None:
        """Dispatch one control message. ``sender`` is the CURVE key it came from (the
        listener passes it with authentication on); None is a trusted local call."""
        if sender is not None:
            self.authenticate(msg, sender)
        if isinstance(msg, _wire.Transfer):
            assert pages is not None
            self.agent._on_transfer(msg, pages)  # (through the agent: tests wrap it)
        elif isinstance(msg, _wire.Abort):
            self.agent._on_abort(msg)
        elif isinstance(msg, _wire.Register):
            self.agent.peers.register(msg, key=sender or "")
            if sender is not None:
                self.agent.control.authorize(msg.endpoint, sender)
        elif isinstance(msg, _wire.Ping):
            if sender is not None:  # decode's heartbeat socket serves with the same key
                self.agent.control.authorize(msg.endpoint, sender, reply=True)
            pong = _wire.Pong(v=_wire.WIRE_VERSION, nonce=msg.nonce, rank=self.agent.rank_id)
            self.agent.control.send_nowait(msg.endpoint, pong)
        else:
            raise ProtocolError(f"prefill does not take {type(msg).__name__}")

    def handle_closing(
        self, msg: _wire.Message, pages: npt.NDArray[np.int32] | None, sender: str | None = None
    ) -> None:
        """:meth:`_handle` for the messages still unread when the agent closes: a TRANSFER or
        an ABORT is taken (so :meth:`_shutdown_rooms` answers it: nothing of ours will write
        those pages), anything else is dropped."""
        if isinstance(msg, (_wire.Transfer, _wire.Abort)):
            self.handle(msg, pages, sender)

    def authenticate(self, msg: _wire.Message, sender: str) -> None:
        """With authentication on, may ``sender`` (a CURVE key) send ``msg``? Raises
        :class:`AuthenticationError` (counted ``auth_refused`` by the listener) if not:

        * a REGISTER must name its sender as ``control_key``, carry a valid proof under the
          cluster token (:func:`~trio_pd.io._security.register_mac`), and not name an endpoint
          another key registered, unless that registration is proven gone;
        * a TRANSFER or ABORT only from the key that registered its endpoint (a TRANSFER also
          from the key whose REGISTER of it was refused: it fails its room with the reason);
        * a PING only from a key that registered some endpoint.
        """
        if isinstance(msg, _wire.Register):
            token = self.agent.security.token
            if msg.control_key != sender:
                raise AuthenticationError(
                    f"REGISTER for {msg.endpoint} names key {msg.control_key!r}, sent by {sender}"
                )
            if token is None or not check_register_mac(
                token, msg.auth, endpoint=msg.endpoint, control_key=msg.control_key,
                engine=msg.engine, session=msg.session, decode_rank=msg.decode_rank,
                decode_tp=msg.decode_tp,
            ):
                raise AuthenticationError(
                    f"REGISTER for {msg.endpoint} from {sender}: no valid cluster-token proof"
                )
            old = self.agent.peers.get(msg.endpoint)
            if old is not None and old.key != sender and not old.gone:
                raise AuthenticationError(
                    f"REGISTER for {msg.endpoint} from {sender}: the endpoint is registered "
                    "under another key"
                )
        elif isinstance(msg, (_wire.Transfer, _wire.Abort)):
            peer = self.agent.peers.get(msg.endpoint)
            if peer is None and isinstance(msg, _wire.Transfer) and sender == (
                self.agent.peers.refused_key.get(msg.endpoint)
            ):
                return  # the key whose REGISTER was refused: its room fails with the reason
            if peer is None or peer.key != sender:
                raise AuthenticationError(
                    f"{type(msg).__name__.upper()} naming {msg.endpoint} from {sender}: "
                    "not the key that registered it"
                )
        elif isinstance(msg, _wire.Ping) and sender not in self._ping_keys:
            if not any(p.key == sender for p in self.agent.peers.all()):
                raise AuthenticationError(f"PING from {sender}: no registration under this key")
            if len(self._ping_keys) >= 4096:
                self._ping_keys.pop(next(iter(self._ping_keys)))
            self._ping_keys[sender] = None

    def on_transfer(self, msg: _wire.Transfer, pages: npt.NDArray[np.int32]) -> None:
        """TRANSFER from a decode rank: the table checks it and says where it goes
        (:meth:`PrefillRooms.on_transfer <trio_pd.core._tables.PrefillRooms.on_transfer>`)."""
        peer, refused = self.peer_view(msg.endpoint), self.agent.peers.refused.get(msg.endpoint)
        self.agent._carry_at(msg.room, self.agent.table.on_transfer(msg, pages, peer, refused))

    def on_abort(self, msg: _wire.Abort) -> None:
        """ABORT from a decode rank: to the room if it is this use, else tombstoned and acked
        (:meth:`PrefillRooms.on_abort <trio_pd.core._tables.PrefillRooms.on_abort>`)."""
        self.agent._carry_at(msg.room, self.agent.table.on_abort(msg.room, msg.epoch, msg.endpoint))


async def wait_quarantines(agent: PrefillAgent) -> None:
    """Closing, before anything stops: while a room holds a quarantined lease, keep
    serving, for at most ``close_timeout``. A failed write's bytes may still land, so its
    room's drain ack is withheld until the quarantine ends on proof (``PeerRegistry``);
    closing the control socket at once would leave decode to guess from a refused
    connect, while our engine may still deliver (it outlives this agent when the
    application keeps it). Meanwhile the socket stays open: PINGs get their PONG, ABORTs
    register their ack targets, and each ack goes out as its quarantine ends. Rooms
    still quarantined at the bound are counted (``rooms_unacked_at_close``) and logged:
    their acks are withheld for good (:meth:`PrefillRoom.shutdown`).

    **Cancellation:** run it shielded: cancelling it stops the wait early, with the same
    report.
    """
    if agent.quarantines.value:
        bound = agent.config.close_timeout
        if bound is None:
            bound = 2 * agent.peers.fence + 1.0
        log.info("prefill agent closing: waiting up to %g s for %d quarantined write(s) "
                 "to be proven over", bound, agent.quarantines.value)
        with trio.move_on_after(bound):
            await agent.quarantines.wait_value(0)
    else:
        await trio.lowlevel.checkpoint()
    left = [r for r in agent._rooms.values() if r.machine.leases.quarantined]
    if left:
        agent.counters.bump("rooms_unacked_at_close", len(left))
        log.error(
            "prefill agent closed with %d room(s) whose failed writes are not proven over: "
            "no drain ack for them, so decode keeps their pages: %s",
            len(left), ", ".join(str(r.machine.room) for r in left[:20]),
        )

def unproven(agent: PrefillAgent) -> bool:
    """Whether a failed write of ours is not proven over: a lease still quarantined."""
    return bool(agent.quarantines.value) or any(
        r.machine.leases.quarantined for r in agent._rooms.values()
    )


@one_error
@asynccontextmanager
async def open_prefill(
    *,
    engine: TransferEngine,
    pool: PoolSpec,
    bootstrap_url: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    kv_heads: int | None = None,
    host: str = "127.0.0.1",
    config: PrefillConfig | None = None,
    dp_rank: int = 0,
    dp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    first_layer: int = 0,
    metrics: AgentMetrics | None = None,
    token: str | None = None,
    secure: bool | None = None,
    bootstrap_verify: ssl.SSLContext | str | bool = True,
) -> AsyncIterator[PrefillAgent]:
    """Run a prefill rank: register ``pool`` with ``engine``, bind the control socket,
    register with the bootstrap service, and serve until the block exits.

    Authentication (docs/security.md): ``token`` is the cluster token (left out:
    ``TRIO_PD_TOKEN``, else, on loopback, this process's own), proven to the bootstrap
    service, never sent. ``secure`` None (the default) or True: CURVE and the identity
    checks on, and a missing token off loopback raises
    :class:`~trio_pd.ConfigurationError`; False (or ``TRIO_PD_SECURE=0``): off, explicitly,
    logged as one warning line.
    ``bootstrap_verify`` is how an https bootstrap service's certificate is checked (see
    :class:`~trio_pd.BootstrapClient`).

    ``kv_heads`` is the model's total KV heads (1 for MLA); left out, it is worked out from
    the pool (``heads * tp_size``), which needs more than one head per rank when TP > 1.
    Either way it must fit the pool: the heads this TP rank holds are the pool's heads, or
    :class:`~trio_pd.ConfigurationError` is raised before anything starts.

    DP attention: ``dp_rank`` and ``dp_size`` (default 0 and 1) say which DP rank's TP group
    this rank is in (``tp_rank`` and ``tp_size`` are then the attention TP rank and size), and
    are registered with the bootstrap service, which may serve every DP rank of the instance.
    With ``dp_size > 1`` TP rank 0 of each DP rank tells the service, for every room
    :meth:`~PrefillAgent.sender` creates, that this DP rank holds it (its
    :attr:`~PrefillAgent.dp_announcer`, in the background, never blocking ``sender``), so
    decode ranks route the room here (docs/topologies.md, "DP-attention routing").
    :class:`~trio_pd.ConfigurationError` unless ``0 <= dp_rank < dp_size``.

    Pipeline parallelism (docs/topologies.md, "Pipeline parallelism"): ``pp_rank`` and
    ``pp_size`` (default 0 and 1) say which PP stage's TP group this rank is in, and
    ``first_layer`` (default 0) which model layer its pool's first layer is: the pool holds
    the stage's ``pool.num_layers`` layers from there, and its layer ``i`` is written into
    decode's layer ``first_layer + i``. Only the last stage writes the aux rows. Each (stage,
    TP rank) is a prefill rank of its own for status and acks (:attr:`PrefillAgent.rank_id`).
    :class:`~trio_pd.ConfigurationError` unless ``0 <= pp_rank < pp_size`` and stage 0 starts
    at layer 0; the bootstrap service refuses stages that overlap or leave a gap (409). A
    pool with state components (:class:`~trio_pd.StateSpec`) cannot be split in stages yet.

    On exit, while rooms hold quarantined leases (a failed write whose bytes may still
    land), the agent first keeps serving, for at most ``config.close_timeout``, so that their
    fences can end and their drain acks reach decode (docs/lifetimes.md, "Shutdown"). Then
    every task is cancelled; engine calls already running finish first (the nursery waits for
    them), then rooms still open are failed and their pages handed back.

    Errors come out as one exception, not in an ExceptionGroup: a start that fails raises
    its :class:`~trio_pd.TransferError` (the bootstrap service unreachable:
    :class:`~trio_pd.BootstrapUnreachable`), and an exception raised in the block comes
    out as itself. Only failures that are unrelated to each other stay a group.

    **Cancellation:** cancelling the enclosing scope closes the agent as above.
    """
    config = config or PrefillConfig()
    # (workers=0 or a float count failed later, or hung; a None or NaN deadline in a compare)
    config.check(f"prefill rank {tp_rank}")
    check_dp(dp_rank, dp_size, f"prefill rank {tp_rank}")
    check_pp(pp_rank, pp_size, first_layer, pool.num_layers, f"prefill rank {tp_rank}")
    if pool.states and pp_size > 1:
        raise ConfigurationError(
            f"prefill rank {tp_rank}: state components are not supported with pipeline "
            "stages (each stage would write its own layers' states)"
        )
    _wire.check_advertised_host(host, f"prefill rank {tp_rank}")
    security = resolve(
        what=f"prefill rank {tp_rank}", hosts=[host], token=token, secure=secure
    )
    _descriptors.prepare(f"prefill rank {tp_rank}")
    # (a name is resolved here, once, off the I/O thread: libzmq would resolve it there)
    bind = await _names.bind_address(host, f"prefill rank {tp_rank}")
    try:
        kv_heads = model_kv_heads(
            pool.layout, pool.heads, pool.first_head, tp_rank, tp_size, kv_heads
        )
    except ValueError as exc:
        raise ConfigurationError(f"prefill rank {tp_rank}: {exc}") from None
    agent = PrefillAgent(
        engine=engine, pool=pool, tp_rank=tp_rank, tp_size=tp_size, kv_heads=kv_heads,
        host=bind, config=config, security=security, pp_rank=pp_rank, pp_size=pp_size,
        first_layer=first_layer,
    )
    if metrics is not None:
        metrics.attach(agent)  # sets agent.metrics; exports statistics() at scrape time
    regions = pool.regions()
    registered = False
    try:
        await trio.to_thread.run_sync(engine.register, regions)
        registered = True
        async with (
            BootstrapClient(
                bootstrap_url, token=security.token or "", verify=bootstrap_verify
            ) as client,
            trio.open_nursery() as nursery,
        ):
            # The listener, the timers and the peer registry's tasks (its probes) outlive a
            # cancellation of the block: closing waits for quarantined writes to be proven
            # over (_wait_quarantines), which needs them, and stops them when done.
            services = [trio.CancelScope(shield=True) for _ in range(3)]
            try:
                agent.peers.nursery = await nursery.start(serve_nursery, services[0])
                # a decode rank's key is admitted once the bootstrap service vouches for it
                agent.control.vouch = client.vouches
                nursery.start_soon(serve, services[1], partial(agent.control.serve, agent._handle))
                nursery.start_soon(serve, services[2], agent.timers.run)
                agent.jobs.start(nursery)
                info = PrefillRankInfo(
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    endpoint=agent.endpoint,
                    engine=engine.name,
                    engine_session=engine.session_id,
                    layout=pool.layout,
                    kv_heads=kv_heads,
                    page_size=pool.page_size,
                    heartbeat_endpoint=agent.control.heartbeat_endpoint,
                    head_bytes=pool.head_bytes,
                    num_layers=pool.num_layers,
                    aux_item_len=pool.aux_item_len,
                    control_key=agent.control.public_key,
                    dp_rank=dp_rank,
                    dp_size=dp_size,
                    pp_rank=pp_rank,
                    pp_size=pp_size,
                    first_layer=first_layer,
                    buffer_head_bytes=pool.head_bytes_all,
                    aux_item_lens=pool.aux_item_lens,
                    states=tuple(_wire.StateWire.from_spec(st) for st in pool.states),
                    kv_dtype=pool.kv_dtype,
                    landing=True,
                )
                try:  # (a prefill rank may start before its bootstrap service: retried)
                    with trio.fail_after(config.bootstrap_timeout):
                        await client.wait_register(info)
                except trio.TooSlowError:
                    raise client.no_answer(
                        config.bootstrap_timeout, f"prefill rank {tp_rank}, registering"
                    ) from None
                agent.dp_rank, agent.dp_size = dp_rank, dp_size
                # one announcer per DP rank (docs/topologies.md): TP rank 0 of its first PP stage
                if dp_size > 1 and tp_rank == 0 and pp_rank == 0:
                    agent.dp_announcer = DpAnnouncer(
                        client, dp_rank, give_up_after=config.bootstrap_timeout
                    )
                    nursery.start_soon(agent.dp_announcer.run)
                try:
                    yield agent
                finally:
                    with trio.CancelScope(shield=True):
                        await wait_quarantines(agent)
            finally:
                # (also when starting failed, the registration refused say: the services
                # are shielded, so the nursery's own cancellation would not reach them)
                agent.jobs.stop()
                for scope in services:
                    scope.cancel("prefill agent closing")
                nursery.cancel_scope.cancel("prefill agent closing")
    finally:
        agent.peers.nursery = None
        agent.peers.close()  # every call has returned: the nursery waited for them
        # what the listener left unread (a decode rank's TRANSFER sent as we closed) is
        # answered too: its room fails here and that rank hears a Failed STATUS and an ack
        agent.control.drain_nowait(agent._handle_closing)
        proven = not unproven(agent)  # (before the rooms are shut down and forgotten)
        agent._shutdown_rooms()
        if proven:
            agent._say_goodbye()
        # shielded (a cancelled block still closes everything), each step bounded on its
        # own (_close): one that hangs skips none of the others
        with trio.CancelScope(shield=True):
            await wait_probe_threads(agent.peers.probe_threads.limiter, agent.peers.fence)
            if registered:
                await unregister(engine, regions, f"prefill rank {tp_rank}'s pool")
            await agent.runner.planner.close_staging()
            await bounded("closing the control plane", agent.control.aclose)
