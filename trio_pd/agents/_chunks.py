"""The chunk runner: one chunk's engine calls, planned, validated, made and waited for.

Two rules of the specification live here, and only here:

* **A chunk transfer is a nursery** (SPEC §5.1). The chunk's engine calls, one per destination
  rank, are children of one nursery. The chunk ends only when every call has returned, a
  failed call's siblings included: drain on failure is structural. With one destination
  there is no sibling and no nursery: the runner awaits its one call, and a lane call, once
  started, is waited for even when cancelled, so the chunk still cannot end while it runs.
* **Business abort is not DMA completion** (§5.2). The chunk runs inside a cancel scope the
  room keeps; an abort cancels it. An engine call goes onto its peer's lane
  (:meth:`Lane.run_sync <trio_pd.io._lane.Lane.run_sync>`): cancelled while still queued, it
  never starts (the call's state stays ``not-started``); once the lane's thread took it, its
  result is always observed. That single point tells "never started" from "started", and the
  chunk's outcome (:class:`~trio_pd.core._state.Outcome`) follows from the calls' states.

What the outcome means for the lease, and everything after, is the room machine's
(:meth:`trio_pd.core._rooms.PrefillRoom.chunk_settled`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Literal

import trio

from ..core._errors import (
    EngineError,
    PeerLost,
    ProtocolError,
    RegionError,
    TransferAborted,
    TransferError,
    copy_error,
)
from ..core._memory import PoolSpec, layer_buffers, layer_view, stamp_aux_row
from ..core._plan import (
    Blocks,
    concat,
    plan_aux,
    plan_pages,
    plan_small,
    plan_staged,
    plan_staged_small,
    plan_states,
    staged_bytes,
    stages_heads,
    stages_pages,
    validate_blocks,
)
from ..core._rooms import Chunk, Pages, PrefillRoom, Target
from ..core._staging import Reservation, StagingArea, host_source
from ..core._state import Liveness, Outcome
from ..core._stats import Counters
from ..engines import TransferEngine, start_write
from ..io._lane import LaneClosed
from ._close import deregister_area
from ._peers import DecodePeer, PeerRegistry

if TYPE_CHECKING:
    from ..metrics import AgentMetrics

log = logging.getLogger("trio_pd.prefill")

#: staging areas of closed agents that an engine may still read (a failed call's range)
_KEPT: list[StagingArea] = []


class _Call:
    """One engine call of a chunk: whether it started, how it ended, and the staging range
    it reads (if its head slices were gathered: see _staging)."""

    __slots__ = ("peer", "staged", "state", "tail")

    def __init__(self, staged: Reservation | None = None) -> None:
        self.state: Literal["not-started", "done", "error"] = "not-started"
        self.staged = staged
        #: where the call wrote, and (source, destination) of its last block: if it fails,
        #: its quarantine may rewrite that block's first byte as a barrier (_peers)
        self.peer: DecodePeer | None = None
        self.tail: tuple[int, int] = (0, 0)


class Write:
    """One engine write of a chunk, as a lane call (:class:`~trio_pd.io._lane.Joinable`): the
    writes of other rooms' chunks queued behind it for the same engine and peer join its
    engine call (``PrefillConfig.batch_blocks``)."""

    __slots__ = (
        "blocks", "call_blocks", "call_bytes", "engine", "join_key", "joined", "nbytes",
        "num_blocks", "peer", "prepare", "riders",
    )

    def __init__(
        self, engine: TransferEngine, peer: str, blocks: Blocks,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.peer = peer
        self.blocks = blocks
        #: run on the lane's thread right before the engine call (a staging gather)
        self.prepare = prepare
        self.join_key = (id(engine), peer)
        self.num_blocks = blocks.num_blocks
        self.nbytes = blocks.nbytes
        #: set by the lane on a write that rode in an earlier write's engine call
        self.joined = False
        #: the blocks and bytes of the engine call this write led (its own plus its joiners')
        self.call_blocks = self.num_blocks
        self.call_bytes = self.nbytes
        #: the writes that joined the engine call this write led
        self.riders = 0

    def __call__(self) -> object:
        if self.prepare is not None:
            self.prepare()
        return start_write(self.engine, self.peer, *self.blocks)

    def join(self, others: Sequence[Write]) -> Callable[[], object]:
        blocks = concat([self.blocks, *(w.blocks for w in others)])
        self.riders = len(others)
        self.call_blocks = blocks.num_blocks
        self.call_bytes = blocks.nbytes
        prepares = [w.prepare for w in (self, *others) if w.prepare is not None]
        if not prepares:
            return partial(start_write, self.engine, self.peer, *blocks)

        def call() -> object:
            for prepare in prepares:
                prepare()
            return start_write(self.engine, self.peer, *blocks)

        return call


def outcome_of(calls: list[_Call]) -> Outcome:
    """An error anywhere: unknown completion (quarantine). Otherwise any call done: drained.
    None started: cancelled."""
    if len(calls) == 1:  # (one destination: most chunks)
        state = calls[0].state
        return (
            Outcome.ERROR if state == "error"
            else Outcome.COMPLETED if state == "done" else Outcome.CANCELLED
        )
    states = {c.state for c in calls}
    if "error" in states:
        return Outcome.ERROR
    if "done" in states:
        return Outcome.COMPLETED
    return Outcome.CANCELLED


def room_error(group: BaseExceptionGroup[Exception]) -> TransferError:
    """The room's one typed error for a failed chunk: a copy of the first error of the most
    telling kind, type and attributes kept (an :class:`EngineError`'s ``code``), chained from
    the group that carried it. Anything not ours becomes a :class:`TransferError`."""
    for kind in (EngineError, PeerLost, RegionError, ProtocolError, TransferAborted, TransferError):
        sub = group.subgroup(kind)
        if sub is not None:
            leaf = sub.exceptions[0]
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            err = copy_error(leaf)
            assert isinstance(err, TransferError)
            break
    else:
        err = TransferError(f"chunk failed: {group.exceptions[0]!r}")
    err.__cause__ = group
    return err


class ChunkPlanner:
    """A chunk's blocks for each destination, and the staging area they may go through.

    Owns the agent's staging area (head slices for decode ranks of a larger TP are gathered
    there, see _staging): its registration with the engine, the ranges a plan reserves, and
    what becomes of a range once its call is over (:meth:`settle_staging`). Also keeps the
    layer-wise views of the pools. Makes no engine write: that is the runner's.
    """

    def __init__(
        self, *, engine: TransferEngine, pool: PoolSpec, counters: Counters, staging_bytes: int
    ) -> None:
        self.engine = engine
        self.pool = pool
        self.counters = counters
        #: where head slices for decode ranks of a larger TP are gathered (_staging)
        self.staging = StagingArea(staging_bytes if host_source(pool) else 0)
        #: layer-wise chunks: (id(pool), a, b) -> (pool, its view of layers [a, b))
        self._views: dict[tuple[int, int, int], tuple[PoolSpec, PoolSpec]] = {}
        self._staging_lock = trio.Lock()

    def stages(self, peer: DecodePeer, chunk: Chunk, target: Target | None = None) -> bool:
        """Whether this chunk's pages for ``peer`` go through staging (see _staging): head
        slices for a decode rank of a larger TP, or whole pages for a target whose
        destination is the peer's landing area (trio_pd.core._landing)."""
        if not (chunk.pages.size > 0 and self.staging.usable) or peer.heads is None:
            return False
        if self._heads_staged(peer):
            return True
        return (
            target is not None and target.landing and peer.landing is not None
            and stages_pages(self.pool, peer.landing, self._mha(peer))
        )

    def _heads_staged(self, peer: DecodePeer) -> bool:
        """Whether ``peer``'s head slices go through staging (``stages_heads``): fixed for
        the life of its registration and asked for every chunk, so kept on the peer."""
        staged = peer.heads_staged
        if staged is None:
            staged = peer.heads_staged = stages_heads(self.pool, peer.pool, peer.heads)
        return staged

    def _mha(self, peer: DecodePeer) -> tuple[int, int] | None:
        return peer.heads if self.pool.layout == "mha" else None

    async def register_staging(self) -> None:
        async with self._staging_lock:
            if self.staging.registered or self.staging.disabled:
                return
            try:
                await trio.to_thread.run_sync(self.engine.register, [self.staging.region])
            except Exception as exc:
                log.warning("staging area not registered (%s): head slices go in place", exc)
                self.staging.disabled = True
            else:
                self.staging.registered = True

    async def close_staging(self) -> None:
        """Deregister the staging area (the agent is closing: every call has returned), a
        step bounded on its own (:func:`~trio_pd.agents._close.unregister`). A range still
        kept for a failed call stays allocated for the life of the process: the engine may
        still read it. So does the whole area when its deregistration fails or does not
        return in time: the engine may still hold it registered.

        **Cancellation:** shielded (the step is): a cancellation is delivered after it."""
        if not self.staging.registered:
            # (one that cannot be cancelled: the close's later steps must run)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        self.staging.registered = False
        self.staging.disabled = True
        await deregister_area(self.engine, self.staging.region, "the staging area",
                              self.staging, bool(self.staging.held), _KEPT)

    def plan(
        self, room: PrefillRoom, chunk: Chunk, target: Target, peer: DecodePeer, call: _Call,
        staging: bool,
    ) -> tuple[Blocks, Callable[[], None] | None]:
        """The chunk's blocks for ``target``, and the gather to run before they are written
        (when they are staged: the reservation is then ``call.staged``)."""
        parts: list[Blocks] = []
        prepare = None
        # layer-wise: both sides seen as pools of the chunk's layers only (their buffers);
        # a landing target's destination is the peer's landing area (_landing)
        src_pool, dst_pool = self._layer_views(chunk.layers, peer, target.landing)
        src_pages = chunk.pages
        skip = target.prefix - chunk.start  # pages of the chunk decode holds already
        if skip > 0:
            src_pages = src_pages[skip:]
        if not staging and not (chunk.last and self.pool.states):
            small = self._plan_small(room, chunk, target, peer, src_pool, dst_pool, src_pages)
            if small is not None:
                return small, None
        if peer.heads is not None and len(src_pages):
            first = chunk.start + len(chunk.pages) - len(src_pages) - target.prefix
            dst = target.dst_pages[first : first + len(src_pages)]
            mha_heads = self._mha(peer)
            r = None
            if staging and self.staging.registered:
                r = self.staging.reserve(staged_bytes(src_pool, dst_pool, len(dst)))
                if r is None:
                    self.counters.bump("staging_full")
            if r is not None:
                call.staged = r
                # head slices, or (a landing target) whole pages: every head we hold
                heads = mha_heads if self._heads_staged(peer) else (
                    self.pool.first_head, self.pool.first_head + self.pool.heads
                )
                assert heads is not None
                try:
                    prepare = self.staging.gatherer(
                        self.pool, src_pages, heads, r, dst_pool.item_lens,
                        buffers=self._buffers(chunk.layers),
                    )
                    quick = None
                    if not (chunk.last and self.pool.states):
                        quick = self._plan_staged_small(room, chunk, target, peer, call,
                                                        src_pool, dst_pool, dst)
                    if quick is not None:
                        return quick, prepare
                    parts.append(plan_staged(src_pool, dst_pool, dst, r.addr))
                except BaseException:
                    self._unstage(call)
                    raise
            else:
                # both page lists were validated when they arrived (admit, add_target)
                parts.append(
                    plan_pages(
                        src_pool, dst_pool, src_pages, dst, heads=mha_heads,
                        pages_checked=True,
                    )
                )
        try:
            if chunk.last and peer.writes_aux:
                stamp_aux_row(self.pool, room.aux_slot, room.room, target.epoch)
                parts.append(plan_aux(self.pool, peer.pool, room.aux_slot, target.aux_slot))
            if chunk.last and self.pool.states:  # (the slots' lengths checked on every rank)
                parts.append(plan_states(self.pool, peer.pool, peer.state_cuts,
                                         room.state_slots, target.state_slots))
            blocks = parts[0] if len(parts) == 1 else concat(parts)
            validate_blocks(blocks, peer.regions)  # I8: nothing lands outside decode's memory
        except BaseException:
            self._unstage(call)
            raise
        return blocks, prepare

    def _unstage(self, call: _Call) -> None:
        """Planning ``call`` failed: its staging range goes back (no engine call was made,
        so nothing reads it)."""
        if call.staged is not None:
            self.staging.give(call.staged)
            call.staged = None

    def _plan_small(
        self, room: PrefillRoom, chunk: Chunk, target: Target, peer: DecodePeer,
        src_pool: PoolSpec, dst_pool: PoolSpec, src_pages: Pages,
    ) -> Blocks | None:
        """:meth:`plan` for a chunk of whole pages in a few runs, no staging and no state
        slots (:func:`~trio_pd.core._plan.plan_small`: the same blocks); None: take the
        general path."""
        src: Pages | list[int] = []
        dst: Pages | list[int] = []
        heads = None
        n = src_pages.size  # (a 1-D array, as the chunk's: no len call)
        if peer.heads is not None and n:
            first = chunk.start + chunk.pages.size - n - target.prefix
            src = src_pages
            dst = target.dst_pages[first : first + n]
            heads = self._mha(peer)
        aux = None
        if chunk.last and peer.writes_aux:
            aux = (self.pool, peer.pool, room.aux_slot, target.aux_slot)
        blocks = plan_small(src_pool, dst_pool, src, dst, aux, peer.regions, heads=heads)
        if blocks is not None and aux is not None:
            stamp_aux_row(self.pool, room.aux_slot, room.room, target.epoch)
        return blocks

    def _plan_staged_small(
        self, room: PrefillRoom, chunk: Chunk, target: Target, peer: DecodePeer, call: _Call,
        src_pool: PoolSpec, dst_pool: PoolSpec, dst_pages: Pages,
    ) -> Blocks | None:
        """:meth:`plan` for a staged chunk (its reservation ``call.staged``) of a few runs of
        destination pages and no state slots (:func:`~trio_pd.core._plan.plan_staged_small`:
        the same blocks); None: take the general path."""
        assert call.staged is not None
        aux = None
        if chunk.last and peer.writes_aux:
            aux = (self.pool, peer.pool, room.aux_slot, target.aux_slot)
        blocks = plan_staged_small(src_pool, dst_pool, dst_pages, call.staged.addr, aux,
                                   peer.regions)
        if blocks is not None and aux is not None:  # (a failure: plan gives the range back)
            stamp_aux_row(self.pool, room.aux_slot, room.room, target.epoch)
        return blocks

    def _layer_views(
        self, layers: tuple[int, int] | None, peer: DecodePeer, landing: bool = False
    ) -> tuple[PoolSpec, PoolSpec]:
        """Our pool and the peer's (already our stage's layers of decode's pool; its landing
        area for ``landing``) as pools of ``layers`` only
        (:func:`~trio_pd.core._memory.layer_view`: MHA's K and V buffers of those layers,
        MLA's one each, per-buffer geometry kept); both whole for None. Made once per (pool,
        range): an agent has one pool, a peer one and its landing area."""
        dst = peer.pool
        if landing:
            if peer.landing is None:  # (checked when the TRANSFER came: a bug)
                raise ProtocolError(f"decode peer {peer.endpoint} has no landing area")
            dst = peer.landing
        if layers is None:
            return self.pool, dst
        return self._view(self.pool, layers), self._view(dst, layers)

    def _view(self, pool: PoolSpec, layers: tuple[int, int]) -> PoolSpec:
        key = (id(pool), *layers)
        hit = self._views.get(key)
        if hit is None or hit[0] is not pool:
            if len(self._views) >= 4096:
                self._views.clear()
            hit = self._views[key] = (pool, layer_view(pool, layers[0], layers[1] - layers[0]))
        return hit[1]

    def _buffers(self, layers: tuple[int, int] | None) -> list[int] | None:
        """Our pool's buffer indices of ``layers`` (None: every buffer)."""
        if layers is None:
            return None
        a, b = layers
        return layer_buffers(self.pool.layout, self.pool.num_layers, a, b - a)

    def settle_staging(self, room: PrefillRoom, calls: list[_Call]) -> None:
        """Staging ranges of the chunk's calls: back to the area if the call completed or
        never started; kept until the room's pages are released if it failed (the engine
        may still read them: see _staging)."""
        for call in calls:
            r = call.staged
            if r is None:
                continue
            call.staged = None
            if call.state == "error":
                self.staging.hold(room, r)
            else:
                self.staging.give(r)


class ChunkRunner:
    """Runs chunks for a prefill agent's workers: the chunk's nursery, its engine calls on
    the peers' lanes, the outcome handed to the room. Plans come from its :class:`ChunkPlanner`."""

    def __init__(
        self,
        *,
        engine: TransferEngine,
        pool: PoolSpec,
        peers: PeerRegistry,
        counters: Counters,
        metrics: Callable[[], AgentMetrics | None],
        staging_bytes: int = 0,
    ) -> None:
        self.engine = engine
        self.peers = peers
        self.counters = counters
        self._metrics = metrics
        self.planner = ChunkPlanner(
            engine=engine, pool=pool, counters=counters, staging_bytes=staging_bytes
        )

    async def run(  # noqa: ASYNC910 (every path schedules: a call, a nursery, or below)
        self,
        room: PrefillRoom,
        scopes: dict[trio.CancelScope, None],
        chunk: Chunk,
        settle: Callable[[Outcome, TransferError | None], None],
    ) -> None:
        """Run ``chunk`` of ``room`` to the end of all its engine calls, then call
        ``settle(outcome, failure)`` synchronously, on every path (also while an outer
        cancellation propagates): ``failure`` is the error that fails the room, or None.
        Never raises a chunk's error.

        **Cancellation:** ``scopes`` gets the chunk's cancel scope while it runs: cancelling
        it skips every call not yet started; calls already started are waited for. An outer
        cancellation (the agent closing) is the same and then propagates, after the calls.
        """
        calls: list[_Call] = []
        failure: TransferError | None = None
        ran_to_end = False
        # one destination: its call runs here, no nursery (see _transfer)
        single = len(room.targets) == 1
        scope = trio.CancelScope()
        try:
            try:
                with scope:
                    scopes[scope] = None
                    if room.leases.closed:
                        scope.cancel("room closed before the chunk started")
                    try:
                        if single:
                            await self._transfer(room, chunk, calls, None)
                            if not calls:  # (a call awaited is a schedule point; none was)
                                await trio.lowlevel.cancel_shielded_checkpoint()
                        else:
                            async with trio.open_nursery() as nursery:
                                await self._transfer(room, chunk, calls, nursery)
                        ran_to_end = True
                    finally:
                        scopes.pop(scope, None)
            except* Exception as group:  # planning, validation or engine: the room fails
                failure = room_error(group)
                if single:  # (where a nursery's exit would have been, as on every path)
                    await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self.planner.settle_staging(room, calls)
            outcome = outcome_of(calls)
            if outcome is Outcome.ERROR:  # (its quarantine, due in settle, takes them)
                self.peers.quarantines.failed_calls(
                    chunk.lease,
                    [(c.peer, c.tail) for c in calls if c.state == "error" and c.peer is not None],
                )
            if ran_to_end and not calls:
                outcome = Outcome.COMPLETED  # nothing to write here (a dummy rank): done
            elif outcome is Outcome.CANCELLED and failure is None and not scope.cancel_called:
                # cancelled from outside: the agent is closing before the chunk was written
                failure = TransferAborted(f"room {room.room}: the prefill agent is closing")
            settle(outcome, failure)

    async def _transfer(  # noqa: ASYNC910 (run: a schedule point on the paths with none here)
        self, room: PrefillRoom, chunk: Chunk, calls: list[_Call], nursery: trio.Nursery | None
    ) -> None:
        """The chunk's engine calls, one per destination rank, as children of ``nursery``,
        which exits only when every one has (SPEC §5.1, scenarios 1 and 2). Each starts as
        soon as it is planned.

        With one destination (``nursery`` None) the one call is awaited here: there is no
        sibling to wait for, and :meth:`Lane.run_sync <trio_pd.io._lane.Lane.run_sync>`
        returns only once a started call has, also when cancelled, so the chunk cannot end
        while its call runs, as in a nursery. What a nursery adds there is a schedule point
        at its exit even when its body had none: :meth:`run` makes it where no call was
        awaited (a dummy rank, a chunk that failed before its call), so every path keeps one,
        but a chunk whose call returned costs one task step less."""
        for target in room.targets.values():
            peer = self.peers.get(target.endpoint)
            if peer is None or peer.session != target.session:
                raise PeerLost(
                    f"decode peer {target.endpoint} re-registered with another engine session"
                )
            if peer.registration != target.registration:
                raise PeerLost(
                    f"decode peer {target.endpoint} re-registered with other memory (its pool "
                    "or landing area moved): the room's page ids name the old"
                )
            if not peer.ready.is_set():
                await peer.ready.wait()  # not started yet: cancellable
            staging = self.planner.stages(peer, chunk, target)
            if staging and not self.planner.staging.registered:
                await self.planner.register_staging()  # once per agent; cancellable until then
            call = _Call()
            blocks, prepare = self.planner.plan(room, chunk, target, peer, call, staging)
            if len(blocks.lens) == 0:
                continue  # a dummy rank for this destination: bookkeeping only
            calls.append(call)  # (settling gives back or keeps its staging range)
            call.peer = peer
            call.tail = (int(blocks.src[-1]), int(blocks.dst[-1]))
            if peer.probing and not peer.failed:
                # a write to it has just failed: this room was not in that call, and
                # the peer may well be alive (SPEC §5.7). Not started yet: cancellable
                await self.peers.probes.verdict(peer)
            if peer.failed:
                self.peers.probes.reprobe(peer)  # (unless a probe is running)
                raise PeerLost(
                    f"decode peer {peer.endpoint} is lost ({peer.lost}): chunks to it fail "
                    "fast until it answers a probe or registers again"
                )
            if nursery is None:
                await self._engine_call(peer, blocks, call, prepare)
            else:
                nursery.start_soon(self._engine_call, peer, blocks, call, prepare)

    async def _blame(self, peer: DecodePeer, write: Write, error: Exception) -> PeerLost | None:
        """An engine call to ``peer`` raised ``error``: is the peer alive (its probe's
        answer, :meth:`PeerProbes.verdict <trio_pd.agents._peer_probes.PeerProbes.verdict>`)?
        Alive: None, and the error fails the rooms in that call only (logged once per call, by
        the write that led it). Not alive: the :class:`PeerLost` that names it, for this room."""
        state = await self.peers.probes.verdict(peer)
        if state is Liveness.ALIVE:
            if not write.joined:
                log.warning(
                    "a write to decode peer %s failed (%d chunk writes, %d blocks in the call); "
                    "the peer answers a probe, so only the rooms in that call fail: %s",
                    peer.endpoint, write.riders + 1, write.call_blocks, error,
                )
            return None
        why = peer.lost or f"its liveness is {state.value}"
        return PeerLost(f"decode peer {peer.endpoint} is lost ({why}); a write to it failed: "
                        f"{error}")

    async def _engine_call(
        self, peer: DecodePeer, blocks: Blocks, call: _Call,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        """The one place an engine write happens. A call that raises is blamed on the call, or
        on the peer (:meth:`_blame`) once a probe of the peer has answered.

        **Cancellation:** before the lane's thread takes the call, it is skipped (``call``
        stays not-started); after, it completes and its result is observed. A call that
        raised counts as failed (``call.state``: its lease is quarantined) also when the
        wait for its peer's probe is cancelled.
        """
        write = Write(self.engine, peer.session, blocks, prepare)
        metrics = self._metrics()
        t0 = 0.0 if metrics is None else time.perf_counter()
        try:
            await self.peers.run_engine_call(peer.lane, write)
        except trio.Cancelled:
            raise
        except LaneClosed as exc:  # never started: the peer re-registered with a new engine
            raise PeerLost(
                f"decode peer {peer.endpoint} re-registered with another engine session"
            ) from exc
        except BaseException as exc:
            call.state = "error"
            self.counters.bump("engine_errors")  # (each chunk of a shared call that failed)
            if metrics is not None and not write.joined:
                metrics.observe_write(self.engine.name, time.perf_counter() - t0, 0, ok=False)
            if isinstance(exc, Exception):
                lost = await self._blame(peer, write, exc)
                if lost is not None:
                    raise lost from exc
            raise
        call.state = "done"
        self.counters.bump_write(write.joined, write.nbytes)
        if call.staged is not None:
            self.counters.bump("chunks_staged")
        # one observation per engine call, by the write that led it (a joined write's bytes
        # are in its leader's call; bytes_written counts every chunk's own)
        if metrics is not None and not write.joined:
            seconds = time.perf_counter() - t0
            metrics.observe_write(
                self.engine.name, seconds, write.call_bytes, blocks=write.call_blocks
            )
