"""A raw peer of a live agent: a PUSH socket that sends whatever it is given, a fake decode
rank whose real control plane collects what prefill sends back, the messages they send, and
a good room to watch through the bad input.

Ordering trick used as a barrier: messages from one PUSH socket are handled in order, so after
an ABORT for an unknown room sent last on the same socket has been acked, every message sent
before it has been handled (and anything it made prefill send to us came first).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import trio
import zmq

from trio_pd import KVPoll, PrefillSender
from trio_pd.core import _wire
from trio_pd.core._stats import Counters
from trio_pd.engines import TransferEngine
from trio_pd.io._control import ControlPlane
from trio_pd.io._zmq import Socket, open_socket

from .agents import Pair, poll_until

V = _wire.WIRE_VERSION
_nonces = itertools.count(10_000_000)


@asynccontextmanager
async def raw_push(endpoint: str) -> AsyncIterator[Socket]:
    """A raw PUSH socket to an agent's control endpoint: sends whatever bytes it is given."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = open_socket(ctx, zmq.PUSH)
    try:
        sock.connect(endpoint)
        yield sock
    finally:
        sock.close()
        ctx.term()


@dataclass
class FakeDecode:
    """A fake decode rank: a real control plane (its PULL socket collects what prefill sends)
    and, optionally, a real engine with real registered memory."""

    cp: ControlPlane
    got: list[_wire.Message] = field(default_factory=list)
    arrived: trio.Event = field(default_factory=trio.Event)

    @property
    def endpoint(self) -> str:
        return self.cp.endpoint

    def _handle(self, msg: _wire.Message, _pages: Any) -> None:
        self.got.append(msg)
        self.arrived.set()
        self.arrived = trio.Event()

    async def next_matching(self, pred: Callable[[_wire.Message], bool]) -> _wire.Message:
        while True:
            for m in self.got:
                if pred(m):
                    return m
            await self.arrived.wait()

    def statuses(self, room: int) -> list[_wire.Status]:
        return [m for m in self.got if isinstance(m, _wire.Status) and m.room == room]


@asynccontextmanager
async def fake_decode() -> AsyncIterator[FakeDecode]:
    cp = ControlPlane("127.0.0.1", Counters())
    fake = FakeDecode(cp)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cp.serve, fake._handle)
            yield fake
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await cp.aclose(linger=0)


async def barrier(sock: Socket, fake: FakeDecode) -> None:
    """Every message sent on ``sock`` before this call has been handled by the prefill
    agent (see the module docstring)."""
    room = next(_nonces)
    await sock.send_multipart(
        _wire.encode(_wire.Abort(v=V, room=room, epoch=room, endpoint=fake.endpoint))
    )
    with trio.fail_after(10):
        await fake.next_matching(lambda m: isinstance(m, _wire.AbortAck) and m.room == room)


def enc(d: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode(d)


def as_dict(msg: _wire.Message) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(msg, builtin_types=(bytes,))
    return out


def transfer(room: int, epoch: int, endpoint: str, num_pages: int, **kw: Any) -> _wire.Transfer:
    args: dict[str, Any] = dict(
        v=V, room=room, epoch=epoch, endpoint=endpoint, decode_rank=0, aux_slot=0, required=1,
        num_pages=num_pages,
    )
    args.update(kw)
    return _wire.Transfer(**args)


def register(endpoint: str, eng: TransferEngine, pool: Any, **kw: Any) -> _wire.Register:
    args: dict[str, Any] = dict(
        v=V, endpoint=endpoint, decode_rank=0, decode_tp=1, engine=eng.name,
        session=eng.session_id, engine_meta=eng.metadata(),
        pool=_wire.PoolWire.from_spec(pool),
    )
    args.update(kw)
    return _wire.Register(**args)


async def good_room(pair: Pair, url: str, room: int) -> tuple[PrefillSender, Any, np.ndarray]:
    """A room started before the bad input: receiver ready, first chunk sent, last not."""
    src, dst = np.array([30, 31, 32, 33, 34]), np.array([60, 61, 2, 3, 4])
    pair.src.fill(src, room)
    pair.src.fill_aux(7, room)
    sender = pair.prefill.sender(room, num_pages=5, aux_slot=7)
    receiver = pair.decode.receiver(room, bootstrap_url=url)
    receiver.init(dst, 7)
    sender.send(src[:2])
    with trio.fail_after(10):  # the first chunk has landed
        await poll_until(lambda: pair.prefill.statistics().leases_live == 0)
    return sender, receiver, src


async def finish_good_room(
    pair: Pair, room: int, sender: PrefillSender, receiver: Any, src: np.ndarray
) -> None:
    sender.send(src[2:], last=True)
    with trio.fail_after(15):
        assert await receiver.wait() is KVPoll.Success, receiver.failure
        assert await sender.wait() is KVPoll.Success, sender.failure
    assert pair.verify(room, np.array([60, 61, 2, 3, 4]), 7)
