"""The records a bootstrap service and its clients exchange, and the bounds on them (SPEC §2):
what a prefill rank publishes (:class:`PrefillRankInfo`), a prefill instance's ranks
(:class:`Topology`), and the DP-attention rooms and answers (:class:`DpRoom`,
:class:`DpRanks`), with the URL form that names one DP rank (:func:`dp_url`). Pure: no I/O,
so the service's rank table and the agents' checks share them without importing HTTP.
"""

from __future__ import annotations

import re
from typing import Annotated, Final
from urllib.parse import parse_qs, urlsplit, urlunsplit

import msgspec

from ..core._errors import ConfigurationError
from ..core._memory import DTYPE_PATTERN, UNKNOWN_DTYPE
from ..core._wire import MAX_STATES, StateWire

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
    #: it takes landing pages (trio_pd.core._landing): a decode rank advertises its landing
    #: area in REGISTER, and names landing pages in a TRANSFER, only to a rank that says so
    #: (False: an older prefill, which would refuse both)
    landing: bool = False

    @property
    def rank_id(self) -> int:
        """The rank's id in STATUS and ABORT_ACK: ``pp_rank * tp_size + tp_rank`` (its TP
        rank, without pipeline parallelism)."""
        return self.pp_rank * self.tp_size + self.tp_rank


#: the most bytes of one answer the client reads: a whole topology is at most a few MiB
#: (the service takes a rank's registration of at most 64 KiB), so 32 MiB leaves room for


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

