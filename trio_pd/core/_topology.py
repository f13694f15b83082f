"""Topology: which prefill rank holds, and writes, which heads of which decode rank (SPEC §2).

Pure integer arithmetic over TP sizes and head counts; no I/O, no trio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from ._memory import UNKNOWN_DTYPE, StateSpec, layer_buffers


def _check_tp(prefill_tp: int, decode_tp: int) -> None:
    if prefill_tp < 1 or decode_tp < 1:
        raise ValueError(f"TP sizes must be positive, got P={prefill_tp}, D={decode_tp}")
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp) != 0:
        raise ValueError(
            f"the larger TP size must be a multiple of the smaller one, "
            f"got P={prefill_tp}, D={decode_tp}"
        )


def _check_rank(rank: int, tp_size: int, what: str) -> None:
    if not 0 <= rank < tp_size:
        raise ValueError(f"{what} rank {rank} is out of range for TP size {tp_size}")


def head_range(rank: int, tp_size: int, total_heads: int) -> tuple[int, int]:
    """Return ``(first_head, count)``: the global KV heads that TP rank ``rank`` holds.

    With at most one rank per head (``tp_size <= total_heads``) the heads are split evenly and
    ``total_heads`` must be a multiple of ``tp_size``. With more ranks than heads (GQA head
    replication) every rank holds one head, ``rank * total_heads // tp_size``, so ``tp_size /
    total_heads`` neighbouring ranks hold the same head; ``tp_size`` must then be a multiple
    of ``total_heads``, otherwise the replicas of one head would not line up across two TP
    sizes. Integer division, not modulo: rank 1 of 4 with 2 heads holds head 0, not head 1.
    """
    if tp_size < 1 or total_heads < 1:
        raise ValueError(f"need tp_size >= 1 and total_heads >= 1, got {tp_size}, {total_heads}")
    _check_rank(rank, tp_size, "TP")
    if tp_size <= total_heads:
        if total_heads % tp_size != 0:
            raise ValueError(f"{total_heads} KV heads cannot be split evenly over TP {tp_size}")
        count = total_heads // tp_size
        return rank * count, count
    if tp_size % total_heads != 0:
        raise ValueError(
            f"TP {tp_size} is not a multiple of the {total_heads} KV heads it replicates"
        )
    return rank * total_heads // tp_size, 1


def source_ranks(decode_rank: int, prefill_tp: int, decode_tp: int) -> range:
    """The prefill ranks that decode rank ``decode_rank`` reads its KV cache from.

    ``P == D``: one, the same rank number. ``D > P``: one, shared by ``D / P`` neighbouring
    decode ranks. ``D < P``: the ``P / D`` consecutive prefill ranks whose heads together make
    up this decode rank's heads (MHA), or that all hold the same replicated latent (MLA).
    """
    _check_tp(prefill_tp, decode_tp)
    _check_rank(decode_rank, decode_tp, "decode")
    lo = decode_rank * prefill_tp // decode_tp
    hi = max(lo + 1, (decode_rank + 1) * prefill_tp // decode_tp)
    return range(lo, hi)


def served_decode_ranks(prefill_rank: int, prefill_tp: int, decode_tp: int) -> range:
    """The decode ranks whose :func:`source_ranks` contain ``prefill_rank``.

    This is how many metadata (TRANSFER) messages a prefill rank waits for per request:
    ``D / P`` when ``D > P``, otherwise one.
    """
    _check_tp(prefill_tp, decode_tp)
    _check_rank(prefill_rank, prefill_tp, "prefill")
    if decode_tp >= prefill_tp:
        fan = decode_tp // prefill_tp
        return range(prefill_rank * fan, (prefill_rank + 1) * fan)
    first = prefill_rank // (prefill_tp // decode_tp)
    return range(first, first + 1)


def aux_writer(decode_rank: int, prefill_tp: int, decode_tp: int) -> int:
    """The one prefill rank that writes decode rank ``decode_rank``'s aux row: the lowest of
    its source ranks."""
    return source_ranks(decode_rank, prefill_tp, decode_tp)[0]


def writes_aux(
    prefill_rank: int,
    decode_rank: int,
    prefill_tp: int,
    decode_tp: int,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> bool:
    """Whether TP rank ``prefill_rank`` of PP stage ``pp_rank`` (of ``pp_size``) writes
    decode rank ``decode_rank``'s aux row: the :func:`aux_writer` of the *last* stage only
    (its output is the request's: SGLang's last PP stage makes the output ids, logprobs and
    hidden states the aux rows carry). Exactly one (stage, TP rank) per decode rank."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"PP rank {pp_rank} is out of range for PP size {pp_size}")
    return pp_rank == pp_size - 1 and aux_writer(decode_rank, prefill_tp, decode_tp) == (
        prefill_rank
    )


def write_heads(
    prefill_rank: int,
    decode_rank: int,
    prefill_tp: int,
    decode_tp: int,
    total_heads: int,
    layout: Literal["mha", "mla"],
) -> tuple[int, int] | None:
    """Which global heads ``[h0, h1)`` prefill rank ``prefill_rank`` writes to decode rank
    ``decode_rank``, or ``None`` when it writes no KV bytes there.

    MHA: the heads both ranks hold, less those a *lower* source rank of the decode rank also
    holds (under GQA replication several prefill ranks hold the same head; only the lowest
    writes it, so every destination byte is written exactly once). MLA: the latent is
    replicated, so the lowest source rank writes ``(0, 1)`` and the others write nothing.

    ``None`` marks a *dummy* rank for this decode rank: it still takes part in the request's
    bookkeeping (status, acks) but moves no KV bytes. A prefill rank that is not a source rank
    of ``decode_rank`` at all also gets ``None``.
    """
    _check_tp(prefill_tp, decode_tp)
    _check_rank(prefill_rank, prefill_tp, "prefill")
    sources = source_ranks(decode_rank, prefill_tp, decode_tp)
    if prefill_rank not in sources:
        return None
    if layout == "mla":
        return (0, 1) if prefill_rank == sources[0] else None
    if layout != "mha":
        raise ValueError(f"unknown layout {layout!r}")
    p_first, p_count = head_range(prefill_rank, prefill_tp, total_heads)
    d_first, d_count = head_range(decode_rank, decode_tp, total_heads)
    h0 = max(p_first, d_first)
    h1 = min(p_first + p_count, d_first + d_count)
    # Lower source ranks hold either exactly the same heads (replicas) or disjoint ones, and
    # only ever heads at or below ours: trimming from the bottom is all that can happen.
    for lower in range(sources[0], prefill_rank):
        q_first, q_count = head_range(lower, prefill_tp, total_heads)
        if q_first <= h0 < q_first + q_count:
            h0 = q_first + q_count
    return (h0, h1) if h0 < h1 else None


# --------------------------------------------------------------------------------------------
# The model's shape, checked against the pools (an 8-head pool run as 1 head once reported
# Success with an eighth of the bytes)
# --------------------------------------------------------------------------------------------


def model_kv_heads(
    layout: Literal["mha", "mla"],
    heads: int,
    first_head: int,
    tp_rank: int,
    tp_size: int,
    kv_heads: int | None,
) -> int:
    """The model's total KV heads for a rank whose pool holds ``heads`` heads from
    ``first_head``: ``kv_heads`` if given (checked), else worked out from the pool.

    MLA has one latent "head", replicated on every rank. For MHA, a pool with more than one
    head, or TP 1, tells the total (``heads * tp_size``); one head on TP > 1 could also be GQA
    replication, so there ``kv_heads`` must be given. Raises ``ValueError`` with what does
    not fit: the head range the pool must hold is :func:`head_range`'s.
    """
    _check_rank(tp_rank, tp_size, "TP")
    if layout == "mla":
        if (kv_heads not in (None, 1)) or heads != 1 or first_head != 0:
            raise ValueError(
                f"MLA keeps one replicated latent: kv_heads must be 1 and the pool must hold "
                f"head 0 only (got kv_heads={kv_heads}, pool heads={heads} from {first_head})"
            )
        return 1
    if kv_heads is None:
        if heads == 1 and tp_size > 1:
            raise ValueError(
                "kv_heads is needed: a one-head pool on TP > 1 may be a replicated (GQA) head"
            )
        kv_heads = heads * tp_size
    try:
        want = head_range(tp_rank, tp_size, kv_heads)
    except ValueError as exc:
        raise ValueError(f"kv_heads={kv_heads} does not fit TP {tp_size}: {exc}") from exc
    if want != (first_head, heads):
        raise ValueError(
            f"with kv_heads={kv_heads}, TP rank {tp_rank} of {tp_size} holds heads "
            f"{want[0]}..{want[0] + want[1] - 1}, but its pool holds {heads} head(s) from "
            f"{first_head}"
        )
    return kv_heads


def pairing_problem(
    *,
    layout: Literal["mha", "mla"],
    page_size: int,
    head_bytes: int | tuple[int, ...],
    num_layers: int,
    aux_item_len: int | tuple[int, ...],
    kv_heads: int,
    prefill_tp: int,
    peer_layout: str,
    peer_page_size: int,
    peer_head_bytes: int | tuple[int, ...],
    peer_num_layers: int,
    peer_aux_item_len: int | tuple[int, ...],
    peer_rank: int,
    peer_tp: int,
    peer_heads: int,
    peer_first_head: int,
    first_layer: int = 0,
    pp_rank: int = 0,
    pp_size: int = 1,
    kv_dtype: str = UNKNOWN_DTYPE,
    peer_kv_dtype: str = UNKNOWN_DTYPE,
) -> str | None:
    """Why a decode rank's pool cannot take this prefill instance's KV, or None if it can.

    Both sides run it: decode on the topology the bootstrap service gives, prefill on each
    REGISTER, so a mismatch is refused once, up front, with this reason, instead of being
    found (or missed) per request.

    ``aux_item_len`` / ``peer_aux_item_len``: the row bytes of each aux buffer
    (:attr:`~trio_pd.PoolSpec.aux_item_lens`), compared buffer by buffer, or of the first
    alone (an int: all a side knows of the other from the bootstrap service).

    Pipeline parallelism: a prefill PP stage (``pp_rank`` of ``pp_size``) holds
    ``num_layers`` layers from model layer ``first_layer``; decode holds every layer. With
    ``pp_size == 1`` and ``first_layer == 0`` (the whole model) the layer counts must be
    equal, as always; otherwise the stage's layers must lie inside decode's, and per-buffer
    ``head_bytes`` tuples are compared with decode's buffers of those layers
    (:func:`~trio_pd.core._memory.layer_buffers`): pairing is by layer id, not position.

    ``kv_dtype`` / ``peer_kv_dtype``: what each side's KV bytes hold; compared only when both
    say (``"unknown"`` skips it: the same bytes per head of bf16 and fp16 would pass every
    other check and move garbage)."""
    whole_model = pp_size == 1 and first_layer == 0
    if not whole_model and isinstance(peer_head_bytes, tuple) and (
        first_layer + num_layers <= peer_num_layers
    ):
        picks = layer_buffers(peer_layout, peer_num_layers, first_layer, num_layers)
        if len(peer_head_bytes) == (2 if peer_layout == "mha" else 1) * peer_num_layers:
            peer_head_bytes = tuple(peer_head_bytes[b] for b in picks)
    aux_rows = aux_item_len if isinstance(aux_item_len, tuple) else (aux_item_len,)
    peer_aux_rows = (peer_aux_item_len if isinstance(peer_aux_item_len, tuple)
                     else (peer_aux_item_len,))
    mismatches = [
        (what, ours, theirs)
        for what, ours, theirs in (
            ("layout", layout, peer_layout),
            ("page size", page_size, peer_page_size),
            ("head bytes", head_bytes, peer_head_bytes),
            *((("layer count", num_layers, peer_num_layers),) if whole_model else ()),
        )
        if ours != theirs
    ]
    if UNKNOWN_DTYPE not in (kv_dtype, peer_kv_dtype) and kv_dtype != peer_kv_dtype:
        mismatches.append(("KV dtype", kv_dtype, peer_kv_dtype))
    if not whole_model and not (first_layer >= 0 and first_layer + num_layers <= peer_num_layers):
        mismatches.append((
            "layers",
            f"PP stage {pp_rank} of {pp_size} holds layers {first_layer}.."
            f"{first_layer + num_layers - 1}",
            f"holds {peer_num_layers} (0..{peer_num_layers - 1})",
        ))
    if aux_rows != peer_aux_rows:  # (one buffer each: shown as ints, as before)
        if len(aux_rows) == len(peer_aux_rows) == 1:
            mismatches.append(("aux row bytes", aux_rows[0], peer_aux_rows[0]))
        else:
            mismatches.append(("aux row bytes per aux buffer", aux_rows, peer_aux_rows))
    if mismatches:
        return "; ".join(f"{w}: prefill {a}, decode {b}" for w, a, b in mismatches)
    try:
        _check_tp(prefill_tp, peer_tp)
        _check_rank(peer_rank, peer_tp, "decode")
        model_kv_heads(layout, peer_heads, peer_first_head, peer_rank, peer_tp, kv_heads)
    except ValueError as exc:
        return f"decode rank {peer_rank} of TP {peer_tp}: {exc}"
    return None


# --------------------------------------------------------------------------------------------
# State components: which bytes of a slot a prefill rank writes into a decode rank's slot
# --------------------------------------------------------------------------------------------

#: per buffer of a state component: the ``(src offset, dst offset, bytes)`` cuts of one slot
SlotCuts = tuple[tuple[tuple[int, int, int], ...], ...]


def state_problem(
    ours: Sequence[StateSpec],
    theirs: Sequence[StateSpec],
    prefill_tp: int,
    decode_tp: int,
    pp_size: int = 1,
) -> str | None:
    """Why decode's state components (``theirs``) cannot take this prefill rank's
    (``ours``), or None. Components pair by position and must agree in name, in how TP
    splits them (:attr:`StateSpec.split`) and in their buffers: the same slot bytes for a
    replicated or rank-local component (which also needs the same TP size on both sides),
    and for a split one the same segments, each with the same unit bytes and the same
    units in all (``units * tp``)."""
    if not ours and not theirs:
        return None
    if pp_size > 1:
        return "state components are not supported with pipeline stages"
    if [s.name for s in ours] != [s.name for s in theirs]:
        return (f"state components: prefill {[s.name for s in ours]}, "
                f"decode {[s.name for s in theirs]}")
    for a, b in zip(ours, theirs, strict=True):
        where = f"state component {a.name!r}"
        if a.split != b.split:
            return f"{where}: prefill splits it by {a.split}, decode by {b.split}"
        if len(a.buffers) != len(b.buffers):
            return f"{where}: prefill has {len(a.buffers)} buffers, decode {len(b.buffers)}"
        if a.split == "rank" and prefill_tp != decode_tp:
            return (f"{where} is split by TP rank with no segments to reslice it: prefill TP "
                    f"{prefill_tp} cannot fill decode TP {decode_tp} (give its segments)")
        if a.split != "segments":
            if a.item_lens != b.item_lens:
                return (f"{where}: slot bytes per buffer: prefill {a.item_lens}, "
                        f"decode {b.item_lens}")
            continue
        for i, (sa, sb) in enumerate(zip(a.segments, b.segments, strict=True)):
            total_a = [(ub, u * prefill_tp) for ub, u in sa]
            total_b = [(ub, u * decode_tp) for ub, u in sb]
            if total_a != total_b:
                return (f"{where}, buffer {i}: segments (unit bytes, units in all): "
                        f"prefill {total_a}, decode {total_b}")
    return None


def state_cuts(
    src: StateSpec, dst: StateSpec, prefill_rank: int, decode_rank: int,
    prefill_tp: int, decode_tp: int,
) -> SlotCuts:
    """For each buffer of a state component, the cuts of one slot prefill rank
    ``prefill_rank`` writes into decode rank ``decode_rank``'s slot: ``(offset in the source
    slot, offset in the destination slot, bytes)``, adjacent cuts merged; empty for every
    buffer when it writes nothing there. The pair must pass :func:`state_problem`.

    Replicated and rank-local slots go whole, from the decode rank's :func:`aux_writer`
    alone (with equal TP sizes, its own rank). A split slot goes segment by segment: each
    prefill rank writes the units it holds that the decode rank holds, so every byte of a
    decode slot is written exactly once."""
    _check_tp(prefill_tp, decode_tp)
    if src.split != "segments":
        if aux_writer(decode_rank, prefill_tp, decode_tp) != prefill_rank:
            return tuple(() for _ in src.buffers)
        return tuple(((0, 0, n),) for n in src.item_lens)
    out: list[tuple[tuple[int, int, int], ...]] = []
    for sa, sb in zip(src.segments, dst.segments, strict=True):
        cuts: list[tuple[int, int, int]] = []
        off_a = off_b = 0
        for (ub, ua), (_, ud) in zip(sa, sb, strict=True):
            lo = max(prefill_rank * ua, decode_rank * ud)
            hi = min((prefill_rank + 1) * ua, (decode_rank + 1) * ud)
            if lo < hi:
                so = off_a + (lo - prefill_rank * ua) * ub
                do = off_b + (lo - decode_rank * ud) * ub
                n = (hi - lo) * ub
                if cuts and cuts[-1][0] + cuts[-1][2] == so and cuts[-1][1] + cuts[-1][2] == do:
                    cuts[-1] = (cuts[-1][0], cuts[-1][1], cuts[-1][2] + n)
                else:
                    cuts.append((so, do, n))
            off_a += ub * ua
            off_b += ub * ud
        out.append(tuple(cuts))
    return tuple(out)
