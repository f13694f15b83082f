"""Generators for the fuzz session: valid control messages drawn with ``random.Random`` (fast
enough for a million inputs, where hypothesis is not), the ways to spoil them, and the check
of what :func:`trio_pd.core._wire.decode` may return.

Every mutation is a pure function of the generator's state, so a failing input is found again
from its seed and index (the tests print both, and the frames, for anything that escapes).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from trio_pd.core import _wire
from trio_pd.core._wire import (
    MAX_BUFFERS,
    MAX_ENDPOINT_CHARS,
    MAX_ENGINE_META_BYTES,
    MAX_HEADER_BYTES,
    MAX_NAME_CHARS,
    MAX_POOL_PAGES,
    MAX_RANKS,
    MAX_REASON_CHARS,
    MAX_SESSION_CHARS,
    MAX_TRANSFER_PAGES,
    WIRE_VERSION,
    numeric_endpoint,
)

V = WIRE_VERSION
I64_MAX = (1 << 63) - 1
U64_MAX = (1 << 64) - 1
TAGS = ("register", "transfer", "status", "abort", "abort_ack", "ping", "pong", "bye")
Frames = list[Any]

# ------------------------------------------------------------------------ valid messages


def rand_endpoint(rng: random.Random, *, loopback_only: bool = False) -> str:
    port = rng.choice([1, 2, 80, 5555, 65535, rng.randint(1, 65535)])
    if loopback_only:
        return f"tcp://127.0.0.1:{port}"
    # (numeric only: a name in a control message is refused, see HOSTILE's named hosts)
    kind = rng.randrange(3)
    if kind == 0:
        host = ".".join(str(rng.randrange(256)) for _ in range(4))
    elif kind == 1:
        host = "[" + ":".join(f"{rng.randrange(1 << 16):x}" for _ in range(8)) + "]"
    else:
        host = rng.choice(["[::1]", "[fe80::1%eth0]", "127.0.0.1"])
    return f"tcp://{host}:{port}"


def rand_pool(rng: random.Random) -> _wire.PoolWire:
    layout = rng.choice(["mha", "mla"])
    num_layers = rng.choice([1, 2, 3, 32, rng.randint(1, 64)])
    heads, first_head = (rng.randint(1, 16), rng.randint(0, 16)) if layout == "mha" else (1, 0)
    page_size = rng.choice([1, 4, 16, 64])
    head_bytes = rng.choice([16, 128, 256, 512])
    num_pages = rng.choice([1, 256, 1 << 20, MAX_POOL_PAGES, rng.randint(1, 1 << 16)])
    buffer_len = num_pages * page_size * heads * head_bytes
    n = num_layers * (2 if layout == "mha" else 1)
    top = (1 << 64) - buffer_len
    bases = tuple(rng.choice([0, top, rng.randrange(top + 1)]) for _ in range(n))
    aux_item_len = rng.choice([1, 64, 4096])
    aux_slots = rng.choice([1, 32, 1 << 20])
    aux_base = rng.randrange((1 << 64) - aux_item_len * aux_slots + 1)
    return _wire.PoolWire(
        layout=layout, page_size=page_size, num_pages=num_pages, num_layers=num_layers,
        head_bytes=head_bytes, heads=heads, first_head=first_head, buffer_bases=bases,
        aux_base=aux_base, aux_item_len=aux_item_len, aux_slots=aux_slots,
        states=rand_states(rng),
    )


def rand_states(rng: random.Random) -> tuple[_wire.StateWire, ...] | msgspec.UnsetType:
    """None most of the time; else 1 to 3 state components, each split one of the three
    ways, every buffer inside the 64-bit address space."""
    if rng.random() < 0.7:
        return msgspec.UNSET
    out = []
    for k in range(rng.randint(1, 3)):
        slots = rng.choice([1, 8, 1 << 20])
        how = rng.randrange(3)
        bufs, segs = [], []
        for _ in range(rng.randint(1, 4)):
            seg = tuple((rng.choice([1, 16, 64]), rng.randint(1, 4))
                        for _ in range(rng.randint(1, 3)))
            n = sum(ub * u for ub, u in seg)
            bufs.append((rng.randrange((1 << 64) - slots * n + 1), n))
            segs.append(seg)
        out.append(_wire.StateWire(f"s{k}", slots, tuple(bufs), how == 1,
                                   tuple(segs) if how == 2 else ()))
    return tuple(out)


def rand_id(rng: random.Random) -> int:
    return rng.choice([0, 1, I64_MAX, rng.randrange(1 << 16), rng.randrange(I64_MAX + 1)])


def rand_text(rng: random.Random, lo: int, hi: int) -> str:
    n = rng.choice([lo, hi, rng.randint(lo, min(hi, lo + 16))])
    alphabet = rng.choice(["abcxyz0123:.", "é€\U0001f600\x00 ", "tcp://127.0.0.1:"])
    return "".join(rng.choices(alphabet, k=n))


def rand_message(rng: random.Random) -> tuple[_wire.Message, np.ndarray[Any, Any] | None]:
    """One valid message of a random type (every field inside its documented bound)."""
    kind = rng.choice(TAGS)
    if kind == "register":
        tp = rng.choice([1, 2, 8, MAX_RANKS, rng.randint(1, 64)])
        return _wire.Register(
            V, endpoint=rand_endpoint(rng), decode_rank=rng.randrange(tp), decode_tp=tp,
            engine=rand_text(rng, 1, MAX_NAME_CHARS), session=rand_text(rng, 0, MAX_SESSION_CHARS),
            engine_meta=rng.randbytes(rng.choice([0, 16, 300])), pool=rand_pool(rng),
        ), None
    if kind == "transfer":
        n = rng.choice([0, 1, 3, 64, rng.randint(0, 300)])
        top = rng.choice([1, 256, MAX_POOL_PAGES])
        pages = np.array([rng.randrange(top) for _ in range(n)], dtype=np.int32)
        slots: tuple[tuple[int, ...], ...] | msgspec.UnsetType = msgspec.UNSET
        if rng.random() < 0.3:
            slots = tuple(tuple(rand_id(rng) for _ in range(rng.choice([0, 1, 4])))
                          for _ in range(rng.randint(0, 3)))
        return _wire.Transfer(
            V, room=rand_id(rng), epoch=rand_id(rng), endpoint=rand_endpoint(rng),
            decode_rank=rng.randrange(MAX_RANKS), aux_slot=rand_id(rng),
            required=rng.randint(1, MAX_RANKS), num_pages=n, state_slots=slots,
        ), pages
    if kind == "status":
        return _wire.Status(
            V, room=rand_id(rng), epoch=rand_id(rng), rank=rng.randrange(MAX_RANKS),
            ok=rng.random() < 0.5, reason=rand_text(rng, 0, MAX_REASON_CHARS),
        ), None
    if kind == "abort":
        return _wire.Abort(V, room=rand_id(rng), epoch=rand_id(rng),
                           endpoint=rand_endpoint(rng)), None
    if kind == "abort_ack":
        return _wire.AbortAck(V, room=rand_id(rng), epoch=rand_id(rng),
                              rank=rng.randrange(MAX_RANKS)), None
    if kind == "ping":
        return _wire.Ping(V, nonce=rand_id(rng), endpoint=rand_endpoint(rng)), None
    if kind == "bye":
        return _wire.Bye(V, rank=rng.randrange(MAX_RANKS), endpoint=rand_endpoint(rng)), None
    return _wire.Pong(V, nonce=rand_id(rng), rank=rng.randrange(MAX_RANKS)), None


# ------------------------------------------------------------------------ hostile values

#: field values at and past every bound, of every wrong type (each one msgpack can encode)
HOSTILE: list[Any] = [
    0, 1, -1, 2, 3, -(1 << 63), I64_MAX, 1 << 63, U64_MAX,
    MAX_RANKS - 1, MAX_RANKS, MAX_RANKS + 1, MAX_BUFFERS, MAX_BUFFERS + 1,
    MAX_TRANSFER_PAGES, MAX_TRANSFER_PAGES + 1, MAX_POOL_PAGES - 1, MAX_POOL_PAGES,
    MAX_POOL_PAGES + 1, 1 << 31, (1 << 31) - 1, -(1 << 31), 1 << 32,
    0.0, 1.0, 1.5, -0.0, math.nan, math.inf, -math.inf,
    True, False, None,
    "", "x", "1", "garbage", "tcp://", "tcp://*:1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:1",
    "ipc:///tmp/x", "tcp://[::1]:1", "tcp://127.0.0.1:65536", "tcp://127.0.0.1:1\x00",
    "x" * (MAX_ENDPOINT_CHARS + 1), "tcp://" + "a" * (MAX_ENDPOINT_CHARS - 8) + ":1",
    # well-formed names: libzmq would resolve them on its I/O thread (a resolver that never
    # answers stalled every peer), so a control message may not carry one
    "tcp://localhost:1", "tcp://stall.invalid:5555", "tcp://a-9.example:80",
    "é" * MAX_NAME_CHARS, "é" * (MAX_NAME_CHARS + 1), "y" * (MAX_SESSION_CHARS + 1),
    "r" * MAX_REASON_CHARS, "r" * (MAX_REASON_CHARS + 1), "\U0010ffff",
    "mha", "mla", "gqa", *TAGS, "PING", "transfer\x00",
    b"", b"\x00", b"\x00" * 300, b"1",
    [], [1], [1, 2, 3, 4], [[[[[]]]]], [None] * 5, list(range(9)),
    {}, {"t": "ping"}, {"v": 1}, {1: 2},
]


def rand_msgpack(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-encodable value, nested at most three levels."""
    kind = rng.randrange(9 if depth < 3 else 7)
    if kind == 0:
        return rng.choice(HOSTILE)
    if kind == 1:
        return rng.randint(-(1 << 63), U64_MAX)
    if kind == 2:
        return rng.random() * 10 ** rng.randint(-5, 30)
    if kind == 3:
        return rng.randbytes(rng.randrange(20))
    if kind == 4:
        return rand_text(rng, 0, 30)
    if kind == 5:
        return rng.choice(TAGS)
    if kind == 6:
        return rng.choice([None, True, False])
    if kind == 7:
        return [rand_msgpack(rng, depth + 1) for _ in range(rng.randrange(5))]
    keys = [rng.choice([*TAGS, "t", "v", "room", "pool", "x"]) for _ in range(rng.randrange(5))]
    return {k: rand_msgpack(rng, depth + 1) for k in keys}


# ------------------------------------------------------------------------ mutations


@dataclass
class Base:
    """A valid message, encoded, and its header as a map (mutated copies are re-packed)."""

    frames: list[bytes]
    header: dict[str, Any]


def make_base(msg: _wire.Message, pages: np.ndarray[Any, Any] | None = None) -> Base:
    frames = _wire.encode(msg, pages)
    header = msgspec.msgpack.decode(frames[0])
    assert isinstance(header, dict)
    return Base(frames, header)


_HUGE: dict[str, bytes] = {}


def huge(name: str) -> bytes:
    """Big frames, made once and reused (decode must refuse them by size, or take them)."""
    if name not in _HUGE:
        if name == "header+1":
            _HUGE[name] = b"\xc4" + b"\x00" * MAX_HEADER_BYTES
        elif name == "header=max":  # a str of exactly the limit: msgpack, refused by bound
            body = MAX_HEADER_BYTES - 5
            _HUGE[name] = b"\xdb" + body.to_bytes(4, "big") + b"a" * body
        elif name == "pages16M":
            _HUGE[name] = b"\x00" * (4 * MAX_TRANSFER_PAGES)
        elif name == "pages16M+4":
            _HUGE[name] = b"\x00" * (4 * MAX_TRANSFER_PAGES + 4)
        elif name == "meta=max":
            msg = _wire.Register(
                V, endpoint="tcp://127.0.0.1:1", decode_rank=0, decode_tp=1, engine="e",
                session="s", engine_meta=b"\x01" * MAX_ENGINE_META_BYTES,
                pool=rand_pool(random.Random(0)),
            )
            _HUGE[name] = _wire.encode(msg)[0]
        elif name == "meta+1":
            d = msgspec.msgpack.decode(huge("meta=max"))
            d["engine_meta"] = b"\x01" * (MAX_ENGINE_META_BYTES + 1)
            _HUGE[name] = msgspec.msgpack.encode(d)
        elif name == "nested":
            _HUGE[name] = b"\x91" * 200_000 + b"\x00"
        elif name == "random1M":
            _HUGE[name] = random.Random(1).randbytes(1 << 20)
    return _HUGE[name]


HUGE_NAMES = ("header+1", "header=max", "pages16M", "pages16M+4", "meta=max", "meta+1",
              "nested", "random1M")


def _pack(d: Any) -> bytes:
    return msgspec.msgpack.encode(d)


def _flip(rng: random.Random, frame: bytes, n: int) -> bytes:
    if not frame:
        return frame
    b = bytearray(frame)
    for _ in range(n):
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


class Mutator:
    """Draws one hostile input at a time: a class name and the frames.

    ``huge_every``: about one input in this many is of the ``huge`` class (big frames cost
    memory bandwidth, not coverage). ``endpoints``: the reply endpoints hostile fields may
    name (the live fuzz keeps them on loopback); None means any.
    """

    def __init__(
        self,
        rng: random.Random,
        bases: Sequence[Base],
        *,
        huge_every: int = 1000,
        endpoints: Sequence[str] | None = None,
        classes: Sequence[str] | None = None,
    ) -> None:
        self.rng = rng
        self.bases = list(bases)
        self.huge_every = huge_every
        self.hostile = [
            h for h in HOSTILE
            if endpoints is None or not isinstance(h, str) or not h.startswith("tcp://")
            or _is_bad_endpoint(h)
        ] + list(endpoints or ())
        self.table: dict[str, Callable[[], Frames]] = {
            "valid": self.valid,
            "flip": self.flip,
            "insert_delete": self.insert_delete,
            "truncate_extend": self.truncate_extend,
            "frames": self.frames,
            "field": self.field,
            "tag_version": self.tag_version,
            "keys": self.keys,
            "pages": self.pages,
            "splice": self.splice,
            "random_bytes": self.random_bytes,
            "random_msgpack": self.random_msgpack,
            "frame_types": self.frame_types,
            "huge": self.huge,
        }
        self.names = [n for n in (classes or self.table) if n != "huge"]
        self.with_huge = classes is None or "huge" in classes

    def draw(self) -> tuple[str, Frames]:
        if self.with_huge and self.rng.random() * self.huge_every < 1:
            name = "huge"
        else:
            name = self.rng.choice(self.names)
        return name, self.table[name]()

    def _base(self) -> Base:
        return self.rng.choice(self.bases)

    # -- the classes

    def valid(self) -> Frames:
        return list(self._base().frames)

    def flip(self) -> Frames:
        frames = list(self._base().frames)
        i = self.rng.randrange(len(frames))
        frames[i] = _flip(self.rng, frames[i], self.rng.choice([1, 1, 2, 4, 8]))
        return frames

    def insert_delete(self) -> Frames:
        frames = list(self._base().frames)
        i = self.rng.randrange(len(frames))
        b = bytearray(frames[i])
        at = self.rng.randrange(len(b) + 1)
        if self.rng.random() < 0.5 or not b:
            b[at:at] = self.rng.randbytes(self.rng.randint(1, 8))
        else:
            del b[at : at + self.rng.randint(1, 8)]
        frames[i] = bytes(b)
        return frames

    def truncate_extend(self) -> Frames:
        frames = list(self._base().frames)
        i = self.rng.randrange(len(frames))
        f = frames[i]
        if self.rng.random() < 0.5:
            frames[i] = f[: self.rng.randrange(len(f) + 1)]
        else:
            extra = self.rng.choice([b"\x00", b"\xc0", self.rng.randbytes(8), f])
            frames[i] = f + extra
        return frames

    def frames(self) -> Frames:
        frames = list(self._base().frames)
        how = self.rng.randrange(5)
        if how == 0:
            del frames[self.rng.randrange(len(frames))]
        elif how == 1:
            frames.insert(self.rng.randrange(len(frames) + 1), self.rng.choice(frames))
        elif how == 2:
            frames.reverse() if len(frames) > 1 else frames.append(b"")
        elif how == 3:
            frames.append(self.rng.randbytes(self.rng.choice([0, 4, 8, 12])))
        else:
            frames = frames * self.rng.randint(2, 3)
        return frames

    def _hostile_value(self) -> Any:
        return self.rng.choice(self.hostile) if self.rng.random() < 0.8 else rand_msgpack(
            self.rng
        )

    def field(self) -> Frames:
        base = self._base()
        d = dict(base.header)
        key = self.rng.choice(sorted(d))
        if key == "pool" and isinstance(d[key], dict) and self.rng.random() < 0.7:
            pool = dict(d[key])
            pkey = self.rng.choice(sorted(pool))
            if pkey == "buffer_bases" and self.rng.random() < 0.5:
                bases = list(pool[pkey])
                if bases:
                    bases[self.rng.randrange(len(bases))] = self._hostile_value()
                pool[pkey] = bases
            else:
                pool[pkey] = self._hostile_value()
            d[key] = pool
        else:
            d[key] = self._hostile_value()
        return [_pack(d), *base.frames[1:]]

    def tag_version(self) -> Frames:
        base = self._base()
        d = dict(base.header)
        if self.rng.random() < 0.5:
            d["t"] = self.rng.choice([*TAGS, "", "Ping", "format_disk", 1, None, b"ping", ["ping"]])
        else:
            d["v"] = self.rng.choice([0, 2, -1, V + 1, I64_MAX, U64_MAX, "1", 1.0, True, None])
        if self.rng.random() < 0.1:
            del d[self.rng.choice(["t", "v"])]
        return [_pack(d), *base.frames[1:]]

    def keys(self) -> Frames:
        base = self._base()
        d = dict(base.header)
        how = self.rng.randrange(4)
        if how == 0:
            del d[self.rng.choice(sorted(d))]
        elif how == 1:
            d[self.rng.choice(["extra", "T", "room ", "pool", "nonce", "rank"])] = 1
        elif how == 2:  # a key twice: raw msgpack, one more map entry than the map has
            header = base.frames[0]
            if 0x80 <= header[0] < 0x8F:
                key = self.rng.choice(sorted(d))
                dup = _pack(key) + _pack(self.rng.choice([d[key], self._hostile_value()]))
                return [bytes([header[0] + 1]) + header[1:] + dup, *base.frames[1:]]
        else:
            d = {self.rng.choice([1, b"t", None]) if k == "t" else k: v for k, v in d.items()}
        return [_pack(d), *base.frames[1:]]

    def pages(self) -> Frames:
        transfers = [b for b in self.bases if b.header.get("t") == "transfer"]
        if not transfers:
            return self.flip()
        base = self.rng.choice(transfers)
        n = int(base.header["num_pages"])
        how = self.rng.randrange(6)
        if how == 0:
            ids = np.array([self.rng.choice([-1, -(1 << 31), MAX_POOL_PAGES, (1 << 31) - 1,
                                             0, 1]) for _ in range(max(n, 1))], "<i4")
            d = {**base.header, "num_pages": len(ids)}
            return [_pack(d), ids.tobytes()]
        if how == 1:
            return [base.frames[0], base.frames[1] + b"\x00" * self.rng.choice([1, 3, 4, 8])]
        if how == 2:
            d = {**base.header, "num_pages": self.rng.choice([0, n + 1, max(n - 1, 0),
                                                              MAX_TRANSFER_PAGES])}
            return [_pack(d), base.frames[1]]
        if how == 3:
            return [base.frames[0], np.frombuffer(base.frames[1], "<i4").astype(">i4").tobytes()]
        if how == 4:
            ids = np.array([self.rng.randrange(-(1 << 31), 1 << 31) for _ in range(n)], "<i4")
            return [base.frames[0], ids.tobytes()]
        return [base.frames[0], _flip(self.rng, base.frames[1], 1)]

    def splice(self) -> Frames:
        a, b = self._base(), self._base()
        how = self.rng.randrange(3)
        if how == 0:
            return [a.frames[0], *b.frames[1:]]
        if how == 1:
            return [a.frames[0] + b.frames[0], *a.frames[1:]]
        cut = self.rng.randrange(len(a.frames[0]) + 1)
        return [a.frames[0][:cut] + b.frames[0][cut:], *a.frames[1:]]

    def random_bytes(self) -> Frames:
        return [self.rng.randbytes(self.rng.choice([0, 1, 2, 8, 64, self.rng.randrange(600)]))
                for _ in range(self.rng.choice([1, 1, 1, 2, 3, 0]))]

    def random_msgpack(self) -> Frames:
        if self.rng.random() < 0.5:
            d: Any = {"t": self.rng.choice(TAGS), "v": V}
            for _ in range(self.rng.randrange(8)):
                d[self.rng.choice(["room", "epoch", "endpoint", "rank", "nonce", "ok",
                                   "reason", "pool", "num_pages", "x"])] = rand_msgpack(self.rng)
        else:
            d = rand_msgpack(self.rng)
        return [_pack(d), *([self.rng.randbytes(4)] if self.rng.random() < 0.3 else [])]

    def frame_types(self) -> Frames:
        """The decoder's documented input types in odd shapes (bytearray, memoryviews, not
        contiguous or not of bytes), and a few elements of no bytes type at all."""
        frames: Frames = list(self._base().frames)
        i = self.rng.randrange(len(frames))
        f = frames[i]
        how = self.rng.randrange(8)
        if how == 0:
            frames[i] = bytearray(f)
        elif how == 1:
            frames[i] = memoryview(f)
        elif how == 2:
            frames[i] = memoryview(f + f)[::2]  # not contiguous
        elif how == 3 and len(f) % 4 == 0 and f:
            frames[i] = memoryview(f).cast("i")
        elif how == 4 and len(f) % 2 == 0 and f:
            frames[i] = memoryview(f).cast("B", (2, len(f) // 2))  # 2-D
        elif how == 5:
            frames[i] = self.rng.choice(["a str", 1, None, 1.5, [b"x"]])
        elif how == 6:
            frames = tuple(frames)  # type: ignore[assignment]
        else:
            frames[i] = memoryview(bytearray(f))
        return frames

    def huge(self) -> Frames:
        name = self.rng.choice(HUGE_NAMES)
        blob = huge(name)
        if name.startswith("pages16M"):
            t = next((b for b in self.bases if b.header.get("t") == "transfer"), None)
            if t is None:
                return [blob]
            return [_pack({**t.header, "num_pages": MAX_TRANSFER_PAGES}), blob]
        return [blob]


def _is_bad_endpoint(endpoint: str) -> bool:
    try:
        numeric_endpoint(endpoint)
    except Exception:
        return True
    return False


# ------------------------------------------------------------------------ what decode returns


def bound_violations(
    msg: Any, pages: Any
) -> list[str]:
    """Every documented bound (module docstring and field annotations of ``_wire``) that a
    decoded message breaks; empty when it is well-typed and in bounds."""
    out: list[str] = []

    def ints(**bounds: tuple[int, int]) -> None:
        for name, (lo, hi) in bounds.items():
            value = getattr(msg, name)
            if type(value) is not int or not lo <= value <= hi:
                out.append(f"{type(msg).__name__}.{name}={value!r} outside [{lo}, {hi}]")

    def text(name: str, lo: int, hi: int) -> None:
        value = getattr(msg, name)
        if type(value) is not str or not lo <= len(value) <= hi:
            out.append(f"{type(msg).__name__}.{name} not a str of {lo}..{hi} chars")

    if not isinstance(msg, _wire._MESSAGE_TYPES):
        return [f"decode returned a {type(msg).__name__}"]
    if type(msg.v) is not int or msg.v != V:
        out.append(f"version {msg.v!r}")
    if isinstance(msg, (_wire.Register, _wire.Transfer, _wire.Abort, _wire.Ping)):
        text("endpoint", 1, MAX_ENDPOINT_CHARS)
        if _is_bad_endpoint(msg.endpoint):
            out.append(f"endpoint {msg.endpoint!r} refused by numeric_endpoint")
    if isinstance(msg, _wire.Register):
        ints(decode_rank=(0, MAX_RANKS - 1), decode_tp=(1, MAX_RANKS))
        if not out and msg.decode_rank >= msg.decode_tp:
            out.append("decode_rank >= decode_tp")
        text("engine", 1, MAX_NAME_CHARS)
        text("session", 0, MAX_SESSION_CHARS)
        if type(msg.engine_meta) is not bytes or len(msg.engine_meta) > MAX_ENGINE_META_BYTES:
            out.append("engine_meta")
        if type(msg.pool) is not _wire.PoolWire:
            out.append("pool type")
        else:
            try:
                msg.pool.to_spec()
            except Exception as exc:
                out.append(f"pool: {exc!r}")
            if type(msg.pool.buffer_bases) is not tuple:
                out.append("buffer_bases not a tuple")
    elif isinstance(msg, _wire.Transfer):
        ints(room=(0, I64_MAX), epoch=(0, I64_MAX), decode_rank=(0, MAX_RANKS - 1),
             aux_slot=(0, I64_MAX), required=(1, MAX_RANKS), num_pages=(0, MAX_TRANSFER_PAGES))
        slots = msg.state_slots
        if slots is not msgspec.UNSET and (
            type(slots) is not tuple or len(slots) > _wire.MAX_STATES
            or any(type(c) is not tuple or len(c) > _wire.MAX_STATE_SLOTS
                   or any(type(i) is not int or not 0 <= i <= I64_MAX for i in c)
                   for c in slots)
        ):
            out.append("state_slots")
    elif isinstance(msg, _wire.Status):
        ints(room=(0, I64_MAX), epoch=(0, I64_MAX), rank=(0, MAX_RANKS - 1))
        if type(msg.ok) is not bool:
            out.append("ok not a bool")
        text("reason", 0, MAX_REASON_CHARS)
    elif isinstance(msg, _wire.Abort):
        ints(room=(0, I64_MAX), epoch=(0, I64_MAX))
    elif isinstance(msg, _wire.AbortAck):
        ints(room=(0, I64_MAX), epoch=(0, I64_MAX), rank=(0, MAX_RANKS - 1))
    elif isinstance(msg, _wire.Ping):
        ints(nonce=(0, I64_MAX))
    elif isinstance(msg, _wire.Pong):
        ints(nonce=(0, I64_MAX), rank=(0, MAX_RANKS - 1))
    if isinstance(msg, _wire.Transfer):
        if not isinstance(pages, np.ndarray) or pages.dtype != np.int32 or pages.ndim != 1:
            out.append("pages not a 1-D int32 array")
        elif len(pages) != msg.num_pages:
            out.append("len(pages) != num_pages")
        elif pages.size and not (pages.min() >= 0 and pages.max() < MAX_POOL_PAGES):
            out.append("page id out of range")
    elif pages is not None:
        out.append("pages on a message that has none")
    return out


def round_trip_problem(msg: Any, pages: Any) -> str | None:
    """A decoded (valid) message re-encodes to frames that decode equal; else why not."""
    try:
        again, again_pages = _wire.decode(_wire.encode(msg, pages))
    except Exception as exc:
        return f"re-encoding a decoded message failed: {exc!r}"
    if again != msg:
        return f"re-encoded {msg!r} decodes to {again!r}"
    if (pages is None) != (again_pages is None) or (
        pages is not None and not np.array_equal(pages, again_pages)
    ):
        return "re-encoded page ids differ"
    return None


@dataclass
class ClassStats:
    """What one class of input did to the decoder."""

    inputs: int = 0
    decoded: int = 0
    refused: int = 0
    max_ns: int = 0
    total_ns: int = 0
    escaped: list[str] = field(default_factory=list)

    def add(self, ns: int) -> None:
        self.total_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns


def show(frames: Any, limit: int = 200) -> str:
    """A reproducer: the frames as Python literals, long ones cut."""
    try:
        parts = []
        for f in frames:
            if isinstance(f, (bytes, bytearray, memoryview)):
                b = bytes(f)
                parts.append(repr(b[:limit]) + (f"+{len(b) - limit}B" if len(b) > limit else ""))
            else:
                parts.append(repr(f)[:limit])
        return "[" + ", ".join(parts) + "]"
    except Exception:
        return repr(frames)[:limit]


def report(name: str, data: dict[str, Any]) -> None:
    """Write ``data`` as ``<name>.json`` into the folder ``TRIO_PD_FUZZ_REPORT`` names, if set."""
    folder = os.environ.get("TRIO_PD_FUZZ_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True))
