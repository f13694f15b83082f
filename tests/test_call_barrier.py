"""A failed engine call may still hold blocks inside the engine (SPEC §5.6): its quarantine,
and decode's drain ack after it, end only once the engine proves nothing of it is left.

Measured with the real Mooncake engine over TCP: a call whose first block the peer refuses
returns -1 within milliseconds, while the transport keeps the call's other blocks queued
and delivers them over the next hundreds of milliseconds, reading the source pages after
the call returned. The peer answers a probe meanwhile, and our kernel's send queues are
seen empty between blocks: the old proof (the engine's deadline, a probe, the send queues)
ended the quarantine, and decode released its pages, while those blocks were still to come.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import trio

from trio_pd import DecodeConfig, KVPoll, PrefillConfig, open_decode, open_prefill
from trio_pd.engines import EngineError, call_mark, flushed, make_engine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.testing.pools import DEST_POISON, HostKVPool, PageAllocator

from .helpers.agents import host_pool
from .helpers.child import run_child
from .helpers.engines import HAVE_NIXL

# Gigabyte calls, a stopped peer and the engine's own deadlines: measured alone, after the
# parallel pass (a loaded box stretches every wait here)
pytestmark = pytest.mark.serial

BOUND = 30.0

#: pages of 4 MiB (2 layers, K and V, 16 tokens of 2 heads of 32 KiB), written to decode's
#: pages in reverse order so that no two merge: a call of ``BIG`` pages is 1,024 blocks of
#: 1 MiB (and the aux row), which the engine takes 0.2-0.5 s to deliver
BIG = 256
#: rooms, one after the other: in each the first block of its one call is refused
ROUNDS = 3


def big_pool() -> HostKVPool:
    return host_pool(num_pages=BIG, page_size=16, head_bytes=32 << 10, aux_slots=4)


async def test_a_failed_call_still_delivering_keeps_decode_pages_until_it_is_flushed(
    bootstrap_url: str,
) -> None:
    """In each room the write's first block is refused by decode's engine (a real partial
    failure: ``bad_block``), so the call fails at once while the engine still sends the
    rest of it. Decode must get its drain ack only after those bytes are in: the pages it
    then releases, and hands out again for the next room, are checked by the sanitizer.
    Before, the quarantine ended on the fence, the probe and the send queues, and up to
    every page of the room was written after release."""
    src, dst = big_pool(), big_pool()
    pages_alloc = PageAllocator(dst.page_rows(), DEST_POISON)
    aux_alloc = PageAllocator(dst.aux_rows(), DEST_POISON)
    inner, de = make_engine("mooncake"), make_engine("mooncake")
    # (the quarantine's barrier writes are one block: they go through untouched)
    fault = FaultEngine(inner, lambda _i, _p, n: Fault("bad_block") if n > 1 else None)
    src.fill(np.arange(BIG), 5)
    src.fill_aux(0, 5)
    late: list[int] = []
    try:
        async with open_decode(
            engine=de, pool=dst.spec, config=DecodeConfig(ack_timeout=0.3),
        ) as decode, open_prefill(
            engine=fault, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2,
            config=PrefillConfig(quarantine_fence=0.1),
        ) as prefill:
            for room in range(1, ROUNDS + 1):
                pages, aux = pages_alloc.alloc_nowait(BIG), aux_alloc.alloc_nowait(1)
                assert pages is not None and aux is not None
                released = trio.Event()

                def release(pages: np.ndarray = pages, aux: np.ndarray = aux,
                            released: trio.Event = released) -> None:
                    pages_alloc.free(pages)
                    aux_alloc.free(aux)
                    released.set()

                sender = prefill.sender(room, num_pages=BIG, aux_slot=0)
                receiver = decode.receiver(room, bootstrap_url=bootstrap_url)
                receiver.init(pages[::-1].copy(), int(aux[0]), on_release=release)
                sender.send(np.arange(BIG), last=True)
                with trio.fail_after(BOUND):
                    assert await sender.wait() is KVPoll.Failed
                    assert await receiver.wait() is KVPoll.Failed
                    await released.wait()
                    await sender.wait_released()
                assert isinstance(sender.failure, EngineError)
                t = time.monotonic()
                await trio.sleep(0.8)  # (what the engine still held has landed by now)
                late.append(pages_alloc.late_in_free_rows())
                assert time.monotonic() - t < 5
            stats = prefill.statistics()
            assert decode.statistics().acks_received == ROUNDS
    finally:
        fault.close()
        de.close()
    assert late == [0] * ROUNDS, f"pages written after release, per room: {late}"
    assert pages_alloc.late_writes == 0 and aux_alloc.late_in_free_rows() == 0
    assert stats.released_after_quarantine == ROUNDS


#: A peer engine in its own process (so that it can be stopped), over a file in /dev/shm
#: that the test maps too: it sees every byte that lands. Prints its session, the base of
#: its memory and its metadata (hex), then waits for a line on stdin.
_PEER = """
import ctypes, mmap, os, sys
from trio_pd.core._memory import HOST, Region
from trio_pd.engines import make_engine
path, size = sys.argv[1], int(sys.argv[2])
mm = mmap.mmap(os.open(path, os.O_RDWR), size)
base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
engine = make_engine(sys.argv[3])
engine.register([Region(base, size, HOST)])
print(engine.session_id, base, engine.metadata().hex() or "-", flush=True)
sys.stdin.readline()
"""

#: The writer's side, in a child process of its own (environment knobs are read once per
#: process): builds ``ENGINE`` with ``KW``, starts a peer, fails a write as ``HOW`` says, and
#: reports when the engine's flushed() turned True and what had landed by then.
_WRITER = """
import json, mmap, signal, subprocess, sys, time
import numpy as np
from trio_pd.core._memory import HOST, Region
from trio_pd.engines import EngineError, call_mark, flushed, make_engine
SIZE, BLK, N = 640 << 20, 1 << 20, 512
path = f"/dev/shm/trio_pd_barrier_{os.getpid()}"
with open(path, "wb") as f:
    f.truncate(SIZE)
dst = np.frombuffer(mmap.mmap(os.open(path, os.O_RDWR), SIZE), np.uint8)
peer = subprocess.Popen([sys.executable, "-c", PEER, path, str(SIZE), ENGINE],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
try:
    session, base, meta = peer.stdout.readline().split()
    base = int(base)
    engine = make_engine(ENGINE, **KW)
    src = np.full(SIZE, 7, np.uint8)
    engine.register([Region(int(src.ctypes.data), SIZE, HOST)])
    engine.add_peer(session, bytes.fromhex(meta.strip("-")))
    u = lambda xs: np.array(xs, dtype=np.uint64)
    s0 = int(src.ctypes.data)
    engine.write(session, u([s0]), u([base]), u([4096]))  # (the handshake)
    dst[:] = 0
    srcs, dsts = [s0 + i * BLK for i in range(N)], [base + i * BLK for i in range(N)]
    if HOW == "bad_block":
        dsts[0] += 1 << 40  # the peer refuses it
    else:
        os.kill(peer.pid, signal.SIGSTOP)
    t = time.monotonic()
    try:
        engine.write(session, u(srcs), u(dsts), u([BLK] * N))
        out = {"failed": False}
    except EngineError:
        out = {"failed": True}
    out["took"] = time.monotonic() - t
    mark = call_mark(engine, session)
    out["mark"] = mark
    landed = lambda: int(np.count_nonzero(dst[: N * BLK]))  # bytes written
    out["landed_at_return"] = landed()
    if mark is not None:
        out["flushed_at_once"] = flushed(engine, session, mark)
        if HOW == "stop":
            time.sleep(1.0)
            out["flushed_while_stopped"] = flushed(engine, session, mark)
            os.kill(peer.pid, signal.SIGCONT)
        end = time.monotonic() + 20
        barriers = 0
        while not flushed(engine, session, mark) and time.monotonic() < end:
            try:  # a one-byte barrier, as a quarantine makes
                engine.write(session, u([s0 + SIZE - 1]), u([base + SIZE - 1]), u([1]))
            except EngineError:
                pass
            barriers += 1
            time.sleep(0.01)
        out["barriers"] = barriers
        out["landed_when_flushed"] = landed()
        time.sleep(1.5)
        out["landed_later"] = landed()
    os.kill(peer.pid, signal.SIGCONT)
    engine.close()
finally:
    peer.stdin.write("x\\n")
    peer.stdin.close()
    peer.wait(timeout=30)
    os.unlink(path)
print(json.dumps(out))
"""


def writer(engine: str, how: str, env: dict[str, str], **kw: object) -> dict[str, object]:
    """Run :data:`_WRITER` in a child process with ``env`` set (before anything is imported)
    and ``ENGINE``, ``HOW``, ``KW``, ``PEER`` defined; what it reported."""
    prefix = "import os\n" + "".join(f"os.environ[{k!r}] = {v!r}\n" for k, v in env.items())
    prefix += f"ENGINE, HOW, KW, PEER = {engine!r}, {how!r}, {kw!r}, {_PEER!r}\n"
    return dict(run_child(prefix + _WRITER, timeout=120))


def test_mooncake_a_later_call_that_completes_proves_a_failed_call_over() -> None:
    """The adapter's proof, on the real engine: a call whose first block the peer refuses
    fails at once while its other 511 blocks are still to come; flushed() is False until a
    call made after it completes, and from then on not one more byte lands (one TCP
    connection per peer, the adapter's default)."""
    got = writer("mooncake", "bad_block", {"MC_FORCE_TCP": "1"})
    assert got["failed"] and got["mark"] is not None
    assert got["landed_at_return"] < 511 << 20, got  # (still to come: the hole)
    assert got["flushed_at_once"] is False
    # Not one byte after the proof. (Some blocks of a call cut short may never land:
    # measured, 393 to 511 of the 511 in 10 runs: "delivered or dropped".)
    assert got["landed_when_flushed"] == got["landed_later"], repr(got)


def test_mooncake_gives_no_proof_with_several_connections_per_peer() -> None:
    """With more than one TCP connection per peer a later call may complete before the
    failed call's blocks on another connection land (measured: in 3 of 6 runs): the
    adapter then answers None, and a quarantine keeps its pages (``quarantine_unflushed``)."""
    got = writer("mooncake", "bad_block", {"MC_FORCE_TCP": "1", "MC_TCP_LANES_PER_PEER": "4"})
    assert got["failed"] and got["mark"] is None


@pytest.mark.skipif(not HAVE_NIXL, reason="nixl-cu12 not installed")
def test_nixl_keeps_a_timed_out_request_until_it_ends() -> None:
    """NIXL over UCX's tcp transport, to a stopped peer: the write times out (the adapter's
    deadline), but the request is still posted, and releasing it does not stop it (its
    blocks land when the peer resumes). The adapter keeps the request; flushed() stays
    False while the peer is stopped and turns True once the request ended, every block in."""
    got = writer("nixl", "stop", {"UCX_TLS": "tcp"}, transfer_timeout_s=1.0)
    assert got["failed"] and got["landed_at_return"] == 0, got
    assert got["flushed_at_once"] is False and got["flushed_while_stopped"] is False
    assert got["landed_when_flushed"] == got["landed_later"] == 512 << 20, got


async def test_without_the_engines_proof_the_pages_stay_held(
    bootstrap_url: str, keep_environ: None
) -> None:
    """Mooncake with several TCP connections per peer can prove nothing about a failed call's
    blocks (a later call may overtake them): the quarantine keeps the pages, counted
    ``quarantine_unflushed``, though the peer answers and our send queues are empty; decode
    gets no ack and keeps its pages; the closing agents report the room, they do not release
    it on a guess."""
    os.environ["MC_TCP_LANES_PER_PEER"] = "4"
    inner = make_engine("mooncake")
    del os.environ["MC_TCP_LANES_PER_PEER"]
    de = make_engine("mooncake")
    fault = FaultEngine(inner, lambda _i, _p, n: Fault("bad_block") if n > 1 else None)
    src, dst = host_pool(), host_pool()
    released: list[str] = []
    try:
        async with open_decode(
            engine=de, pool=dst.spec, config=DecodeConfig(ack_timeout=0.3, close_timeout=0.5),
        ) as decode:
            async with open_prefill(
                engine=fault, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2,
                config=PrefillConfig(quarantine_fence=0.1, close_timeout=0.5),
            ) as prefill:
                src.fill(np.arange(8), 6)
                sender = prefill.sender(6, num_pages=8, aux_slot=0)
                receiver = decode.receiver(6, bootstrap_url=bootstrap_url)
                receiver.init(np.arange(8), 0, on_release=lambda: released.append("dst"))
                sender.send(np.arange(8), last=True)
                with trio.fail_after(BOUND):
                    assert await sender.wait() is KVPoll.Failed
                    assert await receiver.wait() is KVPoll.Failed
                with trio.fail_after(BOUND):
                    while prefill.statistics().quarantine_unflushed < 3:  # noqa: ASYNC110
                        await trio.sleep(0.05)  # (a counter: three fences passed, kept)
                stats = prefill.statistics()
                assert stats.leases_quarantined == 1 and stats.released_after_quarantine == 0
                assert released == []
            assert prefill.statistics().rooms_unacked_at_close == 1
        assert released == []
        assert decode.statistics().rooms_unproven_at_close == 1
    finally:
        fault.close()
        de.close()


def test_fault_engine_late_write_is_not_flushed_until_made() -> None:
    """The test wrapper answers for its own simulated engine: a ``late`` fault's write is
    still to come, so flushed() is False until it has been made (whatever the wrapped
    engine says), and True after."""
    from trio_pd.core._memory import HOST, Region

    target, inner = make_engine("mooncake"), make_engine("mooncake")
    fault = FaultEngine(inner, lambda _i, _p, _n: Fault("late", delay_s=0.5))
    buf, src = np.zeros(1 << 16, np.uint8), np.full(1 << 16, 3, np.uint8)
    try:
        target.register([Region(int(buf.ctypes.data), buf.nbytes, HOST)])
        fault.register([Region(int(src.ctypes.data), src.nbytes, HOST)])
        blocks = [np.array([a], dtype=np.uint64) for a in (src.ctypes.data, buf.ctypes.data, 4096)]
        peer = target.session_id
        with pytest.raises(EngineError):
            fault.write(peer, *blocks)
        mark = call_mark(fault, peer)
        assert mark is not None
        assert not flushed(fault, peer, mark)
        assert fault.wait_late(10.0)
        assert (buf[:4096] == 3).all()
        assert flushed(fault, peer, mark)
    finally:
        fault.close()
        target.close()
