"""Decode's sources: the prefill instances a decode rank reads from, found through their
bootstrap services; the prefill ranks it registered with; their heartbeat, loss and
liveness.

A prefill rank that misses ``heartbeat_misses`` pings in a row is *lost*: its rooms fail. A
loss proves nothing about its writes (a stopped or partitioned peer's engine may still
deliver what it queued), so held pages wait for its drain ack, or for proof that none of its
writes can land any more. That proof is made here, at the target: a probe that finds its
control endpoint or engine port refusing connections (:mod:`trio_pd.io._probe`) only hints that
it is gone, and then our own engine fences it off (``fence_writer``: for Mooncake's TCP
transport, the connections it accepted from the writer's host shut down and closed, once the
writer's engine refuses connections). Where the engine has no fence, the pages stay held,
counted ``writers_unfenced`` and logged.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import trio
import trio_util

from ..bootstrap._bootstrap_client import BootstrapClient, PrefillRankInfo, Topology
from ..core import _wire
from ..core._errors import (
    AuthenticationError,
    BootstrapError,
    IncompatiblePeer,
    PeerLost,
    ProtocolError,
    TransferError,
)
from ..core._memory import UNKNOWN_DTYPE, PoolSpec, layer_view
from ..core._state import Liveness
from ..core._stats import Counters
from ..core._topology import pairing_problem, source_ranks, state_problem
from ..engines import Fence, FenceOutcome, TransferEngine, fence_writer
from ..io import _names, _probe
from ..io._control import ControlPlane
from ..io._security import is_loopback, register_mac

if TYPE_CHECKING:
    from ..metrics import AgentMetrics

log = logging.getLogger("trio_pd.decode")

#: how many closed prefill ranks' bootstrap records a decode rank remembers (``Sources``)
MAX_CLOSED_RANKS = 1024


@dataclass(eq=False, slots=True)
class PrefillRank:
    """One prefill rank this decode rank registered with."""

    endpoint: str
    tp_rank: int
    session: str
    ping_id: int = 0
    heartbeat_endpoint: str = ""
    #: ids of the rooms it serves here
    rooms: set[int] = field(default_factory=set)
    unanswered: int = 0  # pings sent since the last pong
    lost: bool = False
    #: its CURVE public key (z85) as the bootstrap service published it ("" with
    #: authentication off): the only key a STATUS, ABORT_ACK or PONG for it is taken from
    key: str = ""
    #: pipeline parallelism: its PP stage, and its id in STATUS and ABORT_ACK (``pp_rank *
    #: tp_size + tp_rank``; its TP rank without pipeline parallelism). The rooms' books count
    #: statuses and acks by this id: each (stage, TP rank) is a rank of its own
    pp_rank: int = 0
    #: (left out: its TP rank, the id of a rank of the only stage)
    rank_id: int = -1
    #: what its last probe answered (None: never probed): changes are logged once
    probed: Liveness | None = None
    #: our engine fenced off its writes (see :meth:`Sources.liveness`): it is gone for good
    fenced: bool = False
    #: a fence of it is being made (probes of several rooms share it)
    fencing: trio.Event | None = None
    #: it closed and said so (a BYE, sent after its last engine call): no write of it can
    #: land any more; it counts as drained for every room here
    closed: bool = False
    #: it takes landing pages (it published so), and was told of our landing area
    landing: bool = False

    def __post_init__(self) -> None:
        if self.rank_id < 0:
            self.rank_id = self.tp_rank


@dataclass(eq=False, slots=True)
class Instance:
    """One prefill instance (one bootstrap URL) and the ranks this decode rank reads from."""

    url: str
    sources: list[PrefillRank] = field(default_factory=list)
    ready: bool = False
    #: rooms created before the instance was resolved (the agent's records)
    waiting: list[Any] = field(default_factory=list)
    #: the instance's DP size, as its topology says once resolved (DP attention)
    dp_size: int | None = None
    #: resolving it failed (the agent's DP routing then asks the service directly)
    failed: bool = False


class WriterCheck:
    """Whether a prefill rank that writes our pages is gone: a probe, and our engine's fence
    when the probe is refused. Only a proven fence makes it GONE (SPEC §5.6)."""

    def __init__(self, *, engine: TransferEngine, probe_timeout: float,
                 threads: _probe.ProbeThreads, counters: Counters) -> None:
        self.engine, self.probe_timeout = engine, probe_timeout
        self.probe_threads, self.counters = threads, counters

    async def liveness(self, rank: PrefillRank) -> Liveness:
        """Probe a prefill rank (a writer of our pages). GONE only once our own engine has
        fenced it off: a probe that is refused (REFUSED) makes the fence worth trying, and
        the answer is GONE if the fence is proven, else UNKNOWN (the pages stay held). A
        change of what its probes answer is logged once (unknown, answering again; the fence
        logs its own outcome), not every probe: a held room's writers are probed at every ack
        timeout."""
        if rank.fenced or rank.closed:
            await trio.lowlevel.checkpoint()
            return Liveness.GONE
        state = await _probe.probe(
            self.engine,
            rank.session,
            control_endpoint=rank.endpoint,
            timeout=self.probe_timeout,
            threads=self.probe_threads,
            counters=self.counters,
        )
        refused = state is Liveness.REFUSED
        if refused:
            state = Liveness.GONE if await self._fence(rank) else Liveness.UNKNOWN
        seen, rank.probed = rank.probed, state
        if state is seen or (seen is None and state is Liveness.ALIVE):
            return state
        if state is Liveness.UNKNOWN and not refused:
            log.warning(
                "prefill rank %d at %s: no answer to a probe within %g s (unreachable, stopped "
                "or hung: its liveness is unknown); pages it may write stay held",
                rank.rank_id, rank.endpoint, self.probe_timeout,
            )
        elif state is Liveness.ALIVE:
            log.info("prefill rank %d at %s answers a probe again", rank.rank_id, rank.endpoint)
        return state

    async def _fence(self, rank: PrefillRank) -> bool:
        """Have our engine fence off ``rank``'s writes (``fence_writer``, in a thread, within
        ``probe_timeout``); True once proven. One fence per rank at a time: a probe that
        finds one under way waits for its answer. What it proved is logged; UNPROVEN is
        counted ``writers_unfenced``, UNKNOWN ``checks_unknown``."""
        if rank.fencing is not None:
            await rank.fencing.wait()
            return rank.fenced
        rank.fencing = done = trio.Event()
        try:
            fence = await self._make_fence(rank)
        finally:
            rank.fencing = None
            done.set()
        if fence is None:
            self.counters.bump("checks_unknown")
            log.warning("prefill rank %d (%s) refused a connection; the fence of its writes "
                        "did not answer within %g s: its pages stay held", rank.rank_id,
                        rank.endpoint, self.probe_timeout)
        elif fence.proven:
            rank.fenced = True
            self.counters.bump("writers_fenced")
            log.warning("prefill rank %d (%s) is gone: %s", rank.rank_id, rank.endpoint,
                        fence.detail)
        elif fence.outcome is FenceOutcome.UNKNOWN:
            self.counters.bump("checks_unknown")
            log.warning("prefill rank %d (%s) refused a connection, but its writes could not "
                        "be fenced now: %s: its pages stay held", rank.rank_id, rank.endpoint,
                        fence.detail)
        else:
            self.counters.bump("writers_unfenced")
            log.warning("prefill rank %d (%s) refused a connection, but nothing proves its "
                        "writes are over: %s: its pages stay held until it acks", rank.rank_id,
                        rank.endpoint, fence.detail)
        return rank.fenced

    async def _make_fence(self, rank: PrefillRank) -> Fence | None:
        """The engine's fence of ``rank``, or None if it gave no answer in time (or there
        was no thread for it)."""
        hosts = await _probe.peer_hosts(self.engine, rank.session, rank.endpoint)
        if not hosts:
            return Fence(FenceOutcome.UNKNOWN if hosts is not None else FenceOutcome.UNPROVEN,
                         "its host does not resolve" if hosts is not None
                         else "it is reached over no TCP host")
        with trio.move_on_after(self.probe_timeout):
            try:
                # (abandoned on cancel: a fence touches no page; the limiter's token is held
                # until the thread returns, as for a probe)
                return await trio.to_thread.run_sync(
                    fence_writer, self.engine, rank.session, hosts,
                    limiter=self.probe_threads.limiter, abandon_on_cancel=True,
                )
            except Exception as exc:  # (no thread, a closed engine: it did not run)
                log.warning("the fence of prefill rank %d could not run: %r", rank.rank_id, exc)
                await trio.lowlevel.checkpoint()
        return None


class Sources:
    """Resolve, register, heartbeat, loss (SPEC §5.6, §8.14)."""

    def __init__(
        self,
        *,
        engine: TransferEngine,
        pool: PoolSpec,
        tp_rank: int,
        tp_size: int,
        control: ControlPlane,
        counters: Counters,
        bootstrap_timeout: float,
        heartbeat_interval: float,
        heartbeat_misses: int,
        probe_timeout: float,
        on_resolved: Callable[[Instance], None],
        on_failed: Callable[[Instance, TransferError], None],
        on_lost: Callable[[PrefillRank], None],
        metrics: Callable[[], AgentMetrics | None] = lambda: None,
    ) -> None:
        self.engine, self.pool = engine, pool
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.control, self.counters = control, counters
        self.bootstrap_timeout = bootstrap_timeout
        self.heartbeat_interval, self.heartbeat_misses = heartbeat_interval, heartbeat_misses
        self.probe_timeout = probe_timeout
        self._on_resolved, self._on_failed, self._on_lost = on_resolved, on_failed, on_lost
        #: the landing area each REGISTER advertises: each KV buffer's base, and its pages
        #: (none: ``((), 0)``; trio_pd.core._landing)
        self.landing: tuple[tuple[int, ...], int] = ((), 0)
        self._metrics = metrics  # the agent's metrics, if attached (bootstrap_resolve_seconds)
        self.instances: dict[str, Instance] = {}
        self.ranks: dict[str, PrefillRank] = {}  # endpoint -> rank we registered with
        #: the bootstrap records, ``(endpoint, engine session, key)``, of ranks that closed
        #: (a BYE): the service still publishes them, but a room routed there would wait on
        #: an agent that reads nothing. The newest :data:`MAX_CLOSED_RANKS` are kept
        self.closed_records: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._ping_ids = itertools.count(1)
        #: probes (and fences) run in their own threads: bounded, one probe per rank at a
        #: time, so a hung rank holds up no other (see _probe)
        self.probe_threads = _probe.ProbeThreads()
        #: the probe and fence of a rank that writes our pages
        self.writers = WriterCheck(engine=engine, probe_timeout=probe_timeout,
                                   threads=self.probe_threads, counters=counters)
        self.nursery: trio.Nursery | None = None
        #: the cluster token: sent to bootstrap services, and the key of REGISTER proofs
        self.token: str | None = None
        #: how an https bootstrap service's certificate is checked (BootstrapClient's verify)
        self.verify: ssl.SSLContext | str | bool = True

    def instance(self, url: str) -> Instance:
        """The instance at ``url``, resolved in the background on first use."""
        inst = self.instances.get(url)
        if inst is None:
            inst = self.instances[url] = Instance(url)
            assert self.nursery is not None, "the decode agent is closed"
            self.nursery.start_soon(self._resolve, inst)
        return inst

    async def _resolve(self, inst: Instance) -> None:
        """Find the instance's topology, check that it pairs with our pool, and register with
        the ranks we read from."""
        t0 = time.perf_counter()
        try:
            async with BootstrapClient(
                inst.url, token=self.token or "", verify=self.verify
            ) as client:
                if self.control.curve:  # (so the prefill ranks admit our connections)
                    client.announce_key = self.control.public_key
                try:
                    with trio.fail_after(self.bootstrap_timeout):
                        topo = await client.wait_topology()
                except trio.TooSlowError:  # (what the service last said, or why it did not)
                    raise client.no_answer(self.bootstrap_timeout) from None
            server = client.server_address
            if server is not None and not is_own_address(server):
                problem = loopback_problem(
                    _published(topo, self.engine, self.control.endpoint), server
                )
                if problem is not None:
                    raise IncompatiblePeer(f"prefill instance {inst.url}: {problem}")
            infos = [await _numeric(info) for info in self._source_infos(topo)]
            inst.sources = [self._register_with(info) for info in infos]
        except Exception as exc:
            # Whatever the service's answer made go wrong fails this instance's rooms, not
            # the agent: this task resolves every instance (an answer that slipped past
            # the client's checks once raised IndexError here and closed the agent)
            error: TransferError
            if isinstance(exc, (IncompatiblePeer, PeerLost)):
                error = exc
            elif isinstance(exc, (BootstrapError, ProtocolError, OSError, TimeoutError)):
                error = BootstrapError(f"prefill instance {inst.url}: {exc}")
            else:
                error = BootstrapError(f"prefill instance {inst.url}: {exc!r}")
            log.warning("%s", error)
            if (metrics := self._metrics()) is not None:
                metrics.observe_resolve(time.perf_counter() - t0, ok=False)
            if self.instances.get(inst.url) is inst:
                del self.instances[inst.url]
            inst.failed = True
            self._on_failed(inst, error)
            await trio.lowlevel.checkpoint()
            return
        if (metrics := self._metrics()) is not None:
            metrics.observe_resolve(time.perf_counter() - t0, ok=True)
        inst.ready = True
        inst.dp_size = topo.dp_size
        self._on_resolved(inst)

    def _source_infos(self, topo: Topology) -> list[PrefillRankInfo]:
        """The prefill ranks this decode rank reads from: its TP source ranks in every PP
        stage (stage by stage), once every stage is checked to pair with our pool (each
        stage's layers inside ours, and the stages together holding exactly our layers)."""
        first = topo.ranks[0]
        if first.engine != self.engine.name:
            raise IncompatiblePeer(
                f"prefill uses engine {first.engine!r}, this decode rank {self.engine.name!r}"
            )
        problems = _pairing_problems(topo, self.pool, self.tp_rank, self.tp_size)
        infos: list[PrefillRankInfo] = []
        if _pairs_tp(topo.tp_size, self.tp_size, self.tp_rank):  # (else: problems says why)
            tp_sources = source_ranks(self.tp_rank, topo.tp_size, self.tp_size)
            infos = [topo.stage(s)[p] for s in range(topo.pp_size) for p in tp_sources]
        if problems:
            # Register anyway (best effort): the prefill ranks refuse it with their own
            # reason and count it, so the operator sees the mismatch on both sides.
            with contextlib.suppress(ValueError, ProtocolError):
                for info in infos:
                    self._register_with(info)
            raise IncompatiblePeer(
                f"prefill instance does not pair with this pool: {'; '.join(problems)}"
            )
        return infos

    def _register_with(self, info: PrefillRankInfo) -> PrefillRank:
        p = info.rank_id
        if (info.endpoint, info.engine_session, info.control_key) in self.closed_records:
            raise PeerLost(
                f"prefill rank {p} at {info.endpoint} closed (it said so); the bootstrap "
                "service still publishes it: a rank that takes its place must register anew"
            )
        rank = self.ranks.get(info.endpoint)
        if (
            rank is not None and rank.session == info.engine_session and not rank.lost
            and rank.key == info.control_key
        ):
            return rank
        curve = self.control.curve
        if curve != bool(info.control_key):
            raise IncompatiblePeer(
                f"prefill rank {p} runs with authentication "
                f"{'off (it publishes no CURVE key)' if curve else 'on'}, this decode rank "
                f"with it {'on' if curve else 'off'} (docs/security.md)"
            )
        rank = PrefillRank(
            info.endpoint,
            info.tp_rank,
            info.engine_session,
            next(self._ping_ids),
            info.heartbeat_endpoint or info.endpoint,
            key=info.control_key,
            pp_rank=info.pp_rank,
            rank_id=info.rank_id,
            landing=info.landing and self.landing[1] > 0,
        )
        control_key, auth = "", b""
        if curve:
            assert self.token is not None  # resolve() requires one with CURVE on
            self.control.authorize(rank.endpoint, rank.key)
            self.control.authorize(rank.heartbeat_endpoint, rank.key)
            control_key = self.control.public_key
            auth = register_mac(
                self.token, endpoint=self.control.endpoint, control_key=control_key,
                engine=self.engine.name, session=self.engine.session_id,
                decode_rank=self.tp_rank, decode_tp=self.tp_size,
            )
        self.ranks[info.endpoint] = rank
        msg = _wire.Register(
            v=_wire.WIRE_VERSION,
            endpoint=self.control.endpoint,
            decode_rank=self.tp_rank,
            decode_tp=self.tp_size,
            engine=self.engine.name,
            session=self.engine.session_id,
            engine_meta=self.engine.metadata(),
            # (a rank that published no dtype may predate the field, and would refuse it)
            pool=_wire.PoolWire.from_spec(
                self.pool, with_dtype=info.kv_dtype != UNKNOWN_DTYPE
            ),
            control_key=control_key,
            auth=auth,
            # (only to a rank that takes landing pages: an older one refuses the fields)
            landing_bases=self.landing[0] if rank.landing else (),
            landing_pages=self.landing[1] if rank.landing else 0,
        )
        if not self.control.send_nowait(info.endpoint, msg):
            raise ProtocolError(f"prefill rank {p} at {info.endpoint} is not reading")
        return rank

    # ---------------------------------------------------------------- heartbeat and loss

    async def heartbeat(self) -> None:
        """Ping every prefill rank we use; one that leaves ``heartbeat_misses`` pings in a row
        unanswered is lost. Misses are counted in pings, not seconds, so a stall of this
        process (a pong waiting unread) costs at most one miss.

        **Cancellation:** safe at any point.
        """
        async for _ in trio_util.periodic(self.heartbeat_interval):
            for rank in list(self.ranks.values()):
                if rank.lost:
                    continue
                if rank.unanswered >= self.heartbeat_misses:
                    self._lose(rank)
                    continue
                rank.unanswered += 1
                ping = _wire.Ping(
                    v=_wire.WIRE_VERSION, nonce=rank.ping_id,
                    endpoint=self.control.heartbeat_endpoint,
                )
                self.control.send_nowait(rank.heartbeat_endpoint, ping)

    def on_pong(self, nonce: int, sender: str | None = None) -> None:
        """A PONG: its rank answered. With authentication on (``sender`` given) only the
        rank's own key can answer for it: :class:`AuthenticationError` otherwise."""
        for rank in self.ranks.values():
            if rank.ping_id == nonce:
                if sender is not None and sender != rank.key:
                    raise AuthenticationError(
                        f"PONG for prefill rank {rank.tp_rank} from {sender}: not its key"
                    )
                rank.unanswered = 0

    def _lose(self, rank: PrefillRank) -> None:
        rank.lost = True
        self.counters.bump("peers_lost")
        log.warning(
            "prefill rank %d at %s lost: %d heartbeats unanswered; its %d rooms here fail "
            "(PeerLost), their pages held until it acks or is proven gone", rank.rank_id,
            rank.endpoint, rank.unanswered, len(rank.rooms),
        )
        if self.ranks.get(rank.endpoint) is rank:
            del self.ranks[rank.endpoint]
        self.control.forget(rank.heartbeat_endpoint)
        for url, inst in list(self.instances.items()):
            if rank in inst.sources:
                del self.instances[url]  # the next receiver re-resolves the instance
        self._on_lost(rank)

    def close(self, rank: PrefillRank) -> None:
        """``rank`` closed and said so (a BYE): it counts as drained for its rooms here (the
        caller carries that out), is pinged no more, and the instances that name it are
        resolved anew; its bootstrap record is remembered as closed."""
        if rank.closed:
            return
        rank.closed = True
        self.counters.bump("peers_closed")
        log.info(
            "prefill rank %d at %s closed (it said so after its last engine call): its %d "
            "rooms here fail, and none of its writes can land any more",
            rank.rank_id, rank.endpoint, len(rank.rooms),
        )
        record = (rank.endpoint, rank.session, rank.key)
        self.closed_records[record] = None
        while len(self.closed_records) > MAX_CLOSED_RANKS:
            self.closed_records.popitem(last=False)
        if self.ranks.get(rank.endpoint) is rank:
            del self.ranks[rank.endpoint]
        self.control.forget(rank.heartbeat_endpoint)
        for url, inst in list(self.instances.items()):
            if rank in inst.sources:
                del self.instances[url]

    async def liveness(self, rank: PrefillRank) -> Liveness:
        """:meth:`WriterCheck.liveness` of ``rank``."""
        return await self.writers.liveness(rank)

def _published(topo: Topology, engine: TransferEngine, endpoint: str) -> list[tuple[str, str, str]]:
    """Every address the instance's ranks and this rank (its control ``endpoint``, its
    ``engine``) publish, as ``(whose, address, the option that sets it)``."""
    made = f"make_engine({engine.name!r}, host=)"
    out = [("this decode rank's control endpoint", endpoint, "open_decode(host=)"),
           ("this decode rank's engine session", engine.session_id, made)]
    for r in topo.ranks:
        out += [(f"prefill rank {r.rank_id}'s control endpoint", r.endpoint,
                 "open_prefill(host=)"),
                (f"prefill rank {r.rank_id}'s engine session", r.engine_session, made)]
    return out


def _pairing_problems(topo: Topology, pool: PoolSpec, tp_rank: int, tp_size: int) -> list[str]:
    """Why the instance's PP stages do not pair with decode rank ``tp_rank`` of ``tp_size``
    holding ``pool`` (each stage's layers inside ours, and the stages together holding
    exactly our layers); empty when they do."""
    problems: list[str] = []
    next_layer = 0  # pipeline parallelism: where the next stage must start
    for s in range(topo.pp_size):
        head = topo.stage(s)[0]
        layers = head.num_layers or (pool.num_layers if topo.pp_size == 1 else 0)
        # bytes per head buffer by buffer, against our buffers of the stage's layers, and
        # every aux buffer's row bytes, when the prefill rank published them
        ours = _stage_head_bytes(pool, head.first_layer, layers)
        by_buffer = bool(head.buffer_head_bytes) and ours is not None
        problem = pairing_problem(
            layout=head.layout,  # type: ignore[arg-type]
            page_size=head.page_size,
            head_bytes=(head.buffer_head_bytes if by_buffer
                        else head.head_bytes or pool.head_bytes),
            num_layers=layers,
            aux_item_len=head.aux_item_lens or head.aux_item_len or pool.aux_item_len,
            kv_heads=head.kv_heads,
            prefill_tp=topo.tp_size,
            peer_layout=pool.layout,
            peer_page_size=pool.page_size,
            peer_head_bytes=ours if by_buffer and ours is not None else pool.head_bytes,
            peer_num_layers=pool.num_layers,
            # (an older prefill publishes the first aux buffer's row bytes alone)
            peer_aux_item_len=pool.aux_item_lens if head.aux_item_lens else pool.aux_item_len,
            peer_rank=tp_rank,
            peer_tp=tp_size,
            peer_heads=pool.heads,
            peer_first_head=pool.first_head,
            first_layer=head.first_layer,
            pp_rank=s,
            pp_size=topo.pp_size,
            kv_dtype=head.kv_dtype,
            peer_kv_dtype=pool.kv_dtype,
        )
        problem = problem or _states_problem(head, pool, topo.tp_size, tp_size,
                                             topo.pp_size)
        if problem is not None and problem not in problems:
            problems.append(problem)
        if topo.pp_size > 1 and head.first_layer != next_layer:
            problems.append(f"PP stage {s} starts at layer {head.first_layer}, not at "
                            f"{next_layer} (the stages must hold every layer once, in order)")
        next_layer = head.first_layer + layers
    if not problems and topo.pp_size > 1 and next_layer != pool.num_layers:
        problems.append(f"layers: the {topo.pp_size} PP stages hold layers 0.."
                        f"{next_layer - 1}, decode holds {pool.num_layers}")
    return problems


async def _numeric(info: PrefillRankInfo) -> PrefillRankInfo:
    """``info`` with its control endpoints numeric: a host name a bootstrap record gives is
    resolved here, off the I/O thread and bounded in time (``_names``), before any socket
    sees it. OSError or TimeoutError fail the instance's rooms with the reason.

    **Cancellation:** as :func:`trio_pd.io._names.resolve_endpoint`.
    """
    endpoint = await _names.resolve_endpoint(info.endpoint)
    heartbeat = info.heartbeat_endpoint
    if heartbeat:
        heartbeat = await _names.resolve_endpoint(heartbeat)
    if endpoint == info.endpoint and heartbeat == info.heartbeat_endpoint:
        return info
    return msgspec.structs.replace(info, endpoint=endpoint, heartbeat_endpoint=heartbeat)


def is_own_address(ip: str) -> bool:
    """Whether ``ip`` (an IP literal) is an address of this host, as its network namespace
    sees it: a loopback address, or one a socket can bind (nothing is sent or resolved)."""
    address = _wire.ip_literal(ip)
    if address is None:
        return False
    if address.is_loopback:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((ip, 0))
    except OSError:
        return False
    return True


def loopback_problem(published: Sequence[tuple[str, str, str]], server: str) -> str | None:
    """Why the prefill instance whose bootstrap service answered from ``server``, an
    address of another host, cannot be reached, or None: an address published there or here
    (``(whose, address, option)`` triples, :meth:`Sources._published`) that is a loopback
    address, which each host reads as itself. Pure."""
    loops = [(who, addr, option) for who, addr, option in published
             if (host := _wire.address_host(addr)) is not None and is_loopback(host)]
    if not loops:
        return None
    options = list(dict.fromkeys(option for _, _, option in loops))
    return (
        f"{'; '.join(f'{who} is {addr}' for who, addr, _ in loops)}: a loopback address, "
        f"but the bootstrap service answered from {server}, another host, and each host "
        f"reads a loopback address as itself. Set {' and '.join(options)} to an address the "
        "other hosts reach (docs/deployment.md)"
    )


def _pairs_tp(prefill_tp: int, decode_tp: int, decode_rank: int) -> bool:
    """Whether the two TP sizes pair at all (else there are no source ranks to name)."""
    try:
        source_ranks(decode_rank, prefill_tp, decode_tp)
    except ValueError:
        return False
    return True


def _stage_head_bytes(pool: PoolSpec, first_layer: int, layers: int) -> tuple[int, ...] | None:
    """Bytes per head of our buffers of layers ``[first_layer, first_layer + layers)``, in
    buffer order (what a prefill stage holding those layers must publish), or None when the
    range is not inside our pool (the pairing check says so on its own)."""
    try:
        return layer_view(pool, first_layer, layers).head_bytes_all
    except ValueError:
        return None


def _states_problem(
    head: PrefillRankInfo, pool: PoolSpec, prefill_tp: int, decode_tp: int, pp_size: int
) -> str | None:
    """Why the state components a prefill stage published cannot pair with ours, or None
    (:func:`~trio_pd.core._topology.state_problem`, as prefill applies it at REGISTER)."""
    try:
        theirs = [w.to_spec() for w in head.states]
    except ProtocolError as exc:
        return f"the prefill rank published state components that make no sense: {exc}"
    return state_problem(theirs, pool.states, prefill_tp, decode_tp, pp_size)
