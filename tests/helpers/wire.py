"""Hypothesis strategies for control messages: every valid value of every field, one
strategy per message type (``STRATEGIES``), and the ways a frame or a value is mutated."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from hypothesis import strategies as st

from trio_pd.core._wire import (
    MAX_POOL_PAGES,
    MAX_REASON_CHARS,
    WIRE_VERSION,
    Abort,
    AbortAck,
    Bye,
    Message,
    Ping,
    Pong,
    PoolWire,
    Register,
    Status,
    Transfer,
)

I64_MAX = 2**63 - 1
U64_MAX = 2**64 - 1


ids = st.integers(0, I64_MAX)
ranks = st.integers(0, 2**16 - 1)
counts = st.integers(1, 2**16)
# numeric_endpoint takes tcp://IP:PORT only (its own cases: tests/test_hostile_input.py)
endpoints = st.builds(
    "tcp://{}:{}".format,
    st.one_of(
        st.ip_addresses(v=4).map(str),
        st.ip_addresses(v=6).map("[{}]".format),
    ),
    st.integers(1, 65535),
)
small_pos = st.integers(1, 1 << 12)


@st.composite
def pools(draw: st.DrawFn) -> PoolWire:
    layout: Literal["mha", "mla"] = draw(st.sampled_from(["mha", "mla"]))
    num_layers = draw(st.integers(1, 8))
    if layout == "mha":
        heads = draw(st.integers(1, 64))
        first_head = draw(st.integers(0, 64))
    else:
        heads, first_head = 1, 0
    page_size = draw(small_pos)
    num_pages = draw(st.integers(1, MAX_POOL_PAGES))
    head_bytes = draw(small_pos)
    buffer_len = num_pages * page_size * heads * head_bytes
    base_room = 2**64 - buffer_len
    assert base_room >= 0
    n = num_layers * (2 if layout == "mha" else 1)
    bases = draw(st.lists(st.integers(0, base_room), min_size=n, max_size=n))
    aux_item_len = draw(small_pos)
    aux_slots = draw(st.integers(1, 1 << 20))
    aux_base = draw(st.integers(0, 2**64 - aux_item_len * aux_slots))
    return PoolWire(
        layout=layout,
        page_size=page_size,
        num_pages=num_pages,
        num_layers=num_layers,
        head_bytes=head_bytes,
        heads=heads,
        first_head=first_head,
        buffer_bases=tuple(bases),
        aux_base=aux_base,
        aux_item_len=aux_item_len,
        aux_slots=aux_slots,
    )


@st.composite
def registers(draw: st.DrawFn) -> Register:
    tp = draw(counts)
    return Register(
        WIRE_VERSION,
        endpoint=draw(endpoints),
        decode_rank=draw(st.integers(0, tp - 1)),
        decode_tp=tp,
        engine=draw(st.text(min_size=1, max_size=64)),
        session=draw(st.text(max_size=256)),
        engine_meta=draw(st.binary(max_size=256)),
        pool=draw(pools()),
    )


page_ids = st.lists(st.integers(0, MAX_POOL_PAGES - 1), max_size=64)


@st.composite
def transfers(draw: st.DrawFn) -> tuple[Transfer, np.ndarray[Any, Any]]:
    pages = np.array(draw(page_ids), dtype=np.int32)
    msg = Transfer(
        WIRE_VERSION,
        room=draw(ids),
        epoch=draw(ids),
        endpoint=draw(endpoints),
        decode_rank=draw(ranks),
        aux_slot=draw(ids),
        required=draw(counts),
        num_pages=len(pages),
    )
    return msg, pages


statuses = st.builds(
    Status,
    st.just(WIRE_VERSION),
    room=ids,
    epoch=ids,
    rank=ranks,
    ok=st.booleans(),
    reason=st.text(max_size=MAX_REASON_CHARS),
)
aborts = st.builds(Abort, st.just(WIRE_VERSION), room=ids, epoch=ids, endpoint=endpoints)
abort_acks = st.builds(AbortAck, st.just(WIRE_VERSION), room=ids, epoch=ids, rank=ranks)
pings = st.builds(Ping, st.just(WIRE_VERSION), nonce=ids, endpoint=endpoints)
pongs = st.builds(Pong, st.just(WIRE_VERSION), nonce=ids, rank=ranks)
byes = st.builds(Bye, st.just(WIRE_VERSION), rank=ranks, endpoint=endpoints)


def _no_pages(s: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[Any, None]]:
    return s.map(lambda m: (m, None))


STRATEGIES: dict[str, st.SearchStrategy[tuple[Message, np.ndarray[Any, Any] | None]]] = {
    "register": _no_pages(registers()),
    "transfer": transfers(),
    "status": _no_pages(statuses),
    "abort": _no_pages(aborts),
    "abort_ack": _no_pages(abort_acks),
    "ping": _no_pages(pings),
    "pong": _no_pages(pongs),
    "bye": _no_pages(byes),
}
any_message = st.one_of(*STRATEGIES.values())


mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("insert"), st.integers(0), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0), st.integers(1, 8)),
)


def mutate(frame: bytes, how: tuple[Any, ...]) -> bytes:
    buf = bytearray(frame)
    match how:
        case ("flip", i, x) if buf:
            buf[i % len(buf)] ^= x
        case ("truncate", i):
            del buf[i % (len(buf) + 1) :]
        case ("extend", extra):
            buf += extra
        case ("insert", i, extra):
            buf[i % (len(buf) + 1) : i % (len(buf) + 1)] = extra
        case ("delete", i, n) if buf:
            del buf[i % len(buf) : i % len(buf) + n]
    return bytes(buf)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64_MAX)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)
