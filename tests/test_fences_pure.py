"""The quarantine fences (``trio_pd.core._fences``), driven by plain calls: no trio, no engine,
no probe, no socket.

A fence ends only on proof (SPEC §5.6): every peer answered or refused (never UNKNOWN), every
failed call to a peer that answered proven flushed by the engine, and our send queues to the
peers seen drained, in that order; anything less keeps the pages out, counted, for another
fence. Asserted on the effects :class:`Fences` returns and on what each look asks next.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from trio_pd.core._fences import (
    CheckDrain,
    EndFence,
    Fence,
    FenceDeadlines,
    Fences,
    FenceTimer,
    Look,
    ProbePeers,
    ProveFlush,
)
from trio_pd.core._rooms import Arm, Count, Warn
from trio_pd.core._state import Lease, Liveness

FENCE = 3.0
ALIVE, REFUSED, UNKNOWN = Liveness.ALIVE, Liveness.REFUSED, Liveness.UNKNOWN


@dataclass(eq=False)
class Peer:
    endpoint: str


class End:
    """An ``end`` callback that counts its runs."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self) -> None:
        self.runs += 1


def _fence(
    fences: Fences[Peer], peers: list[Peer], *, failed: list[Peer] | None = None,
    marks: dict[str, int | None] | None = None, npages: int = 4,
) -> tuple[Fence[Peer], End, Arm]:
    """Quarantine a lease over ``peers`` (the calls to ``failed`` failed, the engine keeps
    their blocks when ``marks`` is given) and pass its fence: the fence, its end, its arm."""
    lease = Lease(room=1, serial=0, npages=npages)
    end = End()
    if failed:
        fences.failed_calls(lease, [(p, (10 + i, 20 + i)) for i, p in enumerate(failed)])
    mark_of = None if marks is None else (lambda p: marks[p.endpoint])
    due = fences.quarantine(lease, peers, end, mark_of)
    assert len(due) == 1 and isinstance(due[0], Arm)
    arm = due[0]
    looked = fences.handle_timer(arm.key)
    assert len(looked) == 1 and isinstance(looked[0], Look)
    return looked[0].fence, end, arm


def test_a_quarantine_arms_its_fence_and_the_timer_starts_one_look() -> None:
    fences: Fences[Peer] = Fences(FenceDeadlines(fence=FENCE))
    a, b = Peer("tcp://a:1"), Peer("tcp://b:1")
    lease, end = Lease(room=7, serial=1, npages=8), End()
    [arm] = fences.quarantine(lease, [a, b], end, None)
    assert isinstance(arm, Arm) and arm.kind == "fence" and arm.after == FENCE
    assert isinstance(arm.key, FenceTimer) and arm.key.fence.lease is lease
    assert fences.fenced() == {id(a), id(b)}
    [look] = fences.handle_timer(arm.key)
    assert isinstance(look, Look)
    assert fences.handle_timer(arm.key) == []  # (a look runs: no second one)
    assert fences.next_check(look.fence) == ProbePeers([a, b])


def test_an_unknown_peer_keeps_the_pages_out_for_another_fence() -> None:
    fences: Fences[Peer] = Fences(FenceDeadlines(fence=FENCE))
    a, b = Peer("tcp://a:1"), Peer("tcp://b:1")
    fence, end, _ = _fence(fences, [a, b])
    due = fences.on_liveness(fence, [ALIVE, UNKNOWN])
    assert due[:2] == [
        Count("quarantine_unknown"),
        Warn("quarantine of 4 pages kept: peer liveness unknown (tcp://a:1, tcp://b:1)"),
    ]
    assert isinstance(due[2], Arm) and due[2].kind == "fence" and due[2].after == FENCE
    assert fences.next_check(fence) is None and end.runs == 0
    assert fences.fenced() == {id(a), id(b)}
    # the next fence looks again from the start
    assert isinstance(fences.handle_timer(due[2].key)[0], Look)
    assert fences.next_check(fence) == ProbePeers([a, b])


def test_answers_then_drained_queues_end_the_quarantine_once() -> None:
    fences: Fences[Peer] = Fences(FenceDeadlines(fence=FENCE))
    a, b = Peer("tcp://a:1"), Peer("tcp://b:1")
    fence, end, arm = _fence(fences, [a, b])
    assert fences.on_liveness(fence, [ALIVE, REFUSED]) == []  # (a refusal alone ends nothing)
    assert fences.next_check(fence) == CheckDrain([a, b])
    [ended] = fences.on_drain(fence, True)
    assert isinstance(ended, EndFence)
    ended.end()
    assert end.runs == 1 and fences.fenced() == set() and len(fences) == 0
    # whatever comes later about it changes nothing
    assert fences.next_check(fence) is None
    assert fences.on_drain(fence, True) == [] and fences.handle_timer(arm.key) == []


def test_bytes_still_queued_or_unreadable_queues_keep_the_pages_out() -> None:
    fences: Fences[Peer] = Fences(FenceDeadlines(fence=FENCE))
    a = Peer("tcp://a:1")
    fence, _, _ = _fence(fences, [a])
    fences.on_liveness(fence, [ALIVE])
    due = fences.on_drain(fence, False)
    assert due[:2] == [Count("quarantine_undrained"), Warn(
        "quarantine of 4 pages kept (tcp://a:1): bytes written to them are still in the "
        "kernel's send queue")]
    assert isinstance(due[2], Arm)
    fences.handle_timer(due[2].key)
    fences.on_liveness(fence, [ALIVE])
    due = fences.on_drain(fence, None)  # (a check that could not run is never "drained")
    assert due[:2] == [Count("quarantine_unknown"), Warn(
        "quarantine of 4 pages kept (tcp://a:1): our send queues to them could not be read")]
    assert len(fences) == 1


def test_failed_calls_to_peers_that_answer_must_be_proven_flushed_in_order() -> None:
    fences: Fences[Peer] = Fences(FenceDeadlines(fence=FENCE))
    a, b, c = Peer("tcp://a:1"), Peer("tcp://b:1"), Peer("tcp://c:1")
    marks: dict[str, int | None] = {"tcp://a:1": 5, "tcp://b:1": 6, "tcp://c:1": None}
    fence, end, _ = _fence(fences, [a, b, c], failed=[a, b, c], marks=marks)
    assert [(f.peer, f.mark, f.tail) for f in fence.flushes] == [
        (a, 5, (10, 20)), (b, 6, (11, 21)), (c, None, (12, 22))]
    # b refused (it can be sent nothing more): only a's and c's calls need the engine's proof
    fences.on_liveness(fence, [ALIVE, REFUSED, ALIVE])
    check = fences.next_check(fence)
    assert isinstance(check, ProveFlush) and check.flush.peer is a
    assert fences.on_flush(fence, check.flush, None) == []
    check = fences.next_check(fence)
    assert isinstance(check, ProveFlush) and check.flush.peer is c
    due = fences.on_flush(fence, check.flush, "the engine cannot prove it")
    assert due[:2] == [Count("quarantine_unflushed"),
                       Warn("quarantine of 4 pages kept (tcp://c:1): the engine cannot prove it")]
    assert fences.next_check(fence) is None and end.runs == 0


def test_an_engine_that_keeps_nothing_needs_no_flush() -> None:
    fences: Fences[Peer] = Fences(FenceDeadlines(fence=FENCE))
    a = Peer("tcp://a:1")
    fence, _, _ = _fence(fences, [a], failed=[a], marks=None)
    assert fence.flushes == []
    fences.on_liveness(fence, [ALIVE])
    assert fences.next_check(fence) == CheckDrain([a])


def test_a_dropped_fence_answers_nothing() -> None:
    """The agent closed mid-look: the rooms end their own quarantines; an answer that comes
    back afterwards neither ends nor re-arms anything."""
    fences: Fences[Peer] = Fences(FenceDeadlines(fence=FENCE))
    a = Peer("tcp://a:1")
    fence, end, arm = _fence(fences, [a])
    fences.clear()
    assert fences.next_check(fence) is None
    assert fences.on_liveness(fence, [UNKNOWN]) == []
    assert fences.on_drain(fence, True) == [] and fences.handle_timer(arm.key) == []
    assert end.runs == 0 and fences.fenced() == set()


@given(
    states=st.lists(st.sampled_from([ALIVE, REFUSED, UNKNOWN]), min_size=1, max_size=4),
    keeps=st.booleans(),
    flush_ok=st.lists(st.booleans(), min_size=4, max_size=4),
    drained=st.sampled_from([True, False, None]),
)
def test_a_look_ends_the_quarantine_exactly_when_everything_is_proven(
    states: list[Liveness], keeps: bool, flush_ok: list[bool], drained: bool | None
) -> None:
    """One look, answered at random: the quarantine ends iff no peer is UNKNOWN, every failed
    call to a peer that answered is proven flushed, and the queues are seen drained; the
    look asks exactly that, in that order, and nothing after a failed proof."""
    fences: Fences[Peer] = Fences(FenceDeadlines(fence=FENCE))
    peers = [Peer(f"tcp://p{i}:1") for i in range(len(states))]
    marks: dict[str, int | None] | None = {p.endpoint: 0 for p in peers} if keeps else None
    fence, end, _ = _fence(fences, peers, failed=peers, marks=marks)
    asked: list[object] = []
    ended = False
    while (check := fences.next_check(fence)) is not None:
        asked.append(type(check).__name__)
        match check:
            case ProbePeers():
                due = fences.on_liveness(fence, states)
            case ProveFlush(flush=flush):
                ok = flush_ok[peers.index(flush.peer)]
                due = fences.on_flush(fence, flush, None if ok else "not proven")
            case CheckDrain():
                due = fences.on_drain(fence, drained)
        ended = ended or any(isinstance(e, EndFence) for e in due)
        assert len(asked) <= 2 + len(peers)
    alive = [i for i, s in enumerate(states) if s is ALIVE]
    unknown = UNKNOWN in states
    flushes_ok = not keeps or all(flush_ok[i] for i in alive)
    assert ended == (not unknown and flushes_ok and drained is True)
    assert (len(fences) == 0) == ended and end.runs == 0  # (the shell runs ``end``)
    expected = ["ProbePeers"]
    if not unknown:
        for i in alive if keeps else []:
            expected.append("ProveFlush")
            if not flush_ok[i]:
                break
        if flushes_ok:
            expected.append("CheckDrain")
    assert asked == expected
