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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Generic, Protocol, TypeVar

import trio

from ..bootstrap._bootstrap_client import (
    MAX_DP_BATCH,
    UNKNOWN_DP_RANK,
    BootstrapClient,
    DpRoom,
    dp_url,
)
from ..core._errors import (
    BootstrapError,
    BootstrapUnreachable,
    NotReady,
    TransferError,
    UnknownRoom,
)
from ..core._rooms import DecodeRoom
from ..core._state import KVPoll
from ..core._stats import Counters
from ..io._timers import Timers
from ._sources import Instance, Sources

log = logging.getLogger("trio_pd.decode")

# How often a bootstrap service is asked again for rooms it does not know yet (from the first
# to the last, doubling while nothing new is learnt), the bound of one ask, and how many
# bootstrap URLs the router keeps state for.
_ASK_MIN = 0.005
_ASK_MAX = 0.1
_ASK_TIMEOUT = 5.0
_MAX_ROUTES = 4096


class Routed(Protocol):
    """What the router reads of a room: its machine (room id, epoch, status)."""

    @property
    def machine(self) -> DecodeRoom: ...


R = TypeVar("R", bound=Routed)


def dp_instance(base: str, dp_rank: int) -> str:
    """The URL DP rank ``dp_rank`` of the service at ``base`` is resolved at (``base`` itself
    for DP rank 0, as a room without DP attention)."""
    return base if dp_rank == 0 else dp_url(base, dp_rank)


@dataclass(eq=False, slots=True)
class _Route(Generic[R]):
    """The rooms of one bootstrap URL waiting to learn their DP rank, and what the service
    said of its DP size."""

    url: str
    #: the instance's DP size, once the service said (None: not known, or to learn again)
    dp_size: int | None = None
    #: rooms still asking, oldest first, and whether an ask included them yet (their
    #: deadline runs from the first)
    pending: dict[R, bool] = field(default_factory=dict)
    #: a task is asking for them (:meth:`DpRouter._ask_loop`)
    running: bool = False
    #: set when a room joins ``pending``: ask again sooner
    wake: trio.Event = field(default_factory=trio.Event)
    client: BootstrapClient | None = None
    #: why the last ask routed nothing (for the error of a room whose deadline passes)
    last_error: str = "no answer yet"
    #: when a room's deadline was last logged (one warning a second per service)
    warned_at: float = -math.inf


class DpRouter(Generic[R]):
    """The decode agent's DP routing: per bootstrap URL, the rooms asking for their DP rank
    (bounded: :data:`_MAX_ROUTES` URLs) and the service's DP size once known.

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
        self.bootstrap_timeout, self.token = bootstrap_timeout, token
        self._on_routed, self._on_failed = on_routed, on_failed
        self._routes: dict[str, _Route[R]] = {}

    def target(self, base: str, dp_rank: int | None) -> str | None:
        """The instance URL a new room of the service at ``base`` goes to: the DP rank it
        names, DP rank 0 when the service has one DP rank, else None (ask: :meth:`route`)."""
        route = self._routes.get(base)
        if dp_rank is not None:
            self._route_for(base)  # rooms that name no DP rank will ask (mixed routing)
            return dp_instance(base, dp_rank)
        if route is None:
            inst = self.sources.instances.get(base)
            if inst is not None and inst.ready:
                return base  # resolved outside DP routing (set up by hand): as before
            return None
        return base if route.dp_size == 1 else None

    def route(self, rec: R, base: str) -> None:
        """Find the DP rank that holds ``rec``. While the DP size of the service at ``base``
        is not known, its DP rank 0 (the whole instance, with one DP rank) is resolved first:
        its topology says the DP size, and with one DP rank the room goes there unasked.
        Otherwise the service is asked (batched per service), for at most
        ``bootstrap_timeout`` from the first ask that includes the room."""
        route = self._route_for(base)
        route.pending[rec] = False
        if route.dp_size is None:
            inst = self.sources.instance(base)
            if inst.ready:
                self.resolved(inst)
                if rec not in route.pending:
                    return
        route.wake.set()
        if not route.running:
            assert self.sources.nursery is not None, "the decode agent is closed"
            route.running = True
            self.sources.nursery.start_soon(self._ask_loop, route)

    def resolved(self, inst: Instance) -> None:
        """The instance at a route's URL resolved: its topology says the DP size; with one
        DP rank, every room asking goes to it, unasked."""
        route = self._routes.get(inst.url)
        if route is None:
            return
        if route.dp_size is None and inst.dp_size is not None:
            route.dp_size = inst.dp_size
            if inst.dp_size == 1:
                for rec in list(route.pending):
                    del route.pending[rec]
                    self._on_routed(rec, route.url, 0)
        route.wake.set()

    def resolve_failed(self, inst: Instance, error: TransferError) -> None:
        """The instance at a route's URL did not resolve. Rooms that waited for it to say the
        DP size, and have not asked yet, fail now with its reason (the service did not answer
        or cannot pair within the deadline), instead of asking for a deadline of their own
        (which made a dead URL take twice ``bootstrap_timeout``)."""
        route = self._routes.get(inst.url)
        if route is None:
            return
        if route.dp_size is None:
            for rec in list(route.pending):
                del route.pending[rec]
                self._on_failed(rec, error)
        route.wake.set()

    def forget_sizes(self) -> None:
        """A prefill rank was lost: a restarted instance may have another DP size."""
        for route in self._routes.values():
            route.dp_size = None

    async def aclose(self) -> None:
        """The agent is closing (its tasks have ended): close the services' clients."""
        await trio.lowlevel.checkpoint()
        for route in self._routes.values():
            if route.client is not None:
                await route.client.aclose()

    # ---------------------------------------------------------------- internals

    def _route_for(self, base: str) -> _Route[R]:
        route = self._routes.get(base)
        if route is None:
            if len(self._routes) >= _MAX_ROUTES:
                self._evict()
            route = self._routes[base] = _Route(base)
        return route

    def _evict(self) -> None:
        """Drop the oldest idle route (none idle: keep them all; each holds waiting rooms)."""
        for url, route in self._routes.items():
            if route.pending or route.running:
                continue
            del self._routes[url]
            if route.dp_size != 1:
                # its DP rank 0 must not be taken for the whole instance by a later room
                self.sources.instances.pop(url, None)
            if route.client is not None and self.sources.nursery is not None:
                self.sources.nursery.start_soon(route.client.aclose)
            return

    async def _ask_loop(self, route: _Route[R]) -> None:
        """Ask until no room of ``route`` is waiting: at once, then again after 5 ms,
        doubling up to 100 ms while nothing new is learnt (sooner when a room joins).
        Bounded: every waiting room leaves at its deadline (:meth:`_due`).

        **Cancellation:** safe at any point (the agent is closing).
        """
        delay = _ASK_MIN
        try:
            await trio.lowlevel.checkpoint()
            if route.client is None:
                route.client = BootstrapClient(
                    route.url, token=self.token, verify=self.sources.verify
                )
            while route.pending and route.dp_size is None and not self._resolving_ended(route):
                # first learn the DP size from the topology being resolved: with one DP
                # rank (the common case) no room is ever asked for
                route.wake = trio.Event()
                await route.wake.wait()
            while route.pending:
                route.wake = trio.Event()
                learnt = await self._ask(route, route.client)
                if not route.pending:
                    break
                delay = _ASK_MIN if learnt else min(2 * delay, _ASK_MAX)
                with trio.move_on_after(delay):
                    await route.wake.wait()
                await trio.sleep(_ASK_MIN)
        finally:
            route.running = False

    def _resolving_ended(self, route: _Route[R]) -> bool:
        """Whether the instance at ``route``'s URL (DP rank 0's group) resolved or failed."""
        inst = self.sources.instances.get(route.url)
        return inst is None or inst.ready or inst.failed

    async def _ask(self, route: _Route[R], client: BootstrapClient) -> bool:
        """One round: ask for every waiting room (:data:`MAX_DP_BATCH` a request) and route
        those the service knows. True if any room left ``pending``."""
        await trio.lowlevel.checkpoint()
        learnt = False
        waiting = list(route.pending)
        for start in range(0, len(waiting), MAX_DP_BATCH):
            batch = [r for r in waiting[start:start + MAX_DP_BATCH] if r in route.pending]
            if not batch:
                continue
            for rec in batch:
                if not route.pending[rec]:  # its first ask: its deadline starts
                    route.pending[rec] = True
                    self.timers.after(self.bootstrap_timeout, partial(self._due, route, rec))
            rooms = [DpRoom(r.machine.room, r.machine.epoch) for r in batch]
            try:
                with trio.fail_after(_ASK_TIMEOUT):
                    answer = await client.query_dp_ranks(rooms)
            except (NotReady, BootstrapUnreachable, trio.TooSlowError) as exc:
                route.last_error = f"{type(exc).__name__}: {exc}"
                return learnt  # (the service may not be up yet: ask again later)
            except BootstrapError as exc:  # a definite refusal (401, 400...): fail them now
                error = BootstrapError(f"prefill instance {route.url}: {exc}")
                log.warning("%s", error)
                for rec in list(route.pending):
                    del route.pending[rec]
                    self._on_failed(rec, error)
                return True
            route.dp_size = answer.dp_size
            for rec, k in zip(batch, answer.dp_ranks, strict=True):
                if k == UNKNOWN_DP_RANK or rec not in route.pending:
                    continue
                del route.pending[rec]
                self._on_routed(rec, route.url, k)
                learnt = True
            if UNKNOWN_DP_RANK in answer.dp_ranks:
                route.last_error = (
                    f"DP size {answer.dp_size}; no prefill DP rank announced the room"
                )
        return learnt

    def _due(self, route: _Route[R], rec: R) -> None:
        """``bootstrap_timeout`` after the first ask for the room: if it still waits, it
        fails (counted ``timeouts``; nobody was told of it) with :class:`UnknownRoom`, or,
        if the service never answered, with a :class:`BootstrapError` as an instance that
        does not resolve."""
        if rec not in route.pending:
            return
        del route.pending[rec]
        if rec.machine.status is KVPoll.Failed:
            return  # failed meanwhile (aborted): there is nobody to tell
        self.counters.bump("timeouts")
        timeout = self.bootstrap_timeout
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
        now = trio.current_time()
        if now - route.warned_at >= 1.0:
            route.warned_at = now
            log.warning("%s", error)
        self._on_failed(rec, error)
