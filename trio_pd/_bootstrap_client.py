"""The bootstrap client: what prefill and decode ranks use to reach a bootstrap service, and
the two records it carries (SPEC §2, §6).

The service itself (routes, validation, the HTTP server) is in ``_bootstrap``; the agents
import only this module, so a rank never imports the HTTP server. Every failure is a
:class:`~trio_pd.BootstrapError`: :class:`~trio_pd._errors.NotReady` for 503,
:class:`~trio_pd._errors.UnknownRank` for a rank that does not exist,
:class:`~trio_pd._errors.BootstrapUnreachable` when the connection fails.

DP attention (docs/topologies.md, "DP-attention routing"): one bootstrap service may serve
several DP ranks of a prefill instance, each a TP group of its own. A URL with
``?dp_rank=K`` (:func:`dp_url`) names DP rank K's group: a client made with it reads that
group's topology. :class:`DpAnnouncer` tells the service which DP rank holds each room a
prefill DP rank creates; :meth:`BootstrapClient.query_dp_ranks` asks it.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import re
import socket
import ssl
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from http import HTTPStatus
from types import TracebackType
from typing import Annotated, Any, Final, TypeVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

import httpx
import msgspec
import trio

from ._errors import (
    BootstrapError,
    BootstrapUnreachable,
    ConfigurationError,
    NotReady,
    UnknownRank,
)
from ._memory import DTYPE_PATTERN, UNKNOWN_DTYPE
from ._security import (
    ANSWER_HEADER,
    AUTH_SCHEME,
    NONCE_HEADER,
    STALE_HEADER,
    answer_mac,
    default_token,
    request_mac,
)
from ._wire import MAX_STATES, StateWire

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

#: Largest DP size a registration may name (and ``tp_size * dp_size`` is at most
#: ``MAX_TP_SIZE`` of the service: one bootstrap service holds at most that many ranks).
MAX_DP_SIZE: Final = 1024
#: Largest PP size a registration may name (``tp_size * dp_size * pp_size`` is at most the
#: service's ``MAX_TP_SIZE`` too).
MAX_PP_SIZE: Final = 256
#: Bound of ``first_layer + num_layers`` in a registration (a model's layer count).
MAX_LAYERS: Final = 1 << 16
#: Most rooms one ``/register_dp_rank`` or ``/query_dp_ranks`` request may carry.
MAX_DP_BATCH: Final = 1024
#: What ``/query_dp_ranks`` answers for a room it holds no record of (or a record of another
#: use of the room id, under another epoch).
UNKNOWN_DP_RANK: Final = -1
_DP_QUERY: Final = re.compile(r"[0-9]{1,9}")


def check_dp(dp_rank: int, dp_size: int, what: str) -> None:
    """:class:`~trio_pd.ConfigurationError` unless ``0 <= dp_rank < dp_size <= MAX_DP_SIZE``
    (ints, not bools)."""
    for name, value in (("dp_rank", dp_rank), ("dp_size", dp_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigurationError(f"{what}: {name} must be an int, not {value!r}")
    if not 1 <= dp_size <= MAX_DP_SIZE:
        raise ConfigurationError(f"{what}: dp_size {dp_size} outside [1, {MAX_DP_SIZE}]")
    if not 0 <= dp_rank < dp_size:
        raise ConfigurationError(f"{what}: dp_rank {dp_rank} outside [0, dp_size={dp_size})")


def check_pp(pp_rank: int, pp_size: int, first_layer: int, num_layers: int, what: str) -> None:
    """:class:`~trio_pd.ConfigurationError` unless ``0 <= pp_rank < pp_size <=
    MAX_PP_SIZE``, ``first_layer >= 0`` (0 for stage 0), ``num_layers >= 1`` and
    ``first_layer + num_layers <= MAX_LAYERS`` (ints, not bools)."""
    for name, value in (("pp_rank", pp_rank), ("pp_size", pp_size),
                        ("first_layer", first_layer)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigurationError(f"{what}: {name} must be an int, not {value!r}")
    if not 1 <= pp_size <= MAX_PP_SIZE:
        raise ConfigurationError(f"{what}: pp_size {pp_size} outside [1, {MAX_PP_SIZE}]")
    if not 0 <= pp_rank < pp_size:
        raise ConfigurationError(f"{what}: pp_rank {pp_rank} outside [0, pp_size={pp_size})")
    if first_layer < 0 or (pp_rank == 0 and first_layer != 0):
        raise ConfigurationError(
            f"{what}: first_layer {first_layer}: PP stage 0 starts at layer 0, and no stage "
            "starts below it"
        )
    if num_layers < 1 or first_layer + num_layers > MAX_LAYERS:
        raise ConfigurationError(
            f"{what}: layers {first_layer}..{first_layer + num_layers - 1} (the pool's "
            f"{num_layers}) must be at least one and end below {MAX_LAYERS}"
        )


def dp_url(url: str, dp_rank: int) -> str:
    """The URL of DP rank ``dp_rank`` of the prefill instance whose bootstrap service is at
    ``url``: ``url?dp_rank=K``, and ``url`` itself for DP rank 0 (the service's ``/route``
    without a ``dp_rank`` is DP rank 0's)."""
    base, _ = split_dp_url(url)
    return base if dp_rank == 0 else f"{base}?dp_rank={dp_rank}"


def split_dp_url(url: str) -> tuple[str, int | None]:
    """``(base URL, DP rank)`` of a URL made by :func:`dp_url` (the DP rank None when the URL
    names none). A URL whose query is anything but one ``dp_rank=K`` is returned as it is."""
    parts = urlsplit(url)
    if not parts.query:
        return url.rstrip("/"), None
    query = parse_qs(parts.query, keep_blank_values=True)
    values = query.get("dp_rank", [])
    if set(query) != {"dp_rank"} or len(values) != 1 or not _DP_QUERY.fullmatch(values[0]):
        return url.rstrip("/"), None
    base = urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")).rstrip("/")
    return base, int(values[0])


# --------------------------------------------------------------------------------------------
# Data


class PrefillRankInfo(msgspec.Struct, frozen=True):
    """What one prefill rank publishes about itself.

    ``endpoint`` is the rank's ZeroMQ control endpoint (``"tcp://10.0.0.5:5555"``);
    ``engine_session`` is how peers address its transfer engine. ``kv_heads`` is the model's
    total number of KV heads for MHA, and 1 for MLA.
    """

    tp_rank: Annotated[int, msgspec.Meta(ge=0)]
    tp_size: Annotated[int, msgspec.Meta(ge=1)]
    endpoint: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    engine: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    engine_session: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    layout: str
    kv_heads: Annotated[int, msgspec.Meta(ge=1)]
    page_size: Annotated[int, msgspec.Meta(ge=1)]
    #: a second control endpoint that takes only heartbeat pings, so a backlog of transfer
    #: messages on ``endpoint`` never delays them ("" = use ``endpoint``)
    heartbeat_endpoint: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    #: the rest of the pool's shape, so a decode rank can check that its pool pairs with this
    #: instance before it registers (0: not published, by an older prefill)
    head_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    num_layers: Annotated[int, msgspec.Meta(ge=0)] = 0
    aux_item_len: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: the rank's CURVE public key (z85) when authentication is on, "" when it is off: decode
    #: connects to ``endpoint`` and ``heartbeat_endpoint`` as a CURVE client of this key, and
    #: takes a STATUS, ABORT_ACK or PONG for this rank only from it (docs/security.md)
    control_key: Annotated[str, msgspec.Meta(max_length=40)] = ""
    #: DP attention: the DP rank whose TP group this rank belongs to, and how many DP ranks
    #: the instance has (every rank agrees on it). 0 and 1 without DP attention
    dp_rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    dp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    #: pipeline parallelism: the PP stage this rank's TP group is, how many stages the
    #: instance has (every rank agrees on it), and the model layer its pool's first layer is
    #: (it holds ``num_layers`` layers from there). 0, 1 and 0 without pipeline parallelism
    pp_rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    pp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    first_layer: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: per-buffer geometry and several aux buffers: the bytes per head of each of the rank's
    #: KV buffers, and the row bytes of each aux buffer, so that a decode rank can check them
    #: before it registers (empty: not published, by an older prefill)
    buffer_head_bytes: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=1)], ...], msgspec.Meta(max_length=4096)
    ] = ()
    aux_item_lens: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=1)], ...], msgspec.Meta(max_length=64)
    ] = ()
    #: the pool's state components, so that a decode rank can check that its own pair with
    #: them before it registers (empty: none, or an older prefill that does not say)
    states: Annotated[tuple[StateWire, ...], msgspec.Meta(max_length=MAX_STATES)] = ()
    #: what its KV bytes hold (:attr:`~trio_pd.PoolSpec.kv_dtype`; "unknown": it does not
    #: say, or an older prefill): a decode pool that names another fails to pair, and a
    #: decode rank sends its own in REGISTER only to a rank that published one
    kv_dtype: Annotated[str, msgspec.Meta(pattern=f"^{DTYPE_PATTERN}$")] = UNKNOWN_DTYPE

    @property
    def rank_id(self) -> int:
        """The rank's id in STATUS and ABORT_ACK: ``pp_rank * tp_size + tp_rank`` (its TP
        rank, without pipeline parallelism)."""
        return self.pp_rank * self.tp_size + self.tp_rank


#: the most bytes of one answer the client reads: a whole topology is at most a few MiB
#: (the service takes a rank's registration of at most 64 KiB), so 32 MiB leaves room for
#: 512 ranks of that size
MAX_ANSWER_BYTES: Final = 32 * 1024 * 1024


class Topology(msgspec.Struct, frozen=True):
    """Every rank of a prefill instance (of one of its DP ranks, with DP attention), stage
    by stage: ``ranks[s * tp_size + t]`` is TP rank ``t`` of PP stage ``s`` (``ranks[i].tp_rank
    == i`` without pipeline parallelism), all of DP rank ``dp_rank``."""

    tp_size: int
    ranks: list[PrefillRankInfo]
    dp_rank: int = 0
    dp_size: int = 1
    pp_size: int = 1

    def stage(self, pp_rank: int) -> list[PrefillRankInfo]:
        """The TP ranks of PP stage ``pp_rank``, in TP order."""
        return self.ranks[pp_rank * self.tp_size : (pp_rank + 1) * self.tp_size]


_RoomId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class DpRoom(msgspec.Struct, frozen=True, omit_defaults=True):
    """One room in a DP-rank registration or query: its id and, when the side that sends it
    knows it, the epoch of this use of the room id (None: any use)."""

    room: _RoomId
    epoch: _RoomId | None = None


class DpRanks(msgspec.Struct, frozen=True):
    """The answer to ``/query_dp_ranks``: the instance's DP size, and the DP rank holding each
    room asked about, in the order asked (:data:`UNKNOWN_DP_RANK` where the service holds no
    record of that use of the room)."""

    dp_size: int
    dp_ranks: list[int]


# --------------------------------------------------------------------------------------------
# The client


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception behind it (causes, contexts, members of groups), nearest
    first, each once."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return seen


def _untrusted(exc: BaseException) -> str | None:
    """What the certificate verification that failed under ``exc`` said, or None."""
    for e in _causes(exc):
        if isinstance(e, ssl.SSLCertVerificationError):
            return str(e.verify_message or e.reason or e)
    return None


def transport_reason(exc: BaseException) -> str:
    """Why a connection failed, in words, from the most telling exception behind ``exc``:
    httpx's own message says only "all attempts to connect ... failed" for a refused
    connection, and nothing at all for a failed TLS handshake."""
    causes = _causes(exc)
    for e in causes:
        if isinstance(e, ssl.SSLCertVerificationError):
            return f"TLS certificate verification failed: {e.verify_message or e.reason}"
    for e in causes:
        if isinstance(e, ssl.SSLError):
            return f"TLS handshake failed: {e.reason or e}"
        if isinstance(e, socket.gaierror):
            return f"cannot resolve the host name ({e.strerror or e})"
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
        if isinstance(e, TimeoutError):
            return "connection timed out"
        if isinstance(e, OSError) and e.errno:
            return os.strerror(e.errno).lower()
    for e in causes:
        if str(e):
            return f"{type(e).__name__}: {e}"
    return type(exc).__name__


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


#: the service's paths that need no proof of the token
OPEN_PATHS: Final = frozenset({"/health", "/metrics", "/nonce"})


class TokenProof(httpx.Auth):
    """httpx authentication that proves the cluster token without sending it
    (docs/security.md): each request to a path that needs the token carries
    ``Authorization: TRIO-PD-HMAC <nonce> <proof>``, :func:`~trio_pd._security.request_mac`
    over a one-time nonce the service issued, the method, the target and the body.

    Nonces come from the service's answers (each hands out a fresh one) and, when none is
    left, from ``GET /nonce``; at most :data:`KEEP` are kept, each used only within
    :data:`MAX_AGE` seconds of its arrival (the service takes it for 30). An answer ``401``
    that says the nonce was stale (:data:`~trio_pd._security.STALE_HEADER`: expired, or
    issued by a service since restarted) is retried once with the nonce it handed out.
    """

    requires_request_body = True
    KEEP = 16
    MAX_AGE = 10.0

    def __init__(self, token: str) -> None:
        self.token = token
        self._nonces: deque[tuple[str, float]] = deque(maxlen=self.KEEP)

    def keep(self, response: httpx.Response) -> None:
        """Keep the nonce ``response`` hands out, if any."""
        nonce = response.headers.get(NONCE_HEADER)
        if nonce:
            self._nonces.append((nonce, time.monotonic()))

    def _take(self) -> str | None:
        while self._nonces:
            nonce, at = self._nonces.pop()
            if time.monotonic() - at < self.MAX_AGE:
                return nonce
        return None

    def _sign(self, request: httpx.Request, nonce: str) -> None:
        proof = request_mac(
            self.token, nonce, request.method, request.url.raw_path, request.content
        )
        request.headers["authorization"] = f"{AUTH_SCHEME} {nonce} {proof}"

    def auth_flow(self, request: httpx.Request) -> Any:
        if request.url.path in OPEN_PATHS:
            yield request
            return
        nonce = self._take()
        if nonce is None:
            fetch = httpx.Request("GET", request.url.copy_with(path="/nonce", query=None))
            answer = yield fetch
            self.keep(answer)
            nonce = self._take() or ""
        self._sign(request, nonce)
        response = yield request
        if response.status_code == 401 and response.headers.get(STALE_HEADER):
            fresh = response.headers.get(NONCE_HEADER)
            if fresh:  # (its nonce may have expired, or been taken by an earlier try)
                self._sign(request, fresh)
                response = yield request
        self.keep(response)


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
        # Certificate verification only means something for https; skipping it for plain
        # http avoids loading the CA bundle (~80 ms) for every client.
        plain = httpx.URL(self.url).scheme == "http"
        if isinstance(verify, str):  # a CA bundle (a self-signed service's certificate)
            verify = ssl.create_default_context(cafile=verify)
        #: the cluster token, proven (never sent) with every request that needs it, and the
        #: key every answer to one is checked under
        self.token = (default_token() if token is None else token) or None
        self._proof = None if self.token is None else TokenProof(self.token)
        #: why the last :meth:`wait_ready` retried (None: it has not had to)
        self.waiting: BootstrapError | None = None
        #: the IP address the last answer came from (None: none yet): where this host
        #: reached the service, whatever name the URL gives
        self.server_address: str | None = None
        #: a decode rank's CURVE public key (z85), announced with every route read so that
        #: the service vouches for it to the prefill ranks (None: not announced)
        self.announce_key: str | None = None
        self._http = httpx.AsyncClient(
            base_url=self.url, timeout=None, trust_env=False, verify=False if plain else verify,
            auth=self._proof,
        )

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
        await self._http.aclose()

    async def register(self, info: PrefillRankInfo) -> None:
        """Register (or re-register) one prefill rank.

        Raises :class:`BootstrapError` if the service refuses it (400: invalid; 409:
        disagrees with the ranks already registered) or cannot be reached.

        **Cancellation:** safe to cancel; the registration may or may not have been stored
        (registering again is harmless, it replaces).
        """
        await self._request(
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
        response = await self._request("GET", "/route", params=self._dp_params())
        topology = self._decode(response, Topology)
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
        response = await self._request("GET", "/route", params=params)
        info = self._decode(response, PrefillRankInfo)
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
        response = await self._request("GET", "/key", params={"key": key})
        answer = self._decode(response, dict[str, bool])
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
        await self._request(
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
        response = await self._request(
            "POST", "/query_dp_ranks", content=msgspec.json.encode(body),
            headers={"content-type": "application/json"},
        )
        answer = self._decode(response, DpRanks)
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
            response = await self._http.get("/health")
        except httpx.TransportError:
            await trio.lowlevel.checkpoint()
            return False
        return response.status_code == 200

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request, its answer read whole but kept only up to :data:`MAX_ANSWER_BYTES`:
        past that the answer is a :class:`BootstrapError` (a 400 MiB one used to grow the
        decode process by 800 MiB). One that says it is longer is refused unread; one that
        does not say is read to its end and dropped (leaving httpx's stream half read warns
        of unclosed generators), so a service that never stops is ended by the caller's
        timeout, with at most the bound in memory."""
        too_big = BootstrapError(
            f"{method} {path} on bootstrap service {self.url}: the answer is over "
            f"{MAX_ANSWER_BYTES} bytes"
        )
        try:
            async with self._http.stream(method, path, **kwargs) as streamed:
                stream = streamed.extensions.get("network_stream")
                try:
                    server = stream.get_extra_info("server_addr") if stream else None
                except OSError:  # (the service answered and closed already: ENOTCONN)
                    server = None
                if isinstance(server, tuple) and server:
                    self.server_address = str(server[0])
                declared = streamed.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > MAX_ANSWER_BYTES:
                    raise too_big
                body: bytearray | None = bytearray()
                async for chunk in streamed.aiter_bytes():  # (decoded: a gzip bomb counts)
                    if body is not None:
                        body += chunk
                        if len(body) > MAX_ANSWER_BYTES:
                            body = None  # (what is left is read and dropped)
        except httpx.TransportError as exc:
            untrusted = _untrusted(exc)
            if untrusted is not None:  # (not a service that has not started: no retry helps)
                raise BootstrapError(
                    f"bootstrap service at {self.url}: TLS certificate verification failed: "
                    f"{untrusted} (trust its certificate with bootstrap_verify=, "
                    "docs/security.md)"
                ) from exc
            raise BootstrapUnreachable(
                f"bootstrap service at {self.url} unreachable: {transport_reason(exc)}"
            ) from exc
        if body is None:
            raise too_big
        if self.token is not None and path not in OPEN_PATHS:
            self._check_answer(method, path, streamed, bytes(body))
        response = httpx.Response(
            streamed.status_code, headers=streamed.headers, content=bytes(body),
            request=streamed.request,
        )
        if response.status_code == 200:
            return response
        try:
            reason = msgspec.json.decode(response.content, type=dict[str, Any])["error"]
        except (msgspec.DecodeError, KeyError):
            reason = response.text[:200]
        message = (
            f"{method} {path} on bootstrap service {self.url}: "
            f"{response.status_code} {_phrase(response.status_code)}: {reason}"
        )
        if response.status_code == 503:
            raise NotReady(message)
        if response.status_code == 404 and path == "/route":
            raise UnknownRank(message)
        raise BootstrapError(message)

    def _check_answer(
        self, method: str, path: str, streamed: httpx.Response, body: bytes
    ) -> None:
        """The answer must carry the service's proof of the token, bound to the nonce of
        the request it answers (:func:`~trio_pd._security.answer_mac`): otherwise it was not
        the cluster's service that wrote it, or it was altered on the way (a route's CURVE
        key swapped), and it is refused whatever it says."""
        assert self.token is not None
        claim = streamed.request.headers.get("authorization", "").split(" ")
        nonce = claim[1] if len(claim) == 3 else ""
        fresh = streamed.headers.get(NONCE_HEADER, "")
        want = answer_mac(self.token, nonce, streamed.status_code, body, fresh)
        if not hmac.compare_digest(want, streamed.headers.get(ANSWER_HEADER, "")):
            raise BootstrapError(
                f"{method} {path} on bootstrap service {self.url}: the answer "
                f"({streamed.status_code}) does not prove the cluster token (a service "
                "without the token, or an answer altered on the way): refused"
            )

    def _decode(self, response: httpx.Response, type_: type[_T]) -> _T:
        try:
            return msgspec.json.decode(response.content, type=type_)
        except msgspec.DecodeError as exc:
            raise BootstrapError(
                f"bootstrap service at {self.url} sent a malformed {type_.__name__}: {exc}"
            ) from exc


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
