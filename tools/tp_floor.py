"""The TP 1->4 floor: what a minimal trio program reaches for ``trio-pd bench``'s
``tp_mismatch`` load, beside trio_pd's own phase, in one process, alternated.

Scratch measurement tool (not part of the package; no test imports it). It answers: on this
machine, with the engines as they are, what ``ratio`` (TP 1->4 GB/s over TP 1->1 GB/s) does a
program with no rules beyond correctness reach for the phase's load, and does any design of
it reach 0.7?

Run from the repository root (one process at a time: it measures CPU)::

    python tools/tp_floor.py --engines nixl,mooncake --rounds 8 --nice 10 >> /tmp/tp.jsonl
    python tools/tp_floor.py --summary /tmp/tp.jsonl

The load is the phase's own: the demo's options as ``run_tp_mismatch`` builds them from the
bench's defaults (MHA, 8 kv heads of 256 B, 2 layers, 16-token pages, 64 requests of 512
tokens, 16 in flight per rank, 16-page chunks), the demo's pools (``_demo._pool``), its
request plan, its page allocators with their poison checks, its fill on prefill and its
byte-for-byte check (``_demo._verify``) on every decode rank, its random 0-2 ms "compute"
before each chunk. Every run opens fresh pools and engines, as the demo does: one engine
per rank (TP 1->4: five), each decode engine with its pool registered, the prefill engine
with its pool (and its staging area) registered and every decode engine added as a peer.

Control, the least that still crosses a socket: per request and decode rank ONE zmq frame
decode -> prefill (room, epoch, aux row, rank, destination pages), and ONE status frame
prefill -> decode rank per engine call that finishes a room for it (listing those rooms).
No bootstrap, no handshake, no encryption, no timeouts, no aborts.

Modes (each a whole run, alternated round by round with trio_pd's):

* ``floor1``: TP 1->1. Per (chunk, decode rank) ONE engine call: whole pages, one block per
  run of consecutive pages per buffer (``plan_pages``), the aux row with the last chunk,
  handed to a per-peer thread (two calls in flight: ``floor_bench.Pusher``).
* ``loop4``: TP 1->4, design (a): each (chunk, decode rank) gathered into a staging area
  (``StagingArea``, as trio_pd's) ON THE LOOP THREAD as soon as both the chunk and the
  rank's request are there, planned (``plan_staged``: one block per buffer), one engine
  call per (chunk, decode rank) on that rank's thread.
* ``thread4``: TP 1->4, design (b): the same plan, the gather run on the rank's thread
  right before its call, so the gather of one call overlaps the write of the one before
  (one thread per decode rank, two calls in flight).
* ``one4``: ``thread4`` with ONE thread for the four decode ranks (up to eight calls in
  flight, waited in the order they started): one poller of the engine instead of four.
* ``join4``: ``thread4`` with every ready (chunk, rank) of a rank joined into one call up
  to the engine's ``join_bytes`` (several gathers, one call).
* ``onejoin4``: ``join4`` on ONE thread for the four decode ranks (as ``one4``).
* ``inplace4``: TP 1->4, design (c): no staging; every token slot's head slice is its own
  block (``plan_pages`` with the rank's heads: 1,024 blocks a chunk per rank). Not in the
  default modes (seconds a run on NIXL, half a minute on Mooncake).
* ``trio_pd1`` / ``trio_pd4``: ``trio.run(run_in_process, replace(base, decode_tp=...))``,
  exactly as the bench's phase runs it (CURVE on, the demo's default).
* ``trio_pd1_insecure`` / ``trio_pd4_insecure``: the same with ``secure=False`` (not in the
  default modes).
* any mode with ``@poll`` after its name (``thread4@poll``, ``trio_pd4@poll``...): run with
  the NIXL adapter's first sleep between completion checks at 250 us instead of 20 us (its
  module constant patched for the run; NIXL only).

Per run: ``gbps`` as the demo's ``transfer_gbps`` (the verified bytes of every decode rank
over the union of its requests' in-flight intervals, ``time.monotonic`` from the decode
request's start to its completion), ``window_s`` (first start to last end), ``loop_cpu_s``
and ``proc_cpu_s``: the trio loop thread's CPU (its ``CLOCK_THREAD_CPUTIME``) and the
process's CPU over that window, sampled every 2 ms by a sampler thread (the same for every
mode), ``harness_cpu_s``: the loop's CPU in the demo's own work over the run (fill, verify,
the page allocators' poisoning and checks; the demo's ``harness_cpu_seconds``), ``calls``:
prefill engine calls; floor modes also ``threads_cpu_s`` (the per-peer threads' CPU over
the run: gathers where they run them, engine submits and waits) and ``gather_cpu_s`` (the
gathers alone, on whichever thread ran them).

Options: ``--nice N`` raises the floor's per-peer threads' nice value (trio_pd's lanes run
at +10: ``PrefillConfig.lane_nice``); ``--lean`` makes every page allocator, the floor's and
the demo's, without its sanitizer; ``--warm`` has the floor write to each peer once before
its window. The summary gives medians and ranges per engine and mode: ``ratio`` (each
TP 1->4 run over its round's TP 1->1 run: floor designs over ``floor1``, trio_pd over
trio_pd), ``over best 1`` (over the faster TP 1->1 run of the round) and ``CPU bound`` (the
same ratio of ``max(loop CPU, process CPU / 2)``: the shortest window the run's CPU allows on
two free cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import numpy.typing as npt
import trio
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from floor_bench import Pusher, _drain, _span, zsock

from trio_pd.core._memory import stamp_aux_row
from trio_pd.core._plan import (
    Blocks,
    chunk_ranges,
    concat,
    plan_aux,
    plan_pages,
    plan_staged,
    staged_bytes,
    total_bytes,
)
from trio_pd.core._staging import Reservation, StagingArea
from trio_pd.engines import join_bytes, make_engine, nixl
from trio_pd.testing.pools import DEST_POISON, SOURCE_POISON, PageAllocator
from trio_pd.tools import _demo
from trio_pd.tools._bench import BenchOptions
from trio_pd.tools._demo import DemoOptions, RankResult, Request

_HEAD = struct.Struct("<qqqq")  # room, epoch, destination aux row, decode rank
_DONTWAIT = int(zmq.DONTWAIT)
#: the default modes (``inplace4`` and the ``_insecure`` ones are asked for by name)
MODES = ("floor1", "loop4", "thread4", "one4", "join4", "trio_pd1", "trio_pd4")
#: ``@poll`` modes: NIXL's first sleep between a write's completion checks (the adapter's
#: ``POLL_FIRST_S`` is 20 us, doubling up to 1 ms)
POLL_FIRST_S = 250e-6
#: the staging area's size: trio_pd's default (``PrefillConfig.staging_bytes``)
STAGING = 64 << 20


def phase_options(engine: str) -> DemoOptions:
    """The demo's options for the bench's ``tp_mismatch`` phase at the bench's defaults
    (``run_tp_mismatch``'s ``base``, decode TP 1)."""
    o = BenchOptions(engine=engine)
    return DemoOptions(
        requests=64, concurrency=o.concurrency, page_size=o.page_size, layers=o.layers,
        kv_heads=o.kv_heads, head_bytes=o.head_bytes, min_tokens=512, max_tokens=512,
        chunk_pages=o.chunk_pages, engine=engine, seed=o.seed, device=o.device,
    )


class Sampler:
    """A thread that samples (monotonic, loop thread CPU, process CPU) every ``period`` s,
    so that any window's CPU can be read afterwards."""

    def __init__(self, period: float = 0.002) -> None:
        self.clock = time.pthread_getcpuclockid(threading.get_ident())  # (the loop's thread)
        self.period = period
        self.samples: list[tuple[float, float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="cpu sampler")
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            self.samples.append((time.monotonic(), time.clock_gettime(self.clock),
                                 time.process_time()))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)

    def window(self, start: float, end: float) -> tuple[float, float]:
        """(loop CPU, process CPU) seconds from the last sample at or before ``start`` to the
        first at or after ``end`` (so at most one period more on each side)."""
        s = self.samples
        a = max((x for x in s if x[0] <= start), default=s[0], key=lambda x: x[0])
        z = min((x for x in s if x[0] >= end), default=s[-1], key=lambda x: x[0])
        return z[1] - a[1], z[2] - a[2]


class _Room:
    __slots__ = ("done", "dst", "left", "ranks_left", "ready", "req", "src_aux", "src_pages")

    def __init__(self, req: Request, tp: int, chunks: int) -> None:
        self.req = req
        self.src_pages: npt.NDArray[np.int64] | None = None
        self.src_aux = 0
        self.ready: list[tuple[int, int]] = []  # the chunks prefill has "computed"
        self.dst: list[tuple[npt.NDArray[np.int64], int] | None] = [None] * tp
        self.left = [chunks] * tp  # per decode rank: chunks not yet written
        self.ranks_left = tp
        self.done = trio.Event()


class FloorRun:
    """One run of a floor mode: fresh pools and engines, both sides on the current loop."""

    def __init__(self, opts: DemoOptions, mode: str, nice: int = 0, warm: bool = False) -> None:
        mode = mode.split("@")[0]  # (a run's patches are the caller's)
        self.opts, self.mode, self.nice = opts, mode, nice
        self.tp = tp = opts.decode_tp
        self.src = _demo._pool(opts, 0, 1)
        self.dsts = [_demo._pool(opts, d, tp) for d in range(tp)]
        self.heads = [(f, f + n) for f, n in (_demo._heads(opts, d, tp) for d in range(tp))]
        self.area = StagingArea(0 if mode == "inplace4" or self.tp == 1 else STAGING)
        self.pe = make_engine(opts.engine)
        self.pe.register(self.src.spec.regions() + ([self.area.region] if self.area.units
                                                     else []))
        self.des = []
        for pool in self.dsts:
            de = make_engine(opts.engine)
            de.register(pool.spec.regions())
            self.pe.add_peer(de.session_id, de.metadata())
            self.des.append(de)
            if warm:  # one aux row written before the window: the peer's connection is open
                self.pe.write(de.session_id, *plan_aux(self.src.spec, pool.spec, 0, 0))
        self.join = join_bytes(self.pe) if mode in ("join4", "onejoin4") else 0
        self.rooms: dict[int, _Room] = {}
        self.chunks = {r.room: chunk_ranges(r.num_pages, opts.chunk_pages)
                       for r in _demo.plan_requests(opts)}
        self.results = [RankResult("decode", d) for d in range(tp)]
        self.calls = 0
        #: the loop thread's CPU in the demo's own work (fill, verify, the page allocators'
        #: poisoning and poison checks), as the demo's ``harness_cpu_seconds`` counts it
        self.harness = 0.0
        self.allocs: list[Any] = []
        #: per decode rank: CPU seconds of its gathers (on its thread; loop4: on the loop,
        #: so also in the loop's CPU)
        self.gather_cpu = [0.0] * tp
        self.queued: list[list[tuple[_Room, int]]] = [[] for _ in range(tp)]
        self.inflight = [0] * tp
        self.ctx: zmq.Context[Any] = zmq.Context()

    # ------------------------------------------------------------------ prefill
    def _room(self, req: Request) -> _Room:
        r = self.rooms.get(req.room)
        if r is None:
            r = self.rooms[req.room] = _Room(req, self.tp, len(self.chunks[req.room]))
        return r

    def on_transfer(self, msg: bytes) -> None:
        room, _epoch, aux, d = _HEAD.unpack_from(msg)
        r = self._room(self.by_room[room])
        r.dst[d] = (np.frombuffer(msg, np.int64, offset=_HEAD.size), aux)
        for i in range(len(r.ready)):
            self._unit(r, i, d)

    def chunk_ready(self, r: _Room, a: int, b: int) -> None:
        r.ready.append((a, b))
        i = len(r.ready) - 1
        for d in range(self.tp):
            if r.dst[d] is not None:
                self._unit(r, i, d)

    def _unit(self, r: _Room, i: int, d: int) -> None:
        """Chunk ``i`` of room ``r`` is computed and decode rank ``d`` asked for it."""
        if self.join:
            self.queued[d].append((r, i))
            self._flush(d)
            return
        blocks, res, gather = self._plan(r, i, d)
        if gather is not None and self.mode == "loop4":
            self._timed(gather, d)()
            gather = None
        elif gather is not None:
            gather = self._timed(gather, d)
        self.calls += 1
        self.pushers[d].submit(blocks, self._done, (d, [(r, i)], [res]), gather,
                               self.des[d].session_id)

    def _flush(self, d: int) -> None:
        """``join4``: every queued unit of rank ``d`` into calls of up to ``join`` bytes,
        while fewer than two of its calls are on the thread."""
        q = self.queued[d]
        while q and self.inflight[d] < 2:
            parts: list[Blocks] = []
            units, res, gathers = [], [], []
            nbytes = 0
            while q:
                blocks, rv, g = self._plan(*q[0], d)
                size = total_bytes(blocks)
                if parts and nbytes + size > self.join:
                    if rv is not None:
                        self.area.give(rv)
                    break
                units.append(q.pop(0))
                parts.append(blocks)
                res.append(rv)
                if g is not None:
                    gathers.append(g)
                nbytes += size
            self.inflight[d] += 1
            self.calls += 1

            def gather_all(gs: list[Any] = gathers, d: int = d) -> None:
                cpu = time.thread_time()
                for g in gs:
                    g()
                self.gather_cpu[d] += time.thread_time() - cpu

            self.pushers[d].submit(concat(parts), self._done, (d, units, res), gather_all,
                                   self.des[d].session_id)

    def _timed(self, gather: Any, d: int) -> Any:
        """``gather``, its CPU time added to rank ``d``'s (it runs on that rank's thread)."""

        def timed() -> None:
            cpu = time.thread_time()
            gather()
            self.gather_cpu[d] += time.thread_time() - cpu

        return timed

    def _plan(self, r: _Room, i: int, d: int) -> tuple[Blocks, Reservation | None, Any]:
        """Chunk ``i``'s blocks for rank ``d`` (staged where the mode stages), the staging
        reservation they read, and the gather that fills it (None: nothing to gather)."""
        a, b = r.ready[i]
        assert r.src_pages is not None
        entry = r.dst[d]
        assert entry is not None
        dst_pages, dst_aux = entry
        src, dst = self.src.spec, self.dsts[d].spec
        sp, dp = r.src_pages[a:b], dst_pages[a:b]
        res = gather = None
        if self.area.units and (res := self.area.reserve(staged_bytes(src, dst, b - a))):
            gather = self.area.gatherer(src, sp, self.heads[d], res, dst.item_lens)
            parts = [plan_staged(src, dst, dp, res.addr)]
        else:  # TP 1->1, inplace4, or a full staging area: in place
            parts = [plan_pages(src, dst, sp, dp, heads=self.heads[d])]
        if i == len(self.chunks[r.req.room]) - 1:
            parts.append(plan_aux(src, dst, r.src_aux, dst_aux))
        return concat(parts), res, gather

    def _done(self, arg: tuple[int, list[tuple[_Room, int]], list[Any]]) -> None:
        """A call finished (on the loop): staging back, and one status frame listing the
        rooms it finished for its decode rank."""
        d, units, res = arg
        for rv in res:
            if rv is not None:
                self.area.give(rv)
        finished = []
        for r, _i in units:
            r.left[d] -= 1
            if r.left[d] == 0:
                finished.append(r.req.room)
                r.ranks_left -= 1
                if r.ranks_left == 0:
                    r.done.set()
        if finished:
            zmq.backend.Socket.send(self.pre_push[d], struct.pack(f"<{len(finished)}q",
                                                                  *finished), _DONTWAIT)
        if self.join:
            self.inflight[d] -= 1
            self._flush(d)

    async def prefill_one(self, req: Request, pages_alloc: PageAllocator,
                          aux_alloc: PageAllocator, rng: random.Random,
                          slots: trio.Semaphore) -> None:
        try:
            pages = await pages_alloc.alloc(req.num_pages)
            aux = await aux_alloc.alloc(1)
            cpu = time.thread_time()
            self.src.fill(pages, req.room)
            self.src.fill_aux(int(aux[0]), req.room)
            self.harness += time.thread_time() - cpu
            stamp_aux_row(self.src.spec, int(aux[0]), req.room, req.epoch)
            r = self._room(req)
            r.src_pages, r.src_aux = pages, int(aux[0])
            for a, b in self.chunks[req.room]:
                await trio.sleep(rng.random() * 0.002)  # the scheduler computes (as the demo)
                self.chunk_ready(r, a, b)
            await r.done.wait()
            del self.rooms[req.room]
            pages_alloc.free(pages)
            aux_alloc.free(aux)
        finally:
            slots.release()

    # ------------------------------------------------------------------ decode
    async def decode_one(self, d: int, req: Request, pages_alloc: PageAllocator,
                         aux_alloc: PageAllocator, slots: trio.Semaphore) -> None:
        try:
            pages = await pages_alloc.alloc(req.num_pages)
            aux = await aux_alloc.alloc(1)
            ev = self.events[d][req.room] = trio.Event()
            started = time.monotonic()
            zmq.backend.Socket.send(self.dec_push[d], _HEAD.pack(req.room, req.epoch,
                                                                 int(aux[0]), d)
                                    + pages.tobytes(), _DONTWAIT)
            await ev.wait()
            res = self.results[d]
            res.active.append((started, time.monotonic()))
            res.outcomes[req.index] = 1
            cpu = time.thread_time()
            _demo._verify(res, self.dsts[d], pages, int(aux[0]), req)
            self.harness += time.thread_time() - cpu
            pages_alloc.free(pages)
            aux_alloc.free(aux)
        finally:
            slots.release()

    def _on_status(self, d: int, msg: bytes) -> None:
        pop = self.events[d].pop
        for room in struct.unpack(f"<{len(msg) // 8}q", msg):
            pop(room).set()

    # ------------------------------------------------------------------ the run
    async def run(self) -> dict[str, Any]:
        opts, tp = self.opts, self.tp
        reqs = _demo.plan_requests(opts)
        self.by_room = {r.room: r for r in reqs}
        self.events: list[dict[int, trio.Event]] = [{} for _ in range(tp)]
        self.pre_pull = zsock(self.ctx, zmq.PULL)
        port = self.pre_pull.bind_to_random_port("tcp://127.0.0.1")
        self.dec_push, self.dec_pull, self.pre_push = [], [], []
        for _ in range(tp):
            push = zsock(self.ctx, zmq.PUSH)
            push.connect(f"tcp://127.0.0.1:{port}")
            pull = zsock(self.ctx, zmq.PULL)
            p = pull.bind_to_random_port("tcp://127.0.0.1")
            back = zsock(self.ctx, zmq.PUSH)
            back.connect(f"tcp://127.0.0.1:{p}")
            self.dec_push.append(push)
            self.dec_pull.append(pull)
            self.pre_push.append(back)
        if self.mode in ("one4", "onejoin4"):  # one thread for every peer, two calls a peer
            one = Pusher(self.pe, self.des[0].session_id, depth=2 * tp, nice=self.nice)
            self.pushers = [one] * tp
        else:
            self.pushers = [Pusher(self.pe, de.session_id, nice=self.nice) for de in self.des]
        try:
            async with trio.open_nursery() as service:
                service.start_soon(_drain, self.pre_pull, self.on_transfer)
                for d in range(tp):
                    service.start_soon(_drain, self.dec_pull[d],
                                       lambda m, d=d: self._on_status(d, m))
                async with trio.open_nursery() as ranks:
                    ranks.start_soon(self._prefill_rank, reqs)
                    for d in range(tp):
                        ranks.start_soon(self._decode_rank, d, reqs)
                service.cancel_scope.cancel()
        finally:
            unique = list({id(p): p for p in self.pushers}.values())
            for p in unique:
                p.close()
            self.thread_cpu = sum(p.cpu for p in unique)
            for s in (self.pre_pull, *self.dec_push, *self.dec_pull, *self.pre_push):
                s.close()
            self.ctx.term()
            self.pe.close()
            for de in self.des:
                de.close()
        bad = sum(r.corrupt_pages for r in self.results)
        assert bad == 0, f"{self.mode}: {bad} corrupt pages"
        assert all(len(r.outcomes) == len(reqs) for r in self.results)
        intervals = [iv for r in self.results for iv in r.active]
        nbytes = sum(r.bytes for r in self.results)
        secs = _demo._union_seconds(intervals)
        return {"bytes": nbytes, "transfer_seconds": secs, "transfer_gbps": nbytes / secs / 1e9,
                "window": (min(a for a, _ in intervals), max(z for _, z in intervals)),
                "calls": self.calls,
                "harness_cpu_s": self.harness + sum(a.cpu_seconds for a in self.allocs),
                "threads_cpu_s": self.thread_cpu, "gather_cpu_s": sum(self.gather_cpu)}

    async def _prefill_rank(self, reqs: list[Request]) -> None:
        pages_alloc = _demo._page_allocator(self.opts, self.src, SOURCE_POISON, 0)
        self.allocs.append(pages_alloc)
        aux_alloc = PageAllocator(self.src.aux_rows(), SOURCE_POISON)
        rng = random.Random(self.opts.seed * 7)
        slots = trio.Semaphore(self.opts.concurrency)
        async with trio.open_nursery() as nursery:
            for req in reqs:
                await slots.acquire()
                nursery.start_soon(self.prefill_one, req, pages_alloc, aux_alloc, rng, slots)

    async def _decode_rank(self, d: int, reqs: list[Request]) -> None:
        pool = self.dsts[d]
        pages_alloc = _demo._page_allocator(self.opts, pool, DEST_POISON, d)
        self.allocs.append(pages_alloc)
        aux_alloc = PageAllocator(pool.aux_rows(), DEST_POISON)
        slots = trio.Semaphore(self.opts.concurrency)
        async with trio.open_nursery() as nursery:
            for req in reqs:
                await slots.acquire()
                nursery.start_soon(self.decode_one, d, req, pages_alloc, aux_alloc, slots)


@contextmanager
def _windows(sink: list[tuple[float, float]]) -> Iterator[None]:
    """While open, every demo summary's window (its decode requests' first start and last
    end) is appended to ``sink``: the demo's ``summarize`` wrapped, nothing else changed."""
    inner = _demo.summarize

    def wrapped(opts: DemoOptions, results: list[RankResult], seconds: float,
                **kw: Any) -> dict[str, Any]:
        ivs = [iv for r in results if r.role == "decode" for iv in r.active]
        sink.append((min(a for a, _ in ivs), max(z for _, z in ivs)))
        return inner(opts, results, seconds, **kw)

    with mock.patch.object(_demo, "summarize", wrapped):
        yield


def one_run(engine: str, mode: str, sampler: Sampler, nice: int = 0,
            warm: bool = False) -> dict[str, Any]:
    base = phase_options(engine)
    tp = 4 if "4" in mode else 1
    opts = replace(base, decode_tp=tp, secure=not mode.endswith("_insecure"))
    with ExitStack() as stack:
        if mode.endswith("@poll"):  # NIXL's waits: the first sleep between checks longer
            stack.enter_context(mock.patch.object(nixl, "POLL_FIRST_S", POLL_FIRST_S))
        return _one_run(engine, mode, sampler, nice, warm, opts, tp)


def _one_run(engine: str, mode: str, sampler: Sampler, nice: int, warm: bool,
             opts: DemoOptions, tp: int) -> dict[str, Any]:
    if mode.startswith("trio_pd"):
        win: list[tuple[float, float]] = []
        with _windows(win):
            out = trio.run(_demo.run_in_process, opts)
        bad = [k for k in ("failed", "corrupt_pages", "late_writes", "leaked_pages", "hung")
               if out[k]]
        assert not bad and out["succeeded"] == opts.requests, (mode, bad)
        calls = sum(r["engine_calls"] for r in out["ranks"] if r["role"] == "prefill")
        window = win[0]
        harness = sum(r["harness_cpu_seconds"] for r in out["ranks"])
        extra = {}
    else:
        out = trio.run(FloorRun(opts, mode, nice, warm).run)
        calls, window, harness = out["calls"], out["window"], out["harness_cpu_s"]
        extra = {"threads_cpu_s": round(out["threads_cpu_s"], 4),
                 "gather_cpu_s": round(out["gather_cpu_s"], 4)}
    loop_cpu, proc_cpu = sampler.window(*window)
    return {"engine": engine, "mode": mode, "tp": tp, "bytes": out["bytes"],
            "gbps": round(out["transfer_gbps"], 4),
            "seconds": round(out["transfer_seconds"], 4),
            "window_s": round(window[1] - window[0], 4), "loop_cpu_s": round(loop_cpu, 4),
            "proc_cpu_s": round(proc_cpu, 4), "calls": calls,
            "harness_cpu_s": round(harness, 4), **extra}


@contextmanager
def _no_sanitizer() -> Iterator[None]:
    """While open, every page allocator (the floor's and the demo's) is made without its
    sanitizer: no poisoning of freed rows, no poison check when they are handed out."""
    inner = PageAllocator.__init__

    def init(self: PageAllocator, rows: Any, poison: int, *, sanitize: bool = True) -> None:
        inner(self, rows, poison, sanitize=False)

    with mock.patch.object(PageAllocator, "__init__", init):
        yield


def main(engines: list[str], rounds: int, modes: list[str], lean: bool = False,
         nice: int = 0, warm: bool = False) -> None:
    sampler = Sampler()
    proc = f"{os.getpid()}-{int(time.time())}"
    stack = ExitStack()
    if lean:
        stack.enter_context(_no_sanitizer())
    try:
        for e in engines:  # a warm-up run of each mode, not printed
            for m in modes:
                one_run(e, m, sampler, nice, warm)
        for rnd in range(rounds):
            for e in engines:
                for m in modes:
                    print(json.dumps({"proc": proc, "round": rnd, "lean": lean, "nice": nice,
                                      "warm": warm, **one_run(e, m, sampler, nice, warm)}),
                          flush=True)
    finally:
        sampler.close()
        stack.close()


def _cpu_bound(r: dict[str, Any]) -> float:
    """The shortest window a run's CPU allows on two free cores: the loop thread's CPU (one
    thread runs it) or half the process's CPU, whichever is longer."""
    return float(max(r["loop_cpu_s"], r["proc_cpu_s"] / 2))


def summary(path: str) -> None:
    """Medians and ranges per engine and mode. ``ratio``: each TP 1->4 run's GB/s over the
    TP 1->1 run of the same round of the same process (floor designs over ``floor1``,
    ``trio_pd4`` over ``trio_pd1``); ``over best 1``: over the faster of that round's two
    TP 1->1 runs; ``CPU bound``: the same ratio of :func:`_cpu_bound` (what the runs' CPU
    allows on two free cores, whatever else shares the box)."""
    by: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    ones: dict[tuple[str, str, int, str], dict[str, Any]] = {}
    with open(path) as fh:
        for line in fh:
            if line.startswith("{"):
                r = json.loads(line)
                e = (r["engine"] + (" (no sanitizer)" if r.get("lean") else "")
                     + (f", floor threads nice +{r['nice']}" if r.get("nice") else "")
                     + (", floor peers written to before" if r.get("warm") else ""))
                by[e][r["mode"]].append(r)
                ones[(r["proc"], e, r["round"], r["mode"])] = r
    for e, ms in by.items():
        print(f"\n{e}")
        cols = (("GB/s", "gbps", 1, "{:.2f}"), ("window ms", "window_s", 1e3, "{:.0f}"),
                ("loop CPU ms", "loop_cpu_s", 1e3, "{:.0f}"),
                ("proc CPU ms", "proc_cpu_s", 1e3, "{:.0f}"),
                ("harness ms", "harness_cpu_s", 1e3, "{:.0f}"),
                ("threads ms", "threads_cpu_s", 1e3, "{:.0f}"),
                ("gather ms", "gather_cpu_s", 1e3, "{:.0f}"), ("calls", "calls", 1, "{:.0f}"))
        print(f"{'mode':9} {'runs':>4} {'ratio':>17} {'over best 1':>17} {'CPU bound':>17} "
              f"{'loop busy %':>13} "
              + " ".join(f"{c[0]:>17}" for c in cols))
        for m, rs in ms.items():
            base = m.replace("4", "1") if m.startswith("trio_pd") else "floor1"
            pairs = [(r, ones[k]) for r in rs if (k := (r["proc"], e, r["round"], base)) in ones]
            ratio = [r["gbps"] / b["gbps"] for r, b in pairs if b["gbps"]]
            # over the round's faster TP 1->1 run, where the round has one
            tops = [(r, max(ones.get((r["proc"], e, r["round"], one), {"gbps": 0})["gbps"]
                            for one in ("floor1", "trio_pd1"))) for r in rs]
            best = [r["gbps"] / top for r, top in tops if top]
            bound = [_cpu_bound(b) / _cpu_bound(r) for r, b in pairs]
            busy = [100 * r["loop_cpu_s"] / r["window_s"] for r in rs]
            print(f"{m:9} {len(rs):4} {_span(ratio, '{:.2f}'):>17} {_span(best, '{:.2f}'):>17} "
                  f"{_span(bound, '{:.2f}'):>17} {_span(busy):>13} " + " ".join(
                f"{_span([r[k] * x for r in rs if k in r], f):>17}" for _, k, x, f in cols))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="nixl,mooncake")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--summary", metavar="JSONL")
    ap.add_argument("--nice", type=int, default=0,
                    help="raise the floor's engine threads' nice value (trio_pd's lanes: 10)")
    ap.add_argument("--warm", action="store_true",
                    help="the floor writes one aux row to each peer before its window")
    ap.add_argument("--lean", action="store_true",
                    help="every page allocator without its sanitizer (floor and trio_pd)")
    ns = ap.parse_args()
    if ns.summary:
        summary(ns.summary)
        sys.exit(0)
    main(ns.engines.split(","), ns.rounds, ns.modes.split(","), ns.lean, ns.nice, ns.warm)
