"""Decode's DP routing (``trio_pd.core._dp_routes``), driven by plain calls: no trio, no HTTP,
no bootstrap service.

Which DP rank a new room goes to, what the instance's topology and each answer of the service
decide, each room's deadline (from the first ask that included it) and the one warning a
second, and the bound on routes: asserted on the effects :class:`DpRoutes` returns.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial

from trio_pd.core._dp_routes import (
    Disarm,
    DpRoutes,
    DropRoute,
    QuietTimer,
    Resolve,
    Routed,
    RouteDeadlines,
    RouteTimer,
    StartAsking,
    Unroutable,
    Wake,
)
from trio_pd.core._errors import BootstrapError, TransferAborted, UnknownRoom
from trio_pd.core._rooms import Arm, Count, DecodeRoom, Warn

URL = "http://bootstrap:1"
DEADLINES = RouteDeadlines(bootstrap=30.0)


@dataclass(eq=False)
class Rec:
    """The agent's record of a room: all the routes read is its machine."""

    room: int
    machine: DecodeRoom = field(init=False)

    def __post_init__(self) -> None:
        self.machine = DecodeRoom(self.room, 1000 + self.room)


def _waiting(routes: DpRoutes[Rec], *recs: Rec) -> None:
    for rec in recs:
        routes.add(rec, URL)


def test_the_target_of_a_new_room() -> None:
    """A DP rank named goes there (and the URL gets a route: rooms that name none will ask);
    else DP rank 0 for an instance resolved by hand or one known to have one DP rank; else
    the room asks."""
    routes: DpRoutes[Rec] = DpRoutes(DEADLINES)
    assert routes.target(URL, None, ready=True) == (0, [])
    assert routes.target(URL, None, ready=False) == (None, [])
    assert routes.target(URL, 3, ready=False) == (3, []) and URL in routes.routes
    assert routes.target(URL, None, ready=True) == (None, [])  # (its DP size is not known)
    routes.resolved(URL, 1)
    assert routes.target(URL, None, ready=False) == (0, [])


def test_a_one_rank_instance_routes_every_waiting_room_unasked() -> None:
    routes: DpRoutes[Rec] = DpRoutes(DEADLINES)
    a, b = Rec(1), Rec(2)
    assert routes.add(a, URL) == [Resolve(URL)]
    routes.add(b, URL)
    assert routes.resolved(URL, 1) == [Routed(a, URL, 0), Routed(b, URL, 0), Wake(URL)]
    assert routes.routes[URL].pending == {}
    assert routes.add(Rec(3), URL) == []  # (its size is known: nothing to resolve)


def test_a_larger_instance_leaves_the_rooms_to_ask() -> None:
    routes: DpRoutes[Rec] = DpRoutes(DEADLINES)
    a = Rec(1)
    routes.add(a, URL)
    assert routes.resolved(URL, 2) == [Wake(URL)]
    route = routes.routes[URL]
    assert list(route.pending) == [a] and not routes.awaiting_size(route)


def test_an_instance_that_does_not_resolve_fails_the_rooms_waiting_for_its_size() -> None:
    routes: DpRoutes[Rec] = DpRoutes(DEADLINES)
    a, b = Rec(1), Rec(2)
    _waiting(routes, a, b)
    error = BootstrapError("no answer")
    assert routes.resolve_failed(URL, error) == [
        Unroutable(a, error), Unroutable(b, error), Wake(URL)]


def test_one_asking_task_per_route() -> None:
    routes: DpRoutes[Rec] = DpRoutes(DEADLINES)
    assert routes.ask(URL) == []
    _waiting(routes, Rec(1))
    route = routes.routes[URL]
    assert routes.ask(URL) == [Wake(URL), StartAsking(route)]
    assert routes.ask(URL) == [Wake(URL)]
    routes.stopped_asking(route)
    assert routes.ask(URL) == [Wake(URL), StartAsking(route)]


def test_a_room_s_deadline_starts_at_its_first_ask() -> None:
    routes: DpRoutes[Rec] = DpRoutes(DEADLINES)
    a, b = Rec(1), Rec(2)
    _waiting(routes, a)
    route = routes.routes[URL]
    batch, due = routes.asking(route, [a, b])  # (b is not waiting: not asked for)
    assert batch == [a] and due == [Arm("dp_route", 30.0, RouteTimer(route, a))]
    assert routes.asking(route, [a]) == ([a], [])  # (asked again: no second deadline)


def test_an_answer_routes_the_rooms_it_knows() -> None:
    routes: DpRoutes[Rec] = DpRoutes(DEADLINES)
    a, b = Rec(1), Rec(2)
    _waiting(routes, a, b)
    route = routes.routes[URL]
    assert routes.answered(route, [a, b], 4, [None, 3]) == (True, [Routed(b, URL, 3)])
    assert list(route.pending) == [a] and route.dp_size == 4
    assert route.last_error == "DP size 4; no prefill DP rank announced the room"
    assert routes.answered(route, [a], 4, [None]) == (False, [])
    routes.no_answer(route, "NotReady: not yet")
    assert route.last_error == "NotReady: not yet"


def test_a_refusal_fails_every_waiting_room_with_one_warning() -> None:
    routes: DpRoutes[Rec] = DpRoutes(DEADLINES)
    a, b = Rec(1), Rec(2)
    _waiting(routes, a, b)
    due = routes.refused(routes.routes[URL], BootstrapError("401 bad token"))
    assert due[0] == Warn(f"prefill instance {URL}: 401 bad token")
    assert [(type(e).__name__, e.rec) for e in due[1:]] == [  # type: ignore[union-attr]
        ("Unroutable", a), ("Unroutable", b)]
    assert routes.routes[URL].pending == {}


def test_the_deadline_fails_the_room_and_warns_at_most_once_a_second() -> None:
    """A room still waiting at its deadline fails, counted: UnknownRoom once the service has
    answered, a BootstrapError while it never has. The first failure of a route is warned
    of and quiets it for ``warn_every``; the ones within pass silently."""
    routes: DpRoutes[Rec] = DpRoutes(DEADLINES)
    a, b, c, d = Rec(1), Rec(2), Rec(3), Rec(4)
    _waiting(routes, a, b, c, d)
    route = routes.routes[URL]
    route.last_error = "ConnectError: refused"
    due = routes.handle_timer(RouteTimer(route, a))
    text = f"prefill instance {URL}: no answer within 30 s (ConnectError: refused)"
    assert due[:2] == [Count("timeouts"), Warn(text)]
    assert due[2] == Arm("dp_warn", 1.0, QuietTimer(route))
    assert isinstance(due[3], Unroutable) and due[3].rec is a
    assert type(due[3].error) is BootstrapError and str(due[3].error) == text
    routes.answered(route, [b], 2, [None])
    due = routes.handle_timer(RouteTimer(route, b))  # (quiet: no warning)
    assert due[0] == Count("timeouts") and len(due) == 2
    assert isinstance(due[1], Unroutable) and isinstance(due[1].error, UnknownRoom)
    assert routes.handle_timer(QuietTimer(route)) == []
    assert Warn in [type(e) for e in routes.handle_timer(RouteTimer(route, c))]
    # a room aborted meanwhile leaves silently; a room gone leaves nothing to do
    d.machine.fail(TransferAborted("aborted"))
    assert routes.handle_timer(RouteTimer(route, d)) == [] and route.pending == {}
    assert routes.handle_timer(RouteTimer(route, a)) == []


def test_a_room_s_deadline_is_disarmed_exactly_when_its_wait_ends() -> None:
    """A deadline armed at a room's first ask holds the room's record: it is disarmed as the
    room leaves its route before it, however it leaves (routed by an answer or by the
    topology, failed by a refusal or by an instance that did not resolve), and only then; a
    room never asked for armed none and disarms none; the deadline that runs disarms
    nothing (it ran); an expiry after the Disarm (were the shell to run one) changes
    nothing."""
    routes: DpRoutes[Rec] = DpRoutes(DEADLINES)
    a, b, c = Rec(1), Rec(2), Rec(3)
    _waiting(routes, a, b, c)
    route = routes.routes[URL]
    routes.resolved(URL, 2)
    routes.asking(route, [a, b])  # (c: not asked yet, no deadline)
    # an answer: only the room it routes leaves, its Disarm just before its Routed
    assert routes.answered(route, [a, b], 2, [1, None]) == (
        True, [Disarm(RouteTimer(route, a)), Routed(a, URL, 1)])
    assert routes.handle_timer(RouteTimer(route, a)) == [] and list(route.pending) == [b, c]
    # a refusal: every waiting room leaves; the asked one disarms, the other has nothing to
    error = BootstrapError("401 bad token")
    due = routes.refused(route, error)
    assert [type(e) for e in due] == [Warn, Disarm, Unroutable, Unroutable]
    assert due[1] == Disarm(RouteTimer(route, b))
    assert [e.rec for e in due[2:]] == [b, c]  # type: ignore[union-attr]
    assert routes.handle_timer(RouteTimer(route, b)) == []
    # learnt again from the topology (a prefill rank was lost), with asked rooms waiting
    d, e, f = Rec(4), Rec(5), Rec(6)
    _waiting(routes, d, e)
    routes.asking(route, [d])
    routes.forget_sizes()
    assert routes.resolved(URL, 1) == [
        Disarm(RouteTimer(route, d)), Routed(d, URL, 0), Routed(e, URL, 0), Wake(URL)]
    _waiting(routes, f)
    routes.forget_sizes()
    route.dp_size = 2
    routes.asking(route, [f])
    route.dp_size = None
    failure = BootstrapError("no answer")
    assert routes.resolve_failed(URL, failure) == [
        Disarm(RouteTimer(route, f)), Unroutable(f, failure), Wake(URL)]
    # its own deadline: the room fails, and nothing is disarmed (that deadline just ran)
    g = Rec(7)
    _waiting(routes, g)
    routes.resolved(URL, 2)
    routes.asking(route, [g])
    due = routes.handle_timer(RouteTimer(route, g))
    assert isinstance(due[-1], Unroutable) and not [x for x in due if isinstance(x, Disarm)]


def _carry(armed: set[Hashable], due: Sequence[object]) -> None:
    """The shell's bookkeeping of deadlines, modelled: an Arm enters its key, a Disarm takes
    one that is armed."""
    for effect in due:
        if isinstance(effect, Arm):
            assert effect.key not in armed
            armed.add(effect.key)
        elif isinstance(effect, Disarm):
            armed.remove(effect.key)  # (KeyError: never armed, or disarmed twice)


def _order(key: Hashable) -> int:
    """A deadline's place in a seeded run's choice: its room's id (-1: a quiet time)."""
    return key.rec.room if isinstance(key, RouteTimer) else -1


def test_every_armed_deadline_is_armed_exactly_while_its_room_waits_asked() -> None:
    """Random runs (seeded) of every call, with the shell's bookkeeping modelled: each Arm
    enters a key, each Disarm takes one that is armed, each expiry takes its own. After every
    step the room deadlines armed are exactly those of the rooms waiting that an ask
    included: none outlives its room's wait, and none is disarmed twice or after it ran."""
    for seed in range(200):
        rnd = random.Random(seed)
        routes: DpRoutes[Rec] = DpRoutes(DEADLINES)
        armed: set[Hashable] = set()
        carry = partial(_carry, armed)
        recs: list[Rec] = []
        for _ in range(40):
            op = rnd.randrange(8)
            route = routes.routes.get(URL)
            if op == 0 or route is None:
                recs.append(Rec(len(recs)))
                carry(routes.add(recs[-1], URL))
            elif op == 1:
                carry(routes.asking(route, list(route.pending))[1])
            elif op == 2 and route.pending:
                batch = rnd.sample(list(route.pending), rnd.randint(1, len(route.pending)))
                ranks = [rnd.choice([None, 0, 1]) for _ in batch]
                carry(routes.answered(route, batch, 2, ranks)[1])
            elif op == 3:
                carry(routes.refused(route, BootstrapError("refused")))
            elif op == 4:
                routes.forget_sizes()
            elif op == 5:
                carry(routes.resolved(URL, rnd.choice([1, 2])))
            elif op == 6:
                carry(routes.resolve_failed(URL, BootstrapError("did not resolve")))
            elif armed:  # an expiry: the shell lets its handle go, then hands the key back
                key = rnd.choice(sorted(armed, key=_order))
                armed.remove(key)
                carry(routes.handle_timer(key))
            # a stale expiry (already disarmed or run) is ignored
            route = routes.routes[URL]
            for rec in recs:
                stale = RouteTimer(route, rec)
                if stale not in armed and rec not in route.pending:
                    assert routes.handle_timer(stale) == []
            waiting = {RouteTimer(r, rec) for r in routes.routes.values()
                       for rec, asked in r.pending.items() if asked}
            assert {k for k in armed if isinstance(k, RouteTimer)} == waiting, seed


def test_routes_are_bounded_and_only_idle_ones_go() -> None:
    routes: DpRoutes[Rec] = DpRoutes(DEADLINES, max_routes=2)
    routes.add(Rec(1), "http://busy:1")  # (a room waits: never dropped)
    routes.target("http://idle:1", 1, ready=False)
    routes.resolved("http://idle:1", 1)
    assert routes.target("http://new:1", 2, ready=False) == (
        2, [DropRoute("http://idle:1", forget_instance=False)])
    routes.stopped_asking(routes.routes["http://new:1"])
    assert routes.target("http://newer:1", 0, ready=False) == (
        0, [DropRoute("http://new:1", forget_instance=True)])
    route = routes.routes["http://newer:1"]
    route.asking = True  # (a task asks for it: kept, and so is every other busy one)
    assert routes.target("http://last:1", 0, ready=False) == (0, [])
    assert set(routes.routes) == {"http://busy:1", "http://newer:1", "http://last:1"}


def test_the_pause_between_asks_doubles_while_nothing_is_learnt() -> None:
    d = RouteDeadlines(ask_min=0.005, ask_max=0.1)
    pauses = [d.ask_min]
    for _ in range(6):
        pauses.append(d.next_pause(pauses[-1], learnt=False))
    assert pauses == [0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.1]
    assert d.next_pause(0.1, learnt=True) == 0.005

