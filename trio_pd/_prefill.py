"""The prefill agent: owns the engine's source pools, receives decode metadata, moves chunks,
publishes each room's outcome, and acks drains.

How a room lives here (SPEC §5):

* ``sender.send(pages)`` *admits* a chunk: it takes a lease on the chunk's source pages at once
  (:class:`~trio_pd._state.LeaseBook`), or raises if admission is closed (I2).
* A worker task runs the chunk inside the room's cancel scope. The chunk's engine calls run in
  one nursery (children, or its body when there is one destination), so the chunk ends only
  when every call has returned, failed ones' siblings included (drain by structure, I3).
* Each engine call goes through :meth:`PrefillAgent._engine_call`, onto the destination
  peer's :class:`~trio_pd._lane.Lane` (one thread per decode peer, calls in order). If the room
  was aborted while the call was still queued, it raises Cancelled *without starting it*; once
  started, its result is always observed. That single point decides "never started" (retire)
  from "started" (wait for it).
* The room's outcome is decided under the room's ``trio.Lock`` with no checkpoint between the
  check and the non-blocking sends (:meth:`PrefillAgent._publish_locked`).
* ABORT closes admission first, then registers the ack target, then acks once the room holds
  no lease (:meth:`PrefillAgent._on_abort`).
"""

from __future__ import annotations

import ctypes
import logging
import math
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import trio
import trio.lowlevel

from . import _wire
from ._bootstrap import BootstrapClient, PrefillRankInfo
from ._control import ControlPlane
from ._errors import (
    EngineError,
    PeerLost,
    ProtocolError,
    RegionError,
    TransferAborted,
    TransferError,
)
from ._lane import Lane, LaneClosed
from ._lazy import LazyEvent
from ._plan import (
    Blocks,
    PoolSpec,
    RegionTable,
    aux_writer,
    concat,
    plan_aux,
    plan_pages,
    served_decode_ranks,
    validate_blocks,
    validate_pages,
    write_heads,
)
from ._state import AckBook, KVPoll, Lease, LeaseBook, Outcome, StatusCell
from ._stats import AgentStatistics, Counters
from ._timers import Timers
from .engines import TransferEngine, start_write

if TYPE_CHECKING:
    from .metrics import AgentMetrics

log = logging.getLogger("trio_pd.prefill")

#: bytes 0..15 of every aux row are trio_pd's: (room, epoch) as little-endian int64, so decode
#: can tell a row that belongs to someone else (SPEC §3).
AUX_STAMP = struct.Struct("<qq")

#: why a closing agent fails the rooms it still holds (and tells their decode ranks)
CLOSED = "prefill agent closed"


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Knobs of a prefill agent. Deadlines are in seconds."""

    workers: int = 8
    #: writes to one decode peer that may be in flight at once (started, not yet waited for):
    #: 2 keeps the engine's queue fed while the lane waits for the oldest
    inflight_per_peer: int = 2
    #: a room's chunks that wait in the queue behind the one a worker takes join its engine
    #: call, up to this many pages in all (1: one call per chunk). Only a backlog coalesces:
    #: a chunk that is alone in the queue goes as it is. Fewer, larger calls cost the event
    #: loop less per byte (on the 2-core bench box NIXL 2.2 -> 3.0 GB/s with four 16-page
    #: chunks per request); an aborted room waits for at most one such call to drain
    coalesce_pages: int = 64
    #: raise the lanes' threads' nice value by this much (Linux; 0: leave them at the
    #: process's priority). On a host whose cores are all busy the event loop, which serves
    #: every request, then preempts the threads that wait on engine calls. On the 2-core
    #: bench box 10 took loop lateness p99 from 5.6-6.1 ms to 3.3-3.4 ms and the load from
    #: 1.27-1.45 to 1.38-1.59 GB/s; with idle cores it changes nothing
    lane_nice: int = 10
    #: a room whose decode metadata has not arrived by then fails (it frees nothing)
    bootstrap_timeout: float = 30.0
    #: how long after an engine error its pages stay quarantined; None: the engine's own
    #: per-call deadline (``write_deadline_s``) plus a margin
    quarantine_fence: float | None = None
    #: how long an ABORT for an unknown room refuses a late TRANSFER for that (room, epoch)
    tombstone_ttl: float = 120.0
    sndhwm: int = 10_000
    #: bounded queue of TRANSFER metadata for rooms the scheduler has not created yet
    max_pending_meta: int = 100_000
    #: a Failed STATUS that finds the decode peer's socket full is retried every 50 ms for
    #: this long, then dropped and counted (``status_dropped``); the decode room still fails
    #: at its own waiting deadline. Retries also stop once the peer re-registers.
    failed_status_retry: float = 60.0


@dataclass(eq=False, slots=True)
class _DecodePeer:
    endpoint: str
    decode_rank: int
    decode_tp: int
    session: str
    pool: PoolSpec
    regions: RegionTable
    #: the thread that makes every engine call to this peer, in order
    lane: Lane
    #: the heads this prefill rank writes there (None: no KV bytes), and whether it writes
    #: the aux row: fixed by the two topologies, so worked out once at REGISTER
    heads: tuple[int, int] | None
    writes_aux: bool
    ready: trio.Event = field(default_factory=trio.Event)
    failed: bool = False
    probing: bool = False


@dataclass(eq=False, slots=True)
class _Target:
    peer: _DecodePeer
    epoch: int
    aux_slot: int
    dst_pages: npt.NDArray[np.int64]


@dataclass(eq=False, slots=True)
class _Chunk:
    lease: Lease
    pages: npt.NDArray[np.int64]
    start: int
    last: bool


@dataclass(eq=False, slots=True)
class _Publish:
    """A job that only publishes a room's outcome (after an abort or a failure)."""


class _Call:
    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = "not-started"  # -> "done" | "error"


@dataclass(eq=False, slots=True)
class _Room:
    room: int
    num_pages: int
    aux_slot: int
    on_release: Callable[[], None] | None
    cell: StatusCell = field(default_factory=StatusCell)
    leases: LeaseBook = field(init=False)
    acks: AckBook = field(default_factory=AckBook)
    _lock: trio.Lock | None = None
    targets: dict[int, _Target] = field(default_factory=dict)  # decode rank -> target
    expected_targets: int | None = None
    epoch: int | None = None
    waiting: list[_Chunk] = field(default_factory=list)  # admitted before metadata arrived
    # dicts used as sets: an empty dict is a third of an empty set, and rooms are many
    queued: dict[_Chunk, None] = field(default_factory=dict)  # with the workers, not started
    scopes: dict[trio.CancelScope, None] = field(default_factory=dict)
    sent_pages: int = 0
    last_admitted: bool = False
    published: bool = False
    terminal: LazyEvent = field(default_factory=LazyEvent)
    released: LazyEvent = field(default_factory=LazyEvent)

    def __post_init__(self) -> None:
        self.leases = LeaseBook(self.room)

    @property
    def lock(self) -> trio.Lock:
        """The publication lock, made when the room first publishes (see _lazy)."""
        if self._lock is None:
            self._lock = trio.Lock()
        return self._lock

    @property
    def ready(self) -> bool:
        return self.expected_targets is not None and len(self.targets) >= self.expected_targets


class PrefillSender:
    """The scheduler's handle for one room on a prefill rank (≈ SGLang's ``KVSender``).

    Create with :meth:`PrefillAgent.sender`. Hand chunks over with :meth:`send`; the last one
    (``last=True``) also carries the aux row. The room's source pages belong to trio_pd from
    the first ``send`` until ``on_release`` runs (exactly once, when nothing can read them).
    """

    def __init__(self, agent: PrefillAgent, room: _Room) -> None:
        self._agent = agent
        self._room = room

    @property
    def room(self) -> int:
        return self._room.room

    def poll(self) -> KVPoll:
        """The room's status now. Never blocks; a terminal status never changes again."""
        return self._room.cell.status

    @property
    def failure(self) -> TransferError | None:
        """Why the room failed (None unless Failed)."""
        return self._room.cell.failure

    def send(self, pages: npt.ArrayLike, *, last: bool = False) -> None:
        """Admit the next chunk: ``pages`` are source page ids, in request order. Non-blocking.

        Raises :class:`~trio_pd._state.AdmissionClosed` if the room was aborted or failed, and
        :class:`ProtocolError` for page ids outside the pool or a chunk past ``num_pages``.
        """
        self._agent._admit(self._room, np.asarray(pages, dtype=np.int64).reshape(-1), last)

    def abort(self, reason: str = "aborted by the prefill scheduler") -> None:
        """Abort the room: close admission, cancel work not yet started, publish Failed.
        Engine calls already running finish; ``on_release`` runs once they have. Idempotent."""
        self._agent._close_room(self._room, TransferAborted(reason))

    def abort_from_thread(self, reason: str = "aborted from a thread") -> None:
        """:meth:`abort` for code that runs in a thread outside trio."""
        trio.from_thread.run_sync(self.abort, reason, trio_token=self._agent._token)

    async def wait(self) -> KVPoll:
        """Wait until the room is terminal; return Success or Failed.

        **Cancellation:** cancelling the wait does not abort the room.
        """
        await self._room.terminal.wait()
        return self._room.cell.status

    async def wait_released(self) -> None:
        """Wait until the room's source pages have been handed back.

        **Cancellation:** cancelling the wait changes nothing.
        """
        await self._room.released.wait()


class PrefillAgent:
    """One prefill rank. Make one with :func:`open_prefill`."""

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
    ) -> None:
        self.metrics = metrics  # prometheus hooks (trio_pd.metrics), optional
        self.engine = engine
        self.pool = pool
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.kv_heads = kv_heads
        self.config = config
        self.counters = Counters()
        self.control = control or ControlPlane(host, self.counters, sndhwm=config.sndhwm)
        #: probes get their own thread: a probe of a hung peer can take a minute and must
        #: not hold up a lane
        self._probe_limiter = trio.CapacityLimiter(1)
        #: how an engine call reaches its lane's thread: ``run_engine_call(lane, fn)``; the
        #: schedule explorer swaps in a thread-free twin with the same contract (Cancelled
        #: only before the call starts)
        self.run_engine_call: Callable[[Lane, Callable[[], object]], Awaitable[object]] = (
            Lane.run_sync
        )
        self._jobs_tx, self._jobs_rx = trio.open_memory_channel[tuple[_Room, _Chunk | _Publish]](
            math.inf
        )
        self._rooms: dict[int, _Room] = {}
        self._peers: dict[str, _DecodePeer] = {}
        self._pending_meta: dict[int, dict[int, tuple[_wire.Transfer, npt.NDArray[np.int32]]]] = {}
        #: room -> epochs aborted by decode before this rank knew the room: a late TRANSFER
        #: for one is refused, and a sender created for the room fails at once
        self._tombstones: dict[int, set[int]] = {}
        #: rooms that failed and were forgotten: a late TRANSFER for one is answered Failed
        self._failed_recently: dict[int, str] = {}
        self.timers = Timers()
        self._nursery: trio.Nursery | None = None
        self._token = trio.lowlevel.current_trio_token()
        fence = config.quarantine_fence
        if fence is None:
            fence = float(getattr(engine, "write_deadline_s", 10.0)) + 1.0
        self._fence = fence

    # ------------------------------------------------------------------ public API

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint (ZeroMQ)."""
        return self.control.endpoint

    def sender(
        self,
        room: int,
        *,
        num_pages: int,
        aux_slot: int,
        on_release: Callable[[], None] | None = None,
    ) -> PrefillSender:
        """Create the handle for ``room``: ``num_pages`` source pages will be sent in chunks,
        and aux row ``aux_slot`` with the last one. ``on_release`` runs exactly once, when the
        room is over and no engine call can still read its pages."""
        if room in self._rooms:
            raise TransferError(f"room {room} is still in use on prefill rank {self.tp_rank}")
        if not 0 <= aux_slot < self.pool.aux_slots:
            raise ProtocolError(f"aux slot {aux_slot} outside [0, {self.pool.aux_slots})")
        if num_pages < 0:
            raise ValueError("num_pages must be >= 0")
        r = _Room(room, num_pages, aux_slot, on_release)
        self._rooms[room] = r
        self.timers.after(self.config.bootstrap_timeout, partial(self._bootstrap_due, r))
        if room in self._tombstones:
            # decode aborted this room before the scheduler created it here: fail it now
            # rather than at the bootstrap deadline
            self._close_room(r, TransferAborted(f"room {room} was aborted by decode"))
        for msg, pages in self._pending_meta.pop(room, {}).values():
            try:
                self._add_target(r, msg, pages)
            except ProtocolError as exc:  # the room failed; the scheduler reads it in poll()
                self.counters.bump("refused_messages")
                log.warning("room %d: refused a queued TRANSFER: %s", room, exc)
        return PrefillSender(self, r)

    def statistics(self) -> AgentStatistics:
        live = sum(len(r.leases.live) for r in self._rooms.values())
        quarantined = sum(len(r.leases.quarantined) for r in self._rooms.values())
        return self.counters.snapshot(
            rooms_active=len(self._rooms), leases_live=live, leases_quarantined=quarantined
        )

    # ------------------------------------------------------------------ admission

    def _admit(self, room: _Room, pages: npt.NDArray[np.int64], last: bool) -> None:
        if room.last_admitted:
            raise ProtocolError(f"room {room.room}: a chunk after the last one")
        validate_pages(pages, self.pool.num_pages)
        end = room.sent_pages + len(pages)
        if end > room.num_pages or (last and end != room.num_pages):
            raise ProtocolError(
                f"room {room.room}: chunk ends at page {end} of {room.num_pages}"
                + (" (the last chunk must end at num_pages)" if last else "")
            )
        lease = room.leases.admit(len(pages))  # raises AdmissionClosed: I2
        chunk = _Chunk(lease, pages, room.sent_pages, last)
        room.sent_pages = end
        room.last_admitted = last
        if room.ready:
            room.cell.advance(KVPoll.Transferring)
            self._submit(room, chunk)
        else:
            room.waiting.append(chunk)

    # ------------------------------------------------------------------ the chunk path

    def _submit(self, room: _Room, chunk: _Chunk) -> None:
        room.queued[chunk] = None
        self._jobs_tx.send_nowait((room, chunk))

    async def _worker(self) -> None:
        async for room, job in self._jobs_rx:
            if isinstance(job, _Publish):
                await self._publish(room)
                self._settle_room(room)
            elif room.queued:  # else cancelled, or already taken into an earlier call
                await self._run_chunk(room, self._take_chunks(room))

    def _take_chunks(self, room: _Room) -> _Chunk:
        """The room's oldest queued chunk, joined by the chunks queued right behind it
        (contiguous, up to ``coalesce_pages`` pages): one chunk, one lease, one engine call.

        A job names a chunk but a worker takes the room's oldest: jobs and chunks are equal in
        number, and each job that finds the queue non-empty takes at least one chunk, so every
        chunk is taken, in admission order (a batch of woken workers runs in any order)."""
        first = next(iter(room.queued))
        del room.queued[first]
        npages = len(first.pages)
        limit = self.config.coalesce_pages
        group = [first]
        for following in room.queued:  # (admission order: the dict keeps insertion order)
            n = len(following.pages)
            if following.start != first.start + npages or npages + n > limit:
                break
            group.append(following)
            npages += n
        if len(group) == 1:
            return first
        for following in group[1:]:
            del room.queued[following]
        lease = room.leases.merge([c.lease for c in group])
        self.counters.bump("chunks_coalesced", len(group) - 1)
        pages = np.concatenate([c.pages for c in group])
        return _Chunk(lease, pages, first.start, group[-1].last)

    async def _run_chunk(self, room: _Room, chunk: _Chunk) -> None:  # noqa: ASYNC910
        # (every path checkpoints: _transfer_chunk's nursery exit is always a schedule point)
        calls: list[_Call] = []
        failure: TransferError | None = None
        try:
            try:
                with trio.CancelScope() as scope:
                    room.scopes[scope] = None
                    if room.leases.closed:
                        scope.cancel("room closed before the chunk started")
                    try:
                        await self._transfer_chunk(room, chunk, calls)
                    finally:
                        room.scopes.pop(scope, None)
            except* Exception as group:  # planning, validation or engine: the room fails
                failure = _room_error(group)
        finally:
            # Synchronous, so it runs even while an outer cancellation propagates.
            self._settle_chunk(room, chunk, calls, failure)
        if self._publish_due(room):  # (most chunks are not a room's last: no extra round)
            await self._publish(room)
        self._settle_room(room)

    def _settle_chunk(
        self, room: _Room, chunk: _Chunk, calls: list[_Call], failure: TransferError | None
    ) -> None:
        states = {c.state for c in calls}
        if "error" in states:
            outcome = Outcome.ERROR
        elif "done" in states:
            outcome = Outcome.COMPLETED
        else:
            outcome = Outcome.CANCELLED
        room.leases.settle(chunk.lease, outcome)
        if outcome is Outcome.ERROR:
            self.counters.bump("quarantined")
            self._quarantine(room, chunk.lease, [t.peer for t in room.targets.values()])
        if failure is not None:
            self._close_room(room, failure)
        elif chunk.last and not room.leases.closed:
            room.leases.close()  # concluded: nothing more can be admitted

    async def _transfer_chunk(self, room: _Room, chunk: _Chunk, calls: list[_Call]) -> None:
        """The chunk's engine calls, one per destination rank, in one nursery: it exits only
        when every one has (SPEC §5.1, scenario 1 and 2). Each starts as a child as soon as
        it is planned; with one destination (the common case) the call runs in the nursery's
        body instead, which the nursery waits for just the same: no task spawn per chunk."""
        single = len(room.targets) == 1
        async with trio.open_nursery() as nursery:
            for target in room.targets.values():
                if not target.peer.ready.is_set():
                    await target.peer.ready.wait()  # not started yet: cancellable
                blocks = self._plan_chunk(room, chunk, target)
                if len(blocks.lens) == 0:
                    continue  # a dummy rank for this destination: bookkeeping only
                if target.peer.failed:
                    raise PeerLost(f"decode peer {target.peer.endpoint} is marked failed")
                call = _Call()
                calls.append(call)
                if single:
                    await self._engine_call(target.peer, blocks, call)
                else:
                    nursery.start_soon(self._engine_call, target.peer, blocks, call)

    def _plan_chunk(self, room: _Room, chunk: _Chunk, target: _Target) -> Blocks:
        peer = target.peer
        parts: list[Blocks] = []
        if peer.heads is not None and len(chunk.pages):
            dst = target.dst_pages[chunk.start : chunk.start + len(chunk.pages)]
            mha_heads = peer.heads if self.pool.layout == "mha" else None
            # both page lists were validated when they arrived (_admit, _add_target)
            parts.append(
                plan_pages(
                    self.pool, peer.pool, chunk.pages, dst, heads=mha_heads, pages_checked=True
                )
            )
        if chunk.last and peer.writes_aux:
            self._stamp_aux(room, target.epoch)
            parts.append(plan_aux(self.pool, peer.pool, room.aux_slot, target.aux_slot))
        blocks = parts[0] if len(parts) == 1 else concat(parts)
        validate_blocks(blocks, peer.regions)  # I8: nothing lands outside what decode registered
        return blocks

    def _stamp_aux(self, room: _Room, epoch: int) -> None:
        addr = self.pool.aux_base + room.aux_slot * self.pool.aux_item_len
        ctypes.memmove(addr, AUX_STAMP.pack(room.room, epoch), AUX_STAMP.size)

    async def _engine_call(self, peer: _DecodePeer, blocks: Blocks, call: _Call) -> None:
        """The one place an engine write happens.

        The peer's lane (:meth:`Lane.run_sync <trio_pd._lane.Lane.run_sync>`, through
        ``run_engine_call``) is the decision point: if the room's scope is cancelled while the
        call is still queued, it raises Cancelled and the call never happened (``call.state``
        stays "not-started"); once the lane's thread took it, the caller waits for it whatever
        is cancelled, so its result is always observed.

        **Cancellation:** before the start, the call is skipped; after it, the call completes.
        """
        write = partial(start_write, self.engine, peer.session, blocks.src, blocks.dst, blocks.lens)
        t0 = time.perf_counter()
        try:
            await self.run_engine_call(peer.lane, write)
        except trio.Cancelled:
            raise
        except LaneClosed as exc:  # never started: the peer re-registered with a new engine
            raise PeerLost(
                f"decode peer {peer.endpoint} re-registered with another engine session"
            ) from exc
        except BaseException:
            call.state = "error"
            self.counters.bump("engine_errors")
            if self.metrics is not None:
                self.metrics.observe_write(self.engine.name, time.perf_counter() - t0, 0, ok=False)
            raise
        call.state = "done"
        nbytes = int(blocks.lens.sum())
        self.counters.bump("engine_calls")
        self.counters.bump("bytes_written", nbytes)
        if self.metrics is not None:
            self.metrics.observe_write(self.engine.name, time.perf_counter() - t0, nbytes)

    # ------------------------------------------------------------------ publication

    def _publish_due(self, room: _Room) -> bool:
        if room.published:
            return False
        failed = room.cell.status is KVPoll.Failed
        return (failed or room.leases.closed) and not room.leases.live and (failed or room.ready)

    async def _publish(self, room: _Room) -> None:
        """Decide and publish the room's outcome, once, under the room's lock."""
        if not self._publish_due(room):
            await trio.lowlevel.checkpoint()  # a checkpoint on every path
            return
        async with room.lock:
            self._publish_locked(room)

    def _publish_locked(self, room: _Room) -> None:
        """Check, decide, send, update: synchronous, so nothing can interleave between the
        check and the sends (SPEC §5.4). A full socket fails the room here and now; it never
        makes us wait with the lock held."""
        if room.published:
            return
        room.published = True
        ok = room.cell.status is not KVPoll.Failed
        reason = "" if ok else _reason(room.cell.failure)
        for target in room.targets.values():
            status = self._status(room.room, target.epoch, ok, reason)
            if self.control.send_nowait(target.peer.endpoint, status):
                continue
            if ok:  # back-pressure: the room fails here and now; the lock is not held on
                ok = False
                reason = f"STATUS to {target.peer.endpoint} refused: its socket is full"
                room.cell.fail(TransferError(reason))
                self.counters.bump("failed")
            self._retry_failed_status(room.room, target.epoch, target.peer, reason)
        if ok:
            room.cell.advance(KVPoll.Success)
            self.counters.bump("succeeded")
        self._on_status_change(room)

    def _status(self, room: int, epoch: int, ok: bool, reason: str) -> _wire.Status:
        return _wire.Status(
            v=_wire.WIRE_VERSION, room=room, epoch=epoch, rank=self.tp_rank, ok=ok, reason=reason
        )

    def _retry_failed_status(self, room: int, epoch: int, peer: _DecodePeer, reason: str) -> None:
        """A Failed STATUS must get through (decode would otherwise wait for its own
        deadline): retry it shortly, outside any lock, for a bounded time."""
        status = self._status(room, epoch, False, reason)
        give_up = trio.current_time() + self.config.failed_status_retry

        def retry() -> None:
            if self._peers.get(peer.endpoint) is not peer:
                return  # the peer re-registered (its old rooms are gone) or was forgotten
            if self.control.send_nowait(peer.endpoint, status):
                return
            if trio.current_time() >= give_up:
                self.counters.bump("status_dropped")
                log.warning(
                    "room %d: Failed STATUS to %s dropped after %g s of a full socket",
                    room, peer.endpoint, self.config.failed_status_retry,
                )
                return
            self.timers.after(0.05, retry)

        self.timers.after(0.05, retry)

    # ------------------------------------------------------------------ closing, acks, release

    def _close_room(self, room: _Room, error: TransferError) -> None:
        """Close admission and fail the room (I2: this happens before any ack target is
        registered). Synchronous. Work not yet started is cancelled; chunks already inside the
        engine finish."""
        room.leases.close()
        if room.cell.fail(error):
            self.counters.bump("aborted" if isinstance(error, TransferAborted) else "failed")
            if self.metrics is not None:
                self.metrics.observe_failure(error)
        for scope in list(room.scopes):
            scope.cancel(f"room {room.room}: {error}")
        # chunks that never reached a worker are cancelled now, not when a worker gets to
        # them: the drain ack must not wait behind other rooms' work
        for chunk in (*room.waiting, *room.queued):
            room.leases.settle(chunk.lease, Outcome.CANCELLED)
        room.waiting.clear()
        room.queued.clear()
        self._on_status_change(room)
        if not room.published:
            self._jobs_tx.send_nowait((room, _Publish()))
        self._settle_room(room)

    def _on_status_change(self, room: _Room) -> None:
        if room.cell.terminal:
            room.terminal.set()

    def _settle_room(self, room: _Room) -> None:
        """Run whatever a change of leases made due: acks, then the release, then forgetting
        the room once it holds nothing and owes nothing."""
        for endpoint, epoch in room.acks.due(room.leases):
            self._send_ack(room.room, epoch, endpoint)
        if room.leases.take_release():
            if room.on_release is not None:
                try:
                    room.on_release()
                except Exception:
                    log.exception("room %d: on_release raised", room.room)
            room.released.set()
        if room.released.is_set() and room.published and self._rooms.get(room.room) is room:
            del self._rooms[room.room]
            if room.cell.status is KVPoll.Failed:
                self._failed_recently[room.room] = _reason(room.cell.failure)
                self.timers.after(
                    self.config.bootstrap_timeout,
                    partial(self._failed_recently.pop, room.room, None),
                )

    def _send_ack(self, room: int, epoch: int, endpoint: str) -> None:
        ack = _wire.AbortAck(v=_wire.WIRE_VERSION, room=room, epoch=epoch, rank=self.tp_rank)
        if self.control.send_nowait(endpoint, ack):
            self.counters.bump("acks_sent")
        else:  # the peer is not reading: try again shortly, the ack must get through
            self.timers.after(0.05, partial(self._send_ack, room, epoch, endpoint))

    def _quarantine(self, room: _Room, lease: Lease, peers: list[_DecodePeer]) -> None:
        """An errored lease: its pages stay out until the engine provably cannot touch them."""
        for peer in peers:
            self._mark_failed(peer)
        self.timers.after(self._fence, partial(self._fence_passed, room, lease, peers))

    def _fence_passed(self, room: _Room, lease: Lease, peers: list[_DecodePeer]) -> None:
        """The engine's own deadline for the failed call has passed, so the call has
        returned; requests it left queued may still be on their way. End the quarantine once
        every peer it wrote to answers a probe (the link is moving again, so what was queued
        has been delivered) or is proven gone. A peer that does not answer keeps the pages
        out for another fence."""
        if lease not in room.leases.quarantined:
            return
        if self._nursery is None:
            return
        self._nursery.start_soon(self._confirm_quarantine_end, room, lease, peers)

    async def _confirm_quarantine_end(
        self, room: _Room, lease: Lease, peers: list[_DecodePeer]
    ) -> None:
        answered = True
        with trio.move_on_after(self._fence) as scope:
            await trio.lowlevel.checkpoint()
            for peer in peers:
                await trio.to_thread.run_sync(
                    self.engine.probe, peer.session, limiter=self._probe_limiter
                )
        if scope.cancelled_caught:
            answered = False
        if answered:
            self._end_quarantine(room, lease)
        elif lease in room.leases.quarantined:
            self.timers.after(self._fence, partial(self._fence_passed, room, lease, peers))

    def _end_quarantine(self, room: _Room, lease: Lease) -> None:
        if lease in room.leases.quarantined:
            room.leases.end_quarantine(lease)
            self.counters.bump("released_after_quarantine")
            self._settle_room(room)

    def _mark_failed(self, peer: _DecodePeer) -> None:
        if not peer.failed:
            peer.failed = True
            self.counters.bump("peers_failed")
        if not peer.probing and self._nursery is not None:
            peer.probing = True
            self._nursery.start_soon(self._probe_peer, peer)

    async def _probe_peer(self, peer: _DecodePeer) -> None:
        """Is a failed peer's engine alive? Alive: it may be written again. Gone: the pages of
        its quarantined leases can go back now (the writer's target is proven gone)."""
        try:
            alive = False
            with trio.move_on_after(self._fence):
                alive = await trio.to_thread.run_sync(
                    self.engine.probe, peer.session, limiter=self._probe_limiter
                )
        finally:
            peer.probing = False
        if alive:
            peer.failed = False
            return
        self.counters.bump("peers_lost")
        for room in list(self._rooms.values()):
            if any(t.peer is peer for t in room.targets.values()):
                for lease in list(room.leases.quarantined):
                    self._end_quarantine(room, lease)

    # ------------------------------------------------------------------ control messages

    def _handle(self, msg: _wire.Message, pages: npt.NDArray[np.int32] | None) -> None:
        if isinstance(msg, _wire.Transfer):
            assert pages is not None
            self._on_transfer(msg, pages)
        elif isinstance(msg, _wire.Abort):
            self._on_abort(msg)
        elif isinstance(msg, _wire.Register):
            self._on_register(msg)
        elif isinstance(msg, _wire.Ping):
            pong = _wire.Pong(v=_wire.WIRE_VERSION, nonce=msg.nonce, rank=self.tp_rank)
            self.control.send_nowait(msg.endpoint, pong)
        else:
            raise ProtocolError(f"prefill does not take {type(msg).__name__}")

    def _on_register(self, msg: _wire.Register) -> None:
        if msg.engine != self.engine.name:
            raise ProtocolError(
                f"decode uses engine {msg.engine!r}, this rank {self.engine.name!r}"
            )
        pool = msg.pool.to_spec()
        if pool.layout != self.pool.layout:
            raise ProtocolError(f"decode layout {pool.layout} != prefill {self.pool.layout}")
        old = self._peers.get(msg.endpoint)
        if old is not None and old.session == msg.session:
            lane = old.lane  # the same destination engine keeps its lane: one FIFO per engine
        else:
            lane = Lane(
                f"{msg.endpoint} ({msg.session})",
                depth=self.config.inflight_per_peer,
                nice=self.config.lane_nice,
            )
            if old is not None:  # a new engine behind the endpoint (decode restarted)
                old.lane.close()  # what it has queued still runs; later calls: LaneClosed
                self.control.forget(msg.endpoint)
        peer = _DecodePeer(
            msg.endpoint,
            msg.decode_rank,
            msg.decode_tp,
            msg.session,
            pool,
            RegionTable(pool.regions()),
            lane,
            write_heads(
                self.tp_rank, msg.decode_rank, self.tp_size, msg.decode_tp, self.kv_heads,
                self.pool.layout,
            ),
            aux_writer(msg.decode_rank, self.tp_size, msg.decode_tp) == self.tp_rank,
        )
        self._peers[msg.endpoint] = peer
        assert self._nursery is not None
        self._nursery.start_soon(self._add_peer, peer, msg.engine_meta)

    async def _add_peer(self, peer: _DecodePeer, meta: bytes) -> None:
        try:
            await self.run_engine_call(peer.lane, partial(self.engine.add_peer, peer.session, meta))
        except Exception as exc:
            log.warning("could not add decode peer %s: %s", peer.endpoint, exc)
            self._mark_failed(peer)
            await trio.lowlevel.checkpoint()
        peer.ready.set()

    def _on_transfer(self, msg: _wire.Transfer, pages: npt.NDArray[np.int32]) -> None:
        if msg.epoch in self._tombstones.get(msg.room, ()):
            # A decode rank aborted this (room, epoch) after it concluded here. Another rank's
            # TRANSFER can still be on its way (prefill failed the room before every rank's
            # metadata arrived; the others heard the Failed STATUS and aborted): answer it,
            # or that rank holds its pages until its own waiting deadline.
            self.counters.bump("late_messages")
            self._refuse_transfer(msg, f"room {msg.room} was aborted before this TRANSFER came")
            return
        room = self._rooms.get(msg.room)
        if room is None and msg.room in self._failed_recently:
            self._refuse_transfer(msg, self._failed_recently[msg.room])
            return
        if room is None:
            # Checked now, not when the scheduler creates the room: a bad or stray TRANSFER
            # must neither displace a good one nor surface later in sender().
            peer = self._peers.get(msg.endpoint)
            if peer is None:
                raise ProtocolError(f"TRANSFER from unregistered endpoint {msg.endpoint}")
            validate_pages(pages, peer.pool.num_pages)
            if not 0 <= msg.aux_slot < peer.pool.aux_slots:
                raise ProtocolError(f"aux slot {msg.aux_slot} outside the decode aux buffer")
            if msg.decode_rank in self._pending_meta.get(msg.room, {}):
                raise ProtocolError(
                    f"a second TRANSFER for room {msg.room} from decode rank {msg.decode_rank}"
                )
            pending = self._pending_meta.setdefault(msg.room, {})
            if len(self._pending_meta) > self.config.max_pending_meta:
                self._pending_meta.pop(msg.room)
                raise ProtocolError("too many TRANSFERs for rooms this rank does not know")
            if not pending:
                self.timers.after(
                    self.config.bootstrap_timeout,
                    partial(self._pending_meta.pop, msg.room, None),
                )
            pending[msg.decode_rank] = (msg, pages)
            return
        self._add_target(room, msg, pages)

    def _add_target(self, room: _Room, msg: _wire.Transfer, pages: npt.NDArray[np.int32]) -> None:
        if room.leases.closed or room.published:
            if room.cell.status is KVPoll.Failed:
                self._refuse_transfer(msg, _reason(room.cell.failure))
            else:
                self.counters.bump("late_messages")
            return
        peer = self._peers.get(msg.endpoint)
        try:
            if peer is None:
                raise ProtocolError(f"TRANSFER from unregistered endpoint {msg.endpoint}")
            if room.epoch is not None and msg.epoch != room.epoch:
                raise ProtocolError(
                    f"room {room.room}: epoch {msg.epoch} disagrees with {room.epoch}"
                )
            if msg.num_pages != room.num_pages:
                raise ProtocolError(
                    f"room {room.room}: decode sent {msg.num_pages} pages, prefill has "
                    f"{room.num_pages}"
                )
            validate_pages(pages, peer.pool.num_pages)
            if not 0 <= msg.aux_slot < peer.pool.aux_slots:
                raise ProtocolError(f"aux slot {msg.aux_slot} outside the decode aux buffer")
        except ProtocolError as exc:
            self._close_room(room, exc)
            if peer is not None:  # that decode rank must not wait for its own deadline
                self._refuse_transfer(msg, _reason(exc))
            raise
        room.epoch = msg.epoch
        room.targets[peer.decode_rank] = _Target(
            peer, msg.epoch, msg.aux_slot, pages.astype(np.int64)
        )
        room.expected_targets = len(served_decode_ranks(self.tp_rank, self.tp_size, peer.decode_tp))
        if room.ready:
            room.cell.advance(KVPoll.WaitingForInput)
            if room.waiting:
                room.cell.advance(KVPoll.Transferring)
            for chunk in room.waiting:
                self._submit(room, chunk)
            room.waiting.clear()

    def _expire_tombstone(self, room: int, epoch: int) -> None:
        epochs = self._tombstones.get(room)
        if epochs is not None:
            epochs.discard(epoch)
            if not epochs:
                del self._tombstones[room]

    def _refuse_transfer(self, msg: _wire.Transfer, reason: str) -> None:
        """The room already failed here: tell that decode rank now rather than let it wait
        (registered ranks only: a stray endpoint gets no socket of ours)."""
        peer = self._peers.get(msg.endpoint)
        if peer is not None:
            self._send_failed(msg.room, msg.epoch, peer, reason)

    def _send_failed(self, room: int, epoch: int, peer: _DecodePeer, reason: str) -> None:
        """A Failed STATUS to ``peer``, retried shortly if its socket is full."""
        if not self.control.send_nowait(peer.endpoint, self._status(room, epoch, False, reason)):
            self._retry_failed_status(room, epoch, peer, reason)

    def _on_abort(self, msg: _wire.Abort) -> None:
        """ABORT from a decode rank: close admission, then register the ack target, then ack
        if nothing is held (SPEC §5.5). The order is the invariant I2."""
        room = self._rooms.get(msg.room)
        if room is None or (room.epoch is not None and room.epoch != msg.epoch):
            # Unknown or concluded: rooms are forgotten only once they hold nothing, so this
            # (room, epoch) provably holds nothing. A late TRANSFER for it will be refused.
            self._pending_meta.pop(msg.room, None)
            epochs = self._tombstones.setdefault(msg.room, set())
            if msg.epoch not in epochs:
                epochs.add(msg.epoch)
                self.timers.after(
                    self.config.tombstone_ttl, partial(self._expire_tombstone, msg.room, msg.epoch)
                )
            self._send_ack(msg.room, msg.epoch, msg.endpoint)
            return
        self._close_room(room, TransferAborted(f"aborted by decode {msg.endpoint}"))
        room.acks.add_target(room.leases, msg.endpoint, msg.epoch)
        self._settle_room(room)

    # ------------------------------------------------------------------ timers

    def _bootstrap_due(self, room: _Room) -> None:
        if not room.ready and not room.cell.terminal and self._rooms.get(room.room) is room:
            self.counters.bump("timeouts")
            self._close_room(
                room,
                TransferAborted(
                    f"room {room.room}: no decode metadata within "
                    f"{self.config.bootstrap_timeout:g} s (bootstrap timeout)"
                ),
            )

    # ------------------------------------------------------------------ shutdown

    def _shutdown_rooms(self) -> None:
        """After every task (and so every engine call) has finished: tell the decode ranks
        (:meth:`_say_goodbye`), fail what is left and hand every source page back to the
        scheduler."""
        self._say_goodbye()
        for room in list(self._rooms.values()):
            if not room.cell.terminal:
                room.cell.fail(TransferAborted(CLOSED))
                room.terminal.set()
            if room.leases.quarantined:
                # the quarantines end here for our own pages, not for decode's: a failed
                # write may still land there, so its drain is never confirmed
                room.acks.withhold()
            room.leases.close()
            room.published = True
            room.waiting.clear()
            room.queued.clear()
            for lease in list(room.leases.live):
                room.leases.settle(lease, Outcome.CANCELLED)
            for lease in list(room.leases.quarantined):
                room.leases.end_quarantine(lease)
            self._settle_room(room)  # sends the acks now due, once per decode rank

    def _say_goodbye(self) -> None:
        """At shutdown, tell every decode rank this agent knows to be waiting on it, so it
        need not wait to prove this rank gone (which never happens while the engine stays
        up): a Failed STATUS where nothing was published, and an ack target, since no write
        of ours can land in its pages any more. (After an engine error :meth:`_shutdown_rooms`
        withholds those acks: a quarantined lease's write may still land.) Rooms whose
        TRANSFERs came before any sender are told too. Best effort: the sockets get
        ``aclose``'s linger to deliver it (a crash says nothing)."""
        for room_id, metas in self._pending_meta.items():
            for msg, _pages in metas.values():
                self._refuse_transfer(msg, CLOSED)
                self._send_ack(room_id, msg.epoch, msg.endpoint)
        self._pending_meta.clear()
        for room in self._rooms.values():
            if room.published and room.cell.status is KVPoll.Success:
                continue  # that decode room is done
            for target in room.targets.values():
                if not room.published:
                    self._send_failed(room.room, target.epoch, target.peer, CLOSED)
                room.leases.close()  # (an ack target needs admission closed)
                room.acks.add_target(room.leases, target.peer.endpoint, target.epoch)


def _room_error(group: BaseExceptionGroup[Exception]) -> TransferError:
    """One typed error for the room, chained from the group that carried it."""
    err: TransferError | None = None
    for kind in (EngineError, PeerLost, RegionError, ProtocolError, TransferAborted, TransferError):
        sub = group.subgroup(kind)
        if sub is not None:
            err = kind(f"{sub.exceptions[0]}")
            break
    if err is None:
        err = TransferError(f"chunk failed: {group.exceptions[0]!r}")
    err.__cause__ = group
    return err


def _reason(error: TransferError | None) -> str:
    if error is None:
        return ""
    return f"{type(error).__name__}: {error}"


@asynccontextmanager
async def open_prefill(
    *,
    engine: TransferEngine,
    pool: PoolSpec,
    bootstrap_url: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    kv_heads: int = 1,
    host: str = "127.0.0.1",
    config: PrefillConfig | None = None,
    metrics: AgentMetrics | None = None,
) -> AsyncIterator[PrefillAgent]:
    """Run a prefill rank: register ``pool`` with ``engine``, bind the control socket,
    register with the bootstrap service, and serve until the block exits.

    On exit every task is cancelled; engine calls already running finish first (the nursery
    waits for them), then rooms still open are failed and their pages handed back.

    **Cancellation:** cancelling the enclosing scope closes the agent as above.
    """
    config = config or PrefillConfig()
    agent = PrefillAgent(
        engine=engine,
        pool=pool,
        tp_rank=tp_rank,
        tp_size=tp_size,
        kv_heads=kv_heads,
        host=host,
        config=config,
    )
    if metrics is not None:
        metrics.attach(agent)  # sets agent.metrics; exports statistics() at scrape time
    regions = pool.regions()
    try:
        await trio.to_thread.run_sync(engine.register, regions)
        async with BootstrapClient(bootstrap_url) as client, trio.open_nursery() as nursery:
            agent._nursery = nursery
            nursery.start_soon(agent.control.serve, agent._handle)
            nursery.start_soon(agent.timers.run)
            for _ in range(config.workers):
                nursery.start_soon(agent._worker)
            await client.register(
                PrefillRankInfo(
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    endpoint=agent.endpoint,
                    engine=engine.name,
                    engine_session=engine.session_id,
                    layout=pool.layout,
                    kv_heads=kv_heads,
                    page_size=pool.page_size,
                    heartbeat_endpoint=agent.control.heartbeat_endpoint,
                )
            )
            try:
                yield agent
            finally:
                nursery.cancel_scope.cancel("prefill agent closing")
    finally:
        agent._nursery = None
        for peer in agent._peers.values():
            peer.lane.close()  # every call has returned: the nursery waited for them
        agent._shutdown_rooms()
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await trio.to_thread.run_sync(engine.unregister, regions)
            await agent.control.aclose()
