"""Prefill's decode peers: who registered, whether their pools fit, and the lane that carries
every engine call to each (:class:`PeerRegistry`). Two concerns have their own modules, over
the registry's peers: failed marks and probes (:mod:`trio_pd.agents._peer_probes`: a failed
engine call fails the rooms in that call and nothing else while its peer answers, SPEC §5.7),
and the quarantine fences that keep an errored write's pages out until its peers are proven
quiet or gone (:mod:`trio_pd.agents._quarantine`, SPEC §5.6).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import trio

from ..core import _wire
from ..core._errors import IncompatiblePeer
from ..core._landing import landing_spec
from ..core._memory import PoolSpec, RegionTable, layer_view
from ..core._stats import Counters
from ..core._tables import DecodePeerView, resolved_against
from ..core._topology import (
    SlotCuts,
    pairing_problem,
    state_cuts,
    state_problem,
    write_heads,
    writes_aux,
)
from ..engines import TransferEngine
from ..io import _probe
from ..io._lane import Lane
from ..io._timers import Timers
from ._peer_probes import PeerProbes, _Probe
from ._quarantine import Quarantines

log = logging.getLogger("trio_pd.prefill")

EngineCall = Callable[[Lane, Callable[[], object]], Awaitable[object]]


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
    #: its landing area as this rank plans against it (``_landing.landing_spec``, a view of
    #: this stage's layers like ``pool``), or None: it advertised none
    landing: PoolSpec | None = None
    #: what the room table needs of it (``PrefillWire.peer_view``), made on first use: every
    #: field it is made of is fixed for the life of this registration
    view: DecodePeerView | None = None
    #: whether this rank's head slices for it go through staging (``_plan.stages_heads``
    #: of our pool and ``pool``), worked out by the chunk planner on first use: fixed for
    #: the life of this registration
    heads_staged: bool | None = None
    #: which registration of the endpoint this is (``DecodePeerView.registration``), and what
    #: its TRANSFERs' page ids are resolved against (``_tables.resolved_against``)
    registration: int = 0
    memory: tuple[object, ...] = ()

    @property
    def probing(self) -> bool:
        return self.probe is not None



def _landing_of(
    pool: PoolSpec, bases: tuple[int, ...], pages: int
) -> tuple[PoolSpec | None, str | None]:
    """The landing area a REGISTER advertises (``_landing.landing_spec``), or why it makes no
    sense: one base per KV buffer, some pages, every buffer inside the 64-bit space."""
    if len(bases) != pool.num_buffers or pages < 1:
        return None, (
            f"landing area of {len(bases)} buffer bases and {pages} pages for a pool of "
            f"{pool.num_buffers} buffers"
        )
    for b, (base, item) in enumerate(zip(bases, pool.item_lens, strict=True)):
        if base + pages * item > 1 << 64:
            return None, f"landing buffer {b} at {base:#x} runs past the 64-bit address space"
    return landing_spec(pool, bases, pages), None


class PeerRegistry:
    """The decode peers of one prefill rank: owns the table of registrations (REGISTER, its
    pairing check, the cap and who is dropped to make room, the refused endpoints), each
    peer's lane, its engine session being added or removed, and what the parts share: the
    engine, the fence, the counters, the timers, the nursery and how an engine call reaches a
    lane. Failed marks and probes are :attr:`probes` (SPEC §5.7: a peer that is not alive
    fails fast), quarantine fences :attr:`quarantines` (§5.6: they end on proof only); the
    few calls the chunk runner and the agent make of those pass through here."""

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
        #: the peers' failed marks and probes, and the quarantine fences (their own modules)
        self.probes = PeerProbes(self)
        self.quarantines = Quarantines(self)
        #: endpoints whose REGISTER was refused, with why (bounded, oldest dropped): a TRANSFER
        #: from one fails its room with the reason instead of leaving it to its deadline
        self.refused: dict[str, str] = {}
        #: and the key each refused endpoint's REGISTER came from (authentication on): a
        #: TRANSFER from that key still reaches its room, to fail it with the reason
        self.refused_key: dict[str, str] = {}
        #: engine sessions of dropped peers being removed from the engine (see _make_room)
        self._removing: dict[str, trio.Event] = {}
        #: numbers each new registration (``DecodePeer.registration``)
        self._registrations = itertools.count(1)

    def get(self, endpoint: str) -> DecodePeer | None:
        peer = self._peers.get(endpoint)
        if peer is not None:
            peer.last_used = self.timers.clock()
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
        landing: PoolSpec | None = None
        if problem is None and (msg.landing_bases or msg.landing_pages):
            landing, problem = _landing_of(pool, msg.landing_bases, msg.landing_pages)
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
        memory = resolved_against(msg)
        registration = 0  # (0: a new one, numbered below)
        if old is not None and old.session == msg.session:
            lane = old.lane
            if old.memory == memory:
                registration = old.registration  # (the same registration: its rooms go on)
            else:
                # the same engine, other memory (a pool or landing area moved, another rank):
                # the page ids of TRANSFERs taken under the old registration name memory it
                # no longer registers, so their rooms fail (_chunks: PeerLost) and what is
                # parked of them is dropped, rather than written at those ids into the new
                self.counters.bump("registrations_moved")
                log.warning("decode peer %s registered again with the same engine session but "
                            "other memory: rooms resolved against the old registration fail",
                            msg.endpoint)
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
                self.probes.registration_over(old, "registered again with another engine session")
        peer = DecodePeer(
            msg.endpoint,
            msg.decode_rank,
            msg.decode_tp,
            msg.session,
            # pairing by layer id: our layer i is decode's layer first_layer + i
            layer_view(pool, self.first_layer, self.pool.num_layers),
            RegionTable(pool.regions() + ([] if landing is None else landing.regions()[
                : landing.num_buffers
            ])),
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
        peer.last_used = self.timers.clock()
        peer.key = key
        peer.registration = registration or next(self._registrations)
        peer.memory = memory
        if landing is not None:
            peer.landing = layer_view(landing, self.first_layer, self.pool.num_layers)
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
        now = self.timers.clock()
        fenced = self.quarantines.fenced()
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
            self.probes.mark_failed(peer, f"the engine could not add it ({exc})")
            self.probes.reprobe(peer)  # (a probe that answers ALIVE ends the mark)
            await trio.lowlevel.checkpoint()
        peer.ready.set()

    def close(self) -> None:
        """No more engine calls: let every lane's thread finish and exit."""
        for peer in self._peers.values():
            peer.lane.close()

