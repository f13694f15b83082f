"""The room tables (``trio_pd.core._tables``), driven by plain calls: no trio, no engine, no socket.

What arrives at the edge of a room (a TRANSFER before the room, an ABORT for a use not held, a
deadline after the room id was reused) and what each deadline's expiry does, asserted on the
effects the tables return.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import trio_pd
from trio_pd.core._errors import ProtocolError, TransferAborted, TransferError, TransferTimeout
from trio_pd.core._rooms import (
    Arm,
    ArmAckDeadline,
    Count,
    DecodeRoom,
    Due,
    Failed,
    Forget,
    PeerPool,
    PrefillRoom,
    ProbeWriters,
    Reject,
    Release,
    SendAborts,
    SendAck,
    SendFailed,
    SendTransfers,
    Succeeded,
)
from trio_pd.core._state import KVPoll
from trio_pd.core._tables import (
    DecodeDeadlines,
    DecodePeerView,
    DecodeRooms,
    IdDeadline,
    PrefillDeadlines,
    PrefillRooms,
    RoomDeadline,
    resolved_against,
)
from trio_pd.core._wire import WIRE_VERSION, PoolWire, Register, Transfer
from trio_pd.testing.pools import HostKVPool

POOL = 64
DEADLINES = PrefillDeadlines(bootstrap=30.0, tombstone=120.0)


@dataclass(eq=False)
class Rec:
    """The agent's record of a room: all a table needs is its machine."""

    machine: PrefillRoom


def _view(rank: int, session: str = "s") -> DecodePeerView:
    return DecodePeerView(f"d{rank}", session, rank, 2, PeerPool(POOL, 8), (0, 1))


def _transfer(
    table: PrefillRooms[Rec], room: int, rank: int, epoch: int, n: int,
    peer: DecodePeerView | str | None = "registered", refused: str | None = None,
    dst_pages: np.ndarray[Any, Any] | None = None,
) -> Due:
    msg = Transfer(
        v=WIRE_VERSION, room=room, epoch=epoch, endpoint=f"d{rank}",
        decode_rank=rank, aux_slot=0, required=2, num_pages=n,
    )
    pages = np.arange(n, dtype=np.int32) if dst_pages is None else dst_pages
    view = _view(rank) if peer == "registered" else peer
    assert not isinstance(view, str)
    return table.on_transfer(msg, pages, view, refused)


def _room(room: int, n: int = 2, epoch: int | None = None) -> Rec:
    return Rec(PrefillRoom(room=room, num_pages=n, aux_slot=0, pool_pages=POOL, epoch=epoch))


def _arms(due: Due) -> list[Arm]:
    return [e for e in due if isinstance(e, Arm)]


def _peer_of(endpoint: str) -> DecodePeerView | None:
    return _view(int(endpoint[1:]))


# --------------------------------------------------------------------------------------------
# intake
# --------------------------------------------------------------------------------------------


def test_abort_for_a_use_that_has_not_told_its_epoch_does_not_touch_it() -> None:
    """ABORT (R, E1) while R's room exists with epoch None is acked and tombstoned, the room
    untouched; then a TRANSFER (R, E1) is refused (and fails that use), (R, E2) reaches the
    room; once the room has told its epoch, ABORT (R, E2) is for it."""
    table: PrefillRooms[Rec] = PrefillRooms(DEADLINES)
    rec = _room(9)
    table.open(rec, _peer_of)
    due = table.on_abort(9, 1, "d0")
    tombstone = IdDeadline("tombstone", 9, 1, epoch=1)
    assert due == [Arm("tombstone", 120.0, tombstone), SendAck("d0", 1)]
    assert not rec.machine.leases.closed and not rec.machine.cell.terminal
    other = _room(10)
    table.open(other, _peer_of)
    table.on_abort(10, 1, "d0")
    assert _transfer(table, 10, 0, 2, 2) == []  # another epoch: to the room
    assert other.machine.epoch == 2
    assert table.on_abort(10, 1, "d0") == [SendAck("d0", 1)]  # tombstone exists: no re-arm
    assert not other.machine.cell.terminal
    # (R, E1): late, refused, and the room (still without an epoch) is that aborted use
    due = _transfer(table, 9, 0, 1, 2)
    assert due[0] == Count("late_messages")
    assert any(isinstance(e, Failed) for e in due)
    assert isinstance(due[-1], SendFailed) and due[-1].epoch == 1
    due = table.on_abort(10, 2, "d0")
    assert rec.machine.cell.status is KVPoll.Failed
    assert other.machine.cell.status is KVPoll.Failed and other.machine.acks.targets == {"d0": 2}
    assert not any(isinstance(e, Arm) for e in due)


def test_transfer_intake_refusals() -> None:
    """A TRANSFER from an unregistered endpoint, naming another decode rank than it
    registered as, or for a rank this rank does not write to, is rejected and changes no
    room; one whose REGISTER was refused fails its room with the reason."""
    table: PrefillRooms[Rec] = PrefillRooms(DEADLINES)
    rec = _room(1)
    table.open(rec, _peer_of)
    due = _transfer(table, 1, 0, 5, 2, peer=None)
    assert len(due) == 1 and isinstance(due[0], Reject)
    due = _transfer(table, 1, 0, 5, 2, peer=DecodePeerView("d0", "s", 1, 2, PeerPool(POOL, 8),
                                                            (0, 1)))
    assert len(due) == 1 and isinstance(due[0], Reject) and "registered" in str(due[0].error)
    due = _transfer(table, 1, 0, 5, 2, peer=DecodePeerView("d0", "s", 0, 2, PeerPool(POOL, 8),
                                                            (1,)))
    assert len(due) == 1 and isinstance(due[0], Reject)
    assert not rec.machine.cell.terminal and table.parked == {}
    due = _transfer(table, 1, 0, 5, 2, peer=None, refused="layout differs")
    assert isinstance(due[-1], Reject) and any(isinstance(e, Failed) for e in due)
    assert rec.machine.cell.status is KVPoll.Failed
    assert "layout differs" in str(rec.machine.cell.failure)
    # a bad TRANSFER for a room not held is rejected before it is parked
    due = _transfer(table, 2, 0, 5, 2, dst_pages=np.array([0, POOL], dtype=np.int32))
    assert len(due) == 1 and isinstance(due[0], Reject) and table.parked == {}


def test_abort_of_a_parked_transfer_fails_the_next_sender() -> None:
    table: PrefillRooms[Rec] = PrefillRooms(DEADLINES)
    _transfer(table, 4, 0, 1, 3)
    _transfer(table, 4, 1, 2, 2)
    assert table.parked_page_ids == 5
    assert table.on_abort(4, 1, "d0")[-1] == SendAck("d0", 1)
    assert table.parked_page_ids == 2
    assert [p.epoch for p in table.parked[4].values()] == [2]
    rec = _room(4)
    due = table.open(rec, _peer_of)
    assert any(isinstance(e, Failed) for e in due)  # that use was aborted: it fails at once
    assert table.parked_page_ids == 0 and table.parked == {} and table.aborted_parked == {}


def test_parked_transfers_reach_the_room_the_scheduler_makes() -> None:
    table: PrefillRooms[Rec] = PrefillRooms(DEADLINES)
    assert _arms(_transfer(table, 3, 0, 7, 2)) == [Arm("parked", 30.0, IdDeadline("parked", 3, 1))]
    assert table.decode_metadata(3, 7, _peer_of) is KVPoll.Bootstrapping
    _transfer(table, 3, 1, 7, 2)
    assert table.decode_metadata(3, 7, _peer_of) is KVPoll.WaitingForInput
    assert table.decode_metadata(3, 8, _peer_of) is KVPoll.Bootstrapping
    rec = _room(3)
    due = table.open(rec, _peer_of)
    assert _arms(due) == [Arm("bootstrap", 30.0, RoomDeadline("bootstrap", rec))]
    assert sorted(rec.machine.targets) == [0, 1] and rec.machine.ready
    # a parked TRANSFER whose decode restarted since (another session) is not taken
    _transfer(table, 5, 0, 7, 2)
    rec5 = _room(5)
    table.open(rec5, lambda ep: _view(int(ep[1:]), session="restarted"))
    assert rec5.machine.targets == {} and table.parked == {}
    with pytest.raises(TransferError):
        table.open(_room(3), _peer_of)


def test_a_parked_transfer_is_taken_only_under_the_registration_it_was_checked_against() -> None:
    """Same engine session, but a registration that moved the memory (another
    ``registration``): the parked TRANSFER is not taken, its page ids name the old memory;
    a TRANSFER taken under a registration carries its number into the target, which the
    chunk runner compares before each write."""
    table: PrefillRooms[Rec] = PrefillRooms(DEADLINES)

    def view(registration: int) -> Callable[[str], DecodePeerView]:
        return lambda ep: replace(_view(int(ep[1:])), registration=registration)

    _transfer(table, 6, 0, 7, 2, peer=view(1)("d0"))
    rec = _room(6)
    table.open(rec, view(2))
    assert rec.machine.targets == {} and table.parked == {} and table.parked_page_ids == 0
    _transfer(table, 6, 0, 7, 2, peer=view(2)("d0"))  # sent again under the new one
    assert rec.machine.targets[0].registration == 2
    _transfer(table, 7, 0, 7, 2, peer=view(3)("d0"))
    rec7 = _room(7)
    table.open(rec7, view(3))  # the same registration: taken
    assert rec7.machine.targets[0].registration == 3


def test_what_a_registration_resolves_page_ids_against() -> None:
    """A REGISTER that changes the landing area, the pool or the rank is another
    registration for the rooms; the engine metadata and keys are not part of it."""
    pool = PoolWire.from_spec(HostKVPool(layout="mha", num_pages=8, num_layers=1, page_size=1,
                                         head_bytes=8, heads=1).spec)
    msg = Register(v=WIRE_VERSION, endpoint="tcp://127.0.0.1:1", decode_rank=0, decode_tp=1,
                   engine="mooncake", session="s", engine_meta=b"a", pool=pool,
                   landing_bases=(4096,), landing_pages=4)
    same = msgspec.structs.replace(msg, engine_meta=b"b", control_key="k")
    assert resolved_against(same) == resolved_against(msg)
    for moved in (
        msgspec.structs.replace(msg, landing_bases=(8192,)),
        msgspec.structs.replace(msg, landing_pages=3),
        msgspec.structs.replace(msg, landing_bases=(), landing_pages=0),
        msgspec.structs.replace(msg, pool=msgspec.structs.replace(
            pool, buffer_bases=tuple(b + 4096 for b in pool.buffer_bases))),
        msgspec.structs.replace(msg, decode_rank=1),
    ):
        assert resolved_against(moved) != resolved_against(msg)


def test_parking_is_bounded() -> None:
    table: PrefillRooms[Rec] = PrefillRooms(DEADLINES, max_rooms=2, max_page_ids=6)
    key = _arms(_transfer(table, 1, 0, 1, 2))[0].key
    assert _transfer(table, 1, 1, 1, 2) == []
    second = _transfer(table, 1, 1, 1, 0)  # a second TRANSFER from one rank
    assert isinstance(second[0], Reject)
    _transfer(table, 2, 0, 1, 1)
    assert isinstance(_transfer(table, 3, 0, 1, 0)[0], Reject)  # a third room
    assert isinstance(_transfer(table, 2, 1, 1, 2)[0], Reject)  # 7 page ids
    assert table.parked_page_ids == 5
    assert [type(e) for e in table.handle_timer(key)] == [SendFailed, SendFailed]
    assert table.parked_page_ids == 1
    with pytest.raises(ProtocolError):
        table.check_park(2, 0, 0)


def test_tombstones_are_bounded() -> None:
    """A flood of ABORTs for (room, epoch)s never held keeps at most ``max_tombstones``: the
    oldest go first, and the expiry armed for one dropped early leaves a newer one alone."""
    table: PrefillRooms[Rec] = PrefillRooms(DEADLINES, max_tombstones=3)
    keys = [_arms(table.on_abort(r, 1, "d0"))[0].key for r in range(5)]
    assert sorted(table.tombstones) == [2, 3, 4]
    assert 0 not in table.tombstones and table.tombstones[4] == {1}
    again = _arms(table.on_abort(0, 1, "d0"))[0].key  # room 0 again: room 2 goes
    assert sorted(table.tombstones) == [0, 3, 4]
    table.handle_timer(keys[0])  # the first tombstone of room 0 was dropped: not this one
    assert table.tombstones[0] == {1}
    table.handle_timer(again)
    assert 0 not in table.tombstones
    for key in keys:
        table.handle_timer(key)
    assert table.tombstones == {}


def test_failed_rooms_and_expiry() -> None:
    table: PrefillRooms[Rec] = PrefillRooms(DEADLINES)
    rec = _room(3)
    table.open(rec, _peer_of)
    rec.machine.close(TransferError("boom"))
    (arm,) = table.forget(rec)
    assert isinstance(arm, Arm) and arm.kind == "failed" and arm.after == 30.0
    assert table.get(3) is None
    due = _transfer(table, 3, 0, 1, 2)
    assert due == [SendFailed("d0", 1, "TransferError: boom")]
    table.handle_timer(arm.key)
    assert _arms(_transfer(table, 3, 0, 1, 2))  # now parked
    tomb = _arms(table.on_abort(3, 1, "d0"))[0].key
    assert table.parked == {}  # the abort dropped it
    assert isinstance(_transfer(table, 3, 1, 1, 2)[-1], SendFailed)
    assert not isinstance(_transfer(table, 3, 1, 2, 2)[-1], SendFailed)
    table.handle_timer(tomb)
    assert table.tombstones == {}


def test_an_expired_parked_transfer_fails_the_decode_room_that_sent_it() -> None:
    """A TRANSFER parked for a room the scheduler has not made by the bootstrap deadline is
    dropped, and each decode rank that sent one is told Failed: its room fails now, rather
    than wait its own (longer) deadline for writes this rank will never make. (Seen in a
    chaos run: prefill's and decode's schedulers, each out of pages, took different rooms;
    decode's TRANSFERs sat parked, were dropped in silence, and decode waited 120 s.)"""
    table: PrefillRooms[Rec] = PrefillRooms(DEADLINES)
    key = _arms(_transfer(table, 9, 0, 5, 2))[0].key
    _transfer(table, 9, 1, 5, 3)
    due = table.handle_timer(key)
    assert table.parked == {} and table.parked_page_ids == 0
    assert [(e.endpoint, e.epoch) for e in due if isinstance(e, SendFailed)] == [
        ("d0", 5), ("d1", 5)
    ]
    assert all("did not create it within 30 s" in e.reason for e in due
               if isinstance(e, SendFailed))
    assert table.handle_timer(key) == []  # (fired once; a stale expiry tells no one)


def test_old_expiry_spares_a_newer_entry() -> None:
    """An expiry armed for an earlier entry of a room id (parked, then taken, then parked
    again; failed, then failed again) leaves the newer entry alone."""
    table: PrefillRooms[Rec] = PrefillRooms(DEADLINES)
    old = _arms(_transfer(table, 5, 0, 1, 2))[0].key
    table.open(rec := _room(5), _peer_of)
    del table.rooms[5]  # (the room ended without failing)
    assert rec.machine.targets
    new = _arms(_transfer(table, 5, 0, 2, 2))[0].key
    table.handle_timer(old)
    assert 5 in table.parked and table.parked_page_ids == 2
    table.handle_timer(new)
    assert table.parked == {} and table.parked_page_ids == 0
    keys = []
    for why in ("first", "second"):
        failed = _room(6)
        table.open(failed, _peer_of)
        failed.machine.close(TransferError(why))
        keys.append(_arms(table.forget(failed))[0].key)
    table.handle_timer(keys[0])
    assert table.failed_recently == {6: "TransferError: second"}
    table.handle_timer(keys[1])
    assert table.failed_recently == {}


# --------------------------------------------------------------------------------------------
# deadlines
# --------------------------------------------------------------------------------------------


def test_bootstrap_deadline_fails_a_room_without_metadata_and_counts_it() -> None:
    table: PrefillRooms[Rec] = PrefillRooms(PrefillDeadlines(bootstrap=2.5))
    rec = _room(1)
    (arm,) = _arms(table.open(rec, _peer_of))
    assert arm.kind == "bootstrap" and arm.after == 2.5
    due = table.handle_timer(arm.key)
    assert due[0] == Count("timeouts")
    assert rec.machine.cell.status is KVPoll.Failed
    assert "2.5 s" in str(rec.machine.cell.failure)
    assert table.handle_timer(arm.key) == []  # already failed: nothing more


def test_bootstrap_deadline_spares_a_ready_room_and_a_reused_id() -> None:
    table: PrefillRooms[Rec] = PrefillRooms(DEADLINES)
    rec = _room(1)
    (arm,) = _arms(table.open(rec, _peer_of))
    _transfer(table, 1, 0, 3, 2)
    _transfer(table, 1, 1, 3, 2)
    assert rec.machine.ready
    assert table.handle_timer(arm.key) == []
    # the room ends and its id is reused: the old use's deadline does not touch the new one
    rec.machine.forgotten = True
    del table.rooms[1]
    new = _room(1)
    table.open(new, _peer_of)
    assert table.handle_timer(arm.key) == []
    assert not new.machine.cell.terminal


def test_shutdown_answers_parked_transfers_and_shuts_rooms() -> None:
    table: PrefillRooms[Rec] = PrefillRooms(DEADLINES)
    _transfer(table, 8, 0, 4, 1)
    rec = _room(2)
    table.open(rec, _peer_of)
    out = list(table.shutdown("closed"))
    assert out[0] == (8, None, [SendFailed("d0", 4, "closed"), SendAck("d0", 4)])
    assert out[1][:2] == (2, rec) and any(isinstance(e, Failed) for e in out[1][2])
    assert table.parked == {} and table.parked_page_ids == 0


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class DRec:
    machine: DecodeRoom


def _resolved(table: DecodeRooms[DRec], room: int = 1, epoch: int = 2) -> DRec:
    """A receiver made, resolved to prefill ranks 0 and 1, given pages, TRANSFERs sent."""
    rec = DRec(DecodeRoom(room, epoch))
    table.open(rec)
    rec.machine.bind([0, 1])
    assert rec.machine.init(np.arange(3, dtype=np.int32), 0) == [SendTransfers()]
    rec.machine.contacted(0)
    rec.machine.contacted(1)
    return rec


def _no_check(rec: DRec) -> None:
    pass


def test_decode_messages_for_another_use_are_late() -> None:
    """A STATUS or ABORT_ACK for another epoch, a room not held, or a room not yet resolved
    is counted late and changes nothing, and the sender check does not even run."""
    table: DecodeRooms[DRec] = DecodeRooms()
    rec = _resolved(table)
    asked: list[DRec] = []
    late = [Count("late_messages")]
    assert table.on_status(1, 3, 0, False, "x", lambda r: True, asked.append) == late
    assert table.on_status(9, 2, 0, False, "x", lambda r: True, asked.append) == late
    assert table.on_ack(1, 3, 0, asked.append) == late
    early = DRec(DecodeRoom(4, 2))
    table.open(early)
    assert table.on_status(4, 2, 0, True, "", lambda r: True, asked.append) == late
    assert asked == [] and rec.machine.status is KVPoll.WaitingForInput
    # this use: checked, then to the machine; Success needs both ranks and the aux stamp
    assert table.on_status(1, 2, 0, True, "", lambda r: True, asked.append) == []
    due = table.on_status(1, 2, 1, True, "", lambda r: r is rec, asked.append)
    assert due == [Succeeded(), Forget()] and asked == [rec, rec]


def test_decode_acks_release_after_every_rank() -> None:
    table: DecodeRooms[DRec] = DecodeRooms()
    rec = _resolved(table)
    table.give_up(rec, TransferAborted("x"))
    assert table.on_ack(1, 2, 0, _no_check) == [Count("acks_received")]
    assert table.on_ack(1, 2, 1, _no_check) == [
        Count("acks_received"), Release("drained"), Forget(),
    ]


def test_decode_give_up_after_unseen_success_releases() -> None:
    table: DecodeRooms[DRec] = DecodeRooms()
    rec = _resolved(table)
    table.on_status(1, 2, 0, True, "", lambda r: True, _no_check)
    table.on_status(1, 2, 1, True, "", lambda r: True, _no_check)
    assert table.give_up(rec, TransferAborted("x")) == [Release("unclaimed")]


def test_decode_deadlines() -> None:
    """Init: a receiver never given pages is failed and forgotten, counted reclaimed.
    Waiting: a room not complete fails, counted, pages held. Ack: late acks are asked
    again and their writers probed; the "timeout" policy frees, and says so."""
    table: DecodeRooms[DRec] = DecodeRooms(DecodeDeadlines(waiting=5.0, ack=1.5))
    idle = DRec(DecodeRoom(7, 1))
    (arm,) = table.open(idle)
    assert isinstance(arm, Arm) and arm.kind == "init" and arm.after == 5.0
    due = table.handle_timer(arm.key)
    assert due[:2] == [Count("rooms_reclaimed"), Count("timeouts")] and Forget() in due
    assert table.handle_timer(arm.key) == []  # once
    rec = _resolved(table)
    waiting = table.timer(rec, "waiting")
    assert waiting == Arm("waiting", 5.0, RoomDeadline("waiting", rec))
    init = RoomDeadline("init", rec)
    assert table.handle_timer(init) == []  # it was given pages: left to its other deadlines
    due = table.handle_timer(waiting.key)
    assert due[0] == Count("timeouts") and isinstance(due[1], Failed)
    assert isinstance(due[1].error, TransferTimeout) and ArmAckDeadline() in due
    assert rec.machine.holding
    ack = table.timer(rec, "ack")
    assert ack.kind == "ack" and ack.after == 1.5
    assert table.handle_timer(ack.key) == [
        Count("timeouts"), SendAborts((0, 1)), ProbeWriters((0, 1)), ArmAckDeadline(),
    ]
    assert table.handle_timer(waiting.key) == []  # failed already: nothing more
    freeing: DecodeRooms[DRec] = DecodeRooms(DecodeDeadlines(release_policy="timeout"))
    other = _resolved(freeing, room=3)
    freeing.give_up(other, TransferAborted("x"))
    assert freeing.handle_timer(freeing.timer(other, "ack").key) == [
        Count("timeouts"), Release("timeout"), Forget(),
    ]
    assert freeing.handle_timer(freeing.timer(other, "ack").key) == []  # released


def test_decode_reused_room_id_is_another_use() -> None:
    table: DecodeRooms[DRec] = DecodeRooms()
    old = DRec(DecodeRoom(1, 1))
    (arm,) = table.open(old)
    assert isinstance(arm, Arm)
    with pytest.raises(TransferError):
        table.open(DRec(DecodeRoom(1, 2)))
    old.machine.init_deadline(1.0)
    table.forget(old)
    new = _resolved(table, room=1, epoch=2)
    table.forget(old)  # (a late Forget of the old use leaves the new one)
    assert table.get(1) is new
    assert table.handle_timer(arm.key) == []  # the old use's init deadline: nothing
    assert new.machine.status is not KVPoll.Failed


# --------------------------------------------------------------------------------------------
# the parked / tombstone memory as a state machine
# --------------------------------------------------------------------------------------------


class PrefillTableRules(RuleBasedStateMachine):
    """Parked TRANSFERs, tombstones and aborted parked uses, keyed by (room, epoch), bounded,
    and cleaned up exactly by their expiry keys (I4)."""

    def __init__(self) -> None:
        super().__init__()
        self.table: PrefillRooms[Rec] = PrefillRooms(DEADLINES, max_rooms=3, max_page_ids=10)
        self.parked: dict[int, dict[int, tuple[int, int]]] = {}  # room -> rank -> (epoch, n)
        self.tombstones: dict[int, set[int]] = {}
        self.aborted: dict[int, int] = {}
        self.failed: dict[int, str] = {}
        self.keys: list[Any] = []
        #: (kind, room) -> the expiry key armed for the entry there now
        self.live: dict[tuple[str, int], Any] = {}

    @property
    def page_ids(self) -> int:
        return sum(n for ranks in self.parked.values() for _, n in ranks.values())

    @rule(room=st.integers(0, 3), rank=st.integers(0, 1), epoch=st.integers(1, 2),
          n=st.integers(0, 5))
    def transfer(self, room: int, rank: int, epoch: int, n: int) -> None:
        """A TRANSFER for a room the scheduler has not created: refused or parked."""
        due = _transfer(self.table, room, rank, epoch, n)
        if epoch in self.tombstones.get(room, set()):
            assert due[0] == Count("late_messages") and len(due) == 2
            assert isinstance(due[1], SendFailed) and due[1].epoch == epoch
            return
        if room in self.failed:
            assert due == [SendFailed(f"d{rank}", epoch, self.failed[room])]
            return
        pending = self.parked.get(room)
        too_many = (
            (pending is not None and rank in pending)
            or (pending is None and len(self.parked) >= 3)
            or self.page_ids + n > 10
        )
        if too_many:
            assert len(due) == 1 and isinstance(due[0], Reject)
            return
        if pending is None:
            (arm,) = due
            assert isinstance(arm, Arm) and arm.kind == "parked"
            self.keys.append(arm.key)
            self.live[("parked", room)] = arm.key
        else:
            assert due == []
        self.parked.setdefault(room, {})[rank] = (epoch, n)

    @rule(room=st.integers(0, 3), epoch=st.integers(1, 2))
    def abort(self, room: int, epoch: int) -> None:
        due = self.table.on_abort(room, epoch, "d0")
        assert due[-1] == SendAck("d0", epoch)
        pending = self.parked.get(room, {})
        for rank, (e, _) in list(pending.items()):
            if e == epoch:
                del pending[rank]
                self.aborted[room] = epoch
        if room in self.parked and not pending:
            del self.parked[room]
        epochs = self.tombstones.setdefault(room, set())
        if epoch in epochs:
            assert len(due) == 1
        else:
            epochs.add(epoch)
            (arm, _) = due
            assert isinstance(arm, Arm) and arm.kind == "tombstone"
            self.keys.append(arm.key)

    @rule(room=st.integers(0, 3))
    def sender(self, room: int) -> None:
        """The scheduler creates the room (no epoch told): its aborted use fails, its
        parked TRANSFERs come out; then it ends without failing."""
        rec = _room(room, n=5)
        due = self.table.open(rec, _peer_of)
        aborted = self.aborted.pop(room, None)
        if aborted is not None:  # (a parked TRANSFER that does not fit fails it too)
            assert rec.machine.cell.status is KVPoll.Failed
        self.parked.pop(room, None)
        assert any(isinstance(e, Arm) and e.kind == "bootstrap" for e in due)
        del self.table.rooms[room]

    @rule(room=st.integers(0, 3))
    def room_failed(self, room: int) -> None:
        rec = _room(room)
        self.table.rooms[room] = rec  # (held without open: only forget is under test)
        rec.machine.close(TransferError(f"room {room} failed"))
        self.failed[room] = f"TransferError: room {room} failed"
        (arm,) = self.table.forget(rec)
        assert isinstance(arm, Arm)
        self.keys.append(arm.key)
        self.live[("failed", room)] = arm.key

    @precondition(lambda self: self.keys)
    @rule(i=st.integers(0, 20))
    def expire(self, i: int) -> None:
        key = self.keys.pop(i % len(self.keys))
        due = self.table.handle_timer(key)
        told = sorted((e.endpoint, e.epoch) for e in due if isinstance(e, SendFailed))
        assert len(told) == len(due)  # (an expiry only tells the senders of what it drops)
        match key:
            case IdDeadline(kind="parked" | "failed" as kind, room=room):
                if self.live.get((kind, room)) != key:
                    assert due == []
                    return  # armed for an earlier entry of this room id: the newer one stays
                if kind == "parked":  # each parked TRANSFER's sender is told Failed
                    assert told == sorted(
                        (f"d{rank}", epoch) for rank, (epoch, _n) in
                        self.parked.get(room, {}).items()
                    )
                del self.live[(kind, room)]
                if kind == "failed":
                    self.failed.pop(room, None)
                else:
                    self.parked.pop(room, None)
                    self.aborted.pop(room, None)
            case IdDeadline(kind="tombstone", room=room, epoch=int(epoch)):
                self.tombstones[room].discard(epoch)
                if not self.tombstones[room]:
                    del self.tombstones[room]

    @rule()
    def everything_due(self) -> None:
        """Every room created and every expiry run: the table is empty."""
        for room in range(4):
            self.sender(room)
        while self.keys:
            self.expire(0)
        table = self.table
        assert table.parked == {} and table.parked_page_ids == 0
        assert table.tombstones == {} and table.aborted_parked == {}
        assert table.failed_recently == {} and table.rooms == {}

    @invariant()
    def table_matches_model(self) -> None:
        table = self.table
        assert table.parked_page_ids == self.page_ids >= 0
        assert {r: {k: (p.epoch, len(p.dst_pages)) for k, p in ranks.items()}
                for r, ranks in table.parked.items()} == self.parked
        assert table.tombstones == self.tombstones
        assert table.aborted_parked == self.aborted
        assert table.failed_recently == self.failed
        assert len(table.parked) <= table.max_rooms


TestPrefillTableRules = PrefillTableRules.TestCase
TestPrefillTableRules.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("shell", ["agents/_prefill.py", "agents/_decode.py"])
def test_the_agents_arm_no_room_deadline_of_their_own(shell: str) -> None:
    """Every room deadline is a table's: an agent puts a timer on its timers task only to
    hand an expiry back to its table (``_timer_due``), never with a deadline or an action of
    its own (a new one belongs in ``PrefillDeadlines`` / ``DecodeDeadlines``)."""
    source = (Path(trio_pd.__file__).parent / shell).read_text()
    calls = re.findall(r"timers\.(?:after|at)\(([^\n]*)", source)
    assert calls, "no timer armed at all: the check no longer looks at the right thing"
    # (_deadline_passed: _timer_due, read once, so that each entry does not hold one)
    assert "self._deadline_passed = self._timer_due" in source
    assert all(c.startswith("after, self._deadline_passed, key)") for c in calls), calls


@pytest.mark.parametrize("shell", ["agents/_quarantine.py", "agents/_dp_router.py"])
def test_the_fence_and_route_shells_keep_no_deadline_of_their_own(shell: str) -> None:
    """The quarantine fences' timers and a room's DP-routing deadline are the pure core's
    (``core/_fences.py``, ``core/_dp_routes.py``): their shells put a timer on the timers
    task only to hand an expiry back (``_timer_due``), read no clock, and name no delay of
    their own (the lengths are ``FenceDeadlines`` / ``RouteDeadlines``)."""
    source = (Path(trio_pd.__file__).parent / shell).read_text()
    calls = re.findall(r"timers\.(?:after|at)\(([^\n]*)", source)
    assert calls, "no timer armed at all: the check no longer looks at the right thing"
    assert "self._deadline_passed = self._timer_due" in source  # (read once)
    assert all(c.startswith("after, self._deadline_passed, key)") for c in calls), calls
    assert "current_time" not in source
    assert not re.findall(r"^_[A-Z_]+ = \d*\.\d+", source, re.MULTILINE), "a delay of its own"
