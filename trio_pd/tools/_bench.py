"""``trio-pd bench``: trio_pd against the bare engine, on the same machine and the same blocks.

Phases, all in one process with one prefill and one decode rank on loopback:

1. **ceiling**: the blocks trio_pd's planner produces for the workload (``plan_pages``, plus
   ``plan_aux`` on the last chunk, exactly as the prefill agent plans them), at both call
   sizes the agent uses: one engine call per chunk, and one per group of chunks a backlog
   coalesces (``coalesce_pages``). Pushed by plain threads with no trio_pd in the way:
   blocking ``engine.write`` calls from 1 and from 2 threads, and (engines with ``submit``)
   one thread keeping two writes in flight, as a lane does. The best of these counts.
2. **trio_pd**: the same requests end to end through ``open_prefill`` / ``open_decode``
   (bootstrap done by a warm-up request), ``concurrency`` requests in flight, chunked. The
   ceiling's runs and trio_pd's alternate: ``ceiling_repeats`` rounds of one run of each
   ceiling mode, then one timed trio_pd run, the best of each counting, so that both sides
   of the ratio sample the same minutes of a shared box. A trio_pd run is timed from the
   first receiver to the last decode Success, and the event loop's thread CPU time is taken
   over it. Each round then runs the load once more with a 1 ms periodic trio task that
   measures how late the event loop wakes it; that run is not timed, because the probe's own
   wake-ups cost the loop CPU. Every destination byte (and aux row) of every run is verified
   *after* its timed region.
3. **aborts under load**: the same load again plus requests that decode aborts mid-transfer,
   abort → ``on_release`` latency: each abort request starting at a random moment of the
   running load (steady state: the target's figure), then all of them starting together with
   the load (a start burst: reported beside it).
4. **overhead per chunk**: 1-page requests of a tiny pool, one at a time: ``send`` → prefill
   Success, minus the engine's own time for that very write (timed around the engine call on
   the lane's thread, by a wrapper around the prefill engine). Beside it, the same samples
   minus a direct call's time measured back to back (``overhead_vs_direct_us``): an isolated
   call costs the engine more than one of a tight loop (its threads have gone to sleep), so
   that figure charges the difference to trio_pd.
5. **scale**: N concurrent rooms (tiny pages): bookkeeping memory per room (tracemalloc growth
   from creating N receivers + senders until every room is bootstrapped, over N), then the
   time to move them all.

6. **facades**: the same requests through the trio API, the thread facade and the asyncio
   facade, alternated: process CPU per request of each (:mod:`trio_pd.tools._bench_facades`).

``--preset peer`` runs none of these but one workload with prefill and decode in separate OS
processes (:func:`run_peer`, through the demo's ``--processes`` runner).

``device="cuda"`` (``--device cuda``) puts every pool of every phase, KV buffers and aux
buffer, on CUDA device 0, built by the demo's :func:`~trio_pd.tools._demo.make_pool` (the TP and
peer phases through the demo's own runners, with the same option): the ceiling's bare
engines then move device memory too, and the verification reads the pages back from the
device. The demo's check refuses it, saying why, where that cannot run.
"""

from __future__ import annotations

import gc
import math
import os
import random
import secrets
import threading
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt
import trio

from ..agents._decode import DecodeAgent, DecodeConfig, open_decode
from ..agents._prefill import PrefillAgent, PrefillConfig, open_prefill
from ..bootstrap._bootstrap import open_bootstrap_server
from ..core._errors import AdmissionClosed
from ..core._memory import PoolSpec, read_aux_stamp
from ..core._plan import Blocks, chunk_ranges, concat, plan_aux, plan_pages, total_bytes
from ..core._state import TERMINAL, KVPoll
from ..engines import Deferred, Pending, TransferEngine, join_bytes, make_engine, start_write
from ._bench_layers import LayerBenchOptions, run_layerwise

if TYPE_CHECKING:
    from ._demo import DemoOptions, DemoPool

Progress = Callable[[str], None]

#: ratio (trio_pd / ceiling) targets, >=, by engine
RATIO_TARGETS = {"mooncake": 0.95, "nixl": 0.9}
TARGETS = {
    "loop_cpu_us_per_request": 250.0,  # <=
    "overhead_us_p50": 300.0,  # <=
    "loop_lateness_ms_p99": 5.0,  # <=
    "abort_release_ms_p99": 10.0,  # <=
    "bytes_per_room_10k": 4096.0,  # <=
    "tp_mismatch_ratio": 0.7,  # >=
    "facade_over_trio_us": 300.0,  # <= (CPU per request, each facade over the trio API)
}

LOOP_CPU = TARGETS["loop_cpu_us_per_request"]


def _ratio_target(engine: str) -> float:
    return RATIO_TARGETS.get(engine, 0.9)


@dataclass(frozen=True)
class BenchOptions:
    engine: str = "mooncake"
    # the big pool: MHA, 16 tokens x 8 heads x 256 B = 32 KiB per page per buffer
    page_size: int = 16
    kv_heads: int = 8
    head_bytes: int = 256
    layers: int = 2
    request_pages: int = 64
    chunk_pages: int = 16
    total_mib: int = 256
    concurrency: int = 16
    ceiling_threads: tuple[int, ...] = (1, 2)
    ceiling_repeats: int = 5  # runs per ceiling mode, and of trio_pd: the best counts
    abort_requests: int = 16
    overhead_samples: int = 400
    scale_rooms: tuple[int, ...] = (100, 1000, 10_000)
    scale_pages: int = 2  # pages per room in the scale phase, sent one page per chunk
    #: the prefill agent's ``coalesce_pages`` (its default): chunks a backlog joins into one
    #: engine call, up to this many pages
    coalesce_pages: int = PrefillConfig().coalesce_pages
    #: the prefill agent's ``batch_blocks`` (its default): chunk writes of several rooms
    #: queued for the same decode peer join one engine call, up to this many blocks
    batch_blocks: int = PrefillConfig().batch_blocks
    seed: int = 0
    #: authentication on (CURVE control plane, a cluster token; docs/security.md)
    secure: bool = True
    #: "default": the phases above; "peer": only the peer preset (:func:`run_peer`)
    preset: str = "default"
    #: where every phase's KV pools and aux buffers live: host memory, or CUDA device 0
    #: (:func:`trio_pd.tools._demo.make_pool`, as the demo's ``--device``)
    device: Literal["host", "cuda"] = "host"
    #: the layer-wise phase (:mod:`trio_pd.tools._bench_layers`): model layers, pages per request,
    #: simulated compute per layer (ms), and rounds of one request of each mode, alternated
    layer_layers: int = 8
    layer_pages: int = 32
    layer_compute_ms: float = 4.0
    layer_rounds: int = 10
    #: the peer preset's decode landing area (``DecodeConfig.landing_bytes``; 0: none)
    landing_bytes: int = 0

    @classmethod
    def quick(cls, engine: str = "mooncake") -> BenchOptions:
        return cls(
            engine=engine, total_mib=16, concurrency=8, ceiling_repeats=1, abort_requests=4,
            overhead_samples=60, scale_rooms=(50, 200), layer_layers=4, layer_pages=8,
            layer_compute_ms=2.0, layer_rounds=2,
        )

    @property
    def layer_options(self) -> LayerBenchOptions:
        """The layer-wise phase's options."""
        return LayerBenchOptions(
            engine=self.engine, layers=self.layer_layers, pages=self.layer_pages,
            compute_ms=self.layer_compute_ms, rounds=self.layer_rounds, secure=self.secure,
            seed=self.seed, device=self.device,
        )

    @classmethod
    def peer(cls, engine: str = "mooncake", *, quick: bool = False) -> BenchOptions:
        """``--preset peer``: 200 requests (20 with ``quick``) of 32 pages, 16 KiB per page
        per buffer (16 tokens x 8 heads x 128 B), 8 layers (K and V: 16 buffers), 8-page
        chunks, 8 requests in flight, a random page layout on both sides; prefill and decode
        in separate OS processes (:func:`run_peer`)."""
        o = cls(engine=engine, preset="peer", head_bytes=128, layers=8, request_pages=32,
                chunk_pages=8, concurrency=8)
        return replace(o, total_mib=(20 if quick else 200) * o.request_bytes >> 20)

    def option_problem(self) -> str | None:
        """What makes these options unusable (the CLI refuses them before anything starts)."""
        if self.preset == "peer":
            return peer_demo_options(self).option_problem()
        if self.preset not in ("default", "layers"):
            return f"--preset must be peer or layers (or left out), got {self.preset!r}"
        from ._demo import DemoOptions

        # the demo's own refusals: the engine's module, and for device memory cuda-python,
        # the device and an engine build that moves it
        demo = DemoOptions(engine=self.engine, device=self.device)
        return demo.engine_problem() or demo._device_problem()

    @property
    def num_buffers(self) -> int:
        return 2 * self.layers

    @property
    def item_len(self) -> int:
        return self.page_size * self.kv_heads * self.head_bytes

    @property
    def request_bytes(self) -> int:
        return self.request_pages * self.num_buffers * self.item_len

    @property
    def coalesced_pages(self) -> int:
        """The pages of one engine call when a request's chunks all wait in the queue."""
        group = max(1, self.coalesce_pages // self.chunk_pages) * self.chunk_pages
        return min(group, self.request_pages)

    @property
    def load_requests(self) -> int:
        return max(1, (self.total_mib << 20) // self.request_bytes)

    @property
    def scale_max(self) -> int:
        return max(self.scale_rooms, default=1)


# the tiny pool of the overhead and scale phases: 16 tokens x 1 head x 16 B = 256 B per page
SMALL = dict(page_size=16, kv_heads=1, head_bytes=16, layers=1)


@dataclass
class _Req:
    room: int
    epoch: int
    src_pages: npt.NDArray[np.int64]
    dst_pages: npt.NDArray[np.int64]
    src_aux: int
    dst_aux: int


@dataclass
class _Setup:
    opts: BenchOptions
    src: DemoPool
    dst: DemoPool
    small_src: DemoPool
    small_dst: DemoPool
    load: list[_Req]
    aborts: list[_Req]
    warm: _Req
    rng: random.Random
    results: dict[str, Any] = field(default_factory=dict)


def _pct(values: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), p)) if values else math.nan


def _p(values: list[float], scale: float = 1.0, nd: int = 3) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": round(_pct(values, 50) * scale, nd), "p99": round(_pct(values, 99) * scale, nd)}


def _pool(opts: BenchOptions, pages: int, aux_slots: int, **kw: int) -> DemoPool:
    """A pool of the bench, in host memory or on the device (``opts.device``), by the
    demo's :func:`~trio_pd.tools._demo.make_pool`."""
    from ._demo import make_pool

    o = replace(opts, **kw)  # type: ignore[arg-type]
    return make_pool(
        opts.device, layout="mha", num_pages=pages, num_layers=o.layers,
        page_size=o.page_size, head_bytes=o.head_bytes, heads=o.kv_heads, first_head=0,
        aux_slots=aux_slots,
    )


def _wipe(pool: DemoPool) -> None:
    """Every KV byte and aux row of ``pool`` to zero (one fill each, on the device too)."""
    pool.page_rows().poison(None, 0)
    pool.aux_rows().poison(None, 0)


def _close_pools(pools: list[DemoPool]) -> None:
    """Free the pools (a device pool's memory), once no engine has them registered."""
    for pool in pools:
        pool.close()


def _setup(opts: BenchOptions) -> _Setup:
    pools: list[DemoPool] = []
    try:
        return _setup_in(opts, pools)
    except BaseException:
        _close_pools(pools)
        raise


def _setup_in(opts: BenchOptions, pools: list[DemoPool]) -> _Setup:
    rng = random.Random(opts.seed)
    n_load, n_abort = opts.load_requests, opts.abort_requests
    slots = n_load + n_abort + 1
    p = opts.request_pages
    src = _pool(opts, slots * p, slots)
    pools.append(src)
    dst = _pool(opts, slots * p, slots)
    pools.append(dst)
    # destination slots in another order than the source ones: addresses differ on each side
    order = list(range(slots))
    rng.shuffle(order)
    rooms = rng.sample(range(1, 1 << 40), slots)
    reqs = [
        _Req(
            rooms[i], rng.getrandbits(62),
            np.arange(i * p, (i + 1) * p, dtype=np.int64),
            np.arange(order[i] * p, (order[i] + 1) * p, dtype=np.int64), i, order[i],
        )
        for i in range(slots)
    ]
    for r in reqs:
        src.fill(r.src_pages, r.room)
        src.fill_aux(r.src_aux, r.room)
    small_pages = max(opts.scale_max * opts.scale_pages, 64)
    small_src = _pool(opts, small_pages, opts.scale_max + 1, **SMALL)
    pools.append(small_src)
    small_dst = _pool(opts, small_pages, opts.scale_max + 1, **SMALL)
    pools.append(small_dst)
    return _Setup(
        opts, src, dst, small_src, small_dst, reqs[:n_load], reqs[n_load:-1], reqs[-1], rng
    )


def plan_request(src: PoolSpec, dst: PoolSpec, req: _Req, chunk_pages: int) -> list[Blocks]:
    """The blocks of each chunk of ``req``, exactly as the prefill agent plans them (P == D:
    whole pages, all heads), aux row with the last chunk."""
    heads = (src.first_head, src.first_head + src.heads)
    ranges = chunk_ranges(len(req.src_pages), chunk_pages)
    out = []
    for i, (a, b) in enumerate(ranges):
        parts = [plan_pages(src, dst, req.src_pages[a:b], req.dst_pages[a:b], heads=heads)]
        if i == len(ranges) - 1:
            parts.append(plan_aux(src, dst, req.src_aux, req.dst_aux))
        out.append(concat(parts))
    return out


# ---------------------------------------------------------------------------- the ceiling


def _engine_pair(s: _Setup) -> tuple[TransferEngine, TransferEngine]:
    a, b = make_engine(s.opts.engine), make_engine(s.opts.engine)
    a.register(s.src.spec.regions() + s.small_src.spec.regions())
    b.register(s.dst.spec.regions() + s.small_dst.spec.regions())
    a.add_peer(b.session_id, b.metadata())
    return a, b


class _Ceiling:
    """The bare engine pair, the blocks of the whole load, and the best time of each way of
    pushing them from plain threads (no trio_pd). The blocks come at both granularities the
    prefill agent may use: one engine call per chunk, and one per group of chunks that a
    backlog coalesces (``PrefillConfig.coalesce_pages``), so the ceiling is the better of the
    two whichever the agent made; and, where the engine joins writes of several rooms into one
    call (:func:`~trio_pd.engines.join_bytes`, ``PrefillConfig.batch_blocks``), the coalesced
    calls of consecutive requests joined as the lane would join them. It stays open through
    the trio_pd runs, whose repeats it alternates with (idle Mooncake engines use no CPU), so
    that both sides of the ratio sample the same minutes of a shared box."""

    def __init__(self, s: _Setup) -> None:
        opts = s.opts
        per_call = {"per chunk": opts.chunk_pages, "coalesced": opts.coalesced_pages}
        if per_call["coalesced"] == opts.chunk_pages:
            del per_call["coalesced"]
        self.calls = {
            name: [blk for r in s.load for blk in plan_request(s.src.spec, s.dst.spec, r, n)]
            for name, n in per_call.items()
        }
        self.a, self.b = _engine_pair(s)
        coarsest = self.calls[list(per_call)[-1]]
        joined = _joined(coarsest, opts.batch_blocks, join_bytes(self.a))
        if len(joined) < len(coarsest):
            self.calls["joined"] = joined
        sizes = {sum(total_bytes(b) for b in calls) for calls in self.calls.values()}
        assert len(sizes) == 1, "every granularity moves the same bytes"
        self.nbytes = sizes.pop()
        self.peer = self.b.session_id
        pushes: dict[str, Callable[[TransferEngine, str, list[Blocks]], float]] = {
            f"write x{n}": partial(_push, threads=n) for n in opts.ceiling_threads
        }
        if hasattr(self.a, "submit"):
            pushes["pipelined x1"] = _push_pipelined
        self.modes = {
            f"{push}, {gran}": (fn, calls)
            for gran, calls in self.calls.items() for push, fn in pushes.items()
        }
        self.best = dict.fromkeys(self.modes, math.inf)

    def run_all(self) -> None:
        """Push the whole load once in each mode (blocking: call it from a thread)."""
        for name, (push, calls) in self.modes.items():
            self.best[name] = min(self.best[name], push(self.a, self.peer, calls))

    def gbps(self) -> dict[str, float]:
        return {name: round(self.nbytes / t / 1e9, 3) for name, t in self.best.items()}

    def close(self) -> None:
        self.a.close()
        self.b.close()


def _joined(calls: list[Blocks], max_blocks: int, max_bytes: int) -> list[Blocks]:
    """``calls`` joined in order as a lane joins queued writes (``trio_pd/io/_lane.py``): each
    takes the calls behind it while the group stays within ``max_blocks`` blocks and
    ``max_bytes`` bytes."""
    out: list[Blocks] = []
    group: list[Blocks] = []
    blocks = nbytes = 0
    for call in calls:
        n, size = call.num_blocks, total_bytes(call)
        if group and (blocks + n > max_blocks or nbytes + size > max_bytes):
            out.append(concat(group))
            group, blocks, nbytes = [], 0, 0
        group.append(call)
        blocks += n
        nbytes += size
    if group:
        out.append(concat(group))
    return out


def open_ceiling(s: _Setup, progress: Progress) -> _Ceiling:
    """Open the ceiling's engines, warm them, and time the engine's own call for the blocks
    of a 1-page chunk of the tiny pool (back to back, and 1 ms apart)."""
    opts = s.opts
    c = _Ceiling(s)
    try:
        first = c.calls["per chunk"][0]
        c.a.write(c.peer, first.src, first.dst, first.lens)  # the first call opens the segment
        small = s.small_src.spec, s.small_dst.spec
        one = _Req(0, 0, np.array([0]), np.array([0]), 0, 0)
        blk = plan_request(*small, one, 1)[0]
        engine_us: list[float] = []
        isolated_us: list[float] = []  # 1 ms apart, as the overhead phase's calls are
        for gap, out in ((0.0, engine_us), (0.001, isolated_us)):
            for _ in range(max(opts.overhead_samples, 50)):
                time.sleep(gap)
                t = time.perf_counter()
                c.a.write(c.peer, blk.src, blk.dst, blk.lens)
                out.append((time.perf_counter() - t) * 1e6)
    except BaseException:
        c.close()
        raise
    _wipe(s.small_dst)
    s.results.update(
        ceiling_calls={k: len(v) for k, v in c.calls.items()},
        ceiling_blocks={k: sum(b.num_blocks for b in v) for k, v in c.calls.items()},
        bytes=c.nbytes, engine_call_us=_p(engine_us, nd=1),
        engine_call_isolated_us=_p(isolated_us, nd=1),
    )
    progress("ceiling")
    return c


def _ceiling_results(s: _Setup, c: _Ceiling) -> None:
    per_mode = c.gbps()
    top = max(per_mode, key=lambda k: per_mode[k])
    s.results.update(ceiling_gbps=per_mode[top], ceiling_mode=top, ceiling_gbps_by_mode=per_mode)


def _push_pipelined(
    engine: TransferEngine, peer: str, calls: list[Blocks], depth: int = 2
) -> float:
    """One thread, ``depth`` writes started ahead of the one it waits for: what a lane does."""
    flying: deque[Pending] = deque()
    start = time.perf_counter()
    for blk in calls:
        if len(flying) == depth:
            flying.popleft().wait()
        flying.append(start_write(engine, peer, blk.src, blk.dst, blk.lens))
    while flying:
        flying.popleft().wait()
    return time.perf_counter() - start


def _push(engine: TransferEngine, peer: str, calls: list[Blocks], threads: int) -> float:
    it: Iterator[Blocks] = iter(calls)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                blk = next(it, None)
            if blk is None:
                return
            engine.write(peer, blk.src, blk.dst, blk.lens)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(worker) for _ in range(threads)]:
            f.result()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------- trio_pd


class _TimedEngine:
    """An engine that times each write it makes, from the call that starts it to the return
    of its wait, on the thread that makes it (a lane's): the engine's own time for exactly
    the calls trio_pd made. Everything else is the wrapped engine's."""

    def __init__(self, inner: TransferEngine) -> None:
        self._inner = inner
        self.seconds: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write(self, peer: str, src: Any, dst: Any, lens: Any) -> None:
        self.submit(peer, src, dst, lens).wait()

    def submit(self, peer: str, src: Any, dst: Any, lens: Any) -> Pending:
        start = time.perf_counter()
        pending = start_write(self._inner, peer, src, dst, lens)

        def finish() -> None:
            try:
                pending.wait()
            finally:
                self.seconds.append(time.perf_counter() - start)

        return Deferred(finish)


@dataclass
class _Pair:
    prefill: PrefillAgent
    decode: DecodeAgent
    url: str
    timed: _TimedEngine | None = None  # the prefill engine, when timed


async def _open_pair(
    stack: AsyncExitStack, opts: BenchOptions, src: DemoPool, dst: DemoPool, *,
    timed: bool = False,
) -> _Pair:
    token = secrets.token_urlsafe(24) if opts.secure else None
    auth: dict[str, Any] = {"token": token, "secure": opts.secure}
    server = await stack.enter_async_context(open_bootstrap_server(**auth))
    pre_engine, dec_engine = make_engine(opts.engine), make_engine(opts.engine)
    stack.callback(dec_engine.close)  # closed last, once no agent moves bytes
    stack.callback(pre_engine.close)
    clock = _TimedEngine(pre_engine) if timed else None
    prefill = await stack.enter_async_context(open_prefill(
        engine=clock or pre_engine, pool=src.spec, bootstrap_url=server.url,
        kv_heads=src.spec.heads,
        config=PrefillConfig(bootstrap_timeout=900.0, coalesce_pages=opts.coalesce_pages,
                             batch_blocks=opts.batch_blocks),
        **auth,
    ))
    decode = await stack.enter_async_context(open_decode(
        # 10,000 rooms bootstrapping under tracemalloc take minutes: no deadline may fire
        engine=dec_engine, pool=dst.spec, config=DecodeConfig(waiting_timeout=900.0), **auth,
    ))
    return _Pair(prefill, decode, server.url, clock)


async def _request(
    pair: _Pair, req: _Req, chunk_pages: int, *, abort_after: float | None = None,
    release_ms: list[float] | None = None,
) -> KVPoll:
    """One request end to end; ``abort_after``: decode aborts it that many seconds in."""
    aborted_at: list[float] = []
    released = trio.Event()

    def on_release() -> None:
        if aborted_at and release_ms is not None:
            release_ms.append((time.perf_counter() - aborted_at[0]) * 1e3)
        released.set()

    rx = pair.decode.receiver(req.room, bootstrap_url=pair.url, epoch=req.epoch)
    rx.init(req.dst_pages, req.dst_aux, on_release=on_release)
    tx = pair.prefill.sender(
        req.room, num_pages=len(req.src_pages), aux_slot=req.src_aux, epoch=req.epoch
    )
    ranges = chunk_ranges(len(req.src_pages), chunk_pages)
    for i, (a, b) in enumerate(ranges):
        tx.send(req.src_pages[a:b], last=i == len(ranges) - 1)
    if abort_after is not None:
        await trio.sleep(abort_after)
        if rx.poll() is not KVPoll.Success:
            aborted_at.append(time.perf_counter())
            rx.abort("bench: abort under load")
    status = await rx.wait()
    if tx.poll() not in TERMINAL:  # (mostly terminal already)
        await tx.wait()
    if status is not KVPoll.Success:
        await released.wait()
        await tx.wait_released()
    return status


async def _load(pair: _Pair, reqs: list[_Req], opts: BenchOptions) -> tuple[float, int]:
    """Every request of ``reqs``, ``concurrency`` at a time; (seconds, failures).

    ``concurrency`` client tasks each take the next request when their last one is done, as
    a frontend's in-flight slots would: the loop's CPU per request then counts the agents'
    work and a request's own awaits, not a task start and a semaphore per request."""
    todo = iter(reqs)
    failures = 0

    async def client() -> None:  # noqa: ASYNC910 (a task)
        nonlocal failures
        for req in todo:
            if await _request(pair, req, opts.chunk_pages) is not KVPoll.Success:
                failures += 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(min(opts.concurrency, len(reqs))):
            nursery.start_soon(client)
    return time.perf_counter() - start, failures


async def _lateness_probe(out: list[float], period: float = 0.001) -> None:
    """Sleep ``period`` again and again; record how late each wake-up is (seconds)."""
    while True:
        due = trio.current_time() + period
        await trio.sleep_until(due)
        out.append(trio.current_time() - due)


def _fresh(reqs: list[_Req], rng: random.Random) -> list[_Req]:
    """The same pages under new room ids (a room id is used once per agent)."""
    return [replace(r, room=rng.randrange(1 << 41, 1 << 42), epoch=rng.getrandbits(62))
            for r in reqs]


def verify(s: _Setup, run: list[_Req] | None = None) -> tuple[int, int]:
    """Compare every destination page and aux row of the load with what prefill holds:
    (corrupt pages, verified bytes). ``run``: the load as it was sent (:func:`_fresh` room
    ids, whose stamps the aux rows carry); the page contents follow ``s.load``'s rooms."""
    corrupt = verified = 0
    for r, sent in zip(s.load, run or s.load, strict=True):
        got = s.dst.read(r.dst_pages)  # (a device pool's are copied to the host)
        want = s.src.expected(r.room, len(r.dst_pages))
        bad = ~(got == want).reshape(got.shape[0], len(r.dst_pages), -1).all(axis=(0, 2))
        corrupt += int(bad.sum())
        stamp = read_aux_stamp(s.dst.spec, r.dst_aux)
        if stamp != (sent.room, sent.epoch) or not s.dst.aux_ok(r.dst_aux, r.room):
            corrupt += 1
        verified += int(got.nbytes)
    return corrupt, verified


async def run_trio_pd(s: _Setup, ceiling: _Ceiling, progress: Progress) -> None:
    opts = s.opts
    # One pair of agents at a time: idle agents' tasks and threads would compete for the
    # cores with the measured ones (idle Mooncake engines do not: the ceiling's stay open).
    async with AsyncExitStack() as stack:
        big = await _open_pair(stack, opts, s.src, s.dst)
        # bootstrap + first-call handshakes, outside every timed region
        if await _request(big, s.warm, opts.chunk_pages) is not KVPoll.Success:
            raise RuntimeError("the warm-up request failed")

        # --- throughput + loop lateness: ``ceiling_repeats`` rounds of one ceiling run per
        # mode, then trio_pd twice: a timed run (throughput, the loop's CPU), then a run with
        # the lateness probe. The probe stays out of the timed run: its 1 ms wake-ups cost
        # the loop ~120 ms of CPU a second here (160 us each when the loop is otherwise
        # idle), which would count as trio_pd's CPU and slow trio_pd's side of the ratio
        # alone. The best timed run counts (the same statistic on both sides of the ratio,
        # over the same minutes). Every trio_pd run's bytes are verified, the destination
        # wiped before each (the ceiling writes the same pages)
        late: list[float] = []
        runs: list[float] = []
        loop_cpu: list[float] = []  # CPU seconds of the event loop's thread, per timed run
        failures = corrupt = verified = 0
        for rep in range(opts.ceiling_repeats):
            await trio.to_thread.run_sync(ceiling.run_all)
            for probed in (False, True):
                reqs = s.load if rep == 0 and not probed else _fresh(s.load, s.rng)
                _wipe(s.dst)
                async with trio.open_nursery() as nursery:
                    if probed:
                        nursery.start_soon(_lateness_probe, late)
                    cpu = time.thread_time()  # (this task runs on the loop's thread)
                    seconds, failed = await _load(big, reqs, opts)
                    cpu = time.thread_time() - cpu
                    nursery.cancel_scope.cancel()
                if not probed:
                    runs.append(seconds)
                    loop_cpu.append(cpu)
                bad, checked = verify(s, reqs)
                failures, corrupt, verified = failures + failed, corrupt + bad, verified + checked
        _ceiling_results(s, ceiling)
        ceiling.close()  # (Mooncake's close holds the GIL ~1 s: now, between timed phases)
        nbytes = s.results["bytes"]
        seconds = min(runs)
        s.results.update(
            trio_pd_gbps=round(nbytes / seconds / 1e9, 3), trio_pd_seconds=round(seconds, 4),
            trio_pd_gbps_runs=[round(nbytes / x / 1e9, 3) for x in runs],
            requests=len(s.load), failed=failures, corrupt_pages=corrupt,
            verified_bytes=verified, loop_lateness_ms=_p(late, 1e3), loop_samples=len(late),
            # both agents' work on the one loop (and the bench's request driver), in the
            # least busy timed run: what the loop pays per request, engines' threads excluded
            loop_cpu_us_per_request=round(min(loop_cpu) / len(s.load) * 1e6, 1),
            loop_cpu_us_per_mib=round(min(loop_cpu) / (nbytes / 2**20) * 1e6, 1),
        )
        s.results["ratio"] = round(s.results["trio_pd_gbps"] / s.results["ceiling_gbps"], 3)
        progress("trio_pd")

        # --- aborts under load: in steady state (each abort request starts at a random
        # moment of a running load, then is aborted 0.5-4 ms in), then in a start burst
        # (all of them at once with the load's first requests: a thundering herd)
        release_ms: list[float] = []
        burst_ms: list[float] = []
        span = s.results["trio_pd_seconds"]
        for out, spread in ((release_ms, (0.1, 0.8)), (burst_ms, (0.0, 0.0))):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_load, big, _fresh(s.load, s.rng), opts)
                for req in _fresh(s.aborts, s.rng):
                    nursery.start_soon(partial_request(
                        big, req, opts.chunk_pages, s.rng.uniform(0.0005, 0.004), out,
                        start_after=s.rng.uniform(*spread) * span,
                    ))
        s.results.update(
            abort_release_ms=_p(release_ms), abort_samples=len(release_ms),
            abort_release_burst_ms=_p(burst_ms), abort_burst_samples=len(burst_ms),
        )
        progress("aborts")

    async with AsyncExitStack() as stack:
        small = await _open_pair(stack, opts, s.small_src, s.small_dst, timed=True)
        await _overhead_request(small, s, 0, 0)  # bootstrap + handshake, not timed

        # --- overhead per chunk: each sample minus the engine's time for its own write
        assert small.timed is not None
        chunk_us, in_run_us = [], []
        for i in range(opts.overhead_samples):
            small.timed.seconds.clear()
            chunk_us.append(await _overhead_request(small, s, i + 1, i % 64))
            (seconds,) = small.timed.seconds  # one write per 1-page request
            in_run_us.append(seconds * 1e6)
        direct_p50 = s.results["engine_call_us"]["p50"]
        s.results.update(
            trio_pd_chunk_us=_p(chunk_us, nd=1),
            engine_call_in_run_us=_p(in_run_us, nd=1),
            overhead_us=_p([u - e for u, e in zip(chunk_us, in_run_us, strict=True)], nd=1),
            overhead_vs_direct_us=_p([u - direct_p50 for u in chunk_us], nd=1),
        )
        progress("overhead")

        # --- scale
        scale = []
        for n in opts.scale_rooms:
            scale.append(await _scale(small, s, n))
            progress(f"scale {n}")
        s.results["scale"] = scale


def partial_request(
    pair: _Pair, req: _Req, chunk_pages: int, after: float, release_ms: list[float],
    *, start_after: float = 0.0,
) -> Callable[[], Any]:
    async def run() -> None:
        await trio.sleep(start_after)
        await _request(pair, req, chunk_pages, abort_after=after, release_ms=release_ms)

    return run


async def _overhead_request(pair: _Pair, s: _Setup, i: int, page: int) -> float:
    """A 1-page request, bootstrapped first; µs from ``send`` to the prefill's Success."""
    room = (1 << 43) + i
    pages = np.array([page], dtype=np.int64)
    rx = pair.decode.receiver(room, bootstrap_url=pair.url, epoch=i)
    rx.init(pages, 0)
    tx = pair.prefill.sender(room, num_pages=1, aux_slot=0)
    # no public event for "bootstrapped": poll
    while tx.poll() < KVPoll.WaitingForInput:  # noqa: ASYNC110
        await trio.sleep(0.0002)
    start = time.perf_counter()
    tx.send(pages, last=True)
    status = await tx.wait()
    took = (time.perf_counter() - start) * 1e6
    if status is not KVPoll.Success or await rx.wait() is not KVPoll.Success:
        raise RuntimeError(f"overhead request {i} failed")
    return took


async def _scale(pair: _Pair, s: _Setup, n: int) -> dict[str, Any]:
    """``n`` concurrent rooms of ``scale_pages`` tiny pages: memory while all are
    bootstrapped, then the time to move them all (one page per chunk)."""
    k = s.opts.scale_pages
    base_room = (1 << 44) + n * 1_000_000
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    rxs, txs = [], []
    for i in range(n):
        pages = np.arange(i * k, (i + 1) * k, dtype=np.int64)
        rx = pair.decode.receiver(base_room + i, bootstrap_url=pair.url, epoch=i)
        rx.init(pages, i)
        rxs.append(rx)
        txs.append(pair.prefill.sender(base_room + i, num_pages=k, aux_slot=i))
    # bootstrapped: WaitingForInput, or Failed (e.g. a control socket full); bounded
    with trio.move_on_after(60):
        await trio.lowlevel.checkpoint()
        while any(tx.poll() is KVPoll.Bootstrapping for tx in txs):  # noqa: ASYNC110
            await trio.sleep(0.005)
    stuck = sum(tx.poll() is KVPoll.Bootstrapping for tx in txs)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    start = time.perf_counter()
    for i, tx in enumerate(txs):
        try:
            for j in range(k):
                tx.send(np.array([i * k + j], dtype=np.int64), last=j == k - 1)
        except AdmissionClosed:
            pass  # the room already failed (counted below)
    failed = 0
    with trio.move_on_after(120):
        await trio.lowlevel.checkpoint()
        for rx in rxs:
            failed += await rx.wait() is not KVPoll.Success
    failed += sum(rx.poll() not in (KVPoll.Success, KVPoll.Failed) for rx in rxs)
    seconds = time.perf_counter() - start
    with trio.move_on_after(60):
        await trio.lowlevel.checkpoint()
        for tx in txs:
            await tx.wait()
    nbytes = n * k * s.small_src.spec.num_buffers * s.small_src.spec.item_len
    return {
        "rooms": n, "gbps": round(nbytes / seconds / 1e9, 4), "seconds": round(seconds, 4),
        "chunks_per_s": round(n * k / seconds), "bytes_per_room": round(grown / n),
        "failed": failed, "not_bootstrapped": stuck,
        "prefill_stats": _stats(pair.prefill.statistics()),
        "decode_stats": _stats(pair.decode.statistics()),
    }


def _stats(st: Any) -> dict[str, int]:
    keys = ("failed", "timeouts", "send_backpressure", "refused_messages", "bad_messages")
    return {k: int(getattr(st, k)) for k in keys}


# ---------------------------------------------------------------------------- the peer preset


def peer_demo_options(opts: BenchOptions) -> DemoOptions:
    """The peer preset's workload as the demo's options: every request exactly
    ``request_pages`` pages, pages handed out in a random order on both sides."""
    from ._demo import DemoOptions

    tokens = opts.request_pages * opts.page_size
    return DemoOptions(
        requests=opts.load_requests, concurrency=opts.concurrency, page_size=opts.page_size,
        layers=opts.layers, kv_heads=opts.kv_heads, head_bytes=opts.head_bytes,
        min_tokens=tokens, max_tokens=tokens, chunk_pages=opts.chunk_pages, engine=opts.engine,
        seed=opts.seed, secure=opts.secure, random_pages=True, device=opts.device,
        landing_bytes=opts.landing_bytes,
    )


def _peer_bound(requests: int) -> float:
    """Seconds the whole peer run may take (process start-up included) before it is stopped
    and its processes killed."""
    return 120.0 + 2.0 * requests


def run_peer(opts: BenchOptions, progress: Progress = lambda _: None) -> dict[str, Any]:
    """The peer preset: the bootstrap service, one prefill rank and one decode rank as three
    OS processes (the demo's ``--processes`` runner, :func:`trio_pd.tools._demo.run_processes`),
    on a real engine over loopback. Decode verifies every Success byte for byte (and its aux
    row); every allocator is checked for late writes and leaks. Throughput and requests/s
    over the requests' in-flight time (the union of decode's ``init`` -> Success
    intervals), request latency over the same intervals, and each rank process's own CPU
    time (every thread, ``time.process_time()`` while it ran its requests) per request,
    with the part its event loop spent filling (prefill) or verifying (decode) pages and in
    the page allocator's sanitizer (poisoning freed pages, checking the poison)."""
    from ._demo import RANK_COUNTERS, check, run_processes

    d = peer_demo_options(opts)
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        progress(f"peer {done}")

    async def bounded() -> dict[str, Any]:
        with trio.fail_after(_peer_bound(d.requests)):
            summary: dict[str, Any] = await run_processes(d, tick)
            return summary

    summary = trio.run(bounded)
    n = summary["requests"]
    seconds = summary["transfer_seconds"]
    verified, rest = divmod(summary["bytes"], opts.request_bytes)
    found = check(d, summary)
    if rest or verified != n:
        found.append(f"verified {verified} requests ({summary['bytes']} bytes) of {n}")

    def process(role: str) -> dict[str, Any]:
        (rank,) = [x for x in summary["ranks"] if x["role"] == role]
        return {
            "pid": rank["pid"], "cpu_seconds": rank["cpu_seconds"],
            "cpu_ms_per_request": round(rank["cpu_seconds"] / n * 1e3, 3),
            "harness_ms_per_request": round(rank["harness_cpu_seconds"] / n * 1e3, 3),
            **{k: rank.get(k, 0) for k in RANK_COUNTERS},
        }

    peer = {
        "workload": {
            "requests": n, "pages": opts.request_pages, "item_bytes": opts.item_len,
            "buffers": opts.num_buffers, "request_bytes": opts.request_bytes,
            "chunk_pages": opts.chunk_pages, "concurrency": opts.concurrency,
            "page_layout": "random, both sides", "engine": opts.engine,
            "landing_bytes": opts.landing_bytes,
        },
        "gbps": summary["transfer_gbps"],
        "requests_per_s": round(summary["succeeded"] / seconds, 1) if seconds > 0 else 0.0,
        "seconds": seconds, "wall_seconds": summary["seconds"],
        "request_ms": summary["request_ms"],
        "prefill": process("prefill"), "decode": process("decode"), "bench_pid": os.getpid(),
        "verified_requests": verified, "verified_bytes": summary["bytes"],
        **{k: summary[k] for k in (
            "requests", "succeeded", "failed", "corrupt_pages", "source_uaf_pages",
            "late_writes", "leaked_pages", "hung", "released_by_timeout", "engine_errors",
        )},
        "problems": found,
    }
    return {"preset": "peer", "peer": peer, "options": asdict(opts)}


# ---------------------------------------------------------------------------- the whole bench


def _until(pred: Callable[[], bool], bound: float = 10.0) -> None:
    """Poll ``pred`` every 50 µs (a scheduler's step) until true; RuntimeError after ``bound``."""
    end = time.perf_counter() + bound
    while not pred():
        if time.perf_counter() > end:
            raise RuntimeError("the facade phase waited too long")
        time.sleep(50e-6)


def _past(handle: Any, state: KVPoll) -> bool:
    return bool(handle.poll() is not state)


def _ended(handle: Any) -> bool:
    return handle.poll() in (KVPoll.Success, KVPoll.Failed)


def run_facade(s: _Setup, progress: Progress) -> None:
    """The thread facade (:mod:`trio_pd.sync`) from this plain thread, beside the trio API:
    one hop to the trio thread and back (``TrioThread.call``), a ``poll()``, and the same
    1-page requests as the overhead phase, from ``send`` to the prefill's Success as the
    scheduler thread sees it (polling every 50 µs)."""
    from .. import sync  # (not loaded by the trio phases)

    opts = s.opts
    hop_us: list[float] = []
    poll_us: list[float] = []
    request_us: list[float] = []
    with (
        make_engine(opts.engine) as pre_engine, make_engine(opts.engine) as dec_engine,
        sync.open_bootstrap_server() as boot,
        sync.open_prefill(engine=pre_engine, pool=s.small_src.spec, bootstrap_url=boot.url,
                          kv_heads=s.small_src.spec.heads,
                          config=PrefillConfig(bootstrap_timeout=900.0)) as prefill,
        sync.open_decode(engine=dec_engine, pool=s.small_dst.spec) as decode,
    ):
        for _ in range(max(opts.overhead_samples, 50)):
            t = time.perf_counter()
            prefill.thread.call(int)  # a no-op there and back
            hop_us.append((time.perf_counter() - t) * 1e6)
        for i in range(opts.overhead_samples + 1):  # the first one: bootstrap, not timed
            room = (1 << 44) + i
            pages = np.array([i % 64], dtype=np.int64)
            sender = prefill.sender(room, epoch=i)
            sender.init(1, 0)
            receiver = decode.receiver(room, bootstrap_url=boot.url, epoch=i)
            _until(partial(_past, receiver, KVPoll.Bootstrapping))
            receiver.init(pages, 0)
            time.sleep(0.002)  # (decode's TRANSFER reaches prefill)
            t = time.perf_counter()
            sender.send(pages, last=True)
            _until(partial(_ended, sender))
            took = (time.perf_counter() - t) * 1e6
            t = time.perf_counter()
            status = sender.poll()
            poll_us.append((time.perf_counter() - t) * 1e6)
            _until(partial(_ended, receiver))
            if status is not KVPoll.Success or receiver.poll() is not KVPoll.Success:
                raise RuntimeError(f"facade request {i} failed")
            if i:
                request_us.append(took)
            prefill.pop_released()
            decode.pop_released()
    chunk = _p(request_us, nd=1)
    s.results.update(
        facade_hop_us=_p(hop_us, nd=1), facade_poll_us=_p(poll_us, nd=2),
        facade_chunk_us=chunk,
        facade_chunk_vs_trio_us=round(chunk["p50"] - s.results["trio_pd_chunk_us"]["p50"], 1),
    )
    progress("facade")


def run_facades(s: _Setup, progress: Progress) -> None:
    """The same requests through the trio API, the thread facade and the asyncio facade,
    alternated (:mod:`trio_pd.tools._bench_facades` says what is measured and why)."""
    from ._bench_facades import FacadeWorkload, measure

    w = FacadeWorkload.quick() if s.opts.total_mib <= 16 else FacadeWorkload()
    s.results["facades"] = measure(lambda: make_engine(s.opts.engine), s.small_src.spec,
                                   s.small_dst.spec, w, progress)


def run_tp_mismatch(s: _Setup, progress: Progress) -> None:
    """The same bytes from one prefill rank to one decode rank, then to four (MHA, each
    decode rank holding a quarter of the heads: every token slot becomes a head slice, one
    block each), through the demo's verified in-process runner; the throughput over the
    requests' in-flight time, and the ratio TP 1->4 / TP 1->1."""
    from ._demo import DemoOptions, run_in_process

    opts = s.opts
    quick = opts.total_mib <= 16
    base = DemoOptions(
        requests=8 if quick else 64, concurrency=opts.concurrency, page_size=opts.page_size,
        layers=opts.layers, kv_heads=opts.kv_heads, head_bytes=opts.head_bytes,
        min_tokens=128 if quick else 512, max_tokens=128 if quick else 512,
        chunk_pages=opts.chunk_pages, engine=opts.engine, seed=opts.seed, device=opts.device,
    )
    out: dict[str, Any] = {"requests": base.requests, "tokens": base.max_tokens}
    if opts.device != "host":
        out["note"] = ("device pools: TP 1->4 writes every head slice in place, one block per "
                       "token slot (staged head slices gather host pools only)")
    for decode_tp in (1, 4):
        run = trio.run(run_in_process, replace(base, decode_tp=decode_tp))
        bad = [k for k in ("failed", "corrupt_pages", "late_writes", "leaked_pages", "hung")
               if run[k]]
        if bad or run["succeeded"] != base.requests:
            raise RuntimeError(f"tp mismatch phase, TP 1 -> {decode_tp}: {bad or run}")
        out[f"tp1_{decode_tp}_gbps"] = run["transfer_gbps"]
        out[f"tp1_{decode_tp}_seconds"] = run["transfer_seconds"]
        out["bytes"] = run["bytes"]
    out["ratio"] = round(out["tp1_4_gbps"] / out["tp1_1_gbps"], 3) if out["tp1_1_gbps"] else 0.0
    s.results["tp_mismatch"] = out
    progress("tp mismatch")


def run(opts: BenchOptions, progress: Progress = lambda _: None) -> dict[str, Any]:
    """Every phase (or the peer preset's one); returns the JSON-able summary."""
    if opts.preset == "peer":
        r = run_peer(opts, progress)
    elif opts.preset == "layers":
        r = {"preset": "layers", "options": asdict(opts), "layerwise": run_layerwise(
            opts.layer_options)}
        progress("layerwise")
        r["targets"] = targets_met(r)
    else:
        r = _run_phases(opts, progress)
    r["device"] = opts.device
    if opts.device == "cuda":
        from ._demo import DEMO_DEVICE

        r["device_index"] = DEMO_DEVICE
        r["device_name"] = device_name(DEMO_DEVICE)
    return r


def _run_phases(opts: BenchOptions, progress: Progress) -> dict[str, Any]:
    s = _setup(opts)
    try:
        ceiling = open_ceiling(s, progress)
        try:
            trio.run(run_trio_pd, s, ceiling, progress)
        finally:
            ceiling.close()
        run_facade(s, progress)
        run_facades(s, progress)
        run_tp_mismatch(s, progress)
        s.results["layerwise"] = run_layerwise(opts.layer_options)
        progress("layerwise")
    finally:  # every engine that had them registered is closed by now
        _close_pools([s.src, s.dst, s.small_src, s.small_dst])
    r = s.results
    r["options"] = asdict(opts)
    r["verified"] = "every destination page and aux row of the load, after the timed region"
    r["targets"] = targets_met(r)
    return r


def device_name(device: int) -> str | None:
    """CUDA device ``device``'s name (``cudaGetDeviceProperties``), or None where cuda-python
    cannot say."""
    from ..io import _cuda

    rt = _cuda.runtime()
    if rt is None:
        return None
    try:
        err, props = rt.cudaGetDeviceProperties(device)
        if err != rt.cudaError_t.cudaSuccess:
            return None
        name = props.name
        raw = name.encode() if isinstance(name, str) else bytes(name)
        return raw.split(b"\0")[0].decode(errors="replace")
    except Exception:
        return None


def phases(opts: BenchOptions) -> list[str]:
    """The progress bar's steps, each ended by one ``progress`` call of :func:`run` (the
    peer preset: one per request the decode process finished)."""
    if opts.preset == "peer":
        n = opts.load_requests
        return [f"peer: {i}/{n} requests (prefill, decode in own processes)" for i in range(n)]
    if opts.preset == "layers":
        return ["layerwise"]
    return ["ceiling", "trio_pd", "aborts", "overhead", *(f"scale {n}" for n in opts.scale_rooms),
            "facade", "facades", "tp mismatch", "layerwise"]


def targets_met(r: dict[str, Any]) -> dict[str, bool | None]:
    def le(v: float | None, t: float) -> bool | None:
        return None if v is None else v <= t

    lw = r.get("layerwise")
    layers = {
        # the transfer left after the last layer's compute is a layer's, not the request's
        "layerwise_tail<=2_layers": (
            lw["layerwise_after_compute_ms"]["p50"] <= 2 * lw["layer_transfer_ms_est"]
            if lw else None
        ),
    }
    if r.get("preset") == "layers":
        return layers
    ten_k = [x for x in r.get("scale", []) if x["rooms"] == 10_000]
    ratio = _ratio_target(r["options"]["engine"])
    return {
        **layers,
        f"ratio>={ratio}": r["ratio"] >= ratio,
        f"loop_cpu<={LOOP_CPU:g}us/request": le(r.get("loop_cpu_us_per_request"), LOOP_CPU),
        "overhead_p50<=300us": le(r["overhead_us"]["p50"], TARGETS["overhead_us_p50"]),
        "loop_lateness_p99<=5ms": le(r["loop_lateness_ms"]["p99"],
                                     TARGETS["loop_lateness_ms_p99"]),
        "abort_release_p99<=10ms": le(r["abort_release_ms"]["p99"],
                                      TARGETS["abort_release_ms_p99"]),
        "tp_mismatch_ratio>=0.7": (
            r["tp_mismatch"]["ratio"] >= TARGETS["tp_mismatch_ratio"] if "tp_mismatch" in r
            else None
        ),
        "facades<=300us/request": (
            max(r["facades"]["thread_over_trio_us"], r["facades"]["asyncio_over_trio_us"])
            <= TARGETS["facade_over_trio_us"] if "facades" in r else None
        ),
        "10k_rooms<=4KiB/room": (
            ten_k[0]["bytes_per_room"] <= TARGETS["bytes_per_room_10k"] if ten_k else None
        ),
    }


def targets_line(r: dict[str, Any]) -> str | None:
    """One line that says how many of the run's targets it met and names the ones it
    missed (None: a run with no targets, e.g. ``--preset peer``). Printed after the table,
    and on stderr with ``--json``, so that a missed target is read, not only stored."""
    judged = {k: v for k, v in (r.get("targets") or {}).items() if v is not None}
    if not judged:
        return None
    missed = [k for k, v in judged.items() if not v]
    return (f"targets: {len(judged) - len(missed)} of {len(judged)} met"
            + (f"; missed: {', '.join(missed)}" if missed else ""))


def problems(r: dict[str, Any]) -> list[str]:
    """What makes a bench run a failure (the command exits 1): wrong bytes or failed
    requests, never a missed target."""
    out = [f"peer: {x}" for x in r["peer"]["problems"]] if "peer" in r else []
    if r.get("preset") == "peer":
        return out
    if r.get("layerwise", {}).get("corrupt"):
        out.append(f"layerwise: corrupt requests = {r['layerwise']['corrupt']}")
    if r.get("preset") == "layers":
        return out
    if r["corrupt_pages"]:
        out.append(f"corrupt_pages = {r['corrupt_pages']}")
    if r["failed"]:
        out.append(f"failed = {r['failed']}")
    if any(x["failed"] for x in r["scale"]):
        out.append("scale rooms failed")
    f = r.get("facades", {})
    for name in ("trio", "thread", "asyncio"):
        if f.get(f"{name}_failed"):
            out.append(f"facades: {name} requests failed = {f[f'{name}_failed']}")
    return out


def table(r: dict[str, Any]) -> Any:
    from rich.table import Table

    def pp(d: dict[str, Any], unit: str) -> str:
        return f"p50 {d['p50']} / p99 {d['p99']} {unit}"

    def mark(key: str) -> str:
        v = r["targets"].get(key)
        return "—" if v is None else ("[green]met[/]" if v else "[red]missed[/]")

    if r.get("preset") == "peer":
        return _peer_table(r["peer"], _pools_text(r))
    if r.get("preset") == "layers":
        t = Table(title="trio-pd bench, layer-wise streaming")
        t.add_column("metric")
        t.add_column("value", justify="right")
        t.add_column("target")
        t.add_column("")
        _layer_rows(t, r["layerwise"], mark)
        return t
    o = r["options"]
    t = Table(title=f"trio-pd bench ({o['engine']}, {r['requests']} requests x "
                    f"{o['request_pages']} pages, chunks of {o['chunk_pages']}, "
                    f"concurrency {o['concurrency']})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("target")
    t.add_column("")
    t.add_row("pools (KV and aux, every phase)", _pools_text(r), "", "")
    t.add_row("ceiling (direct engine calls)",
              f"{r['ceiling_gbps']:.3f} GB/s ({r['ceiling_mode']})", "", "")
    t.add_row("trio_pd (end to end, verified)",
              f"{r['trio_pd_gbps']:.3f} GB/s (best of {len(r['trio_pd_gbps_runs'])})", "", "")
    ratio = _ratio_target(o["engine"])
    t.add_row("ratio", f"{r['ratio']:.3f}", f">= {ratio}", mark(f"ratio>={ratio}"))
    t.add_row("event loop CPU per request", f"{r['loop_cpu_us_per_request']} µs "
              f"({r['loop_cpu_us_per_mib']} µs/MiB)", f"<= {LOOP_CPU:g} µs",
              mark(f"loop_cpu<={LOOP_CPU:g}us/request"))
    t.add_row("engine call (1 page), back to back", pp(r["engine_call_us"], "µs"), "", "")
    t.add_row("engine call (1 page), 1 ms apart", pp(r["engine_call_isolated_us"], "µs"),
              "", "")
    t.add_row("engine call (1 page) in trio_pd", pp(r["engine_call_in_run_us"], "µs"),
              "", "")
    t.add_row("trio_pd send→Success (1 page)", pp(r["trio_pd_chunk_us"], "µs"), "", "")
    t.add_row("overhead/chunk (minus its call)", pp(r["overhead_us"], "µs"),
              "p50 <= 300 µs", mark("overhead_p50<=300us"))
    t.add_row("overhead/chunk (minus direct)",
              pp(r["overhead_vs_direct_us"], "µs"), "", "")
    t.add_row("loop lateness (1 ms task)", pp(r["loop_lateness_ms"], "ms"), "p99 <= 5 ms",
              mark("loop_lateness_p99<=5ms"))
    t.add_row(f"abort → release, steady load ({r['abort_samples']} aborts)",
              pp(r["abort_release_ms"], "ms"), "p99 <= 10 ms", mark("abort_release_p99<=10ms"))
    t.add_row(f"abort → release, start burst ({r['abort_burst_samples']} aborts)",
              pp(r["abort_release_burst_ms"], "ms"), "", "")
    for x in r["scale"]:
        key = "10k_rooms<=4KiB/room" if x["rooms"] == 10_000 else ""
        t.add_row(f"scale {x['rooms']} rooms",
                  f"{x['bytes_per_room']} B/room, {x['chunks_per_s']} chunks/s",
                  "<= 4096 B/room" if key else "", mark(key) if key else "")
    tp = r["tp_mismatch"]
    t.add_row(f"TP 1->4 / TP 1->1, same bytes ({tp['requests']} x {tp['tokens']} tokens)",
              f"{tp['ratio']:.3f} ({tp['tp1_4_gbps']} / {tp['tp1_1_gbps']} GB/s)", ">= 0.7",
              mark("tp_mismatch_ratio>=0.7"))
    t.add_row("thread facade: one hop", pp(r["facade_hop_us"], "µs"), "", "")
    t.add_row("thread facade: poll()", pp(r["facade_poll_us"], "µs"), "", "")
    t.add_row("thread facade: send→Success (1 page)",
              f"{pp(r['facade_chunk_us'], 'µs')} ({r['facade_chunk_vs_trio_us']:+} µs "
              "vs trio, p50)", "", "")
    if "facades" in r:
        f = r["facades"]
        t.add_row("facades: CPU per request (trio / thread / asyncio)",
                  f"{f['trio_us_per_request']} / {f['thread_us_per_request']} / "
                  f"{f['asyncio_us_per_request']} µs ({f['thread_over_trio_us']:+} / "
                  f"{f['asyncio_over_trio_us']:+})", "<= +300 µs",
                  mark("facades<=300us/request"))
    if "layerwise" in r:
        _layer_rows(t, r["layerwise"], mark)
    t.add_row("verified", f"{r['verified_bytes'] / 1e6:.1f} MB, corrupt pages "
              f"{r['corrupt_pages']}", "", "")
    return t


def _layer_rows(t: Any, lw: dict[str, Any], mark: Callable[[str], str]) -> None:
    """The layer-wise phase's rows (:mod:`trio_pd.tools._bench_layers`)."""
    o = lw["options"]

    def span(d: dict[str, float]) -> str:
        return f"p50 {d['p50']} ms ({d['min']} to {d['max']})"

    what = (f"{o['layers']} layers x {lw['layer_bytes'] / 2**20:g} MiB, {o['compute_ms']} ms "
            f"compute per layer, {o['rounds']} rounds")
    t.add_row(f"layer-wise: after the last layer's compute → Success, whole ({what})",
              span(lw["whole_after_compute_ms"]), "", "")
    t.add_row("layer-wise: after the last layer's compute → Success, layer by layer",
              span(lw["layerwise_after_compute_ms"]),
              f"<= 2 layers ({2 * lw['layer_transfer_ms_est']:.1f} ms)",
              mark("layerwise_tail<=2_layers"))
    t.add_row("layer-wise: request start → Success (whole / layer by layer)",
              f"{lw['whole_ttft_ms']['p50']} / {lw['layerwise_ttft_ms']['p50']} ms "
              f"({lw['ttft_saved_ms']:+} saved)", "", "")


def _pools_text(r: dict[str, Any]) -> str:
    """Where the run's pools were, for the table."""
    if r.get("device", "host") == "host":
        return "host memory"
    name = r.get("device_name")
    return f"cuda:{r.get('device_index', 0)}" + (f" ({name})" if name else "")


def _peer_table(p: dict[str, Any], pools: str) -> Any:
    from rich.table import Table

    w = p["workload"]
    t = Table(title=f"trio-pd bench --preset peer ({w['engine']}, {w['requests']} requests x "
                    f"{w['pages']} pages x {w['buffers']} buffers of {w['item_bytes'] >> 10} "
                    f"KiB, chunks of {w['chunk_pages']}, concurrency {w['concurrency']}, "
                    "random page layout; prefill and decode in their own processes)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("pools (KV and aux, both processes)", pools)
    lat = p["request_ms"]
    t.add_row("throughput (requests in flight)",
              f"{p['gbps']:.3f} GB/s, {p['requests_per_s']} requests/s over {p['seconds']} s")
    t.add_row("request latency (decode init → Success)",
              f"p50 {lat['p50']} / p99 {lat['p99']} ms")
    for role, work in (("prefill", "filling pages, sanitizer"),
                       ("decode", "verifying, sanitizer")):
        x = p[role]
        t.add_row(f"{role} process (pid {x['pid']}): CPU per request",
                  f"{x['cpu_ms_per_request']} ms (of which {work}: "
                  f"{x['harness_ms_per_request']} ms)")
    t.add_row("verified", f"{p['verified_requests']} of {p['requests']} requests, "
              f"{p['verified_bytes'] / 1e6:.1f} MB")
    t.add_row("corrupt pages / late writes / leaked pages / hung",
              f"{p['corrupt_pages']} / {p['late_writes']} / {p['leaked_pages']} / {p['hung']}")
    return t


def plot_problem(path: str) -> str | None:
    """Why :func:`plot` could not write ``path`` (checked before the run), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return (f"--plot needs matplotlib ({exc}); install the plot extra: "
                f"pip install 'trio-pd[plot]'")
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        return f"--plot {path}: is a folder, not a file name"
    if not os.path.isdir(folder):
        return f"--plot {path}: the folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"--plot {path}: the folder {folder} is not writable"
    if os.path.exists(target) and not os.access(target, os.W_OK):
        return f"--plot {path}: the file is not writable"
    return None


def plot(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if r.get("preset") == "peer":
        _plot_peer(plt, r["peer"], path)
        return
    if r.get("preset") == "layers":
        fig, ax = plt.subplots(1, 1, figsize=(7, 4.5))
        _plot_layers(ax, r["layerwise"])
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [f"ceiling: {m}" for m in r["ceiling_gbps_by_mode"]] + ["trio_pd"]
    vals = [*r["ceiling_gbps_by_mode"].values(), r["trio_pd_gbps"]]
    # horizontal bars: the ceiling's mode names are long
    bars = ax1.barh(names, vals, color=["#999999"] * (len(vals) - 1) + ["#1f77b4"])
    ax1.bar_label(bars, fmt="%.2f")
    ax1.invert_yaxis()
    ax1.set_xlabel("GB/s")
    where = "" if r.get("device", "host") == "host" else f", pools on {_pools_text(r)}"
    ax1.set_title(f"throughput ({r['options']['engine']}{where}), ratio {r['ratio']:.2f}")
    rooms = [x["rooms"] for x in r["scale"]]
    ax2.plot(rooms, [x["bytes_per_room"] for x in r["scale"]], "o-", label="bytes / room")
    ax2.axhline(TARGETS["bytes_per_room_10k"], color="red", ls="--", lw=1, label="4 KiB target")
    ax2.set_xscale("log")
    ax2.set_xlabel("concurrent rooms")
    ax2.set_ylabel("bookkeeping bytes per room")
    ax3 = ax2.twinx()
    ax3.plot(rooms, [x["chunks_per_s"] for x in r["scale"]], "s--", color="green",
             label="chunks / s")
    ax3.set_ylabel("chunks / s (tiny pages)")
    ax2.legend(loc="upper left")
    ax3.legend(loc="upper right")
    ax2.set_title("scale")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_layers(ax: Any, lw: dict[str, Any]) -> None:
    """Whole vs layer by layer: after the last layer's compute, and from the request's
    start, each a p50 bar with the run's min and max."""
    names = ["after last compute", "request start"]
    x = np.arange(len(names))
    for i, (mode, color) in enumerate((("whole", "#999999"), ("layerwise", "#1f77b4"))):
        stats = [lw[f"{mode}_after_compute_ms"], lw[f"{mode}_ttft_ms"]]
        p50 = [d["p50"] for d in stats]
        err = [[d["p50"] - d["min"] for d in stats], [d["max"] - d["p50"] for d in stats]]
        bars = ax.bar(x + (i - 0.5) * 0.38, p50, 0.38, yerr=err, capsize=4, color=color,
                      label="whole request" if mode == "whole" else "layer by layer")
        ax.bar_label(bars, fmt="%.1f")
    o = lw["options"]
    ax.set_xticks(x, [f"{n} → decode Success" for n in names])
    ax.set_ylabel("ms (p50, min to max)")
    ax.set_title(f"layer-wise streaming ({o['engine']}): {o['layers']} layers of "
                 f"{lw['layer_bytes'] / 2**20:g} MiB, {o['compute_ms']} ms compute each")
    ax.legend()


def _plot_peer(plt: Any, p: dict[str, Any], path: str) -> None:
    """The peer preset: request latency, and each process's CPU per request (the part
    spent filling or verifying pages and in the allocator's sanitizer hatched)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    bars = ax1.bar(["p50", "p99"], [p["request_ms"]["p50"], p["request_ms"]["p99"]])
    ax1.bar_label(bars, fmt="%.1f")
    ax1.set_ylabel("ms")
    ax1.set_title(f"request latency: {p['gbps']:.2f} GB/s, {p['requests_per_s']} requests/s")
    roles = ["prefill", "decode"]
    harness = [p[x]["harness_ms_per_request"] for x in roles]
    rest = [p[x]["cpu_ms_per_request"] - h for x, h in zip(roles, harness, strict=True)]
    ax2.bar(roles, rest, label="the rest (trio_pd, engine threads)")
    ax2.bar(roles, harness, bottom=rest, hatch="//", color="#cccccc",
            label="filling / verifying pages, sanitizer")
    ax2.set_ylabel("CPU ms per request")
    ax2.set_title("each process's CPU per request")
    ax2.legend()
    fig.suptitle(f"trio-pd bench --preset peer ({p['workload']['engine']}, "
                 f"{p['workload']['requests']} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = [
    "BenchOptions", "device_name", "peer_demo_options", "phases", "plot", "plot_problem",
    "problems", "run", "run_peer", "table", "verify",
]
