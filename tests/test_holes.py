"""Acceptance checks for the holes of issue 13, on real engines, real ZeroMQ and the real
bootstrap server. Each test states the target behaviour; each failed on the main of the day
the issue was filed (the holes it names), for the reason its docstring gives.

Names the fix introduces (``ConfigurationError``, ``IncompatiblePeer``, ``TransferTimeout``,
``DecodeConfig.close_timeout``, the ``kv_heads`` parameter of ``open_decode``, new counters)
are looked up lazily, so a missing one fails its own test with an assertion, not the module.

How the interleavings are forced, without sleeping: a :class:`FaultEngine` wraps the real
prefill engine, and a ``stall`` fault holds a write inside the engine until the test opens the
gate. Where a test shows that something does *not* happen, it watches a bounded window; with
correct code the thing cannot happen in it, so the check cannot flake.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import trio

import trio_pd
from trio_pd import (
    AdmissionClosed,
    DecodeConfig,
    EngineError,
    KVPoll,
    PeerLost,
    PrefillConfig,
    RemoteFailure,
    TransferAborted,
    open_decode,
    open_prefill,
)
from trio_pd.core import _wire as wire
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.engines.fault import Fault, FaultEngine, Policy
from trio_pd.testing.pools import DEST_POISON, HostKVPool, PageAllocator, page_rows

from .helpers.agents import host_pool, open_pair

#: bound on every wait for something that must happen
BOUND = 10.0
#: how long a test watches for something that must not happen
QUIET = 0.5


def config(cls: Any, **kw: Any) -> Any:
    """``cls(**kw)`` with only the fields ``cls`` has: a knob the fix adds is used once it
    exists (and its absence is asserted where the test is about it)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in kw.items() if k in names})


def has_field(cls: Any, name: str) -> bool:
    return name in {f.name for f in dataclasses.fields(cls)}


def readme_pool(**kw: Any) -> HostKVPool:
    """The README example's pool: 2 layers, 16-token pages, 8 KV heads of 32 bytes."""
    args: dict[str, Any] = dict(
        layout="mha", num_pages=64, num_layers=2, page_size=16, head_bytes=32, heads=8
    )
    args.update(kw)
    return HostKVPool(**args)


def stall_all(_i: int, _peer: str, _n: int) -> Fault | None:
    return Fault("stall")


class LoggingFault(FaultEngine):
    """A FaultEngine that logs ``"write returned"`` when a write comes back (in its thread)
    and sets :attr:`returned`."""

    def __init__(self, inner: TransferEngine, policy: Policy, log: list[str]) -> None:
        super().__init__(inner, policy)
        self.log = log
        self.returned = threading.Event()

    def write(self, *args: Any, **kw: Any) -> None:
        try:
            super().write(*args, **kw)
        finally:
            self.log.append("write returned")
            self.returned.set()


@asynccontextmanager
async def engines(*names: str) -> AsyncIterator[list[TransferEngine]]:
    made = [make_engine(n) for n in names]
    try:
        yield made
    finally:
        for e in made:
            e.close()


@contextmanager
def patched_sends(
    monkeypatch: pytest.MonkeyPatch, refuse: Callable[[str, wire.Message], bool]
) -> Iterator[list[tuple[str, wire.Message]]]:
    """Patch the control plane's ``send_nowait`` for every agent made after this (patched on
    the class, so also a bound method an agent keeps): record every send attempt, and answer
    ``False`` (the peer's socket is full) where ``refuse(endpoint, msg)``."""
    from trio_pd.io._control import ControlPlane

    attempts: list[tuple[str, wire.Message]] = []
    real = ControlPlane.send_nowait

    def send_nowait(self: Any, endpoint: str, msg: wire.Message, pages: Any = None) -> bool:
        attempts.append((endpoint, msg))
        if refuse(endpoint, msg):
            return False
        return real(self, endpoint, msg, pages)

    monkeypatch.setattr(ControlPlane, "send_nowait", send_nowait)
    yield attempts


def _dead_endpoint() -> str:
    """A tcp endpoint nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


# ------------------------------------------------------------------------------ hole 1: kv_heads


async def test_hole1_readme_pool_without_kv_heads_moves_every_byte(
    engine_name: str, bootstrap_url: str
) -> None:
    """Hole 1: with the README's 8-head pool on both sides and ``kv_heads`` left out, the room
    reports Success on both sides *and* every byte of the destination pages equals the source.
    (Before: Success, with only the first head's bytes written, 13 % of the pages.)"""
    src, dst = readme_pool(), readme_pool()
    room, src_pages, dst_pages = 7, np.arange(4), np.arange(10, 14)
    src.fill(src_pages, room=room)
    async with engines(engine_name, engine_name) as (pe, de), AsyncExitStack() as stack:
        prefill = await stack.enter_async_context(
            open_prefill(engine=pe, pool=src.spec, bootstrap_url=bootstrap_url)
        )
        decode = await stack.enter_async_context(open_decode(engine=de, pool=dst.spec))
        sender = prefill.sender(room, num_pages=4, aux_slot=0)
        receiver = decode.receiver(room, bootstrap_url=bootstrap_url)
        receiver.init(dst_pages, aux_slot=3)
        sender.send(src_pages[:2])
        sender.send(src_pages[2:], last=True)
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Success
            assert await sender.wait() is KVPoll.Success
        same = dst.kv[:, dst_pages] == src.kv[:, src_pages]
        assert same.all(), f"Success, but only {same.mean():.1%} of the destination bytes match"


async def test_hole1_prefill_kv_heads_disagreeing_with_pool_is_refused(
    bootstrap_url: str,
) -> None:
    """Hole 1: ``open_prefill(kv_heads=4)`` over an 8-head pool at TP 1 cannot be right: it
    raises :class:`trio_pd.ConfigurationError` (a ValueError) on entering the block."""
    configuration_error = getattr(trio_pd, "ConfigurationError", None)
    async with engines("mooncake") as (pe,):
        with pytest.raises(configuration_error or ValueError):
            async with open_prefill(
                engine=pe, pool=readme_pool().spec, bootstrap_url=bootstrap_url, kv_heads=4
            ):
                pass
    assert configuration_error is not None and issubclass(configuration_error, ValueError)


async def test_hole1_decode_kv_heads_disagreeing_with_pool_is_refused() -> None:
    """Hole 1: ``open_decode`` takes ``kv_heads`` too; 4 over an 8-head pool at TP 1 raises
    :class:`trio_pd.ConfigurationError` on entering the block."""
    assert "kv_heads" in inspect.signature(open_decode).parameters, (
        "open_decode has no kv_heads parameter"
    )
    configuration_error = getattr(trio_pd, "ConfigurationError", None)
    assert configuration_error is not None and issubclass(configuration_error, ValueError)
    kw: dict[str, Any] = {"kv_heads": 4}  # (a parameter the fix added)
    async with engines("mooncake") as (de,):
        with pytest.raises(configuration_error):
            async with open_decode(engine=de, pool=readme_pool().spec, **kw):
                pass


async def test_hole1_page_size_mismatch_refused_at_register(bootstrap_url: str) -> None:
    """Hole 1: a decode pool with 32-token pages against prefill's 16-token pages is refused at
    REGISTER, with a typed reason both sides see: the receiver fails within 5 s (its waiting
    deadline is 120 s) with :class:`trio_pd.IncompatiblePeer` naming the page size, and prefill
    counts the refused REGISTER. (Before: REGISTER accepted, the receiver waits.)"""
    incompatible = getattr(trio_pd, "IncompatiblePeer", None)
    src, dst = readme_pool(), readme_pool(page_size=32)
    async with engines("mooncake", "mooncake") as (pe, de), AsyncExitStack() as stack:
        prefill = await stack.enter_async_context(
            open_prefill(engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=8)
        )
        decode = await stack.enter_async_context(open_decode(engine=de, pool=dst.spec))
        receiver = decode.receiver(5, bootstrap_url=bootstrap_url)
        receiver.init(np.arange(2), aux_slot=0)
        with trio.move_on_after(5.0):
            await receiver.wait()
        assert receiver.poll() is KVPoll.Failed, (
            f"receiver still {receiver.poll().name} 5 s after init"
        )
        failure = receiver.failure
        assert incompatible is not None and isinstance(failure, incompatible), repr(failure)
        assert "page" in str(failure)
        # prefill sees it too: decode still sends its REGISTER, which prefill refuses
        with trio.fail_after(5):
            while prefill.statistics().refused_messages < 1:  # noqa: ASYNC110
                await trio.sleep(0.01)


# ---------------------------------------------------------------------- hole 2: decode close


@asynccontextmanager
async def decode_in_task(
    engine: TransferEngine, pool: HostKVPool, cfg: DecodeConfig
) -> AsyncIterator[tuple[Any, trio.Event, trio.Event, list[float]]]:
    """``open_decode`` run in a task: yields (agent, leave, closed, [close duration]). Setting
    ``leave`` makes the task leave the block; ``closed`` is set once ``open_decode`` exited."""
    leave, closed = trio.Event(), trio.Event()
    took: list[float] = []

    async def run(task_status: trio.TaskStatus[Any]) -> None:
        async with open_decode(engine=engine, pool=pool.spec, config=cfg) as decode:
            task_status.started(decode)
            await leave.wait()
            t0 = trio.current_time()
        took.append(trio.current_time() - t0)
        closed.set()

    async with trio.open_nursery() as nursery:
        decode = await nursery.start(run)
        try:
            yield decode, leave, closed, took
        finally:
            leave.set()


@dataclass
class StalledRoom:
    """One room whose prefill write is stalled inside the engine, with decode open in a task:
    ``leave`` makes decode close, ``closed`` is set once it did (``took``: how long)."""

    pe: Any
    decode: Any
    leave: trio.Event
    closed: trio.Event
    took: list[float]
    log: list[str]
    alloc: PageAllocator
    n: int


@asynccontextmanager
async def stalled_room(
    bootstrap_url: str, room: int, close_timeout: float
) -> AsyncIterator[StalledRoom]:
    log: list[str] = []
    src, dst = host_pool(), host_pool()
    alloc = PageAllocator(page_rows(dst), DEST_POISON)
    n = 4
    src_pages = np.arange(n)
    src.fill(src_pages, room)
    async with engines("mooncake", "mooncake") as (inner, de):
        pe = LoggingFault(inner, stall_all, log)
        async with open_prefill(
            engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2
        ) as prefill:
            try:  # (the gate opens before prefill's exit waits for the stalled call)
                cfg = config(DecodeConfig, close_timeout=close_timeout)
                async with decode_in_task(de, dst, cfg) as (decode, leave, closed, took):
                    ids = alloc.alloc_nowait(n)
                    assert ids is not None

                    def release() -> None:
                        log.append("dst released")
                        alloc.free(ids)

                    sender = prefill.sender(room, num_pages=n, aux_slot=0)
                    receiver = decode.receiver(room, bootstrap_url=bootstrap_url)
                    receiver.init(ids, 0, on_release=release)
                    sender.send(src_pages, last=True)
                    with trio.fail_after(BOUND):
                        await pe.stalls.wait_stalled_async(1)
                    yield StalledRoom(pe, decode, leave, closed, took, log, alloc, n)
            finally:
                pe.stalls.release_all()


async def test_hole2_closing_decode_holds_pages_until_the_write_returns(
    bootstrap_url: str,
) -> None:
    """Hole 2: decode leaves ``open_decode`` while prefill's write into the room's pages is
    stalled inside the engine. The pages are not handed back under the write: ``on_release``
    runs only after the write returned, and the sanitizing allocator sees no late write into
    a free row. (Before: the pages went back at once, with the write still to come.)"""
    async with stalled_room(bootstrap_url, 201, BOUND) as r:
        r.leave.set()  # decode closes while the write is inside the engine
        with trio.move_on_after(QUIET):
            await r.closed.wait()
        released_under_the_write = "dst released" in r.log
        r.pe.stalls.release_all()  # the write lands
        assert await trio.to_thread.run_sync(r.pe.returned.wait, BOUND)
        with trio.fail_after(BOUND):
            await r.closed.wait()
    late = r.alloc.late_in_free_rows()
    assert late == 0, f"{late} of {r.n} freed pages were written after their release"
    assert not released_under_the_write, (
        "on_release ran while the write into the pages was still stalled"
    )
    assert r.log == ["write returned", "dst released"]


async def test_hole2_close_timeout_reports_unproven_rooms_and_keeps_their_pages(
    bootstrap_url: str,
) -> None:
    """Hole 2: with ``DecodeConfig(close_timeout=1.0)`` and prefill's write stalled past it,
    closing decode takes about the close timeout, never runs ``on_release`` (the pages are
    not handed back as free), and counts the room ``rooms_unproven_at_close``. (Before: the
    close released the pages at once.)"""
    close_timeout = 1.0
    async with stalled_room(bootstrap_url, 202, close_timeout) as r:
        r.leave.set()
        with trio.fail_after(close_timeout + 2.0):
            await r.closed.wait()
        assert "dst released" not in r.log, (
            "on_release ran at close while the write into the pages was unproven"
        )
        assert r.took[0] <= close_timeout + 2.0
        stats = r.decode.statistics()
        assert getattr(stats, "rooms_unproven_at_close", 0) >= 1
        r.pe.stalls.release_all()  # the write ends (lands or fails): still no release
        assert await trio.to_thread.run_sync(r.pe.returned.wait, BOUND)
        assert "dst released" not in r.log
        assert r.alloc.late_in_free_rows() == 0
        assert has_field(DecodeConfig, "close_timeout")


# ------------------------------------------------------------------------------ hole 3: probes


class HangingProbe(FaultEngine):
    """Every probe hangs for ``hang`` seconds, longer than the quarantine fence, then answers
    False: what Mooncake's ``send_probe`` does against a hung peer (about 60 s, then "no
    answer"). A probe that did not answer within its bound proves nothing either way."""

    hang = 1.0

    def probe(self, peer: str) -> bool:
        time.sleep(self.hang)
        return False


async def test_hole3_probe_timeout_does_not_end_a_quarantine(bootstrap_url: str) -> None:
    """Hole 3: the first write fails (engine error), so its lease is quarantined; every probe
    of the peer hangs past the fence (0.3 s). A probe that timed out proves nothing: for 2 s
    the source pages stay out (no ``on_release``, ``released_after_quarantine == 0``) and the
    unknown answer is counted (``quarantine_unknown``). (Before: the timed-out probe was taken
    for "peer gone" and the quarantine ended.)"""
    src, dst = host_pool(), host_pool()
    released: list[str] = []
    room, n = 301, 2
    async with engines("mooncake", "mooncake") as (inner, de):
        pe = HangingProbe(inner, lambda i, _p, _n: Fault("fail") if i == 0 else None)
        async with open_prefill(
            engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2,
            config=PrefillConfig(quarantine_fence=0.3),
        ) as prefill, open_decode(
            engine=de, pool=dst.spec, config=config(DecodeConfig, close_timeout=1.0)
        ) as decode:
            sender = prefill.sender(
                room, num_pages=n, aux_slot=0, on_release=lambda: released.append("src")
            )
            receiver = decode.receiver(room, bootstrap_url=bootstrap_url)
            receiver.init(np.arange(n), 0)
            sender.send(np.arange(n), last=True)
            with trio.fail_after(BOUND):
                assert await sender.wait() is KVPoll.Failed
            # (the peer answered no probe, so it is taken for lost: PeerLost, carrying the
            # engine's error; a peer that answers would leave the EngineError itself)
            assert isinstance(sender.failure, PeerLost), repr(sender.failure)
            assert "injected fault" in str(sender.failure)
            assert prefill.statistics().quarantined == 1
            with trio.move_on_after(2.0):
                await sender.wait_released()
            stats = prefill.statistics()
            assert released == [], "the quarantine ended although every probe timed out"
            assert stats.released_after_quarantine == 0
            assert getattr(stats, "quarantine_unknown", 0) >= 1


# ------------------------------------------------------------------------------ hole 4: retries


def _rank_pool(rank: int, tp: int, kv_heads: int = 2) -> HostKVPool:
    """The pool of TP rank ``rank`` of ``tp`` (``tp`` divides ``kv_heads``): its even share."""
    heads = kv_heads // tp
    return host_pool("mha", heads=heads, first_head=rank * heads)


async def test_hole4_decode_abort_retries_stay_bounded(
    bootstrap_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hole 4: decode reads from two prefill ranks whose sockets refuse every ABORT. After the
    room is aborted, each endpoint sees at most 20 ABORT attempts in 0.6 s. (Before: every
    failed send re-scheduled the whole room, so attempts doubled every 50 ms.)"""
    room = 401
    transfers: list[str] = []
    sent_transfers = trio.Event()
    refusing = [True]

    def refuse(endpoint: str, msg: wire.Message) -> bool:
        if isinstance(msg, wire.Transfer) and msg.room == room:
            transfers.append(endpoint)  # (sent synchronously, in the trio thread)
            if len(transfers) == 2:
                sent_transfers.set()
        return refusing[0] and isinstance(msg, wire.Abort)

    with patched_sends(monkeypatch, refuse) as attempts:
        async with engines("mooncake", "mooncake", "mooncake") as (p0, p1, de):
            srcs = [_rank_pool(r, 2) for r in range(2)]
            dst = _rank_pool(0, 1)
            async with AsyncExitStack() as stack:
                prefills = [
                    await stack.enter_async_context(
                        open_prefill(
                            engine=e, pool=srcs[r].spec, bootstrap_url=bootstrap_url,
                            tp_rank=r, tp_size=2, kv_heads=2,
                        )
                    )
                    for r, e in enumerate((p0, p1))
                ]
                decode = await stack.enter_async_context(
                    open_decode(
                        engine=de, pool=dst.spec, config=config(DecodeConfig, close_timeout=1.0)
                    )
                )
                endpoints = {p.endpoint for p in prefills}
                receiver = decode.receiver(room, bootstrap_url=bootstrap_url)
                receiver.init(np.arange(2), 0)
                with trio.fail_after(BOUND):
                    await sent_transfers.wait()  # the room is bound to both prefill ranks
                receiver.abort()
                await trio.sleep(0.6)  # a rate window
                per_endpoint = Counter(
                    e for e, m in attempts if isinstance(m, wire.Abort) and m.room == room
                )
                refusing[0] = False
                assert set(per_endpoint) == endpoints
                assert max(per_endpoint.values()) <= 20, dict(per_endpoint)


async def test_hole4_prefill_ack_retries_to_a_mute_peer_stay_bounded(
    insecure: None, bootstrap_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hole 4: a decode peer that never reads asks five times for the drain of a room this
    rank does not hold (its ABORT re-sent). The ABORT_ACKs to it are retried under one bound:
    at most 20 attempts in the next 0.6 s. (Before: every ABORT started its own endless
    50 ms retry chain, five chains.)"""
    endpoint = _dead_endpoint()

    def refuse(ep: str, msg: wire.Message) -> bool:
        return ep == endpoint and isinstance(msg, wire.AbortAck)

    with patched_sends(monkeypatch, refuse) as attempts:
        src, dst = host_pool(), host_pool()
        async with engines("mooncake", "mooncake") as (pe, mute):
            await trio.to_thread.run_sync(mute.register, dst.spec.regions())
            try:
                async with open_prefill(
                    engine=pe, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2
                ) as prefill:
                    prefill._handle(
                        wire.Register(
                            v=wire.WIRE_VERSION, endpoint=endpoint, decode_rank=0, decode_tp=1,
                            engine=mute.name, session=mute.session_id,
                            engine_meta=mute.metadata(), pool=wire.PoolWire.from_spec(dst.spec),
                        ),
                        None,
                    )
                    abort = wire.Abort(v=wire.WIRE_VERSION, room=402, epoch=3, endpoint=endpoint)
                    for _ in range(5):
                        prefill._handle(abort, None)
                    before = sum(isinstance(m, wire.AbortAck) for _e, m in attempts)
                    assert before >= 1
                    await trio.sleep(0.6)  # a rate window
                    acks = sum(isinstance(m, wire.AbortAck) for _e, m in attempts) - before
                    assert acks <= 20, f"{acks} ABORT_ACK attempts in 0.6 s"
            finally:
                await trio.to_thread.run_sync(mute.unregister, dst.spec.regions())


# ------------------------------------------------------------------------------ hole 5: epochs


async def test_hole5_late_abort_of_old_epoch_spares_the_next_use(
    engine_name: str, insecure: None, bootstrap_url: str
) -> None:
    """Hole 5: the scheduler has created the sender for room R's next use; before that use's
    TRANSFER arrives, a late ABORT for R's old epoch E1 comes in. The use turns out to be epoch
    E2: ``send()`` does not raise, and both sides reach Success with the right bytes.
    (Before: the ABORT aborted the new use; ``send()`` raised AdmissionClosed.)"""
    async with open_pair(
        engine_name, bootstrap_url, decode_config=config(DecodeConfig, close_timeout=1.0)
    ) as pair:
        room, n, e1, e2 = 501, 3, 11, 12
        src_pages, dst_pages = np.arange(n), np.arange(20, 20 + n)
        pair.src.fill(src_pages, room)
        pair.src.fill_aux(0, room)
        sender = pair.prefill.sender(room, num_pages=n, aux_slot=0)
        pair.prefill._handle(
            wire.Abort(v=wire.WIRE_VERSION, room=room, epoch=e1, endpoint=pair.decode.endpoint),
            None,
        )
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url, epoch=e2)
        receiver.init(dst_pages, 1)
        try:
            sender.send(src_pages, last=True)
        except AdmissionClosed as exc:
            pytest.fail(f"the old epoch's ABORT closed the new use: send() raised {exc!r}")
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Success, receiver.failure
            assert await sender.wait() is KVPoll.Success, sender.failure
        assert pair.verify(room, dst_pages, 1)


async def test_hole5_transfer_of_the_aborted_epoch_is_still_refused(
    engine_name: str, insecure: None, bootstrap_url: str
) -> None:
    """Hole 5, the converse (a guard: the tombstone still works): after ABORT(R, E1) reached
    a sender for R that had no TRANSFER yet, a TRANSFER for (R, E1) is refused: both sides of
    the room fail, and decode's pages go back."""
    async with open_pair(
        engine_name, bootstrap_url, decode_config=config(DecodeConfig, close_timeout=1.0)
    ) as pair:
        room, n, e1 = 502, 2, 21
        released: list[str] = []
        sender = pair.prefill.sender(room, num_pages=n, aux_slot=0)
        pair.prefill._handle(
            wire.Abort(v=wire.WIRE_VERSION, room=room, epoch=e1, endpoint=pair.decode.endpoint),
            None,
        )
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url, epoch=e1)
        receiver.init(np.arange(n), 0, on_release=lambda: released.append("dst"))
        with trio.fail_after(BOUND):
            assert await receiver.wait() is KVPoll.Failed
            assert await sender.wait() is KVPoll.Failed
            await receiver.wait_released()
        assert released == ["dst"]


# ------------------------------------------------------------------------------ also wrong


class FailingRegister(FaultEngine):
    """Its ``register`` registers nothing and raises EngineError(code=7); every
    ``unregister`` call is recorded (and passed on to the real engine)."""

    def __init__(self, inner: TransferEngine) -> None:
        super().__init__(inner)
        self.unregistered: list[object] = []

    def register(self, regions: list[Any]) -> None:
        raise EngineError("boom", code=7)

    def unregister(self, regions: list[Any]) -> None:
        self.unregistered.append(regions)
        self.inner.unregister(regions)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


#: what failed opens raised, kept until the process exits: where an open leaks its ZeroMQ
#: sockets (the bug), a garbage collection during a later test would meet a context whose
#: sockets are still open, and its ``destroy`` can hang
_KEEP: list[BaseException] = []


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_failed_registration_raises_its_own_error_and_leaks_nothing(
    bootstrap_url: str, side: str
) -> None:
    """Also wrong: when registering the pool fails, ``open_prefill`` / ``open_decode`` raise
    that EngineError (its code kept), unregister nothing that was never registered, and
    leave no control socket open (no file descriptors leak over repeated attempts). (Before:
    they called
    ``unregister`` for the regions, raised *its* error over the first one, and the control
    sockets stayed open.)"""

    async def attempt(engine: FailingRegister) -> tuple[type[BaseException], Any, str]:
        pool = host_pool().spec
        try:
            if side == "prefill":
                async with open_prefill(
                    engine=engine, pool=pool, bootstrap_url=bootstrap_url, kv_heads=2
                ):
                    pass
            else:
                async with open_decode(engine=engine, pool=pool):
                    pass
        except BaseException as exc:
            _KEEP.append(exc)  # see _KEEP
            return type(exc), getattr(exc, "code", None), str(exc)
        raise AssertionError("the block was entered although registration failed")

    async with engines("mooncake") as (inner,):
        engine = FailingRegister(inner)
        before = _open_fds()
        raised = [await attempt(engine) for _ in range(3)]
        leaked_fds = _open_fds() - before
        kind, code, text = raised[0]
        assert issubclass(kind, EngineError) and code == 7 and text == "boom", raised[0]
        assert engine.unregistered == [], "unregister called for regions never registered"
        assert leaked_fds <= 2, f"{leaked_fds} file descriptors leaked by 3 failed opens"


async def test_room_error_keeps_its_type_and_code(engine_name: str, bootstrap_url: str) -> None:
    """Also wrong: an engine write fails with EngineError(code=-42); the room's failure is an
    EngineError with that code (before: rebuilt from its text, code None). The decode room,
    which heard prefill's Failed STATUS, fails with a RemoteFailure."""

    def wrap(engine: TransferEngine) -> TransferEngine:
        return FaultEngine(engine, lambda *_: Fault("fail", code=-42), probe_override=True)

    async with open_pair(
        engine_name, bootstrap_url, wrap=wrap,
        prefill_config=PrefillConfig(quarantine_fence=0.2),
        decode_config=config(DecodeConfig, close_timeout=1.0),
    ) as pair:
        room, n = 701, 2
        sender = pair.prefill.sender(room, num_pages=n, aux_slot=0)
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        receiver.init(np.arange(n), 0)
        sender.send(np.arange(n), last=True)
        with trio.fail_after(BOUND):
            assert await sender.wait() is KVPoll.Failed
            assert await receiver.wait() is KVPoll.Failed
        assert isinstance(sender.failure, EngineError), repr(sender.failure)
        assert sender.failure.code == -42, f"code {sender.failure.code}"
        assert isinstance(receiver.failure, RemoteFailure), repr(receiver.failure)
        with trio.fail_after(BOUND):
            await receiver.wait_released()
            await sender.wait_released()


async def test_prefill_bootstrap_deadline_is_a_timeout(
    engine_name: str, bootstrap_url: str
) -> None:
    """Also wrong: a prefill room whose TRANSFER never comes fails at
    ``bootstrap_timeout`` with a TransferTimeout, not a TransferAborted."""
    transfer_timeout = getattr(trio_pd, "TransferTimeout", None)
    async with engines(engine_name) as (pe,), open_prefill(
        engine=pe, pool=host_pool().spec, bootstrap_url=bootstrap_url, kv_heads=2,
        config=PrefillConfig(bootstrap_timeout=0.5),
    ) as prefill:
        sender = prefill.sender(801, num_pages=2, aux_slot=0)
        with trio.fail_after(BOUND):
            assert await sender.wait() is KVPoll.Failed
        failure = sender.failure
        assert not isinstance(failure, TransferAborted), repr(failure)
        assert transfer_timeout is not None and isinstance(failure, transfer_timeout)


@pytest.mark.serial
async def test_decode_waiting_deadline_is_a_timeout(
    engine_name: str, bootstrap_url: str
) -> None:
    """Also wrong: a decode room whose prefill write never finishes (stalled in the engine)
    fails at ``waiting_timeout`` with a TransferTimeout."""
    transfer_timeout = getattr(trio_pd, "TransferTimeout", None)
    faults: list[FaultEngine] = []

    def wrap(engine: TransferEngine) -> TransferEngine:
        faults.append(FaultEngine(engine, stall_all))
        return faults[0]

    async with open_pair(
        engine_name, bootstrap_url, wrap=wrap,
        decode_config=config(DecodeConfig, waiting_timeout=0.5, close_timeout=1.0),
    ) as pair:
        try:
            room, n = 802, 2
            sender = pair.prefill.sender(room, num_pages=n, aux_slot=0)
            receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
            receiver.init(np.arange(n), 0)
            sender.send(np.arange(n), last=True)
            with trio.fail_after(BOUND):
                await faults[0].stalls.wait_stalled_async(1)
                assert await receiver.wait() is KVPoll.Failed
            failure = receiver.failure
            assert transfer_timeout is not None and isinstance(failure, transfer_timeout), (
                repr(failure)
            )
        finally:
            faults[0].stalls.release_all()
        with trio.fail_after(BOUND):
            await receiver.wait_released()
