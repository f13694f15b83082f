"""The room machines of ``_rooms`` (SPEC §5, §7) as hypothesis state machines.

Each machine is driven with plain method calls, the way the agents drive it, against a model
that knows only the rules: what was admitted, taken, started, settled, quarantined, aborted
and published. Every effect a machine hands back is checked as it comes (a ``Release`` while
something is held, a second ``SendAck`` to one endpoint, ``Succeeded`` after ``Failed``...),
and the invariants below check that what is due did come (the release once nothing is held,
the ack once the room is drained).

Inputs are the ones the agents can produce: a chunk settles CANCELLED without a failure only
after the room's work was cancelled (``CancelWork``), an ERROR always carries the room's
failure, a shutdown happens only once every engine call has returned.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from trio_pd.core._errors import (
    AdmissionClosed,
    EngineError,
    PeerLost,
    ProtocolError,
    TransferAborted,
    TransferError,
)
from trio_pd.core._rooms import (
    ArmAckDeadline,
    CancelWork,
    Chunk,
    DecodeRoom,
    Due,
    Failed,
    Forget,
    PeerPool,
    PrefillRoom,
    ProbeWriters,
    PublishDue,
    Quarantine,
    Refused,
    Release,
    RunChunks,
    SendAborts,
    SendAck,
    SendFailed,
    SendTransfers,
    Succeeded,
)
from trio_pd.core._state import KVPoll, Lease, Outcome

POOL = 64
PEER = PeerPool(64, 8)
EPOCH = 7
ENDPOINTS = ["tcp://d0", "tcp://d1"]


def _pages(start: int, n: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    # source page id == page index: the taken chunks then spell out which pages they cover
    return np.arange(start, start + n, dtype=np.int64)


# --------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------


class PrefillRules(RuleBasedStateMachine):
    """One ``PrefillRoom``: admission, decode metadata, chunks taken, started and settled,
    quarantines, aborts, publication, deadlines and shutdown (SPEC §5.3-§5.6, I1-I3, I5)."""

    room: PrefillRoom

    @initialize(
        n=st.integers(0, 12), expected=st.sampled_from([1, 2]), calm=st.integers(0, 40)
    )
    def setup(self, n: int, expected: int, calm: int) -> None:
        # no failure for the first ``calm`` steps: most examples then get past the start
        self.calm = calm
        self.steps = 0
        self.n = n
        self.expected = expected
        self.room = PrefillRoom(room=5, num_pages=n, aux_slot=0, pool_pages=POOL)
        # admission
        self.sent = 0
        self.last = False
        self.closed = False
        # decode metadata: rank -> epoch, in arrival order
        self.targets: dict[int, int] = {}
        self.epoch: int | None = None
        # chunks: (start, size, last) before they are taken; Chunk objects after
        self.waiting: list[tuple[int, int, bool]] = []
        self.queued: list[tuple[int, int, bool]] = []
        self.taken: list[Chunk] = []  # taken by a worker, no engine call started
        self.started: list[Chunk] = []  # in the engine
        self.quarantined: list[Lease] = []
        self.taken_pages: list[int] = []
        self.cancelled_pages: list[int] = []
        self.completed_pages: list[int] = []
        self.takeable = 0  # chunks that entered the queue
        self.run_total = 0  # sum of RunChunks
        # outcome
        self.failed = False
        self.succeeded = False
        self.published = False
        self.released = False
        self.forgotten = False
        self.publish_due_seen = False
        self.in_publish = False
        self.shut = False
        # drain acks: endpoint -> epoch of its first ABORT
        self.ack_targets: dict[str, int] = {}
        self.acked: set[str] = set()
        self.withheld: set[str] = set()

    # ---------------------------------------------------------------- the model's view

    @property
    def stormy(self) -> bool:
        """Failures (aborts, deadlines, bad TRANSFERs, shutdown) may happen now."""
        return self.steps >= self.calm

    @property
    def ready(self) -> bool:
        return len(self.targets) >= self.expected

    @property
    def live(self) -> bool:
        return bool(self.waiting or self.queued or self.taken or self.started)

    @property
    def holds(self) -> bool:
        return self.live or bool(self.quarantined)

    @property
    def terminal(self) -> bool:
        return self.failed or self.succeeded

    def _publish_due(self) -> bool:
        if self.published or self.live:
            return False
        return self.failed or (self.closed and self.ready)

    def _close(self) -> None:
        """What ``close`` does to the model: admission closed, unstarted work cancelled."""
        self.closed = True
        for start, size, _ in (*self.waiting, *self.queued):
            self.cancelled_pages.extend(range(start, start + size))
        self.waiting.clear()
        self.queued.clear()

    def _apply(self, due: Due) -> None:
        """Check each effect against the model as it is handed back."""
        for effect in due:
            match effect:
                case RunChunks(n=n):
                    assert n >= 1
                    self.run_total += n
                case Release():
                    assert not self.released, "Release twice"
                    assert self.closed, "Release before admission closed"
                    assert not (self.taken or self.started), "Release with a chunk in flight (I1)"
                    assert not self.quarantined, "Release with a lease quarantined (I1, I3)"
                    assert not self.live
                    self.released = True
                case SendAck(endpoint=endpoint, epoch=epoch):
                    assert endpoint in self.ack_targets and self.ack_targets[endpoint] == epoch
                    assert endpoint not in self.acked, "a second ack to one endpoint"
                    assert endpoint not in self.withheld
                    assert self.closed and not self.holds, "ack while something is held"
                    self.acked.add(endpoint)
                case Forget():
                    assert not self.forgotten, "Forget twice"
                    assert self.released and self.published, "Forget before release/publication"
                    self.forgotten = True
                case Failed():
                    assert not self.failed and not self.succeeded, "Failed after terminal"
                    self.failed = True
                case Succeeded():
                    assert self.in_publish, "Succeeded outside publish"
                    assert not self.failed and not self.succeeded
                    self.succeeded = True
                case PublishDue():
                    assert self._publish_due()
                    self.publish_due_seen = True
                case Quarantine() | SendFailed() | Refused() | CancelWork():
                    pass
                case _:
                    raise AssertionError(f"prefill machine handed back {effect!r}")

    def _expect_failure(self, due: Due, was_terminal: bool) -> None:
        assert any(isinstance(e, CancelWork) for e in due)
        assert any(isinstance(e, Failed) for e in due) == (not was_terminal)

    # ---------------------------------------------------------------- admission

    @precondition(lambda self: not self.shut and not self.last)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        left = self.n - self.sent
        size = data.draw(st.integers(0, left), label="size")
        last = size == left and data.draw(st.booleans(), label="last")
        if self.closed:
            with pytest.raises(AdmissionClosed):  # I2
                self.room.admit(_pages(self.sent, size), last)
            return
        due = self.room.admit(_pages(self.sent, size), last)
        chunk = (self.sent, size, last)
        self.sent += size
        self.last = last
        if self.ready:
            self.queued.append(chunk)
            self.takeable += 1
            assert due == [RunChunks(1)]
        else:
            self.waiting.append(chunk)
            assert due == []
        self._apply(due)

    @precondition(lambda self: not self.shut and self.stormy)
    @rule(kind=st.sampled_from(["past_end", "out_of_pool", "repeated", "after_last"]))
    def admit_bad(self, kind: str) -> None:
        """Refused before any lease is taken: nothing changes."""
        left = self.n - self.sent
        if kind == "after_last" and not self.last:
            kind = "past_end"
        pages = {
            "after_last": _pages(self.sent, 0),
            "past_end": _pages(self.sent, left + 1),
            "out_of_pool": np.array([POOL], dtype=np.int64),
            "repeated": np.array([1, 1], dtype=np.int64),
        }[kind]
        with pytest.raises(ProtocolError):
            self.room.admit(pages, False)

    # ---------------------------------------------------------------- decode metadata

    @precondition(lambda self: not self.shut and len(self.targets) < self.expected)
    @rule(data=st.data())
    def add_target(self, data: st.DataObject) -> None:
        rank = data.draw(
            st.sampled_from([r for r in range(self.expected) if r not in self.targets]),
            label="rank",
        )
        kind = data.draw(
            st.sampled_from(["good", "good", "good", "num_pages", "page", "epoch", "aux"]),
            label="kind",
        )
        if not self.stormy or (kind == "epoch" and self.epoch is None):
            kind = "good"  # the first TRANSFER sets the epoch: none can disagree yet
        epoch = EPOCH if self.epoch is None else self.epoch + (kind == "epoch")
        dst = np.arange(self.n, dtype=np.int64) + 3 * rank
        if kind == "page":
            dst = np.append(dst, PEER.num_pages)
        endpoint = ENDPOINTS[rank]
        was_terminal = self.terminal
        due = self.room.add_target(
            endpoint=endpoint,
            session=f"s{rank}",
            decode_rank=rank,
            epoch=epoch,
            aux_slot=PEER.aux_slots if kind == "aux" else rank,
            num_pages=self.n + (kind == "num_pages"),
            dst_pages=dst,
            peer=PEER,
            expected=self.expected,
        )
        if self.closed or self.published:
            # too late: answered Failed if the room failed, otherwise dropped
            if self.failed:
                assert len(due) == 1 and isinstance(due[0], SendFailed)
                assert (due[0].endpoint, due[0].epoch) == (endpoint, epoch)
            else:
                assert due == []
        elif kind != "good":
            assert isinstance(due[0], Refused)
            assert isinstance(due[-1], SendFailed)
            assert (due[-1].endpoint, due[-1].epoch) == (endpoint, epoch)
            self._close()
            self._expect_failure(due, was_terminal)
        else:
            self.targets[rank] = epoch
            self.epoch = epoch
            moved = len(self.waiting) if self.ready else 0
            if moved:
                self.queued.extend(self.waiting)
                self.waiting.clear()
                self.takeable += moved
            assert due == ([RunChunks(moved)] if moved else [])
        self._apply(due)

    # ---------------------------------------------------------------- chunks

    @precondition(lambda self: not self.shut and self.queued)
    @rule(limit=st.integers(1, 8))
    def take(self, limit: int) -> None:
        got = self.room.take_chunks(limit)
        assert got is not None
        first = self.queued[0]
        group, npages = [first], first[1]
        for following in self.queued[1:]:
            if following[0] != first[0] + npages or npages + following[1] > limit:
                break
            group.append(following)
            npages += following[1]
        chunk, joined = got
        assert joined == len(group) - 1
        assert chunk.start == first[0] and chunk.last == group[-1][2]
        assert chunk.pages.tolist() == list(range(first[0], first[0] + npages))
        assert chunk.lease.npages == npages
        del self.queued[: len(group)]
        if not self.queued:  # a worker woken for a chunk an earlier take coalesced
            assert self.room.take_chunks(limit) is None
        self.taken.append(chunk)
        self.taken_pages.extend(chunk.pages.tolist())

    @precondition(
        lambda self: not self.shut
        and not self.live
        and (self.last or self.closed)
        and not self._publish_due()
    )
    @rule(limit=st.integers(1, 8))
    def spare_wakeup(self, limit: int) -> None:
        """A worker's job for a chunk that was cancelled or coalesced: nothing to take. (Also
        the one step left to a room that is over before its storm.)"""
        assert self.room.take_chunks(limit) is None

    @precondition(lambda self: self.taken)
    @rule(i=st.integers(0, 10))
    def start(self, i: int) -> None:
        """The chunk's first engine call reaches the engine."""
        self.started.append(self.taken.pop(i % len(self.taken)))

    @precondition(lambda self: self.started or (self.taken and self.stormy))
    @rule(i=st.integers(0, 10), data=st.data())
    def settle(self, i: int, data: st.DataObject) -> None:
        pool = self.started + self.taken
        chunk = pool[i % len(pool)]
        failure: TransferError | None
        if chunk in self.started:
            self.started.remove(chunk)
            # an engine error is a failure, but also the quarantine path: allowed while calm
            outcome = data.draw(st.sampled_from([Outcome.COMPLETED] * 3 + [Outcome.ERROR]))
            if outcome is Outcome.ERROR:
                failure = EngineError("write failed", code=-1)
            else:  # all calls done, and maybe another destination failed to plan
                failures: list[TransferError | None] = [None]
                if self.stormy:
                    failures.append(PeerLost("gone"))
                failure = data.draw(st.sampled_from(failures))
        else:
            self.taken.remove(chunk)
            outcome = Outcome.CANCELLED
            # no call started: the room's work was cancelled, or the chunk failed first
            choices: list[TransferError | None] = [PeerLost("peer marked failed")]
            if self.failed:
                choices.append(None)
            failure = data.draw(st.sampled_from(choices))
        was_terminal = self.terminal
        due = self.room.chunk_settled(chunk, outcome, failure)
        quarantines = [e for e in due if isinstance(e, Quarantine)]
        if outcome is Outcome.ERROR:
            assert quarantines == [Quarantine(chunk.lease)]
            self.quarantined.append(chunk.lease)
        else:
            assert quarantines == []
        if outcome is Outcome.COMPLETED:
            self.completed_pages.extend(chunk.pages.tolist())
        if failure is not None:
            self._close()
            self._expect_failure(due, was_terminal)
        elif chunk.last:
            self.closed = True  # concluded
        self._apply(due)

    @precondition(lambda self: self.quarantined)
    @rule(i=st.integers(0, 10))
    def end_quarantine(self, i: int) -> None:
        lease = self.quarantined.pop(i % len(self.quarantined))
        self._apply(self.room.end_quarantine(lease))
        assert self.room.end_quarantine(lease) == []  # a second proof changes nothing

    # ---------------------------------------------------------------- failure and abort

    @precondition(lambda self: not self.shut and self.stormy and not self.failed)
    @rule()
    def close(self) -> None:
        """The scheduler aborts the request."""
        was_terminal = self.terminal
        due = self.room.close(TransferAborted("scheduler abort"))
        self._close()
        self._expect_failure(due, was_terminal)
        self._apply(due)

    @precondition(lambda self: not self.shut and self.stormy and self.epoch is not None)
    @rule(rank=st.integers(0, 1))
    def on_abort(self, rank: int) -> None:
        """ABORT for this use (PrefillRooms routes only matching epochs here)."""
        assert self.epoch is not None
        endpoint = ENDPOINTS[rank]
        was_terminal = self.terminal
        due = self.room.on_abort(endpoint, self.epoch)  # AckBook raises if I2 is broken
        self._close()
        self.ack_targets.setdefault(endpoint, self.epoch)
        self._expect_failure(due, was_terminal)
        self._apply(due)

    @precondition(lambda self: not self.shut and self.stormy and not self.ready)
    @rule()
    def bootstrap_deadline(self) -> None:
        fires = not self.ready and not self.terminal and not self.forgotten
        was_terminal = self.terminal
        due = self.room.bootstrap_deadline(3.0)
        if fires:
            self._close()
            self._expect_failure(due, was_terminal)
        else:
            assert due == []
        self._apply(due)

    # ---------------------------------------------------------------- publication

    @precondition(lambda self: not self.shut and self._publish_due())
    @rule(accepts=st.lists(st.booleans(), max_size=2))
    def publish(self, accepts: list[bool]) -> None:
        if not self.stormy:
            accepts = []  # every send accepted
        due_now = self._publish_due()
        assert self.room.publish_due == due_now
        calls: list[tuple[str, int, bool]] = []
        answers = iter(accepts)

        def send(endpoint: str, epoch: int, ok: bool, reason: str) -> bool:
            calls.append((endpoint, epoch, ok))
            assert ok or reason, "a Failed STATUS without a reason"
            return next(answers, True)

        self.in_publish = True
        try:
            due = self.room.publish(send)
            if not due_now:
                # not due, or published already: nothing is sent or decided again
                assert calls == []
                assert not any(isinstance(e, Succeeded | SendFailed | Failed) for e in due)
                self._apply(due)
                return
            self.published = True
            ok = not self.failed
            refused_ok: list[str] = []
            expected_failed: list[tuple[str, int]] = []
            for (rank, epoch), (endpoint, sent_epoch, sent_ok), accepted in zip(
                self.targets.items(), calls, [*accepts, *[True] * len(calls)], strict=False
            ):
                assert (endpoint, sent_epoch, sent_ok) == (ENDPOINTS[rank], epoch, ok)
                if not accepted:
                    if ok:
                        refused_ok.append(endpoint)
                        ok = False
                    expected_failed.append((endpoint, epoch))
            assert len(calls) == len(self.targets)
            assert [(e.endpoint, e.epoch) for e in due if isinstance(e, SendFailed)] == (
                expected_failed
            )
            # a refusal fails the room here; Success only if every send was accepted
            assert any(isinstance(e, Failed) for e in due) == bool(refused_ok)
            assert any(isinstance(e, Succeeded) for e in due) == ok
            self._apply(due)
            # publication happens once: a second publish sends and decides nothing
            assert self.room.publish(send) == [] and len(calls) == len(self.targets)
        finally:
            self.in_publish = False

    # ---------------------------------------------------------------- shutdown

    @precondition(
        lambda self: not self.shut and self.steps >= 30 and not (self.taken or self.started)
    )
    @rule()
    def shutdown(self) -> None:
        """The agent closes once every engine call returned."""
        was_published, was_terminal = self.published, self.terminal
        due = self.room.shutdown("agent closed")
        told = [(e.endpoint, e.epoch) for e in due if isinstance(e, SendFailed)]
        if not (self.published and self.succeeded):
            for rank, epoch in self.targets.items():
                self.ack_targets.setdefault(ENDPOINTS[rank], epoch)
        expected_told = (
            [] if was_published else [(ENDPOINTS[r], e) for r, e in self.targets.items()]
        )
        assert told == expected_told
        assert any(isinstance(e, Failed) for e in due) == (not was_terminal)
        if self.quarantined:
            # a write's outcome is unknown: those acks are withheld for good
            self.withheld = set(self.ack_targets) - self.acked
        self._close()
        self.quarantined.clear()
        self.published = True
        self.shut = True
        self._apply(due)
        assert self.released and self.forgotten

    @precondition(lambda self: self.shut)
    @rule()
    def after_shutdown(self) -> None:
        """Late calls on a shut room decide nothing, send nothing, free nothing."""
        calls: list[object] = []

        def send(*status: object) -> bool:
            calls.append(status)
            return True

        assert self.room.publish(send) == []
        assert calls == []
        assert self.room.bootstrap_deadline(1.0) == []
        with pytest.raises((AdmissionClosed, ProtocolError)):
            self.room.admit(_pages(self.sent, 0), True)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def clock(self) -> None:
        """Counts the steps (for :attr:`stormy`); checks nothing."""
        self.steps += 1

    @invariant()
    def machine_matches_model(self) -> None:
        room = self.room
        assert room.sent_pages == self.sent
        assert room.leases.closed == self.closed
        assert set(room.leases.quarantined) == set(self.quarantined)
        assert room.released == self.released
        assert room.published == self.published
        assert room.forgotten == self.forgotten
        assert room.publish_due == self._publish_due()
        assert len(room.queued) <= len(self.queued)  # coalescing only shrinks the queue
        if self.failed:
            assert room.cell.status is KVPoll.Failed and room.cell.failure is not None
        elif self.succeeded:
            assert room.cell.status is KVPoll.Success
        else:
            assert not room.cell.terminal

    @invariant()
    def release_exactly_when_drained(self) -> None:
        """I1/I3: the release comes once admission closed and nothing is held, not before."""
        assert self.released == (self.closed and not self.holds)

    @invariant()
    def acks_when_drained(self) -> None:
        if self.closed and not self.holds:
            assert set(self.ack_targets) == self.acked | self.withheld

    @invariant()
    def forget_after_release_and_publication(self) -> None:
        assert self.forgotten == (self.released and self.published)

    @invariant()
    def publication_is_announced(self) -> None:
        if self._publish_due():
            assert self.publish_due_seen

    @invariant()
    def every_page_once_in_order(self) -> None:
        pending = [p for s, n, _ in (*self.waiting, *self.queued) for p in range(s, s + n)]
        covered = self.taken_pages + self.cancelled_pages + pending
        assert covered == list(range(self.sent))

    @invariant()
    def chunks_run_as_queued(self) -> None:
        assert self.run_total == self.takeable

    @invariant()
    def success_means_every_page_written(self) -> None:
        if self.succeeded:
            assert not self.failed
            assert sorted(self.completed_pages) == list(range(self.n))
            assert self.last and self.ready


def test_prefill_two_batches_release_after_both() -> None:
    """Scenario 5: A completes, B pending: no release; B completes: exactly one."""
    room = PrefillRoom(room=1, num_pages=4, aux_slot=0, pool_pages=POOL)
    room.add_target(
        endpoint="e", session="s", decode_rank=0, epoch=1, aux_slot=0, num_pages=4,
        dst_pages=np.arange(4), peer=PEER, expected=1,
    )
    room.admit(_pages(0, 2), False)
    room.admit(_pages(2, 2), True)
    taken_a, taken_b = room.take_chunks(2), room.take_chunks(2)
    assert taken_a is not None and taken_b is not None
    assert Release() not in room.chunk_settled(taken_b[0], Outcome.COMPLETED, None)
    room.publish(lambda *_: True)
    due = room.chunk_settled(taken_a[0], Outcome.COMPLETED, None)
    assert due == [PublishDue(), Release()]
    assert room.publish(lambda *_: True) == [Succeeded(), Forget()]


def test_prefill_abort_with_chunk_in_flight_acks_once_after_it() -> None:
    """Scenario 6, and an engine error (scenario 9): no ack, no release while quarantined."""
    room = PrefillRoom(room=1, num_pages=2, aux_slot=0, pool_pages=POOL)
    room.add_target(
        endpoint="e", session="s", decode_rank=0, epoch=3, aux_slot=0, num_pages=2,
        dst_pages=np.arange(2), peer=PEER, expected=1,
    )
    room.admit(_pages(0, 2), True)
    taken = room.take_chunks(8)
    assert taken is not None
    due = room.on_abort("e", 3)
    assert not any(isinstance(e, SendAck | Release) for e in due)
    due = room.chunk_settled(taken[0], Outcome.ERROR, EngineError("boom"))
    assert Quarantine(taken[0].lease) in due
    assert not any(isinstance(e, SendAck | Release) for e in due)
    due = room.end_quarantine(taken[0].lease)
    assert due == [SendAck("e", 3), Release()]


def test_prefill_never_succeeds_with_a_chunk_cancelled_unwritten() -> None:
    """A chunk that settles CANCELLED with no failure while its room is neither failed nor
    aborted never wrote its pages: the room fails rather than publishing Success. (The runner
    reports a chunk with nothing to write, a dummy rank's, as COMPLETED.)"""
    room = PrefillRoom(room=1, num_pages=4, aux_slot=0, pool_pages=POOL)
    room.add_target(
        endpoint="e", session="s", decode_rank=0, epoch=1, aux_slot=0, num_pages=4,
        dst_pages=np.arange(4), peer=PEER, expected=1,
    )
    room.admit(_pages(0, 2), False)
    room.admit(_pages(2, 2), True)
    taken_a, taken_b = room.take_chunks(2), room.take_chunks(2)
    assert taken_a is not None and taken_b is not None
    room.chunk_settled(taken_b[0], Outcome.COMPLETED, None)
    due = room.chunk_settled(taken_a[0], Outcome.CANCELLED, None)  # pages 0-1 never written
    assert any(isinstance(e, Failed) for e in due)
    assert room.cell.status is KVPoll.Failed
    assert Succeeded() not in room.publish(lambda *_: True)


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------


class DecodeRules(RuleBasedStateMachine):
    """One ``DecodeRoom``: resolve, init, ask, statuses, acks, deadlines, lost and gone
    writers, close (SPEC §5.5, §5.6, I1, I5, I6)."""

    def __init__(self) -> None:
        super().__init__()
        self.room = DecodeRoom(room=5, epoch=7)
        self.required: set[int] | None = None
        self.pages_given = False
        self.asked = False
        self.told: set[int] = set()
        self.aborted_to: set[int] = set()
        self.probed: set[int] = set()
        self.acked: set[int] = set()
        self.ok: set[int] = set()
        self.gone: set[int] = set()
        self.failed = False
        self.succeeded = False
        self.released = False
        self.forgotten = False
        self.ack_armed = False
        self.aux_answer: bool | None = None
        self.calm = 0
        self.steps = 0

    @initialize(calm=st.integers(0, 30))
    def setup(self, calm: int) -> None:
        # no failure for the first ``calm`` steps: most examples then get to ask and succeed
        self.calm = calm

    @property
    def stormy(self) -> bool:
        return self.steps >= self.calm

    @invariant()
    def clock(self) -> None:
        """Counts the steps (for :attr:`stormy`); checks nothing."""
        self.steps += 1

    @property
    def proven(self) -> set[int]:
        """Ranks whose writes can no longer land: acked, reported Success, or proven gone."""
        return self.acked | self.ok | self.gone

    def _apply(self, due: Due) -> None:
        for effect in due:
            match effect:
                case SendTransfers():
                    assert not self.asked, "TRANSFERs asked twice"
                    assert self.pages_given and self.required is not None
                    assert not self.failed
                    self.asked = True
                case SendAborts(ranks=ranks):
                    assert self.required is not None and set(ranks) <= self.required
                    self.aborted_to |= set(ranks)
                case ArmAckDeadline():
                    self.ack_armed = True
                case ProbeWriters(ranks=ranks):
                    self.probed |= set(ranks)
                case Failed():
                    assert not self.failed and not self.succeeded, "Failed after terminal"
                    self.failed = True
                case Succeeded():
                    assert not self.failed and not self.succeeded
                    assert self.required is not None and self.ok >= self.required
                    assert self.aux_answer is True, "Success without the aux row's epoch (I6)"
                    self.succeeded = True
                case Release(how=how):
                    assert not self.released, "Release twice"
                    assert not self.succeeded, "Release of a Success room"
                    assert self.failed and self.pages_given
                    if how == "unsent":
                        assert not self.asked or not self.told, "unsent after a TRANSFER"
                    else:
                        assert self.told <= self.proven, "Release before the drain (I1)"
                    self.released = True
                case Forget():
                    assert not self.forgotten, "Forget twice"
                    assert self.succeeded or self.released or (
                        self.failed and not self.pages_given
                    )
                    self.forgotten = True
                case _:
                    raise AssertionError(f"decode machine handed back {effect!r}")

    @precondition(lambda self: self.required is None)
    @rule(ranks=st.sets(st.integers(0, 2), min_size=1))
    def bind(self, ranks: set[int]) -> None:
        self.required = ranks
        self._apply(self.room.bind(sorted(ranks)))

    @precondition(lambda self: not self.pages_given)
    @rule(n=st.integers(0, 4))
    def init(self, n: int) -> None:
        self.pages_given = True
        self._apply(self.room.init(np.arange(n, dtype=np.int32), 0))
        with pytest.raises(ProtocolError):
            self.room.init(np.arange(n, dtype=np.int32), 0)

    @precondition(
        lambda self: self.asked and self.required is not None and self.required - self.told
    )
    @rule(data=st.data())
    def contacted(self, data: st.DataObject) -> None:
        assert self.required is not None
        left = sorted(self.required - self.told)
        rank = data.draw(st.sampled_from(left), label="rank")
        self.room.contacted(rank)
        self.told.add(rank)

    @precondition(lambda self: self.told)
    @rule(data=st.data(), ok=st.booleans(), aux=st.booleans())
    def on_status(self, data: st.DataObject, ok: bool, aux: bool) -> None:
        rank = data.draw(st.sampled_from(sorted(self.told)), label="rank")
        if not self.stormy:
            ok = aux = True
        self.aux_answer = None

        def aux_ok() -> bool:
            self.aux_answer = aux
            return aux

        if ok:
            self.ok.add(rank)
        due = self.room.on_status(rank, ok, "" if ok else "it broke", aux_ok)
        assert self.required is not None
        if self.aux_answer is not None:  # read only once every rank succeeded
            assert self.ok >= self.required
        self._apply(due)

    @precondition(lambda self: self.required is not None and len(self.required) < 3)
    @rule(data=st.data())
    def on_status_stranger(self, data: st.DataObject) -> None:
        assert self.required is not None
        rank = data.draw(st.sampled_from(sorted({0, 1, 2} - self.required)), label="rank")
        with pytest.raises(ProtocolError):
            self.room.on_status(rank, True, "", lambda: True)

    @precondition(lambda self: self.told or self.aborted_to)
    @rule(data=st.data())
    def on_ack(self, data: st.DataObject) -> None:
        rank = data.draw(st.sampled_from(sorted(self.told | self.aborted_to)), label="rank")
        self.acked.add(rank)
        self._apply(self.room.on_ack(rank))

    @precondition(lambda self: self.stormy)
    @rule()
    def fail(self) -> None:
        self._apply(self.room.fail(TransferAborted("scheduler abort")))

    @precondition(lambda self: self.asked and self.stormy)
    @rule()
    def waiting_deadline(self) -> None:
        self._apply(self.room.waiting_deadline(2.0))

    @precondition(lambda self: self.ack_armed)
    @rule()
    def ack_deadline(self) -> None:
        due = self.room.ack_deadline("drain")
        assert not any(isinstance(e, Release) for e in due), "the drain policy freed pages"
        self._apply(due)

    @precondition(lambda self: self.required is not None and self.stormy)
    @rule(data=st.data())
    def peer_lost(self, data: st.DataObject) -> None:
        assert self.required is not None
        rank = data.draw(st.sampled_from(sorted(self.required)), label="rank")
        due = self.room.peer_lost(rank)
        # a loss proves nothing: a Release here must stand on the other proofs (_apply)
        self._apply(due)

    @precondition(lambda self: self.probed)
    @rule(data=st.data())
    def writer_gone(self, data: st.DataObject) -> None:
        rank = data.draw(st.sampled_from(sorted(self.probed)), label="rank")
        self.gone.add(rank)
        self._apply(self.room.writer_gone(rank))

    @precondition(lambda self: self.stormy)
    @rule()
    def close(self) -> None:
        self._apply(self.room.close("agent closed"))

    @invariant()
    def machine_matches_model(self) -> None:
        assert self.room.released == self.released
        assert self.room.forgotten == self.forgotten
        if self.failed:
            assert self.room.status is KVPoll.Failed and self.room.failure is not None
        elif self.succeeded:
            assert self.room.status is KVPoll.Success
        else:
            assert self.room.status not in (KVPoll.Failed, KVPoll.Success)

    @invariant()
    def released_once_drained(self) -> None:
        """A Failed room with pages gives them back once every source rank is proven quiet
        (or at once if none was ever told of them)."""
        if not (self.failed and self.pages_given):
            return
        if self.required is None or self.required <= self.proven:
            assert self.released

    @invariant()
    def success_needs_every_rank(self) -> None:
        if self.succeeded:
            assert self.required is not None and self.ok >= self.required


def test_decode_two_ranks_hold_until_both_ack() -> None:
    """Scenario 8: held after one ack, released after both; duplicate acks count once."""
    room = DecodeRoom(room=1, epoch=2)
    room.bind([0, 1])
    assert room.init(np.arange(3, dtype=np.int32), 0) == [SendTransfers()]
    room.contacted(0)
    room.contacted(1)
    assert room.fail(TransferAborted("x"))[1:] == [SendAborts((0, 1)), ArmAckDeadline()]
    assert room.on_ack(0) == []
    assert room.on_ack(0) == []
    assert room.on_ack(1) == [Release("drained"), Forget()]
    assert room.on_ack(1) == []


def test_decode_room_counts_ranks_once() -> None:
    """A rank's Success and its ack count once; the pages go back once, when every contacted
    rank is drained (rank 0 by its Success: its writes returned; rank 1 by its ack)."""
    room = DecodeRoom(room=1, epoch=2)
    room.bind([0, 1])
    room.init(np.arange(3, dtype=np.int32), 0)
    room.contacted(0)
    room.contacted(1)
    assert room.on_status(0, True, "", lambda: True) == []
    assert room.on_status(0, True, "", lambda: True) == []
    assert not room.all_succeeded
    assert Release("drained") not in room.fail(TransferError("x"))
    assert room.on_ack(1) == [Release("drained"), Forget()]
    assert room.on_ack(1) == []


def test_decode_success_needs_aux_epoch() -> None:
    room = DecodeRoom(room=1, epoch=2)
    room.bind([0])
    room.init(np.arange(3, dtype=np.int32), 0)
    room.contacted(0)
    due = room.on_status(0, True, "", lambda: False)
    assert isinstance(due[0], Failed) and isinstance(due[0].error, ProtocolError)
    assert Succeeded() not in due
    # rank 0 reported Success: all its writes returned, so that is its drain proof
    assert Release("drained") in due


def test_decode_room_failed_and_given_back_before_its_ranks_are_known_awaits_no_ack() -> None:
    """Failed before its ranks were known (aborted while its instance resolves, or while it
    waits for its DP rank), then given pages: they go back at once, unsent, and the room is
    forgotten. Once its ranks are known, the ABORTs still tell them; but nothing is held, so
    no ack deadline is armed (it would only keep the forgotten room's record until it
    passed)."""
    room = DecodeRoom(room=1, epoch=2)
    assert room.fail(TransferAborted("x"))[1:] == []
    assert room.init(np.arange(3, dtype=np.int32), 0) == [Release("unsent"), Forget()]
    assert room.bind([0, 1]) == [SendAborts((0, 1))]
    assert not room.holding and room.ack_deadline("drain") == []
    # pages never given: the ABORTs, and the room is forgotten then
    bare = DecodeRoom(room=3, epoch=4)
    bare.fail(TransferAborted("x"))
    assert bare.bind([0]) == [SendAborts((0,)), Forget()]


TestPrefillRules = PrefillRules.TestCase
TestPrefillRules.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestDecodeRules = DecodeRules.TestCase
TestDecodeRules.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


def test_prefill_publishes_only_once_every_transfer_it_waits_for_is_in() -> None:
    """A rank that serves two decode ranks has its chunks queued, and its outcome decided,
    only once both TRANSFERs are in: a room whose chunks all settled after the first is not
    published. The TRANSFER that releases waiting chunks leaves the room Transferring; one
    that finds none, WaitingForInput."""
    room = PrefillRoom(room=1, num_pages=2, aux_slot=0, pool_pages=POOL)
    for rank in (0, 1):
        if rank == 1:
            assert room.admit(_pages(0, 2), True) == []  # (one TRANSFER in: it waits)
            assert not room.publish_due and room.cell.status is KVPoll.Bootstrapping
        due = room.add_target(
            endpoint=f"e{rank}", session="s", decode_rank=rank, epoch=3, aux_slot=0,
            num_pages=2, dst_pages=np.arange(2), peer=PEER, expected=2,
        )
    assert due == [RunChunks(1)] and room.cell.status is KVPoll.Transferring
    taken = room.take_chunks(8)
    assert taken is not None
    assert PublishDue() in room.chunk_settled(taken[0], Outcome.COMPLETED, None)
    # the rule itself: closed, nothing live, one TRANSFER of two in: not decidable yet
    room = PrefillRoom(room=2, num_pages=2, aux_slot=0, pool_pages=POOL)
    room.add_target(
        endpoint="e0", session="s", decode_rank=0, epoch=3, aux_slot=0, num_pages=2,
        dst_pages=np.arange(2), peer=PEER, expected=2,
    )
    room.leases.close()
    assert not room.publish_due and room.publish(lambda *_: True) == []
    # a TRANSFER that completes the set with no chunk waiting: WaitingForInput
    room = PrefillRoom(room=3, num_pages=2, aux_slot=0, pool_pages=POOL)
    for rank in (0, 1):
        due = room.add_target(
            endpoint=f"e{rank}", session="s", decode_rank=rank, epoch=3, aux_slot=0,
            num_pages=2, dst_pages=np.arange(2), peer=PEER, expected=2,
        )
    assert due == [] and room.cell.status is KVPoll.WaitingForInput
