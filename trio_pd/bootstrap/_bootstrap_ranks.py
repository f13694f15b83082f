"""The bootstrap service's rank table: whether a prefill rank's registration is valid on its
own, and whether it agrees with the ranks already registered (SPEC §2). Pure: no I/O.

The HTTP answers these rules give (``400`` for :func:`invalid_reason`, ``409`` for
:meth:`RankTable.conflict`) are listed in :mod:`trio_pd.bootstrap._bootstrap`'s docstring.
"""

from __future__ import annotations

from typing import Final

from ._bootstrap_records import (
    MAX_DP_SIZE,
    MAX_LAYERS,
    MAX_PP_SIZE,
    PrefillRankInfo,
    Topology,
)

LAYOUTS: Final = ("mha", "mla")
#: Largest tp_size a registration may name: the rank table holds at most this many ranks
#: (``tp_size * dp_size`` of them with DP attention).
MAX_TP_SIZE: Final = 1024

# Fields every rank of one prefill instance must agree on.
SHARED_FIELDS: Final = (
    "tp_size", "engine", "layout", "kv_heads", "page_size", "dp_size", "pp_size",
)


def invalid_reason(info: PrefillRankInfo) -> str | None:
    """Why ``info`` is not a valid registration on its own, or None.

    Single-field bounds are checked by msgspec while decoding; these are the rules that
    relate fields to each other.
    """
    if info.tp_size > MAX_TP_SIZE:
        return f"tp_size {info.tp_size} is over {MAX_TP_SIZE}"
    if not 0 <= info.tp_rank < info.tp_size:
        return f"tp_rank {info.tp_rank} is outside [0, tp_size={info.tp_size})"
    if info.dp_size > MAX_DP_SIZE or info.dp_size * info.tp_size > MAX_TP_SIZE:
        return (f"dp_size {info.dp_size} x tp_size {info.tp_size} is over {MAX_TP_SIZE} ranks "
                f"(or dp_size over {MAX_DP_SIZE})")
    if not 0 <= info.dp_rank < info.dp_size:
        return f"dp_rank {info.dp_rank} is outside [0, dp_size={info.dp_size})"
    if info.pp_size > MAX_PP_SIZE or info.pp_size * info.dp_size * info.tp_size > MAX_TP_SIZE:
        return (f"pp_size {info.pp_size} x dp_size {info.dp_size} x tp_size {info.tp_size} is "
                f"over {MAX_TP_SIZE} ranks (or pp_size over {MAX_PP_SIZE})")
    if not 0 <= info.pp_rank < info.pp_size:
        return f"pp_rank {info.pp_rank} is outside [0, pp_size={info.pp_size})"
    if info.pp_rank == 0 and info.first_layer != 0:
        return f"PP stage 0 starts at layer 0, not {info.first_layer}"
    if info.pp_size > 1 and info.num_layers < 1:
        return f"PP stage {info.pp_rank} must publish its num_layers (at least 1)"
    if info.first_layer + info.num_layers > MAX_LAYERS:
        return (f"layers {info.first_layer}..{info.first_layer + info.num_layers - 1} end past "
                f"{MAX_LAYERS}")
    if info.layout not in LAYOUTS:
        return f"layout {info.layout!r} is not one of {', '.join(LAYOUTS)}"
    if info.layout == "mla" and info.kv_heads != 1:
        return f"an MLA rank has kv_heads 1, not {info.kv_heads}"
    return None


class RankTable:
    """The registered ranks of one prefill instance, by ``(dp_rank, pp_rank, tp_rank)`` (DP
    rank 0 only, without DP attention; PP stage 0 only, without pipeline parallelism)."""

    def __init__(self) -> None:
        self._ranks: dict[tuple[int, int, int], PrefillRankInfo] = {}

    def __len__(self) -> int:
        return len(self._ranks)

    @property
    def tp_size(self) -> int | None:
        """The tp_size the registered ranks agree on, or None if none registered."""
        for info in self._ranks.values():
            return info.tp_size
        return None

    @property
    def dp_size(self) -> int | None:
        """The dp_size the registered ranks agree on, or None if none registered."""
        for info in self._ranks.values():
            return info.dp_size
        return None

    @property
    def pp_size(self) -> int | None:
        """The pp_size the registered ranks agree on, or None if none registered."""
        for info in self._ranks.values():
            return info.pp_size
        return None

    @property
    def complete(self) -> bool:
        """Every TP rank of every PP stage of every DP rank registered."""
        tp_size, dp_size, pp_size = self.tp_size, self.dp_size, self.pp_size
        return (tp_size is not None and dp_size is not None and pp_size is not None
                and len(self) == tp_size * dp_size * pp_size)

    def group_size(self, dp_rank: int) -> int:
        """How many ranks of DP rank ``dp_rank`` (all its PP stages) registered."""
        return sum(1 for d, _, _ in self._ranks if d == dp_rank)

    def conflict(self, info: PrefillRankInfo) -> str | None:
        """Why ``info`` disagrees with the other registered ranks, or None.

        The rank ``info`` would replace is not compared with while the instance is
        incomplete: a lone rank may re-register with a different shape. Once every rank has
        registered the shape is fixed: a rank replacing itself must keep it too (else one
        PUT could make the instance need 10**9 ranks, and every decode get 503).
        """
        complete = self.complete
        for other in self._ranks.values():
            if _key(other) == _key(info) and not complete:
                continue
            for field in SHARED_FIELDS:
                mine, theirs = getattr(info, field), getattr(other, field)
                if mine != theirs:
                    return f"{field} {mine!r} disagrees with {theirs!r} of registered " + (
                        _named(other)
                    )
            if info.pp_size > 1:
                problem = _stage_conflict(info, other)
                if problem is not None:
                    return problem
        return None

    def get(self, tp_rank: int, dp_rank: int = 0, pp_rank: int = 0) -> PrefillRankInfo | None:
        """The registration of ``tp_rank`` of PP stage ``pp_rank`` of DP rank ``dp_rank``,
        if any."""
        return self._ranks.get((dp_rank, pp_rank, tp_rank))

    def register(self, info: PrefillRankInfo) -> None:
        """Store ``info``, replacing any earlier registration of its ``(dp_rank, pp_rank,
        tp_rank)``.

        The caller checked :func:`invalid_reason` and :meth:`conflict` first.
        """
        self._ranks[_key(info)] = info

    def topology(self, dp_rank: int = 0) -> Topology | None:
        """The complete topology of DP rank ``dp_rank`` (every TP rank of every PP stage of
        it, stage by stage), or None while some rank of it is missing."""
        tp_size, dp_size, pp_size = self.tp_size, self.dp_size, self.pp_size
        if tp_size is None or dp_size is None or pp_size is None or not 0 <= dp_rank < dp_size:
            return None
        ranks = [self._ranks.get((dp_rank, s, t)) for s in range(pp_size) for t in range(tp_size)]
        if any(r is None for r in ranks):
            return None
        return Topology(
            tp_size=tp_size, ranks=[r for r in ranks if r is not None], dp_rank=dp_rank,
            dp_size=dp_size, pp_size=pp_size,
        )


def _key(info: PrefillRankInfo) -> tuple[int, int, int]:
    return info.dp_rank, info.pp_rank, info.tp_rank


def _named(info: PrefillRankInfo) -> str:
    """``tp_rank T`` (``of pp_rank S``, ``of dp_rank K`` where the instance has them)."""
    return (
        f"tp_rank {info.tp_rank}"
        + (f" of pp_rank {info.pp_rank}" if info.pp_size > 1 else "")
        + (f" of dp_rank {info.dp_rank}" if info.dp_size > 1 else "")
    )


def _stage_conflict(info: PrefillRankInfo, other: PrefillRankInfo) -> str | None:
    """Why PP stage ``info.pp_rank``'s layers do not fit with those of the registered
    ``other`` (same pp_size), or None. The stages tile the model's layers in order: the
    ranks of one stage (in every DP rank) hold the same layers; stage ``s + 1`` starts where
    stage ``s`` ends; a lower stage holds only lower layers (no overlap)."""
    lo, n = info.first_layer, info.num_layers
    olo, on = other.first_layer, other.num_layers
    mine = f"PP stage {info.pp_rank} (layers {lo}..{lo + n - 1})"
    theirs = f"PP stage {other.pp_rank} (layers {olo}..{olo + on - 1}) of registered " + (
        _named(other)
    )
    if other.pp_rank == info.pp_rank:
        if (olo, on) != (lo, n):
            return f"{mine} disagrees with {theirs}: one stage holds one range of layers"
        return None
    if lo < olo + on and olo < lo + n:
        return f"{mine} overlaps {theirs}"
    below, above = (other, info) if other.pp_rank < info.pp_rank else (info, other)
    if (below.first_layer >= above.first_layer
            or (above.pp_rank == below.pp_rank + 1
                and below.first_layer + below.num_layers != above.first_layer)):
        return (f"{mine} does not follow on from {theirs}: stage s + 1 starts at the layer "
                "after stage s's last")
    return None
