"""Which prefill DP rank holds a room, pure: every decision of decode's DP-attention routing.

A bootstrap service may serve several DP ranks of one prefill instance. A room the caller did
not route waits here, per bootstrap URL (a :class:`Route`), until its DP rank is known: from
the instance's topology (one DP rank: DP rank 0, unasked), or from the service's answer to an
ask (``POST /query_dp_ranks``), or until it cannot be known: the service refused, the
instance did not resolve before the size was learnt, or its deadline passed
(``RouteDeadlines.bootstrap`` after the first ask that included it).

:class:`DpRoutes` owns the routes (bounded: the oldest idle one goes first), the rooms
waiting in them, their deadlines and the pause between two warnings of a deadline. Like the
room tables (:mod:`._tables`) it imports no trio, socket or HTTP client and reads no clock:
each call returns the effects now due (:class:`Routed`, :class:`Unroutable`,
:class:`Resolve`, :class:`Wake`, :class:`StartAsking`, :class:`DropRoute`, :class:`Disarm`, and
the shared :class:`~._rooms.Arm`, :class:`~._rooms.Count`, :class:`~._rooms.Warn`), and the
shell (:class:`~trio_pd.agents._dp_router.DpRouter`) carries them out and makes the asks.

**A room's deadline goes when its wait ends.** Its key (:class:`RouteTimer`) holds the room's
record, so the armed deadline would keep a room routed in milliseconds, page ids and all,
reachable for the whole bootstrap deadline. Every room that leaves its route before its
deadline, routed or unroutable, leaves with a :class:`Disarm` of that deadline if it was
armed (each :class:`~._rooms.Arm` of a :class:`RouteTimer` is matched by exactly one
:class:`Disarm` or by its own expiry, never both). A room the caller gave up keeps waiting:
once routed, its DP rank must hear the ABORT.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

from ._errors import BootstrapError, TransferError, UnknownRoom
from ._rooms import Arm, Count, DecodeRoom, Warn
from ._state import KVPoll


class _Routed(Protocol):
    """What the routes read of a room: its machine (room id, epoch, status)."""

    @property
    def machine(self) -> DecodeRoom: ...


R = TypeVar("R", bound=_Routed)


@dataclass(frozen=True, slots=True)
class RouteDeadlines:
    """The deadlines and pauses of DP routing, in seconds."""

    #: a room still waiting for its DP rank this long after the first ask that included it
    #: fails (``DecodeConfig.bootstrap_timeout``)
    bootstrap: float = 30.0
    #: the pause between two asks to a service: ``ask_min`` after one that taught something,
    #: doubling up to ``ask_max`` while nothing new is learnt (sooner when a room joins)
    ask_min: float = 0.005
    ask_max: float = 0.1
    #: the bound of one ask
    ask_timeout: float = 5.0
    #: at most one warning of a room's deadline per service this often
    warn_every: float = 1.0

    def next_pause(self, pause: float, learnt: bool) -> float:
        """The pause before the next ask, after one that took ``pause`` before it."""
        return self.ask_min if learnt else min(2 * pause, self.ask_max)


@dataclass(eq=False, slots=True)
class Route(Generic[R]):
    """The rooms of one bootstrap URL waiting to learn their DP rank, and what the service
    said of its DP size."""

    url: str
    #: the instance's DP size, once known (None: not known, or to learn again)
    dp_size: int | None = None
    #: rooms still waiting, oldest first, and whether an ask included them yet (their
    #: deadline runs from the first)
    pending: dict[R, bool] = field(default_factory=dict)
    #: a task asks for them (set by :class:`StartAsking`, cleared by the task's end)
    asking: bool = False
    #: why the last ask routed nothing (for the error of a room whose deadline passes)
    last_error: str = "no answer yet"
    #: a deadline was warned of less than ``warn_every`` ago: the next ones pass silently
    quiet: bool = False


@dataclass(frozen=True, slots=True)
class RouteTimer:
    """The key of a room's routing deadline: that room in that route (both by identity)."""

    route: Route[Any]
    rec: Any


@dataclass(frozen=True, slots=True)
class QuietTimer:
    """The key of the end of a route's quiet time after a warning."""

    route: Route[Any]


# effects ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Routed(Generic[R]):
    """The room's DP rank is known: it goes to DP rank ``dp_rank`` of the service at ``url``."""

    rec: R
    url: str
    dp_rank: int


@dataclass(frozen=True, slots=True)
class Unroutable(Generic[R]):
    """The room cannot be routed: it fails with ``error``."""

    rec: R
    error: TransferError


@dataclass(frozen=True, slots=True)
class Disarm:
    """The deadline armed under ``key`` (a :class:`RouteTimer`) is no longer wanted: the
    room's wait ended before it. Cancel it now (it holds the room's record)."""

    key: Hashable


@dataclass(frozen=True, slots=True)
class Resolve:
    """Resolve the instance at ``url`` (DP rank 0's group): its topology says the DP size.
    If it is resolved already, say so (:meth:`DpRoutes.resolved`)."""

    url: str


@dataclass(frozen=True, slots=True)
class Wake:
    """Wake the task asking for ``url`` (a room joined, or the DP size may be known): it asks
    again sooner."""

    url: str


@dataclass(frozen=True, slots=True)
class StartAsking(Generic[R]):
    """Start the one task that asks for ``route``'s rooms; when it ends, say
    :meth:`DpRoutes.stopped_asking`."""

    route: Route[R]


@dataclass(frozen=True, slots=True)
class DropRoute:
    """The route of ``url`` was dropped to make room: close its client, and, with
    ``forget_instance``, forget the instance at ``url`` (its DP rank 0 must not be taken for
    the whole instance by a later room)."""

    url: str
    forget_instance: bool


RouteDue: TypeAlias = list[
    Routed[R] | Unroutable[R] | Resolve | Wake | StartAsking[R] | DropRoute | Arm | Disarm
    | Count | Warn
]


class DpRoutes(Generic[R]):
    """Decode's DP routing: per bootstrap URL, the rooms waiting for their DP rank (at most
    ``max_routes`` URLs) and the service's DP size once known; every room leaves its route
    once, routed or unroutable, and its deadline, if armed, with it (:class:`Disarm`)."""

    def __init__(self, deadlines: RouteDeadlines | None = None, *, max_routes: int = 4096) -> None:
        self.deadlines = deadlines or RouteDeadlines()
        self.max_routes = max_routes
        self.routes: dict[str, Route[R]] = {}

    def target(self, base: str, dp_rank: int | None, ready: bool) -> tuple[int | None, RouteDue[R]]:
        """The DP rank of the service at ``base`` a new room goes to: the one it names; DP
        rank 0 (the whole instance) when the service has one DP rank, or when the instance at
        ``base`` is resolved (``ready``) outside DP routing (set up by hand); else None (it
        waits: :meth:`add`)."""
        route = self.routes.get(base)
        if dp_rank is not None:
            _, due = self._route_for(base)  # rooms that name no DP rank will ask (mixed)
            return dp_rank, due
        if route is None:
            return (0 if ready else None), []
        return (0 if route.dp_size == 1 else None), []

    def add(self, rec: R, base: str) -> RouteDue[R]:
        """``rec`` waits for its DP rank. While the DP size of the service at ``base`` is not
        known, its DP rank 0 (the whole instance) is resolved first: its topology says the DP
        size, and with one DP rank the room goes there unasked. Otherwise the service is
        asked (:meth:`asking`)."""
        route, due = self._route_for(base)
        route.pending[rec] = False
        if route.dp_size is None:
            due.append(Resolve(base))
        return due

    def ask(self, base: str) -> RouteDue[R]:
        """Rooms wait at ``base``: wake the task asking for them, or start one."""
        route = self.routes.get(base)
        if route is None or not route.pending:
            return []
        due: RouteDue[R] = [Wake(base)]
        if not route.asking:
            route.asking = True
            due.append(StartAsking(route))
        return due

    def stopped_asking(self, route: Route[R]) -> None:
        route.asking = False

    def awaiting_size(self, route: Route[R]) -> bool:
        """Rooms wait and the DP size is not known: learn it from the topology being
        resolved before asking (with one DP rank, the common case, no room is asked for)."""
        return bool(route.pending) and route.dp_size is None

    def resolved(self, url: str, dp_size: int | None) -> RouteDue[R]:
        """The instance at ``url`` resolved with ``dp_size`` DP ranks (None: it did not
        say); with one DP rank every room waiting goes to it, unasked."""
        route = self.routes.get(url)
        if route is None:
            return []
        due: RouteDue[R] = []
        if route.dp_size is None and dp_size is not None:
            route.dp_size = dp_size
            if dp_size == 1:
                due += self._leave_all(route, lambda rec: Routed(rec, url, 0))
        return [*due, Wake(url)]

    def resolve_failed(self, url: str, error: TransferError) -> RouteDue[R]:
        """The instance at ``url`` did not resolve. Rooms that waited for it to say the DP
        size fail now with its reason, instead of asking for a deadline of their own (which
        made a dead URL take twice the bootstrap deadline)."""
        route = self.routes.get(url)
        if route is None:
            return []
        due: RouteDue[R] = []
        if route.dp_size is None:
            due += self._leave_all(route, lambda rec: Unroutable(rec, error))
        return [*due, Wake(url)]

    def forget_sizes(self) -> None:
        """A prefill rank was lost: a restarted instance may have another DP size."""
        for route in self.routes.values():
            route.dp_size = None

    # ---------------------------------------------------------------- asks

    def asking(self, route: Route[R], candidates: Sequence[R]) -> tuple[list[R], RouteDue[R]]:
        """The rooms of ``candidates`` still waiting, to be asked for now; the deadline of
        each asked for the first time starts."""
        batch = [r for r in candidates if r in route.pending]
        due: RouteDue[R] = []
        for rec in batch:
            if not route.pending[rec]:
                route.pending[rec] = True
                due.append(Arm("dp_route", self.deadlines.bootstrap, RouteTimer(route, rec)))
        return batch, due

    def answered(
        self, route: Route[R], batch: Sequence[R], dp_size: int, ranks: Sequence[int | None]
    ) -> tuple[bool, RouteDue[R]]:
        """The service's answer for ``batch``: its DP size, and the DP rank of each room
        (None: no DP rank announced it yet). Whether any room left, and the routed."""
        route.dp_size = dp_size
        due: RouteDue[R] = []
        for rec, k in zip(batch, ranks, strict=True):
            if k is None or rec not in route.pending:
                continue
            due += self._leave(route, rec)
            due.append(Routed(rec, route.url, k))
        if None in ranks:
            route.last_error = f"DP size {dp_size}; no prefill DP rank announced the room"
        return bool(due), due

    def no_answer(self, route: Route[R], why: str) -> None:
        """An ask got no answer (the service may not be up yet): asked again later."""
        route.last_error = why

    def refused(self, route: Route[R], error: BootstrapError) -> RouteDue[R]:
        """A definite refusal (401, 400...): every room waiting fails now."""
        failure = BootstrapError(f"prefill instance {route.url}: {error}")
        due: RouteDue[R] = [Warn(str(failure))]
        return due + self._leave_all(route, lambda rec: Unroutable(rec, failure))

    # ---------------------------------------------------------------- deadlines

    def handle_timer(self, key: Hashable) -> RouteDue[R]:
        """A deadline armed by an :class:`Arm` of these routes has passed."""
        match key:
            case RouteTimer(route=route, rec=rec):
                return self._deadline(route, rec)
            case QuietTimer(route=route):
                route.quiet = False
        return []

    def _deadline(self, route: Route[R], rec: R) -> RouteDue[R]:
        """The bootstrap deadline after the first ask for the room: if it still waits, it
        fails (counted ``timeouts``) with :class:`UnknownRoom`, or, if the service never
        answered, with a :class:`BootstrapError` as an instance that does not resolve. At
        most one warning per route each ``warn_every``."""
        if rec not in route.pending:
            return []  # (it left before: its Disarm was due then; this is a stale expiry)
        del route.pending[rec]  # (this very deadline ran: nothing to disarm)
        if rec.machine.status is KVPoll.Failed:
            return []  # failed meanwhile (aborted): there is nobody to tell
        timeout = self.deadlines.bootstrap
        error: BootstrapError
        if route.dp_size is None:  # it never answered: as an instance that does not resolve
            error = BootstrapError(
                f"prefill instance {route.url}: no answer within {timeout:g} s "
                f"({route.last_error})"
            )
        else:
            error = UnknownRoom(
                f"room {rec.machine.room}: the bootstrap service at {route.url} did not say "
                f"which DP rank holds it within {timeout:g} s ({route.last_error})"
            )
        due: RouteDue[R] = [Count("timeouts")]
        if not route.quiet:
            route.quiet = True
            due += [Warn(str(error)),
                    Arm("dp_warn", self.deadlines.warn_every, QuietTimer(route))]
        return [*due, Unroutable(rec, error)]

    # ---------------------------------------------------------------- leaving

    def _leave(self, route: Route[R], rec: R) -> RouteDue[R]:
        """``rec``'s wait in ``route`` ends before its deadline: the deadline goes too, if
        an ask armed it (:meth:`asking`)."""
        return [Disarm(RouteTimer(route, rec))] if route.pending.pop(rec) else []

    def _leave_all(
        self, route: Route[R], outcome: Callable[[R], Routed[R] | Unroutable[R]]
    ) -> RouteDue[R]:
        """Every room waiting in ``route`` leaves, oldest first: its deadline's
        :class:`Disarm` if armed, then ``outcome(rec)``."""
        due: RouteDue[R] = []
        for rec in list(route.pending):
            due += self._leave(route, rec)
            due.append(outcome(rec))
        return due

    # ---------------------------------------------------------------- the bound

    def _route_for(self, base: str) -> tuple[Route[R], RouteDue[R]]:
        route = self.routes.get(base)
        if route is not None:
            return route, []
        due = self._evict() if len(self.routes) >= self.max_routes else []
        route = self.routes[base] = Route(base)
        return route, due

    def _evict(self) -> RouteDue[R]:
        """Drop the oldest idle route (none idle: keep them all; each holds waiting rooms)."""
        for url, route in self.routes.items():
            if route.pending or route.asking:
                continue
            del self.routes[url]
            return [DropRoute(url, forget_instance=route.dp_size != 1)]
        return []


__all__ = [
    "Disarm",
    "DpRoutes",
    "DropRoute",
    "QuietTimer",
    "Resolve",
    "Route",
    "RouteDeadlines",
    "RouteTimer",
    "Routed",
    "StartAsking",
    "Unroutable",
    "Wake",
]
