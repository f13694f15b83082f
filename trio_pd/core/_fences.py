"""The quarantine fences of a prefill rank, pure (SPEC §5.6: a quarantine ends on proof only).

An errored engine write may still land: its lease's pages stay out until every decode peer
the failed call wrote to is proven quiet or gone. :class:`Fences` owns every rule of that: the
fence each errored lease gets, its timer, what each look at it must prove and in which order,
what each answer means, and when the quarantine ends. Like the room tables (:mod:`._tables`)
it imports no trio, engine or socket and reads no clock; every call returns the effects now
due (:class:`~._rooms.Arm`, :class:`~._rooms.Count`, :class:`~._rooms.Warn`, and the two
here: :class:`Look`, :class:`EndFence`), and the shell
(:class:`~trio_pd.agents._quarantine.Quarantines`) carries them out and makes the probes.

A look at a fence, ``fence`` seconds after the failed call (the engine has given the call up
by then) and again after each look that proved nothing, asks in this order
(:meth:`Fences.next_check`):

1. :class:`ProbePeers`: the liveness of every peer. Any UNKNOWN keeps the pages out
   (``quarantine_unknown``); ALIVE and REFUSED go on (a refusal alone proves nothing about
   bytes already sent).
2. :class:`ProveFlush`, for each failed call to a peer that answered ALIVE, where the engine
   keeps a failed call's blocks: the engine's proof that nothing of the call is left. Without
   it the pages stay out (``quarantine_unflushed``).
3. :class:`CheckDrain`: the kernel's send queues to every peer seen empty. Bytes still queued
   (``quarantine_undrained``) or queues that could not be read (``quarantine_unknown``) keep
   the pages out.

Then the quarantine ends (:class:`EndFence`), once. A fence dropped meanwhile (the agent
closed) answers nothing more: every answer about it is ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeAlias, TypeVar

from ._rooms import Arm, Count, Warn
from ._state import Lease, Liveness


class _Peer(Protocol):
    @property
    def endpoint(self) -> str: ...


P = TypeVar("P", bound=_Peer)


@dataclass(frozen=True, slots=True)
class FenceDeadlines:
    """The deadlines of a quarantine, in seconds."""

    #: a fence's peers are looked at this long after the failed call, and again this long
    #: after each look that proved nothing (the engine's own deadline for a call, plus a
    #: margin); also how long one look waits for the send queues to drain
    fence: float
    #: between two reads of the kernel's send queues while a look waits for them to drain
    drain_poll: float = 0.05


@dataclass(eq=False, slots=True)
class Flush(Generic[P]):
    """A failed call to ``peer`` whose blocks the engine may still hold: ``mark`` is where
    the engine's calls to the peer stood once it had returned (None: the engine can prove
    nothing), ``tail`` the (source, destination) of its last block."""

    peer: P
    mark: int | None
    tail: tuple[int, int]


@dataclass(eq=False, slots=True)
class Fence(Generic[P]):
    """One errored lease held out, and where the look at it stands."""

    lease: Lease
    peers: list[P]
    #: ends the quarantine (the room's pages may go back): run once, by :class:`EndFence`
    end: Callable[[], None]
    #: the lease's failed calls that the engine must prove over (to peers that answer)
    flushes: list[Flush[P]] = field(default_factory=list)
    #: what the look under way asks next; "idle" while the fence's timer runs
    step: Literal["idle", "probe", "flush", "drain"] = "idle"
    #: the flushes this look has yet to see proven (the failed calls to peers that answered)
    to_prove: list[Flush[P]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FenceTimer:
    """The key of a fence's timer (the fence itself, by identity)."""

    fence: Fence[Any]


# effects ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Look(Generic[P]):
    """Start a look at ``fence``: answer each :meth:`Fences.next_check` until it says None."""

    fence: Fence[P]


@dataclass(frozen=True, slots=True)
class EndFence:
    """The quarantine is over: run ``end`` (the room's pages may go back)."""

    end: Callable[[], None]


FenceDue: TypeAlias = list[Arm | Count | Warn | Look[P] | EndFence]

# what a look asks ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProbePeers(Generic[P]):
    """Probe each peer, in order; answer :meth:`Fences.on_liveness`."""

    peers: list[P]


@dataclass(frozen=True, slots=True)
class ProveFlush(Generic[P]):
    """Have the engine prove ``flush`` over; answer :meth:`Fences.on_flush` (None: proven;
    otherwise why not)."""

    flush: Flush[P]


@dataclass(frozen=True, slots=True)
class CheckDrain(Generic[P]):
    """Read our kernel's send queues to these peers' hosts within one fence; answer
    :meth:`Fences.on_drain` (True: seen empty; False: not; None: could not be read)."""

    peers: list[P]


Check: TypeAlias = ProbePeers[P] | ProveFlush[P] | CheckDrain[P]


class Fences(Generic[P]):
    """The quarantine fences of one prefill rank: each errored lease's fence and its timer,
    the failed calls a settling chunk reported for it, and every rule that ends one.

    Invariant: a lease has at most one fence, and at most one look at it runs (a look starts
    only from the fence's timer, and re-arms the timer only when it ends without proof)."""

    def __init__(self, deadlines: FenceDeadlines) -> None:
        self.deadlines = deadlines
        #: lease -> its fence, until the quarantine ends or the agent closes
        self._fences: dict[Lease, Fence[P]] = {}
        #: a settling chunk's failed calls, until its quarantine takes them (:meth:`quarantine`)
        self._failed: dict[Lease, list[tuple[P, tuple[int, int]]]] = {}

    def __len__(self) -> int:
        return len(self._fences)

    def fenced(self) -> set[int]:
        """The ids of the peers some quarantine waits on (they may not be dropped)."""
        return {id(p) for fence in self._fences.values() for p in fence.peers}

    def failed_calls(self, lease: Lease, calls: list[tuple[P, tuple[int, int]]]) -> None:
        """The engine calls of ``lease``'s chunk that failed, each with the (source,
        destination) of its last block: told as the chunk settles, just before the lease's
        quarantine starts (:meth:`quarantine` takes them)."""
        self._failed[lease] = calls

    def quarantine(
        self, lease: Lease, peers: list[P], end: Callable[[], None],
        mark_of: Callable[[P], int | None] | None,
    ) -> FenceDue[P]:
        """``lease``'s write errored: fence it off from ``peers`` and arm the fence.
        ``mark_of`` is None for an engine that holds nothing of a call once it returned;
        otherwise it reads where the engine's calls to a peer stand now (the failed calls
        have returned: marks taken now are after them), and each failed call must be proven
        flushed past its mark before the quarantine ends."""
        fence = Fence(lease, peers, end)
        failed = self._failed.pop(lease, [])
        if failed and mark_of is not None:
            fence.flushes = [Flush(peer, mark_of(peer), tail) for peer, tail in failed]
        self._fences[lease] = fence
        return [self._arm(fence)]

    def _arm(self, fence: Fence[P]) -> Arm:
        return Arm("fence", self.deadlines.fence, FenceTimer(fence))

    def current(self, fence: Fence[P]) -> bool:
        """Whether ``fence`` still holds its lease (not ended, not dropped)."""
        return self._fences.get(fence.lease) is fence

    def handle_timer(self, key: Hashable) -> FenceDue[P]:
        """A fence's timer passed: look at it, if it still holds its lease."""
        match key:
            case FenceTimer(fence=fence) if self.current(fence) and fence.step == "idle":
                fence.step = "probe"
                return [Look(fence)]
        return []

    def next_check(self, fence: Fence[P]) -> Check[P] | None:
        """What the look at ``fence`` asks next; None once it is over (the fence ended, was
        dropped, or waits for its timer again)."""
        if not self.current(fence):
            return None
        match fence.step:
            case "probe":
                return ProbePeers(fence.peers)
            case "flush":
                return ProveFlush(fence.to_prove[0])
            case "drain":
                return CheckDrain(fence.peers)
        return None

    def on_liveness(self, fence: Fence[P], states: Sequence[Liveness]) -> FenceDue[P]:
        """The peers' liveness, in order. Any UNKNOWN keeps the pages out. Otherwise the
        failed calls to the peers that answered must be proven flushed (a peer that refuses
        can be sent nothing more), then the send queues drained."""
        if not self.current(fence) or fence.step != "probe":
            return []
        if any(s is Liveness.UNKNOWN for s in states):
            return self._keep(fence, "quarantine_unknown",
                              f"peer liveness unknown ({_endpoints(fence)})")
        alive = {id(p) for p, s in zip(fence.peers, states, strict=True) if s is Liveness.ALIVE}
        fence.to_prove = [f for f in fence.flushes if id(f.peer) in alive]
        fence.step = "flush" if fence.to_prove else "drain"
        return []

    def on_flush(self, fence: Fence[P], flush: Flush[P], why: str | None) -> FenceDue[P]:
        """The engine's answer for ``flush``: None (proven over) goes on; a reason keeps the
        pages out."""
        if not self.current(fence) or fence.step != "flush" or fence.to_prove[0] is not flush:
            return []
        if why is not None:
            return self._keep(fence, "quarantine_unflushed", why, where=flush.peer.endpoint)
        fence.to_prove.pop(0)
        if not fence.to_prove:
            fence.step = "drain"
        return []

    def on_drain(self, fence: Fence[P], drained: bool | None) -> FenceDue[P]:
        """Our send queues to the peers: seen empty ends the quarantine; bytes still queued,
        or queues that could not be read (never taken for drained), keep the pages out."""
        if not self.current(fence) or fence.step != "drain":
            return []
        if drained:
            del self._fences[fence.lease]
            fence.step = "idle"
            return [EndFence(fence.end)]
        if drained is None:
            return self._keep(fence, "quarantine_unknown",
                              "our send queues to them could not be read", where=_endpoints(fence))
        return self._keep(fence, "quarantine_undrained",
                          "bytes written to them are still in the kernel's send queue",
                          where=_endpoints(fence))

    def _keep(
        self, fence: Fence[P],
        counter: Literal["quarantine_unknown", "quarantine_undrained", "quarantine_unflushed"],
        why: str, *, where: str | None = None,
    ) -> FenceDue[P]:
        """This look proved nothing: the pages stay out, counted and said, for another
        fence."""
        fence.step, fence.to_prove = "idle", []
        n = fence.lease.npages
        text = (f"quarantine of {n} pages kept: {why}" if where is None
                else f"quarantine of {n} pages kept ({where}): {why}")
        return [Count(counter), Warn(text), self._arm(fence)]

    def clear(self) -> None:
        """The agent is closing: the rooms end their own quarantines (our own pages)."""
        self._fences.clear()
        self._failed.clear()


def _endpoints(fence: Fence[P]) -> str:
    return ", ".join(p.endpoint for p in fence.peers)


__all__ = [
    "CheckDrain",
    "EndFence",
    "Fence",
    "FenceDeadlines",
    "FenceTimer",
    "Fences",
    "Flush",
    "Look",
    "ProbePeers",
    "ProveFlush",
]
