"""Control messages: typed, versioned, bounded; encode and decode. No I/O. (SPEC §6)

A message travels as a ZeroMQ multipart message. Frame 0 is a msgpack *header*: a map whose
``"t"`` key names the message type and whose ``"v"`` key is :data:`WIRE_VERSION`. Only a
:class:`Transfer` has a second frame: the destination page ids as raw little-endian int32,
exactly ``num_pages`` of them (the frame is present, and empty, when ``num_pages == 0``: the
last chunk of a room may carry only the aux row).

Who sends what:

- decode → prefill: :class:`Register` (once per decode rank and prefill rank),
  :class:`Transfer`, :class:`Abort`, :class:`Ping`;
- prefill → decode: :class:`Status`, :class:`AbortAck`, :class:`Pong`, :class:`Bye`.

Decoding is strict and bounded. Whatever arrives (a wrong frame count, an oversized header,
bytes that are not msgpack, a truncated or extended header, an unknown type or version, a
missing, extra or wrongly typed field, an out-of-range integer, a page frame of the wrong
length, a page id no pool can have, a pool layout that makes no sense), :func:`decode` raises
:class:`ProtocolError` with a message that says what was wrong; nothing else escapes it, so a
listener can log and count the error and carry on. :func:`encode` applies the same rules to what
it is given and raises :class:`ProtocolError` rather than put a message on the wire that the
peer would refuse.

The structs themselves do not validate on construction (msgspec only checks constraints while
decoding); :func:`encode` is the gate on the way out, :func:`decode` the gate on the way in.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
import sys
from collections.abc import Sequence
from typing import Annotated, Final, Literal, TypeAlias

import msgspec
import msgspec.structs
import numpy as np
import numpy.typing as npt

from ._errors import ConfigurationError, ProtocolError
from ._memory import (
    DTYPE_PATTERN,
    MAX_REQUEST_STATE_SLOTS,
    MAX_STATE_NAME,
    UNKNOWN_DTYPE,
    PoolSpec,
    StateSpec,
)
from ._memory import MAX_POOL_PAGES as _MAX_POOL_PAGES

WIRE_VERSION: Final = 1
"""The only header version this module speaks; any other is refused."""

MAX_HEADER_BYTES: Final = 2 * 1024 * 1024
"""Largest header frame :func:`decode` will look at (a full :class:`Register` fits)."""

MAX_ENDPOINT_CHARS: Final = 256
MAX_REASON_CHARS: Final = 1024
"""A :class:`Status` reason longer than this is truncated by :func:`encode`."""
MAX_NAME_CHARS: Final = 64
"""Bound of :attr:`Register.engine`."""
MAX_SESSION_CHARS: Final = 256
MAX_ENGINE_META_BYTES: Final = 1 << 20
MAX_BUFFERS: Final = 4096
"""Most KV buffers one pool may register (MHA: two per layer)."""
MAX_AUX_BUFFERS: Final = 64
"""Most aux buffers one pool may register, the first included (:attr:`PoolWire.extra_aux`
holds at most one fewer)."""
MAX_TRANSFER_PAGES: Final = 1 << 22
"""Most page ids one :class:`Transfer` may carry."""
MAX_FRAME_BYTES: Final = max(MAX_HEADER_BYTES, MAX_TRANSFER_PAGES * 4)
"""The largest frame a legal message has (a :class:`Transfer`'s page ids, int32 each): the
control plane's sockets refuse a larger one (``zmq.MAXMSGSIZE``) before it is read whole."""
MAX_STATES: Final = 16
"""Most state components one pool may register (:attr:`PoolWire.states`)."""
MAX_STATE_SEGMENTS: Final = 1024
"""Most segments one state buffer's slot may be split into."""
MAX_STATE_SLOTS: Final = MAX_REQUEST_STATE_SLOTS
"""Most slots of one state component one :class:`Transfer` may name (the request's bound:
all components together may name no more)."""
MAX_POOL_PAGES: Final = _MAX_POOL_PAGES  # a power of two: see _check_page_ids
"""Bound of a pool's ``num_pages``; a page id at or above it is absurd whatever the pool."""
MAX_RANKS: Final = 1 << 16
"""Bound of a rank id, a TP size and a required sender count."""
MAX_KEY_CHARS: Final = 40
"""A CURVE public key in z85 (:attr:`Register.control_key`)."""
MAX_AUTH_BYTES: Final = 64
"""Bound of :attr:`Register.auth` (an HMAC-SHA256 is 32 bytes)."""

_U64_LIMIT: Final = 1 << 64
_I64_MAX: Final = (1 << 63) - 1

# Integer kinds. msgspec checks these while decoding.
_Id = Annotated[int, msgspec.Meta(ge=0, le=_I64_MAX)]  # room, epoch, nonce, aux slot
_Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
_Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
_Version = Annotated[int, msgspec.Meta(ge=0, le=_I64_MAX)]  # equality checked after decoding
_Size = Annotated[int, msgspec.Meta(ge=1, le=_I64_MAX)]
# msgspec cannot bound an int above int64; addresses are checked against 2**64 by to_spec().
_Address = Annotated[int, msgspec.Meta(ge=0)]
_NumPages = Annotated[int, msgspec.Meta(ge=0, le=MAX_TRANSFER_PAGES)]

_Endpoint = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ENDPOINT_CHARS)]

MAX_HOSTNAME_CHARS: Final = 253
"""Longest DNS-style host :func:`validate_endpoint` takes (RFC 1035's bound on a name)."""

_TCP_ENDPOINT: Final = re.compile(r"tcp://(\[[^\]]*\]|[^:\[\]]*):([0-9]+)", re.ASCII)
_LABEL: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", re.ASCII)
_SCOPE_ID: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}", re.ASCII)


def check_advertised_host(host: str, what: str) -> str:
    """``host`` if peers can be told to reach us there; else :class:`ConfigurationError`.

    An agent binds its sockets on ``host`` *and* publishes that address (the bootstrap route,
    REGISTER, Mooncake's session id), so a wildcard such as ``0.0.0.0`` or ``::`` would send
    peers on other hosts to an address that means "this machine" to each of them. Give the
    address of the interface peers reach (docs/deployment.md)."""
    address = ip_literal(host)
    if (address is not None and address.is_unspecified) or host.strip().strip("[]") in ("", "*"):
        raise ConfigurationError(
            f"{what}: host={host!r} is a wildcard; peers are told the address the agent binds, "
            "so give the address (or name) of the interface they reach this host on"
        )
    return host


def ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` is, when it is an IP literal (IPv6 with or without brackets, a
    ``%zone`` dropped); None for a name. Pure: nothing is resolved."""
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return ipaddress.ip_address(name.partition("%")[0])
    except ValueError:
        return None


def bracketed(host: str) -> str:
    """``host`` as it goes in a ``tcp://HOST:PORT`` endpoint or a URL: an IPv6 literal in
    brackets (``[::1]``), anything else as it is."""
    name = host.strip()
    if ":" in name and not name.startswith("["):
        return f"[{name}]"
    return name


def address_host(address: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint or a ``HOST:PORT`` engine session (an IPv6
    host in brackets, returned without them), or None if ``address`` is neither (a NIXL
    agent's name)."""
    match = _TCP_ENDPOINT.fullmatch(address if "://" in address else f"tcp://{address}")
    if match is None:
        return None
    host = match.group(1)
    return host[1:-1] if host.startswith("[") else host


@functools.lru_cache(maxsize=4096)  # endpoints repeat on every message; bounded, pure
def validate_endpoint(endpoint: str) -> str:
    """Return ``endpoint`` if it is a ZeroMQ address this library will connect to, else raise
    :class:`ProtocolError` saying why.

    The one accepted form is ``tcp://HOST:PORT``, at most :data:`MAX_ENDPOINT_CHARS`
    characters, where HOST is an IPv4 literal (``127.0.0.1``), a bracketed IPv6 literal
    (``[::1]``, with an optional ``%zone`` of letters, digits, ``_``, ``.``, ``-``) or a
    DNS-style hostname (labels of letters, digits and inner ``-`` joined by ``.``, at most
    :data:`MAX_HOSTNAME_CHARS` characters, the last label not all digits), and PORT is a
    decimal number in 1..65535 without leading zeros. Everything else is refused: other
    schemes (``ipc://``, ``inproc://``, ``udp://``...), wildcards (``*``), interface names,
    a source address (``tcp://a:1;b:2``), whitespace, an empty host or port.

    Every endpoint trio_pd produces passes: a control plane binds ``tcp://{host}:*`` and
    reports libzmq's ``LAST_ENDPOINT``, which names the resolved address and port. The check
    is pure (no name resolution) and runs when a message is decoded, so a peer's bad reply
    address is a malformed message, counted and dropped before any handler or socket sees it.
    """
    if type(endpoint) is not str:
        raise ProtocolError(f"endpoint must be a str, not {type(endpoint).__name__}")
    shown = endpoint if len(endpoint) <= 80 else endpoint[:77] + "..."
    if len(endpoint) > MAX_ENDPOINT_CHARS:
        raise ProtocolError(f"endpoint {shown!r} is longer than {MAX_ENDPOINT_CHARS} characters")
    match = _TCP_ENDPOINT.fullmatch(endpoint)
    if match is None:
        raise ProtocolError(f"endpoint {shown!r} is not of the form tcp://HOST:PORT")
    host, port = match.groups()
    if port[0] == "0" or int(port) > 65535:
        raise ProtocolError(f"endpoint {shown!r}: port must be a decimal in 1..65535")
    if host.startswith("["):
        address, _, zone = host[1:-1].partition("%")
        if "%" in host and _SCOPE_ID.fullmatch(zone) is None:
            raise ProtocolError(f"endpoint {shown!r}: bad IPv6 zone {zone!r}")
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            raise ProtocolError(f"endpoint {shown!r}: {address!r} is not an IPv6 literal") from None
        return endpoint
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        pass
    else:
        return endpoint
    labels = host.split(".")
    if (
        not host
        or len(host) > MAX_HOSTNAME_CHARS
        or not all(_LABEL.fullmatch(label) for label in labels)
        or labels[-1].isdigit()
    ):
        raise ProtocolError(
            f"endpoint {shown!r}: {host!r} is not an IPv4 address, [IPv6] or hostname"
        )
    return endpoint


@functools.lru_cache(maxsize=4096)  # on every TRANSFER, ABORT, PING: an IP parse each
def numeric_endpoint(endpoint: str) -> str:
    """:func:`validate_endpoint`, and its host must be an IP literal: the endpoints that
    travel in control messages and reach a ZeroMQ socket. A name is refused with
    :class:`ProtocolError`: libzmq would resolve it on its I/O thread, where a resolver that
    never answers stalls every socket of the agent (``_names`` resolves configured names
    before they get here). Every endpoint trio_pd publishes is numeric (libzmq's
    ``LAST_ENDPOINT``)."""
    validate_endpoint(endpoint)
    if ip_literal(address_host(endpoint) or "") is None:
        shown = endpoint if len(endpoint) <= 80 else endpoint[:77] + "..."
        raise ProtocolError(
            f"endpoint {shown!r} names a host; control endpoints are numeric addresses"
        )
    return endpoint


_Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)]


class StateWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """:class:`StateSpec` on the wire, checked by :meth:`to_spec`."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STATE_NAME)]
    slots: Annotated[int, msgspec.Meta(ge=1, le=MAX_POOL_PAGES)]
    buffers: Annotated[tuple[tuple[_Address, _Size], ...],
                       msgspec.Meta(min_length=1, max_length=MAX_BUFFERS)]
    replicated: bool = False
    segments: Annotated[
        tuple[Annotated[tuple[tuple[_Size, _Size], ...],
                        msgspec.Meta(max_length=MAX_STATE_SEGMENTS)], ...],
        msgspec.Meta(max_length=MAX_BUFFERS),
    ] = ()

    @classmethod
    def from_spec(cls, spec: StateSpec) -> StateWire:
        return cls(spec.name, spec.slots, spec.buffers, spec.replicated, spec.segments)

    def to_spec(self) -> StateSpec:
        """The component, or :class:`ProtocolError` if it makes no sense (see
        :class:`StateSpec`) or a buffer runs past the 64-bit address space."""
        for i, (base, n) in enumerate(self.buffers):
            if base + self.slots * n > _U64_LIMIT:
                raise ProtocolError(
                    f"state {self.name!r} buffer {i} at {base:#x} of {self.slots} x {n} bytes "
                    "runs past the 64-bit address space"
                )
        try:
            return StateSpec(
                self.name, self.slots, tuple((base, n) for base, n in self.buffers),
                self.replicated,
                tuple(tuple((ub, u) for ub, u in segs) for segs in self.segments),
            )
        except ConfigurationError as exc:
            raise ProtocolError(str(exc)) from None


class PoolWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """:class:`PoolSpec` on the wire: the same fields, checked by :meth:`to_spec`."""

    layout: Literal["mha", "mla"]
    page_size: _Size
    num_pages: Annotated[int, msgspec.Meta(ge=1, le=MAX_POOL_PAGES)]
    num_layers: Annotated[int, msgspec.Meta(ge=1, le=MAX_BUFFERS)]
    head_bytes: _Size
    heads: Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
    first_head: Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
    buffer_bases: Annotated[tuple[_Address, ...], msgspec.Meta(max_length=MAX_BUFFERS)]
    aux_base: _Address
    aux_item_len: _Size
    aux_slots: Annotated[int, msgspec.Meta(ge=1, le=MAX_POOL_PAGES)]
    page_layout: Literal["nhd", "hnd"] = "nhd"
    buffer_head_bytes: Annotated[tuple[_Size, ...], msgspec.Meta(max_length=MAX_BUFFERS)] = ()
    page_strides: Annotated[tuple[_Size, ...], msgspec.Meta(max_length=MAX_BUFFERS)] = ()
    #: the aux buffers after the first, ``(base, row bytes)`` each; UNSET (a pool with one aux
    #: buffer) leaves the field off the wire, so such a pool's REGISTER is what it always was
    extra_aux: (
        Annotated[tuple[tuple[_Address, _Size], ...],
                  msgspec.Meta(max_length=MAX_AUX_BUFFERS - 1)]
        | msgspec.UnsetType
    ) = msgspec.UNSET
    #: the state components (UNSET: none, the field off the wire)
    states: (
        Annotated[tuple[StateWire, ...], msgspec.Meta(max_length=MAX_STATES)]
        | msgspec.UnsetType
    ) = msgspec.UNSET
    #: what the KV bytes hold (:attr:`PoolSpec.kv_dtype`); UNSET: "unknown", the field off
    #: the wire. A peer that predates it sends none (and is read as "unknown"), and refuses
    #: a pool with it (unknown fields are refused): :meth:`from_spec` leaves it off unless
    #: told the peer published a dtype of its own, so no wire version bump is needed
    kv_dtype: (
        Annotated[str, msgspec.Meta(pattern=f"^{DTYPE_PATTERN}$")] | msgspec.UnsetType
    ) = msgspec.UNSET

    @classmethod
    def from_spec(cls, spec: PoolSpec, *, with_dtype: bool = True) -> PoolWire:
        """Copy ``spec`` field by field (the two classes have the same fields; an empty
        ``extra_aux``, no ``states`` and an "unknown" ``kv_dtype`` become UNSET, and so does
        ``kv_dtype`` with ``with_dtype=False``: for a peer that may predate the field).
        Checking happens in :meth:`to_spec` / :func:`encode`."""
        values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        values["extra_aux"] = spec.extra_aux or msgspec.UNSET
        values["states"] = (
            tuple(StateWire.from_spec(st) for st in spec.states) or msgspec.UNSET
        )
        known = with_dtype and spec.kv_dtype != UNKNOWN_DTYPE
        values["kv_dtype"] = spec.kv_dtype if known else msgspec.UNSET
        return cls(**values)

    def to_spec(self) -> PoolSpec:
        """Check that the layout makes sense and return it as a :class:`PoolSpec`.

        Raises :class:`ProtocolError` unless: the layout is ``"mha"`` or ``"mla"``; every size
        and count is a positive int (``first_head`` non-negative) within the bounds above;
        there are ``2 * num_layers`` buffers for MHA, ``num_layers`` for MLA; MLA has
        ``heads == 1`` and ``first_head == 0``; and every buffer and the aux buffer lie, end
        included, inside the 64-bit address space; ``buffer_head_bytes`` and
        ``page_strides`` are empty or one positive int per buffer, no stride shorter than its
        buffer's page; ``extra_aux`` is at most ``MAX_AUX_BUFFERS - 1`` pairs of a base and
        a positive row size, each buffer (``aux_slots`` rows) inside the 64-bit address
        space too.
        """
        if self.layout not in ("mha", "mla"):
            raise ProtocolError(f"pool layout must be 'mha' or 'mla', not {self.layout!r}")
        _check_int("page_size", self.page_size, 1, _I64_MAX + 1)
        _check_int("num_pages", self.num_pages, 1, MAX_POOL_PAGES + 1)
        _check_int("num_layers", self.num_layers, 1, MAX_BUFFERS + 1)
        _check_int("head_bytes", self.head_bytes, 1, _I64_MAX + 1)
        _check_int("heads", self.heads, 1, MAX_RANKS + 1)
        _check_int("first_head", self.first_head, 0, MAX_RANKS)
        _check_int("aux_base", self.aux_base, 0, _U64_LIMIT)
        _check_int("aux_item_len", self.aux_item_len, 1, _I64_MAX + 1)
        _check_int("aux_slots", self.aux_slots, 1, MAX_POOL_PAGES + 1)
        bases = self.buffer_bases
        if not isinstance(bases, (tuple, list)):
            raise ProtocolError(f"pool buffer_bases must be a sequence of ints, not {bases!r}")
        per_layer = 2 if self.layout == "mha" else 1
        if len(bases) != per_layer * self.num_layers:
            raise ProtocolError(
                f"{self.layout} pool with {self.num_layers} layers needs "
                f"{per_layer * self.num_layers} buffers, got {len(bases)}"
            )
        if self.layout == "mla" and (self.heads != 1 or self.first_head != 0):
            raise ProtocolError(
                f"mla pool must have heads=1, first_head=0 "
                f"(got heads={self.heads}, first_head={self.first_head})"
            )
        if self.page_layout not in ("nhd", "hnd"):
            raise ProtocolError(f"page_layout must be 'nhd' or 'hnd', not {self.page_layout!r}")
        for name in ("buffer_head_bytes", "page_strides"):
            values = getattr(self, name)
            if not isinstance(values, (tuple, list)) or (values and len(values) != len(bases)):
                raise ProtocolError(f"pool {name} must be empty or one int per buffer")
            for i, v in enumerate(values):
                _check_int(f"{name}[{i}]", v, 1, _I64_MAX + 1)
        per_token = self.page_size * self.heads
        head_bytes = self.buffer_head_bytes or [self.head_bytes] * len(bases)
        items = [per_token * hb for hb in head_bytes]
        strides = list(self.page_strides) or items
        for i, (item, stride) in enumerate(zip(items, strides, strict=True)):
            if stride < item:
                raise ProtocolError(
                    f"pool page_strides[{i}] is {stride}, less than the {item}-byte page"
                )
        for i, base in enumerate(bases):
            _check_int(f"buffer_bases[{i}]", base, 0, _U64_LIMIT)
            buffer_len = (self.num_pages - 1) * strides[i] + items[i]
            if base + buffer_len > _U64_LIMIT:
                raise ProtocolError(
                    f"pool buffer {i} at {base:#x} of {buffer_len} bytes "
                    "runs past the 64-bit address space"
                )
        if self.aux_base + self.aux_slots * self.aux_item_len > _U64_LIMIT:
            raise ProtocolError(
                f"pool aux buffer at {self.aux_base:#x} of {self.aux_slots} x "
                f"{self.aux_item_len} bytes runs past the 64-bit address space"
            )
        extra = self._extra_aux()
        states = () if self.states is msgspec.UNSET else tuple(
            st.to_spec() for st in self.states
        )
        try:
            return PoolSpec(**(msgspec.structs.asdict(self) | {
                "buffer_bases": tuple(bases), "buffer_head_bytes": tuple(self.buffer_head_bytes),
                "page_strides": tuple(self.page_strides), "extra_aux": extra, "states": states,
                "kv_dtype": UNKNOWN_DTYPE if self.kv_dtype is msgspec.UNSET else self.kv_dtype,
            }))
        except ConfigurationError as exc:  # (what only the whole pool can tell: names)
            raise ProtocolError(str(exc)) from None

    def _extra_aux(self) -> tuple[tuple[int, int], ...]:
        """:attr:`extra_aux`, checked (see :meth:`to_spec`), as a tuple of pairs."""
        extra = self.extra_aux
        if extra is msgspec.UNSET:
            return ()
        limit = MAX_AUX_BUFFERS - 1
        if not isinstance(extra, (tuple, list)):
            raise ProtocolError(
                f"pool extra_aux must be a sequence of (base, row bytes) pairs, not {extra!r}"
            )
        if len(extra) > limit:
            raise ProtocolError(
                f"pool extra_aux: at most {limit} aux buffers after the first, got {len(extra)}"
            )
        out = []
        for i, pair in enumerate(extra):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ProtocolError(f"pool extra_aux[{i}] must be a (base, row bytes) pair")
            base, row = pair
            _check_int(f"extra_aux[{i}] base", base, 0, _U64_LIMIT)
            _check_int(f"extra_aux[{i}] row bytes", row, 1, _I64_MAX + 1)
            if base + self.aux_slots * row > _U64_LIMIT:
                raise ProtocolError(
                    f"pool aux buffer {i + 1} at {base:#x} of {self.aux_slots} x {row} bytes "
                    "runs past the 64-bit address space"
                )
            out.append((base, row))
        return tuple(out)


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    """Raise unless ``value`` is an int (not a bool) with ``lo <= value < hi``."""
    if type(value) is not int or not lo <= value < hi:
        raise ProtocolError(f"pool {name} must be an int in [{lo}, {hi}), not {value!r}")


class _Header(msgspec.Struct, frozen=True, tag_field="t", forbid_unknown_fields=True):
    """Base of every header: frozen, tagged by ``"t"``, unknown fields refused."""


class Register(_Header, frozen=True, tag="register", omit_defaults=True):
    """decode → prefill, once per (decode rank, prefill rank): who I am and where to write.

    ``endpoint`` is the decode rank's ZeroMQ address for replies; ``engine`` names its
    transfer engine, ``session`` its engine session id and ``engine_meta`` any opaque bytes the
    engine needs to connect (at most 1 MiB). ``decode_rank`` must be below ``decode_tp``.

    With authentication on (docs/security.md), ``control_key`` is the decode rank's CURVE
    public key (z85; the key its messages come from, and the key its PULL sockets serve
    with) and ``auth`` the proof (:func:`trio_pd.io._security.register_mac`) that the sender
    holds the cluster token. Both default to empty and are then left off the wire
    (``omit_defaults``), so a REGISTER without them is byte for byte what older peers send
    and decode.
    """

    v: _Version
    endpoint: _Endpoint
    decode_rank: _Rank
    decode_tp: _Count
    engine: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
    session: Annotated[str, msgspec.Meta(max_length=MAX_SESSION_CHARS)]
    engine_meta: Annotated[bytes, msgspec.Meta(max_length=MAX_ENGINE_META_BYTES)]
    pool: PoolWire
    control_key: Annotated[str, msgspec.Meta(max_length=MAX_KEY_CHARS)] = ""
    auth: Annotated[bytes, msgspec.Meta(max_length=MAX_AUTH_BYTES)] = b""
    #: the decode rank's landing area (``DecodeConfig.landing_bytes``): where each KV
    #: buffer's landing pages start, and how many there are (the pool's geometry, packed).
    #: Empty and 0 (no landing area) leave both off the wire
    landing_bases: Annotated[tuple[_Address, ...], msgspec.Meta(max_length=MAX_BUFFERS)] = ()
    landing_pages: Annotated[int, msgspec.Meta(ge=0, le=MAX_POOL_PAGES)] = 0


class Transfer(_Header, frozen=True, tag="transfer", omit_defaults=True):
    """decode → prefill: write one chunk of room ``room`` (attempt ``epoch``) into my pages.

    The page ids travel in frame 1. ``aux_slot`` is the destination aux row; ``required`` is
    how many prefill ranks must report Success before the room is complete.
    ``prefix_pages``: the request's first pages decode holds already (a prefix cache hit);
    the ``num_pages`` page ids are for the request's pages after them. ``state_slots``:
    the destination slots of each state component of decode's pool, in order (UNSET: a
    pool without state components). ``landing``: the page ids are landing pages of the
    decode rank's landing area (its REGISTER advertised it), not pages of its pool; decode
    copies them into the room's pages before Success. False leaves it off the wire.
    """

    v: _Version
    room: _Id
    epoch: _Id
    endpoint: _Endpoint
    decode_rank: _Rank
    aux_slot: _Id
    required: _Count
    num_pages: _NumPages
    prefix_pages: Annotated[int, msgspec.Meta(ge=0, le=MAX_POOL_PAGES)] = 0
    state_slots: (
        Annotated[tuple[Annotated[tuple[_Id, ...], msgspec.Meta(max_length=MAX_STATE_SLOTS)],
                        ...], msgspec.Meta(max_length=MAX_STATES)]
        | msgspec.UnsetType
    ) = msgspec.UNSET
    landing: bool = False


class Status(_Header, frozen=True, tag="status"):
    """prefill → decode: prefill rank ``rank`` finished (``ok``) or failed room ``room``."""

    v: _Version
    room: _Id
    epoch: _Id
    rank: _Rank
    ok: bool
    reason: _Reason = ""


class Abort(_Header, frozen=True, tag="abort"):
    """decode → prefill: give up room ``room``; answer with :class:`AbortAck` to ``endpoint``
    once nothing of the room is in flight any more."""

    v: _Version
    room: _Id
    epoch: _Id
    endpoint: _Endpoint


class AbortAck(_Header, frozen=True, tag="abort_ack"):
    """prefill → decode: rank ``rank`` holds nothing of room ``room`` and will write no more."""

    v: _Version
    room: _Id
    epoch: _Id
    rank: _Rank


class Ping(_Header, frozen=True, tag="ping"):
    """decode → prefill: heartbeat; answer with a :class:`Pong` echoing ``nonce``."""

    v: _Version
    nonce: _Id
    endpoint: _Endpoint


class Pong(_Header, frozen=True, tag="pong"):
    """prefill → decode: answer to the :class:`Ping` with the same ``nonce``."""

    v: _Version
    nonce: _Id
    rank: _Rank


class Bye(_Header, frozen=True, tag="bye"):
    """prefill → decode: rank ``rank``, the agent at ``endpoint``, has closed. Sent after its
    last engine call returned and every quarantine of its failed writes ended on proof, and
    after it stopped reading its control socket: no write of it can start or land any more,
    so it counts as drained for every room that names it (a drain ack for all of them). A
    rank that closes with a write not proven over sends none."""

    v: _Version
    rank: _Rank
    endpoint: _Endpoint


Message: TypeAlias = Register | Transfer | Status | Abort | AbortAck | Ping | Pong | Bye
_MESSAGE_TYPES: Final = (Register, Transfer, Status, Abort, AbortAck, Ping, Pong, Bye)
_EXACT_TYPES: Final = frozenset(_MESSAGE_TYPES)
_WITH_ENDPOINT: Final = frozenset({Register, Transfer, Abort, Ping, Bye})
"""The messages that name a reply endpoint: each is checked by :func:`numeric_endpoint`
(asked as ``type(msg) in``: the decoder makes these exact classes, and a set lookup is no
call, where ``isinstance`` is one)."""


class _Probe(msgspec.Struct):
    """What an unreadable header may still tell: its version and type, for the error."""

    v: int | None = None
    t: str | None = None


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(Message)
_PROBE: Final = msgspec.msgpack.Decoder(_Probe)
_PAGE_DTYPE: Final = np.dtype("<i4")
_LITTLE_ENDIAN: Final = sys.byteorder == "little"


def _frame_bytes(frame: object, what: str) -> int:
    """The length of a frame that must be a contiguous bytes-like object."""
    if type(frame) is bytes:
        return len(frame)
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what} frame must be bytes, not {type(frame).__name__}")
    view = memoryview(frame)
    if not view.c_contiguous:
        raise ProtocolError(f"{what} frame is not a contiguous buffer")
    return view.nbytes


def _decode_header(header: bytes | bytearray | memoryview) -> Message:
    """Decode and check a header frame; :class:`ProtocolError` for anything amiss."""
    try:
        msg = _DECODER.decode(header)
    except (msgspec.DecodeError, RecursionError) as exc:
        # RecursionError: msgspec skips unknown values recursively, and says so (no crash)
        # when a hostile header nests them deeply.
        try:
            probe = _PROBE.decode(header)
        except (msgspec.DecodeError, RecursionError):
            probe = _Probe()
        # A header of another version may well fail validation: say so if we can tell.
        if probe.v is not None and probe.v != WIRE_VERSION:
            raise ProtocolError(
                f"unsupported wire version {probe.v} (this side speaks {WIRE_VERSION})"
            ) from exc
        kind = f"{probe.t!r} " if probe.t is not None and len(probe.t) <= 32 else ""
        if isinstance(exc, RecursionError):
            raise ProtocolError(f"malformed {kind}message header: nested too deeply") from exc
        raise ProtocolError(f"malformed {kind}message header: {exc}") from exc
    if msg.v != WIRE_VERSION:
        raise ProtocolError(f"unsupported wire version {msg.v} (this side speaks {WIRE_VERSION})")
    cls = type(msg)
    if cls in _WITH_ENDPOINT:
        try:
            numeric_endpoint(msg.endpoint)  # type: ignore[union-attr]
        except ProtocolError as exc:
            raise ProtocolError(f"{cls.__name__}: {exc}") from None
    if cls is Register:
        assert isinstance(msg, Register)
        msg.pool.to_spec()
        if msg.decode_rank >= msg.decode_tp:
            raise ProtocolError(
                f"register: decode_rank {msg.decode_rank} is not below decode_tp {msg.decode_tp}"
            )
    return msg


def _check_page_ids(pages: npt.NDArray[np.integer], what: str) -> None:
    # MAX_POOL_PAGES is a power of two: every id lies in [0, MAX_POOL_PAGES) exactly when the
    # bitwise OR of all of them does (a negative id sets the sign bit). One pass, no temporary.
    if pages.size and not 0 <= int(np.bitwise_or.reduce(pages)) < MAX_POOL_PAGES:
        raise ProtocolError(f"{what}: page ids must lie in [0, {MAX_POOL_PAGES})")


def _plainly_valid(msg: Message) -> bool:
    """True only if :func:`decode` accepts the header :func:`encode` makes of ``msg``: the
    message is a :class:`Transfer` or a :class:`Status` (what every request sends) whose
    every field has its exact builtin type and a value in range. Asked in Python, this costs
    a fraction of decoding the header again; False says nothing (:func:`encode` then decodes
    the header to find out). A ``Status`` reason is already cut to length by then.

    Every condition decode applies to these two types is here; no value of another type is
    taken (a bool where an int goes, an int subclass, a float), so whatever decode would
    refuse is sent to decode, which says why."""
    cls = type(msg)
    if cls is Transfer:
        m: Transfer = msg  # type: ignore[assignment]
        v, room, epoch, rank, slot = m.v, m.room, m.epoch, m.decode_rank, m.aux_slot
        req, num, prefix, endpoint = m.required, m.num_pages, m.prefix_pages, m.endpoint
        if not (
            type(v) is int and v == WIRE_VERSION
            and type(room) is int and 0 <= room <= _I64_MAX
            and type(epoch) is int and 0 <= epoch <= _I64_MAX
            and type(rank) is int and 0 <= rank < MAX_RANKS
            and type(slot) is int and 0 <= slot <= _I64_MAX
            and type(req) is int and 1 <= req <= MAX_RANKS
            and type(num) is int and 0 <= num <= MAX_TRANSFER_PAGES
            and type(prefix) is int and 0 <= prefix <= MAX_POOL_PAGES
            and m.state_slots is msgspec.UNSET
            and type(m.landing) is bool
            and type(endpoint) is str
        ):
            return False
    elif cls is Status:
        st: Status = msg  # type: ignore[assignment]
        v, room, epoch, rank = st.v, st.room, st.epoch, st.rank
        return (
            type(v) is int and v == WIRE_VERSION
            and type(room) is int and 0 <= room <= _I64_MAX
            and type(epoch) is int and 0 <= epoch <= _I64_MAX
            and type(rank) is int and 0 <= rank < MAX_RANKS
            and type(st.ok) is bool
            and type(st.reason) is str  # (at most MAX_REASON_CHARS: encode cut it)
        )
    else:
        return False
    try:
        numeric_endpoint(endpoint)  # (1 to MAX_ENDPOINT_CHARS characters, and numeric)
    except ProtocolError:
        return False
    return True


def encode(msg: Message, pages: npt.NDArray[np.int32] | None = None) -> list[bytes]:
    """Encode ``msg`` as ZeroMQ frames: ``[header]``, or ``[header, page_ids]`` for a Transfer.

    A :class:`Transfer` needs ``pages``: a 1-D integer array of exactly ``msg.num_pages`` ids,
    each in ``[0, MAX_POOL_PAGES)``; any integer dtype is range-checked, then sent as
    little-endian int32. Every other message refuses ``pages``. A :class:`Status` reason is
    truncated to :data:`MAX_REASON_CHARS` characters.

    Raises :class:`ProtocolError` if ``msg`` would not pass :func:`decode` on the other side
    (a wrong version, an out-of-range field, a nonsensical pool, ...): the header is decoded
    again here, unless :func:`_plainly_valid` shows at less cost that it would pass.
    """
    cls = type(msg)
    exact = cls in _EXACT_TYPES  # (the usual case: no isinstance call below)
    if not exact and not isinstance(msg, _MESSAGE_TYPES):
        raise ProtocolError(f"cannot encode {cls.__name__}: not a control message")
    if cls is Status or (not exact and isinstance(msg, Status)):
        reason = msg.reason  # type: ignore[union-attr]
        if isinstance(reason, str) and len(reason) > MAX_REASON_CHARS:
            msg = msgspec.structs.replace(msg, reason=reason[:MAX_REASON_CHARS])
    try:
        header = _ENCODER.encode(msg)
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"refusing to encode {cls.__name__}: {exc}") from exc
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"refusing to encode {cls.__name__}: header of {len(header)} bytes")
    if not _plainly_valid(msg):
        try:
            _decode_header(header)
        except ProtocolError as exc:
            raise ProtocolError(f"refusing to encode {cls.__name__}: {exc}") from exc
    if cls is not Transfer and (exact or not isinstance(msg, Transfer)):
        if pages is not None:
            raise ProtocolError(f"{cls.__name__} carries no page ids")
        return [header]
    transfer: Transfer = msg  # type: ignore[assignment]
    if pages is None:
        raise ProtocolError("Transfer needs its page ids")
    if type(pages) is np.ndarray:
        arr: npt.NDArray[np.integer] = pages
    else:
        try:
            arr = np.asarray(pages)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"Transfer page ids are not an array: {exc}") from exc
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ProtocolError(
            f"Transfer page ids must be a 1-D integer array, not {arr.ndim}-D {arr.dtype}"
        )
    if arr.shape[0] != transfer.num_pages:
        raise ProtocolError(
            f"Transfer says num_pages={transfer.num_pages} but carries {arr.shape[0]} page ids"
        )
    _check_page_ids(arr, "Transfer")
    if arr.dtype != _PAGE_DTYPE:
        arr = arr.astype(_PAGE_DTYPE)
    return [header, arr.tobytes()]


def decode(
    frames: Sequence[bytes | bytearray | memoryview],
) -> tuple[Message, npt.NDArray[np.int32] | None]:
    """Decode the frames of one ZeroMQ multipart message into ``(message, page_ids)``.

    ``page_ids`` is ``None`` except for a :class:`Transfer`, where it is a 1-D int32 array of
    ``num_pages`` ids: a read-only view of the frame when that is ``bytes``, else a copy.

    Raises :class:`ProtocolError`, and nothing else, for any input that is not a well-formed
    message of this version (see the module docstring).
    """
    try:
        count = len(frames)
    except TypeError as exc:
        raise ProtocolError(f"frames must be a sequence, not {type(frames).__name__}") from exc
    if count not in (1, 2):
        raise ProtocolError(f"a control message has 1 or 2 frames, got {count}")
    header = frames[0]
    # (_frame_bytes, written out for bytes: what a receive gives)
    size = len(header) if type(header) is bytes else _frame_bytes(header, "header")
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {size} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    msg = _decode_header(header)
    if type(msg) is not Transfer:  # (the decoder makes exact classes)
        if count != 1:
            raise ProtocolError(f"{type(msg).__name__} has 1 frame, got {count}")
        return msg, None
    if count != 2:
        raise ProtocolError("Transfer has 2 frames (header, page ids), got 1")
    raw = frames[1]
    size = len(raw) if type(raw) is bytes else _frame_bytes(raw, "page id")
    if size != 4 * msg.num_pages:
        raise ProtocolError(
            f"Transfer page frame has {size} bytes, expected 4 * num_pages = {4 * msg.num_pages}"
        )
    pages: npt.NDArray[np.int32] = np.frombuffer(raw, dtype=_PAGE_DTYPE)
    if not _LITTLE_ENDIAN:
        pages = pages.astype(np.int32)
    elif type(raw) is not bytes and pages.flags.writeable:
        pages = pages.copy()  # don't alias a buffer the caller may still change
    _check_page_ids(pages, "Transfer")
    return msg, pages
