"""A descriptor flood against a real prefill/decode pair in a child process.

:data:`CHILD` runs in its own process with ``RLIMIT_NOFILE`` lowered (argv: soft limit,
``hard`` to lower the hard limit as well, so that the agents cannot raise theirs). It starts
a bootstrap service, a prefill agent (Mooncake behind a :class:`FaultEngine`) and a decode
agent, prints their four control endpoints (before any request: no socket to a peer is made
yet), and then obeys one JSON command a line on stdin: ``{"requests": N}`` moves N one-page
requests and prints their outcomes; ``{"fault": true}`` makes the next prefill engine call
fail; ``{"stats": true}`` prints both agents' counters; ``{"quit": true}`` closes the agents
and prints ``{"closed": true}``. Should an agent's block end with an error, it prints
``{"died": ...}``.

:class:`Flood` is the attacker: raw TCP connections (no ZeroMQ greeting, no key) to the
endpoints, as many as the child's process will accept, held (and, sustained, reopened)
until closed.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any

CHILD = r"""
import dataclasses, json, logging, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit if sys.argv[2] == "hard" else hard))
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import numpy as np
import trio
from trio_pd import open_bootstrap_server, open_decode, open_prefill
from trio_pd.engines import make_engine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.testing.pools import HostKVPool

def pool():
    return HostKVPool(layout="mha", num_pages=512, num_layers=2, page_size=16, head_bytes=32,
                      heads=8)

def say(**kw):
    print(json.dumps(kw), flush=True)

async def main():
    src, dst = pool(), pool()
    src.fill(np.arange(512), room=1)
    fail = []
    pe = FaultEngine(make_engine("mooncake"),
                     lambda i, p, n: Fault("fail") if fail and not fail.pop() else None)
    de = make_engine("mooncake")
    room = iter(range(1, 1 << 30))
    try:
        async with (
            open_bootstrap_server() as boot,
            open_prefill(engine=pe, pool=src.spec, bootstrap_url=boot.url, kv_heads=8) as pf,
            open_decode(engine=de, pool=dst.spec) as dc,
        ):
            async def one():
                r_id = next(room)
                page = r_id % 500
                s = pf.sender(r_id, num_pages=1, aux_slot=0)
                r = dc.receiver(r_id, bootstrap_url=boot.url)
                r.init(np.arange(page, page + 1), aux_slot=1)
                s.send(np.arange(page, page + 1), last=True)
                with trio.move_on_after(30):
                    status = await r.wait()
                    reason = r.failure
                    return status.name if reason is None else f"{status.name}: {reason!r}"
                return "no answer in 30 s"

            say(endpoints=[pf.endpoint, pf.control.heartbeat_endpoint, dc.control.endpoint,
                           dc.control.heartbeat_endpoint],
                limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            while True:
                cmd = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
                if "requests" in cmd:
                    say(outcomes=[await one() for _ in range(cmd["requests"])])
                elif "fault" in cmd:
                    fail.append(False)
                    say(fault=True)
                elif "stats" in cmd:
                    say(prefill=dataclasses.asdict(pf.statistics()),
                        decode=dataclasses.asdict(dc.statistics()))
                else:
                    break
    except BaseException as exc:
        say(died=repr(exc)[:2000])
        raise
    finally:
        pe.close()
        de.close()
    say(closed=True)

trio.run(main)
"""


class Child:
    """The agents' process: send a command, read its answer."""

    def __init__(self, limit: int, *, hard: bool, timeout: float = 120.0) -> None:
        # (the log goes to a file: a pipe nobody reads would stop the child once full)
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(limit), "hard" if hard else "soft"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
        )
        self.timeout = timeout
        self.started = self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the agents' process ended: {self.stderr()[-3000:]}")
        answer: dict[str, Any] = json.loads(line)
        assert "died" not in answer, f"an agent died: {answer['died']}\n{self.stderr()[-3000:]}"
        return answer

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stderr(self) -> str:
        """The process's log, once it has ended ("" while it runs)."""
        if self.proc.poll() is None:
            return ""
        self.log.seek(0)
        return self.log.read()

    def close(self) -> tuple[int, str]:
        """Quit, wait for the process, and return its exit status and log (stderr)."""
        try:
            if self.proc.poll() is None:
                assert self.ask(quit=True)["closed"]
                self.proc.wait(timeout=self.timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
        self.log.seek(0)
        text = self.log.read()
        self.log.close()
        return self.proc.returncode, text


class Flood:
    """Raw TCP connections to ``endpoints`` (``tcp://host:port``), ``per_endpoint`` each,
    never speaking. With ``sustain``, a thread opens a new one for each the agent closes
    (as an attacker would), until :meth:`close`; ``closed_by_peer`` counts those."""

    def __init__(self, endpoints: list[str], per_endpoint: int, *, sustain: bool = False) -> None:
        self.addresses = []
        for endpoint in endpoints:
            host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
            self.addresses.append((host, int(port)))
        self.per_endpoint = per_endpoint
        self.conns: dict[tuple[str, int], list[socket.socket]] = {a: [] for a in self.addresses}
        self.refused = 0
        self.closed_by_peer = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.top_up()
        self._thread = None
        if sustain:
            self._thread = threading.Thread(target=self._sustain, daemon=True)
            self._thread.start()

    def top_up(self) -> None:
        """Open connections until each endpoint has ``per_endpoint`` (or one is refused)."""
        for address, conns in self.conns.items():
            while len(conns) < self.per_endpoint and not self._stop.is_set():
                try:
                    conns.append(socket.create_connection(address, timeout=2))
                except OSError:
                    self.refused += 1
                    break

    def reap(self) -> int:
        """Drop the connections the agent closed; returns how many."""
        reaped = 0
        for conns in self.conns.values():
            if not conns:
                continue
            poller = select.poll()  # (not select(): descriptors here may pass 1,024)
            by_fd = {conn.fileno(): conn for conn in conns}
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(0):
                conn = by_fd[fd]
                try:
                    data = conn.recv(4096)
                except OSError:
                    data = b""
                if not data:  # (the greeting libzmq sends first is read and ignored)
                    conns.remove(conn)
                    conn.close()
                    reaped += 1
        self.closed_by_peer += reaped
        return reaped

    def _sustain(self) -> None:
        while not self._stop.wait(0.05):
            with self._lock:
                self.reap()
                self.top_up()

    def open_count(self) -> int:
        return sum(len(c) for c in self.conns.values())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with self._lock:
            for conns in self.conns.values():
                for conn in conns:
                    conn.close()
                conns.clear()
