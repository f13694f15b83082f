"""Every live listener under fuzzed messages while real requests run (issue 14, item 5,
part 2).

A live prefill agent and a live decode agent (real Mooncake engines, real ZeroMQ, the real
bootstrap service) each take ``MESSAGES`` generated messages on raw PUSH sockets, half on the
main endpoint and half on the heartbeat endpoint: mutations of valid messages (the
generators of ``_gen``), and forged identities (TRANSFER, ABORT, STATUS, ABORT_ACK for rooms
in use, with wrong epochs or ranks). Meanwhile background workers run real rooms, each
verified byte for byte, into a decode pool with poisoned guard pages on both sides of every
buffer (registered with the engine: the pool is the middle of larger arrays).

Accounting is exact, per message. The listener's ``_dispatch`` is wrapped (on the instance)
so that every message it handles is matched to the fuzzer's queue for that agent (ZeroMQ
keeps each PUSH socket's order) and classed by which counter it moved: ``bad_messages``,
``refused_messages``, ``late_messages``, ``handler_errors``, or none (accepted). Before each
message is sent it is decoded here too: the agent must count it ``bad`` exactly when that
local decode refuses it. Messages from the real peers are tallied apart. Then, per agent:
sent == bad + refused + late + handler_errors + accepted (decode: + acks_received), every
message moved at most one counter, and the agent's counter deltas equal the fuzz tallies
plus the real ones.

What the fuzzer withholds, and why (each counted): a message that would make an agent
connect off loopback, or to a port nobody here owns (a reply endpoint or an engine session
a mutation made up); and the forgeries that succeed by design while authentication is off,
as it is on loopback (docs/security.md): a REGISTER for the real decode's endpoint, a
TRANSFER for a room in use from a registered endpoint, an ABORT / STATUS / ABORT_ACK with the
room's real epoch from its real rank.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import trio

from trio_pd import KVPoll, ProtocolError, open_decode, open_prefill
from trio_pd.core import _wire
from trio_pd.core._stats import AgentStatistics
from trio_pd.engines import make_engine
from trio_pd.io._control import ControlPlane
from trio_pd.testing.pools import HostKVPool

from ..helpers.agents import host_pool
from ..helpers.peers import FakeDecode, barrier, fake_decode, raw_push, register, transfer
from ._gen import Mutator, V, make_base

# Raw, unauthenticated input at the listeners: security off, explicitly (with it on, the
# default, a stranger gets nowhere: tests/test_auth.py)
pytestmark = [pytest.mark.fuzz, pytest.mark.usefixtures("insecure")]

SEED = int(os.environ.get("TRIO_PD_FUZZ_SEED", "14005"))
#: fuzzed messages per agent
MESSAGES = {"short": 10_000, "full": 100_000}
#: wall-clock bound of one agent's fuzz
BOUND_S = {"short": 60, "full": 420}
CATS = ("bad_messages", "refused_messages", "late_messages", "handler_errors")
#: also tracked: an ABORT_ACK decode takes for a room it holds (from a rank it never
#: contacted it changes nothing: ``DecodeRoom.on_ack`` ignores it, but counts it received)
TRACKED = (*CATS, "acks_received")
REAL_BASE = 5_000_000_000
REAL_SPAN = 100_000_000
FUZZ_ROOM = 7_000_000
WORKERS = 4
GUARD = 16
POISON = 0xE7
#: reply endpoints a hostile field may name: loopback ports nobody listens on
CLOSED_PORTS = [f"tcp://127.0.0.1:{p}" for p in range(1, 33)]
#: endpoints forged TRANSFERs come from: never registered by anyone
FORGER_PORTS = [f"tcp://127.0.0.1:{p}" for p in range(33, 41)]


def real_room(room: Any) -> bool:
    return type(room) is int and REAL_BASE <= room < REAL_BASE + REAL_SPAN


# ------------------------------------------------------------------------ a guarded pool


@dataclass
class Guarded:
    """A decode pool that is the middle of larger arrays: ``GUARD`` poisoned pages before and
    after every buffer, and ``GUARD`` poisoned aux rows around the aux buffer."""

    pool: HostKVPool
    whole: HostKVPool
    used_pages: int
    used_slots: int

    def untouched(self) -> dict[str, int]:
        """Bytes no longer holding their poison: in the guards (outside the registered
        region), and in pages and aux rows inside it that no real room ever used."""
        kv, aux = self.whole.kv, self.whole.aux
        n, s = self.pool.spec.num_pages, self.pool.aux.shape[0]
        return {
            "guard_kv": int((kv[:, :GUARD] != POISON).sum() + (kv[:, GUARD + n :] != POISON).sum()),
            "guard_aux": int((aux[:GUARD] != POISON).sum() + (aux[GUARD + s :] != POISON).sum()),
            "unused_kv": int((self.pool.kv[:, self.used_pages :] != POISON).sum()),
            "unused_aux": int((self.pool.aux[self.used_slots :] != POISON).sum()),
        }


def guarded_pool(num_pages: int = 256, aux_slots: int = 32) -> Guarded:
    whole = host_pool(num_pages=num_pages + 2 * GUARD, aux_slots=aux_slots + 2 * GUARD)
    whole.kv[...] = POISON
    whole.aux[...] = POISON
    inner = copy.copy(whole)
    # (a window of the whole pool's memory: HostKVPool keeps its pages in _kv / buffers)
    inner._kv = whole.kv[:, GUARD : GUARD + num_pages, :]
    inner.buffers = [inner.kv[i].reshape(-1) for i in range(inner.kv.shape[0])]
    inner.aux = whole.aux[GUARD : GUARD + aux_slots]
    inner.spec = dataclasses.replace(
        whole.spec,
        num_pages=num_pages,
        aux_slots=aux_slots,
        buffer_bases=tuple(int(inner.kv[i].ctypes.data) for i in range(inner.kv.shape[0])),
        aux_base=int(inner.aux.ctypes.data),
    )
    return Guarded(inner, whole, used_pages=WORKERS * 8, used_slots=WORKERS)


# ------------------------------------------------------------------------ exact accounting


@dataclass
class Tally:
    """What one agent's listener did with every message, the fuzz's and the real peers'."""

    counters: Any
    queue: deque[tuple[list[bytes], bool, str]] = field(default_factory=deque)
    beat_queue: deque[tuple[list[bytes], bool, str]] = field(default_factory=deque)
    fuzz: Counter[str] = field(default_factory=Counter)
    by_type: Counter[tuple[str, str]] = field(default_factory=Counter)
    real: Counter[str] = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)
    max_ns: int = 0
    #: what the slowest message to handle was (its kind, or "real")
    slowest: str = ""
    handled: int = 0
    #: frames -> [on the heartbeat socket?, how many queued]: a message equal to one still
    #: queued goes on the same socket, so equal messages never sit in both queues (one
    #: socket's order is kept; across the two, equal messages could not be told apart)
    where: dict[tuple[bytes, ...], list[Any]] = field(default_factory=dict)

    def enqueue(self, frames: list[bytes], bad: bool, kind: str, beat: bool) -> bool:
        """Queue a message about to be sent; returns the socket it must go on."""
        key = tuple(frames)
        slot = self.where.get(key)
        if slot is None:
            slot = self.where[key] = [beat, 0]
        slot[1] += 1
        (self.beat_queue if slot[0] else self.queue).append((frames, bad, kind))
        return bool(slot[0])

    def pending(self) -> int:
        return len(self.queue) + len(self.beat_queue)

    def dispatched(self, frames: Any, took_ns: int, before: list[int]) -> None:
        """Class one message the listener has just handled (see the module docstring)."""
        slowest = took_ns > self.max_ns
        self.max_ns = max(self.max_ns, took_ns)
        moved = [(n, self.counters[n] - b) for n, b in zip(TRACKED, before, strict=True)]
        moved = [(n, d) for n, d in moved if d]
        if not moved:
            cat = "accepted"
        elif len(moved) == 1 and moved[0][1] == 1:
            cat = moved[0][0]
        else:
            cat = "multi:" + ",".join(f"{n}+{d}" for n, d in moved)
        got = [bytes(f) for f in frames]
        for q in (self.queue, self.beat_queue):
            if q and q[0][0] == got:
                _, bad, kind = q.popleft()
                slot = self.where[tuple(got)]
                slot[1] -= 1
                if not slot[1]:
                    del self.where[tuple(got)]
                self.fuzz[cat] += 1
                self.by_type[kind, cat] += 1
                if slowest:
                    self.slowest = f"{kind} ({cat}, {[len(f) for f in got]} bytes)"
                if bad != (cat == "bad_messages") and len(self.mismatches) < 20:
                    self.mismatches.append(f"{kind}: local decode bad={bad}, agent {cat}")
                break
        else:
            self.real[cat] += 1
            if slowest:
                self.slowest = f"real ({cat})"
        self.handled += 1


def tally_every_listener(monkeypatch: pytest.MonkeyPatch) -> dict[int, Tally]:
    """Wrap ``ControlPlane._dispatch`` for every plane made from now on (patched on the
    class, before any agent starts: a listener already waiting in ``recv`` holds the method
    it looked up). Returns ``id(plane) -> Tally``, filled as planes handle messages; every
    message a plane ever handled is in its tally, its counters started at 0."""
    tallies: dict[int, Tally] = {}
    original = ControlPlane._dispatch
    clock = time.perf_counter_ns

    def dispatch(self: ControlPlane, frames: Any, handle: Any, *rest: Any) -> None:
        tally = tallies.get(id(self))
        if tally is None:
            tally = tallies[id(self)] = Tally(self._counters)
        before = [tally.counters[n] for n in TRACKED]
        start = clock()
        original(self, frames, handle, *rest)
        tally.dispatched(frames, clock() - start, before)

    monkeypatch.setattr(ControlPlane, "_dispatch", dispatch)
    return tallies


# ------------------------------------------------------------------------ the set-up


@dataclass
class Live:
    prefill: Any
    decode: Any
    src: HostKVPool
    dst: Guarded
    fake: FakeDecode
    attacker: Any
    url: str
    #: room -> epoch of the real rooms in flight (the forgeries' targets)
    live: dict[int, int] = field(default_factory=dict)
    done: int = 0
    bad_rooms: list[str] = field(default_factory=list)


@asynccontextmanager
async def open_live(url: str) -> AsyncIterator[Live]:
    src, dst = host_pool(), guarded_pool()
    engines = [make_engine("mooncake") for _ in range(3)]
    try:
        async with AsyncExitStack() as stack:
            prefill = await stack.enter_async_context(
                open_prefill(engine=engines[0], pool=src.spec, bootstrap_url=url, kv_heads=2)
            )
            decode = await stack.enter_async_context(
                open_decode(engine=engines[1], pool=dst.pool.spec)
            )
            fake = await stack.enter_async_context(fake_decode())
            yield Live(prefill, decode, src, dst, fake, engines[2], url)
    finally:
        for e in engines:
            e.close()


async def real_traffic(live: Live, worker: int, stop: trio.Event, max_rooms: int) -> None:
    """Real rooms, one after another, each verified byte for byte."""
    pages = np.arange(worker * 8, worker * 8 + 5)
    for i in range(max_rooms):
        if stop.is_set():
            return
        room = REAL_BASE + worker * (REAL_SPAN // WORKERS) + i
        live.src.fill(pages, room)
        live.src.fill_aux(worker, room)
        sender = live.prefill.sender(room, num_pages=5, aux_slot=worker)
        receiver = live.decode.receiver(room, bootstrap_url=live.url)
        receiver.init(pages, worker)
        live.live[room] = receiver.epoch
        sender.send(pages, last=True)
        try:
            with trio.fail_after(30):
                got, sent = await receiver.wait(), await sender.wait()
        finally:
            del live.live[room]
        dst = live.dst.pool
        ok = (
            got is KVPoll.Success
            and sent is KVPoll.Success
            and bool((dst.kv[:, pages, :] == live.src.expected(room, 5)).all())
            and dst.aux_ok(worker, room)
        )
        if ok:
            live.done += 1
        elif len(live.bad_rooms) < 20:
            live.bad_rooms.append(f"room {room}: {got}/{sent} {receiver.failure!r} "
                                  f"{sender.failure!r}")


# ------------------------------------------------------------------------ the fuzzers


class Fuzzer:
    """Draws the messages for one agent, decodes each locally, withholds the ones described
    in the module docstring, and says which are bad."""

    def __init__(self, side: str, live: Live, rng: random.Random) -> None:
        self.side = side
        self.live = live
        self.rng = rng
        fake = live.fake.endpoint
        self.decode_endpoints = {live.decode.endpoint, live.decode.control.heartbeat_endpoint}
        self.reply_ok = {fake, *CLOSED_PORTS, *self.decode_endpoints}
        self.session = live.attacker.session_id
        self.meta = live.attacker.metadata()
        self.withheld: Counter[str] = Counter()
        r = FUZZ_ROOM
        pool = live.dst.pool.spec
        if side == "prefill":
            bases = [
                make_base(register(fake, live.attacker, pool)),
                make_base(register(fake, live.attacker, pool, decode_tp=3)),
                make_base(register(CLOSED_PORTS[0], live.attacker, pool)),
                make_base(transfer(r, 1, fake, 3), np.array([1, 2, 3], np.int32)),
                make_base(transfer(r + 1, 2, fake, 0), np.zeros(0, np.int32)),
                make_base(_wire.Abort(v=V, room=r + 2, epoch=5, endpoint=fake)),
                make_base(_wire.Ping(v=V, nonce=77, endpoint=fake)),
                make_base(_wire.Status(v=V, room=r, epoch=1, rank=0, ok=False, reason="x")),
                make_base(_wire.AbortAck(v=V, room=r, epoch=1, rank=0)),
                make_base(_wire.Pong(v=V, nonce=1 << 40, rank=0)),
            ]
        else:
            bases = [
                make_base(_wire.Status(v=V, room=r, epoch=1, rank=0, ok=True)),
                make_base(_wire.Status(v=V, room=r, epoch=1, rank=1, ok=False, reason="no")),
                make_base(_wire.AbortAck(v=V, room=r, epoch=1, rank=0)),
                make_base(_wire.Pong(v=V, nonce=1 << 40, rank=0)),
                make_base(_wire.Ping(v=V, nonce=77, endpoint=fake)),
                make_base(_wire.Abort(v=V, room=r, epoch=5, endpoint=fake)),
                make_base(register(fake, live.attacker, pool)),
                make_base(transfer(r, 1, fake, 2), np.array([1, 2], np.int32)),
            ]
        classes = [c for c in Mutator(rng, bases).table if c != "frame_types"]
        self.mutator = Mutator(rng, bases, huge_every=1000, endpoints=CLOSED_PORTS,
                               classes=classes)

    def forged(self) -> tuple[str, list[bytes]] | None:
        """A message with a forged identity about a room in use (None: no room in use)."""
        if not self.live.live:
            return None
        room, epoch = self.rng.choice(list(self.live.live.items()))
        wrong = (epoch + self.rng.randrange(1, 1 << 20)) % (1 << 62)
        rng = self.rng
        if self.side == "prefill":
            how = rng.randrange(4)
            if how == 0:  # ABORT for the room, wrong epoch, acked to the real decode or us
                end = rng.choice([self.live.decode.endpoint, self.live.fake.endpoint])
                msg: Any = _wire.Abort(v=V, room=room, epoch=wrong | 1, endpoint=end)
            elif how == 1:  # TRANSFER for the room from an endpoint that never registered
                end = rng.choice(FORGER_PORTS)
                t = transfer(room, wrong & ~1, end, 5)
                return "forged transfer", _wire.encode(t, np.arange(5, dtype=np.int32))
            elif how == 2:  # a prefill rank's messages sent to prefill
                msg = rng.choice([
                    _wire.Status(v=V, room=room, epoch=epoch, rank=0, ok=True),
                    _wire.AbortAck(v=V, room=room, epoch=epoch, rank=0),
                ])
            else:  # PING naming the real decode's heartbeat endpoint (a reflected PONG)
                hb = self.live.decode.control.heartbeat_endpoint
                msg = _wire.Ping(v=V, nonce=(1 << 50) + rng.randrange(1 << 20), endpoint=hb)
        else:
            how = rng.randrange(4)
            if how == 0:
                msg = _wire.Status(v=V, room=room, epoch=wrong, rank=0, ok=rng.random() < 0.5)
            elif how == 1:
                msg = _wire.Status(v=V, room=room, epoch=epoch, rank=rng.randint(1, 9),
                                   ok=rng.random() < 0.5, reason="forged")
            elif how == 2:
                msg = _wire.AbortAck(v=V, room=room, epoch=wrong, rank=0)
            else:
                msg = _wire.AbortAck(v=V, room=room, epoch=epoch, rank=rng.randint(1, 9))
        return f"forged {type(msg).__name__.lower()}", _wire.encode(msg)

    def withhold(self, msg: Any) -> str | None:
        """Why ``msg`` (decoded) is not sent, or None."""
        endpoint = getattr(msg, "endpoint", None)
        if endpoint is not None and endpoint not in self.reply_ok | set(FORGER_PORTS):
            return "endpoint not ours"
        if isinstance(msg, _wire.Register):
            if msg.session != self.session or msg.engine_meta != self.meta:
                return "engine session not ours"
            if endpoint in self.decode_endpoints or endpoint in FORGER_PORTS:
                return "auth off: REGISTER as another peer"
        room = getattr(msg, "room", None)
        if real_room(room) and self.side == "prefill" and isinstance(msg, _wire.Transfer):
            return "auth off: TRANSFER for a room in use"
        if (
            real_room(room)
            and msg.epoch == self.live.live.get(room)
            and isinstance(msg, (_wire.Abort, _wire.Status, _wire.AbortAck))
            and getattr(msg, "rank", 0) == 0
        ):
            return "auth off: the room's real epoch and rank"
        return None

    def draw(self) -> tuple[str, list[bytes], bool] | None:
        """(kind, frames, locally bad), or None for a withheld message."""
        forged = self.forged() if self.rng.random() < 0.1 else None
        if forged is not None:
            kind, frames = forged
        else:
            kind, frames = self.mutator.draw()
            frames = [bytes(f) for f in frames]
            if not frames:
                frames = [b""]
        if any(len(f) > _wire.MAX_FRAME_BYTES for f in frames):
            # refused by the socket itself (MAXMSGSIZE), with the connection and what it still
            # carried (tests/test_control.py: a frame larger than any message)
            self.withheld["frame over MAX_FRAME_BYTES"] += 1
            return None
        try:
            msg, _ = _wire.decode(frames)
        except ProtocolError:
            return kind, frames, True
        why = self.withhold(msg) if not kind.startswith("forged transfer") else None
        if why is not None:
            self.withheld[why] += 1
            return None
        return f"{kind}/{type(msg).__name__}", frames, False


async def alive(side: str, live: Live) -> None:
    """Prefill answers a PING (its PONG reaches the fake decode) and an ABORT barrier. Decode
    answers nothing to a stranger: its proof of life is its queue of fuzz messages draining
    (each one handled by the wrapped listener) while its real rooms go on succeeding."""
    if side == "prefill":
        nonce = random.randrange(1 << 60)
        async with raw_push(live.prefill.control.heartbeat_endpoint) as sock:
            await sock.send_multipart(
                _wire.encode(_wire.Ping(v=V, nonce=nonce, endpoint=live.fake.endpoint))
            )
            with trio.fail_after(10):
                await live.fake.next_matching(
                    lambda m: isinstance(m, _wire.Pong) and m.nonce == nonce
                )
        async with raw_push(live.prefill.endpoint) as sock:
            await barrier(sock, live.fake)


async def fuzz_agent(
    side: str, live: Live, tally: Tally, n: int, bound: float
) -> tuple[int, Counter[str], float]:
    agent = live.prefill if side == "prefill" else live.decode
    fuzzer = Fuzzer(side, live, random.Random(f"{SEED}-{side}"))
    sent = 0
    start = time.monotonic()
    with trio.fail_after(bound):
        async with (
            raw_push(agent.endpoint) as main,
            raw_push(agent.control.heartbeat_endpoint) as beat,
        ):
            drawn = 0
            while drawn < n:
                drawn += 1
                got = fuzzer.draw()
                if got is None:
                    continue
                kind, frames, bad = got
                on_beat = tally.enqueue(frames, bad, kind, drawn % 2 == 1)
                await (beat if on_beat else main).send_multipart(frames)
                sent += 1
                if drawn % 5000 == 0:
                    await alive(side, live)
            with trio.move_on_after(bound / 2) as waited:
                while tally.pending():  # noqa: ASYNC110 - the wrapped listener has no event
                    await trio.sleep(0.01)
            if waited.cancelled_caught:
                queues = (tally.queue, tally.beat_queue)
                heads = [q[0][2] + " " + repr(q[0][0])[:300] for q in queues if q]
                raise AssertionError(f"{side}: {tally.pending()} fuzz messages never handled "
                                     f"(sent {sent}, handled {tally.handled}); heads {heads}")
            await alive(side, live)
    return sent, fuzzer.withheld, time.monotonic() - start


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("size", ["short", "full"])
async def test_live_listeners_survive_fuzz_with_real_traffic(
    bootstrap_url: str,
    size: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = MESSAGES[size]
    planes = tally_every_listener(monkeypatch)
    async with open_live(bootstrap_url) as live:
        tallies = {
            side: planes.setdefault(id(agent.control), Tally(agent.counters))
            for side, agent in (("prefill", live.prefill), ("decode", live.decode))
        }
        assert all(t.counters is a.counters for t, a in zip(
            tallies.values(), (live.prefill, live.decode), strict=True))
        befores = {"prefill": AgentStatistics(), "decode": AgentStatistics()}  # from 0
        results: dict[str, tuple[int, Counter[str], float]] = {}
        stop = trio.Event()
        async with trio.open_nursery() as traffic:
            for w in range(WORKERS):
                traffic.start_soon(real_traffic, live, w, stop, 1_000_000)
            for side in ("prefill", "decode"):
                results[side] = await fuzz_agent(side, live, tallies[side], n, BOUND_S[size])
            stop.set()
        # one more real room after everything, then the memory checks
        await real_traffic(live, 0, trio.Event(), 1)
        touched = live.dst.untouched()
        afters = {"prefill": live.prefill.statistics(), "decode": live.decode.statistics()}

    lines = [f"\nlive fuzz ({size}), seed {SEED}: {live.done} real rooms verified, "
             f"{len(live.bad_rooms)} bad; poison broken: {touched}"]
    problems: list[str] = []
    for side, tally in tallies.items():
        sent, withheld, took = results[side]
        before, after = befores[side], afters[side]
        delta = {c: getattr(after, c) - getattr(before, c) for c in TRACKED}
        lines.append(
            f"  {side}: {sent} sent in {took:.1f} s ({sent / took:.0f}/s), withheld "
            f"{dict(withheld)}, fuzz {dict(tally.fuzz)}, real {dict(tally.real)}, "
            f"counter deltas {delta}, slowest dispatch {tally.max_ns / 1000:.0f} us: "
            f"{tally.slowest}"
        )
        types: Counter[str] = Counter()
        for (kind, cat), k in tally.by_type.items():
            if cat != "bad_messages":
                types[f"{kind.split('/')[-1]}:{cat}"] += k
        lines.append(f"    by type (not bad): {dict(sorted(types.items()))}")
        if sum(tally.fuzz.values()) != sent:
            problems.append(f"{side}: {sent} sent, {sum(tally.fuzz.values())} handled")
        problems += [f"{side}: {m}" for m in tally.mismatches]
        for cat in tally.fuzz | tally.real:
            if cat.startswith("multi"):
                problems.append(f"{side}: a message moved several counters: {cat}")
        for c in TRACKED:
            if delta[c] != tally.fuzz[c] + tally.real[c]:
                problems.append(f"{side}: {c} moved {delta[c]}, the listener saw "
                                f"{tally.fuzz[c]} + {tally.real[c]}")
        if tally.fuzz["handler_errors"] or tally.real["handler_errors"]:
            problems.append(f"{side}: handler errors")
        if tally.real["bad_messages"]:
            problems.append(f"{side}: a real peer's message was bad")
        if side == "decode":
            wrong = {k: v for k, v in types.items()
                     if k.endswith((":accepted", ":acks_received"))
                     and k not in ("Pong:accepted", "AbortAck:acks_received")}
            if wrong:
                problems.append(f"decode accepted what it must not: {wrong}")
    with capsys.disabled():
        print("\n".join(lines))
    from ._gen import report

    report(f"live-{size}", {"lines": lines, "problems": problems})
    assert not live.bad_rooms, live.bad_rooms
    assert live.done >= WORKERS, live.done
    assert touched == {"guard_kv": 0, "guard_aux": 0, "unused_kv": 0, "unused_aux": 0}
    assert not problems, "\n".join(problems)
    writes = [s.engine_calls + s.chunks_batched for s in (afters["prefill"], befores["prefill"])]
    assert writes[0] - writes[1] >= live.done  # (a chunk write: its own call, or batched)

