"""The chaos suite's machinery: rank processes (``worker.py``) driven over their stdin and
stdout, a bootstrap process, faults by signal, and network namespaces joined by a veth pair.

Every process here is one this module started; signals go to those PIDs only, and every
process and namespace is removed in a ``finally``. Every wait is bounded in time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from trio_pd.io._sendq import Row, rows

WORKER = str(Path(__file__).with_name("worker.py"))

#: the shape of every rank's pool (the demo's defaults: 32 KiB pages)
POOL = dict(pool_pages=1024, aux_slots=128, layers=4, page_size=16, head_bytes=32, kv_heads=8)


@dataclass
class Proc:
    """A process this test started; its ``CHAOS`` events as they come."""

    name: str
    process: trio.Process
    log: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)
    ended: bool = False
    stopped: bool = False

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    async def pump(self) -> None:
        assert self.process.stdout is not None
        buf = b""
        try:
            async for data in self.process.stdout:
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    text = line.decode(errors="replace")
                    if text.startswith("CHAOS "):
                        self.events.append(json.loads(text[6:]))
                        self.changed.set()
                        self.changed = trio.Event()
                    elif text.startswith("http://"):
                        self.events.append({"ev": "url", "url": text.strip(), "t": time.time()})
                        self.changed.set()
                        self.changed = trio.Event()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        finally:
            self.ended = True
            self.changed.set()

    async def wait_for(
        self, pred: Callable[[list[dict[str, Any]]], Any], seconds: float, what: str
    ) -> Any:
        """Wait (at most ``seconds``) until ``pred(events)`` is truthy; return it."""
        with trio.move_on_after(seconds):
            while True:
                got = pred(self.events)
                if got:
                    return got
                if self.ended:
                    break
                await self.changed.wait()
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        raise AssertionError(f"{self.name}: no {what} within {seconds} s; stderr tail:\n{tail}")

    def send(self, cmd: dict[str, Any]) -> None:
        assert isinstance(self.process.stdin, trio.lowlevel.FdStream)
        data = (json.dumps(cmd) + "\n").encode()
        # a pipe write of a few hundred bytes never blocks (the buffer is 64 KiB); a stopped
        # worker's pipe fills only after hundreds of commands, which no scenario sends
        os.write(self.process.stdin.fileno(), data)

    def signal(self, sig: int) -> None:
        if not self.ended and self.process.returncode is None:
            os.kill(self.pid, sig)
            if sig == signal.SIGSTOP:
                self.stopped = True
            elif sig == signal.SIGCONT:
                self.stopped = False

    def log_lines(self, has: str) -> list[str]:
        """The lines of its stderr (trio_pd's warnings, among others) that contain ``has``."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [line for line in text.splitlines() if has in line]

    def of(self, ev: str, i: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ev"] == ev and (i is None or e.get("i") == i)]


class Cluster:
    """A bootstrap process and rank processes, each possibly inside a network namespace."""

    def __init__(self, nursery: trio.Nursery, tmp: Path, opts: dict[str, Any]) -> None:
        self.nursery = nursery
        self.tmp = tmp
        self.opts = {**POOL, "request_bound": 90.0, **opts}
        self.procs: list[Proc] = []
        self.url = ""
        self.rng = random.Random(1234)
        self.next_i = 0
        #: the cluster token (authentication is on by default outside loopback)
        self.token = os.environ.get("TRIO_PD_TOKEN") or f"chaos-{random.getrandbits(64):016x}"

    async def start(self, name: str, cmd: list[str], netns: str | None = None) -> Proc:
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]  # ip execs the command: same PID
        log = self.tmp / f"{name}-{len(self.procs)}.stderr"
        with log.open("wb") as err:
            process = await trio.lowlevel.open_process(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env={**os.environ, "GLOG_minloglevel": "1", "TRIO_PD_TOKEN": self.token},
            )
        proc = Proc(name, process, log)
        self.procs.append(proc)
        self.nursery.start_soon(proc.pump)
        return proc

    async def bootstrap(self, host: str = "127.0.0.1", netns: str | None = None) -> None:
        cmd = [sys.executable, "-m", "trio_pd.cli", "bootstrap", "--host", host, "--port", "0"]
        boot = await self.start("bootstrap", cmd, netns)
        got = await boot.wait_for(lambda ev: [e for e in ev if e["ev"] == "url"], 30, "URL")
        self.url = got[0]["url"]

    async def rank(self, role: str, host: str = "127.0.0.1", netns: str | None = None) -> Proc:
        cmd = [sys.executable, WORKER, role, self.url, host, json.dumps(self.opts)]
        proc = await self.start(role, cmd, netns)
        await proc.wait_for(lambda ev: proc.of("ready"), 60, "ready")
        return proc

    def submit(
        self, prefill: Proc, decodes: list[Proc], n: int, *, pages: int = 64, chunks: int = 8,
        gap: float = 0.05,
    ) -> list[int]:
        """Announce ``n`` requests to the prefill rank and to each decode rank (one request
        per decode rank, the router's choice): returns their indices."""
        out = []
        for _ in range(n):
            for decode in decodes:
                i = self.next_i
                self.next_i += 1
                cmd = dict(cmd="req", i=i, room=self.rng.getrandbits(40) + 1,
                           epoch=self.rng.getrandbits(62), pages=pages, chunks=chunks, gap=gap)
                prefill.send(cmd)
                decode.send(cmd)
                out.append(i)
        return out

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.process.returncode is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@asynccontextmanager
async def cluster(tmp: Path, **opts: Any) -> AsyncIterator[Cluster]:
    async with trio.open_nursery() as nursery:
        c = Cluster(nursery, tmp, opts)
        try:
            yield c
        finally:
            c.kill_all()
            with trio.CancelScope(shield=True), trio.move_on_after(20):
                for proc in c.procs:
                    await proc.process.wait()
            nursery.cancel_scope.cancel()


async def wait_done(proc: Proc, indices: list[int], seconds: float) -> dict[int, dict[str, Any]]:
    """Every one of ``indices`` reported terminal by ``proc``: index -> its done event."""

    def all_done(ev: list[dict[str, Any]]) -> dict[int, dict[str, Any]] | None:
        got = {e["i"]: e for e in ev if e["ev"] == "done" and e["i"] in set(indices)}
        return got if len(got) == len(indices) else None

    result: dict[int, dict[str, Any]] = await proc.wait_for(all_done, seconds, "terminal rooms")
    return result


async def wait_released(proc: Proc, indices: list[int], seconds: float) -> dict[int, Any]:
    def all_released(ev: list[dict[str, Any]]) -> dict[int, Any] | None:
        got = {e["i"]: e for e in ev if e["ev"] == "released" and e["i"] in set(indices)}
        return got if len(got) == len(indices) else None

    result: dict[int, Any] = await proc.wait_for(all_released, seconds, "released rooms")
    return result


async def final(proc: Proc, bound: float = 60) -> dict[str, Any]:
    """Drain ``proc`` (every row back, at most ``bound`` s) and return its final report."""
    proc.send({"cmd": "drain", "bound": bound})
    got = await proc.wait_for(lambda ev: proc.of("final"), bound + 30, "final report")
    report: dict[str, Any] = got[-1]
    return report


async def engine_calls(proc: Proc, seconds: float = 10) -> int:
    """The chunk writes the prefill rank made so far, asked for now: its engine calls, and
    the writes that rode in another room's call (``chunks_batched``)."""
    proc.events[:] = [e for e in proc.events if e["ev"] != "stats"]
    proc.send({"cmd": "stats"})
    got = await proc.wait_for(lambda ev: proc.of("stats"), seconds, "stats")
    stats = got[-1]["stats"]
    calls: int = stats["engine_calls"] + stats.get("chunks_batched", 0)
    return calls


async def in_flight(prefill: Proc, since: int, calls: int, seconds: float) -> None:
    """Wait until the prefill rank made ``calls`` engine calls more than ``since`` (each room
    has some of its chunks written, none all of them): a fault then hits rooms mid-transfer.
    Polls the counter (it has no event), at most ``seconds``."""
    with trio.fail_after(seconds):
        while await engine_calls(prefill) < since + calls:  # noqa: ASYNC110 - a counter
            await trio.sleep(0.02)


def check_final(report: dict[str, Any], who: str) -> None:
    assert report["late_writes"] == 0, f"{who}: late writes {report}"
    assert report["corrupt"] == 0, f"{who}: corrupt {report}"
    assert report["source_uaf"] == 0, f"{who}: source use-after-free {report}"
    assert report["guard_bytes_touched"] == 0, f"{who}: guard bytes {report}"
    assert report["leaked"] == 0, f"{who}: leaked {report}"
    # (decode: every landing page back once the rooms drained)
    assert report["stats"]["landing_held"] == 0, f"{who}: landing pages held {report}"


def record(row: dict[str, Any]) -> None:
    """Append a scenario's figures to $CHAOS_REPORT (JSON lines), and print them."""
    print("chaos:", json.dumps(row))
    path = os.environ.get("CHAOS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------- network namespaces


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def netns_permitted() -> str | None:
    """None if this process may create network namespaces, else why not."""
    name = f"trio-pd-chaos-check-{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return f"ip netns add is not permitted here: {exc} {detail.decode(errors='replace')}"
    _ip("netns", "del", name)
    return None


@dataclass(frozen=True)
class NetPair:
    a: str
    b: str
    addr_a: str
    addr_b: str
    veth_a: str
    veth_b: str

    def link(self, up: bool) -> None:
        """Take the veth pair down (both ends) or up again."""
        state = "up" if up else "down"
        _ip("-n", self.a, "link", "set", self.veth_a, state)
        _ip("-n", self.b, "link", "set", self.veth_b, state)


@contextmanager
def netns_pair(n: int) -> Iterator[NetPair]:
    """Two namespaces of this test, joined by a veth pair on 10.200.n.0/30; deleted (with
    the pair) on the way out. Their names start with ``$CHAOS_NETNS_PREFIX`` (default
    ``tpdc``), so that runs sharing a host can tell theirs apart."""
    tag = f"{os.getpid() % 10000}-{n}"
    prefix = os.environ.get("CHAOS_NETNS_PREFIX", "tpdc")
    pair = NetPair(f"{prefix}-a-{tag}", f"{prefix}-b-{tag}", f"10.200.{n}.1", f"10.200.{n}.2",
                   f"{prefix[:4]}a{tag}"[:15], f"{prefix[:4]}b{tag}"[:15])
    made: list[str] = []
    try:
        for ns in (pair.a, pair.b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", pair.veth_a, "netns", pair.a, "type", "veth",
            "peer", "name", pair.veth_b, "netns", pair.b)
        for ns, veth, addr in ((pair.a, pair.veth_a, pair.addr_a),
                               (pair.b, pair.veth_b, pair.addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield pair
    finally:
        for ns in made:
            try:
                _ip("netns", "del", ns)  # takes its end of the veth pair with it
            except (OSError, subprocess.SubprocessError):
                pass


def ns_connections(ns: str) -> list[Row]:
    """Every TCP connection in namespace ``ns`` (its ``/proc/net/tcp`` and ``tcp6``, read
    from inside it)."""
    out: list[Row] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        done = subprocess.run(["ip", "netns", "exec", ns, "cat", table], capture_output=True,
                              timeout=10, check=False)
        if done.returncode == 0:
            out.extend(rows(done.stdout.decode()))
    return out


def ns_counter(ns: str, name: str) -> int:
    """A TcpExt counter of namespace ``ns`` (``/proc/net/netstat``), e.g.
    ``TCPAbortOnData``: segments with new data that met a socket shut for reading."""
    done = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/netstat"],
                          capture_output=True, timeout=10, check=True)
    lines = done.stdout.decode().splitlines()
    for head, values in zip(lines[::2], lines[1::2], strict=False):
        names, nums = head.split(), values.split()
        if names[0] == "TcpExt:" and name in names:
            return int(nums[names.index(name)])
    return 0
