"""The bootstrap service's routes: what it answers to each request, over its state (the rank
table, the DP-attention records, the vouched keys). The route list and each answer's rules
are in :mod:`trio_pd.bootstrap._bootstrap`'s docstring.

Every answer is a :class:`Reply`; only ``PUT /route`` awaits (it may probe the endpoint of the
rank it would replace). Reading the request, the token's proof and the counts by route are
the app's (:mod:`trio_pd.bootstrap._bootstrap_http`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final
from urllib.parse import parse_qs

import msgspec
import trio
from hypercorn.typing import HTTPScope
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..io._probe import port_refuses
from ._bootstrap_auth import VouchedKeys
from ._bootstrap_dp import DpQuery, DpRegistration, DpRooms
from ._bootstrap_ranks import RankTable, invalid_reason
from ._bootstrap_records import MAX_DP_BATCH, UNKNOWN_DP_RANK, DpRanks, PrefillRankInfo

logger = logging.getLogger("trio_pd.bootstrap")

ROUTE_METHODS: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType({
    "/route": ("GET", "PUT"), "/register_dp_rank": ("POST",), "/query_dp_ranks": ("POST",),
    "/key": ("GET",), "/nonce": ("GET",), "/health": ("GET",), "/metrics": ("GET",),
})
#: the paths that need the cluster token (when the service has one)
AUTHENTICATED: Final = frozenset({"/route", "/register_dp_rank", "/query_dp_ranks", "/key"})
#: the requests whose body is read (bounded: ``_bootstrap_limits.MAX_BODY_BYTES``)
WITH_BODY: Final = frozenset(
    {("PUT", "/route"), ("POST", "/register_dp_rank"), ("POST", "/query_dp_ranks")}
)
JSON: Final = b"application/json"
TEXT: Final = b"text/plain; charset=utf-8"
_RANK_INT: Final = re.compile(r"-?[0-9]{1,9}")
_Z85_KEY: Final = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
#: how long a replacement's probe of the old rank's endpoint may take (see Routes.put_route)
_REPLACE_PROBE_TIMEOUT: Final = 1.0


@dataclass(frozen=True, slots=True)
class Reply:
    """One answer: its status, body, content type and extra headers."""

    status: int
    body: bytes
    content_type: bytes = JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @classmethod
    def error(cls, status: int, message: str, **kwargs: Any) -> Reply:
        return cls(status, msgspec.json.encode({"ok": False, "error": message}), **kwargs)


class Routes:
    """The service's state and the answer to each request over it.

    Counts what only a route can tell (``refused_replacements``, ``dp_rooms_registered``,
    ``dp_rooms_unknown``); the app counts every answer by route and status.
    """

    def __init__(
        self,
        *,
        metrics_registry: CollectorRegistry | None,
        dp_room_ttl: float,
        max_dp_rooms: int,
    ) -> None:
        #: the registered prefill ranks (PUT /route writes, GET /route reads)
        self.table = RankTable()
        #: "room R is on DP rank K" records (POST /register_dp_rank, /query_dp_ranks)
        self.dp_rooms = DpRooms(max_entries=max_dp_rooms, ttl=dp_room_ttl)
        #: decode ranks' CURVE keys announced with GET /route (GET /key reads)
        self.vouched = VouchedKeys()
        self._metrics_registry = metrics_registry
        #: ``409`` answers to a replacement of a live rank
        self.refused_replacements = 0
        #: records stored by POST /register_dp_rank
        self.dp_registered = 0
        #: rooms POST /query_dp_ranks answered unknown
        self.dp_unknown = 0

    def dispatch(self, method: str, path: str, scope: HTTPScope) -> Reply:
        """The reply to every request without a body (``PUT /route`` and the DP requests have
        one: :meth:`put_route`, :meth:`dp_request`)."""
        allowed = ROUTE_METHODS.get(path)
        if allowed is None:
            return Reply.error(404, f"no such path: {path}")
        if method not in allowed:
            return Reply.error(
                405,
                f"{path} does not accept {method}",
                headers=((b"allow", ", ".join(allowed).encode("ascii")),),
            )
        if path == "/route":
            return self.get_route(scope["query_string"])
        if path == "/key":
            return self.get_key(scope["query_string"])
        if path == "/health":
            return Reply(200, b"OK", content_type=TEXT)
        if path == "/nonce":  # (every answer carries one; this one only that)
            return Reply(200, b'{"ok":true}')
        return self.get_metrics()

    async def put_route(self, body: bytes) -> Reply:
        """:meth:`_register`, after the replacement rule: a rank already registered under
        another control key (a CURVE public key; "" with authentication off) is replaced only
        once its old control endpoint refuses connections (the old process is gone: a
        restarted rank has a new key). Otherwise ``409``, counted ``refused_replacements``:
        a live rank's route cannot be taken over, not even with the token."""
        await trio.lowlevel.checkpoint()
        try:
            info = msgspec.json.decode(body, type=PrefillRankInfo)
        except msgspec.DecodeError:
            return self._register(body)  # (answers 400)
        old = self.table.get(info.tp_rank, info.dp_rank, info.pp_rank)
        if old is not None and old.control_key != info.control_key:
            refused = None
            with trio.move_on_after(_REPLACE_PROBE_TIMEOUT):
                refused = await port_refuses(old.endpoint)
            # (it may have changed meanwhile)
            old = self.table.get(info.tp_rank, info.dp_rank, info.pp_rank)
            if refused is not True and old is not None and old.control_key != info.control_key:
                self.refused_replacements += 1
                logger.warning(
                    "bootstrap: refused to replace tp_rank %d: registered under another "
                    "control key, and its endpoint %s still answers", info.tp_rank, old.endpoint,
                )
                return Reply.error(
                    409,
                    f"tp_rank {info.tp_rank} is registered under another control key and its "
                    f"endpoint still accepts connections",
                )
        else:
            await trio.lowlevel.checkpoint()
        return self._register(body)

    def _register(self, body: bytes) -> Reply:
        try:
            info = msgspec.json.decode(body, type=PrefillRankInfo)
        except msgspec.DecodeError as exc:
            logger.info("bootstrap: refused a malformed registration: %s", exc)
            return Reply.error(400, f"malformed PrefillRankInfo: {exc}")
        reason = invalid_reason(info)
        if reason is not None:
            logger.info("bootstrap: refused registration %r: %s", info, reason)
            return Reply.error(400, reason)
        conflict = self.table.conflict(info)
        if conflict is not None:
            logger.info("bootstrap: refused conflicting registration %r: %s", info, conflict)
            return Reply.error(409, conflict)
        self.table.register(info)
        logger.debug("bootstrap: registered %r", info)
        return Reply(200, b'{"ok":true}')

    def get_route(self, query_string: bytes) -> Reply:
        try:
            query = (
                parse_qs(query_string.decode("ascii"), keep_blank_values=True, strict_parsing=True)
                if query_string
                else {}
            )
        except (UnicodeDecodeError, ValueError):
            return Reply.error(400, "unparseable query string")
        unknown = sorted(set(query) - {"tp_rank", "dp_rank", "pp_rank", "key"})
        if unknown:
            return Reply.error(400, f"unknown query parameter(s): {', '.join(unknown)}")
        if "key" in query:
            keys = query["key"]
            if len(keys) != 1 or not _Z85_KEY.fullmatch(keys[0]):
                return Reply.error(400, "key must be one CURVE public key in z85")
            self.vouched.vouch(keys[0])
        tp_rank = -1
        if "tp_rank" in query:
            values = query["tp_rank"]
            if len(values) != 1 or not _RANK_INT.fullmatch(values[0]):
                return Reply.error(400, f"tp_rank must be one integer >= -1, not {values!r}")
            tp_rank = int(values[0])
            if tp_rank < -1:
                return Reply.error(400, f"tp_rank must be >= -1, not {tp_rank}")
        dp_rank = 0
        if "dp_rank" in query:
            values = query["dp_rank"]
            if len(values) != 1 or not _RANK_INT.fullmatch(values[0]) or int(values[0]) < 0:
                return Reply.error(400, f"dp_rank must be one integer >= 0, not {values!r}")
            dp_rank = int(values[0])
        pp_rank = 0
        if "pp_rank" in query:
            values = query["pp_rank"]
            if len(values) != 1 or not _RANK_INT.fullmatch(values[0]) or int(values[0]) < 0:
                return Reply.error(400, f"pp_rank must be one integer >= 0, not {values!r}")
            pp_rank = int(values[0])
        tp_size, dp_size = self.table.tp_size, self.table.dp_size
        pp_size = self.table.pp_size
        if dp_size is not None and dp_rank >= dp_size:
            return Reply.error(404, f"no dp_rank {dp_rank}: dp_size is {dp_size}")
        if pp_size is not None and pp_rank >= pp_size:
            return Reply.error(404, f"no pp_rank {pp_rank}: pp_size is {pp_size}")
        if tp_size is not None and tp_rank >= tp_size:
            return Reply.error(404, f"no tp_rank {tp_rank}: tp_size is {tp_size}")
        topology = self.table.topology(dp_rank)
        if topology is None:
            if dp_size is not None and dp_size > 1:
                return Reply.error(
                    503, f"not ready: {self.table.group_size(dp_rank)} of "
                    f"{(tp_size or 0) * (pp_size or 1)} ranks of dp_rank {dp_rank} registered"
                )
            if pp_size is not None and pp_size > 1:
                return Reply.error(
                    503, f"not ready: {len(self.table)} of {tp_size} x {pp_size} ranks "
                    f"(TP x PP) registered"
                )
            return Reply.error(
                503, f"not ready: {len(self.table)} of {tp_size or '?'} ranks registered"
            )
        if tp_rank == -1:
            return Reply(200, msgspec.json.encode(topology))
        return Reply(200, msgspec.json.encode(topology.stage(pp_rank)[tp_rank]))

    def get_key(self, query_string: bytes) -> Reply:
        """``GET /key?key=K``: ``{"vouched": true}`` when a decode rank announced K."""
        try:
            query = parse_qs(query_string.decode("ascii"), strict_parsing=True)
        except (UnicodeDecodeError, ValueError):
            return Reply.error(400, "unparseable query string")
        keys = query.get("key", [])
        if set(query) != {"key"} or len(keys) != 1 or not _Z85_KEY.fullmatch(keys[0]):
            return Reply.error(400, "GET /key takes one key, a CURVE public key in z85")
        vouched = keys[0] in self.vouched
        return Reply(200, b'{"vouched":true}' if vouched else b'{"vouched":false}')

    def dp_request(self, path: str, body: bytes) -> Reply:
        """``POST /register_dp_rank`` or ``POST /query_dp_ranks`` (DP attention; see the
        module's docstring). Bounded: at most :data:`MAX_DP_BATCH` rooms (else ``413``), and
        at most ``max_dp_rooms`` records held."""
        try:
            request: DpRegistration | DpQuery = (
                msgspec.json.decode(body, type=DpRegistration)
                if path == "/register_dp_rank"
                else msgspec.json.decode(body, type=DpQuery)
            )
        except msgspec.DecodeError as exc:
            logger.info("bootstrap: refused a malformed %s: %s", path, exc)
            return Reply.error(400, f"malformed {path} body: {exc}")
        rooms = request.rooms
        if not rooms:
            return Reply.error(400, f"{path}: no rooms")
        if len(rooms) > MAX_DP_BATCH:
            return Reply.error(
                413, f"{path}: {len(rooms)} rooms in one request, over {MAX_DP_BATCH}"
            )
        dp_size = self.table.dp_size
        if dp_size is None:
            return Reply.error(503, "not ready: no prefill rank registered (DP size unknown)")
        now = trio.current_time()
        if isinstance(request, DpRegistration):
            if request.dp_rank >= dp_size:
                return Reply.error(
                    400, f"dp_rank {request.dp_rank} is outside [0, dp_size={dp_size})"
                )
            for r in rooms:
                self.dp_rooms.put(r.room, r.epoch, request.dp_rank, now)
            self.dp_registered += len(rooms)
            return Reply(200, msgspec.json.encode({"ok": True, "registered": len(rooms)}))
        if dp_size == 1:
            ranks = [0] * len(rooms)  # one DP rank holds every room
        else:
            ranks = [self.dp_rooms.get(r.room, r.epoch, now) for r in rooms]
            # a room recorded under an earlier, larger DP size (an instance re-registering
            # with another shape) is unknown now: its rank would make the whole answer one
            # the client must refuse, and fail every room it asked about
            ranks = [UNKNOWN_DP_RANK if k >= dp_size else k for k in ranks]
            self.dp_unknown += ranks.count(UNKNOWN_DP_RANK)
        return Reply(200, msgspec.json.encode(DpRanks(dp_size=dp_size, dp_ranks=ranks)))

    def get_metrics(self) -> Reply:
        if self._metrics_registry is None:
            return Reply.error(404, "metrics are not enabled on this server")
        return Reply(
            200,
            generate_latest(self._metrics_registry),
            content_type=CONTENT_TYPE_LATEST.encode("ascii"),
        )
