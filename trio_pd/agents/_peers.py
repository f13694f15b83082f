"""Prefill's decode peers: who registered, whether their pools fit, the lane that carries every
engine call to each, failed marks, and the quarantine fences that keep an errored write's
pages out until its peers are proven quiet or gone.

A failed engine call fails the rooms in that call and nothing else while its peer answers
(SPEC §5.7): the call's rooms, and any chunk for that peer that comes meanwhile, wait for a
probe of the peer (:meth:`PeerRegistry.verdict`). ALIVE: the failure stays with the call's
rooms (the engine's error), and the waiting chunks go ahead. Anything else marks the peer
failed (:meth:`PeerRegistry.mark_failed`): the call's rooms fail with
:class:`~trio_pd.PeerLost` naming why, and later chunks fail fast until a probe answers ALIVE
or the peer registers again.

Liveness is three-valued (:class:`~trio_pd.core._state.Liveness`, probed by
:mod:`trio_pd.io._probe`):
a quarantine ends once every peer the failed call wrote to answered ALIVE after the engine's
own deadline for the call, or refused a connect where it listened (it closed, or its process
is gone), *and* the kernel shows that every byte we wrote to the peers' hosts has been
received there (:mod:`trio_pd.io._sendq`: an engine that gave up on a call may have left its
bytes in a TCP send queue, which the link delivers whenever it moves again). A refusal alone
ends nothing. UNKNOWN (a hung probe, an unreachable host, a check that could not run) keeps
the pages out for another fence (``quarantine_unknown``), and so do bytes still queued
(``quarantine_undrained``).

An engine may keep a failed call's blocks queued in its own memory and send them after the
call returned (Mooncake's TCP transport does; so does NIXL with a request that timed out
still posted: :func:`~trio_pd.engines.keeps_failed_calls`); neither a probe nor our kernel
sees those. For such an engine, the quarantine of a failed call to a peer that answers also
waits for the engine's proof that nothing of the call is left
(:func:`~trio_pd.engines.flushed`: on Mooncake a later call to that peer that completed; on
NIXL the kept request's own end). Where
none has since the call failed, the fence makes one, on the peer's lane: it writes again
the first byte of the failed call's last block (the same byte, from source pages the
quarantine still holds, into a page decode holds until our ack). An engine that cannot give
that proof keeps the pages out, counted ``quarantine_unflushed``, as does a barrier that
fails.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import trio

from ..core import _wire
from ..core._errors import IncompatiblePeer
from ..core._memory import PoolSpec, RegionTable, layer_view
from ..core._state import Lease, Liveness
from ..core._stats import Counters
from ..core._topology import (
    SlotCuts,
    pairing_problem,
    state_cuts,
    state_problem,
    write_heads,
    writes_aux,
)
from ..engines import TransferEngine, call_mark, flushed, keeps_failed_calls
from ..io import _probe, _sendq
from ..io._lane import Lane
from ..io._timers import Timers

log = logging.getLogger("trio_pd.prefill")

EngineCall = Callable[[Lane, Callable[[], object]], Awaitable[object]]

#: seconds between two looks at the kernel's send queues while a quarantine waits on them
_DRAIN_POLL = 0.05


@functools.cache
def _warn_no_tables() -> None:
    log.warning(
        "no TCP tables to read on this host (/proc/net/tcp): a quarantine ends when its peers "
        "answer after the engine's deadline, without the kernel's word that the failed call's "
        "bytes are gone"
    )


@dataclass(eq=False, slots=True)
class DecodePeer:
    """One registered decode rank (one REGISTER endpoint)."""

    endpoint: str
    decode_rank: int
    decode_tp: int
    session: str
    #: the decode rank's pool as this rank plans against it: with pipeline parallelism, a
    #: view of its buffers of this stage's layers only (``_memory.layer_view``)
    pool: PoolSpec
    #: every region the decode rank registered (all its layers): writes are checked here
    regions: RegionTable
    #: the thread that makes every engine call to this peer, in order
    lane: Lane
    #: the heads this prefill rank writes there (None: no KV bytes), and whether it writes
    #: the aux row: fixed by the two topologies, so worked out once at REGISTER
    heads: tuple[int, int] | None
    writes_aux: bool
    #: per state component, the cuts of a slot this rank writes there (``state_cuts``)
    state_cuts: tuple[SlotCuts, ...] = ()
    ready: trio.Event = field(default_factory=trio.Event)
    #: not alive as far as we know: a probe did not answer ALIVE (or the engine could not add
    #: it). Later chunks fail fast with PeerLost, saying ``lost``, until a probe answers ALIVE
    #: or it registers again
    failed: bool = False
    lost: str = ""
    #: the probe under way that a failed write or a chunk meeting the mark started (one at a
    #: time; everyone who needs its answer waits for it)
    probe: _Probe | None = None
    #: its registration is over: it refused a connect where it listened, or a REGISTER with
    #: another engine session replaced it. (Its quarantines still wait for our send queues
    #: to drain: a refusal is no proof that our bytes to it are gone)
    gone: bool = False
    #: authentication on: the CURVE public key (z85) that sent the REGISTER; TRANSFERs and
    #: ABORTs naming this endpoint are taken from it only ("" when authentication is off)
    key: str = ""
    #: trio.current_time() of the last lookup by endpoint (a TRANSFER, a chunk, a STATUS)
    last_used: float = 0.0

    @property
    def probing(self) -> bool:
        return self.probe is not None


@dataclass(eq=False, slots=True)
class _Probe:
    """A probe of one peer under way and, once ``done``, what it answered."""

    done: trio.Event = field(default_factory=trio.Event)
    state: Liveness = Liveness.UNKNOWN


@dataclass(eq=False, slots=True)
class _Flush:
    """A failed call to ``peer`` whose blocks the engine may still hold: ``mark`` is where
    the engine's calls to the peer stood once it had returned (None: the engine can prove
    nothing), ``tail`` the (source, destination) of its last block."""

    peer: DecodePeer
    mark: int | None
    tail: tuple[int, int]


@dataclass(eq=False, slots=True)
class _Fence:
    lease: Lease
    peers: list[DecodePeer]
    end: Callable[[], None]
    #: the lease's failed calls that the engine must prove over (:meth:`PeerRegistry._flush`)
    flushes: list[_Flush] = field(default_factory=list)


class PeerRegistry:
    """The decode peers of one prefill rank (SPEC §5.7: a peer that is not alive fails fast;
    §5.6: quarantines end on proof only)."""

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
        max_peers: int = 1024,
        peer_idle: float = 300.0,
        batch_blocks: int = 0,
        batch_bytes: int = 1 << 20,
        pp_rank: int = 0,
        pp_size: int = 1,
        first_layer: int = 0,
    ) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, not {max_peers!r}")
        self.engine = engine
        self.pool = pool
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.kv_heads = kv_heads
        #: pipeline parallelism: this rank's stage, and the model layer its pool's layer 0 is
        self.pp_rank, self.pp_size, self.first_layer = pp_rank, pp_size, first_layer
        self.inflight_per_peer = inflight_per_peer
        self.lane_nice = lane_nice
        #: each lane joins queued chunk writes up to this many blocks (see _lane, "Joining")
        self.batch_blocks = batch_blocks
        self.batch_bytes = batch_bytes
        self.fence = fence
        self.counters = counters
        self.timers = timers
        self._forget_endpoint = forget_endpoint
        #: at most this many registrations are kept; see :meth:`register`
        self.max_peers = max_peers
        #: a peer not looked up for this long, with no engine call and no probe, may be
        #: dropped to make room for a new REGISTER when every slot is taken
        self.peer_idle = peer_idle
        #: how an engine call reaches its lane's thread (the schedule explorer swaps it)
        self.run_engine_call: EngineCall = Lane.run_sync
        #: probes get their own thread: one of a hung peer can take a minute and must not
        #: hold up a lane or another peer's probe; bounded, one per peer (see _probe)
        self.probe_threads = _probe.ProbeThreads()
        self.nursery: trio.Nursery | None = None
        self._peers: dict[str, DecodePeer] = {}
        self._fences: dict[Lease, _Fence] = {}
        #: a settling chunk's failed calls, until its quarantine takes them (:meth:`failed_calls`)
        self._failed: dict[Lease, list[tuple[DecodePeer, tuple[int, int]]]] = {}
        #: endpoints whose REGISTER was refused, with why (bounded, oldest dropped): a TRANSFER
        #: from one fails its room with the reason instead of leaving it to its deadline
        self.refused: dict[str, str] = {}
        #: and the key each refused endpoint's REGISTER came from (authentication on): a
        #: TRANSFER from that key still reaches its room, to fail it with the reason
        self.refused_key: dict[str, str] = {}
        #: engine sessions of dropped peers being removed from the engine (see _make_room)
        self._removing: dict[str, trio.Event] = {}

    def get(self, endpoint: str) -> DecodePeer | None:
        peer = self._peers.get(endpoint)
        if peer is not None:
            peer.last_used = trio.current_time()
        return peer

    def all(self) -> list[DecodePeer]:
        return list(self._peers.values())

    # ---------------------------------------------------------------- REGISTER

    def register(self, msg: _wire.Register, key: str = "") -> DecodePeer:
        """A decode rank registers (or registers again). Its pool and topology must pair with
        ours: otherwise :class:`IncompatiblePeer` with the reason (the caller tells decode).
        The same engine session keeps its lane (one FIFO per destination engine); a new one
        means decode restarted: the old registration is proven gone.

        Registrations are bounded: a REGISTER from a new endpoint when :attr:`max_peers` are
        registered first drops one that is proven gone, else the least recently used one that
        has been idle for :attr:`peer_idle` seconds (added, no lookup, no engine call queued
        or running, no probe, in no quarantine), counted ``peers_evicted``; its endpoint is
        remembered as refused, so a later TRANSFER from it fails its room with the reason.
        With no such peer the REGISTER is refused with :class:`IncompatiblePeer`, counted
        ``peers_refused``. (A lane's thread exits once it has been idle, see
        :class:`~trio_pd.io._lane.Lane`, so threads follow the peers in use, not this cap.)

        ``key``: the CURVE key the REGISTER came from (authentication on), kept with the peer,
        or with the refusal."""
        pool = msg.pool.to_spec()
        problem = None if msg.engine == self.engine.name else (
            f"decode uses engine {msg.engine!r}, this rank {self.engine.name!r}"
        )
        problem = problem or pairing_problem(
            layout=self.pool.layout,
            page_size=self.pool.page_size,
            head_bytes=self.pool.head_bytes_all,
            num_layers=self.pool.num_layers,
            aux_item_len=self.pool.aux_item_lens,  # every aux buffer's, buffer by buffer
            kv_heads=self.kv_heads,
            prefill_tp=self.tp_size,
            peer_layout=pool.layout,
            peer_page_size=pool.page_size,
            peer_head_bytes=pool.head_bytes_all,
            peer_num_layers=pool.num_layers,
            peer_aux_item_len=pool.aux_item_lens,
            peer_rank=msg.decode_rank,
            peer_tp=msg.decode_tp,
            peer_heads=pool.heads,
            peer_first_head=pool.first_head,
            first_layer=self.first_layer,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            kv_dtype=self.pool.kv_dtype,
            peer_kv_dtype=pool.kv_dtype,
        ) or state_problem(
            self.pool.states, pool.states, self.tp_size, msg.decode_tp, self.pp_size
        )
        old = self._peers.get(msg.endpoint)
        full = problem is None and old is None and len(self._peers) >= self.max_peers
        if full and not self._make_room():
            self.counters.bump("peers_refused")
            problem = f"{self.max_peers} decode peers are registered, none gone or idle"
        if problem is not None:
            error = IncompatiblePeer(f"REGISTER from {msg.endpoint} refused: {problem}")
            self._remember_refused(msg.endpoint, str(error), key)
            raise error
        self.refused.pop(msg.endpoint, None)
        self.refused_key.pop(msg.endpoint, None)
        if old is not None and old.session == msg.session:
            lane = old.lane
        else:
            lane = Lane(
                f"{msg.endpoint} ({msg.session})",
                depth=self.inflight_per_peer,
                nice=self.lane_nice,
                join_blocks=self.batch_blocks,
                join_bytes=self.batch_bytes,
            )
            if old is not None:  # a new engine behind the endpoint (decode restarted)
                old.lane.close()  # what it has queued still runs; later calls: LaneClosed
                self._forget_endpoint(msg.endpoint)
                self._registration_over(old, "registered again with another engine session")
        peer = DecodePeer(
            msg.endpoint,
            msg.decode_rank,
            msg.decode_tp,
            msg.session,
            # pairing by layer id: our layer i is decode's layer first_layer + i
            layer_view(pool, self.first_layer, self.pool.num_layers),
            RegionTable(pool.regions()),
            lane,
            write_heads(
                self.tp_rank, msg.decode_rank, self.tp_size, msg.decode_tp, self.kv_heads,
                self.pool.layout,
            ),
            writes_aux(self.tp_rank, msg.decode_rank, self.tp_size, msg.decode_tp,
                       self.pp_rank, self.pp_size),
            tuple(
                state_cuts(ours, theirs, self.tp_rank, msg.decode_rank, self.tp_size,
                           msg.decode_tp)
                for ours, theirs in zip(self.pool.states, pool.states, strict=True)
            ),
        )
        peer.last_used = trio.current_time()
        peer.key = key
        self._peers[msg.endpoint] = peer
        assert self.nursery is not None
        self.nursery.start_soon(self._add_peer, peer, msg.engine_meta)
        return peer

    def _remember_refused(self, endpoint: str, reason: str, key: str) -> None:
        if endpoint not in self.refused and len(self.refused) >= 1024:
            self.refused_key.pop(next(iter(self.refused)), None)
            self.refused.pop(next(iter(self.refused)))
        self.refused[endpoint] = reason
        self.refused_key[endpoint] = key

    def _make_room(self) -> bool:
        """Drop one registration to make room for a new one: a proven-gone peer first, else
        the least recently used idle one (see :meth:`register`). False if none may go.
        One pass over the peers; it runs only when every slot is taken."""
        now = trio.current_time()
        fenced = {id(p) for fence in self._fences.values() for p in fence.peers}
        victim: DecodePeer | None = None
        for peer in self._peers.values():
            if not peer.ready.is_set() or peer.lane.outstanding or peer.probing:
                continue  # (add_peer not done yet, an engine call queued or running, a probe)
            if id(peer) in fenced:
                continue
            if peer.gone:
                victim = peer
                break
            if now - peer.last_used >= self.peer_idle and (
                victim is None or peer.last_used < victim.last_used
            ):
                victim = peer
        if victim is None:
            return False
        del self._peers[victim.endpoint]
        self.counters.bump("peers_evicted")
        why = "proven gone" if victim.gone else f"idle for {self.peer_idle:g} s"
        self._remember_refused(
            victim.endpoint,
            f"decode peer {victim.endpoint} was dropped ({why}) to make room for another; "
            "it must register again",
            victim.key,
        )
        victim.lane.close()
        self._forget_endpoint(victim.endpoint)
        if not any(p.session == victim.session for p in self._peers.values()):
            self._removing[victim.session] = done = trio.Event()
            assert self.nursery is not None
            self.nursery.start_soon(self._remove_engine_peer, victim.session, done)
        log.warning("dropped decode peer %s (%s): %d peers registered", victim.endpoint, why,
                    len(self._peers))
        return True

    async def _remove_engine_peer(self, session: str, done: trio.Event) -> None:
        """The engine forgets a dropped peer's session (NIXL: its UCX endpoints), so that
        churning registrations do not pile up in the engine. A REGISTER of that session that
        comes meanwhile waits for this (see :meth:`_add_peer`)."""
        try:
            await trio.to_thread.run_sync(self.engine.remove_peer, session)
            self.counters.bump("engine_peers_removed")
        except Exception as exc:
            log.warning("could not remove engine peer %s: %s", session, exc)
            await trio.lowlevel.checkpoint()
        finally:
            if self._removing.get(session) is done:
                del self._removing[session]
            done.set()

    async def _add_peer(self, peer: DecodePeer, meta: bytes) -> None:
        removing = self._removing.get(peer.session)
        if removing is not None:
            await removing.wait()
        try:
            await self.run_engine_call(peer.lane, partial(self.engine.add_peer, peer.session, meta))
        except Exception as exc:
            self.mark_failed(peer, f"the engine could not add it ({exc})")
            self.reprobe(peer)  # (a probe that answers ALIVE ends the mark)
            await trio.lowlevel.checkpoint()
        peer.ready.set()

    # ---------------------------------------------------------------- failed marks, probes

    def mark_failed(self, peer: DecodePeer, why: str) -> None:
        """``peer`` is not alive as far as we know (``why``): later chunks to it fail fast with
        :class:`~trio_pd.PeerLost` until a probe answers ALIVE or it registers again. Counted
        (``peers_failed``) and logged once per mark (a peer proven gone was logged as such)."""
        peer.lost = why
        if peer.failed:
            return
        peer.failed = True
        self.counters.bump("peers_failed")
        if not peer.gone:
            log.warning("decode peer %s lost: %s; chunks to it fail fast until it answers a probe",
                        peer.endpoint, why)

    def reprobe(self, peer: DecodePeer) -> None:
        """Probe ``peer`` in the background unless a probe of it is under way (a chunk met its
        failed mark: one that answers ALIVE ends it)."""
        self._start_probe(peer)

    async def verdict(self, peer: DecodePeer) -> Liveness:
        """Is ``peer`` alive? The answer of the probe of it under way, or of a new one, applied
        to its failed mark (see :meth:`liveness`). Asked when an engine call to it failed, and
        by a chunk for it that comes while that probe runs: until the answer, nobody can tell a
        failed call (its rooms fail, nothing else) from a lost peer (everything to it fails).

        **Cancellation:** cancellable while it waits; the probe carries on for the others
        (it is the registry's task). A cancelled caller learns nothing."""
        probe = self._start_probe(peer)
        if probe is None:  # the agent is closing: no probe starts any more
            await trio.lowlevel.checkpoint()
            return Liveness.UNKNOWN
        await probe.done.wait()
        return probe.state

    def _start_probe(self, peer: DecodePeer) -> _Probe | None:
        if peer.probe is None and self.nursery is not None:
            peer.probe = _Probe()
            self.nursery.start_soon(self._probe_failed, peer, peer.probe)
        return peer.probe

    async def liveness(self, peer: DecodePeer) -> Liveness:
        """Probe ``peer``: ALIVE when its engine answers; REFUSED when its control endpoint or
        its engine's port refuses connections (its registration is over; no proof that our
        bytes to it are gone); UNKNOWN otherwise. The answer sets or ends its failed mark:
        marked only while it is not alive (SPEC §5.7). A peer whose registration is over
        answers GONE at once (a registration that no chunk can use any more)."""
        if peer.gone:
            await trio.lowlevel.checkpoint()
            return Liveness.GONE
        state = await _probe.probe(
            self.engine,
            peer.session,
            control_endpoint=peer.endpoint,
            timeout=self.fence,
            threads=self.probe_threads,
            counters=self.counters,
        )
        if state is Liveness.ALIVE:
            if peer.failed:  # any probe that answers ends the fast-fail mark
                peer.failed = False
                self.counters.bump("peers_back")
                log.info("decode peer %s answers a probe again: chunks to it go ahead",
                         peer.endpoint)
        elif state is Liveness.REFUSED:
            why = "refuses connections where it listened (its agent or process is gone)"
            self._registration_over(peer, why)
            self.mark_failed(peer, f"it {why}")
        else:
            self.mark_failed(
                peer,
                f"no answer to a probe within {self.fence:g} s (unreachable, stopped or hung: "
                "its liveness is unknown)",
            )
        return state

    async def _probe_failed(self, peer: DecodePeer, probe: _Probe) -> None:
        try:
            probe.state = await self.liveness(peer)
        finally:
            if peer.probe is probe:
                peer.probe = None
            probe.done.set()

    def _registration_over(self, peer: DecodePeer, why: str) -> None:
        """``peer``'s registration is over (``why``): counted and logged once. Its quarantines
        still end at their fence only, once our send queues to it are seen drained
        (:meth:`_confirm`): neither a refusal nor a new session proves our bytes to it gone."""
        if peer.gone:
            return
        peer.gone = True
        self.counters.bump("peers_lost")
        log.warning("decode peer %s (engine session %s) %s: its registration is over",
                    peer.endpoint, peer.session, why)

    # ---------------------------------------------------------------- quarantine fences

    def failed_calls(
        self, lease: Lease, calls: list[tuple[DecodePeer, tuple[int, int]]]
    ) -> None:
        """The engine calls of ``lease``'s chunk that failed, each with the (source,
        destination) of its last block: told by the chunk runner as the chunk settles, just
        before the lease's quarantine starts (:meth:`quarantine` takes them)."""
        self._failed[lease] = calls

    def quarantine(self, lease: Lease, peers: list[DecodePeer], end: Callable[[], None]) -> None:
        """``lease``'s write errored: keep its pages out until every peer it wrote to answers
        a probe after the engine's own deadline for the call (``fence``: by then the engine
        has given the call up), or refuses connections, with our kernel's send queues to them
        seen empty (what the call left there has been received), and, for an engine that
        keeps a failed call's blocks, the engine's proof that nothing of each failed call to
        a peer that answers is left (:meth:`_flush`). ``end()`` runs once, on that proof."""
        fence = _Fence(lease, peers, end)
        failed = self._failed.pop(lease, [])
        if failed and keeps_failed_calls(self.engine):
            for peer, tail in failed:  # (the calls have returned: marks taken now are after)
                fence.flushes.append(_Flush(peer, call_mark(self.engine, peer.session), tail))
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
        if any(s is Liveness.UNKNOWN for s in states):
            self.counters.bump("quarantine_unknown")
            log.warning(
                "quarantine of %d pages kept: peer liveness unknown (%s)",
                fence.lease.npages, ", ".join(p.endpoint for p in fence.peers),
            )
            self.timers.after(self.fence, partial(self._fence_passed, fence))
            return
        # what the engine kept of the failed calls to peers that answer: gone only once a
        # later call to the peer completed (a peer that refuses can be sent nothing more)
        alive = {id(p) for p, s in zip(fence.peers, states, strict=True) if s is Liveness.ALIVE}
        for flush in fence.flushes:
            if id(flush.peer) not in alive:
                continue
            why = await self._flush(flush)
            if self._fences.get(fence.lease) is not fence:
                return  # (ended meanwhile)
            if why is not None:
                self.counters.bump("quarantine_unflushed")
                log.warning("quarantine of %d pages kept (%s): %s", fence.lease.npages,
                            flush.peer.endpoint, why)
                self.timers.after(self.fence, partial(self._fence_passed, fence))
                return
        # every peer answered, or refused (closed, or its process gone): a refusal proves
        # nothing about the bytes already sent to it, so both wait for the kernel's word
        drained = await self._sent_bytes_acknowledged(fence.peers)
        if self._fences.get(fence.lease) is not fence:
            return  # (ended meanwhile)
        if drained:
            self._end_fence(fence)
            return
        if drained is None:
            self.counters.bump("quarantine_unknown")
            why = "our send queues to them could not be read"
        else:
            self.counters.bump("quarantine_undrained")
            why = "bytes written to them are still in the kernel's send queue"
        log.warning("quarantine of %d pages kept (%s): %s", fence.lease.npages,
                    ", ".join(p.endpoint for p in fence.peers), why)
        self.timers.after(self.fence, partial(self._fence_passed, fence))

    async def _flush(self, flush: _Flush) -> str | None:
        """Has the engine proven that nothing of the failed call ``flush`` is left in it
        (:func:`~trio_pd.engines.flushed`)? On Mooncake a later call to the peer that
        completed proves it (the engine sends a peer's blocks in order); if none has, make
        one: the first byte of the failed call's last block written again, on the peer's
        lane. (On NIXL only the kept request's end proves it; the write changes nothing.)
        None once proven; otherwise why not."""
        peer, mark = flush.peer, flush.mark
        if mark is None:
            await trio.lowlevel.checkpoint()
            return (f"engine {self.engine.name!r} cannot prove that a failed call's blocks to "
                    f"{peer.session} are gone (for Mooncake: more than one TCP connection per "
                    "peer, or RDMA)")
        if flushed(self.engine, peer.session, mark):
            await trio.lowlevel.checkpoint()
            return None
        src, dst = flush.tail
        one = np.ones(1, dtype=np.uint64)
        barrier = partial(self.engine.write, peer.session, np.array([src], dtype=np.uint64),
                          np.array([dst], dtype=np.uint64), one)
        try:
            await self.run_engine_call(peer.lane, barrier)
        except Exception as exc:  # (LaneClosed: it registered again; an engine error)
            await trio.lowlevel.checkpoint()
            return f"a barrier write to {peer.session} failed: {exc}"
        if flushed(self.engine, peer.session, mark):
            return None
        return f"the engine holds a failed call's blocks to {peer.session} still"

    async def _sent_bytes_acknowledged(self, peers: list[DecodePeer]) -> bool | None:
        """Has every TCP connection of ours to these peers' hosts been seen with an empty send
        queue (see :mod:`trio_pd.io._sendq`), within one ``fence``? An engine's failed call may
        have left bytes there, which TCP delivers (into pages) whenever the link moves again:
        a peer answering a probe proves only that the link moves now.

        False if not within the fence, or if a peer's host does not resolve. True at once for
        peers reached over no TCP at all (in-process). Where the platform has no such tables
        (not Linux) there is no such evidence: True, with a warning once, so the quarantine
        rests on the engine's deadline alone there. None (unknown, counted ``checks_unknown``)
        where the tables exist but cannot be read now, e.g. with no descriptor left: a check
        that cannot run is never taken for "drained"."""
        await trio.lowlevel.checkpoint()
        hosts: set[str] = set()
        for peer in peers:
            named = await _probe.peer_hosts(self.engine, peer.session, peer.endpoint)
            if named is not None and not named:
                return False
            hosts.update(named or ())
        if not hosts:
            return True
        watch = _sendq.DrainWatch()
        with trio.move_on_after(self.fence):
            while True:
                try:
                    snap = await trio.to_thread.run_sync(_sendq.snapshot, sorted(hosts))
                except (OSError, RuntimeError) as exc:  # (no descriptor, no thread)
                    self.counters.bump("checks_unknown")
                    log.warning("send queues to %s could not be read: %r", sorted(hosts), exc)
                    return None
                if snap is None:
                    _warn_no_tables()
                    return True
                if watch.observe(snap):
                    return True
                await trio.sleep(_DRAIN_POLL)
        log.info("send queues to %s not seen empty in %d looks: %s", sorted(hosts),
                 watch.looks, sorted(watch.pending))
        return False

    def _end_fence(self, fence: _Fence) -> None:
        if self._fences.pop(fence.lease, None) is fence:
            fence.end()

    def drop_fences(self) -> None:
        """The agent is closing: the rooms end their own quarantines (our own pages)."""
        self._fences.clear()
        self._failed.clear()

    def close(self) -> None:
        """No more engine calls: let every lane's thread finish and exit."""
        for peer in self._peers.values():
            peer.lane.close()

