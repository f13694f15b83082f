"""The sans-I/O core's vocabulary: KVPoll rules, leases, the prefill side's books, rank sets.

Nothing here imports trio or touches a socket. The room machines (``_rooms``) own these
objects, one set per room: a prefill room its ``StatusCell``, ``LeaseBook`` and ``AckBook``;
a decode room its ``StatusCell`` and ``RankSet``s (its rank bookkeeping and the rules over it
are the decode room's own, ``_rooms.DecodeRoom``). The rules about *state* (as opposed to
*tasks*) that these objects carry live here, under a name that says it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ._errors import AdmissionClosed, TransferError


class KVPoll(enum.IntEnum):
    """A room's status. Ordered: it only moves forward, and Failed (the minimum) absorbs."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


TERMINAL = frozenset({KVPoll.Failed, KVPoll.Success})


def combine(statuses: Iterable[KVPoll]) -> KVPoll:
    """The status of a request served by several ranks: the minimum (SPEC §4, I6)."""
    return min(statuses, default=KVPoll.Bootstrapping)


class StatusCell:
    """One room's status on one side.

    Forward only; Failed is absorbing; a terminal status never changes again (so a handle that
    saw it keeps seeing it). The first failure's reason wins and stays readable.
    """

    __slots__ = ("failure", "propagated", "status")

    def __init__(self) -> None:
        #: the status: a plain attribute (read several times per request), written by
        #: :meth:`advance` and :meth:`fail` only, never assigned from outside
        self.status = KVPoll.Bootstrapping
        self.failure: TransferError | None = None
        self.propagated = False

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def advance(self, new: KVPoll) -> bool:
        """Move to ``new`` if that is forward and we are not terminal. Returns whether it moved.
        Use :meth:`fail` for Failed (it needs a reason)."""
        if new is KVPoll.Failed:
            raise ValueError("use fail() to record a failure with its reason")
        if self.status in TERMINAL or new <= self.status:  # (terminal, without a call)
            return False
        self.status = new
        return True

    def fail(self, error: TransferError, *, propagated: bool = False) -> bool:
        """Fail with a reason. Returns False if already terminal (Success stands; the first
        failure's reason stays)."""
        if self.status in TERMINAL:
            return False
        self.status = KVPoll.Failed
        self.failure = error
        self.propagated = propagated
        return True


class Outcome(enum.Enum):
    """How a lease's I/O ended (SPEC §5.3)."""

    COMPLETED = "completed"  # every engine call returned success: proof of drain
    CANCELLED = "cancelled"  # no engine call was ever started
    ERROR = "error"  # an engine call failed: completion of in-flight pieces is unknown


class LeaseState(enum.Enum):
    LIVE = "live"
    QUARANTINED = "quarantined"
    RETIRED = "retired"
    MERGED = "merged"  # its pages passed to another lease of the room (LeaseBook.merge)


@dataclass(eq=False, slots=True)
class Lease:
    """A claim on one chunk's pages from admission until its I/O is terminal."""

    room: int
    serial: int
    npages: int
    state: LeaseState = LeaseState.LIVE
    outcome: Outcome | None = None


@dataclass(slots=True)
class LeaseBook:
    """The leases of one room, and the rule for when its pages may go back (SPEC §5.3, I1, I3).

    The room's pages may be handed back (its release callback run) exactly once, when the room
    is *closed* and holds no live and no quarantined lease.
    """

    room: int
    closed: bool = False
    released: bool = False
    _serial: int = 0
    # dicts used as sets (an empty dict is a third of an empty set; thousands of rooms)
    live: dict[Lease, None] = field(default_factory=dict)
    quarantined: dict[Lease, None] = field(default_factory=dict)

    def admit(self, npages: int) -> Lease:
        """Take a lease at admission. Raises AdmissionClosed once the room is closed (I2)."""
        if self.closed:
            raise AdmissionClosed(f"room {self.room} is closed to new chunks")
        self._serial += 1
        lease = Lease(self.room, self._serial, npages)
        self.live[lease] = None
        return lease

    def close(self) -> None:
        """Close admission. Idempotent."""
        self.closed = True

    def merge(self, leases: list[Lease]) -> Lease:
        """Fold live leases that will share one engine call into the first: it then covers
        all their pages and is the one that settles; the others leave the book as MERGED.
        No page is ever uncovered in between (it all happens in one synchronous step)."""
        head, rest = leases[0], leases[1:]
        for lease in leases:
            if lease.state is not LeaseState.LIVE or lease not in self.live:
                raise RuntimeError(f"lease {lease.serial} of room {self.room} is not live here")
        for lease in rest:
            head.npages += lease.npages
            del self.live[lease]
            lease.state = LeaseState.MERGED
        return head

    def settle(self, lease: Lease, outcome: Outcome) -> None:
        """Record how a lease's I/O ended: completed/cancelled retire it, error quarantines it."""
        if lease.state is not LeaseState.LIVE:
            raise RuntimeError(f"lease {lease.serial} of room {self.room} settled twice")
        self.live.pop(lease, None)
        lease.outcome = outcome
        if outcome is Outcome.ERROR:
            lease.state = LeaseState.QUARANTINED
            self.quarantined[lease] = None
        else:
            lease.state = LeaseState.RETIRED

    def end_quarantine(self, lease: Lease) -> None:
        """Retire a quarantined lease on proof that the engine can no longer touch its pages
        (the peer is proven gone, or the engine's own deadline for the call has passed)."""
        if lease.state is not LeaseState.QUARANTINED:
            raise RuntimeError(f"lease {lease.serial} of room {self.room} is not quarantined")
        self.quarantined.pop(lease, None)
        lease.state = LeaseState.RETIRED

    @property
    def holds_nothing(self) -> bool:
        """No lease can still read or write this room's pages."""
        return not self.live and not self.quarantined

    def take_release(self) -> bool:
        """True exactly once: when the room is closed and holds nothing. The caller then runs
        the room's release callback."""
        if self.released or not self.closed or not self.holds_nothing:
            return False
        self.released = True
        return True


@dataclass(slots=True)
class AckBook:
    """Prefill side of the drain ack (SPEC §5.5, I2).

    Ack targets are registered only after admission closed, one per decode endpoint, never
    overwritten; an ack is due once the room holds nothing. Each target is acked once.
    """

    targets: dict[str, int] = field(default_factory=dict)  # endpoint -> epoch
    acked: dict[str, None] = field(default_factory=dict)  # a set, as a smaller dict

    def add_target(self, leases: LeaseBook, endpoint: str, epoch: int) -> None:
        if not leases.closed:
            raise RuntimeError("an ack target is registered only after admission closed")
        self.targets.setdefault(endpoint, epoch)

    def withhold(self) -> None:
        """Never ack the targets registered so far: a write's outcome stays unknown (an agent
        that closes with a quarantined lease)."""
        self.acked.update(dict.fromkeys(self.targets))

    def due(self, leases: LeaseBook) -> list[tuple[str, int]]:
        """The (endpoint, epoch) pairs to ack now; each is returned once."""
        if not self.targets:  # (no ABORT, no shutdown: none owed, as most rooms)
            return []
        if not leases.closed or not leases.holds_nothing:
            return []
        out = [(ep, e) for ep, e in self.targets.items() if ep not in self.acked]
        self.acked.update(dict.fromkeys(ep for ep, _ in out))
        return out


class RankSet:
    """A set of small non-negative rank ids, as the bits of one int: a room keeps four of
    them, and an empty ``set`` costs 216 bytes against this object's 48."""

    __slots__ = ("bits",)

    def __init__(self, ranks: Iterable[int] = ()) -> None:
        self.bits = 0
        if ranks != ():  # (a room makes three empty ones)
            self.update(ranks)

    def add(self, rank: int) -> None:
        if rank < 0:
            raise ValueError(f"rank {rank} is negative")
        self.bits |= 1 << rank

    def update(self, ranks: Iterable[int]) -> None:
        bits = self.bits
        for rank in ranks:  # (add's check, once a rank, without a call each)
            if rank < 0:
                raise ValueError(f"rank {rank} is negative")
            bits |= 1 << rank
        self.bits = bits

    def __contains__(self, rank: object) -> bool:
        return (
            (type(rank) is int or isinstance(rank, int)) and rank >= 0
            and bool(self.bits >> rank & 1)
        )

    def __iter__(self) -> Iterator[int]:
        bits, rank = self.bits, 0
        while bits:
            if bits & 1:
                yield rank
            bits >>= 1
            rank += 1

    def __or__(self, other: RankSet) -> RankSet:
        out = RankSet()
        out.bits = self.bits | other.bits
        return out

    def __ior__(self, other: RankSet) -> RankSet:
        self.bits |= other.bits
        return self

    def __ge__(self, other: RankSet) -> bool:
        """Superset, as for sets."""
        return other.bits & ~self.bits == 0

    def __repr__(self) -> str:
        return f"RankSet({sorted(self)})"


class Liveness(enum.Enum):
    """What a probe of a peer proved (SPEC §5.6). Only ALIVE (after the engine's deadline) or
    GONE may end a quarantine or release held pages; REFUSED and UNKNOWN prove nothing."""

    ALIVE = "alive"  # it answered
    GONE = "gone"  # positive evidence that none of its writes can land any more
    #: its host refused a connect where it listened: it closed its socket, or its process
    #: is gone. A hint that makes a fence worth trying, never proof: an agent may close while
    #: its engine delivers, and a dead process's kernel still sends what its sockets held
    REFUSED = "refused"
    UNKNOWN = "unknown"  # a timeout, a hang, an unreachable host, a check that could not run
