"""The demo: a bootstrap service, P prefill ranks and D decode ranks on loopback, real engines,
N concurrent requests of random prompt lengths sent in chunks, every Success verified byte for
byte, aborts and engine faults at random points, and a lifetime sanitizer on every allocator.

The same per-rank drivers run all ranks in one process (default) or one OS process per rank
(``--processes``). Every process derives the same request plan from the seed, so the only
thing that crosses a process boundary is what trio_pd itself sends.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import trio
import trio.lowlevel

from ._bootstrap import open_bootstrap_server
from ._decode import DecodeConfig, open_decode
from ._errors import AdmissionClosed
from ._memory import read_aux_stamp
from ._plan import chunk_ranges
from ._prefill import PrefillConfig, open_prefill
from ._security import TOKEN_ENV
from ._state import KVPoll
from ._topology import head_range
from .engines import TransferEngine, make_engine
from .testing.pools import (
    DEST_POISON,
    SOURCE_POISON,
    HostKVPool,
    PageAllocator,
    page_rows,
)

ABORT_POINTS = ("before_bootstrap", "between_chunks", "mid_chunk", "after_last")
Side = Literal["prefill", "decode"]


@dataclass(frozen=True)
class DemoOptions:
    requests: int = 200
    concurrency: int = 32
    page_size: int = 16
    layers: int = 4
    layout: Literal["mha", "mla"] = "mha"
    kv_heads: int = 8
    head_bytes: int = 32
    min_tokens: int = 1
    max_tokens: int = 1024
    chunk_pages: int = 16
    prefill_tp: int = 1
    decode_tp: int = 1
    engine: str = "mooncake"
    abort_rate: float = 0.0
    fault_rate: float = 0.0
    #: which faults --fault-rate injects (trio_pd.engines.fault kinds), and their delay
    fault_kinds: tuple[str, ...] = ("fail", "partial", "delay_before", "delay_after")
    fault_delay: float = 0.01
    seed: int = 0
    #: a request not terminal this long after it started counts as hung
    request_bound: float = 60.0
    #: authentication on (docs/security.md): CURVE on the control plane, the REGISTER
    #: proofs and identity checks, and a random cluster token for the bootstrap service.
    #: Off, the loopback demo runs open (and says so)
    secure: bool = False

    @property
    def max_pages(self) -> int:
        return math.ceil(self.max_tokens / self.page_size)

    @property
    def pool_pages(self) -> int:
        # room for every in-flight request, plus pages held for drains and quarantines
        return self.concurrency * self.max_pages * 2

    @property
    def aux_slots(self) -> int:
        return self.concurrency * 4


@dataclass(frozen=True)
class Request:
    index: int
    room: int
    epoch: int
    tokens: int
    abort: tuple[Side, str] | None
    num_pages: int


def plan_requests(opts: DemoOptions) -> list[Request]:
    rng = random.Random(opts.seed)
    out = []
    rooms = rng.sample(range(1, 1 << 40), opts.requests)
    for i in range(opts.requests):
        tokens = rng.randint(opts.min_tokens, opts.max_tokens)
        abort: tuple[Side, str] | None = None
        if rng.random() < opts.abort_rate:
            abort = (rng.choice(("prefill", "decode")), rng.choice(ABORT_POINTS))
        out.append(
            Request(i, rooms[i], rng.getrandbits(62), tokens, abort,
                    math.ceil(tokens / opts.page_size))
        )
    return out


@dataclass
class RankResult:
    role: str
    rank: int
    outcomes: dict[int, int] = field(default_factory=dict)  # request index -> KVPoll
    corrupt_pages: int = 0
    source_uaf_pages: int = 0
    late_writes: int = 0
    leaked_pages: int = 0
    hung: int = 0
    bytes: int = 0
    abort_release_ms: list[float] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


def _pool(opts: DemoOptions, rank: int, tp: int) -> HostKVPool:
    if opts.layout == "mha":
        first, heads = head_range(rank, tp, opts.kv_heads)
    else:
        first, heads = 0, 1
    return HostKVPool(
        layout=opts.layout, num_pages=opts.pool_pages, num_layers=opts.layers,
        page_size=opts.page_size, head_bytes=opts.head_bytes, heads=heads, first_head=first,
        aux_slots=opts.aux_slots,
    )


def _engine(opts: DemoOptions, role: str, rank: int) -> TransferEngine:
    engine = make_engine(opts.engine)
    if role == "prefill" and opts.fault_rate > 0:
        from .engines.fault import FaultEngine

        return FaultEngine.random(
            engine, opts.fault_rate, seed=opts.seed * 1000 + rank,
            kinds=opts.fault_kinds,  # type: ignore[arg-type]  # checked by FaultEngine
            delay_s=opts.fault_delay,
        )
    return engine


async def _bounded_wait(wait: Callable[[], Any], bound: float) -> KVPoll | None:
    with trio.move_on_after(bound):
        result: KVPoll = await wait()
        return result
    return None


def _hand_over(engine: TransferEngine, engines: list[TransferEngine] | None) -> None:
    if engines is None:
        engine.close()
    else:
        engines.append(engine)


async def _all_returned(allocs: list[PageAllocator], bound: float) -> None:
    """Wait (at most ``bound`` s) until every allocator has every row back: quarantines and
    drain acks included."""
    with trio.move_on_after(bound):
        await trio.lowlevel.checkpoint()
        for alloc in allocs:
            await alloc.wait_all_returned()


async def run_prefill_rank(
    opts: DemoOptions,
    rank: int,
    bootstrap_url: str,
    progress: Callable[[], None] = lambda: None,
    engines: list[TransferEngine] | None = None,
    token: str | None = None,
) -> RankResult:
    result = RankResult("prefill", rank)
    pool = _pool(opts, rank, opts.prefill_tp)
    pages_alloc = PageAllocator(page_rows(pool), SOURCE_POISON)
    aux_alloc = PageAllocator(pool.aux, SOURCE_POISON)
    engine = _engine(opts, "prefill", rank)
    rng = random.Random(opts.seed * 7 + rank)
    slots = trio.Semaphore(opts.concurrency)
    try:
        async with open_prefill(
            engine=engine, pool=pool.spec, bootstrap_url=bootstrap_url, tp_rank=rank,
            tp_size=opts.prefill_tp, kv_heads=opts.kv_heads if opts.layout == "mha" else 1,
            config=PrefillConfig(bootstrap_timeout=opts.request_bound),
            token=token, secure=True if opts.secure else None,
        ) as agent:

            async def one(req: Request) -> None:
                try:
                    pages = await pages_alloc.alloc(req.num_pages)
                    aux = await aux_alloc.alloc(1)
                    pool.fill(pages, req.room)
                    pool.fill_aux(int(aux[0]), req.room)

                    def release() -> None:
                        pages_alloc.free(pages)
                        aux_alloc.free(aux)

                    sender = agent.sender(
                        req.room, num_pages=req.num_pages, aux_slot=int(aux[0]),
                        on_release=release, epoch=req.epoch,
                    )
                    point = req.abort[1] if req.abort and req.abort[0] == "prefill" else None
                    if point == "before_bootstrap":
                        sender.abort("demo: abort before bootstrap")
                    ranges = chunk_ranges(req.num_pages, opts.chunk_pages)
                    for i, (a, b) in enumerate(ranges):
                        last = i == len(ranges) - 1
                        await trio.sleep(rng.random() * 0.002)  # the scheduler computes
                        try:
                            sender.send(pages[a:b], last=last)
                        except AdmissionClosed:
                            break
                        if point == "mid_chunk" and i == 0:
                            sender.abort("demo: abort mid-chunk")
                        if point == "between_chunks" and i == 0 and not last:
                            await trio.sleep(rng.random() * 0.002)
                            sender.abort("demo: abort between chunks")
                    if point == "after_last":
                        sender.abort("demo: abort after the last chunk")
                    status = await _bounded_wait(sender.wait, opts.request_bound)
                    if status is None:
                        result.hung += 1
                    else:
                        result.outcomes[req.index] = int(status)
                finally:
                    slots.release()
                    progress()

            async with trio.open_nursery() as nursery:
                for req in plan_requests(opts):
                    await slots.acquire()
                    nursery.start_soon(one, req)
            # quarantined leases come back after their fence; wait for them
            await _all_returned([pages_alloc, aux_alloc], agent.peers.fence + 5)
            # counted before the agent closes: closing hands every page back, whatever it held
            result.leaked_pages = pages_alloc.outstanding
            result.stats = asdict(agent.statistics())
    finally:
        # Mooncake's close() holds the GIL for up to a second: the caller closes every
        # engine once no rank is still moving bytes.
        _hand_over(engine, engines)
    result.late_writes = (
        pages_alloc.late_writes + aux_alloc.late_writes + pages_alloc.late_in_free_rows()
        + aux_alloc.late_in_free_rows()
    )
    return result


async def run_decode_rank(
    opts: DemoOptions,
    rank: int,
    bootstrap_url: str,
    progress: Callable[[], None] = lambda: None,
    engines: list[TransferEngine] | None = None,
    token: str | None = None,
) -> RankResult:
    result = RankResult("decode", rank)
    pool = _pool(opts, rank, opts.decode_tp)
    pages_alloc = PageAllocator(page_rows(pool), DEST_POISON)
    aux_alloc = PageAllocator(pool.aux, DEST_POISON)
    engine = _engine(opts, "decode", rank)
    rng = random.Random(opts.seed * 11 + rank)
    slots = trio.Semaphore(opts.concurrency)
    try:
        async with open_decode(
            engine=engine, pool=pool.spec, tp_rank=rank, tp_size=opts.decode_tp,
            config=DecodeConfig(waiting_timeout=opts.request_bound),
            token=token, secure=True if opts.secure else None,
        ) as agent:

            async def one(req: Request) -> None:
                try:
                    pages = await pages_alloc.alloc(req.num_pages)
                    aux = await aux_alloc.alloc(1)
                    aborted_at: list[float] = []

                    def release() -> None:
                        pages_alloc.free(pages)
                        aux_alloc.free(aux)
                        if aborted_at:
                            waited = time.perf_counter() - aborted_at[0]
                            result.abort_release_ms.append(waited * 1e3)

                    def abort(why: str) -> None:
                        aborted_at.append(time.perf_counter())
                        receiver.abort(why)

                    receiver = agent.receiver(
                        req.room, bootstrap_url=bootstrap_url, epoch=req.epoch
                    )
                    point = req.abort[1] if req.abort and req.abort[0] == "decode" else None
                    if point == "before_bootstrap":
                        abort("demo: abort before bootstrap")
                    receiver.init(pages, int(aux[0]), on_release=release)
                    if point in ("between_chunks", "mid_chunk", "after_last"):
                        await trio.sleep(rng.random() * 0.01)
                        if receiver.poll() is not KVPoll.Success:
                            abort(f"demo: abort ({point})")
                    status = await _bounded_wait(receiver.wait, opts.request_bound)
                    if status is None:
                        result.hung += 1
                        return
                    result.outcomes[req.index] = int(status)
                    if status is KVPoll.Success:
                        _verify(result, pool, pages, int(aux[0]), req)
                        pages_alloc.free(pages)  # the request's KV is ours again: done with it
                        aux_alloc.free(aux)
                finally:
                    slots.release()
                    progress()

            async with trio.open_nursery() as nursery:
                for req in plan_requests(opts):
                    await slots.acquire()
                    nursery.start_soon(one, req)
            await _all_returned([pages_alloc, aux_alloc], opts.request_bound)
            # counted before the agent closes: closing hands every page back, whatever it held
            result.leaked_pages = pages_alloc.outstanding
            result.stats = asdict(agent.statistics())
    finally:
        # Mooncake's close() holds the GIL for up to a second: the caller closes every
        # engine once no rank is still moving bytes.
        _hand_over(engine, engines)
    result.late_writes = (
        pages_alloc.late_writes + aux_alloc.late_writes + pages_alloc.late_in_free_rows()
        + aux_alloc.late_in_free_rows()
    )
    return result


def _verify(
    result: RankResult, pool: HostKVPool, pages: npt.NDArray[np.int64], aux: int, req: Request
) -> None:
    got = pool.kv[:, pages, :]
    want = pool.expected(req.room, len(pages))
    bad = ~(got == want).reshape(got.shape[0], len(pages), -1).all(axis=2).all(axis=0)
    result.corrupt_pages += int(bad.sum())
    if bad.any():
        source_poison = (got[:, bad, :] == SOURCE_POISON).any(axis=(0, 2))
        result.source_uaf_pages += int(source_poison.sum())
    stamp = read_aux_stamp(pool.spec, aux)
    if stamp != (req.room, req.epoch) or not pool.aux_ok(aux, req.room):
        result.corrupt_pages += 1
    result.bytes += int(got.nbytes)


# ---------------------------------------------------------------------- the whole demo


def summarize(opts: DemoOptions, results: list[RankResult], seconds: float) -> dict[str, Any]:
    reqs = plan_requests(opts)
    decode = [r for r in results if r.role == "decode"]
    succeeded = failed = aborted = 0
    for req in reqs:
        ok = all(r.outcomes.get(req.index) == int(KVPoll.Success) for r in decode)
        if ok:
            succeeded += 1
        elif req.abort is not None:
            aborted += 1
        else:
            failed += 1
    def stat(name: str) -> int:
        return sum(r.stats.get(name, 0) for r in results)

    ms = sorted(m for r in decode for m in r.abort_release_ms)
    total_bytes = sum(r.bytes for r in decode)
    return {
        "requests": len(reqs),
        "succeeded": succeeded,
        "failed": failed,
        "aborted": aborted,
        "bytes": total_bytes,
        "seconds": round(seconds, 3),
        "gbps": round(total_bytes / seconds / 1e9, 3) if seconds > 0 else 0.0,
        "corrupt_pages": sum(r.corrupt_pages for r in results),
        "source_uaf_pages": sum(r.source_uaf_pages for r in results),
        "late_writes": sum(r.late_writes for r in results),
        "leaked_pages": sum(r.leaked_pages for r in results),
        "hung": max((r.hung for r in results), default=0),
        "quarantined": stat("quarantined"),
        "released_after_quarantine": stat("released_after_quarantine"),
        "released_by_timeout": stat("released_by_timeout"),
        "released_peer_gone": stat("released_peer_gone"),
        "engine_errors": stat("engine_errors"),
        "abort_release_ms": {
            "p50": round(_pct(ms, 50), 3) if ms else None,
            "p99": round(_pct(ms, 99), 3) if ms else None,
        },
        "engine": opts.engine,
        "layout": opts.layout,
        "prefill_tp": opts.prefill_tp,
        "decode_tp": opts.decode_tp,
        "kv_heads": opts.kv_heads,
    }


def _pct(values: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(values), p))


async def run_in_process(
    opts: DemoOptions, progress: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """Every rank as tasks of one trio run."""
    results: list[RankResult] = []
    engines: list[TransferEngine] = []
    token = secrets.token_urlsafe(24) if opts.secure else None
    start = time.perf_counter()
    try:
        async with (
            open_bootstrap_server(token=token, secure=True if opts.secure else None) as server,
            trio.open_nursery() as nursery,
        ):

            async def run(fn: Any, rank: int, tick: Callable[[], None]) -> None:
                results.append(await fn(opts, rank, server.url, tick, engines, token=token))

            for p in range(opts.prefill_tp):
                nursery.start_soon(run, run_prefill_rank, p, lambda: None)
            for d in range(opts.decode_tp):
                nursery.start_soon(run, run_decode_rank, d, progress if d == 0 else lambda: None)
        seconds = time.perf_counter() - start
    finally:
        for engine in engines:
            engine.close()
    return summarize(opts, results, seconds)


async def run_worker(role: str, rank: int, url: str, opts: DemoOptions) -> None:
    """One rank in its own process (``--processes``): progress lines, then a JSON result."""
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        print(f"progress {done}", flush=True)

    fn = run_prefill_rank if role == "prefill" else run_decode_rank
    engines: list[TransferEngine] = []
    result = await fn(opts, rank, url, tick, engines)
    print("result " + json.dumps(asdict(result)), flush=True)
    for engine in engines:
        engine.close()


async def run_processes(
    opts: DemoOptions, progress: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """Bootstrap, every prefill rank and every decode rank as separate OS processes."""
    exe = [sys.executable, "-m", "trio_pd.cli"]
    results: list[RankResult] = []
    start = time.perf_counter()
    # --secure: every process reads the token from TRIO_PD_TOKEN (kept out of argv)
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    if opts.secure:
        env[TOKEN_ENV] = secrets.token_urlsafe(24)
    boot = await trio.lowlevel.open_process(
        [*exe, "bootstrap", "--port", "0"], stdout=subprocess.PIPE, env=env
    )
    try:
        assert boot.stdout is not None
        url = (await _read_line(boot.stdout)).strip()
        workers = [("prefill", p) for p in range(opts.prefill_tp)] + [
            ("decode", d) for d in range(opts.decode_tp)
        ]
        async with trio.open_nursery() as nursery:
            for role, rank in workers:
                nursery.start_soon(
                    _worker_process, exe, role, rank, url, opts, results,
                    progress if (role, rank) == ("decode", 0) else lambda: None, env,
                )
    finally:
        boot.terminate()
        with trio.CancelScope(shield=True):
            await boot.wait()
    if len(results) != len(workers):
        raise RuntimeError(f"{len(workers) - len(results)} rank processes gave no result")
    return summarize(opts, results, time.perf_counter() - start)


async def _worker_process(
    exe: list[str], role: str, rank: int, url: str, opts: DemoOptions,
    results: list[RankResult], progress: Callable[[], None], env: dict[str, str],
) -> None:
    cmd = [*exe, "_worker", role, str(rank), url, json.dumps(asdict(opts))]
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    buf = b""
    async for data in proc.stdout:
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            text = line.decode()
            if text.startswith("progress"):
                progress()
            elif text.startswith("result "):
                raw = json.loads(text[7:])
                raw["outcomes"] = {int(k): v for k, v in raw["outcomes"].items()}
                results.append(RankResult(**raw))
    code = await proc.wait()
    if code != 0:
        raise RuntimeError(f"{role} rank {rank} exited with {code}")


async def _read_line(stream: trio.abc.ReceiveStream) -> str:
    await trio.lowlevel.checkpoint()
    buf = b""
    while b"\n" not in buf:
        data = await stream.receive_some(1024)
        if not data:
            raise RuntimeError("bootstrap process exited before printing its URL")
        buf += data
    return buf.split(b"\n", 1)[0].decode()


def check(opts: DemoOptions, summary: dict[str, Any]) -> list[str]:
    """What makes a demo run a failure (the command exits 1)."""
    problems = []
    for key in ("corrupt_pages", "late_writes", "leaked_pages", "hung", "released_by_timeout"):
        if summary.get(key):
            problems.append(f"{key} = {summary[key]}")
    if summary["succeeded"] + summary["failed"] + summary["aborted"] != summary["requests"]:
        problems.append("requests unaccounted for")
    if summary["failed"] and opts.fault_rate == 0:
        problems.append(f"failed = {summary['failed']} without injected faults")
    return problems


__all__ = [
    "DemoOptions",
    "check",
    "plan_requests",
    "run_in_process",
    "run_processes",
    "run_worker",
]
