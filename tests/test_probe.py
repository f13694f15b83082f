"""Three-valued liveness (SPEC §5.6): trio_pd.io._probe against real engines and real processes.

A peer here is a real OS process: it builds a real engine, binds a real ZeroMQ PULL socket as
its "control endpoint", prints where both are, and waits for its stdin to close. The tests
kill, stop and continue it with signals and check what :func:`trio_pd.io._probe.probe` can say:
ALIVE while it runs, REFUSED once it is dead (its ports refuse: a hint, never GONE, since a
dead process's kernel may still deliver what its sockets held, and a closed agent's engine
may still run), UNKNOWN while it is stopped (a hung engine probe proves nothing).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import trio

from trio_pd.core._state import Liveness
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.engines.fault import FaultEngine
from trio_pd.io._probe import ProbeThreads, _host_port, port_refuses, probe, wait_idle

from .helpers.child import NO_DESCRIPTORS, run_child
from .helpers.engines import HAVE_NIXL

# The peer process: engine + control socket, one JSON line on stdout, then wait for stdin EOF.
_PEER = """
import json, sys
import zmq
from trio_pd.engines import make_engine
engine = make_engine(sys.argv[1])
ctx = zmq.Context()
sock = ctx.socket(zmq.PULL)
sock.bind("tcp://127.0.0.1:*")
print(json.dumps({
    "session": engine.session_id,
    "endpoint": sock.getsockopt_string(zmq.LAST_ENDPOINT),
    "metadata": engine.metadata().hex(),
}), flush=True)
sys.stdin.read()
"""


@dataclass
class Peer:
    process: subprocess.Popen[bytes]
    session: str
    endpoint: str
    metadata: bytes

    def stop(self) -> None:
        """SIGSTOP, and wait until every thread of it has stopped (a group stop is not
        immediate: a thread that is running may still answer a connection meanwhile)."""
        os.kill(self.process.pid, signal.SIGSTOP)
        _, status = os.waitpid(self.process.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status

    def cont(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL and reap: once this returns, the process and its sockets are gone."""
        self.process.kill()
        self.process.wait(10)


@contextmanager
def peer_process(kind: str) -> Iterator[Peer]:
    process = subprocess.Popen(
        [sys.executable, "-c", _PEER, kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    with process:  # closes the pipes and reaps it
        try:
            assert process.stdout is not None
            ready, _, _ = select.select([process.stdout], [], [], 30)
            assert ready, "the peer process did not start"
            info = json.loads(process.stdout.readline())
            yield Peer(process, info["session"], info["endpoint"], bytes.fromhex(info["metadata"]))
        finally:
            if process.poll() is None:
                process.kill()  # SIGKILL ends a stopped process too
            process.wait(10)


@pytest.fixture(scope="module")
def mooncake() -> Iterator[TransferEngine]:
    engine = make_engine("mooncake")
    try:
        yield engine
    finally:
        engine.close()


async def _probe(
    engine: TransferEngine, peer: Peer, threads: ProbeThreads, seconds: float = 1.0
) -> tuple[Liveness, float]:
    t0 = time.monotonic()
    answer = await probe(
        engine, peer.session, control_endpoint=peer.endpoint, timeout=seconds, threads=threads
    )
    return answer, time.monotonic() - t0


# -- the parts -------------------------------------------------------------------------------


def test_endpoints_that_do_not_parse() -> None:
    assert _host_port("tcp://127.0.0.1:5555") == ("127.0.0.1", 5555)
    assert _host_port("127.0.0.1:15001") == ("127.0.0.1", 15001)
    assert _host_port("tcp://[::1]:5555") == ("::1", 5555)
    for bad in ("ipc:///tmp/x", "trio-pd-0123abcd", "tcp://*:5555", "::1:5555", "h:0", "h:x"):
        assert _host_port(bad) is None, bad


async def test_port_refuses_closed_and_listening_ports() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert await port_refuses(f"tcp://127.0.0.1:{port}") is False
    assert await port_refuses(f"127.0.0.1:{port}") is True  # nothing listens there now
    assert await port_refuses("ipc:///tmp/not-tcp") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux accept-queue rule")
async def test_an_endpoint_that_does_not_answer_is_unknown(mooncake: TransferEngine) -> None:
    """A SYN that gets no answer proves nothing. Deterministic on loopback: a listener with
    backlog 0 whose accept queue holds one connection nobody accepts; Linux drops further
    SYNs (no reset), so a connect stays pending until the deadline, like a black-holed host.
    The engine is never asked: an unreachable control endpoint ends the probe as UNKNOWN."""
    fe = FaultEngine(mooncake, probe_override=True)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # fills the queue
            with trio.move_on_after(0.3) as cs:
                await port_refuses(f"127.0.0.1:{port}")
            assert cs.cancelled_caught  # still pending: neither refused nor connected
            t0 = time.monotonic()
            answer = await probe(
                fe,
                mooncake.session_id,
                control_endpoint=f"tcp://127.0.0.1:{port}",
                timeout=0.5,
                threads=ProbeThreads(),
            )
            elapsed = time.monotonic() - t0
    assert answer is Liveness.UNKNOWN
    assert 0.45 < elapsed < 1.0
    assert fe.statistics().probes_overridden == 0


async def test_engine_errors_and_false_are_unknown(mooncake: TransferEngine) -> None:
    threads = ProbeThreads()
    fe = FaultEngine(mooncake, probe_override=False)  # "UCX saw a disconnect": no proof
    assert (
        await probe(fe, mooncake.session_id, control_endpoint=None, timeout=1.0, threads=threads)
        is Liveness.UNKNOWN
    )
    # A session the engine cannot parse makes Mooncake's probe fail: no proof either.
    assert (
        await probe(mooncake, "not-a-session", control_endpoint=None, timeout=1.0, threads=threads)
        is Liveness.UNKNOWN
    )
    assert (
        await probe(
            mooncake, mooncake.session_id, control_endpoint=None, timeout=1.0, threads=threads
        )
        is Liveness.ALIVE
    )


async def test_a_hung_probe_holds_its_one_thread() -> None:
    """A probe that hangs is abandoned at the deadline; the next one of the same peer waits
    for that thread (which keeps its token) and is UNKNOWN too, without a second thread."""
    threads = ProbeThreads()
    inner = make_engine("mooncake")
    fe = FaultEngine(inner, probe_override=True, probe_hang=5.0)
    try:
        t0 = time.monotonic()
        first = await probe(
            fe, inner.session_id, control_endpoint=None, timeout=0.5, threads=threads
        )
        assert first is Liveness.UNKNOWN
        assert time.monotonic() - t0 < 0.75
        n_threads = threading.active_count()
        second = await probe(
            fe, inner.session_id, control_endpoint=None, timeout=0.5, threads=threads
        )
        assert second is Liveness.UNKNOWN
        assert fe.statistics().probes_hung == 1  # the second never reached the engine
        assert threads.limiter.borrowed_tokens == 1
        assert threading.active_count() <= n_threads
        assert await wait_idle(threads.limiter, 0.1) is False
        assert threads.limiter.borrowed_tokens == 1  # wait_idle gave back what it took
        assert await wait_idle(threads.limiter, 6.0) is True  # the hung thread returned at last
        assert threads.limiter.borrowed_tokens == 0
    finally:
        inner.close()


# -- real peer processes ---------------------------------------------------------------------


@pytest.mark.processes
async def test_a_live_peer_is_alive(mooncake: TransferEngine) -> None:
    with peer_process("mooncake") as peer:
        answer, _ = await _probe(mooncake, peer, ProbeThreads())
        assert answer is Liveness.ALIVE


@pytest.mark.processes
async def test_a_killed_peer_is_refused_at_once(mooncake: TransferEngine) -> None:
    with peer_process("mooncake") as peer:
        peer.kill()
        answer, elapsed = await _probe(mooncake, peer, ProbeThreads())
        assert answer is Liveness.REFUSED  # (a hint: only a fence at the target proves GONE)
        assert elapsed < 2.0
        # Either port is a hint on its own.
        assert (
            await probe(
                mooncake,
                peer.session,
                control_endpoint=None,
                timeout=1.0,
                threads=ProbeThreads(),
            )
            is Liveness.REFUSED
        )


@pytest.mark.processes
async def test_a_stopped_peer_is_unknown_then_alive_again(mooncake: TransferEngine) -> None:
    """SIGSTOP: the kernel still accepts connections to its ports (no refusal) and
    Mooncake's send_probe hangs (no answer, no ALIVE): UNKNOWN at the deadline. SIGCONT: the
    abandoned probe thread returns, and the next probe is ALIVE."""
    threads = ProbeThreads()
    with peer_process("mooncake") as peer:
        peer.stop()
        try:
            for _ in range(2):  # the second waits for the hung thread of this peer
                answer, elapsed = await _probe(mooncake, peer, threads, seconds=1.0)
                assert answer is Liveness.UNKNOWN
                assert 0.9 < elapsed < 2.0
            assert await port_refuses(peer.endpoint) is False
        finally:
            peer.cont()
        assert await wait_idle(threads.limiter, 10.0)
        answer, _ = await _probe(mooncake, peer, threads)
        assert answer is Liveness.ALIVE


@pytest.mark.processes
async def test_a_hung_probe_of_one_peer_holds_up_no_other(mooncake: TransferEngine) -> None:
    """Mooncake's send_probe hangs about a minute against a stopped peer, and its abandoned
    thread keeps running. A live peer probed meanwhile still answers ALIVE at once: with one
    probe thread for all peers it waited behind the hung one and came back UNKNOWN, and
    prefill then marked a live decode peer failed and failed its rooms (SPEC §5.7)."""
    threads = ProbeThreads()
    with peer_process("mooncake") as stopped, peer_process("mooncake") as live:
        stopped.stop()
        try:
            answer, _ = await _probe(mooncake, stopped, threads, seconds=0.5)
            assert answer is Liveness.UNKNOWN
            assert stopped.session in threads.running  # its thread still hangs
            answer, elapsed = await _probe(mooncake, live, threads, seconds=3.0)
            assert answer is Liveness.ALIVE
            assert elapsed < 2.0
        finally:
            stopped.cont()
        assert await wait_idle(threads.limiter, 10.0)
        assert not threads.running


@pytest.mark.processes
async def test_a_stopped_then_killed_peer_is_refused_while_a_probe_hangs(
    mooncake: TransferEngine,
) -> None:
    """The refused ports need no thread: REFUSED is seen even while a hung probe thread keeps
    the limiter's token."""
    threads = ProbeThreads()
    with peer_process("mooncake") as peer:
        peer.stop()
        answer, _ = await _probe(mooncake, peer, threads, seconds=0.5)
        assert answer is Liveness.UNKNOWN
        assert threads.limiter.borrowed_tokens == 1
        peer.kill()
        answer, elapsed = await _probe(mooncake, peer, threads)
        assert answer is Liveness.REFUSED
        assert elapsed < 2.0
        assert await wait_idle(threads.limiter, 10.0)  # the hung send_probe failed once it died


@pytest.mark.processes
@pytest.mark.skipif(not HAVE_NIXL, reason="nixl-cu12 not installed")
async def test_nixl_killed_peer_is_refused_via_its_control_endpoint() -> None:
    engine = make_engine("nixl")
    threads = ProbeThreads()
    try:
        with peer_process("nixl") as peer:
            engine.add_peer(peer.session, peer.metadata)
            try:
                answer, _ = await _probe(engine, peer, threads)
                assert answer is Liveness.ALIVE
                peer.kill()
                answer, elapsed = await _probe(engine, peer, threads)
                assert answer is Liveness.REFUSED
                assert elapsed < 2.0
                # Without the control endpoint nothing proves it: the session is a name.
                assert (
                    await probe(
                        engine, peer.session, control_endpoint=None, timeout=1.0, threads=threads
                    )
                    is Liveness.UNKNOWN
                )
            finally:
                engine.remove_peer(peer.session)
    finally:
        engine.close()


# -- a probe that cannot run -----------------------------------------------------------------

#: run in a child process: every descriptor taken, then a probe of a port that refuses
_PROBE_WITHOUT_DESCRIPTORS = NO_DESCRIPTORS + """
import json, socket
import trio
from trio_pd.io._probe import ProbeThreads, probe
from trio_pd.core._stats import Counters

class NoEngine:  # (the probe cannot get as far as the engine)
    name = "nixl"
    def probe(self, peer):
        raise AssertionError("reached the engine")

with socket.create_server(("127.0.0.1", 0)) as s:
    port = s.getsockname()[1]  # closed again: it refuses

async def main():
    counters = Counters()
    socket.getaddrinfo("127.0.0.1", port)  # (a warm process: the codecs it needs are loaded)
    taken = take_every_descriptor()
    try:
        answer = await probe(NoEngine(), "w", control_endpoint=f"tcp://127.0.0.1:{port}",
                             timeout=2.0, threads=ProbeThreads(), counters=counters)
    finally:
        give_back(taken)
    print(json.dumps({"answer": answer.value, "checks_unknown": counters["checks_unknown"]}))

trio.run(main)
"""


def test_a_probe_with_no_descriptor_left_is_unknown_and_counted() -> None:
    """Out of descriptors, a probe cannot make a socket: UNKNOWN, counted ``checks_unknown``;
    nothing escapes. (Before: the OSError (EMFILE) escaped the probe, and with it the task
    that ran it, closing the whole agent.)"""
    got = run_child(_PROBE_WITHOUT_DESCRIPTORS)
    assert got == {"answer": "unknown", "checks_unknown": 1}
