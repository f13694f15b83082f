"""The bootstrap client: what prefill and decode ranks use to reach a bootstrap service, and
the two records it carries (SPEC §2, §6).

The service itself (routes, validation, the HTTP server) is in ``_bootstrap``; the agents
import only this module, so a rank never imports the HTTP server. Every failure is a
:class:`~trio_pd.BootstrapError`: :class:`~trio_pd._errors.NotReady` for 503,
:class:`~trio_pd._errors.UnknownRank` for a rank that does not exist,
:class:`~trio_pd._errors.BootstrapUnreachable` when the connection fails.
"""

from __future__ import annotations

import logging
import ssl
from http import HTTPStatus
from types import TracebackType
from typing import Annotated, Any, TypeVar

import httpx
import msgspec
import trio

from ._errors import BootstrapError, BootstrapUnreachable, NotReady, UnknownRank

__all__ = ["BootstrapClient", "PrefillRankInfo", "Topology"]

logger = logging.getLogger("trio_pd.bootstrap")

_T = TypeVar("_T")


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


class Topology(msgspec.Struct, frozen=True):
    """Every rank of a prefill instance: ``ranks[i].tp_rank == i`` for ``i < tp_size``."""

    tp_size: int
    ranks: list[PrefillRankInfo]


# --------------------------------------------------------------------------------------------
# The client


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


class BootstrapClient:
    """Talks to one bootstrap service at ``url`` (``"http://10.0.0.5:8998"``, or
    ``https://`` for a service given a certificate).

    ``token`` is the cluster token, sent with every request (docs/security.md); ``verify``
    is httpx's: True (the system's CA bundle), False, an :class:`ssl.SSLContext`, or the
    path of a CA bundle to trust (for a self-signed service).

    Use it as an async context manager, or call :meth:`aclose`. No call has a timeout of its
    own: compose ``trio.fail_after`` / ``trio.move_on_after`` around it. Proxy settings from
    the environment are ignored (the service is on the serving network, not behind a proxy).
    Every failure is a :class:`BootstrapError`: :class:`NotReady` for 503,
    :class:`UnknownRank` for a rank that does not exist, :class:`BootstrapUnreachable` when
    the connection fails.
    """

    def __init__(
        self, url: str, *, token: str | None = None, verify: ssl.SSLContext | str | bool = True
    ) -> None:
        self.url = url.rstrip("/")
        # Certificate verification only means something for https; skipping it for plain
        # http avoids loading the CA bundle (~80 ms) for every client.
        plain = httpx.URL(self.url).scheme == "http"
        if isinstance(verify, str):  # a CA bundle (a self-signed service's certificate)
            verify = ssl.create_default_context(cafile=verify)
        #: the cluster token, sent as ``Authorization: Bearer`` with every request
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        self._http = httpx.AsyncClient(
            base_url=self.url, timeout=None, trust_env=False, verify=False if plain else verify,
            headers=headers,
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
        response = await self._request("GET", "/route")
        topology = self._decode(response, Topology)
        expected = list(range(topology.tp_size))
        if [r.tp_rank for r in topology.ranks] != expected or any(
            r.tp_size != topology.tp_size for r in topology.ranks
        ):
            raise BootstrapError(f"bootstrap service at {self.url} sent an inconsistent topology")
        return topology

    async def rank(self, tp_rank: int) -> PrefillRankInfo:
        """One prefill rank's information.

        Raises :class:`NotReady` while some rank has not registered, :class:`UnknownRank`
        if the instance has no such rank, and :class:`BootstrapError` otherwise.

        **Cancellation:** safe to cancel; nothing changes on the service.
        """
        response = await self._request("GET", "/route", params={"tp_rank": str(tp_rank)})
        info = self._decode(response, PrefillRankInfo)
        if info.tp_rank != tp_rank:
            raise BootstrapError(
                f"bootstrap service at {self.url} answered tp_rank {info.tp_rank} "
                f"for tp_rank {tp_rank}"
            )
        return info

    async def wait_topology(self) -> Topology:
        """The complete topology, waiting for it as long as the caller lets it.

        Retries, with a backoff from 20 ms up to 500 ms, while the service answers 503 or
        cannot be reached (it may not have started yet). Any other error is raised at once.

        **Cancellation:** this only returns or fails on its own for a definite error; bound
        it with ``trio.fail_after``. Cancelling it is safe at any point.
        """
        delay = 0.02
        while True:
            try:
                return await self.topology()
            except (NotReady, BootstrapUnreachable) as exc:
                logger.debug("bootstrap: waiting for topology at %s: %s", self.url, exc)
            await trio.sleep(delay)
            delay = min(delay * 2, 0.5)

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
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise BootstrapUnreachable(
                f"bootstrap service at {self.url} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
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

    def _decode(self, response: httpx.Response, type_: type[_T]) -> _T:
        try:
            return msgspec.json.decode(response.content, type=type_)
        except msgspec.DecodeError as exc:
            raise BootstrapError(
                f"bootstrap service at {self.url} sent a malformed {type_.__name__}: {exc}"
            ) from exc
