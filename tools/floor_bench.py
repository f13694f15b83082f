"""The floor: the least a trio program pays per request for ``trio-pd bench``'s load, beside
trio_pd and the bare engine, in one process, alternated.

Scratch measurement tool (not part of the package; no test imports it). It answers: with
today's engine adapters on this machine, how little event-loop CPU per request, and how
close to the engine's ceiling, can ONE trio loop get when it runs both sides and the
driver of the bench's default load (32 requests of 64 pages, 8 MiB each, 16 in flight),
with real engines and real ZeroMQ control sockets, and no rules beyond correctness?

Run from the repository root (one process at a time: it measures CPU)::

    python tools/floor_bench.py nixl --rounds 8 >> /tmp/floor.jsonl
    python tools/floor_bench.py mooncake --rounds 8 >> /tmp/floor.jsonl
    python tools/floor_bench.py --summary /tmp/floor.jsonl

Modes, alternated round by round in one process (the same pools, the same requests under
fresh room ids, the destination wiped before each load and verified after it):

* ``floor``: a driver of 16 client tasks, each taking the next request: send a TRANSFER
  frame (room, epoch, aux row, destination pages) to prefill on a zmq PUSH socket, mark the
  room's source pages ready (stamp its aux row), wait for the room's done event. Prefill:
  one receiver task on its PULL socket; per decode peer ONE writer task that takes every
  ready room (TRANSFER received and pages ready) up to the engine's ``join_bytes``, plans
  each once (``plan_pages`` of its 64 pages plus ``plan_aux``: the bench's ``plan_request``
  at the coalesced size, the blocks of the ceiling's calls),
  hands ONE joined engine call to a per-peer thread (two calls in flight, as a lane), and,
  when a call completes, sends ONE status frame listing the call's rooms. Decode: one
  receiver task that sets each listed room's done event.
* ``task/room``: the floor plus one prefill trio task per room (spawned at its TRANSFER:
  waits for its pages, queues the room, waits for the call's completion).
* ``status/room``: the floor with one status frame per room instead of one per call.
* ``call/room``: the floor with one engine call per room (no joining).
* ``ahead4``: the floor with up to 4 calls handed to the thread (still 2 started at once),
  so that the thread has the next call queued when one completes.
* ``join32``: the floor joining ready rooms up to 32 MiB whatever the engine's
  ``join_bytes`` (for Mooncake, whose bound of 1 MiB makes every 8 MiB room its own call).
  Not in the default modes.
* ``trio_pd``: the bench's own ``_load`` through a real prefill/decode agent pair.
* ``ceiling``: the bench's ``_push_pipelined`` (one thread, two writes in flight) of the
  same requests' coalesced calls joined up to ``join_bytes`` (the bench's ``pipelined x1,
  joined`` mode; ``coalesced`` where the engine joins nothing), on the floor's engine pair.

Per mode and load: the loop thread's CPU (``time.thread_time``) over the load / requests
(engine and lane threads excluded), and GB/s (bytes / 1e9 / seconds). After the timed
rounds, two loads per mode under a trio Instrument that counts task steps and scheduler
rounds (``before_task_step`` / ``before_io_wait``) per request, the prefill engine's calls
per request, and the loop thread's Python and C calls per request (``sys.setprofile``).
Then three loads per mode with the prefill engine's ``submit`` timed: when the engine had
no call in flight (before the first call, after the last, in all). ``--profile MODES``:
cProfile of the loop over two loads of each (calls per request by package and by file).
``idle_loop_cpu_pct``: the loop's CPU while everything is open and idle (what other modes'
idle agents add). The summary's ratios: each load over the same round's ceiling run, and
median over median, best over best (the bench's statistic).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import struct
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import numpy as np
import trio
import zmq

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from trio_pd.core._memory import stamp_aux_row
from trio_pd.core._plan import Blocks, concat, plan_aux, plan_pages, total_bytes
from trio_pd.engines import Pending, join_bytes, start_write
from trio_pd.tools import _bench as b

_HEAD = struct.Struct("<qqq")  # room, epoch, destination aux row
_POLLIN = int(zmq.POLLIN)
_DONTWAIT = int(zmq.DONTWAIT)
_EVENTS = int(zmq.EVENTS)


class Counts(trio.abc.Instrument):
    """Task steps and scheduler rounds (one per I/O wait)."""

    def __init__(self) -> None:
        self.steps = self.rounds = 0

    def before_task_step(self, task: Any) -> None:
        self.steps += 1

    def before_io_wait(self, timeout: float) -> None:
        self.rounds += 1


def zsock(ctx: zmq.Context[Any], kind: int) -> Any:
    """A socket of the floor's control plane: no linger, no high-water mark in the way."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    return sock


class Pusher:
    """One thread for one peer: engine calls in order, ``depth`` started ahead of the one it
    waits for; a finished call's ``done(arg)`` runs on the trio loop (``run_sync_soon``).
    ``nice``: the thread's nice value raised by that much (Linux). A call's ``prepare`` (if
    any) runs on the thread right before the call starts (a gather into staging), so it
    overlaps the call in flight before it; a call's ``peer`` (if given) is where it writes
    instead (one thread for several peers, waited in order)."""

    def __init__(self, engine: Any, peer: str, depth: int = 2, nice: int = 0) -> None:
        self.engine, self.peer, self.depth, self.nice = engine, peer, depth, nice
        self.token = trio.lowlevel.current_trio_token()
        self.cond = threading.Condition()
        self.jobs: deque[tuple[Blocks, Callable[[Any], None], Any,
                               Callable[[], None] | None, str]] = deque()
        self.idle = False
        self.closed = False
        #: the thread's CPU seconds (``time.thread_time``) when it ended
        self.cpu = 0.0
        #: (started, waited) perf_counter pairs of every call, and the rooms of each
        self.times: list[tuple[float, float]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True, name=f"push {peer}")
        self.thread.start()

    def submit(self, blocks: Blocks, done: Callable[[Any], None], arg: Any,
               prepare: Callable[[], None] | None = None, peer: str | None = None) -> None:
        with self.cond:
            self.jobs.append((blocks, done, arg, prepare, peer or self.peer))
            if self.idle:
                self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(10)

    def _serve(self) -> None:
        if self.nice:  # (as trio_pd's lanes: the loop preempts a thread waiting on the engine)
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self.nice)
        flying: deque[tuple[Callable[[Any], None], Any, Pending]] = deque()
        while True:
            job = None
            with self.cond:
                while not self.jobs and not flying and not self.closed:
                    self.idle = True
                    self.cond.wait()
                    self.idle = False
                if self.jobs and len(flying) < self.depth:
                    job = self.jobs.popleft()
                elif not flying:
                    self.cpu = time.thread_time()
                    return  # closed, nothing queued or flying
            if job is not None:
                blk, done, arg, prepare, peer = job
                if prepare is not None:
                    prepare()
                t0 = time.perf_counter()
                flying.append((done, (arg, t0), start_write(self.engine, peer, *blk)))
                continue
            done, (arg, t0), pending = flying.popleft()
            pending.wait()  # (an engine error ends the thread: the load then hangs, bounded)
            self.times.append((t0, time.perf_counter()))
            self.token.run_sync_soon(done, arg)


async def _drain(sock: zmq.Socket[bytes], handle: Callable[[bytes], None]) -> None:
    """Receive every message of a PULL socket only this task touches, for ever."""
    fd = int(sock.getsockopt(zmq.FD))
    recv, get = zmq.backend.Socket.recv, zmq.backend.Socket.get
    while True:
        while True:
            try:
                msg = recv(sock, _DONTWAIT)
            except zmq.Again:
                break
            handle(msg)
        if int(get(sock, _EVENTS)) & _POLLIN:
            continue
        await trio.lowlevel.wait_readable(fd)


class _Room:
    __slots__ = ("done_ev", "dst_aux", "dst_pages", "has_pages", "has_transfer", "plan",
                 "ready_ev", "req", "size")

    def __init__(self) -> None:
        self.req: Any = None
        self.dst_pages: Any = None
        self.dst_aux = 0
        self.has_transfer = self.has_pages = False
        self.ready_ev: trio.Event | None = None
        self.done_ev: trio.Event | None = None
        self.plan: list[Blocks] | None = None  # planned once, when first looked at
        self.size = 0


class Prefill:
    """One decode peer: a receiver task, a writer task, a :class:`Pusher`."""

    def __init__(self, engine: Any, peer: str, s: b._Setup, pull: Any, push: Any,
                 mode: str) -> None:
        self.engine, self.s, self.pull, self.push = engine, s, pull, push
        self.src, self.dst = s.src.spec, s.dst.spec
        assert s.opts.coalesced_pages == s.opts.request_pages  # one chunk per request
        self.heads = (self.src.first_head, self.src.first_head + self.src.heads)
        self.rooms: dict[int, _Room] = {}
        self.ready: deque[_Room] = deque()
        self.finished: deque[list[_Room]] = deque()
        self.inflight = 0
        self.lot = trio.lowlevel.ParkingLot()
        self.pusher = Pusher(engine, peer)
        self.join = join_bytes(engine)
        self.mode = mode
        self.nursery: trio.Nursery | None = None

    def _room(self, room: int) -> _Room:
        r = self.rooms.get(room)
        if r is None:
            r = self.rooms[room] = _Room()
        return r

    def _kick(self) -> None:
        if self.lot:
            self.lot.unpark()

    def on_transfer(self, msg: bytes) -> None:
        room, _epoch, aux = _HEAD.unpack_from(msg)
        r = self._room(room)
        r.dst_pages = np.frombuffer(msg, np.int64, offset=_HEAD.size)
        r.dst_aux, r.has_transfer = aux, True
        if self.mode == "task/room":
            r.ready_ev, r.done_ev = trio.Event(), trio.Event()
            if r.has_pages:
                r.ready_ev.set()
            assert self.nursery is not None
            self.nursery.start_soon(self._room_task, r)
        elif r.has_pages:
            self.ready.append(r)
            self._kick()

    def send(self, req: b._Req) -> None:
        """Prefill's "these pages are ready" for the whole request (aux row stamped)."""
        stamp_aux_row(self.src, req.src_aux, req.room, req.epoch)
        r = self._room(req.room)
        r.req, r.has_pages = req, True
        if r.ready_ev is not None:
            r.ready_ev.set()
        elif r.has_transfer and self.mode != "task/room":
            self.ready.append(r)
            self._kick()

    async def _room_task(self, r: _Room) -> None:
        assert r.ready_ev is not None and r.done_ev is not None
        await r.ready_ev.wait()
        self.ready.append(r)
        self._kick()
        await r.done_ev.wait()

    def _call_done(self, rooms: list[_Room]) -> None:  # (on the loop, from the pusher)
        self.finished.append(rooms)
        self._kick()

    async def writer(self) -> None:
        send = zmq.backend.Socket.send
        while True:
            per_room = self.mode == "call/room"
            status_per_room = self.mode == "status/room"
            while self.finished:
                rooms = self.finished.popleft()
                self.inflight -= 1
                if status_per_room:
                    for r in rooms:
                        send(self.push, struct.pack("<q", r.req.room), _DONTWAIT)
                else:
                    send(self.push, struct.pack(f"<{len(rooms)}q",
                                                *[r.req.room for r in rooms]), _DONTWAIT)
                for r in rooms:
                    del self.rooms[r.req.room]
                    if r.done_ev is not None:
                        r.done_ev.set()
            ahead = 4 if self.mode == "ahead4" else self.pusher.depth
            if self.ready and self.inflight < ahead:
                taken: list[_Room] = []
                parts: list[Blocks] = []
                nbytes = 0
                while self.ready:
                    r = self.ready[0]
                    if r.plan is None:
                        req = r.req
                        # (the whole request is one coalesced chunk: 64 pages, aux row with it)
                        r.plan = [plan_pages(self.src, self.dst, req.src_pages, r.dst_pages,
                                             heads=self.heads),
                                  plan_aux(self.src, self.dst, req.src_aux, r.dst_aux)]
                        r.size = total_bytes(r.plan[0]) + total_bytes(r.plan[1])
                    plan, size = r.plan, r.size
                    bound = (32 << 20) if self.mode == "join32" else self.join
                    if taken and (per_room or nbytes + size > bound):
                        break
                    self.ready.popleft()
                    taken.append(r)
                    parts += plan
                    nbytes += size
                self.inflight += 1
                self.pusher.submit(concat(parts), self._call_done, taken)
                continue
            await self.lot.park()


class Floor:
    """Both sides of the floor program on the current trio loop, over real zmq sockets."""

    def __init__(self, s: b._Setup, mode: str) -> None:
        self.s = s
        self.ctx = zmq.Context()
        self.a, self.b = b._engine_pair(s)
        first = b.plan_request(s.src.spec, s.dst.spec, s.warm, s.opts.chunk_pages)[0]
        self.a.write(self.b.session_id, first.src, first.dst, first.lens)  # opens the segment
        # decode -> prefill (TRANSFER), prefill -> decode (status)
        self.pre_pull = self._sock(zmq.PULL)
        port = self.pre_pull.bind_to_random_port("tcp://127.0.0.1")
        self.dec_push = self._sock(zmq.PUSH)
        self.dec_push.connect(f"tcp://127.0.0.1:{port}")
        self.dec_pull = self._sock(zmq.PULL)
        port = self.dec_pull.bind_to_random_port("tcp://127.0.0.1")
        self.pre_push = self._sock(zmq.PUSH)
        self.pre_push.connect(f"tcp://127.0.0.1:{port}")
        self.pre = Prefill(self.a, self.b.session_id, s, self.pre_pull, self.pre_push, mode)
        self.events: dict[int, trio.Event] = {}
        self.timeline: dict[str, float] = {}

    def _sock(self, kind: int) -> Any:
        return zsock(self.ctx, kind)

    def _on_status(self, msg: bytes) -> None:
        pop = self.events.pop
        for room in struct.unpack(f"<{len(msg) // 8}q", msg):
            pop(room).set()

    async def serve(self, nursery: trio.Nursery) -> None:
        self.pre.nursery = nursery
        nursery.start_soon(_drain, self.pre_pull, self.pre.on_transfer)
        nursery.start_soon(_drain, self.dec_pull, self._on_status)
        nursery.start_soon(self.pre.writer)

    async def load(self, reqs: list[b._Req], mode: str = "floor") -> float:
        self.pre.mode = mode
        todo = iter(reqs)
        send = zmq.backend.Socket.send
        push, pre, events = self.dec_push, self.pre, self.events

        async def client() -> None:
            for req in todo:
                ev = events[req.room] = trio.Event()
                send(push, _HEAD.pack(req.room, req.epoch, req.dst_aux)
                     + req.dst_pages.tobytes(), _DONTWAIT)
                pre.send(req)
                await ev.wait()

        self.pre.pusher.times.clear()
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(min(self.s.opts.concurrency, len(reqs))):
                nursery.start_soon(client)
        end = time.perf_counter()
        times = sorted(self.pre.pusher.times)
        # the engine's idle time inside the load: before the first call, after the last one,
        # and between calls when none was in flight
        busy, reach = 0.0, start
        for a, z in times:
            busy += max(0.0, z - max(a, reach))
            reach = max(reach, z)
        self.timeline = {"calls": len(times), "lead_us": (times[0][0] - start) * 1e6,
                         "tail_us": (end - max(z for _, z in times)) * 1e6,
                         "idle_us": (end - start - busy) * 1e6}
        return end - start

    def close(self) -> None:
        self.pre.pusher.close()
        for sock in (self.pre_pull, self.dec_push, self.dec_pull, self.pre_push):
            sock.close()
        self.ctx.term()
        self.a.close()
        self.b.close()


FLOORS = ("floor", "task/room", "status/room", "call/room", "ahead4", "join32")


def _where(filename: str) -> str:
    """A profiled function's place, coarsely: trio_pd's subpackage, or the library."""
    f = filename.replace("\\", "/")
    if "/trio_pd/" in f:
        return "trio_pd/" + f.split("/trio_pd/")[-1].split("/")[0]
    if "floor_bench" in f:
        return "floor_bench"
    for lib in ("trio", "zmq", "numpy", "outcome", "threading", "contextlib", "dataclasses",
                "enum", "logging", "_weakrefset", "abc", "typing"):
        if f"/{lib}/" in f or f.endswith(f"/{lib}.py"):
            return lib
    return "builtins" if f.startswith("~") else f.rsplit("/", 1)[-1]


class _TimedPending:
    __slots__ = ("inner", "t0", "times")

    def __init__(self, inner: Pending, t0: float, times: list[tuple[float, float]]) -> None:
        self.inner, self.t0, self.times = inner, t0, times

    def wait(self) -> None:
        try:
            self.inner.wait()
        finally:
            self.times.append((self.t0, time.perf_counter()))


def _idle(times: list[tuple[float, float]], start: float, end: float) -> dict[str, float]:
    """Where the engine had no call in flight inside [start, end]: before the first call
    (lead), after the last (tail), in all (idle); microseconds."""
    times = sorted(times)
    busy, reach = 0.0, start
    for a, z in times:
        busy += max(0.0, z - max(a, reach))
        reach = max(reach, z)
    return {"calls": len(times), "lead_us": (times[0][0] - start) * 1e6,
            "tail_us": (end - max(z for _, z in times)) * 1e6,
            "idle_us": (end - start - busy) * 1e6}


async def _engine_timeline(eng: Any, mode: str, load: Callable[[str, list[b._Req]], Any],
                           s: b._Setup, loads: int = 3) -> dict[str, float]:
    """Means over ``loads`` loads of :func:`_idle`, the engine's ``submit`` timed from the
    call to the return of its wait (an instance attribute over the engine's method: the
    lane's or the pusher's ``start_write`` finds it first)."""
    inner = eng.submit
    times: list[tuple[float, float]] = []

    def timed(*a: Any) -> _TimedPending:
        t0 = time.perf_counter()
        return _TimedPending(inner(*a), t0, times)

    eng.submit = timed
    out: dict[str, float] = defaultdict(float)
    try:
        for _ in range(loads):
            reqs = b._fresh(s.load, s.rng)
            times.clear()
            start = time.perf_counter()
            await load(mode, reqs)
            end = time.perf_counter()
            for k, v in _idle(list(times), start, end).items():
                out[k] += v / loads
            out["load_us"] += (end - start) * 1e6 / loads
    finally:
        del eng.submit
    return {k: round(v, 1) for k, v in out.items()}


async def _profile(modes: list[str], load: Callable[[str, list[b._Req]], Any],
                   s: b._Setup) -> dict[str, Any]:
    """cProfile of the loop thread over 2 loads per mode: calls per request by place, and
    the functions with the most own time (profiled time: relative only)."""
    import cProfile
    import pstats

    out: dict[str, Any] = {}
    for mode in modes:
        pr = cProfile.Profile()
        n = 0
        for _ in range(2):
            reqs = b._fresh(s.load, s.rng)
            n += len(reqs)
            pr.enable()
            await load(mode, reqs)
            pr.disable()
        st = pstats.Stats(pr)
        by_place: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        by_file: dict[str, float] = defaultdict(float)
        rows = []
        for (fn, line, name), (_cc, nc, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
            place = _where(fn)
            by_place[place][0] += nc / n
            by_place[place][1] += tt / n * 1e6
            by_file[f"{place}/{fn.rsplit('/', 1)[-1]}" if "/" in fn else name] += nc / n
            rows.append((tt / n * 1e6, nc / n, f"{place}:{fn.rsplit('/', 1)[-1]}:{line}({name})"))
        rows.sort(reverse=True)
        out[mode] = {
            "by_place": {k: [round(v[0], 1), round(v[1], 1)] for k, v in
                         sorted(by_place.items(), key=lambda kv: -kv[1][1])},
            "top": [[round(a, 1), round(c, 2), w] for a, c, w in rows[:30]],
            "calls_by_file": {k: round(v, 1) for k, v in
                              sorted(by_file.items(), key=lambda kv: -kv[1])[:25]},
        }
    return out


async def main(engine: str, rounds: int, modes: list[str],
               profile: list[str] | None = None) -> dict[str, Any]:
    opts = b.BenchOptions(engine=engine, secure=False)
    s = b._setup(opts)
    calls = [blk for r in s.load
             for blk in b.plan_request(s.src.spec, s.dst.spec, r, opts.coalesced_pages)]
    cpu: dict[str, list[float]] = defaultdict(list)
    gbs: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, dict[str, float]] = {}
    prof_out: dict[str, Any] = {}
    sys_us: dict[str, list[float]] = defaultdict(list)
    etl: dict[str, dict[str, float]] = {}
    tl: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    async with AsyncExitStack() as stack:
        # one floor (one engine pair, its sockets and tasks) for every floor mode: the mode
        # only says how the next load is handled
        floor = Floor(s, "floor")
        stack.callback(floor.close)
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)
        await floor.serve(nursery)
        for mode in modes:
            if mode in FLOORS:
                await floor.load([s.warm], mode)
                await floor.load(b._fresh(s.load, s.rng), mode)
        joined = b._joined(calls, opts.batch_blocks, join_bytes(floor.a))
        nbytes = sum(total_bytes(x) for x in calls)
        pair = None
        if "trio_pd" in modes:
            pair = await b._open_pair(stack, opts, s.src, s.dst)
            await b._request(pair, s.warm, opts.chunk_pages)
            await b._load(pair, b._fresh(s.load, s.rng), opts)

        async def one(mode: str) -> float:
            reqs = b._fresh(s.load, s.rng)
            b._wipe(s.dst)
            ru = resource.getrusage(resource.RUSAGE_THREAD)
            c = time.thread_time()
            if mode == "trio_pd":
                assert pair is not None
                t, failed = await b._load(pair, reqs, opts)
                assert not failed
            else:
                t = await floor.load(reqs, mode)
            c = time.thread_time() - c
            ru2 = resource.getrusage(resource.RUSAGE_THREAD)
            sys_us[mode].append((ru2.ru_stime - ru.ru_stime) / len(reqs) * 1e6)
            if mode in FLOORS:
                for k, v in floor.timeline.items():
                    tl[mode][k].append(v)
            bad, _ = b.verify(s, reqs)
            assert bad == 0, f"{mode}: {bad} corrupt"
            cpu[mode].append(c / len(reqs) * 1e6)
            gbs[mode].append(nbytes / t / 1e9)
            return c

        # idle: what everything open costs the loop when nothing moves
        c = time.thread_time()
        await trio.sleep(1.0)
        idle_pct = (time.thread_time() - c) * 100
        for _ in range(rounds):
            for mode in modes:
                if mode == "ceiling":
                    # from a thread, the loop idle meanwhile: what the loop's thread is
                    # charged while only the engine works (interrupts, softirqs)
                    c = time.thread_time()
                    t = await trio.to_thread.run_sync(
                        b._push_pipelined, floor.a, floor.b.session_id, joined)
                    cpu[mode].append((time.thread_time() - c) / len(s.load) * 1e6)
                    gbs[mode].append(nbytes / t / 1e9)
                else:
                    await one(mode)
        for mode in modes:
            if mode == "ceiling":
                continue
            inst = Counts()
            eng: Any = pair.prefill.engine if mode == "trio_pd" and pair is not None else floor.a
            calls_made = [0]
            inner = eng.submit

            def counted(*a: Any, _inner: Any = inner, _n: list[int] = calls_made) -> Any:
                _n[0] += 1
                return _inner(*a)

            eng.submit = counted  # (an instance attribute: start_write finds it first)
            py = [0, 0]

            def prof(frame: Any, event: str, arg: Any, _py: list[int] = py) -> None:
                if event == "call":
                    _py[0] += 1
                elif event == "c_call":
                    _py[1] += 1

            trio.lowlevel.add_instrument(inst)
            sys.setprofile(prof)  # (this thread only: the loop's)
            n = 0
            try:
                for _ in range(2):
                    reqs = b._fresh(s.load, s.rng)
                    n += len(reqs)
                    if mode == "trio_pd":
                        assert pair is not None
                        await b._load(pair, reqs, opts)
                    else:
                        await floor.load(reqs, mode)
            finally:
                sys.setprofile(None)
                trio.lowlevel.remove_instrument(inst)
                del eng.submit
            counts[mode] = {
                "steps": round(inst.steps / n, 2), "rounds": round(inst.rounds / n, 2),
                "engine_calls": round(calls_made[0] / n, 3),
                "py_calls": round(py[0] / n), "c_calls": round(py[1] / n),
            }
        def run_load(m: str, r: list[b._Req]) -> Any:
            if m == "trio_pd":
                assert pair is not None
                return b._load(pair, r, opts)
            return floor.load(r, m)

        for mode in modes:
            if mode != "ceiling":
                eng = pair.prefill.engine if mode == "trio_pd" and pair is not None else floor.a
                etl[mode] = await _engine_timeline(eng, mode, run_load, s)
        if profile:
            prof_out = await _profile(profile, run_load, s)
    return {
        "engine": engine, "requests": len(s.load), "bytes": nbytes,
        "ceiling_calls": len(joined), "join_bytes": join_bytes(floor.a),
        "idle_loop_cpu_pct": round(idle_pct, 2),
        "cpu_us": {k: [round(x, 1) for x in v] for k, v in cpu.items()},
        "gbps": {k: [round(x, 3) for x in v] for k, v in gbs.items()},
        "per_request": counts, "profile": prof_out,
        "engine_timeline": etl,
        "sys_us": {k: [round(x, 1) for x in v] for k, v in sys_us.items()},
        "timeline": {m: {k: [round(x) for x in v] for k, v in d.items()} for m, d in tl.items()},
    }


def _span(v: list[float], fmt: str = "{:.0f}") -> str:
    if not v:
        return "-"
    return f"{fmt.format(statistics.median(v))} [{fmt.format(min(v))}-{fmt.format(max(v))}]"


def summary(path: str) -> None:
    """Medians and ranges over every process of each engine in a JSON-lines file. The ratio
    is each load's GB/s over the ceiling run of the same round (minutes apart at most)."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    with open(path) as fh:
        for line in fh:
            if line.startswith("{"):
                r = json.loads(line)
                runs[r["engine"]].append(r)
    for engine, rs in runs.items():
        print(f"\n{engine}: {len(rs)} processes, {sum(len(r['gbps']['ceiling']) for r in rs)}"
              " rounds; idle loop CPU %:", [r["idle_loop_cpu_pct"] for r in rs])
        keys = ("steps", "rounds", "engine_calls", "py_calls", "c_calls")
        print(f"{'mode':12} {'loop us/req':>18} {'GB/s':>20} {'ratio':>18} "
              + " ".join(f"{k:>12}" for k in keys))
        ceil = [x for r in rs for x in r["gbps"]["ceiling"]]
        print("ratio: each load over its round's ceiling run; median/median and best/best:",
              {m: (round(statistics.median([x for r in rs for x in r["gbps"][m]])
                         / statistics.median(ceil), 3),
                   round(max(x for r in rs for x in r["gbps"][m]) / max(ceil), 3))
               for m in rs[0]["gbps"]})
        for m in rs[0]["gbps"]:
            g = [x for r in rs for x in r["gbps"][m]]
            c = [x for r in rs for x in r["cpu_us"].get(m, [])]
            ratio = [x / y for r in rs
                     for x, y in zip(r["gbps"][m], r["gbps"]["ceiling"], strict=True)]
            per = [r["per_request"][m] for r in rs if m in r["per_request"]]
            cols = " ".join(
                f"{statistics.median([p[k] for p in per if k in p] or [float('nan')]):12.2f}"
                for k in keys)
            print(f"{m:12} {_span(c):>18} {_span(g, '{:.2f}'):>20} "
                  f"{_span(ratio, '{:.2f}'):>18} {cols}")
        print("loop sys time us/req (in the loop us above):")
        for m in rs[0].get("sys_us", {}):
            print(f"  {m:12} {_span([x for r in rs for x in r['sys_us'][m]])}")
        print("floor loads' engine timeline, us (lead: to the first write; tail: after the last;"
              " idle: none in flight):")
        for m in rs[0].get("timeline", {}):
            tl = {k: [x for r in rs for x in r["timeline"][m][k]] for k in rs[0]["timeline"][m]}
            print(f"  {m:12} " + "  ".join(f"{k} {_span(v)}" for k, v in tl.items()))
        print("engine timeline, submit wrapped (3 loads/process; us; same fields):")
        for m in rs[0].get("engine_timeline", {}):
            keys = rs[0]["engine_timeline"][m]
            print(f"  {m:12} " + "  ".join(
                f"{k} {_span([r['engine_timeline'][m][k] for r in rs])}" for k in keys))
        for m in rs[0].get("profile", {}):
            places: dict[str, list[float]] = defaultdict(list)
            for r in rs:
                for k, (calls, _) in r["profile"][m]["by_place"].items():
                    places[k].append(calls)
            top = sorted(places.items(), key=lambda kv: -statistics.median(kv[1]))[:8]
            print(f"  profiled calls/req, {m}: "
                  + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in top))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine", nargs="?", choices=("mooncake", "nixl"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--modes", default=",".join((*FLOORS[:-1], "trio_pd", "ceiling")))
    ap.add_argument("--summary", metavar="JSONL")
    ap.add_argument("--profile", default="", help="modes to run under cProfile at the end")
    ns = ap.parse_args()
    if ns.summary:
        summary(ns.summary)
        sys.exit(0)
    out = trio.run(main, ns.engine, ns.rounds, ns.modes.split(","),
                   [m for m in ns.profile.split(",") if m])
    print(json.dumps(out), flush=True)
