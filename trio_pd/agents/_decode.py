"""The decode agent: a facade that wires the parts of a decode rank together.

* :class:`~trio_pd.core._rooms.DecodeRoom` (one per room) decides: the three-way status, Success
  (every required rank's Success *and* the aux row stamped with this room and epoch), the one
  failure path, and when held pages may go back (every contacted rank acked its drain,
  reported Success, or is proven gone).
  :class:`~trio_pd.core._tables.DecodeRooms` holds the rooms, decides which use a STATUS or
  ABORT_ACK is for (a late one changes nothing), and owns every room deadline. Both are pure:
  they return what is due.
* :class:`~trio_pd.agents._sources.Sources` finds the prefill instances, registers with their ranks,
  runs the heartbeat and probes writers (three-valued liveness).
* :class:`~trio_pd.io._outbox.Outbox` carries the ABORTs: one retry policy, one pending ABORT per
  (rank, room, epoch) however often it is re-sent.
* :class:`~trio_pd.agents._dp_router.DpRouter` finds which prefill DP rank holds a room the caller
  did not route (DP attention, docs/topologies.md).

Closing the agent fails its rooms the normal way (ABORT to every prefill rank contacted) and
keeps serving, with its memory registered, until their drain acks come or the writers are
proven gone, for at most ``DecodeConfig.close_timeout``. Rooms still unproven then are
counted (``rooms_unproven_at_close``) and logged, and their ``on_release`` does not run: a
write may still land in those pages. Deadlines report; they do not free.
"""

from __future__ import annotations

import logging
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Literal

import msgspec
import numpy as np
import numpy.typing as npt
import trio
import trio.lowlevel
import trio_util

from ..bootstrap._bootstrap_client import (
    MAX_DP_SIZE,
    check_dp,
    split_dp_url,
)
from ..core import _wire
from ..core._config import check_choice, check_count, check_seconds
from ..core._errors import (
    AuthenticationError,
    ConfigurationError,
    PeerLost,
    ProtocolError,
    TransferAborted,
    TransferError,
    one_error,
)
from ..core._landing import KEPT, LandingArea, fragmented
from ..core._memory import (
    PoolSpec,
    as_index,
    check_aux_slot,
    check_prefix_pages,
    check_state_slots,
    pool_page_ids,
    read_aux_stamp,
)
from ..core._rooms import (
    Arm,
    ArmAckDeadline,
    Count,
    DecodeRoom,
    Due,
    Failed,
    Forget,
    ProbeWriters,
    Release,
    SendAborts,
    SendTransfers,
    Succeeded,
)
from ..core._staging import host_source
from ..core._state import KVPoll, Liveness
from ..core._stats import AgentStatistics, Counters, count_room_end
from ..core._tables import DecodeDeadlines, DecodeRooms, RoomDeadline
from ..core._topology import model_kv_heads
from ..engines import TransferEngine
from ..io import _descriptors, _names
from ..io._control import ControlPlane, sweep_idle_sockets
from ..io._outbox import Outbox
from ..io._security import Keypair, Security, resolve
from ..io._timers import Timer, Timers
from ._close import bounded, deregister_area, unregister, wait_probe_threads
from ._dp_router import DpRouter, dp_instance
from ._handle import RoomHandle
from ._lazy import LazyEvent
from ._service import serve
from ._sources import Instance, PrefillRank, Sources

if TYPE_CHECKING:
    from ..metrics import AgentMetrics

log = logging.getLogger("trio_pd.decode")

CLOSING = "decode agent closing"

@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Knobs of a decode agent. Deadlines are in seconds. Each knob's type and range is
    checked by ``open_decode`` before anything starts (:meth:`check`): a bad one is a
    :class:`~trio_pd.ConfigurationError` naming it."""

    #: resolving a prefill instance through its bootstrap service; with DP attention, also
    #: how long a room waits to learn which DP rank holds it (then it fails: UnknownRoom)
    bootstrap_timeout: float = 30.0
    #: a room not terminal this long after ``init`` fails (and waits for its drain acks)
    waiting_timeout: float = 120.0
    #: how long to wait for drain acks before re-sending ABORT and probing the writers
    ack_timeout: float = 10.0
    #: how often each prefill rank this agent reads from is sent a PING
    heartbeat_interval: float = 1.0
    #: PINGs in a row without a PONG after which the prefill rank is lost: the rooms it
    #: serves fail (``peers_lost``)
    heartbeat_misses: int = 3
    #: "drain": pages of a failed room go back only on every ack, or when the writing peer is
    #: proven gone. "timeout": also when ``ack_timeout`` passes (counted released_by_timeout).
    release_policy: Literal["drain", "timeout"] = "drain"
    #: how long closing the agent waits for the drain of the rooms it fails; what is still
    #: unproven then is reported, not released (``rooms_unproven_at_close``)
    close_timeout: float = 10.0
    #: ZeroMQ send high-water mark of each PUSH socket (messages queued per prefill rank);
    #: a send that finds it reached counts ``send_backpressure`` instead of blocking
    sndhwm: int = 10_000
    #: an ABORT that finds a prefill rank's socket full is retried this long, then dropped
    #: and counted (``outbox_dropped``); the pages stay held
    abort_retry: float = 60.0
    #: PUSH sockets open at once; past it the least recently used is closed
    #: (``sockets_evicted``). Stay below libzmq's 1023 sockets per context
    max_peer_sockets: int = 512
    #: a PUSH socket nobody sent on for this long is closed by a periodic sweep
    peer_socket_idle: float = 300.0
    #: bytes of host memory for landing pages (0: none). A room whose pages are fragmented
    #: (``landing_below``) is written there in few large blocks, and copied into its pages
    #: before it reads Success; prefill gathers its source pages into its staging area for
    #: it (``PrefillConfig.staging_bytes``). Allocated and registered with the engine when
    #: the agent opens, for a pool whose KV buffers are stated to be host memory only (else
    #: off; off too, logged, when it cannot be allocated or the engine refuses it: the agent
    #: opens and serves without it); anything but an int >= 0 is a ConfigurationError at
    #: open_decode. A room that finds no free run of landing pages is sent its own pages
    #: (``landing_full``). Each landing page holds a page of every KV buffer
    #: (``sum(pool.item_lens)`` bytes). docs/lifetimes.md, "Landing pages"
    landing_bytes: int = 0
    #: a room lands when its pages, split into runs of consecutive page ids, make runs of
    #: fewer than this many bytes of one buffer on average (and more than one run), and
    #: landing cuts its blocks (not where several prefill ranks of a stage write head
    #: slices of each page: those are per token slot wherever they land)
    landing_below: int = 256 << 10

    def check(self, what: str) -> None:
        """Raise :class:`~trio_pd.ConfigurationError` naming the first knob of the wrong type
        or out of its range, and its value: deadlines and intervals are seconds (an int or
        a float, infinity allowed), ``>= 0`` (``heartbeat_interval`` and
        ``peer_socket_idle``: ``> 0``); counts and sizes are ints (not bools):
        ``heartbeat_misses`` and ``max_peer_sockets`` ``>= 1``, ``sndhwm`` (0: ZeroMQ's no
        limit), ``landing_bytes`` and ``landing_below`` ``>= 0``. ``open_decode`` calls it
        before anything starts."""
        for name in ("bootstrap_timeout", "waiting_timeout", "ack_timeout", "close_timeout",
                     "abort_retry"):
            check_seconds(what, name, getattr(self, name))
        for name in ("heartbeat_interval", "peer_socket_idle"):
            check_seconds(what, name, getattr(self, name), positive=True)
        check_count(what, "heartbeat_misses", self.heartbeat_misses, 1)
        check_count(what, "max_peer_sockets", self.max_peer_sockets, 1)
        check_count(what, "sndhwm", self.sndhwm, 0)
        check_count(what, "landing_bytes", self.landing_bytes, 0)
        check_count(what, "landing_below", self.landing_below, 0)
        check_choice(what, "release_policy", self.release_policy, ("drain", "timeout"))


@dataclass(eq=False, slots=True)
class _Room:
    """The trio side of one decode room."""

    machine: DecodeRoom
    instance: Instance
    on_release: Callable[[], None] | None = None
    sources: list[PrefillRank] = field(default_factory=list)
    terminal: LazyEvent = field(default_factory=LazyEvent)
    released: LazyEvent = field(default_factory=LazyEvent)
    draining: bool = False  # the abort -> release latency is being measured
    #: metrics attached only: the ``time.perf_counter()`` the room's transfer latency runs
    #: from, its creation until ``init`` moves it there
    started: float | None = None
    #: DP attention: the DP rank of the prefill instance the room goes to (0 without DP
    #: attention); None while it asks the bootstrap service (``instance`` is then a
    #: stand-in, known to no one), or if it failed before it learnt it
    dp_rank: int | None = None
    #: Success was delivered to the scheduler (``wait()`` returned it, ``poll()`` reported
    #: it): the pages are its. Becomes True once, never once ``withdrawn`` is set
    delivered: bool = False
    #: the scheduler gave the room up (``abort()``, or left its block) before Success was
    #: delivered: the failure it reads from then on, whatever the room's machine decides
    #: later. Set once, never once ``delivered`` is True
    withdrawn: TransferError | None = None
    #: the first of the landing pages the room holds (as many as its pages), or None: held
    #: until Success, or until its pages are released (trio_pd.core._landing)
    landing: int | None = None
    #: the room's deadlines armed (cancelled when it is forgotten: they hold the record)
    timers: list[Timer] = field(default_factory=list)


class DecodeReceiver(RoomHandle["DecodeAgent", _Room]):
    """The scheduler's handle for one room on a decode rank (≈ SGLang's ``KVReceiver``).

    Ownership of the destination pages (and the aux row): from :meth:`init` they belong to
    trio_pd, until one of two things happens, and only one ever does:

    * Success is *delivered* to you: :meth:`wait` returned it or :meth:`poll` reported it.
      The pages hold the request's KV and are yours; ``on_release`` never runs.
    * ``on_release`` runs, exactly once: after a failure, when no prefill rank can still
      write them; or, when you gave the room up (:meth:`abort`, or leaving its ``async
      with`` block) before Success was delivered to you, at once if the room had succeeded.

    ``async with`` the handle holds the room for the block: leaving the block before Success
    was delivered gives the room up as :meth:`abort` does, however the block ends (an
    exception, a cancellation landing at any await, a return).
    """

    @property
    def epoch(self) -> int:
        return self._room.machine.epoch

    @property
    def prefill_dp_rank(self) -> int | None:
        """DP attention: the DP rank of the prefill instance the room was routed to (0
        without DP attention); None while the bootstrap service is still being asked (or if
        the room failed before it said)."""
        return self._room.dp_rank

    def init(
        self,
        pages: npt.ArrayLike,
        aux_slot: int,
        *,
        on_release: Callable[[], None] | None = None,
        prefix_pages: int = 0,
        state_slots: Sequence[npt.ArrayLike] = (),
    ) -> None:
        """Ask the prefill ranks for the room's KV into ``pages`` and aux row ``aux_slot``.
        From here the pages are trio_pd's until Success is delivered to you or
        ``on_release`` runs (see the class). Synchronous: the pages are handed over when it
        returns; if it raises, they were not.

        ``prefix_pages``: this rank holds the request's first ``prefix_pages`` pages already
        (its own prefix cache hit); ``pages`` are for the request's pages after them, and the
        prefill ranks write only those (and the aux row). Status and release rules are the
        same; ``on_release`` concerns ``pages`` only.

        ``state_slots``: with a pool that has state components (:class:`~trio_pd.StateSpec`),
        this rank's slots of each component for the request, one list per component (a
        Mamba state: one slot; a sliding window: its pages), where the prefill ranks write
        their slots, ``i`` to ``i``. They are held with ``pages`` and come back with them
        (``on_release``). Left out: no slot of any component. :class:`ProtocolError` for
        slots outside a component or repeated, or not one list per component."""
        self._agent._init(self._room, pages, aux_slot, on_release, prefix_pages, state_slots)

    def poll(self) -> KVPoll:
        """The room's status now. Never blocks; a terminal status never changes again.
        Returning Success delivers it: the pages are yours from then on."""
        return super().poll()

    @property
    def failure(self) -> TransferError | None:
        """Why the room failed (None unless Failed)."""
        return self._room.withdrawn or self._room.machine.failure

    @property
    def propagated(self) -> bool:
        """True if this rank saw Failed only because another rank failed."""
        return self._room.machine.cell.propagated and self._room.withdrawn is None

    def abort(self, reason: str = "aborted by the decode scheduler") -> None:
        """Give the room up: it is Failed for you from now on, and the pages come back
        through ``on_release``, exactly once: after every prefill rank it contacted acked
        its drain (it asks them), or at once if it had already succeeded without your
        knowing it (nothing can still write them then). After Success was delivered to
        you (:meth:`wait` returned it, :meth:`poll` reported it) it does nothing: the pages
        are yours. Idempotent."""
        if self._withdraw(reason):
            self._agent._abort(self._room, reason)

    async def wait(self) -> KVPoll:
        """Wait until the room is terminal; return Success or Failed. Returning Success
        delivers it: the pages are yours from then on.

        **Cancellation:** cancelling the wait does not abort the room, and delivers
        nothing: a room that succeeded meanwhile is not yours until :meth:`poll` or a
        later :meth:`wait` says so (leaving the room's block, or :meth:`abort`, gives it
        back through ``on_release``).
        """
        # (RoomHandle.wait's body, not a call of it: one coroutine frame fewer to resume)
        await self._room.terminal.wait()
        return self._deliver(self._status())

    async def wait_released(self) -> None:
        """Wait until ``on_release`` has run (after a failure, or for a Success given up
        unclaimed). A Success delivered to you is never released: this then waits forever.

        **Cancellation:** cancelling the wait changes nothing.
        """
        await super().wait_released()

    # -------------------------------------------------------------- for the facades

    def _status(self) -> KVPoll:
        """:meth:`poll` without delivering anything (the facades publish what they read
        and deliver it when their own caller reads it)."""
        rec = self._room
        return KVPoll.Failed if rec.withdrawn is not None else rec.machine.status

    def _deliver(self, status: KVPoll) -> KVPoll:
        if status is KVPoll.Success:
            self._room.delivered = True
        return status

    def _withdraw(self, reason: str) -> bool:
        """The part of :meth:`abort` that decides, with plain writes only (the asyncio
        facade calls it between trio's ticks, and has the rest done on trio's next tick):
        False if Success was delivered already (nothing to do); else the room reads Failed
        from now on, with ``TransferAborted(reason)`` unless it had failed already."""
        rec = self._room
        if rec.delivered:
            return False
        if rec.withdrawn is None and rec.machine.status is not KVPoll.Failed:
            rec.withdrawn = TransferAborted(reason)
        return True

    def _leave(self, why: str) -> None:
        if not self._room.delivered:
            self.abort(f"the room's async with block was left before Success was delivered{why}")

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
        security: Security | None = None,
    ) -> None:
        self.metrics = metrics  # prometheus hooks (trio_pd.metrics), optional
        #: authentication (docs/security.md); off unless open_decode turned it on
        self.security = security or Security(curve=False, token=None)
        self.engine, self.pool, self.config = engine, pool, config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.counters, self.timers = Counters(), Timers()
        self._deadline_passed = self._timer_due  # (one bound method for every deadline)
        self.control = control or ControlPlane(
            host, self.counters, sndhwm=config.sndhwm, max_peers=config.max_peer_sockets,
            keys=Keypair.generate() if self.security.curve else None,
        )
        self.outbox = Outbox(
            lambda *send: self.control.send_nowait(*send), self.timers, self.counters,
            give_up_after=config.abort_retry,
        )
        sweep_idle_sockets(self.timers, self.control, config.peer_socket_idle)
        self.sources = Sources(
            engine=engine, pool=pool, tp_rank=tp_rank, tp_size=tp_size, control=self.control,
            counters=self.counters, bootstrap_timeout=config.bootstrap_timeout,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_misses=config.heartbeat_misses, probe_timeout=config.ack_timeout,
            on_resolved=self._resolved, on_failed=self._resolve_failed, on_lost=self._lost,
            metrics=lambda: self.metrics,
        )
        self.sources.token = self.security.token
        #: the rooms, the intake of STATUS and ABORT_ACK, and every room deadline (pure)
        self.table: DecodeRooms[_Room] = DecodeRooms(DecodeDeadlines(
            waiting=config.waiting_timeout, ack=config.ack_timeout,
            release_policy=config.release_policy,
        ))
        #: DP attention: which prefill DP rank holds a room the caller did not say
        self.router: DpRouter[_Room] = DpRouter(
            sources=self.sources, timers=self.timers, counters=self.counters,
            bootstrap_timeout=config.bootstrap_timeout, token=self.security.token or "",
            on_routed=self._routed, on_failed=self._fail,
        )
        #: rooms whose pages are held for a drain (failed, named to a prefill rank)
        self.held = trio_util.AsyncValue(0)
        #: where fragmented rooms land (``DecodeConfig.landing_bytes``; set by open_decode)
        self.landing: LandingArea | None = None
        self._token = trio.lowlevel.current_trio_token()
        #: messages to and from prefill ranks (``_handle``: the listener's; tests wrap these)
        self.wire = DecodeWire(self)
        self._handle = self.wire.handle
        self._on_status, self._on_ack = self.wire.on_status, self.wire.on_ack

    @property
    def _rooms(self) -> dict[int, _Room]:
        return self.table.rooms

    @property
    def _instances(self) -> dict[str, Instance]:
        return self.sources.instances

    @property
    def endpoint(self) -> str:
        return self.control.endpoint

    def receiver(
        self,
        room: int,
        *,
        bootstrap_url: str,
        epoch: int | None = None,
        dp_rank: int | None = None,
    ) -> DecodeReceiver:
        """Create the handle for ``room`` served by the prefill instance at ``bootstrap_url``.
        ``epoch`` tells this use of the room from earlier ones; every decode rank of one
        request must pass the same one (default: a fresh random nonce).

        DP attention (docs/topologies.md): ``dp_rank``, when the router knows it, is the DP
        rank of the prefill instance that holds the room; the room goes to that DP rank's TP
        group. Left out, the room goes to DP rank 0 if the instance has one DP rank, and
        otherwise to the DP rank the bootstrap service says holds it (asked in the
        background; the receiver stays Bootstrapping meanwhile, for at most
        ``DecodeConfig.bootstrap_timeout``, then fails with
        :class:`~trio_pd.UnknownRoom`). The agent learns an instance's DP
        size from its first such answer. :class:`~trio_pd.ConfigurationError` for a
        ``dp_rank`` that is not an int in ``[0, 1024)``; a DP rank the instance does not have
        fails the room (:class:`~trio_pd.BootstrapError`, the service's 404)."""
        room = as_index(room, "room")
        if room in self.table.rooms:
            raise TransferError(f"room {room} is still in use on decode rank {self.tp_rank}")
        if "?" in bootstrap_url:
            base, named = split_dp_url(bootstrap_url)
            if named is not None:  # a URL of one DP rank (dp_url): the same as naming it
                bootstrap_url, dp_rank = base, named if dp_rank is None else dp_rank
        if dp_rank is not None:
            check_dp(dp_rank, MAX_DP_SIZE, f"decode rank {self.tp_rank}: room {room}")
        if epoch is None:
            epoch = secrets.randbits(62)
        url = self.router.target(bootstrap_url, dp_rank)
        # (a stand-in Instance while the room asks for its DP rank: nobody resolves it)
        inst = Instance(bootstrap_url) if url is None else self.sources.instance(url)
        rec = _Room(DecodeRoom(room, epoch), inst, dp_rank=None if url is None else dp_rank or 0)
        if self.metrics is not None:
            rec.started = time.perf_counter()
        self._carry(rec, self.table.open(rec))
        if url is None:
            self.router.route(rec, bootstrap_url)
        elif inst.ready:
            self._bind(rec)
        else:
            inst.waiting.append(rec)
        return DecodeReceiver(self, rec)

    def statistics(self) -> AgentStatistics:
        held = sum(
            len(r.machine.pages)
            for r in self._rooms.values()
            if r.machine.pages is not None and r.machine.holding
        )
        landing = 0 if self.landing is None else self.landing.reserved
        return self.counters.snapshot(
            rooms_active=len(self._rooms), pages_held=held, landing_held=landing
        )

    # ------------------------------------------------------------------ room flow

    def _init(
        self,
        rec: _Room,
        pages: npt.ArrayLike,
        aux_slot: int,
        on_release: Callable[[], None] | None,
        prefix_pages: int = 0,
        state_slots: Sequence[npt.ArrayLike] = (),
    ) -> None:
        """:meth:`DecodeReceiver.init`: the caller's pages are checked (integers inside the
        pool, none repeated) and copied here, once; the TRANSFER's encoder and the prefill
        rank check the ids again only where they cross the wire."""
        if rec.machine.pages is not None:
            raise ProtocolError(f"room {rec.machine.room}: init called twice")
        ids = pool_page_ids(pages, self.pool.num_pages, np.int32)  # (a copy)
        prefix_pages = check_prefix_pages(prefix_pages)
        aux_slot = check_aux_slot(aux_slot, self.pool.aux_slots)
        if ids.size > _wire.MAX_TRANSFER_PAGES:  # (its TRANSFER could not carry them)
            raise ProtocolError(
                f"{ids.size} pages in one request; a TRANSFER carries at most "
                f"{_wire.MAX_TRANSFER_PAGES}"
            )
        states = self.pool.states
        slots = check_state_slots(
            [st.slots for st in states], state_slots, "destination"
        ) if states or type(state_slots) is not tuple or state_slots else ()  # (no call: none)
        rec.on_release = on_release
        if self.metrics is not None:
            rec.started = time.perf_counter()
        self._carry(rec, rec.machine.init(ids, aux_slot, prefix_pages, slots))

    def _abort(self, rec: _Room, reason: str) -> None:
        """The scheduler gave ``rec`` up (:meth:`DecodeReceiver.abort`): fail it, or, if it
        had succeeded unseen, hand its pages back now."""
        self._carry(rec, self.table.give_up(rec, rec.withdrawn or TransferAborted(reason)))

    def _bind(self, rec: _Room) -> None:
        """The instance is resolved: the room knows its source ranks."""
        rec.sources = list(rec.instance.sources)
        if self.table.rooms.get(rec.machine.room) is rec:
            for rank in rec.sources:
                rank.rooms.add(rec.machine.room)
        # (each (PP stage, TP rank) is a rank of its own: counted by rank_id)
        due = rec.machine.bind([r.rank_id for r in rec.sources])
        if due:  # (nothing, unless init came first or the room failed)
            self._carry(rec, due)

    def _resolved(self, inst: Instance) -> None:
        waiting, inst.waiting = inst.waiting, []
        for rec in waiting:
            # also rooms already failed and forgotten here: their prefill ranks must hear the
            # ABORT, or their senders would wait for the bootstrap deadline
            self._bind(rec)
        self.router.resolved(inst)

    def _resolve_failed(self, inst: Instance, error: TransferError) -> None:
        for rec in [r for r in self._rooms.values() if r.instance is inst]:
            self._carry(rec, rec.machine.fail(error))  # no rank was told: freed at once
        self.router.resolve_failed(inst, error)

    def _fail(self, rec: _Room, error: TransferError) -> None:
        self._carry(rec, rec.machine.fail(error))

    def _routed(self, rec: _Room, base: str, dp_rank: int) -> None:
        """The room's DP rank is known: it joins that DP rank's instance. (A room that
        failed meanwhile joins too: its prefill ranks must hear the ABORT.)"""
        inst = self.sources.instance(dp_instance(base, dp_rank))
        rec.instance, rec.dp_rank = inst, dp_rank
        if inst.ready:
            self._bind(rec)
        else:
            inst.waiting.append(rec)

    def _lost(self, rank: PrefillRank) -> None:
        self.router.forget_sizes()
        for room_id in list(rank.rooms):
            rec = self._rooms.get(room_id)
            if rec is not None:
                self._carry(rec, rec.machine.peer_lost(rank.rank_id))

    # ------------------------------------------------------------------ doing what is due

    def _carry(self, rec: _Room, due: Due) -> None:
        """Carry out what a room machine made due. Synchronous: it never waits."""
        machine = rec.machine
        for effect in due:
            match effect:  # (the success path's effects first: fewer checks)
                case SendTransfers():
                    self._arm(rec, self.table.timer(rec, "waiting"))
                    self.wire.send_transfers(rec)
                case Succeeded():
                    self.wire.give_landing(rec)  # (scattered already, before Success)
                    count_room_end(self.counters, self.metrics, rec.started)
                    rec.terminal.set()
                case Forget():
                    self.table.forget(rec)
                    self.timers.cancel_all(rec.timers)  # (its deadlines let it go now)
                    for rank in rec.sources:
                        rank.rooms.discard(machine.room)
                case Failed(error=error):
                    count_room_end(self.counters, self.metrics, rec.started, error)
                    rec.terminal.set()
                    if machine.holding and not rec.draining:
                        rec.draining = True
                        self.held.value += 1
                        if self.metrics is not None:
                            self.metrics.drain_started(rec)
                case SendAborts(ranks=ranks):
                    self.wire.send_aborts(rec, ranks)
                case ArmAckDeadline():
                    self._arm(rec, self.table.timer(rec, "ack"))
                case Arm():
                    self._arm(rec, effect)
                case Count(name=name):
                    self.counters.bump(name)
                case Release(how=how):
                    self.wire.give_landing(rec)  # (no write of the room can land any more)
                    if how == "peer_gone":
                        self.counters.bump("released_peer_gone")
                    elif how == "timeout":
                        self.counters.bump("released_by_timeout")
                    elif how == "unclaimed":
                        self.counters.bump("released_unclaimed")
                    if rec.draining:
                        rec.draining = False
                        self.held.value -= 1
                        if self.metrics is not None:
                            self.metrics.drain_released(rec)
                    rec.released.set()
                    callback, rec.on_release = rec.on_release, None
                    if callback is not None:
                        try:
                            callback()
                        except Exception:
                            log.exception("room %d: on_release raised", machine.room)
                case ProbeWriters(ranks=ranks):
                    for rank in rec.sources:
                        if rank.rank_id in ranks and self.sources.nursery is not None:
                            self.sources.nursery.start_soon(self._probe_writer, rec, rank)
                case _:
                    raise AssertionError(f"decode cannot do {effect!r}")

    def _arm(self, rec: _Room, arm: Arm) -> None:
        """Arm a deadline the table made (:meth:`_timer_due` hears it); one of ``rec``'s own
        goes when the room is forgotten (:class:`~trio_pd.io._timers.Timers`, why)."""
        after, key = arm.after, arm.key
        timer = self.timers.after(after, self._deadline_passed, key)
        if type(key) is RoomDeadline and key.rec is rec:
            rec.timers.append(timer)

    # ------------------------------------------------------------------ deadlines, probes

    def _timer_due(self, key: Hashable) -> None:
        """A deadline the table armed has passed: it decides what that means
        (:meth:`DecodeRooms.handle_timer <trio_pd.core._tables.DecodeRooms.handle_timer>`)."""
        if isinstance(key, RoomDeadline):
            self._carry(key.rec, self.table.handle_timer(key))

    async def _probe_writer(self, rec: _Room, rank: PrefillRank) -> None:
        """If the writer is proven gone, its writes are over: it counts as drained."""
        if await self.sources.liveness(rank) is Liveness.GONE:
            self._carry(rec, rec.machine.writer_gone(rank.rank_id))



class DecodeWire:
    """What a decode rank says to its prefill ranks and what it hears from them: the
    TRANSFER and ABORT it sends for a room, and the intake of STATUS, ABORT_ACK, PONG and
    BYE with the check of who sent them (authentication on). Holds no state of its own: the
    rooms are the agent's table, and what a message makes due is carried by
    :meth:`DecodeAgent._carry`.
    """

    def __init__(self, agent: DecodeAgent) -> None:
        self.agent = agent

    def send_transfers(self, rec: _Room) -> None:
        machine = rec.machine
        assert machine.pages is not None
        pages = self.landing_pages(rec)
        for rank in rec.sources:
            if rank.lost:
                error = PeerLost(f"prefill rank {rank.rank_id} is lost")
                self.agent._carry(rec, machine.fail(error))
                return
            msg = _wire.Transfer(
                v=_wire.WIRE_VERSION,
                room=machine.room,
                epoch=machine.epoch,
                endpoint=self.agent.endpoint,
                decode_rank=self.agent.tp_rank,
                aux_slot=machine.aux_slot,
                required=len(rec.sources),
                num_pages=machine.pages.size,
                prefix_pages=machine.prefix_pages,
                state_slots=tuple(tuple(s.tolist()) for s in machine.state_slots)
                if self.agent.pool.states else msgspec.UNSET,
                landing=rec.landing is not None,
            )
            machine.contacted(rank.rank_id)
            try:
                sent = self.agent.control.send_nowait(rank.endpoint, msg, pages)
            except ProtocolError as exc:
                # a TRANSFER that cannot be encoded (init checks what it can, so this is a
                # bug): the room fails, and nothing leaves this call, which may run in the
                # task that resolves every room's instance
                log.error("room %d: its TRANSFER was refused: %s", machine.room, exc)
                self.agent._carry(rec, machine.fail(exc))
                return
            if not sent:
                error = PeerLost(f"prefill rank {rank.rank_id} is not reading (socket full)")
                self.agent._carry(rec, machine.fail(error))
                return

    def landing_pages(self, rec: _Room) -> npt.NDArray[np.int32]:
        """The page ids the room's TRANSFERs name: a run of landing pages when its pages are
        fragmented, every source rank takes landing pages, landing cuts its blocks, and the
        landing area has a free run for them (held from now on:
        :meth:`give_landing`); else its own pages."""
        machine, agent = rec.machine, self.agent
        pages, area = machine.pages, agent.landing
        assert pages is not None
        if rec.landing is not None:  # (held already: the TRANSFERs name the same run)
            return np.arange(rec.landing, rec.landing + len(pages), dtype=np.int32)
        if area is None or not all(
            r.landing for r in rec.sources
        ) or not fragmented(pages, agent.pool.item_lens[0], agent.config.landing_below):
            return pages
        if agent.pool.layout == "mha":
            stages = [r.pp_rank for r in rec.sources]
            if len(set(stages)) < len(stages):
                # several prefill ranks of a stage write head slices of each page (prefill
                # TP above ours): one block per token slot wherever they land, so landing
                # would only add the copy
                return pages
        first = area.reserve(len(pages))
        if first is None:
            agent.counters.bump("landing_full")
            return pages
        rec.landing = first
        return np.arange(first, first + len(pages), dtype=np.int32)

    def land(self, rec: _Room) -> None:
        """Every required rank reported Success and the aux row is the room's: copy its
        landed bytes into its pages (before the room reads Success)."""
        area, pages = self.agent.landing, rec.machine.pages
        if rec.landing is None or area is None or pages is None:
            return
        area.scatter(rec.landing, pages)
        self.agent.counters.bump("rooms_landed")

    def give_landing(self, rec: _Room) -> None:
        """The room's landing range goes back: it succeeded (copied out already), or its
        pages are released (no write of it can land any more)."""
        area, pages = self.agent.landing, rec.machine.pages
        if rec.landing is not None and area is not None and pages is not None:
            area.give(rec.landing, len(pages))
        rec.landing = None

    def send_aborts(self, rec: _Room, ranks: tuple[int, ...]) -> None:
        machine, agent = rec.machine, self.agent
        abort = _wire.Abort(
            v=_wire.WIRE_VERSION, room=machine.room, epoch=machine.epoch, endpoint=agent.endpoint
        )
        for rank in rec.sources:
            if rank.rank_id in ranks:
                agent.outbox.send(rank.endpoint, ("abort", machine.room, machine.epoch), abort)

    def aux_matches(self, rec: _Room) -> bool:
        stamp = read_aux_stamp(self.agent.pool, rec.machine.aux_slot)
        return stamp == (rec.machine.room, rec.machine.epoch)


    def handle(
        self, msg: _wire.Message, pages: npt.NDArray[np.int32] | None, sender: str | None = None
    ) -> None:
        """Dispatch one control message. ``sender`` is the CURVE key it came from (the
        listener passes it with authentication on); None is a trusted local call."""
        if isinstance(msg, _wire.Status):
            self.agent._on_status(msg, sender)  # (through the agent: tests wrap it)
        elif isinstance(msg, _wire.AbortAck):
            self.agent._on_ack(msg, sender)
        elif isinstance(msg, _wire.Pong):
            self.agent.sources.on_pong(msg.nonce, sender)
        elif isinstance(msg, _wire.Bye):
            self.on_bye(msg, sender)
        else:
            raise ProtocolError(f"decode does not take {type(msg).__name__}")

    def check_source(
        self, rec: _Room, msg: _wire.Status | _wire.AbortAck, sender: str | None
    ) -> None:
        """With authentication on, a STATUS or ABORT_ACK for a room held here is taken only
        from the key the bootstrap service published for the prefill rank it names, among
        the ranks the room resolved; else :class:`AuthenticationError`, counted
        ``auth_refused``. (One for a room or epoch not held is late, and changes nothing,
        whoever sent it: it is counted ``late_messages`` before this check.)"""
        if sender is None:
            return
        if not any(r.rank_id == msg.rank and r.key == sender for r in rec.sources):
            raise AuthenticationError(
                f"{type(msg).__name__.upper()} for room {msg.room} as prefill rank {msg.rank} "
                f"from {sender}: not that rank's key"
            )

    def on_status(self, msg: _wire.Status, sender: str | None = None) -> None:
        check = partial(self.check_source, msg=msg, sender=sender)
        due = self.agent.table.on_status(
            msg.room, msg.epoch, msg.rank, msg.ok, msg.reason, self.aux_matches, check,
            None if self.agent.landing is None else self.land,  # (no landing area: no copy)
        )
        self.carry_at(msg.room, due)

    def on_ack(self, msg: _wire.AbortAck, sender: str | None = None) -> None:
        check = partial(self.check_source, msg=msg, sender=sender)
        self.carry_at(msg.room, self.agent.table.on_ack(msg.room, msg.epoch, msg.rank, check))

    def carry_at(self, room: int, due: Due) -> None:
        """:meth:`_carry` for what the table made due about ``room``, held here or not (a
        late message is only counted)."""
        rec = self.agent.table.rooms.get(room)
        if rec is not None:
            if due:
                self.agent._carry(rec, due)
            return
        for effect in due:
            match effect:
                case Count(name=name):
                    self.agent.counters.bump(name)
                case _:
                    raise AssertionError(f"decode cannot do {effect!r} without room {room}")

    def on_bye(self, msg: _wire.Bye, sender: str | None = None) -> None:
        """The prefill rank at ``msg.endpoint`` closed after its last engine call (a BYE): it
        counts as drained for every room that names it, those rooms not yet complete fail
        (``PeerLost``), and its bootstrap record is not used again (``Sources.close``). With
        authentication on, only that rank's own key may say so."""
        ranks = {id(r): r for rec in self.agent._rooms.values() for r in rec.sources
                 if r.endpoint == msg.endpoint and r.rank_id == msg.rank}
        known = self.agent.sources.ranks.get(msg.endpoint)
        if known is not None and known.rank_id == msg.rank:
            ranks[id(known)] = known
        if not ranks:
            self.agent.counters.bump("late_messages")  # (no room or registration names it)
            return
        for rank in ranks.values():
            if sender is not None and sender != rank.key:
                raise AuthenticationError(
                    f"BYE as prefill rank {msg.rank} at {msg.endpoint} from {sender}: not "
                    "that rank's key"
                )
        for rank in ranks.values():
            self.agent.sources.close(rank)
            for room_id in list(rank.rooms):
                rec = self.agent._rooms.get(room_id)
                if rec is not None:
                    self.agent._carry(rec, rec.machine.peer_lost(
                        rank.rank_id, f"prefill rank {rank.rank_id} closed"
                    ))
                    self.agent._carry(rec, rec.machine.writer_gone(rank.rank_id))



async def close_rooms(agent: DecodeAgent) -> None:
        """Fail every room the normal way and wait, at most ``close_timeout``, until none
        holds pages for a drain. What is still unproven then is counted and logged, and its
        ``on_release`` never runs: a prefill write may still land there.

        **Cancellation:** run it shielded: cancelling it stops the wait early, with the same
        report.
        """
        for rec in list(agent._rooms.values()):
            agent._carry(rec, rec.machine.close(CLOSING))
        with trio.move_on_after(agent.config.close_timeout):
            await agent.held.wait_value(0)
        unproven = [r for r in agent._rooms.values() if r.machine.holding]
        if unproven:
            agent.counters.bump("rooms_unproven_at_close", len(unproven))
            log.error(
                "decode agent closed with %d room(s) whose pages a prefill write may still "
                "reach (no drain ack, writer not proven gone within %g s): %s; their "
                "on_release will not run",
                len(unproven), agent.config.close_timeout,
                ", ".join(str(r.machine.room) for r in unproven[:20]),
            )
        for rec in list(agent._rooms.values()):
            rec.terminal.set()


def _allocate_landing(agent: DecodeAgent, nbytes: int) -> LandingArea | None:
    """The landing area, or None, logged, when this process cannot allocate it."""
    try:
        return LandingArea(agent.pool, nbytes)
    except MemoryError as exc:
        log.warning("decode rank %d: a landing area of %d bytes could not be allocated "
                    "(%s): landing off", agent.tp_rank, nbytes, exc)
        return None


async def open_landing(agent: DecodeAgent, nbytes: int) -> LandingArea | None:
    """Allocate the agent's landing area (off the loop: zeroing it touches every page) and
    register it with the engine; it is advertised from then on (REGISTER). None, logged,
    when it holds no page, this process cannot allocate it (``landing_bytes`` larger than
    the memory or address space it can have) or the engine refuses it: rooms are then sent
    their own pages.

    **Cancellation:** a cancellation lands only before the engine call starts, or after
    the area is registered (then it is returned: the caller deregisters it)."""
    area = await trio.to_thread.run_sync(_allocate_landing, agent, nbytes)
    if area is None:
        return None
    if not area.usable:
        log.warning("decode rank %d: %d landing bytes hold no page: landing off",
                    agent.tp_rank, nbytes)
        return None
    try:
        await trio.to_thread.run_sync(agent.engine.register, [area.region])
    except Exception as exc:
        log.warning("decode rank %d: landing area not registered (%s): landing off",
                    agent.tp_rank, exc)
        return None
    area.registered = True
    agent.landing = area
    agent.sources.landing = (area.bases, area.pages)
    return area


async def close_landing(agent: DecodeAgent, area: LandingArea) -> None:
    """Deregister the landing area (the agent is closing), a step bounded on its own
    (:func:`~trio_pd.agents._close.unregister`). A range still held by a room whose drain
    was not proven keeps the area's memory for the life of the process: a write may still
    land there (the pool's pages stay held the same way). That is decided before the first
    schedule point. A deregistration that fails or does not return in time keeps the
    memory too: the engine may still hold the area registered.

    **Cancellation:** shielded (the step is): a cancellation is delivered after it."""
    agent.landing = None
    area.registered = False
    await deregister_area(agent.engine, area.region, "the landing area", area,
                          bool(area.reserved), KEPT)


@one_error
@asynccontextmanager
async def open_decode(
    *,
    engine: TransferEngine,
    pool: PoolSpec,
    tp_rank: int = 0,
    tp_size: int = 1,
    kv_heads: int | None = None,
    host: str = "127.0.0.1",
    config: DecodeConfig | None = None,
    metrics: AgentMetrics | None = None,
    token: str | None = None,
    secure: bool | None = None,
    bootstrap_verify: ssl.SSLContext | str | bool = True,
) -> AsyncIterator[DecodeAgent]:
    """Run a decode rank: register ``pool`` with ``engine``, bind the control socket, and serve
    until the block exits.

    Authentication (docs/security.md), as for :func:`~trio_pd.open_prefill`: ``token`` (left
    out: ``TRIO_PD_TOKEN``, else, on loopback, this process's own) is proven to every
    bootstrap service and proves each REGISTER; ``secure`` (None: on, as True; False or
    ``TRIO_PD_SECURE=0``: off, logged) turns on CURVE and the identity checks. A prefill
    instance whose ranks publish no CURVE key (authentication off there) fails this rank's
    rooms with
    :class:`~trio_pd.IncompatiblePeer` when secure, and likewise the other way round.

    ``kv_heads``, when given, is checked against the pool as for :func:`open_prefill`
    (:class:`~trio_pd.ConfigurationError`); the prefill instance's own value is checked against
    this pool when it is resolved (:class:`~trio_pd.IncompatiblePeer` for its rooms).

    On exit the rooms still open are failed and their prefill ranks asked to drain; the agent
    keeps serving, memory registered, until every held room is released on proof or
    ``config.close_timeout`` passes (then they are reported, not released), and only then
    deregisters its memory.

    Errors come out as one exception, not in an ExceptionGroup, as for
    :func:`~trio_pd.open_prefill`: an exception raised in the block comes out as itself.

    **Cancellation:** cancelling the enclosing scope closes the agent as above.
    """
    config = config or DecodeConfig()
    # (a float landing_bytes failed deep in the area's allocation thread, a None deadline
    # in a compare, and a -1 was quietly taken)
    config.check(f"decode rank {tp_rank}")
    _wire.check_advertised_host(host, f"decode rank {tp_rank}")
    security = resolve(what=f"decode rank {tp_rank}", hosts=[host], token=token, secure=secure)
    _descriptors.prepare(f"decode rank {tp_rank}")
    # (a name is resolved here, once, off the I/O thread: libzmq would resolve it there)
    bind = await _names.bind_address(host, f"decode rank {tp_rank}")
    if kv_heads is not None or pool.layout == "mla" or tp_size == 1 or pool.heads > 1:
        try:
            model_kv_heads(pool.layout, pool.heads, pool.first_head, tp_rank, tp_size, kv_heads)
        except ValueError as exc:
            raise ConfigurationError(f"decode rank {tp_rank}: {exc}") from None
    agent = DecodeAgent(
        engine=engine, pool=pool, tp_rank=tp_rank, tp_size=tp_size, host=bind, config=config,
        security=security,
    )
    agent.sources.verify = bootstrap_verify
    if metrics is not None:
        metrics.attach(agent)  # sets agent.metrics; exports statistics() at scrape time
    regions = pool.regions()
    registered = False
    landing: LandingArea | None = None
    try:
        await trio.to_thread.run_sync(engine.register, regions)
        registered = True
        if config.landing_bytes > 0 and host_source(pool):
            landing = await open_landing(agent, config.landing_bytes)
        async with trio.open_nursery() as nursery:
            agent.sources.nursery = nursery
            # The listener, the timers and the heartbeat outlive a cancellation of the block:
            # closing waits for drain acks, so they stop only when the close is done.
            services = [trio.CancelScope(shield=True) for _ in range(3)]
            nursery.start_soon(serve, services[0], partial(agent.control.serve, agent._handle))
            nursery.start_soon(serve, services[1], agent.timers.run)
            nursery.start_soon(serve, services[2], agent.sources.heartbeat)
            try:
                yield agent
            finally:
                with trio.CancelScope(shield=True):
                    await close_rooms(agent)
                for scope in services:
                    scope.cancel(CLOSING)
                nursery.cancel_scope.cancel(CLOSING)
    finally:
        agent.sources.nursery = None
        # shielded (a cancelled block still closes everything), each step bounded on its
        # own (_close): one that hangs skips none of the others
        with trio.CancelScope(shield=True):
            await wait_probe_threads(agent.sources.probe_threads.limiter, config.ack_timeout)
            if registered:
                await unregister(engine, regions, f"decode rank {tp_rank}'s pool")
            if landing is not None:
                await close_landing(agent, landing)
            await bounded("closing the DP routers' bootstrap clients", agent.router.aclose)
            await bounded("closing the control plane", agent.control.aclose)
