"""The bootstrap client: what prefill and decode ranks use to reach a bootstrap service, and
the records it carries (SPEC §2, §6; the records themselves are ``_bootstrap_records``,
pure, and importable from here too).

The service itself (routes, validation, the HTTP server) is in ``_bootstrap``; the agents
import only this module, so a rank never imports the HTTP server. Every failure is a
:class:`~trio_pd.BootstrapError`: :class:`~trio_pd.core._errors.NotReady` for 503,
:class:`~trio_pd.core._errors.UnknownRank` for a rank that does not exist,
:class:`~trio_pd.core._errors.BootstrapUnreachable` when the connection fails.

DP attention (docs/topologies.md, "DP-attention routing"): one bootstrap service may serve
several DP ranks of a prefill instance, each a TP group of its own. A URL with
``?dp_rank=K`` (:func:`dp_url`) names DP rank K's group: a client made with it reads that
group's topology. :class:`DpAnnouncer` tells the service which DP rank holds each room a
prefill DP rank creates; :meth:`BootstrapClient.query_dp_ranks` asks it.
"""

from __future__ import annotations

import logging
import math
import ssl
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from types import TracebackType
from typing import TypeVar

import httpx
import msgspec
import trio

from ..core._errors import (
    BootstrapError,
    BootstrapUnreachable,
    NotReady,
)
from ..io._security import (
    default_token,
)
from ._bootstrap_records import MAX_DP_BATCH as MAX_DP_BATCH
from ._bootstrap_records import MAX_DP_SIZE as MAX_DP_SIZE
from ._bootstrap_records import MAX_LAYERS as MAX_LAYERS
from ._bootstrap_records import MAX_PP_SIZE as MAX_PP_SIZE
from ._bootstrap_records import UNKNOWN_DP_RANK as UNKNOWN_DP_RANK
from ._bootstrap_records import DpRanks as DpRanks
from ._bootstrap_records import DpRoom as DpRoom
from ._bootstrap_records import PrefillRankInfo as PrefillRankInfo
from ._bootstrap_records import Topology as Topology
from ._bootstrap_records import check_dp as check_dp
from ._bootstrap_records import check_pp as check_pp
from ._bootstrap_records import dp_url as dp_url
from ._bootstrap_records import split_dp_url as split_dp_url
from ._bootstrap_transport import TokenProof as TokenProof
from ._bootstrap_transport import Transport
from ._bootstrap_transport import transport_reason as transport_reason

__all__ = [
    "BootstrapClient",
    "DpAnnouncer",
    "DpRanks",
    "DpRoom",
    "PrefillRankInfo",
    "Topology",
    "check_dp",
    "check_pp",
    "dp_url",
    "split_dp_url",
]

logger = logging.getLogger("trio_pd.bootstrap")

_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------
# The client


class BootstrapClient:
    """Talks to one bootstrap service at ``url`` (``"http://10.0.0.5:8998"``, or
    ``https://`` for a service given a certificate).

    ``token`` is the cluster token, proven (never sent) with every request that needs it,
    and every answer to one is checked under it (docs/security.md); left out, it is
    ``TRIO_PD_TOKEN``, or this process's own (what a service of this process made without a
    token requires), or none with ``TRIO_PD_SECURE=0``; ``""`` is none. ``verify``
    is httpx's: True (the system's CA bundle), False, an :class:`ssl.SSLContext`, or the
    path of a CA bundle to trust (for a self-signed service).

    Use it as an async context manager, or call :meth:`aclose`. No call has a timeout of its
    own: compose ``trio.fail_after`` / ``trio.move_on_after`` around it. Proxy settings from
    the environment are ignored (the service is on the serving network, not behind a proxy).
    Every failure is a :class:`BootstrapError`: :class:`NotReady` for 503,
    :class:`UnknownRank` for a rank that does not exist, :class:`BootstrapUnreachable` when
    the connection fails.

    A URL made by :func:`dp_url` (``...?dp_rank=K``) names DP rank K of a prefill instance
    with DP attention: :meth:`topology` and :meth:`rank` then read that DP rank's TP group
    (:attr:`dp_rank`; None for a plain URL, which reads DP rank 0's).
    """

    def __init__(
        self, url: str, *, token: str | None = None, verify: ssl.SSLContext | str | bool = True
    ) -> None:
        url, dp_rank = split_dp_url(url)
        #: the DP rank the URL names (None: the plain URL, DP rank 0)
        self.dp_rank: int | None = dp_rank
        self.url = url.rstrip("/")
        #: the cluster token, proven (never sent) with every request that needs it, and the
        #: key every answer to one is checked under
        self.token = (default_token() if token is None else token) or None
        #: why the last :meth:`wait_ready` retried (None: it has not had to)
        self.waiting: BootstrapError | None = None
        #: a decode rank's CURVE public key (z85), announced with every route read so that
        #: the service vouches for it to the prefill ranks (None: not announced)
        self.announce_key: str | None = None
        self._transport = Transport(self.url, self.token, verify)

    @property
    def server_address(self) -> str | None:
        """The IP address the last answer came from (None: none yet): where this host
        reached the service, whatever name the URL gives."""
        return self._transport.server_address

    def __repr__(self) -> str:
        return f"<BootstrapClient {self.url}>"

    async def __aenter__(self) -> BootstrapClient:
        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the pooled connections.

        **Cancellation:** the connections are closed even if cancelled (closing a socket
        does not wait), then ``Cancelled`` propagates.
        """
        await self._transport.http.aclose()

    async def register(self, info: PrefillRankInfo) -> None:
        """Register (or re-register) one prefill rank.

        Raises :class:`BootstrapError` if the service refuses it (400: invalid; 409:
        disagrees with the ranks already registered) or cannot be reached.

        **Cancellation:** safe to cancel; the registration may or may not have been stored
        (registering again is harmless, it replaces).
        """
        await self._transport.request(
            "PUT",
            "/route",
            content=msgspec.json.encode(info),
            headers={"content-type": "application/json"},
        )

    async def topology(self) -> Topology:
        """The complete topology of the prefill instance.

        Raises :class:`NotReady` while some rank has not registered, and
        :class:`BootstrapError` for any other failure (including a reply that is not a
        complete, ordered topology).

        **Cancellation:** safe to cancel; nothing changes on the service.
        """
        response = await self._transport.request("GET", "/route", params=self._dp_params())
        topology = self._transport.decode(response, Topology)
        tp_size, pp_size = topology.tp_size, topology.pp_size
        if not (tp_size >= 1 and pp_size >= 1 and len(topology.ranks) == tp_size * pp_size):
            # (checked before the rank list below is built: a tp_size of 10**9 would be
            # a list of 10**9 pairs; a tp_size of 0 an empty topology)
            raise BootstrapError(
                f"bootstrap service at {self.url} sent a topology of {len(topology.ranks)} "
                f"ranks for TP {tp_size} x PP {pp_size}"
            )
        expected = [(s, t) for s in range(pp_size) for t in range(tp_size)]
        dp_rank = self.dp_rank or 0
        if [(r.pp_rank, r.tp_rank) for r in topology.ranks] != expected or any(
            r.tp_size != tp_size or r.dp_rank != dp_rank or r.pp_size != pp_size
            for r in topology.ranks
        ) or topology.dp_rank != dp_rank:
            raise BootstrapError(f"bootstrap service at {self.url} sent an inconsistent topology")
        return topology

    async def rank(self, tp_rank: int, pp_rank: int = 0) -> PrefillRankInfo:
        """One prefill rank's information: TP rank ``tp_rank`` of PP stage ``pp_rank``.

        Raises :class:`NotReady` while some rank has not registered, :class:`UnknownRank`
        if the instance has no such rank, and :class:`BootstrapError` otherwise.

        **Cancellation:** safe to cancel; nothing changes on the service.
        """
        params = {"tp_rank": str(tp_rank), **self._dp_params()}
        if pp_rank:
            params["pp_rank"] = str(pp_rank)
        response = await self._transport.request("GET", "/route", params=params)
        info = self._transport.decode(response, PrefillRankInfo)
        if info.tp_rank != tp_rank or info.dp_rank != (self.dp_rank or 0) or (
            info.pp_rank != pp_rank
        ):
            raise BootstrapError(
                f"bootstrap service at {self.url} answered tp_rank {info.tp_rank} "
                f"for tp_rank {tp_rank}"
            )
        return info

    def _dp_params(self) -> dict[str, str]:
        params = {} if self.dp_rank is None else {"dp_rank": str(self.dp_rank)}
        if self.announce_key is not None:
            params["key"] = self.announce_key
        return params

    async def vouches(self, key: str) -> bool:
        """Does the service vouch for the CURVE public key ``key`` (z85): did a decode rank
        announce it with the token (:attr:`announce_key`)? A prefill rank admits such a
        key's control connections (docs/security.md).

        **Cancellation:** safe to cancel; nothing changes on the service.
        """
        response = await self._transport.request("GET", "/key", params={"key": key})
        answer = self._transport.decode(response, dict[str, bool])
        return answer.get("vouched") is True

    async def register_dp_rooms(self, dp_rank: int, rooms: Sequence[DpRoom]) -> None:
        """Tell the service that DP rank ``dp_rank`` holds ``rooms`` (at most
        :data:`MAX_DP_BATCH`; each with the epoch of its use when known). A later record of a
        room replaces an earlier one; records expire (the service's ``dp_room_ttl``).

        Raises :class:`NotReady` while no prefill rank registered (the service does not know
        the DP size yet), and :class:`BootstrapError` if it refuses the request (400: a DP
        rank outside the instance's; 401: no or the wrong token; 413: too many rooms).

        **Cancellation:** safe to cancel; the records may or may not have been stored
        (registering again is harmless).
        """
        body = {"dp_rank": dp_rank, "rooms": list(rooms)}
        await self._transport.request(
            "POST", "/register_dp_rank", content=msgspec.json.encode(body),
            headers={"content-type": "application/json"},
        )

    async def query_dp_ranks(self, rooms: Sequence[DpRoom]) -> DpRanks:
        """Which DP rank holds each of ``rooms`` (at most :data:`MAX_DP_BATCH`), and the
        instance's DP size. A room the service holds no record of (or only one of another
        epoch) reads :data:`UNKNOWN_DP_RANK`; with DP size 1 every room reads 0.

        Raises :class:`NotReady` while no prefill rank registered, and
        :class:`BootstrapError` otherwise (including an answer of the wrong length or with a
        DP rank outside the instance's).

        **Cancellation:** safe to cancel; nothing changes on the service.
        """
        body = {"rooms": list(rooms)}
        response = await self._transport.request(
            "POST", "/query_dp_ranks", content=msgspec.json.encode(body),
            headers={"content-type": "application/json"},
        )
        answer = self._transport.decode(response, DpRanks)
        if (
            not 1 <= answer.dp_size <= MAX_DP_SIZE
            or len(answer.dp_ranks) != len(rooms)
            or any(not UNKNOWN_DP_RANK <= k < answer.dp_size for k in answer.dp_ranks)
        ):
            raise BootstrapError(f"bootstrap service at {self.url} sent an inconsistent answer "
                                 "to /query_dp_ranks")
        return answer

    async def wait_topology(self) -> Topology:
        """The complete topology, waiting for it as long as the caller lets it
        (:meth:`wait_ready`).

        **Cancellation:** this only returns or fails on its own for a definite error; bound
        it with ``trio.fail_after``. Cancelling it is safe at any point.
        """
        return await self.wait_ready(self.topology)

    async def wait_register(self, info: PrefillRankInfo) -> None:
        """:meth:`register`, retried as long as the caller lets it while the service cannot
        be reached (:meth:`wait_ready`): a prefill rank may start before its bootstrap
        service.

        **Cancellation:** as :meth:`register`; bound it with ``trio.fail_after``.
        """
        await self.wait_ready(partial(self.register, info))

    async def wait_ready(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """``await call()`` until it succeeds: retried, with a backoff from 20 ms up to
        500 ms, while the service answers 503 or cannot be reached (it may not have started
        yet). Any other error (a refusal, a certificate the client does not trust) is raised
        at once.

        The first time the service cannot be reached it logs one warning saying why (at
        debug level for a 503: ranks still registering is normal); :attr:`waiting` keeps the
        last reason, for the error a caller whose deadline passes raises
        (:meth:`no_answer`).

        **Cancellation:** this only returns or fails on its own for a definite error; bound
        it with ``trio.fail_after``. Cancelling it is safe at any point.
        """
        self.waiting = None
        delay = 0.02
        while True:
            try:
                return await call()
            except (NotReady, BootstrapUnreachable) as exc:
                if self.waiting is None:
                    self._say_waiting(exc)
                self.waiting = exc
            await trio.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _say_waiting(self, exc: BootstrapError) -> None:
        left = trio.current_effective_deadline() - trio.current_time()
        until = f"for up to {left:.3g} s" if left < math.inf else "until cancelled"
        if isinstance(exc, NotReady):
            logger.debug("%s; retrying %s", exc, until)
        else:
            logger.warning("%s; retrying %s", exc, until)

    def no_answer(self, timeout: float, what: str = "") -> BootstrapError:
        """The error for a :meth:`wait_ready` that a ``timeout``-second deadline ended
        (``what`` in front of its text): what the service last said, or why it could not be
        reached (:class:`BootstrapUnreachable` then)."""
        last, head = self.waiting, f"{what}: " if what else ""
        if isinstance(last, NotReady):
            return BootstrapError(f"{head}not ready within {timeout:g} s ({last})")
        kind = BootstrapUnreachable if isinstance(last, BootstrapUnreachable) else BootstrapError
        return kind(f"{head}no answer within {timeout:g} s ({last or 'no request answered'})")

    async def health(self) -> bool:
        """Whether the service answers ``GET /health`` with 200.

        False for any other answer and when it cannot be reached; never raises
        :class:`BootstrapError`.

        **Cancellation:** safe to cancel.
        """
        try:
            response = await self._transport.http.get("/health")
        except httpx.TransportError:
            await trio.lowlevel.checkpoint()
            return False
        return response.status_code == 200


# --------------------------------------------------------------------------------------------
# DP attention: the prefill side's announcements


class DpAnnouncer:
    """Tells a bootstrap service, in batches, which DP rank holds each room a prefill DP rank
    creates (``POST /register_dp_rank``), so that decode ranks can route each room to that DP
    rank's TP group. The prefill agent makes one on TP rank 0 of each DP rank, when its DP
    size is over 1 (``open_prefill(dp_rank=, dp_size=)``), and :meth:`announce` is called for
    every room it creates.

    :meth:`announce` never blocks and never fails: it queues the room (at most
    ``max_pending``; past it the oldest is dropped, counted :attr:`dropped`), unless the same
    use of it (room and epoch) was announced and not yet :meth:`forget`-ten, among the last
    ``max_pending`` (an adapter may announce a request before the room exists, as SGLang's
    sender does). :meth:`run`, one
    task, posts what is queued, up to :data:`MAX_DP_BATCH` rooms a request, each request
    bounded by ``request_timeout``; a request that fails is retried with a backoff from 20 ms
    to 500 ms, and a room still not posted ``give_up_after`` seconds after it was queued is
    dropped (counted :attr:`dropped`): its decode rank fails it with :class:`UnknownRoom` at
    its own bootstrap deadline, as this side fails it at its own. Counters:
    :attr:`announced` (rooms stored by the service), :attr:`failed_posts`.
    """

    def __init__(
        self,
        client: BootstrapClient,
        dp_rank: int,
        *,
        give_up_after: float = 30.0,
        max_pending: int = 65_536,
        request_timeout: float = 5.0,
    ) -> None:
        self._client = client
        self.dp_rank = dp_rank
        self._give_up_after = give_up_after
        self._max_pending = max_pending
        self._request_timeout = request_timeout
        self._pending: deque[tuple[DpRoom, float]] = deque()
        #: the last ``max_pending`` uses announced: one is not queued twice
        self._recent: OrderedDict[tuple[int, int | None], None] = OrderedDict()
        self._wake = trio.Event()
        #: rooms the service stored
        self.announced = 0
        #: rooms given up: over ``max_pending``, or not posted within ``give_up_after``
        self.dropped = 0
        #: requests that failed (each is retried)
        self.failed_posts = 0

    @property
    def pending(self) -> int:
        """Rooms queued, not yet stored by the service."""
        return len(self._pending)

    def forget(self, room: int, epoch: int | None = None) -> None:
        """This use of ``room`` is over: a later use with the same id and epoch (a reused
        room id; SGLang's epochs are a function of the room) is announced again. Without
        it, such a use went unannounced and its decode ranks were routed to where the
        room was before, or failed it."""
        self._recent.pop((room, epoch), None)

    def announce(self, room: int, epoch: int | None = None) -> None:
        """Queue "DP rank ``dp_rank`` holds ``room``" (this use of it: ``epoch``, when
        known). Synchronous; never blocks."""
        key = (room, epoch)
        if key in self._recent:
            return
        self._recent[key] = None
        if len(self._recent) > self._max_pending:
            self._recent.popitem(last=False)
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append((DpRoom(room, epoch), trio.current_time()))
        self._wake.set()

    async def run(self) -> None:
        """Post what :meth:`announce` queues, until cancelled.

        **Cancellation:** the normal way to stop it; a batch being posted may or may not
        have been stored.
        """
        delay = 0.02
        warned = False
        while True:
            while not self._pending:
                await self._wake.wait()
                self._wake = trio.Event()
            now = trio.current_time()
            while self._pending and now - self._pending[0][1] > self._give_up_after:
                self._pending.popleft()
                self.dropped += 1
            batch = [self._pending.popleft() for _ in range(min(MAX_DP_BATCH, len(self._pending)))]
            if not batch:
                continue
            error: BaseException | None = None
            try:
                with trio.fail_after(self._request_timeout):
                    await self._client.register_dp_rooms(self.dp_rank, [r for r, _ in batch])
            except (BootstrapError, trio.TooSlowError) as exc:
                error = exc
            if error is None:
                self.announced += len(batch)
                delay, warned = 0.02, False
                continue
            self.failed_posts += 1
            (logger.debug if warned else logger.warning)(
                "bootstrap: could not tell %s that DP rank %d holds %d room(s), retrying: %s",
                self._client.url, self.dp_rank, len(batch), error,
            )
            warned = True
            # back at the front, in order; what no longer fits is the oldest: dropped
            room_left = self._max_pending - len(self._pending)
            keep = batch[len(batch) - room_left:] if room_left < len(batch) else batch
            self.dropped += len(batch) - len(keep)
            self._pending.extendleft(reversed(keep))
            await trio.sleep(delay)
            delay = min(delay * 2, 0.5)
