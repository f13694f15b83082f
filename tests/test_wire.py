"""trio_pd.core._wire: round trips, and strict refusal of anything malformed (SPEC §6)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_pd.core import _wire
from trio_pd.core._errors import ProtocolError
from trio_pd.core._memory import PoolSpec
from trio_pd.core._wire import (
    MAX_AUX_BUFFERS,
    MAX_BUFFERS,
    MAX_ENDPOINT_CHARS,
    MAX_ENGINE_META_BYTES,
    MAX_HEADER_BYTES,
    MAX_POOL_PAGES,
    MAX_REASON_CHARS,
    MAX_TRANSFER_PAGES,
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
    decode,
    encode,
)

from .helpers.wire import (
    I64_MAX,
    STRATEGIES,
    U64_MAX,
    msgpack_values,
    mutate,
    mutations,
    pools,
    small_pos,
)

MESSAGE_TYPES = (Register, Transfer, Status, Abort, AbortAck, Ping, Pong, Bye)

# --------------------------------------------------------------------------------------------
# Helpers.


def transfer(num_pages: int = 3, **kw: Any) -> Transfer:
    fields: dict[str, Any] = dict(
        room=7,
        epoch=1,
        endpoint="tcp://10.0.0.2:5000",
        decode_rank=0,
        aux_slot=4,
        required=2,
        num_pages=num_pages,
    )
    fields.update(kw)
    return Transfer(WIRE_VERSION, **fields)


def pool(**kw: Any) -> PoolWire:
    fields: dict[str, Any] = dict(
        layout="mha",
        page_size=16,
        num_pages=100,
        num_layers=2,
        head_bytes=256,
        heads=4,
        first_head=0,
        buffer_bases=(0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000),
        aux_base=0x9000_0000,
        aux_item_len=64,
        aux_slots=32,
    )
    fields.update(kw)
    return PoolWire(**fields)


def register(**kw: Any) -> Register:
    fields: dict[str, Any] = dict(
        endpoint="tcp://10.0.0.2:5000",
        decode_rank=1,
        decode_tp=2,
        engine="mooncake",
        session="10.0.0.2:17000",
        engine_meta=b"\x00meta",
        pool=pool(),
    )
    fields.update(kw)
    return Register(WIRE_VERSION, **fields)


def header_dict(msg: Message) -> dict[str, Any]:
    """The header as a plain map, to be mutated and re-packed."""
    d = msgspec.msgpack.decode(msgspec.msgpack.encode(msg))
    assert isinstance(d, dict)
    return d


def pack(d: Any) -> bytes:
    return msgspec.msgpack.encode(d)


def assert_refused(frames: list[Any], match: str | None = None) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


def assert_well_formed(msg: Message, pages: np.ndarray[Any, Any] | None) -> None:
    """What decode returns is a message of this version that encode accepts again."""
    assert isinstance(msg, MESSAGE_TYPES)
    assert msg.v == WIRE_VERSION
    if isinstance(msg, Transfer):
        assert pages is not None
        assert pages.dtype == np.int32 and pages.ndim == 1
        assert len(pages) == msg.num_pages
        assert pages.size == 0 or (pages.min() >= 0 and pages.max() < MAX_POOL_PAGES)
    else:
        assert pages is None
    if isinstance(msg, Register):
        msg.pool.to_spec()
    again, again_pages = decode(encode(msg, pages))
    assert again == msg
    if pages is not None:
        assert again_pages is not None
        np.testing.assert_array_equal(again_pages, pages)


# --------------------------------------------------------------------------------------------
# Round trips.


@pytest.mark.parametrize("kind", STRATEGIES)
@given(data=st.data())
def test_round_trip(kind: str, data: st.DataObject) -> None:
    msg, pages = data.draw(STRATEGIES[kind])
    frames = encode(msg, pages)
    assert all(type(f) is bytes for f in frames)
    assert len(frames) == (2 if kind == "transfer" else 1)
    assert len(frames[0]) <= MAX_HEADER_BYTES
    got, got_pages = decode(frames)
    assert type(got) is type(msg)
    assert got == msg
    if pages is None:
        assert got_pages is None
    else:
        assert got_pages is not None
        assert got_pages.dtype == np.int32
        np.testing.assert_array_equal(got_pages, pages)
    if isinstance(got, Register):
        assert PoolWire.from_spec(got.pool.to_spec()) == got.pool


def test_header_is_tagged_map_with_version() -> None:
    d = msgspec.msgpack.decode(encode(AbortAck(WIRE_VERSION, room=1, epoch=2, rank=3))[0])
    assert d == {"t": "abort_ack", "v": WIRE_VERSION, "room": 1, "epoch": 2, "rank": 3}


def test_transfer_with_no_pages() -> None:
    # The last chunk of a room may carry only the aux row.
    frames = encode(transfer(0), np.zeros(0, np.int32))
    assert frames[1] == b""
    msg, pages = decode(frames)
    assert msg == transfer(0)
    assert pages is not None and pages.shape == (0,)


@pytest.mark.parametrize("dtype", ["<i4", ">i4", "<i8", ">u2", "u8", "i1"])
def test_transfer_pages_any_int_dtype_sent_as_le_int32(dtype: str) -> None:
    pages = np.array([0, 5, 100, 3], dtype=dtype)
    frames = encode(transfer(4), pages)
    assert frames[1] == np.array([0, 5, 100, 3], "<i4").tobytes()
    _, got = decode(frames)
    assert got is not None
    np.testing.assert_array_equal(got, [0, 5, 100, 3])


def test_transfer_pages_from_list() -> None:
    frames = encode(transfer(2), [3, 4])  # type: ignore[arg-type]
    assert decode(frames)[1] is not None


def test_decoded_pages_never_alias_a_writable_buffer() -> None:
    frames = encode(transfer(2), np.array([1, 2], np.int32))
    _, ro = decode(frames)
    assert ro is not None and not ro.flags.writeable
    buf = bytearray(frames[1])
    _, owned = decode([frames[0], buf])
    assert owned is not None
    buf[:4] = b"\x09\x00\x00\x00"
    np.testing.assert_array_equal(owned, [1, 2])
    _, from_view = decode([memoryview(frames[0]), memoryview(frames[1])])
    np.testing.assert_array_equal(from_view, [1, 2])


def test_status_reason_is_truncated_by_encoder() -> None:
    long = Status(WIRE_VERSION, room=1, epoch=0, rank=0, ok=False, reason="é" * 5000)
    got, _ = decode(encode(long))
    assert isinstance(got, Status)
    assert got.reason == "é" * MAX_REASON_CHARS
    assert Status(WIRE_VERSION, room=1, epoch=0, rank=0, ok=True).reason == ""
    # ... but a peer that sends a longer one is refused.
    d = header_dict(long)
    assert_refused([pack(d)], "reason")


def test_encode_takes_subclasses_of_a_message_and_nothing_else() -> None:
    """A subclass of Status is encoded as a Status (its long reason cut too); what is no
    control message is refused, not sent."""

    class _Status(Status, frozen=True):
        pass

    long = _Status(WIRE_VERSION, room=1, epoch=0, rank=0, ok=False, reason="é" * 5000)
    got, _ = decode(encode(long))
    assert type(got) is Status and got.reason == "é" * MAX_REASON_CHARS
    with pytest.raises(ProtocolError, match="cannot encode object: not a control message"):
        encode(object())  # type: ignore[arg-type]


def test_encode_transfer_of_1000_pages_is_fast() -> None:
    # A rough guard against an accidental slow path (the target is a few µs on a server).
    import timeit

    msg, pages = transfer(1000), np.arange(1000, dtype=np.int32)
    per_call = min(timeit.repeat(lambda: encode(msg, pages), number=200, repeat=5)) / 200
    assert per_call < 200e-6


# --------------------------------------------------------------------------------------------
# Fuzzing: mutated valid encodings decode to a well-formed message or raise ProtocolError.

def decode_or_refuse(frames: list[Any]) -> None:
    try:
        msg, pages = decode(frames)
    except ProtocolError:
        return
    assert_well_formed(msg, pages)


@pytest.mark.parametrize("kind", STRATEGIES)
@given(data=st.data())
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_mutated_frames_decode_or_raise_protocol_error(kind: str, data: st.DataObject) -> None:
    msg, pages = data.draw(STRATEGIES[kind])
    frames = encode(msg, pages)
    for how in data.draw(st.lists(mutations, min_size=1, max_size=4)):
        which = data.draw(st.integers(0, len(frames) - 1))
        frames[which] = mutate(frames[which], how)
    decode_or_refuse(frames)


@pytest.mark.parametrize("kind", STRATEGIES)
@given(data=st.data())
def test_frame_count_changes_are_refused(kind: str, data: st.DataObject) -> None:
    msg, pages = data.draw(STRATEGIES[kind])
    frames = encode(msg, pages)
    extra = data.draw(st.binary(max_size=8))
    assert_refused([*frames, extra])
    assert_refused(frames[:-1] if len(frames) == 2 else [])
    if pages is None:
        assert_refused([frames[0], b""])


@pytest.mark.parametrize("kind", STRATEGIES)
@given(data=st.data())
def test_mutated_fields_decode_or_raise_protocol_error(kind: str, data: st.DataObject) -> None:
    msg, pages = data.draw(STRATEGIES[kind])
    frames = encode(msg, pages)
    d = header_dict(msg)
    target = d["pool"] if isinstance(msg, Register) and data.draw(st.booleans()) else d
    key = data.draw(st.sampled_from(sorted(target)) | st.text(max_size=8))
    action = data.draw(st.sampled_from(["set", "delete"]))
    if action == "delete":
        target.pop(key, None)
    else:
        target[key] = data.draw(msgpack_values)
    decode_or_refuse([pack(d), *frames[1:]])


@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_random_bytes_decode_or_raise_protocol_error(frames: list[bytes]) -> None:
    decode_or_refuse(frames)


@given(value=msgpack_values, pages=st.binary(max_size=16))
def test_random_msgpack_is_refused(value: Any, pages: bytes) -> None:
    decode_or_refuse([pack(value)])
    decode_or_refuse([pack(value), pages])


# --------------------------------------------------------------------------------------------
# Explicit refusals, one per rule.


def test_wrong_frame_count() -> None:
    ping = encode(Ping(WIRE_VERSION, nonce=1, endpoint="tcp://10.0.0.1:1"))
    xfer = encode(transfer(1), np.array([1], np.int32))
    assert_refused([], "1 or 2 frames")
    assert_refused([*xfer, b""], "1 or 2 frames")
    assert_refused(xfer[:1], "Transfer has 2 frames")
    assert_refused([*ping, b""], "Ping has 1 frame")


def test_frames_must_be_bytes() -> None:
    ping = encode(Ping(WIRE_VERSION, nonce=1, endpoint="tcp://10.0.0.1:1"))
    assert_refused(["not bytes"], "must be bytes")
    assert_refused([None], "must be bytes")
    assert_refused(None, "sequence")  # type: ignore[arg-type]
    xfer = encode(transfer(1), np.array([1], np.int32))
    assert_refused([xfer[0], 5], "must be bytes")
    assert_refused([memoryview(ping[0] * 2)[::2]], "contiguous")


def test_oversized_header_is_refused_before_parsing() -> None:
    assert_refused([b"\x00" * (MAX_HEADER_BYTES + 1)], "exceeds the limit")


@pytest.mark.parametrize(
    "header",
    [b"", b"\xc1", b"\xff\xff\xff", b"not msgpack at all", b"\x85", b"\xdf\xff\xff\xff\xff"],
)
def test_non_msgpack_is_refused(header: bytes) -> None:
    assert_refused([header], "malformed")


DEEP = b"\x91" * (MAX_HEADER_BYTES - 64) + b"\x01"  # [[[...[1]...]]]


@pytest.mark.parametrize(
    "header",
    [
        b"\x82\xa1t\xa4ping\xa1v" + DEEP,  # nested where an int belongs
        b"\x83\xa1t\xa4ping\xa1v\x01\xa1x" + DEEP,  # nested under an unknown key
        b"\x83\xa1x" + DEEP + b"\xa1t\xa4ping\xa1v\x01",  # ... skipped while seeking the tag
        b"\x81\xa1x" * (MAX_HEADER_BYTES // 4) + b"\x01",  # nested maps
    ],
)
def test_deeply_nested_header_is_refused(header: bytes) -> None:
    assert len(header) <= MAX_HEADER_BYTES
    assert_refused([header], "malformed")


@pytest.mark.parametrize(
    ("field", "declared"),
    [
        ("engine_meta", b"\xc6\xff\xff\xff\xff"),  # bin32 of 4 GiB
        ("endpoint", b"\xdb\xff\xff\xff\xff"),  # str32 of 4 GiB
        ("session", b"\xdd\xff\xff\xff\xff"),  # array32 of 4 Gi items
        ("pool", b"\xdf\xff\xff\xff\xff"),  # map32 of 4 Gi pairs
    ],
)
def test_absurd_declared_lengths_are_refused(field: str, declared: bytes) -> None:
    d = header_dict(register())
    del d[field]
    d[field] = None
    header = pack(d)
    assert header.endswith(b"\xc0")  # the last key's value is nil: replace it
    assert_refused([header[:-1] + declared], "malformed")


@pytest.mark.parametrize("cut", [1, 2, 5, 10])
def test_truncated_header_is_refused(cut: int) -> None:
    frames = encode(register())
    assert_refused([frames[0][:-cut]], "malformed")


def test_trailing_bytes_after_header_are_refused() -> None:
    frames = encode(Pong(WIRE_VERSION, nonce=1, rank=0))
    assert_refused([frames[0] + b"\x00"], "malformed")


def test_unknown_tag() -> None:
    d = header_dict(Pong(WIRE_VERSION, nonce=1, rank=0))
    d["t"] = "frobnicate"
    assert_refused([pack(d)], "frobnicate")
    d["t"] = 3
    assert_refused([pack(d)], "malformed")
    del d["t"]
    assert_refused([pack(d)], "missing required field `t`")


@pytest.mark.parametrize("version", [0, 2, 99, 2**40])
def test_other_versions_are_refused(version: int) -> None:
    for msg in (Pong(WIRE_VERSION, nonce=1, rank=0), register(), transfer(1)):
        d = header_dict(msg)
        d["v"] = version
        assert_refused(
            [pack(d), b"\x01\x00\x00\x00"][: 1 + isinstance(msg, Transfer)],
            f"unsupported wire version {version}",
        )


def test_future_version_with_new_fields_says_version() -> None:
    d = {"t": "hello", "v": 2, "whatever": [1, 2, 3]}
    assert_refused([pack(d)], "unsupported wire version 2")


def test_missing_version_is_refused() -> None:
    d = header_dict(Pong(WIRE_VERSION, nonce=1, rank=0))
    del d["v"]
    assert_refused([pack(d)], "missing required field `v`")


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (Pong(WIRE_VERSION, nonce=1, rank=0), "rank"),
        (transfer(1), "num_pages"),
        (register(), "pool"),
    ],
)
def test_missing_field_is_refused(msg: Message, field: str) -> None:
    d = header_dict(msg)
    del d[field]
    assert_refused([pack(d), b""][: 1 + isinstance(msg, Transfer)], f"missing.*`{field}`")


def test_extra_field_is_refused() -> None:
    d = header_dict(Abort(WIRE_VERSION, room=1, epoch=1, endpoint="tcp://10.0.0.1:1"))
    d["surprise"] = 1
    assert_refused([pack(d)], "unknown field `surprise`")
    d = header_dict(register())
    d["pool"]["surprise"] = 1
    assert_refused([pack(d)], "unknown field `surprise`")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("room", "7"),
        ("room", 7.0),
        ("room", True),
        ("rank", None),
        ("ok", 1),
        ("reason", b"x"),
        ("epoch", [1]),
    ],
)
def test_wrong_typed_field_is_refused(field: str, value: Any) -> None:
    d = header_dict(Status(WIRE_VERSION, room=1, epoch=1, rank=0, ok=True))
    d[field] = value
    assert_refused([pack(d)], f"\\$\\.{field}")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("room", -1),
        ("room", 2**63),
        ("room", U64_MAX),
        ("epoch", -5),
        ("epoch", 2**63),
        ("aux_slot", -1),
        ("decode_rank", -1),
        ("decode_rank", 2**16),
        ("required", 0),
        ("required", 2**16 + 1),
        ("num_pages", -1),
        ("num_pages", MAX_TRANSFER_PAGES + 1),
        ("v", -1),
    ],
)
def test_out_of_range_ints_are_refused(field: str, value: int) -> None:
    d = header_dict(transfer(0))
    d[field] = value
    assert_refused([pack(d), b""])


def test_int_bounds_are_inclusive_where_valid() -> None:
    msg = transfer(
        0, room=I64_MAX, epoch=I64_MAX, aux_slot=I64_MAX, decode_rank=2**16 - 1, required=2**16
    )
    assert decode(encode(msg, np.zeros(0, np.int32)))[0] == msg
    big = MAX_TRANSFER_PAGES
    msg = transfer(big)
    got, pages = decode(encode(msg, np.zeros(big, np.int32)))
    assert got == msg and pages is not None and len(pages) == big


def test_string_and_bytes_bounds() -> None:
    assert_refused([pack(header_dict(Ping(WIRE_VERSION, 1, "x" * 257)))], "endpoint")
    assert_refused([pack(header_dict(Ping(WIRE_VERSION, 1, "")))], "endpoint")
    host = ".".join(["a" * 62, "b" * 61, "c" * 61, "d" * 61])  # tcp://HOST:1 is the longest
    assert len(f"tcp://{host}:1") == MAX_ENDPOINT_CHARS
    assert_refused([pack(header_dict(Ping(WIRE_VERSION, 1, f"tcp://{host}:1")))], "names a host")
    ok = Ping(WIRE_VERSION, 1, f"tcp://[ffff:{'ffff:' * 6}ffff%{'z' * 64}]:65535")
    assert decode(encode(ok))[0] == ok
    meta = register(engine_meta=b"m" * MAX_ENGINE_META_BYTES)
    assert decode(encode(meta))[0] == meta
    assert_refused(
        [pack(header_dict(register(engine_meta=b"m" * (MAX_ENGINE_META_BYTES + 1))))], "engine_meta"
    )
    assert_refused([pack(header_dict(register(engine="e" * 65)))], "engine")
    assert_refused([pack(header_dict(register(session="s" * 257)))], "session")


def test_buffer_bases_bound() -> None:
    many = pool(layout="mla", heads=1, num_layers=MAX_BUFFERS, buffer_bases=(0,) * MAX_BUFFERS)
    assert decode(encode(register(pool=many)))[0] == register(pool=many)
    d = header_dict(register(pool=many))
    d["pool"]["buffer_bases"].append(0)
    assert_refused([pack(d)], "buffer_bases")


def test_page_frame_length_must_be_4_per_page() -> None:
    header = encode(transfer(3), np.array([1, 2, 3], np.int32))[0]
    for body in (b"", b"\x01\x00\x00\x00" * 2, b"\x01\x00\x00\x00" * 4, b"\x01" * 11):
        assert_refused([header, body], "expected 4 \\* num_pages = 12")


@pytest.mark.parametrize("bad", [-1, -(2**31), MAX_POOL_PAGES, 2**31 - 1])
def test_negative_or_absurd_page_ids_are_refused(bad: int) -> None:
    header = encode(transfer(3), np.array([1, 2, 3], np.int32))[0]
    body = np.array([1, bad, 3], "<i4").tobytes()
    assert_refused([header, body], "page ids must lie in")
    with pytest.raises(ProtocolError, match="page ids must lie in"):
        encode(transfer(3), np.array([1, bad, 3], np.int64))


def test_register_with_bad_pool_is_refused() -> None:
    d = header_dict(register())
    d["pool"]["buffer_bases"] = d["pool"]["buffer_bases"][:3]
    assert_refused([pack(d)], "needs 4 buffers, got 3")
    d = header_dict(register())
    d["pool"]["layout"] = "gqa"
    assert_refused([pack(d)], "layout")
    d = header_dict(register())
    d["pool"]["aux_base"] = U64_MAX
    assert_refused([pack(d)], "aux buffer")


def test_register_rank_must_be_below_tp() -> None:
    d = header_dict(register(decode_rank=2, decode_tp=2))
    assert_refused([pack(d)], "decode_rank 2 is not below decode_tp 2")


# --------------------------------------------------------------------------------------------
# encode refuses what decode would refuse.


def test_encode_refuses_pages_where_none_belong() -> None:
    with pytest.raises(ProtocolError, match="Pong carries no page ids"):
        encode(Pong(WIRE_VERSION, 1, 0), np.zeros(0, np.int32))


@pytest.mark.parametrize(
    ("pages", "match"),
    [
        (None, "needs its page ids"),
        (np.array([1, 2], np.int32), "num_pages=3 but carries 2"),
        (np.array([1, 2, 3, 4], np.int32), "num_pages=3 but carries 4"),
        (np.array([1.0, 2.0, 3.0]), "integer array"),
        (np.array([True, False, True]), "integer array"),
        (np.array([[1, 2, 3]], np.int32), "1-D"),
        (np.array([1, 2, 2**40], np.int64), "page ids must lie in"),
        (np.array([1, 2, 2**64 - 1], np.uint64), "page ids must lie in"),
        ([[1], [2, 3], 4], "not an array|integer array"),
    ],
)
def test_encode_refuses_bad_transfer_pages(pages: Any, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        encode(transfer(3), pages)


@pytest.mark.parametrize(
    "msg",
    [
        Pong(2, nonce=1, rank=0),
        Pong(WIRE_VERSION, nonce=-1, rank=0),
        Pong(WIRE_VERSION, nonce=2**64, rank=0),
        Ping(WIRE_VERSION, nonce=1, endpoint=""),
        Ping(WIRE_VERSION, nonce=1, endpoint=5),  # type: ignore[arg-type]
        Abort(WIRE_VERSION, room=1, epoch=np.int64(1), endpoint="x"),  # type: ignore[arg-type]
        Status(WIRE_VERSION, room=1, epoch=1, rank=0, ok=1),  # type: ignore[arg-type]
        register(pool=pool(num_layers=3)),
        register(decode_rank=5, decode_tp=2),
        "ping",
    ],
)
def test_encode_refuses_invalid_messages(msg: Any) -> None:
    with pytest.raises(ProtocolError, match="encode"):
        encode(msg)


# --------------------------------------------------------------------------------------------
# PoolWire <-> PoolSpec.


@given(wire=pools())
def test_pool_spec_round_trip(wire: PoolWire) -> None:
    spec = wire.to_spec()
    assert isinstance(spec, PoolSpec)
    assert isinstance(spec.buffer_bases, tuple)
    assert PoolWire.from_spec(spec) == wire
    assert PoolWire.from_spec(spec).to_spec() == spec


def test_pool_from_spec_copies_every_field() -> None:
    spec = PoolSpec("mla", 64, 1000, 3, 576, 1, 0, (10, 20, 30), 4096, 32, 8)
    wire = PoolWire.from_spec(spec)
    assert msgspec.structs.asdict(wire) == {
        "layout": "mla", "page_size": 64, "num_pages": 1000, "num_layers": 3,
        "head_bytes": 576, "heads": 1, "first_head": 0, "buffer_bases": (10, 20, 30),
        "aux_base": 4096, "aux_item_len": 32, "aux_slots": 8, "page_layout": "nhd",
        "buffer_head_bytes": (), "page_strides": (),
        "extra_aux": msgspec.UNSET,  # one aux buffer: left off the wire
        "states": msgspec.UNSET,  # no state components: left off the wire
        "kv_dtype": msgspec.UNSET,  # "unknown": left off the wire
    }  # fmt: skip
    assert wire.to_spec() == spec


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"layout": "gqa"}, "layout"),
        ({"page_size": 0}, "page_size"),
        ({"num_pages": 0}, "num_pages"),
        ({"num_pages": MAX_POOL_PAGES + 1}, "num_pages"),
        ({"head_bytes": -4}, "head_bytes"),
        ({"heads": 0}, "heads"),
        ({"first_head": -1}, "first_head"),
        ({"aux_item_len": 0}, "aux_item_len"),
        ({"aux_slots": 0}, "aux_slots"),
        ({"aux_base": -1}, "aux_base"),
        ({"aux_base": 2**64}, "aux_base"),
        ({"page_size": True}, "page_size"),
        ({"page_size": 16.0}, "page_size"),
        ({"num_layers": 0, "buffer_bases": ()}, "num_layers"),
        ({"num_layers": 3}, "needs 6 buffers, got 4"),
        ({"buffer_bases": (1, 2, 3)}, "needs 4 buffers, got 3"),
        ({"layout": "mla"}, "needs 2 buffers, got 4"),
        ({"layout": "mla", "buffer_bases": (1, 2), "heads": 2}, "mla pool must have heads=1"),
        ({"layout": "mla", "buffer_bases": (1, 2), "first_head": 1}, "first_head=0"),
        ({"buffer_bases": (1, 2, -3, 4)}, r"buffer_bases\[2\]"),
        ({"buffer_bases": (1, 2, 3, 2**64)}, r"buffer_bases\[3\]"),
        ({"buffer_bases": (1, "2", 3, 4)}, r"buffer_bases\[1\]"),
        ({"buffer_bases": 1234}, "sequence"),
        ({"buffer_bases": (1, 2, 3, 2**64 - 100)}, "buffer 3 .* runs past"),
        ({"aux_base": 2**64 - 64 * 32 + 1}, "aux buffer .* runs past"),
        ({"page_layout": "thd"}, "page_layout"),
        ({"buffer_head_bytes": (256, 256, 128)}, "buffer_head_bytes must be empty or one"),
        ({"buffer_head_bytes": (256, 256, 0, 128)}, r"buffer_head_bytes\[2\]"),
        ({"page_strides": (1 << 20,) * 3}, "page_strides must be empty or one"),
        ({"page_strides": (16384, 16384, 16383, 16384)}, r"page_strides\[2\] is 16383"),
        ({"buffer_head_bytes": (256, 256, 256, 512), "page_strides": (16384,) * 4},
         r"page_strides\[3\] is 16384, less than the 32768"),
        ({"page_strides": (16384, 16384, 16384, 1 << 40),
          "buffer_bases": (1, 2, 3, 2**64 - (1 << 40) * 99 - 100)}, "buffer 3 .* runs past"),
    ],
)
def test_pool_to_spec_sanity_errors(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        pool(**changes).to_spec()


def test_pool_to_spec_edges_are_valid() -> None:
    item = 16 * 4 * 256
    end = pool(buffer_bases=(0, 1, 2, 2**64 - 100 * item), aux_base=2**64 - 64 * 32)
    assert end.to_spec().buffer_bases[3] == 2**64 - 100 * item
    assert pool(buffer_bases=[1, 2, 3, 4]).to_spec().buffer_bases == (1, 2, 3, 4)


# --------------------------------------------------------------------------------------------
# Several aux buffers (PoolWire.extra_aux).

EXTRA = ((0xA000_0000, 24), (0xB000_0000, 41))


@st.composite
def pools_with_extra_aux(draw: st.DrawFn) -> PoolWire:
    base = draw(pools())
    slots = base.aux_slots
    rows = draw(st.lists(small_pos, min_size=1, max_size=8))
    extra = tuple((draw(st.integers(0, 2**64 - slots * n)), n) for n in rows)
    return msgspec.structs.replace(base, extra_aux=extra)


@given(wire=pools_with_extra_aux())
def test_pool_with_extra_aux_round_trips(wire: PoolWire) -> None:
    spec = wire.to_spec()
    assert spec.extra_aux == wire.extra_aux and spec.num_aux == 1 + len(wire.extra_aux)
    assert PoolWire.from_spec(spec) == wire
    msg = register(pool=wire)
    assert decode(encode(msg)) == (msg, None)


def test_pool_without_extra_aux_is_on_the_wire_as_before() -> None:
    """No extra aux buffers: the field is left off the header, byte for byte as before."""
    plain = header_dict(register(pool=PoolWire.from_spec(pool().to_spec())))
    assert "extra_aux" not in plain["pool"]
    spec = pool(extra_aux=EXTRA).to_spec()
    assert header_dict(register(pool=PoolWire.from_spec(spec)))["pool"]["extra_aux"] == [
        list(p) for p in EXTRA
    ]
    assert decode([pack(plain)])[0] == register()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (tuple((0xA000_0000 + 4096 * i, 8) for i in range(MAX_AUX_BUFFERS)), "at most 63"),
        (((0xA000_0000, 0),), r"extra_aux\[0\] row bytes"),
        (((0xA000_0000, 24), (0xB000_0000, -8)), r"extra_aux\[1\] row bytes"),
        (((0xA000_0000, True),), r"extra_aux\[0\] row bytes"),
        (((-1, 24),), r"extra_aux\[0\] base"),
        (((2**64, 24),), r"extra_aux\[0\] base"),
        (((2**64 - 32 * 24 + 1, 24),), "aux buffer 1 .* runs past"),
        (((0xA000_0000, 24, 1),), r"extra_aux\[0\] must be a \(base, row bytes\) pair"),
        (5, "extra_aux must be a sequence"),
    ],
)
def test_pool_extra_aux_errors(extra: Any, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        pool(extra_aux=extra).to_spec()
    if not isinstance(extra, int):
        with pytest.raises(ProtocolError):  # encode() is the gate on the way out
            encode(register(pool=pool(extra_aux=extra)))


def test_pool_extra_aux_edges_are_valid() -> None:
    limit = tuple((0xA000_0000 + 4096 * i, 8) for i in range(MAX_AUX_BUFFERS - 1))
    assert pool(extra_aux=limit).to_spec().num_aux == MAX_AUX_BUFFERS
    assert pool(extra_aux=((2**64 - 32 * 24, 24),)).to_spec().aux_bases[1] == 2**64 - 32 * 24
    assert pool(extra_aux=[[1, 2]]).to_spec().extra_aux == ((1, 2),)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ([[0xA000_0000 + 4096 * i, 8] for i in range(MAX_AUX_BUFFERS)], "extra_aux"),
        ([[0xA000_0000, 0]], "extra_aux"),
        ([[-1, 24]], "extra_aux"),
        ([[0xA000_0000, 24, 1]], "extra_aux"),
        ([[0xA000_0000]], "extra_aux"),
        ([[U64_MAX - 100, 24]], "aux buffer 1 .* runs past"),
        ([["a", 24]], "extra_aux"),
        ({"base": 1}, "extra_aux"),
    ],
)
def test_register_with_bad_extra_aux_is_refused(extra: Any, match: str) -> None:
    d = header_dict(register())
    d["pool"]["extra_aux"] = extra
    assert_refused([pack(d)], match)


# --------------------------------------------------------------------------------------------
# encode's cheap self-check (_plainly_valid) refuses exactly what decoding the header refuses.


class _Int(int):
    pass


class _Str(str):
    pass


_TRICKY_INTS: list[Any] = [
    0, 1, 2, -1, -(2**63), 2**16 - 1, 2**16, 2**16 + 1, MAX_TRANSFER_PAGES, MAX_TRANSFER_PAGES + 1,
    MAX_POOL_PAGES - 1, MAX_POOL_PAGES, MAX_POOL_PAGES + 1, I64_MAX, I64_MAX + 1, U64_MAX,
    U64_MAX + 1, True, False, 1.0, 0.0, None, "1", b"1", _Int(1), _Int(-1), np.int64(1),
]
_ints = st.one_of(st.sampled_from(_TRICKY_INTS), st.integers(-3, 70_000))
_versions = st.sampled_from([WIRE_VERSION, 0, WIRE_VERSION + 1, True, 1.0, _Int(WIRE_VERSION)])
_endpoints = st.sampled_from([
    "tcp://127.0.0.1:5555", "tcp://[::1]:1", "tcp://example.com:1", "", "tcp://127.0.0.1:0",
    "tcp://127.0.0.1:" + "1" * 300, _Str("tcp://127.0.0.1:5555"), b"tcp://127.0.0.1:1", None,
    "tcp://127.0.0.1:5555\ud800", "ipc:///tmp/x", 5,
])
_bools = st.sampled_from([True, False, 0, 1, None, "x", np.bool_(True)])
_reasons = st.sampled_from([
    "", "x", "é" * MAX_REASON_CHARS, "x" * (MAX_REASON_CHARS + 1),
    _Str("y" * (MAX_REASON_CHARS + 5)), _Str(""), 5, None, b"x", "\ud800",
])
_state_slots = st.sampled_from([msgspec.UNSET, (), ((1, 2),), ((-1,),), [[1]], None, ((True,),)])


def _outcome(msg: Message, pages: Any, *, fast: bool) -> object:
    """encode's frames, or the type and text of what it raised; ``fast=False`` always
    decodes the header (the reference the cheap check must agree with)."""
    with pytest.MonkeyPatch.context() as mp:
        if not fast:
            mp.setattr(_wire, "_plainly_valid", lambda msg: False)
        try:
            return encode(msg, pages)
        except Exception as exc:  # (compared, whatever it is)
            return (type(exc), str(exc))


def _pages_for(num: Any) -> np.ndarray[Any, Any]:
    n = num if type(num) is int and 0 <= num <= 8 else 2
    return np.arange(n, dtype=np.int32)


_TRANSFER_FIELDS: dict[str, tuple[Any, st.SearchStrategy[Any]]] = {
    "v": (WIRE_VERSION, _versions),
    "room": (7, _ints),
    "epoch": (1, _ints),
    "endpoint": ("tcp://10.0.0.2:5000", _endpoints),
    "decode_rank": (0, _ints),
    "aux_slot": (4, _ints),
    "required": (2, _ints),
    "num_pages": (2, _ints),
    "prefix_pages": (0, _ints),
    "state_slots": (msgspec.UNSET, _state_slots),
    "landing": (False, _bools),
}
_STATUS_FIELDS: dict[str, tuple[Any, st.SearchStrategy[Any]]] = {
    "v": (WIRE_VERSION, _versions),
    "room": (7, _ints),
    "epoch": (1, _ints),
    "rank": (0, _ints),
    "ok": (True, _bools),
    "reason": ("", _reasons),
}


def test_the_self_check_tests_vary_every_field() -> None:
    """A field added to Transfer or Status is drawn by the agreement tests below (and must
    then be checked by _plainly_valid): left out of these tables, they would never vary
    it, and a cheap check that let its bad values through would pass them."""
    assert tuple(_TRANSFER_FIELDS) == Transfer.__struct_fields__
    assert tuple(_STATUS_FIELDS) == Status.__struct_fields__


def _draw_fields(
    data: st.DataObject, fields: dict[str, tuple[Any, st.SearchStrategy[Any]]]
) -> dict[str, Any]:
    """A valid message's fields with up to three of them replaced by anything from their
    pool (a refusal is found one field at a time)."""
    values = {name: good for name, (good, _) in fields.items()}
    for name in data.draw(st.sets(st.sampled_from(sorted(fields)), max_size=3)):
        values[name] = data.draw(fields[name][1], label=name)
    return values


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_cheap_self_check_of_a_transfer_agrees_with_decoding(data: st.DataObject) -> None:
    """Whatever the fields hold, encode answers exactly as when it decodes the header
    again: the same frames, or the same refusal. (With the cheap check taking a negative
    room, a bool rank or a host name, this fails.)"""
    msg = Transfer(**_draw_fields(data, _TRANSFER_FIELDS))
    pages = _pages_for(msg.num_pages)
    assert _outcome(msg, pages, fast=True) == _outcome(msg, pages, fast=False)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_cheap_self_check_of_a_status_agrees_with_decoding(data: st.DataObject) -> None:
    msg = Status(**_draw_fields(data, _STATUS_FIELDS))
    assert _outcome(msg, None, fast=True) == _outcome(msg, None, fast=False)


def test_the_cheap_self_check_takes_the_messages_every_request_sends() -> None:
    """It is the path taken (not only agreeing by falling back every time)."""
    assert _wire._plainly_valid(transfer())
    assert _wire._plainly_valid(Status(WIRE_VERSION, room=1, epoch=2, rank=0, ok=True))
    assert not _wire._plainly_valid(Abort(WIRE_VERSION, room=1, epoch=2, endpoint="tcp://1.2.3.4:5"))
