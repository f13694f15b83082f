"""Out of descriptors: whatever an agent cannot have is a counted, local failure
(``resources_exhausted``, ``checks_unknown``), never an error that escapes into one of its
tasks; connections that never finish a handshake are closed; an agent raises its own soft
descriptor limit and says what it can hold. The whole story, a flood of raw connections
against agents at a lowered limit, is in the chaos session (tests/chaos/test_flood.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import trio

from trio_pd.core import _wire
from trio_pd.core._stats import Counters
from trio_pd.io._control import ControlPlane

from .helpers.child import NO_DESCRIPTORS, run_child

_SEND_WITHOUT_DESCRIPTORS = NO_DESCRIPTORS + """
import json
import trio
from trio_pd.core import _wire
from trio_pd.io._control import ControlPlane
from trio_pd.core._stats import Counters

async def main():
    counters = Counters()
    cp = ControlPlane("127.0.0.1", counters)
    ping = _wire.Ping(v=_wire.WIRE_VERSION, nonce=1, endpoint=cp.endpoint)
    taken = take_every_descriptor()
    try:
        sent = cp.send_nowait("tcp://127.0.0.1:9", ping)  # a first send: a new socket
    except Exception as exc:
        sent = repr(exc)
    finally:
        give_back(taken)
    again = cp.send_nowait("tcp://127.0.0.1:9", ping)
    await cp.aclose()
    print(json.dumps({"sent": sent, "again": again,
                      "exhausted": counters["resources_exhausted"]}))

trio.run(main)
"""


def test_a_send_that_finds_no_descriptor_for_its_socket_fails_locally() -> None:
    """Out of descriptors, a first send to an endpoint cannot make its socket: it answers
    False (its room fails, a heartbeat counts a miss), counted ``resources_exhausted``, and
    the next send, with descriptors back, makes the socket. (Before: libzmq's ZMQError
    (EMFILE) escaped ``send_nowait``; decode's heartbeat met it under a flood of raw
    connections and the whole agent closed.)"""
    got = run_child(_SEND_WITHOUT_DESCRIPTORS)
    assert got == {"sent": False, "again": True, "exhausted": 1}


async def test_connections_that_never_handshake_are_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Raw TCP connections that never send a ZeroMQ greeting are closed by the agent after
    ``ControlPlane.HANDSHAKE_TIMEOUT``, on both of its sockets. (libzmq's own default is 30 s:
    a flood held its descriptors that long.)"""
    monkeypatch.setattr(ControlPlane, "HANDSHAKE_TIMEOUT", 0.3)
    cp = ControlPlane("127.0.0.1", Counters())
    conns = []
    try:
        for endpoint in (cp.endpoint, cp.heartbeat_endpoint):
            host, port = _wire.address_host(endpoint), int(endpoint.rpartition(":")[2])
            for _ in range(5):
                conns.append(socket.create_connection((host, port)))
        closed = 0
        with trio.fail_after(20):
            for conn in conns:
                conn.setblocking(False)
                while True:
                    try:
                        data = conn.recv(4096)
                    except BlockingIOError:
                        await trio.sleep(0.05)
                        continue
                    if not data:  # (the greeting libzmq sends first is read past)
                        closed += 1
                        break
        assert closed == 10
    finally:
        for conn in conns:
            conn.close()
        await cp.aclose()


_RAISE_THE_LIMIT = """
import json, logging, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
from trio_pd.io import _descriptors
now = _descriptors.prepare("decode rank 0")
print(json.dumps({"now": now, "hard": hard,
                  "soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}))
"""


def test_an_agent_raises_its_soft_descriptor_limit_and_says_so() -> None:
    """At start an agent raises the process's soft ``RLIMIT_NOFILE`` toward the hard limit
    and logs one line saying what it can hold. (Before: a process started at 1,024 stayed
    there, and a flood of 1,100 raw connections ran it out.)"""
    done = subprocess.run([sys.executable, "-c", _RAISE_THE_LIMIT], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    got = json.loads(lines[-1])
    assert got["soft"] == got["now"] == min(got["hard"], 1 << 20) > 256
    assert len(lines) == 2 and lines[0].startswith("decode rank 0: file descriptors: soft limit")
    assert "raised from 256" in lines[0]
