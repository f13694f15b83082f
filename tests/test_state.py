"""The pure core's rules (SPEC §4, §5.3, §5.5) as hypothesis state machines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import trio_pd
from trio_pd.core._errors import AdmissionClosed, TransferError
from trio_pd.core._state import (
    AckBook,
    KVPoll,
    LeaseBook,
    Outcome,
    RankSet,
    StatusCell,
    combine,
)

FORWARD = [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success]


class StatusRules(RuleBasedStateMachine):
    """Forward only; Failed absorbs; a terminal status never changes (I5)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = StatusCell()
        self.seen: list[KVPoll] = [self.cell.status]

    @rule(new=st.sampled_from(FORWARD))
    def advance(self, new: KVPoll) -> None:
        before = self.cell.status
        moved = self.cell.advance(new)
        assert moved == (before not in (KVPoll.Failed, KVPoll.Success) and new > before)
        self.seen.append(self.cell.status)

    @rule(text=st.text(max_size=5))
    def fail(self, text: str) -> None:
        before = self.cell.status
        failed = self.cell.fail(TransferError(text))
        assert failed == (before not in (KVPoll.Failed, KVPoll.Success))
        self.seen.append(self.cell.status)

    @invariant()
    def monotone_and_absorbing(self) -> None:
        for a, b in zip(self.seen, self.seen[1:], strict=False):
            if a in (KVPoll.Failed, KVPoll.Success):
                assert b == a
            elif b is not KVPoll.Failed:
                assert b >= a
        if self.cell.status is KVPoll.Failed:
            assert self.cell.failure is not None


class LeaseRules(RuleBasedStateMachine):
    """A lease lives from admission to a terminal outcome; errors quarantine; the release
    runs exactly once, only when closed and holding nothing; nothing is admitted after
    close (I1, I2, I3); acks go out only when nothing is held (SPEC §5.5)."""

    def __init__(self) -> None:
        super().__init__()
        self.book = LeaseBook(room=1)
        self.acks = AckBook()
        self.live: list[object] = []
        self.quarantined: list[object] = []
        self.releases = 0
        self.acked: list[str] = []

    @rule(n=st.integers(0, 4))
    def admit(self, n: int) -> None:
        if self.book.closed:
            with pytest.raises(AdmissionClosed):
                self.book.admit(n)
        else:
            self.live.append(self.book.admit(n))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), outcome=st.sampled_from(list(Outcome)))
    def settle(self, i: int, outcome: Outcome) -> None:
        lease = self.live.pop(i % len(self.live))
        self.book.settle(lease, outcome)  # type: ignore[arg-type]
        if outcome is Outcome.ERROR:
            self.quarantined.append(lease)
        self._after()

    @precondition(lambda self: len(self.live) >= 2)
    @rule(k=st.integers(2, 4))
    def merge(self, k: int) -> None:
        """Coalescing: the first ``k`` live leases fold into the first; the others can no
        longer settle, and the head still holds every page."""
        group = self.live[:k]
        pages = sum(lease.npages for lease in group)  # type: ignore[attr-defined]
        head = self.book.merge(group)  # type: ignore[arg-type]
        assert head is group[0] and head.npages == pages
        self.live = [head, *self.live[len(group):]]
        for gone in group[1:]:
            with pytest.raises(RuntimeError):
                self.book.settle(gone, Outcome.COMPLETED)  # type: ignore[arg-type]
        self._after()

    @precondition(lambda self: self.quarantined)
    @rule()
    def end_quarantine(self) -> None:
        self.book.end_quarantine(self.quarantined.pop())  # type: ignore[arg-type]
        self._after()

    @rule()
    def close(self) -> None:
        self.book.close()
        self._after()

    @precondition(lambda self: self.book.closed)
    @rule(endpoint=st.sampled_from(["a", "b"]))
    def abort_from(self, endpoint: str) -> None:
        self.acks.add_target(self.book, endpoint, epoch=7)
        self._after()

    def _after(self) -> None:
        if self.book.take_release():
            self.releases += 1
            assert not self.live and not self.quarantined and self.book.closed
        for endpoint, _ in self.acks.due(self.book):
            assert not self.live and not self.quarantined
            self.acked.append(endpoint)

    @invariant()
    def book_matches_model(self) -> None:
        assert set(self.book.live) == set(self.live)
        assert set(self.book.quarantined) == set(self.quarantined)

    @invariant()
    def exactly_once(self) -> None:
        assert self.releases <= 1
        assert len(self.acked) == len(set(self.acked))
        done = self.book.closed and not self.live and not self.quarantined
        assert self.releases == (1 if done else 0)


def test_ack_target_needs_closed_admission() -> None:
    with pytest.raises(RuntimeError):
        AckBook().add_target(LeaseBook(room=1), "a", 1)


@given(st.sets(st.integers(0, 70)), st.sets(st.integers(0, 70)), st.integers(-3, 75))
def test_rank_set_behaves_like_a_set(a: set[int], b: set[int], probe: int) -> None:
    ra, rb = RankSet(a), RankSet(b)
    assert set(ra) == a
    assert (probe in ra) == (probe in a)
    assert set(ra | rb) == a | b
    assert (ra >= rb) == (a >= b)
    ra |= rb
    assert set(ra) == a | b
    with pytest.raises(ValueError):
        ra.add(-1)


def test_combined_status_is_the_minimum() -> None:
    assert combine([KVPoll.Success, KVPoll.Failed, KVPoll.Transferring]) is KVPoll.Failed
    assert combine([KVPoll.Success, KVPoll.Transferring]) is KVPoll.Transferring


def test_a_status_is_written_by_its_cell_only() -> None:
    """``StatusCell.status`` is a plain attribute (it is read several times per request): its
    rules (forward only, Failed absorbing, the first reason kept) hold because only the cell's
    own ``advance`` and ``fail`` assign it. No other module of the package assigns a
    ``.status``."""
    root = Path(trio_pd.__file__).parent
    writes = [
        f"{path.relative_to(root)}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for line in path.read_text().splitlines()
        if re.search(r"\.status\s*(?:=[^=]|[-+|&]=)", line) and path.name != "_state.py"
    ]
    assert writes == []
    state = (root / "core" / "_state.py").read_text()
    assert len(re.findall(r"self\.status = ", state)) == 3  # __init__, advance, fail


TestStatusRules = StatusRules.TestCase
TestStatusRules.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestLeaseRules = LeaseRules.TestCase
TestLeaseRules.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
