"""The kernel's send queues as proof that a failed call's bytes are gone (trio_pd.io._sendq), and
the quarantine that waits for it.

On a real partition (tests/chaos/test_netns.py) Mooncake kept a timed-out call's block in the
kernel's send queue, and TCP delivered it into released pages when the link came back. Here the
same kernel state is made on loopback without a partition: a connection whose reader does not
read, so the bytes written to it stay unacknowledged in our send queue.
"""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import numpy as np
import pytest
import trio

from trio_pd import (
    EngineError,
    KVPoll,
    PrefillAgent,
    PrefillConfig,
    PrefillSender,
    open_decode,
    open_prefill,
)
from trio_pd.engines import make_engine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.io._sendq import DrainWatch, parse, snapshot

from .helpers.agents import host_pool
from .helpers.child import NO_DESCRIPTORS, run_child

pytestmark = pytest.mark.skipif(snapshot(["127.0.0.1"]) is None, reason="no /proc/net/tcp")

BOUND = 10.0

#: /proc/net/tcp as Linux prints it (columns after the inode cut): 127.0.0.1:5555 ->
#: 10.200.1.2:16453 established with 0x4018 bytes queued; the same peer in LISTEN, TIME_WAIT
#: and SYN_SENT; another host; an orphan (inode 0) in FIN_WAIT1
TCP4 = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:15B3 0201C80A:4045 01 00004018:00000000 01:00000011 00000000     0        0 111
   1: 0100007F:15B4 0201C80A:4045 0A 00000000:00000000 00:00000000 00000000     0        0 112
   2: 0100007F:15B5 0201C80A:4045 06 00000000:00000000 00:00000000 00000000     0        0 0
   3: 0100007F:15B6 0201C80A:4045 02 00000000:00000000 00:00000000 00000000     0        0 113
   4: 0100007F:15B7 0301C80A:4045 01 00000010:00000000 00:00000000 00000000     0        0 114
   5: 0100007F:15B8 0201C80A:4045 04 00000200:00000000 00:00000000 00000000     0        0 0
   6: 0100007F:15B9 0201C80A:4045 01 00000000:00000000 00:00000000 00000000     0        0 999
"""
#: /proc/net/tcp6: an IPv4-mapped peer ::ffff:10.200.1.2, and ::1 (the local end is ::1)
_V6_LOOP = "00000000000000000000000001000000"
_V6_MAPPED = "0000000000000000FFFF00000201C80A"
_V6_HEAD = "  sl  local_address remote_address st tx_queue rx_queue tr tm->when retrnsmt uid ...\n"
TCP6 = _V6_HEAD + "".join(
    f"   {n}: {_V6_LOOP}:{lport} {remote}:4045 01 {queued}:00000000 00:0 0 0 0 {inode}\n"
    for n, (lport, remote, queued, inode) in enumerate(
        [("15B3", _V6_MAPPED, "00000007", 121), ("15B4", _V6_LOOP, "00000009", 122)]
    )
)


def test_parse_keeps_the_peers_live_connections_with_their_queues() -> None:
    got = parse(TCP4, ["10.200.1.2"], inodes={111, 112, 113})
    assert got == {
        ("127.0.0.1", 0x15B3, "10.200.1.2", 0x4045): 0x4018,  # established, bytes queued
        ("127.0.0.1", 0x15B6, "10.200.1.2", 0x4045): -1,  # being opened
        ("127.0.0.1", 0x15B8, "10.200.1.2", 0x4045): 0x200,  # an orphan still sending
    }  # (LISTEN, TIME_WAIT, another host, and a socket not ours are left out)
    assert parse(TCP6, ["10.200.1.2"]) == {("::1", 0x15B3, "10.200.1.2", 0x4045): 7}
    assert parse(TCP6, ["::1"]) == {("::1", 0x15B4, "::1", 0x4045): 9}


def test_drain_watch_needs_every_connection_seen_empty() -> None:
    a, b, c = (("h", 1, "p", 9), ("h", 2, "p", 9), ("h", 3, "p", 9))
    watch = DrainWatch()
    assert not watch.drained  # no look yet
    assert not watch.observe({a: 100, b: 0})
    assert not watch.observe({a: 100, c: -1})  # b closed; c opening (new: watched too)
    assert not watch.observe({a: 0, c: 5})  # a seen empty, at last
    assert not watch.observe({a: 4096, c: 5})  # (a busy again: new bytes, proven already)
    assert watch.observe({a: 4096})  # c gone from the table
    assert DrainWatch().observe({})


@contextmanager
def unread_connection() -> Iterator[tuple[socket.socket, socket.socket, int]]:
    """A loopback connection whose reader reads nothing: the writer's bytes fill the reader's
    receive buffer, then stay unacknowledged in the writer's send queue. Yields the writer,
    the reader and how many bytes were written."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        writer = socket.create_connection(listener.getsockname())
        reader, _ = listener.accept()
        with writer, reader:
            writer.setblocking(False)
            written = 0
            for _ in range(10_000):  # (bounded: a few MB at most)
                try:
                    written += writer.send(b"k" * 65536)
                except OSError as exc:
                    assert exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
                    break
            yield writer, reader, written


def drain(reader: socket.socket, nbytes: int, seconds: float) -> None:
    """Read ``nbytes`` from ``reader``, within ``seconds``."""
    reader.settimeout(seconds)
    got = 0
    end = time.monotonic() + seconds
    while got < nbytes and time.monotonic() < end:
        got += len(reader.recv(1 << 20))
    assert got == nbytes, (got, nbytes)


def test_the_kernel_shows_our_unacknowledged_bytes_until_the_peer_reads() -> None:
    with unread_connection() as (writer, reader, written):
        here = writer.getsockname()
        conn = ("127.0.0.1", here[1], "127.0.0.1", writer.getpeername()[1])
        snap = snapshot(["127.0.0.1"])
        assert snap is not None and snap.get(conn, 0) > 0, snap
        watch = DrainWatch()
        assert not watch.observe(snap)
        drain(reader, written, BOUND)
        for _ in range(100):
            if watch.observe(snapshot(["127.0.0.1"]) or {}):
                break
            time.sleep(0.02)
        assert watch.drained, watch.pending


async def test_quarantine_ends_only_once_the_kernel_has_sent_our_bytes(
    bootstrap_url: str,
) -> None:
    """The first write fails; the peer (the real decode engine, on 127.0.0.1) answers its
    probe at once. But bytes this process wrote to 127.0.0.1 are unacknowledged in the kernel,
    as a partitioned Mooncake connection's were: the source pages stay out, and
    ``quarantine_undrained`` counts it, until the reader takes them; then the quarantine ends.
    (Before: the peer's answer after the fence ended it, whatever the kernel still held.)"""
    released: list[float] = []
    with unread_connection() as (_writer, reader, written):
        async with a_failed_write(bootstrap_url, 401, 0.3,
                                  lambda: released.append(trio.current_time())) as (
            prefill, sender
        ):
            with trio.move_on_after(1.5):
                await sender.wait_released()
            stats = prefill.statistics()
            assert released == [], "the quarantine ended while our bytes were unsent"
            assert stats.quarantine_undrained >= 1
            assert stats.quarantine_unknown == 0  # (the peer did answer)
            drained_at = trio.current_time()
            await trio.to_thread.run_sync(drain, reader, written, BOUND)
            with trio.fail_after(BOUND):
                await sender.wait_released()
            assert released and released[0] >= drained_at
            assert prefill.statistics().released_after_quarantine == 1


@asynccontextmanager
async def a_failed_write(
    url: str, room: int, fence: float, on_release: Callable[[], None]
) -> AsyncIterator[tuple[PrefillAgent, PrefillSender]]:
    """A prefill and a decode agent (Mooncake, 127.0.0.1) and one room of 2 pages whose write
    fails (nothing written, outcome unknown): yields the prefill agent and the room's sender
    once the room is Failed and its lease quarantined (fence ``fence`` s)."""
    src, dst = host_pool(), host_pool()
    inner, de = make_engine("mooncake"), make_engine("mooncake")
    try:
        pe = FaultEngine(inner, lambda i, _p, _n: Fault("fail") if i == 0 else None)
        async with open_prefill(
            engine=pe, pool=src.spec, bootstrap_url=url, kv_heads=2,
            config=PrefillConfig(quarantine_fence=fence),
        ) as prefill, open_decode(engine=de, pool=dst.spec) as decode:
            sender = prefill.sender(room, num_pages=2, aux_slot=0, on_release=on_release)
            receiver = decode.receiver(room, bootstrap_url=url)
            receiver.init(np.arange(2), 0)
            sender.send(np.arange(2), last=True)
            with trio.fail_after(BOUND):
                assert await sender.wait() is KVPoll.Failed
            assert isinstance(sender.failure, EngineError)
            yield prefill, sender
    finally:
        inner.close()
        de.close()


# -- a check that cannot run is unknown, never "drained" -------------------------------------

#: run in a child process: every descriptor taken, then a snapshot of the tables
_SNAPSHOT_WITHOUT_DESCRIPTORS = NO_DESCRIPTORS + """
import json
from trio_pd.io._sendq import snapshot
taken = take_every_descriptor()
try:
    answer = {"snapshot": repr(snapshot(["127.0.0.1"]))}
except OSError as exc:
    answer = {"raised": exc.errno}
give_back(taken)
print(json.dumps(answer))
"""


def test_a_snapshot_with_no_descriptor_left_raises_instead_of_saying_drained() -> None:
    """Out of descriptors, the tables cannot be read: the snapshot raises (EMFILE), which
    the quarantine takes as unknown. (Before: it returned None, "no tables here", which the
    quarantine took as drained: the proof failed open.)"""
    assert run_child(_SNAPSHOT_WITHOUT_DESCRIPTORS) == {"raised": errno.EMFILE}


async def test_a_send_queue_check_that_cannot_run_keeps_the_quarantine(
    bootstrap_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first write fails; the peer answers its probe after the fence, but our kernel's
    tables cannot be read (no descriptor left: what the snapshot raises then): the pages stay
    out, counted ``checks_unknown`` and ``quarantine_unknown``, and the agent serves on; once
    the tables can be read again the quarantine ends. (Before: the error escaped into the
    agent's task and closed the agent.)"""
    from trio_pd.io import _sendq

    real = _sendq.snapshot

    def no_descriptors(hosts: list[str]) -> dict[tuple[str, int, str, int], int] | None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(_sendq, "snapshot", no_descriptors)
    released: list[str] = []
    async with a_failed_write(bootstrap_url, 402, 0.2, lambda: released.append("src")) as (
        prefill, sender
    ):
        with trio.fail_after(BOUND):
            while prefill.statistics().checks_unknown < 2:  # noqa: ASYNC110 - counters
                await trio.sleep(0.05)
        stats = prefill.statistics()
        assert released == [] and stats.quarantine_unknown >= 2
        assert stats.released_after_quarantine == 0
        monkeypatch.setattr(_sendq, "snapshot", real)
        with trio.fail_after(BOUND):
            await sender.wait_released()
        assert released == ["src"]
