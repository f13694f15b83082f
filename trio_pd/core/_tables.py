"""The room tables: each agent's rooms, the memory of ended rooms, the intake of messages for
them, and every room deadline, in one pure object per side.

A room machine (:mod:`._rooms`) decides about one room it is handed. What arrives at the edge
of a room (a TRANSFER before the scheduler made the room, an ABORT for a use long over, a
deadline that fires after the room id was reused) is decided here, by the agent's table:
:class:`PrefillRooms` and :class:`DecodeRooms`. Like the machines, a table imports no trio,
zmq or engine and reads no clock: every call returns the effects now due (the vocabulary of
:mod:`._rooms`, plus the few here), and the agent carries them out.

Deadlines are effects too. A table never waits: it says :class:`Arm` (kind, delay, key), the
agent's one timer task runs the key back into :meth:`PrefillRooms.handle_timer` (or
:meth:`DecodeRooms.handle_timer`) once the delay has passed, and the table decides what the
expiry means: an expiry whose entry was replaced since (the room id reused, the parked entry
taken) finds another generation and does nothing. Every deadline of SPEC §5.6 a room has is
in :class:`PrefillDeadlines` / :class:`DecodeDeadlines` and nowhere else. The pure core's
other deadlines have the same shape and a home of their own: a quarantine's fence
(:mod:`._fences`) and a room's wait for its DP rank (:mod:`._dp_routes`).

=====================================================  =====================================
rule                                                   here
=====================================================  =====================================
messages keyed by (room, epoch) (I4), prefill          :meth:`PrefillRooms.on_transfer`,
                                                       :meth:`PrefillRooms.on_abort`
an ABORT for a use not held is acked, tombstoned       :meth:`PrefillRooms.on_abort`
tombstones are bounded, oldest dropped first           :class:`Tombstones`
TRANSFERs before the room: parked, bounded             :meth:`PrefillRooms._park`
a TRANSFER only from the decode rank it registered as  :func:`_sender_problem`
a failed room's late TRANSFER is answered Failed       :meth:`PrefillRooms.forget`
messages keyed by (room, epoch) (I4), decode           :meth:`DecodeRooms.room_for`
the room deadlines (§5.6), and what each expiry does   :class:`PrefillDeadlines`,
                                                       :meth:`PrefillRooms.handle_timer`,
                                                       :class:`DecodeDeadlines`,
                                                       :meth:`DecodeRooms.handle_timer`
=====================================================  =====================================
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
from msgspec import UNSET

from ._errors import IncompatiblePeer, ProtocolError, TransferAborted, TransferError
from ._memory import check_aux_slot, check_state_slots, validate_pages
from ._rooms import (
    Arm,
    Count,
    DecodeRoom,
    Due,
    Effect,
    Failed,
    PeerPool,
    PrefillRoom,
    Reject,
    SendAck,
    SendFailed,
    TimerKind,
    reason_of,
)
from ._state import KVPoll
from ._wire import Register, Transfer

# --------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillDeadlines:
    """Every deadline of a prefill room, in seconds (SPEC §5.6: each fails or forgets; none
    frees a page)."""

    #: a room whose decode metadata has not all arrived by then fails; a parked TRANSFER
    #: whose room the scheduler has not created by then is dropped, and its decode rank
    #: told Failed (its room would otherwise wait out its own deadline); a failed room's late
    #: TRANSFERs are answered Failed for this long after it was forgotten
    bootstrap: float = 30.0
    #: an ABORT for a (room, epoch) this rank does not hold refuses its TRANSFER this long
    tombstone: float = 120.0


@dataclass(frozen=True, slots=True)
class DecodePeerView:
    """What the prefill table needs of the registered decode peer a TRANSFER names."""

    endpoint: str
    #: its engine session: a parked TRANSFER is taken only while the registration has it
    session: str
    decode_rank: int
    decode_tp: int
    pool: PeerPool
    #: the decode ranks (of its TP size) this prefill rank writes to
    served: tuple[int, ...]
    #: which registration of the endpoint this is: a REGISTER with another engine session,
    #: or with the same session but other memory (:func:`resolved_against`), is a new one,
    #: and a TRANSFER taken under an earlier one is written no more
    registration: int = 0


def resolved_against(msg: Register) -> tuple[object, ...]:
    """What a TRANSFER's page ids are resolved against in a REGISTER: the decode rank and
    TP size, the pool (its geometry and where its buffers are) and the landing area (its
    bases and its page count). A REGISTER from a registered endpoint, with its engine session,
    that changes any of it is a new registration (``DecodePeerView.registration``): page ids
    taken under the old one name memory the endpoint no longer registers, so the rooms that
    hold them fail (PeerLost) rather than be written into the new memory at the old ids."""
    return (msg.decode_rank, msg.decode_tp, msg.pool, msg.landing_bases, msg.landing_pages)


class _HasPrefillRoom(Protocol):
    @property
    def machine(self) -> PrefillRoom: ...


R = TypeVar("R", bound=_HasPrefillRoom)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RoomDeadline(Generic[T]):
    """The key of one room's deadline: that use of the room (the agent's record ``rec``),
    not its id, so a deadline of a use that ended never touches a later use of the id.
    (Records compare by identity, so two keys are equal when kind and use are.)"""

    kind: TimerKind
    rec: T


@dataclass(frozen=True, slots=True)
class IdDeadline:
    """The key of a deadline of a room id rather than of a use this rank holds: the expiry of
    a parked TRANSFER (``"parked"``), of a failed room's memory (``"failed"``), or of a
    tombstone (``"tombstone"``, for its ``epoch``). ``generation`` tells the entry armed for
    the id now from an earlier one: the expiry of an earlier entry does nothing. What an
    expiry makes due concerns :attr:`room` (a parked TRANSFER's senders are told Failed)."""

    kind: Literal["parked", "failed", "tombstone"]
    room: int
    generation: int
    epoch: int | None = None


@dataclass(eq=False, slots=True)
class _Parked:
    """A TRANSFER that came before the scheduler created its room."""

    endpoint: str
    session: str
    decode_rank: int
    epoch: int
    aux_slot: int
    num_pages: int
    required: int
    #: as decode sent them (int32): a parked TRANSFER costs 4 bytes per page id
    dst_pages: npt.NDArray[np.integer[Any]]
    prefix_pages: int = 0
    #: decode's slots of each state component, as sent (checked when the room takes it)
    state_slots: tuple[npt.NDArray[np.integer[Any]], ...] = ()
    #: the page ids are landing pages (``Transfer.landing``)
    landing: bool = False
    #: the registration they were checked against (``DecodePeerView.registration``)
    registration: int = 0

    @property
    def page_ids(self) -> int:
        """Page ids and state slots it keeps (what the table's bound counts)."""
        return len(self.dst_pages) + sum(len(s) for s in self.state_slots)


class Tombstones:
    """The (room, epoch)s decode aborted while this rank held nothing of them, bounded.

    Each lasts until the expiry its :class:`Arm` names; past ``limit`` the oldest goes at
    once (a peer's ABORTs must not grow memory without bound; a TRANSFER for a tombstone gone
    early is parked, and dropped at the bootstrap deadline). An expiry of a tombstone that
    was dropped early and made again finds another generation and leaves the new one.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: room -> its tombstoned epochs
        self.rooms: dict[int, set[int]] = {}
        #: every (room, epoch) held, oldest first -> the generation of its expiry
        self._order: dict[tuple[int, int], int] = {}
        self._generation = 0

    def __contains__(self, use: tuple[int, int]) -> bool:
        return use in self._order

    def add(self, room: int, epoch: int, after: float) -> Arm | None:
        """Tombstone (room, epoch); the expiry to arm, or None if it was already there."""
        if (room, epoch) in self._order:
            return None
        if len(self._order) >= self.limit:
            self._drop(*next(iter(self._order)))
        self._generation += 1
        self.rooms.setdefault(room, set()).add(epoch)
        self._order[(room, epoch)] = self._generation
        return Arm("tombstone", after, IdDeadline("tombstone", room, self._generation, epoch))

    def expire(self, room: int, epoch: int, generation: int) -> None:
        if self._order.get((room, epoch)) == generation:
            self._drop(room, epoch)

    def _drop(self, room: int, epoch: int) -> None:
        del self._order[(room, epoch)]
        epochs = self.rooms[room]
        epochs.discard(epoch)
        if not epochs:
            del self.rooms[room]


def _sender_problem(peer: DecodePeerView | None, endpoint: str, decode_rank: int) -> str | None:
    """Why a TRANSFER from ``endpoint`` naming ``decode_rank`` is refused whatever room it
    names, or None: the endpoint is not registered, it names another decode rank than it
    registered as (its REGISTER's rank decided which heads, aux row and state units it
    gets), or this prefill rank does not write to that rank."""
    if peer is None:
        return f"TRANSFER from unregistered endpoint {endpoint}"
    if decode_rank != peer.decode_rank:
        return (f"TRANSFER from {endpoint} names decode rank {decode_rank}; it registered "
                f"as rank {peer.decode_rank}")
    if decode_rank not in peer.served:
        return (f"TRANSFER from decode rank {decode_rank} of TP {peer.decode_tp}: this "
                "prefill rank does not write to it")
    return None


def _add_target(
    machine: PrefillRoom, peer: DecodePeerView, decode_rank: int, epoch: int, aux_slot: int,
    num_pages: int, pages: npt.NDArray[np.integer[Any]], prefix_pages: int = 0,
    state_slots: Sequence[npt.ArrayLike] = (), landing: bool = False,
) -> Due:
    """Hand a TRANSFER from ``peer`` to the room's machine."""
    return machine.add_target(
        endpoint=peer.endpoint, session=peer.session, decode_rank=decode_rank, epoch=epoch,
        aux_slot=aux_slot, num_pages=num_pages, dst_pages=pages, peer=peer.pool,
        expected=len(peer.served), prefix_pages=prefix_pages, state_slots=state_slots,
        landing=landing, registration=peer.registration,
    )


class PrefillRooms(Generic[R]):
    """The rooms of one prefill rank, and what arrives for rooms it does not hold.

    ``rooms`` maps a room id to the agent's record of its current use (anything with a
    ``machine``). Besides it, bounded and keyed by (room, epoch) (I4):

    * ``parked``: TRANSFERs that beat the scheduler's ``sender()`` (at most ``max_rooms``
      rooms and ``max_page_ids`` page ids; past that a TRANSFER is refused before its page
      ids are looked at), dropped at the bootstrap deadline, each sender told Failed;
    * ``tombstones``: (room, epoch)s decode aborted while this rank held nothing of them: a
      late TRANSFER for one is refused; each lasts ``deadlines.tombstone``, at most
      ``max_tombstones`` at once (:class:`Tombstones`);
    * ``aborted_parked``: room -> epoch of a parked use its ABORT cancelled: that use's
      ``sender()`` fails at once;
    * ``failed_recently``: room -> why a failed room failed, after it was forgotten: a late
      TRANSFER is answered Failed rather than left to wait.
    """

    def __init__(
        self,
        deadlines: PrefillDeadlines | None = None,
        *,
        max_rooms: int = 100_000,
        max_page_ids: int = 16 * 1024 * 1024,
        max_tombstones: int = 100_000,
    ) -> None:
        self.deadlines = deadlines or PrefillDeadlines()
        self.max_rooms, self.max_page_ids = max_rooms, max_page_ids
        #: room id -> the record of its use now; an entry leaves on :meth:`forget`
        self.rooms: dict[int, R] = {}
        self.parked: dict[int, dict[int, _Parked]] = {}
        #: page ids (and state slots) held by ``parked``, always their sum
        self.parked_page_ids = 0
        self._tombstones = Tombstones(max_tombstones)
        self.aborted_parked: dict[int, int] = {}
        self.failed_recently: dict[int, str] = {}
        #: ("parked" | "failed", room) -> generation of the expiry armed for the entry there
        #: now: an expiry of an earlier entry of the room id finds another and does nothing
        self._armed: dict[tuple[str, int], int] = {}
        self._generation = 0

    def get(self, room: int) -> R | None:
        return self.rooms.get(room)

    def _arm(self, kind: Literal["parked", "failed"], room: int) -> Arm:
        self._generation += 1
        self._armed[(kind, room)] = self._generation
        return Arm(kind, self.deadlines.bootstrap, IdDeadline(kind, room, self._generation))

    @property
    def tombstones(self) -> dict[int, set[int]]:
        """Room -> the epochs tombstoned for it (read-only view)."""
        return self._tombstones.rooms

    # ---------------------------------------------------------------- the scheduler

    def open(self, rec: R, peer_of: Callable[[str], DecodePeerView | None]) -> Due:
        """The scheduler made the room (``sender()``): hold it, arm its bootstrap deadline,
        fail it at once if decode already aborted this use, and hand it the TRANSFERs parked
        for it (those whose decode peer is still the registration that sent them).
        ``peer_of`` looks a decode endpoint up. Raises :class:`TransferError` if the room id
        is in use."""
        machine = rec.machine
        room, epoch = machine.room, machine.epoch
        if room in self.rooms:
            raise TransferError(f"room {room} is still in use")
        self.rooms[room] = rec
        due: Due = [Arm("bootstrap", self.deadlines.bootstrap, RoomDeadline("bootstrap", rec))]
        aborted = self.aborted_parked.pop(room, None)
        if (aborted is not None and epoch in (None, aborted)) or (
            epoch is not None and (room, epoch) in self._tombstones
        ):
            # decode aborted this very use before the scheduler created it here: fail now
            # rather than at the bootstrap deadline
            due += machine.close(TransferAborted(f"room {room} aborted by decode"))
        pending = self.parked.pop(room, None)
        if not pending:  # (the common case: sender() before any TRANSFER)
            return due
        self.parked_page_ids -= sum(p.page_ids for p in pending.values())
        for parked in pending.values():
            peer = peer_of(parked.endpoint)
            if peer is not None and (peer.session, peer.registration) == (
                parked.session, parked.registration
            ):  # else decode restarted, or moved the memory its page ids name
                due += _add_target(
                    machine, peer, parked.decode_rank, parked.epoch, parked.aux_slot,
                    parked.num_pages, parked.dst_pages, parked.prefix_pages,
                    parked.state_slots, parked.landing,
                )
        return due

    def forget(self, rec: R) -> Due:
        """The room's machine said Forget: drop the record; a failed room is remembered for
        a while, so that a late TRANSFER for it is answered Failed."""
        machine = rec.machine
        if self.rooms.get(machine.room) is rec:
            del self.rooms[machine.room]
        if machine.cell.status is not KVPoll.Failed:
            return []
        self.failed_recently[machine.room] = reason_of(machine.cell.failure)
        return [self._arm("failed", machine.room)]

    def decode_metadata(
        self, room: int, epoch: int | None, peer_of: Callable[[str], DecodePeerView | None]
    ) -> KVPoll:
        """What decode has said about a room not created yet (``PrefillAgent.decode_metadata``):
        Failed if it aborted that use, WaitingForInput once every decode rank this rank
        writes to has a parked TRANSFER for it, Bootstrapping before. A room held answers
        its own status."""
        held = self.rooms.get(room)
        if held is not None:
            return held.machine.cell.status
        if epoch is not None and (
            (room, epoch) in self._tombstones or self.aborted_parked.get(room) == epoch
        ):
            return KVPoll.Failed
        parked = [p for p in self.parked.get(room, {}).values()
                  if epoch is None or p.epoch == epoch]
        peer = peer_of(parked[0].endpoint) if parked else None
        if peer is None:
            return KVPoll.Bootstrapping
        got = {p.decode_rank for p in parked}
        return KVPoll.WaitingForInput if got.issuperset(peer.served) else KVPoll.Bootstrapping

    # ---------------------------------------------------------------- messages

    def on_transfer(
        self, msg: Transfer, pages: npt.NDArray[np.integer[Any]], peer: DecodePeerView | None,
        refused: str | None = None,
    ) -> Due:
        """A decode rank's TRANSFER ``msg`` with its page ids ``pages`` (from the endpoint it
        names, registered as ``peer``; ``refused`` is why its REGISTER was refused, if it
        was). In order: a TRANSFER for a tombstoned
        (room, epoch) is late; one from an endpoint that is not registered, or that names
        another decode rank than it registered as, or one this rank does not write to, is
        rejected (a refused registration's room fails with the reason); a late one is
        answered Failed (and fails this use of the room if that is the aborted use); one
        for a room held goes to its machine; the rest is checked and parked."""
        room_id, epoch, endpoint = msg.room, msg.epoch, msg.endpoint
        state_slots = () if msg.state_slots is UNSET else msg.state_slots
        rec = self.rooms.get(room_id)
        machine = rec.machine if rec is not None else None
        due: Due = []
        refuse: str | None = None
        abort_room = False
        if (room_id, epoch) in self._tombstones:
            # A decode rank aborted this (room, epoch) while nothing of it was here. Another
            # rank's TRANSFER can still be on its way: answer it, or it waits its deadline.
            due.append(Count("late_messages"))
            refuse = f"room {room_id} was aborted before this TRANSFER came"
            abort_room = machine is not None and machine.epoch in (None, epoch)
        elif machine is None and room_id in self.failed_recently:
            refuse = self.failed_recently[room_id]
        problem = _sender_problem(peer, endpoint, msg.decode_rank)
        if problem is not None:  # (it changes no room, but a refused registration's)
            if peer is None and refused is not None and machine is not None:
                due += machine.close(IncompatiblePeer(refused))
            return [*due, Reject(ProtocolError(problem))]
        assert peer is not None
        if refuse is not None:
            if abort_room and machine is not None:
                error = TransferAborted(f"room {room_id} was aborted by decode before this use")
                due += machine.close(error)
            return [*due, SendFailed(endpoint, epoch, refuse)]
        if machine is not None:
            return _add_target(
                machine, peer, msg.decode_rank, epoch, msg.aux_slot, msg.num_pages, pages,
                msg.prefix_pages, state_slots, msg.landing,
            )
        return self._park(msg, pages, state_slots, peer)

    def _park(
        self, msg: Transfer, dst_pages: npt.NDArray[np.integer[Any]],
        state_slots: Sequence[Sequence[int]], peer: DecodePeerView,
    ) -> Due:
        """Keep a TRANSFER for a room the scheduler has not created yet. Checked now, not
        when the room is made: a bad or stray TRANSFER must neither displace a good one nor
        surface later in ``sender()``. What could not be parked anyway is rejected before
        its page ids are looked at (sorting 4M ids costs the event loop ~0.1 s)."""
        room_id, decode_rank = msg.room, msg.decode_rank
        try:
            self.check_park(
                room_id, decode_rank, len(dst_pages) + sum(len(s) for s in state_slots)
            )
            if msg.landing and not peer.pool.landing_pages:
                raise ProtocolError(f"room {room_id}: landing pages, but no landing area")
            validate_pages(
                dst_pages, peer.pool.landing_pages if msg.landing else peer.pool.num_pages
            )
            check_aux_slot(msg.aux_slot, peer.pool.aux_slots, "decode aux slot")
            checked = check_state_slots(peer.pool.state_slots, state_slots, "destination")
        except ProtocolError as exc:
            return [Reject(exc)]
        entry = _Parked(
            peer.endpoint, peer.session, decode_rank, msg.epoch, msg.aux_slot, msg.num_pages,
            msg.required, dst_pages, msg.prefix_pages, checked, msg.landing, peer.registration,
        )
        pending = self.parked.get(room_id)
        due: Due = []
        if pending is None:
            pending = self.parked[room_id] = {}
            due.append(self._arm("parked", room_id))
        pending[decode_rank] = entry
        self.parked_page_ids += entry.page_ids
        return due

    def check_park(self, room_id: int, decode_rank: int, num_pages: int) -> None:
        """Raise :class:`ProtocolError` if a TRANSFER of ``num_pages`` page ids for
        ``room_id`` from ``decode_rank`` could not be parked (O(1))."""
        pending = self.parked.get(room_id)
        if pending is not None and decode_rank in pending:
            raise ProtocolError(
                f"a second TRANSFER for room {room_id} from decode rank {decode_rank}"
            )
        if pending is None and len(self.parked) >= self.max_rooms:
            raise ProtocolError("too many TRANSFERs for rooms this rank does not know")
        if self.parked_page_ids + num_pages > self.max_page_ids:
            raise ProtocolError("too many parked page ids for rooms this rank does not know")

    def on_abort(self, room_id: int, epoch: int, endpoint: str) -> Due:
        """ABORT from decode ``endpoint``. To the room only if it is this use (same epoch):
        its machine closes admission, then registers the ack target (SPEC §5.5). Otherwise
        (an unknown room, a concluded one, or one whose use has not told its epoch yet) this
        (room, epoch) provably holds nothing here: ack at once and leave a tombstone so a
        late TRANSFER for it is refused. A parked TRANSFER of that epoch is dropped, and the
        room's next ``sender()`` (that very use) fails at once."""
        rec = self.rooms.get(room_id)
        if rec is not None and rec.machine.epoch == epoch:
            return rec.machine.on_abort(endpoint, epoch)
        due: Due = []
        pending = self.parked.get(room_id)
        if pending is not None:
            for rank, parked in list(pending.items()):
                if parked.epoch == epoch:
                    del pending[rank]
                    self.parked_page_ids -= parked.page_ids
                    self.aborted_parked[room_id] = epoch
            if not pending:
                del self.parked[room_id]
        arm = self._tombstones.add(room_id, epoch, self.deadlines.tombstone)
        return [*due, arm, SendAck(endpoint, epoch)] if arm else [*due, SendAck(endpoint, epoch)]

    # ---------------------------------------------------------------- deadlines

    def handle_timer(self, key: Hashable) -> Due:
        """A deadline armed by an :class:`Arm` of this table has passed."""
        match key:
            case RoomDeadline(kind="bootstrap", rec=rec):
                # no (complete) decode metadata in time: fail; nothing is freed by it
                due = rec.machine.bootstrap_deadline(self.deadlines.bootstrap)
                return [Count("timeouts"), *due] if due else []
            case IdDeadline("parked" | "failed" as kind, room_id, generation):
                if self._armed.get((kind, room_id)) != generation:
                    return []  # armed for an earlier entry of this room id, since replaced
                del self._armed[(kind, room_id)]
                if kind == "failed":
                    self.failed_recently.pop(room_id, None)
                    return []
                # The scheduler did not make the room in time: each decode rank that sent a
                # TRANSFER is told (Failed), so its room fails now rather than wait out its
                # own deadline for writes this rank will never make. (Its ABORT then leaves a
                # tombstone here, so a sender() made later for that use fails at once.)
                expired: Due = []
                for parked in self.parked.pop(room_id, {}).values():
                    self.parked_page_ids -= parked.page_ids
                    expired.append(SendFailed(
                        parked.endpoint, parked.epoch,
                        f"room {room_id}: the prefill scheduler did not create it within "
                        f"{self.deadlines.bootstrap:g} s of its TRANSFER",
                    ))
                self.aborted_parked.pop(room_id, None)
                return expired
            case IdDeadline("tombstone", room_id, generation, int(epoch)):
                self._tombstones.expire(room_id, epoch, generation)
        return []

    # ---------------------------------------------------------------- closing

    def shutdown(self, reason: str) -> Iterator[tuple[int, R | None, Due]]:
        """The agent is closing and every engine call has returned: each parked TRANSFER is
        answered Failed and acked (nothing of ours will write its pages), each room is shut
        down (:meth:`PrefillRoom.shutdown`). Yields (room id, record, effects) per room, one
        at a time: carry each out before taking the next."""
        for room in list(self.parked):
            pending = self.parked.pop(room)
            self.parked_page_ids -= sum(p.page_ids for p in pending.values())
            due: list[Effect] = []
            for parked in pending.values():
                due += [SendFailed(parked.endpoint, parked.epoch, reason),
                        SendAck(parked.endpoint, parked.epoch)]
            yield room, None, due
        for rec in list(self.rooms.values()):
            yield rec.machine.room, rec, rec.machine.shutdown(reason)


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodeDeadlines:
    """Every deadline of a decode room, in seconds (SPEC §5.6: each fails and reports; only
    the ``"timeout"`` release policy frees on one, counted)."""

    #: a room not complete this long after its TRANSFERs went out fails; a receiver never
    #: given ``init`` this long after it was made is failed and forgotten
    waiting: float = 120.0
    #: drain acks awaited longer than this are asked again, and their writers probed
    ack: float = 10.0
    #: "drain": held pages go back only on a drain proof; "timeout": also at the ack deadline
    release_policy: Literal["drain", "timeout"] = "drain"


class _HasDecodeRoom(Protocol):
    @property
    def machine(self) -> DecodeRoom: ...


D = TypeVar("D", bound=_HasDecodeRoom)


class DecodeRooms(Generic[D]):
    """The rooms of one decode rank: the table of uses, the intake of STATUS and ABORT_ACK
    (keyed by (room, epoch), I4: one for another use, or for a room not yet resolved, is
    late and changes nothing), the scheduler giving a room up, and every room deadline."""

    def __init__(self, deadlines: DecodeDeadlines | None = None) -> None:
        self.deadlines = deadlines or DecodeDeadlines()
        #: room id -> the record of its use now; an entry leaves on :meth:`forget`
        self.rooms: dict[int, D] = {}

    def __len__(self) -> int:
        return len(self.rooms)

    def get(self, room: int) -> D | None:
        return self.rooms.get(room)

    def open(self, rec: D) -> Due:
        """The scheduler made a receiver: hold it, and arm its init deadline (a receiver
        dropped before ``init`` is reclaimed by it). Raises :class:`TransferError` if the
        room id is in use."""
        room = rec.machine.room
        if room in self.rooms:
            raise TransferError(f"room {room} is still in use")
        self.rooms[room] = rec
        return [Arm("init", self.deadlines.waiting, RoomDeadline("init", rec))]

    def forget(self, rec: D) -> None:
        """The room's machine said Forget: drop the record (if it is still this use)."""
        if self.rooms.get(rec.machine.room) is rec:
            del self.rooms[rec.machine.room]

    def timer(self, rec: D, kind: Literal["waiting", "ack"]) -> Arm:
        """The deadline a machine asked for (its TRANSFERs went out: ``"waiting"``; acks are
        awaited: ``"ack"``)."""
        after = self.deadlines.waiting if kind == "waiting" else self.deadlines.ack
        return Arm(kind, after, RoomDeadline(kind, rec))

    def room_for(self, room_id: int, epoch: int) -> D | None:
        """The use a STATUS or ABORT_ACK for (room, epoch) is for; None if late."""
        rec = self.rooms.get(room_id)
        # (machine.resolved, without the property's call)
        if rec is None or rec.machine.epoch != epoch or rec.machine.required is None:
            return None
        return rec

    def on_status(
        self, room_id: int, epoch: int, rank: int, ok: bool, reason: str,
        aux_ok: Callable[[D], bool], check: Callable[[D], None],
        land: Callable[[D], None] | None = None,
    ) -> Due:
        """A STATUS from prefill rank ``rank``: late (counted) unless for this use of a
        resolved room. ``check`` raises for a sender that may not speak for the rank (after
        the lateness check: a late message changes nothing, whoever sent it); ``aux_ok``
        reads the aux row's stamp; ``land`` copies a landed room's bytes into its pages
        before Success (:meth:`DecodeRoom.on_status`)."""
        rec = self.room_for(room_id, epoch)
        if rec is None:
            return [Count("late_messages")]
        check(rec)
        # (partial, not a lambda: the machine's call of it runs no frame of ours)
        return rec.machine.on_status(
            rank, ok, reason, partial(aux_ok, rec), None if land is None else partial(land, rec)
        )

    def on_ack(self, room_id: int, epoch: int, rank: int, check: Callable[[D], None]) -> Due:
        """An ABORT_ACK from prefill rank ``rank``: late (counted) unless for this use."""
        rec = self.room_for(room_id, epoch)
        if rec is None:
            return [Count("late_messages")]
        check(rec)
        return [Count("acks_received"), *rec.machine.on_ack(rank)]

    @staticmethod
    def give_up(rec: D, error: TransferError) -> Due:
        """The scheduler gave the room up (``abort()``): fail it, or, if it had succeeded
        unseen, hand its pages back now."""
        if rec.machine.status is KVPoll.Success:
            return rec.machine.unclaimed()
        return rec.machine.fail(error)

    def handle_timer(self, key: Hashable) -> Due:
        """A deadline armed by an :class:`Arm` of this table has passed."""
        match key:
            case RoomDeadline(kind="waiting", rec=rec):
                # not complete in time: fail (the pages stay held for the drain)
                waited: Due = rec.machine.waiting_deadline(self.deadlines.waiting)
                return [Count("timeouts"), *waited] if waited else []
            case RoomDeadline(kind="init", rec=rec):
                due: Due = rec.machine.init_deadline(self.deadlines.waiting)
                if not due:
                    return []
                counts: Due = [Count("rooms_reclaimed")]
                if any(isinstance(e, Failed) for e in due):
                    counts.append(Count("timeouts"))
                return counts + due
            case RoomDeadline(kind="ack", rec=rec):
                # acks are late, if pages are still held (the policy: DecodeRoom.ack_deadline)
                late: Due = rec.machine.ack_deadline(self.deadlines.release_policy)
                return [Count("timeouts"), *late] if late else []
        return []


__all__ = [
    "DecodeDeadlines",
    "DecodePeerView",
    "DecodeRooms",
    "IdDeadline",
    "PrefillDeadlines",
    "PrefillRooms",
    "RoomDeadline",
]
