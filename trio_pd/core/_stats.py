"""Counters every agent keeps; ``statistics()`` returns a frozen snapshot of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Literal

from ._errors import TransferAborted

if TYPE_CHECKING:
    from ..metrics import AgentMetrics


@dataclass(frozen=True, slots=True)
class AgentStatistics:
    """A snapshot of one agent's counters. Counters only grow; gauges (``rooms_active``,
    ``leases_live``, ``leases_quarantined``, ``pages_held``, ``landing_held``) are current
    values. Which agent keeps which field: :data:`SIDES`, below."""

    #: gauge: rooms the agent still tracks
    rooms_active: int = 0
    #: prefill, gauge: chunk leases in flight (admitted, engine calls not all returned)
    leases_live: int = 0
    #: prefill, gauge: chunk leases held in quarantine after an engine error
    leases_quarantined: int = 0
    #: decode, gauge: destination pages of failed rooms held for their drain acks
    pages_held: int = 0
    #: decode, gauge: landing pages rooms hold (in flight, or failed and held with their
    #: pages for the drain: ``DecodeConfig.landing_bytes``)
    landing_held: int = 0
    #: rooms concluded with Success
    succeeded: int = 0
    #: rooms failed by anything but an abort (a TransferTimeout included)
    failed: int = 0
    #: rooms failed by a :class:`~trio_pd.TransferAborted` (the scheduler's or a peer's abort)
    aborted: int = 0
    #: deadlines that fired: bootstrap (prefill); waiting, init and ack (decode)
    timeouts: int = 0
    #: undecodable input: malformed, of an unknown version, oversized, or with a reply endpoint that
    #: is refused
    bad_messages: int = 0
    #: well-formed messages refused: about an unknown peer, a bad page, ...
    refused_messages: int = 0
    #: messages for a room or epoch no longer held: ignored
    late_messages: int = 0
    #: a message handler raised something not a :class:`~trio_pd.TransferError`: contained to that
    #: message
    handler_errors: int = 0
    #: sends to an endpoint that is refused (by the endpoint check or libzmq): nothing sent, no
    #: socket made
    bad_endpoints: int = 0
    #: authentication on: a message or connection refused for its identity (a forged
    #: REGISTER, TRANSFER, ABORT, STATUS, ABORT_ACK, PING or PONG; a message without a
    #: CURVE key; a ZAP request that is not CURVE). Also counted in refused_messages
    #: when a handler refused it
    auth_refused: int = 0
    #: authentication on: control connections refused at the handshake because nobody
    #: vouched for their CURVE key (a stranger; also counted in auth_refused)
    strangers_refused: int = 0
    #: prefill: engine writes completed
    engine_calls: int = 0
    #: prefill: chunks that joined the engine call of the room's chunk queued before them
    #: (``PrefillConfig.coalesce_pages``)
    chunks_coalesced: int = 0
    #: prefill: sends refused with a ProtocolError (a layer of a page admitted twice, a page
    #: past the request, a last send that leaves layers unadmitted...; docs/layerwise.md)
    sends_refused: int = 0
    #: prefill: chunk writes that rode in another room's engine call to the same decode peer
    #: (a lane joins what is queued; see PrefillConfig.batch_blocks)
    chunks_batched: int = 0
    #: prefill: chunk writes whose head slices were gathered into the staging area first
    #: (decode at a larger TP: one block per destination page run, not per token slot)
    chunks_staged: int = 0
    #: prefill: chunks written in place, per token slot, because the staging area was full
    staging_full: int = 0
    #: prefill: engine writes that failed
    engine_errors: int = 0
    #: prefill: bytes of the engine writes completed
    bytes_written: int = 0
    #: non-blocking sends that found a socket full
    send_backpressure: int = 0
    #: send attempts made by the outbox's retry rounds
    outbox_retried: int = 0
    #: messages that must arrive (a Failed STATUS, an ABORT, an ABORT_ACK) given up: undelivered for
    #: their deadline, or the oldest of an endpoint over its bound
    outbox_dropped: int = 0
    #: prefill: drain acks (ABORT_ACK) sent
    acks_sent: int = 0
    #: decode: drain acks (ABORT_ACK) received
    acks_received: int = 0
    #: prefill: leases quarantined by an engine error
    quarantined: int = 0
    #: prefill: quarantined leases retired by the fence or a peer proven gone
    released_after_quarantine: int = 0
    #: prefill: a quarantine fence passed but a peer's liveness was unknown: pages kept out
    quarantine_unknown: int = 0
    #: a quarantine kept after its peers answered: bytes we wrote to them were still in the
    #: kernel's send queue (see _sendq), or their host could not be named
    quarantine_undrained: int = 0
    #: a quarantine kept after its peers answered: the engine had not proven a failed call's
    #: blocks gone (no later call to the peer completed, a barrier write failed, or the
    #: engine can give no such proof: see _peers)
    quarantine_unflushed: int = 0
    #: decode: rooms still held, unproven, when the close deadline passed (pages not handed
    #: back: a write may still land there)
    rooms_unproven_at_close: int = 0
    #: decode: failed rooms released at ``ack_timeout`` without every ack
    #: (``release_policy="timeout"``)
    released_by_timeout: int = 0
    #: decode: failed rooms released without every ack because a writer was proven gone
    released_peer_gone: int = 0
    #: decode: prefill ranks whose writes our engine fenced off (a target-side fence, after
    #: a refused connect hinted they were gone): their held pages may go back
    writers_fenced: int = 0
    #: decode: fences tried that proved nothing (the engine or its transport has none, or the
    #: writer's engine still runs): the pages stay held (logged with the reason)
    writers_unfenced: int = 0
    #: a liveness, drain or fence check that could not run (no descriptor, no thread, the
    #: kernel's tables unreadable): taken as unknown, never as proof
    checks_unknown: int = 0
    #: a socket, descriptor or thread the agent needed could not be had (EMFILE, ENFILE,
    #: ENOMEM, a thread that would not start): the send or call that needed it failed
    #: there, locally, and the agent serves on
    resources_exhausted: int = 0
    #: prefill: rooms still quarantined when a closing agent stopped waiting for their fences
    #: (close_timeout): their drain acks are withheld, so decode keeps their pages
    rooms_unacked_at_close: int = 0
    #: prefill: decode peers marked failed (a probe did not answer ALIVE, or the engine could
    #: not add the peer): chunks to them fail fast with PeerLost
    peers_failed: int = 0
    #: prefill: failed marks ended by a probe that answered ALIVE
    peers_back: int = 0
    #: prefill: decode peers whose registration is over (a probe refused, or a new engine
    #: session registered); decode: prefill ranks lost to the heartbeat
    peers_lost: int = 0
    #: decode: prefill ranks that closed and said so (a BYE): drained for their rooms here
    peers_closed: int = 0
    #: prefill: rooms with a chunk in an engine call that raised (once per room): each fails,
    #: and quarantines that chunk's lease. Rooms failed beyond these were failed by their peer
    #: (PeerLost), an abort or a deadline, not by the call
    rooms_in_failed_calls: int = 0
    #: PUSH sockets closed to stay under the cap, or because nobody sent on them for a while
    sockets_evicted: int = 0
    #: prefill: decode peers dropped to make room for a new REGISTER (proven gone, or idle)
    peers_evicted: int = 0
    #: prefill: engine sessions of dropped peers that the engine was told to forget
    engine_peers_removed: int = 0
    #: prefill: REGISTERs refused because every peer slot was held by a live, busy peer
    peers_refused: int = 0
    #: prefill: REGISTERs with a registered endpoint's engine session but other memory (its
    #: pool or landing area moved, another rank): the rooms resolved against the old
    #: registration fail with PeerLost, its parked TRANSFERs are dropped
    registrations_moved: int = 0
    #: decode: receivers never given init within waiting_timeout, failed and forgotten
    rooms_reclaimed: int = 0
    #: decode: rooms that succeeded but were given up (aborted, or their block left) before
    #: Success was delivered to the scheduler: their pages went back through on_release
    released_unclaimed: int = 0
    #: decode: rooms whose pages were fragmented and that were written into landing pages,
    #: then copied into their pages before Success (``DecodeConfig.landing_bytes``)
    rooms_landed: int = 0
    #: decode: fragmented rooms sent their own pages because the landing area had no free
    #: run for them
    landing_full: int = 0


_COUNTER_NAMES = tuple(f.name for f in dataclasses.fields(AgentStatistics))

Side = Literal["prefill", "decode", "both"]

#: Which agent keeps each :class:`AgentStatistics` field: the one place that says it (the
#: metrics export a field only for the roles that keep it; the other role's would stay 0).
#: Every field is listed (tests/test_metrics.py checks it); one missing counts as "both".
SIDES: Final[Mapping[str, Side]] = MappingProxyType({
    "rooms_active": "both",
    "leases_live": "prefill",  # statistics() of the prefill rooms' lease books
    "leases_quarantined": "prefill",
    "pages_held": "decode",  # statistics() of the decode rooms held for a drain
    "landing_held": "decode",  # statistics() of the landing area
    "succeeded": "both",
    "failed": "both",
    "aborted": "both",
    "timeouts": "both",  # prefill: bootstrap deadline; decode: waiting, init and ack deadlines
    "bad_messages": "both",  # the control plane (_control), which both agents run
    "refused_messages": "both",
    "late_messages": "both",
    "handler_errors": "both",
    "bad_endpoints": "both",
    "auth_refused": "both",
    "strangers_refused": "both",
    "engine_calls": "prefill",  # the chunk runner (_chunks): only prefill writes
    "chunks_coalesced": "prefill",
    "sends_refused": "prefill",
    "chunks_batched": "prefill",
    "chunks_staged": "prefill",
    "staging_full": "prefill",
    "engine_errors": "prefill",
    "bytes_written": "prefill",
    "send_backpressure": "both",
    "outbox_retried": "both",  # the outbox (_outbox): prefill's acks and STATUS, decode's ABORTs
    "outbox_dropped": "both",
    "acks_sent": "prefill",
    "acks_received": "decode",
    "quarantined": "prefill",
    "released_after_quarantine": "prefill",
    "quarantine_unknown": "prefill",  # the decode peer registry (_peers)
    "quarantine_undrained": "prefill",
    "quarantine_unflushed": "prefill",
    "rooms_unproven_at_close": "decode",
    "released_by_timeout": "decode",
    "released_peer_gone": "decode",
    "writers_fenced": "decode",  # the prefill-rank sources (_sources)
    "writers_unfenced": "decode",
    "checks_unknown": "both",  # probes (both), send-queue checks (prefill), fences (decode)
    "resources_exhausted": "both",  # the control plane's sockets, the lanes' threads
    "rooms_unacked_at_close": "prefill",
    "peers_failed": "prefill",
    "peers_back": "prefill",
    "peers_lost": "both",  # prefill: decode peers proven gone; decode: lost to the heartbeat
    "peers_closed": "decode",
    "rooms_in_failed_calls": "prefill",
    "sockets_evicted": "both",
    "peers_evicted": "prefill",
    "engine_peers_removed": "prefill",
    "peers_refused": "prefill",
    "registrations_moved": "prefill",
    "rooms_reclaimed": "decode",
    "released_unclaimed": "decode",
    "rooms_landed": "decode",
    "landing_full": "decode",
})


class Counters:
    """The mutable twin of :class:`AgentStatistics` that an agent increments."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values = dict.fromkeys(_COUNTER_NAMES, 0)

    def bump(self, name: str, by: int = 1) -> None:
        if name not in self._values:
            raise KeyError(f"unknown counter {name!r}")
        self._values[name] += by

    def bump_write(self, joined: bool, nbytes: int) -> None:
        """A chunk's engine write returned: ``chunks_batched`` (it joined another's call) or
        ``engine_calls``, and its ``bytes_written``; one call for the two bumps."""
        values = self._values
        values["chunks_batched" if joined else "engine_calls"] += 1
        values["bytes_written"] += nbytes

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def snapshot(self, **gauges: int) -> AgentStatistics:
        return AgentStatistics(**{**self._values, **gauges})


def count_room_end(
    counters: Counters, metrics: AgentMetrics | None, started: float | None,
    error: BaseException | None = None,
) -> None:
    """A room's status became terminal (once per room): Success when ``error`` is None, else
    ``aborted`` (a :class:`~trio_pd.TransferAborted`) or ``failed``. Counted, and reported to
    ``metrics`` when attached (``started``: where its transfer latency runs from)."""
    if error is None:
        kind = "succeeded"
    else:
        kind = "aborted" if isinstance(error, TransferAborted) else "failed"
    counters.bump(kind)
    if metrics is not None:
        if error is not None:
            metrics.observe_failure(error)
        metrics.observe_room("success" if error is None else kind, started)
