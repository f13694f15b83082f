"""Prefill's decode peers: who registered, whether their pools fit, the lane that carries every
engine call to each, failed marks, and the quarantine fences that keep an errored write's
pages out until its peers are proven quiet or gone.

Liveness is three-valued (:class:`~trio_pd._state.Liveness`, probed by :mod:`trio_pd._probe`):
a quarantine ends only on ALIVE after the engine's own deadline for the failed call, or on
GONE. UNKNOWN (a hung probe, an unreachable host) keeps the pages out for another fence, and
is counted (``quarantine_unknown``). A partitioned peer's engine may deliver what it queued
once the link comes back: before, a probe that timed out was taken for "gone".
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import trio

from . import _probe, _wire
from ._errors import IncompatiblePeer
from ._lane import Lane
from ._memory import PoolSpec, RegionTable
from ._state import Lease, Liveness
from ._stats import Counters
from ._timers import Timers
from ._topology import aux_writer, pairing_problem, write_heads
from .engines import TransferEngine

log = logging.getLogger("trio_pd.prefill")

EngineCall = Callable[[Lane, Callable[[], object]], Awaitable[object]]


@dataclass(eq=False, slots=True)
class DecodePeer:
    """One registered decode rank (one REGISTER endpoint)."""

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
    #: a write to it failed: later chunks fail fast until a probe says ALIVE
    failed: bool = False
    probing: bool = False
    #: proven gone (GONE, or replaced by a REGISTER with another engine session)
    gone: bool = False


@dataclass(eq=False, slots=True)
class _Fence:
    lease: Lease
    peers: list[DecodePeer]
    end: Callable[[], None]


class PeerRegistry:
    """The decode peers of one prefill rank (SPEC §5.7: a failed peer fails fast; §5.6:
    quarantines end on proof only)."""

    def __init__(
        self,
        *,
        engine: TransferEngine,
        pool: PoolSpec,
        tp_rank: int,
        tp_size: int,
        kv_heads: int,
        inflight_per_peer: int,
        lane_nice: int,
        fence: float,
        counters: Counters,
        timers: Timers,
        forget_endpoint: Callable[[str], None],
    ) -> None:
        self.engine = engine
        self.pool = pool
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.kv_heads = kv_heads
        self.inflight_per_peer = inflight_per_peer
        self.lane_nice = lane_nice
        self.fence = fence
        self.counters = counters
        self.timers = timers
        self._forget_endpoint = forget_endpoint
        #: how an engine call reaches its lane's thread (the schedule explorer swaps it)
        self.run_engine_call: EngineCall = Lane.run_sync
        #: probes get their own thread: one of a hung peer can take a minute and must not
        #: hold up a lane; one token bounds them (see _probe)
        self.probe_limiter = trio.CapacityLimiter(1)
        self.nursery: trio.Nursery | None = None
        self._peers: dict[str, DecodePeer] = {}
        self._fences: dict[Lease, _Fence] = {}
        #: endpoints whose REGISTER was refused, with why (bounded, oldest dropped): a TRANSFER
        #: from one fails its room with the reason instead of leaving it to its deadline
        self.refused: dict[str, str] = {}

    def get(self, endpoint: str) -> DecodePeer | None:
        return self._peers.get(endpoint)

    def current(self, peer: DecodePeer) -> bool:
        """Is ``peer`` still the registration behind its endpoint?"""
        return self._peers.get(peer.endpoint) is peer

    def all(self) -> list[DecodePeer]:
        return list(self._peers.values())

    # ---------------------------------------------------------------- REGISTER

    def register(self, msg: _wire.Register) -> DecodePeer:
        """A decode rank registers (or registers again). Its pool and topology must pair with
        ours: otherwise :class:`IncompatiblePeer` with the reason (the caller tells decode).
        The same engine session keeps its lane (one FIFO per destination engine); a new one
        means decode restarted: the old registration is proven gone."""
        pool = msg.pool.to_spec()
        problem = None if msg.engine == self.engine.name else (
            f"decode uses engine {msg.engine!r}, this rank {self.engine.name!r}"
        )
        problem = problem or pairing_problem(
            layout=self.pool.layout,
            page_size=self.pool.page_size,
            head_bytes=self.pool.head_bytes,
            num_layers=self.pool.num_layers,
            aux_item_len=self.pool.aux_item_len,
            kv_heads=self.kv_heads,
            prefill_tp=self.tp_size,
            peer_layout=pool.layout,
            peer_page_size=pool.page_size,
            peer_head_bytes=pool.head_bytes,
            peer_num_layers=pool.num_layers,
            peer_aux_item_len=pool.aux_item_len,
            peer_rank=msg.decode_rank,
            peer_tp=msg.decode_tp,
            peer_heads=pool.heads,
            peer_first_head=pool.first_head,
        )
        if problem is not None:
            if len(self.refused) >= 1024:
                self.refused.pop(next(iter(self.refused)))
            error = IncompatiblePeer(f"REGISTER from {msg.endpoint} refused: {problem}")
            self.refused[msg.endpoint] = str(error)
            raise error
        self.refused.pop(msg.endpoint, None)
        old = self._peers.get(msg.endpoint)
        if old is not None and old.session == msg.session:
            lane = old.lane
        else:
            lane = Lane(
                f"{msg.endpoint} ({msg.session})",
                depth=self.inflight_per_peer,
                nice=self.lane_nice,
            )
            if old is not None:  # a new engine behind the endpoint (decode restarted)
                old.lane.close()  # what it has queued still runs; later calls: LaneClosed
                self._forget_endpoint(msg.endpoint)
                self._proven_gone(old)
        peer = DecodePeer(
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
        assert self.nursery is not None
        self.nursery.start_soon(self._add_peer, peer, msg.engine_meta)
        return peer

    async def _add_peer(self, peer: DecodePeer, meta: bytes) -> None:
        try:
            await self.run_engine_call(peer.lane, partial(self.engine.add_peer, peer.session, meta))
        except Exception as exc:
            log.warning("could not add decode peer %s: %s", peer.endpoint, exc)
            self.mark_failed(peer)
            await trio.lowlevel.checkpoint()
        peer.ready.set()

    # ---------------------------------------------------------------- failed marks, probes

    def mark_failed(self, peer: DecodePeer) -> None:
        """A write to ``peer`` failed: later chunks to it fail fast, until a probe says it is
        alive (or it registers again)."""
        if not peer.failed:
            peer.failed = True
            self.counters.bump("peers_failed")
        if not peer.probing and self.nursery is not None:
            peer.probing = True
            self.nursery.start_soon(self._probe_failed, peer)

    async def liveness(self, peer: DecodePeer) -> Liveness:
        """Probe ``peer``: its control endpoint refusing connections, or its engine's port,
        proves it gone; its engine answering proves it alive; anything else is UNKNOWN."""
        if peer.gone:
            await trio.lowlevel.checkpoint()
            return Liveness.GONE
        state = await _probe.probe(
            self.engine,
            peer.session,
            control_endpoint=peer.endpoint,
            timeout=self.fence,
            limiter=self.probe_limiter,
        )
        if state is Liveness.GONE:
            self._proven_gone(peer)
        elif state is Liveness.ALIVE:
            peer.failed = False  # any probe that answers ends the fast-fail mark
        return state

    async def _probe_failed(self, peer: DecodePeer) -> None:
        try:
            await self.liveness(peer)  # (ALIVE clears the failed mark)
        finally:
            peer.probing = False

    def _proven_gone(self, peer: DecodePeer) -> None:
        if peer.gone:
            return
        peer.gone = True
        self.counters.bump("peers_lost")
        # quarantines whose every peer is now proven gone end here, not at their fence
        for fence in list(self._fences.values()):
            if all(p.gone for p in fence.peers):
                self._end_fence(fence)

    # ---------------------------------------------------------------- quarantine fences

    def quarantine(self, lease: Lease, peers: list[DecodePeer], end: Callable[[], None]) -> None:
        """``lease``'s write errored: keep its pages out until every peer it wrote to is proven
        gone, or answers a probe after the engine's own deadline for the call (``fence``:
        by then the call has returned, and what it left queued has been delivered once the
        link moves again). ``end()`` runs once, on that proof."""
        for peer in peers:
            self.mark_failed(peer)
        fence = _Fence(lease, peers, end)
        self._fences[lease] = fence
        self.timers.after(self.fence, partial(self._fence_passed, fence))

    def _fence_passed(self, fence: _Fence) -> None:
        if self._fences.get(fence.lease) is fence and self.nursery is not None:
            self.nursery.start_soon(self._confirm, fence)

    async def _confirm(self, fence: _Fence) -> None:
        await trio.lowlevel.checkpoint()
        states: list[Liveness] = []
        for peer in fence.peers:
            states.append(await self.liveness(peer))
        if self._fences.get(fence.lease) is not fence:
            return
        if all(s is not Liveness.UNKNOWN for s in states):
            self._end_fence(fence)
            return
        self.counters.bump("quarantine_unknown")
        log.warning(
            "quarantine of %d pages kept: peer liveness unknown (%s)",
            fence.lease.npages, ", ".join(p.endpoint for p in fence.peers),
        )
        self.timers.after(self.fence, partial(self._fence_passed, fence))

    def _end_fence(self, fence: _Fence) -> None:
        if self._fences.pop(fence.lease, None) is fence:
            fence.end()

    def drop_fences(self) -> None:
        """The agent is closing: the rooms end their own quarantines (our own pages)."""
        self._fences.clear()

    def close(self) -> None:
        """No more engine calls: let every lane's thread finish and exit."""
        for peer in self._peers.values():
            peer.lane.close()

