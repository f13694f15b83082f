"""DP-attention routing on the decode side: which prefill DP rank holds a room.

A bootstrap service may serve several DP ranks of one prefill instance, each its own TP group
(docs/topologies.md, "DP-attention routing"). A room goes to the prefill ranks of the DP rank
that holds it: the one ``receiver(dp_rank=)`` names; DP rank 0 when the service has one DP
rank (learnt from the topology of the URL itself, which is resolved first); otherwise the one
the service says (``POST /query_dp_ranks``), asked in batches per service and again at
growing intervals until ``bootstrap_timeout`` after the first ask that included the room,
when it fails with :class:`~trio_pd.UnknownRoom` (or, if the service never answered, with a
:class:`~trio_pd.BootstrapError`, as an instance that does not resolve). A DP rank is then
resolved like any prefill instance, at ``url?dp_rank=K``.

:class:`DpRouter` is the part of the decode agent that does this; the agent consults it as
it consults :class:`~trio_pd.agents._sources.Sources`. It decides nothing about a room's
fate: a room it cannot route is handed back to the agent (``on_failed``), a routed one too
(``on_routed``).

Every decision of it is :class:`~trio_pd.core._dp_routes.DpRoutes`'s (pure): which rooms
wait where, when each is asked for, what an answer means, each room's deadline (armed at its
first ask, disarmed when its wait ends) and the pause between two warnings of one.
:class:`DpRouter` is its shell: the asks over HTTP, the one task per service that makes them,
the instances resolved, the effects carried out (a deadline's handle kept from its ``Arm`` to
its ``Disarm`` or its expiry, whichever comes first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, assert_never

import trio

from ..bootstrap._bootstrap_client import (
    MAX_DP_BATCH,
    UNKNOWN_DP_RANK,
    BootstrapClient,
    DpRoom,
    dp_url,
)
from ..core._dp_routes import (
    Disarm,
    DpRoutes,
    DropRoute,
    R,  # (a room the routes hold; they read its machine)
    Resolve,
    Route,
    Routed,
    RouteDeadlines,
    RouteDue,
    StartAsking,
    Unroutable,
    Wake,
)
from ..core._errors import (
    BootstrapError,
    BootstrapUnreachable,
    NotReady,
    TransferError,
)
from ..core._rooms import Arm, Count, Warn
from ..core._stats import Counters
from ..io._timers import Timer, Timers
from ._sources import Instance, Sources

log = logging.getLogger("trio_pd.decode")

#: how many bootstrap URLs the router keeps state for
_MAX_ROUTES = 4096


def dp_instance(base: str, dp_rank: int) -> str:
    """The URL DP rank ``dp_rank`` of the service at ``base`` is resolved at (``base`` itself
    for DP rank 0, as a room without DP attention)."""
    return base if dp_rank == 0 else dp_url(base, dp_rank)


@dataclass(eq=False, slots=True)
class _Asker:
    """The I/O of one bootstrap URL's route: the client that asks, and the event that wakes
    the task asking."""

    client: BootstrapClient | None = None
    #: set when a room joins, or the DP size may be known: ask again sooner
    wake: trio.Event = field(default_factory=trio.Event)


class DpRouter(Generic[R]):
    """The decode agent's DP routing: the shell of :class:`DpRoutes` (which decides), with
    one asking task and client per bootstrap URL.

    ``on_routed(room, instance_url, dp_rank)``: the room's DP rank is known. ``on_failed(room,
    error)``: it cannot be routed (the service refused, or its deadline passed)."""

    def __init__(
        self,
        *,
        sources: Sources,
        timers: Timers,
        counters: Counters,
        bootstrap_timeout: float,
        token: str | None,
        on_routed: Callable[[R, str, int], None],
        on_failed: Callable[[R, TransferError], None],
    ) -> None:
        self.sources, self.timers, self.counters = sources, timers, counters
        self.token = token
        self._on_routed, self._on_failed = on_routed, on_failed
        self.routes: DpRoutes[R] = DpRoutes(
            RouteDeadlines(bootstrap=bootstrap_timeout), max_routes=_MAX_ROUTES
        )
        self._askers: dict[str, _Asker] = {}
        self._deadline_passed = self._timer_due  # (one bound method for every deadline)
        #: the deadlines the routes armed and have not yet disarmed, each until it runs or
        #: a :class:`Disarm` cancels it (a room's holds its record: it goes when its wait
        #: ends, not when its deadline would have passed)
        self._armed: dict[Hashable, Timer] = {}

    def target(self, base: str, dp_rank: int | None) -> str | None:
        """The instance URL a new room of the service at ``base`` goes to: the DP rank it
        names, DP rank 0 when the service has one DP rank, else None (ask: :meth:`route`)."""
        inst = self.sources.instances.get(base)
        rank, due = self.routes.target(base, dp_rank, inst is not None and inst.ready)
        self._carry(due)
        return None if rank is None else dp_instance(base, rank)

    def route(self, rec: R, base: str) -> None:
        """Find the DP rank that holds ``rec`` (:meth:`DpRoutes.add`): the instance's
        topology first, then the service, asked in batches per service, for at most
        ``bootstrap_timeout`` from the first ask that includes the room."""
        self._carry(self.routes.add(rec, base))
        self._carry(self.routes.ask(base))

    def resolved(self, inst: Instance) -> None:
        """The instance at a route's URL resolved: its topology says the DP size."""
        self._carry(self.routes.resolved(inst.url, inst.dp_size))

    def resolve_failed(self, inst: Instance, error: TransferError) -> None:
        """The instance at a route's URL did not resolve: rooms that waited for it to say
        the DP size fail with its reason."""
        self._carry(self.routes.resolve_failed(inst.url, error))

    def forget_sizes(self) -> None:
        """A prefill rank was lost: a restarted instance may have another DP size."""
        self.routes.forget_sizes()

    async def aclose(self) -> None:
        """The agent is closing (its tasks have ended): close the services' clients.

        **Cancellation:** every client's connections are closed even if cancelled (each
        client closes its own before its first schedule point, and a cancellation of one
        does not skip the next), then ``Cancelled`` propagates."""
        clients = [a.client for a in self._askers.values() if a.client is not None]
        await _close_all(clients)

    # ---------------------------------------------------------------- internals

    def _carry(self, due: RouteDue[R]) -> None:
        """Carry out what the routes made due. Synchronous: it never waits."""
        for effect in due:
            match effect:
                case Routed(rec=rec, url=url, dp_rank=dp_rank):
                    self._on_routed(rec, url, dp_rank)
                case Unroutable(rec=rec, error=error):
                    self._on_failed(rec, error)
                case Resolve(url=url):
                    inst = self.sources.instance(url)
                    if inst.ready:
                        self.resolved(inst)
                case Wake(url=url):
                    self._asker(url).wake.set()
                case StartAsking(route=route):
                    assert self.sources.nursery is not None, "the decode agent is closed"
                    self.sources.nursery.start_soon(self._ask_loop, route)
                case DropRoute(url=url, forget_instance=forget):
                    if forget:
                        self.sources.instances.pop(url, None)
                    asker = self._askers.pop(url, None)
                    nursery = self.sources.nursery
                    if asker is not None and asker.client is not None and nursery is not None:
                        nursery.start_soon(asker.client.aclose)
                case Arm(after=after, key=key):
                    assert key not in self._armed, key  # (one deadline a key, at a time)
                    self._armed[key] = self.timers.after(after, self._deadline_passed, key)
                case Disarm(key=key):
                    self.timers.cancel(self._armed.pop(key))
                case Count(name=name):
                    self.counters.bump(name)
                case Warn(message=message):
                    log.warning("%s", message)
                case _:
                    assert_never(effect)

    def _timer_due(self, key: Hashable) -> None:
        """A deadline the routes armed has passed (its handle goes: it ran): they decide
        what that means."""
        del self._armed[key]
        self._carry(self.routes.handle_timer(key))

    def _asker(self, url: str) -> _Asker:
        asker = self._askers.get(url)
        if asker is None:
            asker = self._askers[url] = _Asker()
        return asker

    async def _ask_loop(self, route: Route[R]) -> None:
        """Ask until no room of ``route`` is waiting, pausing as :class:`RouteDeadlines`
        says (sooner when a room joins). Bounded: every waiting room leaves at its deadline.

        **Cancellation:** safe at any point (the agent is closing).
        """
        deadlines = self.routes.deadlines
        pause = deadlines.ask_min
        asker = self._asker(route.url)
        try:
            await trio.lowlevel.checkpoint()
            if asker.client is None:
                asker.client = BootstrapClient(
                    route.url, token=self.token, verify=self.sources.verify
                )
            while self.routes.awaiting_size(route) and not self._resolving_ended(route):
                asker.wake = trio.Event()
                await asker.wake.wait()
            while route.pending:
                asker.wake = trio.Event()
                learnt = await self._ask(route, asker.client)
                if not route.pending:
                    break
                pause = deadlines.next_pause(pause, learnt)
                with trio.move_on_after(pause):
                    await asker.wake.wait()
                await trio.sleep(deadlines.ask_min)
        finally:
            self.routes.stopped_asking(route)

    def _resolving_ended(self, route: Route[R]) -> bool:
        """Whether the instance at ``route``'s URL (DP rank 0's group) resolved or failed."""
        inst = self.sources.instances.get(route.url)
        return inst is None or inst.ready or inst.failed

    async def _ask(self, route: Route[R], client: BootstrapClient) -> bool:
        """One round: ask for every waiting room (:data:`MAX_DP_BATCH` a request), and hand
        each answer to the routes. True if any room left."""
        await trio.lowlevel.checkpoint()
        learnt = False
        waiting = list(route.pending)
        for start in range(0, len(waiting), MAX_DP_BATCH):
            batch, due = self.routes.asking(route, waiting[start:start + MAX_DP_BATCH])
            self._carry(due)
            if not batch:
                continue
            rooms = [DpRoom(r.machine.room, r.machine.epoch) for r in batch]
            try:
                with trio.fail_after(self.routes.deadlines.ask_timeout):
                    answer = await client.query_dp_ranks(rooms)
            except (NotReady, BootstrapUnreachable, trio.TooSlowError) as exc:
                self.routes.no_answer(route, f"{type(exc).__name__}: {exc}")
                return learnt  # (the service may not be up yet: ask again later)
            except BootstrapError as exc:  # a definite refusal (401, 400...): fail them now
                self._carry(self.routes.refused(route, exc))
                return True
            ranks = [None if k == UNKNOWN_DP_RANK else k for k in answer.dp_ranks]
            got, due = self.routes.answered(route, batch, answer.dp_size, ranks)
            self._carry(due)
            learnt = learnt or got
        return learnt


async def _close_all(clients: list[BootstrapClient]) -> None:
    """``aclose`` every client in turn. One that raises (a cancellation: each client closes
    its connections before its first schedule point) skips no other; the first error
    propagates after the last one. A loop, not a chain of ``finally``: thousands of routes
    would outrun the interpreter's recursion limit."""
    first: BaseException | None = None
    for client in clients:
        try:
            await client.aclose()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first
    await trio.lowlevel.checkpoint()  # (a schedule point with no client too)
