"""The room machines: every decision about one request's transfer, on both sides, in one file.

This is the sans-I/O heart of trio_pd. Nothing here imports trio, zmq or an engine, reads a
clock or touches memory: each machine takes an *event* (a chunk admitted, a chunk's engine
calls settled, a TRANSFER / ABORT / STATUS / ABORT_ACK received, a deadline passed, a peer
proven gone, the agent closing) and returns what is now *due*, as a list of small effect
records. The agents (``_prefill``, ``_decode``) carry the effects out: they queue chunks,
cancel scopes, send messages, run ``on_release``, forget rooms. The vocabulary the machines
use (``StatusCell``, ``LeaseBook``, ``AckBook``, ``RankSet``) lives in ``_state``; a decode
room keeps its rank bookkeeping itself (:class:`DecodeRoom`).

Where each rule of the specification lives (one place each):

=====================================================  =====================================
rule                                                   here
=====================================================  =====================================
admission closes before an ack target exists (I2)      :meth:`PrefillRoom.close`, then
                                                       :meth:`PrefillRoom.on_abort`
a lease from admission to terminal I/O (I3)            :meth:`PrefillRoom.admit`,
                                                       :meth:`PrefillRoom.chunk_settled`
each layer of a page admitted once; the last chunk     :meth:`RequestPages.check`
completes every layer (layer-wise streaming)
an engine error quarantines, it does not free          :meth:`PrefillRoom.chunk_settled`
when publication is due                                :attr:`PrefillRoom.publish_due`
Success or Failed, and the sends, with no gap (§5.4)   :meth:`PrefillRoom.publish`
the drain ack once nothing is held (§5.5)              :meth:`PrefillRoom._settle`
release exactly once, forget after it                  :meth:`PrefillRoom._settle`
messages keyed by (room, epoch) (I4)                   :mod:`._tables`
TRANSFER validation                                    :meth:`Target.from_transfer`
decode's three-way status and Success rule (I6):       :meth:`DecodeRoom.on_status`,
every required rank's Success and the aux stamp        :attr:`DecodeRoom.all_succeeded`
one failure path with the drain (decode)               :meth:`DecodeRoom.fail`
decode's pages held until every contacted rank acked,  :attr:`DecodeRoom.drained`,
reported Success or is proven gone; released once      :meth:`DecodeRoom._maybe_release`
timeouts report, they do not free (§5.6)               :meth:`PrefillRoom.bootstrap_deadline`,
                                                       :meth:`DecodeRoom.waiting_deadline`,
                                                       :meth:`DecodeRoom.ack_deadline`
the ack deadline's policy (re-ask and probe, or free)  :meth:`DecodeRoom.ack_deadline`
a writer proven gone counts as drained                 :meth:`DecodeRoom.writer_gone`
=====================================================  =====================================

The machines do not know which process they run in; their tests drive them with plain
method calls (``tests/test_rooms.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from ._errors import (
    PeerLost,
    ProtocolError,
    RemoteFailure,
    TransferAborted,
    TransferError,
    TransferTimeout,
)
from ._memory import check_aux_slot, check_state_slots, pool_page_ids
from ._state import (
    AckBook,
    KVPoll,
    Lease,
    LeaseBook,
    Outcome,
    RankSet,
    StatusCell,
)

Pages: TypeAlias = npt.NDArray[np.int64]


def reason_of(error: TransferError | None) -> str:
    """The text a STATUS carries for a failure: its type and message."""
    if error is None:
        return ""
    return f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------------------------------
# Effects: what a machine hands back for the agent to do
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunChunks:
    """Prefill: ``n`` chunks were queued for the workers."""

    n: int


@dataclass(frozen=True, slots=True)
class CancelWork:
    """Prefill: cancel the room's work that has not reached the engine (its cancel scopes)."""

    reason: str


@dataclass(frozen=True, slots=True)
class PublishDue:
    """Prefill: the room's outcome is due; call ``publish``."""


@dataclass(frozen=True, slots=True)
class SendAck:
    """Prefill: send ABORT_ACK (room, ``epoch``) to the decode ``endpoint``."""

    endpoint: str
    epoch: int


@dataclass(frozen=True, slots=True)
class SendFailed:
    """Prefill: tell the decode ``endpoint`` that (room, ``epoch``) failed here (a Failed
    STATUS that must arrive, e.g. a TRANSFER that came too late)."""

    endpoint: str
    epoch: int
    reason: str


@dataclass(frozen=True, slots=True)
class Refused:
    """Prefill: a well-formed message was refused (count it, log it)."""

    error: ProtocolError


@dataclass(frozen=True, slots=True)
class Quarantine:
    """Prefill: ``lease`` errored; its pages stay out until its peers prove quiet or gone."""

    lease: Lease


@dataclass(frozen=True, slots=True)
class Failed:
    """Either side: the room just became Failed with ``error`` (count it, set its event)."""

    error: TransferError


@dataclass(frozen=True, slots=True)
class Succeeded:
    """Either side: the room just became Success."""


@dataclass(frozen=True, slots=True)
class Release:
    """Either side: run the room's ``on_release`` now (exactly once)."""

    how: Literal["drained", "peer_gone", "timeout", "unsent", "unclaimed"] = "drained"


@dataclass(frozen=True, slots=True)
class Forget:
    """Either side: the room holds nothing and owes nothing; drop it."""


@dataclass(frozen=True, slots=True)
class SendTransfers:
    """Decode: send TRANSFER to every source rank, and arm the waiting deadline."""


@dataclass(frozen=True, slots=True)
class SendAborts:
    """Decode: send ABORT to these prefill ranks (those that may still write our pages)."""

    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ArmAckDeadline:
    """Decode: acks are awaited; call ``ack_deadline`` after the ack timeout."""


@dataclass(frozen=True, slots=True)
class ProbeWriters:
    """Decode: acks are late; probe these prefill ranks (a writer proven gone counts)."""

    ranks: tuple[int, ...]


# --------------------------------------------------------------------------------------------
# Effects of the tables (:mod:`._tables`, :mod:`._fences`, :mod:`._dp_routes`): deadlines,
# counts, warnings, refusals
# --------------------------------------------------------------------------------------------

#: every kind of deadline of the pure core: the rooms' (:mod:`._tables`), a quarantine's
#: fence (:mod:`._fences`), a room's wait for its DP rank and the pause between two warnings
#: of it (:mod:`._dp_routes`)
TimerKind: TypeAlias = Literal[
    "bootstrap", "parked", "failed", "tombstone", "waiting", "init", "ack",
    "fence", "dp_route", "dp_warn",
]


@dataclass(frozen=True, slots=True)
class Arm:
    """Either side: hand ``key`` back to the agent's table's ``handle_timer`` once ``after`` seconds
    have passed. The table reads no clock, so the delay is relative: the agent turns it into
    a deadline at once. An expiry that is no longer wanted is ignored by the table, so the
    table never disarms anything (the agent lets a room's own deadlines go with its record,
    at ``Forget``: :mod:`trio_pd.io._timers`). The DP routes do disarm a room's deadline
    when its wait ends (:class:`~._dp_routes.Disarm`)."""

    kind: TimerKind
    after: float
    key: Hashable


@dataclass(frozen=True, slots=True)
class Count:
    """Either side: bump the agent's counter ``name`` (a timeout, a late message)."""

    name: Literal[
        "timeouts", "late_messages", "rooms_reclaimed", "acks_received",
        "quarantine_unknown", "quarantine_undrained", "quarantine_unflushed",
    ]


@dataclass(frozen=True, slots=True)
class Warn:
    """Either side: log ``message`` as a warning (the machine decided it is worth one)."""

    message: str


@dataclass(frozen=True, slots=True)
class Reject:
    """Either side: the message is refused; raise ``error`` to the listener (which counts
    it) once the effects before it are carried out. Always the last effect."""

    error: TransferError


Effect: TypeAlias = (
    RunChunks
    | CancelWork
    | PublishDue
    | SendAck
    | SendFailed
    | Refused
    | Quarantine
    | Failed
    | Succeeded
    | Release
    | Forget
    | SendTransfers
    | SendAborts
    | ArmAckDeadline
    | ProbeWriters
    | Arm
    | Count
    | Reject
)
Due: TypeAlias = list[Effect]


# --------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Target:
    """Where one decode rank wants this room's KV (from its TRANSFER)."""

    endpoint: str
    #: the decode engine session it registered with: a chunk is written only while the
    #: endpoint's registration still has it (a restarted decode is another session)
    session: str
    decode_rank: int
    epoch: int
    aux_slot: int
    dst_pages: Pages
    #: the room's first pages this rank holds already (its prefix cache): request page
    #: ``i >= prefix`` goes to ``dst_pages[i - prefix]``, the pages before it nowhere
    prefix: int = 0
    #: the decode rank's slots of each state component (written with the last chunk)
    state_slots: tuple[Pages, ...] = ()
    #: ``dst_pages`` are pages of the decode rank's landing area, not of its pool
    #: (trio_pd.core._landing)
    landing: bool = False
    #: which registration of the endpoint its page ids were resolved against
    #: (``DecodePeerView.registration``): a chunk is written only while the endpoint's
    #: registration is still that one (same session, same memory)
    registration: int = 0

    @classmethod
    def from_transfer(
        cls, room: PrefillRoom, endpoint: str, session: str, decode_rank: int, epoch: int,
        aux_slot: int, num_pages: int, dst_pages: npt.NDArray[np.integer[Any]], peer: PeerPool,
        prefix_pages: int, state_slots: Sequence[npt.ArrayLike], landing: bool = False,
        registration: int = 0,
    ) -> Target:
        """A decode rank's TRANSFER (arguments as :meth:`PrefillRoom.add_target` takes them)
        checked against the room (its epoch, once known, and its size) and against the sizes
        ``peer`` registered: the target, or :class:`ProtocolError` saying what does not fit."""
        if room.epoch is not None and epoch != room.epoch:
            raise ProtocolError(f"room {room.room}: epoch {epoch} disagrees with {room.epoch}")
        if prefix_pages + num_pages != room.num_pages:
            held = f" after a prefix of {prefix_pages}" if prefix_pages else ""
            raise ProtocolError(
                f"room {room.room}: decode sent {num_pages} pages{held}, prefill has "
                f"{room.num_pages}"
            )
        if landing and not peer.landing_pages:
            raise ProtocolError(f"room {room.room}: landing pages, but no landing area")
        # (the wire's decoder checked them against the largest pool; this is the peer's)
        ids = pool_page_ids(dst_pages, peer.landing_pages if landing else peer.num_pages)
        check_aux_slot(aux_slot, peer.aux_slots, "decode aux slot")
        dst_slots = check_state_slots(
            peer.state_slots, state_slots, "destination"
        ) if peer.state_slots or state_slots else ()
        return cls(
            endpoint, session, decode_rank, epoch, aux_slot, ids, prefix_pages, dst_slots,
            landing, registration,
        )


@dataclass(eq=False, slots=True)
class Chunk:
    """Admitted source pages ``[start, start + len(pages))`` of the room, under ``lease``:
    layers ``[layers[0], layers[1])`` of them (pool layer indices), or every layer (None)."""

    lease: Lease
    pages: Pages
    start: int
    last: bool
    layers: tuple[int, int] | None = None


@dataclass(eq=False, slots=True)
class RequestPages:
    """Which pages of which layers of one request were admitted: the rule every front end
    (the room machine, the thread facade's own check) applies to a send, in one place.

    Plain chunks cover every layer of the request's next pages. Layer-wise streaming
    (docs/layerwise.md): a chunk covers layers ``[a, b)`` of the next pages *for those
    layers*, which must all be at the same request page; its page ids are those any other
    layer admitted at the same request pages, and none of them is already another request
    page, so a layer of a page is never admitted twice. The last chunk leaves every layer of
    every page admitted: its aux row and state slots mean "the request is complete".

    Invariant: ``layer_pages[i]`` (or ``sent`` for every layer while it is None) only grows,
    and a refused chunk (:meth:`check` raised) changes nothing that counts.
    """

    room: int
    num_pages: int
    num_layers: int
    #: request pages admitted for every layer (the least of ``layer_pages``)
    sent: int = 0
    #: request pages admitted so far, layer by layer; None until the first chunk of some
    #: layers only (until then every layer is at ``sent``)
    layer_pages: list[int] | None = None
    #: the source page id admitted at each request page (-1: none yet); made at the first
    #: chunk of some layers only
    page_at: Pages | None = None
    #: the page ids of the plain chunks, in order (kept by reference: ``page_at`` is built
    #: from them if the request turns layer-wise)
    admitted: list[Pages] = field(default_factory=list)
    #: the last chunk was admitted
    last: bool = False

    def check_open(self) -> None:
        if self.last:
            raise ProtocolError(f"room {self.room}: a chunk after the last one")

    def check(
        self, pages: Pages, last: bool, layers: tuple[int, int] | None
    ) -> tuple[int, tuple[int, int] | None]:
        """Refuse a chunk that breaks the rule above (:class:`ProtocolError`); else the
        request page it starts at, and its layers (None: every layer)."""
        if self.last:
            self.check_open()  # (raises)
        if layers is not None and layers == (0, self.num_layers):
            layers = None  # every layer: a plain chunk
        if layers is None and self.layer_pages is None:
            end = self.sent + pages.size
            if end > self.num_pages or (last and end != self.num_pages):
                raise ProtocolError(
                    f"room {self.room}: chunk ends at page {end} of {self.num_pages}"
                    + (" (the last chunk must end at num_pages)" if last else "")
                )
            return self.sent, None
        a, b = layers if layers is not None else (0, self.num_layers)
        if not 0 <= a < b <= self.num_layers:
            raise ProtocolError(
                f"room {self.room}: layers [{a}, {b}) are not a range inside the pool's "
                f"{self.num_layers} layers"
            )
        counts = self.layer_pages or [self.sent] * self.num_layers
        start = counts[a]
        if any(counts[i] != start for i in range(a, b)):
            raise ProtocolError(
                f"room {self.room}: layers [{a}, {b}) are at different request pages "
                f"({counts[a:b]}); one send continues layers that are at the same page"
            )
        if len(pages):  # (first: a layer sent again says so, not that it runs past the end)
            self._check_ids(np.asarray(pages, dtype=np.int64), start, counts, a, b)
        end = start + len(pages)
        if end > self.num_pages:
            raise ProtocolError(
                f"room {self.room}: layers [{a}, {b}) would end at page {end} of "
                f"{self.num_pages}"
            )
        if last:
            after = [end if a <= i < b else n for i, n in enumerate(counts)]
            short = next((i for i, n in enumerate(after) if n != self.num_pages), None)
            if short is not None:
                raise ProtocolError(
                    f"room {self.room}: the last send leaves layer {short} at page "
                    f"{after[short]} of {self.num_pages}: it must complete every layer of "
                    "every page"
                )
        return start, layers

    def _check_ids(
        self, ids: Pages, start: int, counts: list[int], a: int, b: int
    ) -> None:
        page_at = self._page_at()
        known = page_at[start : start + ids.size]  # (shorter where it runs past the end)
        seen = np.zeros(ids.size, dtype=bool)
        seen[: known.size] = known >= 0
        clash = seen.copy()
        clash[: known.size] &= known != ids[: known.size]
        if clash.any():
            k = int(np.flatnonzero(clash)[0])
            raise ProtocolError(
                f"room {self.room}: request page {start + k} is page {int(known[k])} in "
                f"the layers admitted before, not {int(ids[k])}"
            )
        fresh = ids[~seen]
        again = fresh[np.isin(fresh, page_at)] if fresh.size else fresh
        if again.size:
            page = int(again[0])
            where = int(np.flatnonzero(page_at == page)[0])
            written = [i for i in range(a, b) if counts[i] > where]
            raise ProtocolError(
                f"room {self.room}: page {page} is request page {where} already"
                + (f", and its layer {written[0]} was admitted: each layer of a page is "
                   "written once" if written else "")
            )

    def _page_at(self) -> Pages:
        if self.page_at is None:
            self.page_at = np.full(self.num_pages, -1, dtype=np.int64)
            if self.admitted:
                done = np.concatenate(self.admitted).astype(np.int64, copy=False)
                self.page_at[: done.size] = done
        return self.page_at

    def advance(
        self, start: int, pages: Pages, last: bool, layers: tuple[int, int] | None
    ) -> None:
        """Record a chunk :meth:`check` passed (``start`` and ``layers`` as it returned)."""
        end = start + pages.size
        self.last = last
        if layers is None and self.layer_pages is None:
            self.sent = end
            if pages.size:
                self.admitted.append(pages)
            return
        a, b = layers if layers is not None else (0, self.num_layers)
        counts = self.layer_pages or [self.sent] * self.num_layers
        self._page_at()[start:end] = pages
        counts[a:b] = [end] * (b - a)
        self.layer_pages = counts
        self.sent = min(counts)


@dataclass(frozen=True, slots=True)
class PeerPool:
    """What a TRANSFER is checked against: the sizes the decode peer registered."""

    num_pages: int
    aux_slots: int
    #: slots of each of its state components
    state_slots: tuple[int, ...] = ()
    #: pages of its landing area (0: it advertised none)
    landing_pages: int = 0


@dataclass(eq=False, slots=True)
class ChunkQueue:
    """A prefill room's chunks admitted and not yet taken by a worker, in admission order, and
    the coalescing rule that joins the oldest of them into one engine call.

    The room decides when a chunk moves (:class:`PrefillRoom` holds one queue); the queue
    only keeps the order. Invariant: a chunk is in at most one of ``waiting`` and ``queued``,
    under a live lease, until it is taken (:meth:`take`) or dropped (:meth:`drop`).
    """

    #: admitted before the decode metadata arrived; queued once the room is ready
    waiting: list[Chunk] = field(default_factory=list)
    #: handed to the workers and not yet taken (dict as an ordered set: a third the size)
    queued: dict[Chunk, None] = field(default_factory=dict)

    def add(self, chunk: Chunk, ready: bool) -> bool:
        """A chunk just admitted: queued for the workers if the room is ``ready`` (True),
        else kept waiting for the decode metadata (False)."""
        if ready:
            self.queued[chunk] = None
        else:
            self.waiting.append(chunk)
        return ready

    def release(self) -> int:
        """The room became ready: every waiting chunk is queued; how many."""
        self.queued.update(dict.fromkeys(self.waiting))
        n, self.waiting = len(self.waiting), []
        return n

    def drop(self) -> tuple[Chunk, ...]:
        """Empty the queue (the room failed or the agent closes); the chunks it held."""
        dropped = (*self.waiting, *self.queued)
        self.waiting.clear()
        self.queued.clear()
        return dropped

    def take(
        self, limit: int, num_layers: int, merge: Callable[[list[Lease]], Lease]
    ) -> tuple[Chunk, int] | None:
        """The oldest queued chunk, joined by the chunks queued right behind it: one chunk,
        one lease, one engine call; with how many chunks joined it. None if the queue is
        empty (its chunks were cancelled, or an earlier take coalesced them).

        Chunks join along one direction: the next pages of the same layers (contiguous, up
        to ``limit`` pages in all), or, layer-wise, the next layers of the same pages (a
        model faster than its transfers queues several layers of a chunk before a worker
        gets to them: they go as one call, not one per layer).

        Each take is the room's *oldest* chunks: every chunk is taken, in admission order,
        whichever worker runs first (the agent keeps one job queued per room while chunks
        remain, not one per chunk)."""
        if not self.queued:
            return None
        first = next(iter(self.queued))
        del self.queued[first]
        npages = first.pages.size  # (a chunk's pages are a 1-D array: size, not a len call)
        group = [first]
        layers = first.layers
        for following in self.queued:  # admission order (a dict keeps insertion order)
            n = following.pages.size
            if (
                following.layers == first.layers
                and layers == first.layers
                and following.start == first.start + npages
                and npages + n <= limit
            ):
                npages += n
            elif (
                len(group) == 1 or layers != first.layers
            ) and layers is not None and following.layers is not None and (
                following.start == first.start
                and n == first.pages.size
                and following.layers[0] == layers[1]
            ):
                layers = (layers[0], following.layers[1])
            else:
                break
            group.append(following)
        if len(group) == 1:
            return first, 0
        for following in group[1:]:
            del self.queued[following]
        lease = merge([c.lease for c in group])
        if layers != first.layers:
            pages = first.pages  # (the same pages, more layers)
            if layers == (0, num_layers):
                layers = None
        else:
            pages = np.concatenate([c.pages for c in group])
        return Chunk(lease, pages, first.start, group[-1].last, layers), len(group) - 1


def check_source_slots(
    room: PrefillRoom, last: bool, state_slots: Sequence[npt.ArrayLike] | None
) -> tuple[Pages, ...]:
    """The state slots of a chunk :meth:`PrefillRoom.admit` takes, checked against this
    rank's own pool (one list per state component, inside it), with the last chunk only;
    or :class:`ProtocolError`. (Its page ids are checked there: :func:`pool_page_ids`.)"""
    if not last:
        raise ProtocolError(f"room {room.room}: state slots go with the last chunk")
    return check_state_slots(room.state_sizes, () if state_slots is None else state_slots, "source")


# a STATUS send for publication: (endpoint, epoch, ok, reason) -> accepted now?
StatusSend: TypeAlias = Callable[[str, int, bool, str], bool]


@dataclass(eq=False, slots=True)
class PrefillRoom:
    """One room on a prefill rank: admission, chunks, publication, drain acks, release.

    Invariants (each kept by the one method named):

    * ``leases.closed`` becomes True once (:meth:`close`, or the last chunk settling) and
      before any ack target is registered (:meth:`on_abort`); no chunk is admitted after it.
    * ``published`` becomes True once (:meth:`publish`); after it no STATUS of this room's
      outcome is sent again, and ``cell`` is terminal.
    * ``on_release`` is due exactly once (:meth:`_settle`): closed, and no live or
      quarantined lease.
    * The room is forgotten only once released *and* published.
    """

    room: int
    num_pages: int
    aux_slot: int
    #: pool size of this rank, for the page-id check of :meth:`admit`
    pool_pages: int
    #: slots of each of this rank's state components, for the check of :meth:`admit`
    state_sizes: tuple[int, ...] = ()
    #: this rank's slots of each state component, given with the last chunk
    state_slots: tuple[Pages, ...] = ()
    #: layers of this rank's pool, for the layer ranges of :meth:`admit`
    num_layers: int = 1
    cell: StatusCell = field(default_factory=StatusCell)
    leases: LeaseBook = field(init=False)
    acks: AckBook = field(default_factory=AckBook)
    #: decode rank -> where it wants the KV; set by :meth:`add_target`
    targets: dict[int, Target] = field(default_factory=dict)
    #: TRANSFERs the room waits for (decode ranks this rank serves); None before the first
    expected_targets: int | None = None
    #: this use's epoch, from its first TRANSFER; None before
    epoch: int | None = None
    #: admitted chunks no worker has taken yet
    chunks: ChunkQueue = field(default_factory=ChunkQueue)
    #: which pages of which layers were admitted (one rule for every front end)
    intake: RequestPages = field(init=False)
    published: bool = False
    released: bool = False
    forgotten: bool = False

    def __post_init__(self) -> None:
        self.leases = LeaseBook(self.room)
        self.intake = RequestPages(self.room, self.num_pages, self.num_layers)

    @property
    def sent_pages(self) -> int:
        """Request pages admitted for every layer."""
        return self.intake.sent

    @property
    def layer_pages(self) -> list[int] | None:
        """Layer-wise: request pages admitted, layer by layer (None: never layer-wise)."""
        return self.intake.layer_pages

    @property
    def last_admitted(self) -> bool:
        return self.intake.last

    @property
    def queued(self) -> dict[Chunk, None]:
        """The chunks handed to the workers and not yet taken (:attr:`ChunkQueue.queued`)."""
        return self.chunks.queued

    @property
    def ready(self) -> bool:
        """Every decode rank this rank serves for the room has sent its TRANSFER."""
        return self.expected_targets is not None and len(self.targets) >= self.expected_targets

    # ---------------------------------------------------------------- admission and chunks

    def admit(
        self, pages: npt.ArrayLike, last: bool,
        state_slots: Sequence[npt.ArrayLike] | None = None,
        layers: tuple[int, int] | None = None,
    ) -> Due:
        """The scheduler hands over the next chunk. Takes its lease at once (I3) or raises
        :class:`AdmissionClosed` (closed room, I2) / :class:`ProtocolError` (a chunk past
        ``num_pages``, after the last one, with page ids that are not integers, outside the
        pool or repeated, or state slots that are not one list per state component, inside
        it, or given before the last chunk). The state slots go with the last chunk, under
        its lease. ``pages`` are the caller's: checked and copied here, the one check of a
        chunk's page ids (:func:`pool_page_ids`), so reusing them later changes nothing.

        ``layers`` ``(a, b)``: the chunk is layers ``[a, b)`` of its pages only (layer-wise
        streaming, :class:`RequestPages`); None: every layer, the request's next pages."""
        intake = self.intake
        if intake.last:
            intake.check_open()  # (raises: the first thing a chunk after the last one hears)
        ids = pool_page_ids(pages, self.pool_pages)
        slots = None
        if state_slots is not None or (last and self.state_sizes):
            slots = check_source_slots(self, last, state_slots)
        start, layers = intake.check(ids, last, layers)
        lease = self.leases.admit(ids.size)  # raises AdmissionClosed: I2
        chunk = Chunk(lease, ids, start, last, layers)
        intake.advance(start, ids, last, layers)
        if slots is not None:  # (only the last chunk brings any: the room is unchanged else)
            self.state_slots = slots
        expected = self.expected_targets  # (ready, without the property's call)
        if not self.chunks.add(chunk, expected is not None and len(self.targets) >= expected):
            return []
        self.cell.advance(KVPoll.Transferring)
        return [RunChunks(1)]

    def take_chunks(self, limit: int) -> tuple[Chunk, int] | None:
        """The room's oldest queued chunks as one chunk under one lease (:meth:`ChunkQueue.take`),
        with how many chunks joined the first; None if nothing is queued."""
        return self.chunks.take(limit, self.num_layers, self.leases.merge)

    def chunk_settled(self, chunk: Chunk, outcome: Outcome, failure: TransferError | None) -> Due:
        """A chunk's engine calls are all terminal (all have returned). ``outcome`` is how
        they ended (SPEC §5.3): completed and cancelled retire the lease, an error quarantines
        it (completion of its blocks is unknown, so its pages do not go back on the error).
        ``failure`` is set when the chunk failed the room."""
        due: Due = []
        self.leases.settle(chunk.lease, outcome)
        if outcome is Outcome.ERROR:
            due.append(Quarantine(chunk.lease))
        if outcome is Outcome.CANCELLED and failure is None and not self.cell.terminal:
            # Its pages were never written, and nothing failed the room: Success would be a
            # lie. (The runner reports a chunk with nothing to write as COMPLETED, and one it
            # cancels as part of an abort after the room already failed.)
            failure = TransferError(
                f"room {self.room}: a chunk was cancelled before it was written"
            )
        if failure is not None:
            return due + self.close(failure)
        if chunk.last and not self.leases.closed:
            self.leases.close()  # concluded: nothing more can be admitted
        if self.publish_due:
            due.append(PublishDue())
        return due + self._settle()

    def end_quarantine(self, lease: Lease) -> Due:
        """The lease's peers proved quiet (answered after the engine's deadline) or gone."""
        if lease not in self.leases.quarantined:
            return []
        self.leases.end_quarantine(lease)
        return self._settle()

    # ---------------------------------------------------------------- decode metadata

    def add_target(
        self, *, endpoint: str, session: str, decode_rank: int, epoch: int, aux_slot: int,
        num_pages: int, dst_pages: npt.NDArray[np.integer[Any]], peer: PeerPool, expected: int,
        prefix_pages: int = 0, state_slots: Sequence[npt.ArrayLike] = (), landing: bool = False,
        registration: int = 0,
    ) -> Due:
        """A decode rank's TRANSFER for this room, from a registered peer. A bad one fails the room
        and that rank is told at once (no waiting for its own deadline); a late one for a room
        already over is answered Failed or dropped; a refusal is a :class:`Refused` effect (the
        listener counts it). A second TRANSFER from a rank that has one for this use is refused and
        changes nothing: decode sends one per use, so a second is a replay, a bug or a forgery, and
        taking it would write the room's bytes where decode never asked and still report Success."""
        if self.leases.closed or self.published:
            if self.cell.status is KVPoll.Failed:
                return [SendFailed(endpoint, epoch, reason_of(self.cell.failure))]
            return []
        if decode_rank in self.targets:
            return [Refused(ProtocolError(
                f"a second TRANSFER for room {self.room} from decode rank {decode_rank}"
            ))]
        try:
            target = Target.from_transfer(
                self, endpoint, session, decode_rank, epoch, aux_slot, num_pages, dst_pages,
                peer, prefix_pages, state_slots, landing, registration,
            )
        except ProtocolError as exc:
            return [Refused(exc), *self.close(exc), SendFailed(endpoint, epoch, reason_of(exc))]
        self.epoch = epoch
        self.targets[decode_rank] = target
        self.expected_targets = expected
        if not self.ready:
            return []
        n = self.chunks.release()
        # (one move, straight on to Transferring when chunks wait: no reader in between)
        self.cell.advance(KVPoll.Transferring if n else KVPoll.WaitingForInput)
        return [RunChunks(n)] if n else []

    # ---------------------------------------------------------------- publication

    @property
    def publish_due(self) -> bool:
        """Decidable now: unpublished, no live lease, failed or concluded with every TRANSFER in."""
        if self.published or self.leases.live:
            return False
        if self.cell.status is KVPoll.Failed:
            return True
        return self.leases.closed and self.ready

    def publish(self, send: StatusSend) -> Due:
        """Decide and send the room's outcome (SPEC §5.4). It is synchronous and
        ``send`` never blocks, so nothing interleaves between the check and the sends.

        Success is sent to each target while every send is accepted; the first refusal (a
        full socket) fails the room here and now, and the remaining targets (and the refused
        one, for the caller to retry) are sent Failed. A Success already accepted by one
        endpoint stands: this is not a distributed transaction. Local Success is written only
        after every send was accepted."""
        if not self.publish_due:
            return []
        self.published = True
        due: Due = []
        ok = self.cell.status is not KVPoll.Failed
        reason = "" if ok else reason_of(self.cell.failure)
        for target in self.targets.values():
            if send(target.endpoint, target.epoch, ok, reason):
                continue
            if ok:  # back-pressure: the room fails now; the refused endpoint gets Failed
                reason = f"STATUS to {target.endpoint} refused: its socket is full"
                ok = False
                error = TransferError(reason)
                self.cell.fail(error)
                due.append(Failed(error))
                reason = reason_of(error)
            due.append(SendFailed(target.endpoint, target.epoch, reason))
        if ok and self.cell.advance(KVPoll.Success):
            due.append(Succeeded())
        return due + self._settle()

    # ---------------------------------------------------------------- failure and abort

    def close(self, error: TransferError) -> Due:
        """Close admission, then fail the room (I2: before any ack target is registered).
        Work not yet started is cancelled; chunks already in the engine finish."""
        due: Due = []
        self.leases.close()
        if self.cell.fail(error):
            due.append(Failed(error))
        due.append(CancelWork(f"room {self.room}: {error}"))
        # chunks that never reached a worker are cancelled now, not when a worker gets to
        # them: the drain ack must not wait behind other rooms' work
        for chunk in self.chunks.drop():
            self.leases.settle(chunk.lease, Outcome.CANCELLED)
        if self.publish_due:
            due.append(PublishDue())
        return due + self._settle()

    def on_abort(self, endpoint: str, epoch: int) -> Due:
        """ABORT from a decode rank for *this* use (its epoch matches): close admission, then
        register the ack target, then ack once nothing is held (SPEC §5.5; the order is I2).
        The caller (:meth:`PrefillRooms.on_abort <trio_pd.core._tables.PrefillRooms.on_abort>`)
        routes ABORTs of other epochs elsewhere."""
        due = self.close(TransferAborted(f"aborted by decode {endpoint}"))
        self.acks.add_target(self.leases, endpoint, epoch)
        return due + self._settle()

    def bootstrap_deadline(self, timeout: float) -> Due:
        """No (complete) decode metadata in time: fail; nothing is freed by the deadline."""
        if self.ready or self.cell.terminal or self.forgotten:
            return []
        return self.close(TransferTimeout(
            f"room {self.room}: no decode metadata within {timeout:g} s (bootstrap timeout)"
        ))

    def shutdown(self, reason: str) -> Due:
        """The agent is closing and every engine call has returned. Tell each decode rank
        still waiting (a Failed STATUS where nothing was published, and an ack: none of our
        writes can land any more), except after an engine error, whose write may still land:
        those acks are withheld. Then hand every source page back."""
        due: Due = []
        unpublished = not self.published
        if not (self.published and self.cell.status is KVPoll.Success):
            for target in self.targets.values():
                if unpublished:
                    due.append(SendFailed(target.endpoint, target.epoch, reason))
                self.leases.close()  # (an ack target needs admission closed)
                self.acks.add_target(self.leases, target.endpoint, target.epoch)
        if not self.cell.terminal:
            error = TransferAborted(reason)
            self.cell.fail(error)
            due.append(Failed(error))
        if self.leases.quarantined:
            self.acks.withhold()
        self.leases.close()
        self.published = True
        self.chunks.drop()
        for lease in list(self.leases.live):
            self.leases.settle(lease, Outcome.CANCELLED)
        for lease in list(self.leases.quarantined):
            self.leases.end_quarantine(lease)  # our own pages: no engine call is running
        return due + self._settle()

    # ---------------------------------------------------------------- settling

    def _settle(self) -> Due:
        """What a change of leases made due: acks, then the release, then forgetting the room
        once it holds nothing and owes nothing."""
        owed = self.acks.due(self.leases)
        due: Due = [SendAck(ep, e) for ep, e in owed] if owed else []
        if self.leases.take_release():
            self.released = True
            due.append(Release())
        if self.released and self.published and not self.forgotten:
            self.forgotten = True
            due.append(Forget())
        return due


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class DecodeRoom:
    """One room on a decode rank: resolve, ask, decide Success, or fail and hold the pages
    until every prefill rank that may write them has acked its drain or is proven gone.

    The room is the one owner of its rank bookkeeping (SPEC §4, §5.5, I6): which source
    ranks must report Success (``required``), which were told of the pages (``writers``),
    which reported Success (``succeeded``) and which acked a drain or are proven gone
    (``acked``). Three phases, told apart by two fields: before the prefill instance is
    resolved ``required`` is None (a failure then tells no prefill rank: none knows the
    room); :meth:`bind` sets it; ``pages`` is set by :meth:`init`.

    The rules, one place each: Success needs every required rank's Success *and* the aux
    row stamped with this room and epoch (:meth:`on_status`, :attr:`all_succeeded`);
    ``on_release`` is due at most once (:meth:`_release`): for a Failed room, once every
    writer has acked, reported Success or been proven gone (:attr:`drained`,
    :meth:`_maybe_release`), or at once when no rank was ever told of the pages; for a
    room that succeeded, only if the scheduler gives it up unclaimed (:meth:`unclaimed`).
    Late acks are re-asked and probed, and free the pages only under the ``"timeout"``
    policy (:meth:`ack_deadline`).
    """

    room: int
    epoch: int
    #: the room's status on this rank (forward only, Failed absorbing, first reason kept)
    cell: StatusCell = field(default_factory=StatusCell)
    #: the source ranks that must each report Success; None until :meth:`bind`
    required: RankSet | None = None
    #: the contacted ranks: sent a TRANSFER (and, once the room fails, every required rank):
    #: each may write the pages until it acks, reports Success or is proven gone
    writers: RankSet = field(default_factory=RankSet)
    #: required ranks that reported Success (each only once all its writes returned)
    succeeded: RankSet = field(default_factory=RankSet)
    #: writers that acked their drain, or were proven gone (or given up: ``"timeout"``)
    acked: RankSet = field(default_factory=RankSet)
    #: the room failed after :meth:`bind`: its ranks were asked to drain
    aborting: bool = False
    pages: npt.NDArray[np.int32] | None = None
    #: the request's first pages this rank holds already (``init``): not asked for
    prefix_pages: int = 0
    aux_slot: int = -1
    #: the scheduler's slots of each state component (held and released with the pages)
    state_slots: tuple[Pages, ...] = ()
    released: bool = False
    forgotten: bool = False
    #: TRANSFERs were sent (the waiting deadline is armed)
    asked: bool = False

    @property
    def status(self) -> KVPoll:
        return self.cell.status

    @property
    def failure(self) -> TransferError | None:
        return self.cell.failure

    @property
    def resolved(self) -> bool:
        """The prefill instance is resolved (:meth:`bind`): STATUS and ABORT_ACK may come."""
        return self.required is not None

    @property
    def holding(self) -> bool:
        """Pages are held for a drain: failed, told some prefill rank, not yet released."""
        return self.pages is not None and not self.released and self.aborting

    @property
    def all_succeeded(self) -> bool:
        """The combined status over the required ranks (the minimum, I6) is Success: every
        one of them reported it (a failed rank fails the room before this is asked). None
        required is not Success: the minimum of no status is Bootstrapping."""
        required = 0 if self.required is None else self.required.bits
        return required != 0 and required & ~self.succeeded.bits == 0

    @property
    def drained(self) -> bool:
        """Every rank that may write our pages has acked its drain, been proven gone, or
        reported Success (it reports Success only once all of its writes returned)."""
        return (self.acked | self.succeeded) >= self.writers

    def bind(self, ranks: list[int]) -> Due:
        """The prefill instance is resolved: these are the room's source ranks."""
        self.required = RankSet(ranks)
        if self.cell.status is KVPoll.Failed:  # failed before: counted when it happened
            return self._drain()
        self.cell.advance(KVPoll.WaitingForInput)
        return self._ask()

    def init(
        self, pages: npt.NDArray[np.int32], aux_slot: int, prefix_pages: int = 0,
        state_slots: tuple[Pages, ...] = (),
    ) -> Due:
        """The scheduler gives the destination pages, aux row and state slots (validated by
        the caller), for the request's pages after the first ``prefix_pages`` (held
        already)."""
        if self.pages is not None:
            raise ProtocolError(f"room {self.room}: init called twice")
        self.pages = pages
        self.aux_slot = aux_slot
        self.prefix_pages = prefix_pages
        self.state_slots = state_slots
        if self.cell.status is KVPoll.Failed:
            # failed before its instance was resolved, or failed (and told its ranks)
            # before init: no prefill rank ever got these pages
            return self._release("unsent")
        return self._ask()

    def _ask(self) -> Due:
        if self.asked or self.pages is None or self.required is None:
            return []
        if self.cell.status is not KVPoll.WaitingForInput:
            return []
        self.asked = True
        return [SendTransfers()]

    def contacted(self, rank: int) -> None:
        """A TRANSFER to ``rank`` is about to be sent: it may write our pages from now on."""
        assert self.required is not None
        self.writers.add(rank)

    def fail(self, error: TransferError, *, propagated: bool = False) -> Due:
        """The one failure path: mark Failed, ask every source rank to drain (also those not
        sent a TRANSFER yet, so their senders fail now rather than at their deadline), hold
        the pages until each has acked (SPEC §5.5)."""
        due: Due = [Failed(error)] if self.cell.fail(error, propagated=propagated) else []
        if self.required is None:  # no prefill rank knows the room: nothing to drain
            if due and self.pages is not None:
                due += self._release("unsent")
            return due
        return due + self._drain()

    def _drain(self) -> Due:
        required = self.required
        assert required is not None
        if self.aborting or self.cell.status is not KVPoll.Failed:
            return []
        self.aborting = True
        self.writers |= required
        if self.pages is None:
            # no pages were given, so none was named to a prefill rank: nothing to hold. The
            # ABORTs still tell the senders; pages given to init later go back at once.
            self.forgotten = True
            return [SendAborts(tuple(required)), Forget()]
        if self.released:
            # given after the failure, so handed back unsent (and forgotten) then: nothing
            # is held, no ack is awaited; the ABORTs still tell the senders. (An ack deadline
            # would do nothing but keep the forgotten room's record until it passed.)
            return [SendAborts(tuple(required))]
        return [SendAborts(tuple(required)), ArmAckDeadline(), *self._maybe_release()]

    def on_status(
        self, rank: int, ok: bool, reason: str, aux_ok: Callable[[], bool],
        land: Callable[[], None] | None = None,
    ) -> Due:
        """A STATUS for this (room, epoch) from prefill rank ``rank``. ``aux_ok`` reads the
        aux row's stamp (called only when every rank succeeded). ``land``, when given, copies
        the room's landed bytes into its pages (trio_pd.core._landing): called only then,
        with the aux row good, before the room reads Success. Raises ProtocolError for a
        rank that is not one of the room's sources. A rank's Success counts once."""
        assert self.required is not None
        if rank not in self.required:
            raise ProtocolError(f"room {self.room}: STATUS from rank {rank}, not a source")
        if not ok:
            return self.fail(RemoteFailure(f"prefill rank {rank}: {reason}"), propagated=True)
        self.succeeded.add(rank)
        due: Due = []
        if self.all_succeeded and not self.cell.terminal:
            if aux_ok():
                if land is not None:  # (every byte is in the pages before Success)
                    land()
                self.cell.advance(KVPoll.Success)
                self.forgotten = True
                return [Succeeded(), Forget()]
            due += self.fail(ProtocolError(f"room {self.room}: aux row does not carry this epoch"))
        # after an abort a rank's Success proves its drain and may be the last proof awaited
        return due + self._maybe_release()

    def on_ack(self, rank: int) -> Due:
        """An ABORT_ACK from ``rank``: counts once, and only from a writer (another rank
        never had the pages)."""
        assert self.required is not None
        if rank in self.writers:
            self.acked.add(rank)
        return self._maybe_release()

    def waiting_deadline(self, timeout: float) -> Due:
        if self.required is None or self.cell.terminal:
            return []
        return self.fail(
            TransferTimeout(f"room {self.room}: not done within {timeout:g} s (waiting timeout)")
        )

    def init_deadline(self, timeout: float) -> Due:
        """The receiver was made ``timeout`` seconds ago and never given pages by ``init``:
        fail it (its ranks, once known, are told by ABORT; no page was ever named to them) and
        forget it, whatever phase it is in. A room given pages, or already forgotten, is left
        to its other deadlines. Every room is reclaimed by a deadline: a scheduler that drops
        a receiver before ``init`` no longer leaves it held for good."""
        if self.pages is not None or self.forgotten:
            return []
        due: Due = []
        if self.status is not KVPoll.Failed:
            due += self.fail(
                TransferTimeout(f"room {self.room}: no init within {timeout:g} s")
            )
        if not self.forgotten:  # (failed before its instance was resolved: nothing to drain)
            self.forgotten = True
            due.append(Forget())
        return due

    def ack_deadline(self, policy: Literal["drain", "timeout"]) -> Due:
        """Acks are late (the ack deadline's policy, whole): report nothing if no longer
        held; otherwise re-ask and probe the late writers (``"drain"``), or give them up
        and free the pages (``"timeout"``)."""
        if not self.holding:
            return []
        if policy == "timeout":
            self.acked |= self.writers
            return self._maybe_release("timeout")
        late = tuple(
            r for r in self.writers if r not in self.acked and r not in self.succeeded
        )
        return [SendAborts(late), ProbeWriters(late), ArmAckDeadline()]

    def peer_lost(self, rank: int, why: str = "") -> Due:
        """Rank ``rank`` stopped answering heartbeats (or closed: ``why``): fail, and probe it
        (a loss is not a proof: its writes may still land)."""
        if self.required is None or rank in self.succeeded or self.forgotten:
            return []
        error = PeerLost(why or f"prefill rank {rank} stopped answering")
        return [*self.fail(error), ProbeWriters((rank,))]

    def writer_gone(self, rank: int) -> Due:
        """Rank ``rank`` is proven gone: none of its writes can land; it counts as drained."""
        if self.required is None or self.released:
            return []
        self.acked.add(rank)
        return self._maybe_release("peer_gone")

    def _maybe_release(
        self, how: Literal["drained", "peer_gone", "timeout"] = "drained"
    ) -> Due:
        """The drain rule (SPEC §5.5, I1): held pages go back once every writer is drained."""
        if not self.holding or not self.drained:
            return []
        return self._release(how)

    def unclaimed(self) -> Due:
        """The room succeeded, but the scheduler gave it up (aborted it, or left its block)
        before Success was delivered to it: it will not take the pages, so they go back now.
        No prefill rank can still write them: each reported Success only after every
        engine call of the room had returned."""
        if self.status is not KVPoll.Success:
            return []
        return self._release("unclaimed")

    def _release(
        self, how: Literal["drained", "peer_gone", "timeout", "unsent", "unclaimed"]
    ) -> Due:
        """``on_release``, exactly once; the room is forgotten with it."""
        if self.released:
            return []
        self.released = True
        due: Due = [Release(how)]
        if not self.forgotten:
            self.forgotten = True
            due.append(Forget())
        return due

    def close(self, reason: str) -> Due:
        """The agent is closing: fail the room the normal way (its ranks are asked to drain);
        the pages go back only on the usual proof."""
        if self.status is KVPoll.Success or self.released:
            return []
        return self.fail(TransferAborted(reason))


__all__ = [
    "ArmAckDeadline",
    "CancelWork",
    "Chunk",
    "DecodeRoom",
    "Due",
    "Effect",
    "Failed",
    "Forget",
    "PeerPool",
    "PrefillRoom",
    "ProbeWriters",
    "PublishDue",
    "Quarantine",
    "Refused",
    "Release",
    "RequestPages",
    "RunChunks",
    "SendAborts",
    "SendAck",
    "SendFailed",
    "SendTransfers",
    "Succeeded",
    "TimerKind",
    "Target",
    "Arm",
    "Count",
    "Warn",
    "Reject",
    "reason_of",
]
