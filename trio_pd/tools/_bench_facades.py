"""``trio-pd bench``'s facades phase: the same requests through the trio API, the thread
facade (:mod:`trio_pd.sync`) and the asyncio facade (:mod:`trio_pd.aio`), alternated.

Workload: ``requests`` requests of ``pages`` tiny pages (the bench's small pool), each sent
in ``chunks`` chunks (the load's shape: 64 pages in chunks of 16 is 4 chunks), ``concurrency``
in flight, prefill and decode in one process on loopback with the bench's engine. The pages
are tiny so that the engine's share stays small and what differs between the three drivers,
the calls into trio_pd, shows.

What is measured over each run, from the first request started to the last one over:

* **process CPU per request** (``time.process_time``: every thread of the process). A facade
  moves work between threads (the caller's and the trio thread; asyncio's loop and trio's
  I/O thread in guest mode): the CPU of any one thread would miss part of it, and the engine's
  own threads do the same work under each driver, so the difference between drivers is the
  facade's. This is the figure the target is about.
* **wall per request** (run seconds x concurrency / requests): what a request waits, with
  the scheduler's polling step (the thread driver's) included.

Each round runs the three drivers once each, in turn, every one with agents of its own (one
trio loop each: the thread facade's bootstrap, prefill and decode share one trio thread, as
the trio driver's share one loop); the median of the rounds counts.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Callable
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from ..agents._decode import DecodeConfig, open_decode
from ..agents._prefill import PrefillConfig, open_prefill
from ..bootstrap._bootstrap import open_bootstrap_server
from ..core._memory import PoolSpec
from ..core._state import TERMINAL, KVPoll
from ..engines import TransferEngine

#: how a run makes each of its engines (the bench's own factory, which tests replace)
EngineMaker = Callable[[], TransferEngine]


@dataclass(frozen=True)
class FacadeWorkload:
    requests: int = 400
    pages: int = 4
    chunks: int = 4
    concurrency: int = 16
    rounds: int = 3
    #: the thread driver's scheduler step: when nothing moved it sleeps this long, then
    #: polls again (a serving engine's step is a forward pass, milliseconds; a shorter step
    #: charges the polling, not the facade, for most of the CPU)
    step_s: float = 0.001

    @classmethod
    def quick(cls) -> FacadeWorkload:
        return cls(requests=60, concurrency=8, rounds=1)


@dataclass
class Run:
    seconds: float
    cpu_seconds: float
    failed: int


@dataclass
class _Slot:
    """The pages, aux rows and room ids of one in-flight position."""

    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    aux: int


def _slots(w: FacadeWorkload) -> list[_Slot]:
    return [
        _Slot(np.arange(k * w.pages, (k + 1) * w.pages, dtype=np.int64),
              np.arange(k * w.pages, (k + 1) * w.pages, dtype=np.int64)[::-1].copy(), k)
        for k in range(w.concurrency)
    ]


def _chunks(pages: npt.NDArray[np.int64], n: int) -> list[npt.NDArray[np.int64]]:
    return [c for c in np.array_split(pages, n) if len(c)]


def _room(base: int, i: int) -> int:
    return base + i


# ------------------------------------------------------------------------------ trio API


async def _trio_run(
    engine: EngineMaker, src: PoolSpec, dst: PoolSpec, w: FacadeWorkload, base: int
) -> Run:
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(open_bootstrap_server())
        pe, de = engine(), engine()
        stack.callback(de.close)
        stack.callback(pe.close)
        prefill = await stack.enter_async_context(open_prefill(
            engine=pe, pool=src, bootstrap_url=server.url, kv_heads=src.heads,
            config=PrefillConfig(bootstrap_timeout=900.0),
        ))
        decode = await stack.enter_async_context(open_decode(
            engine=de, pool=dst, config=DecodeConfig(waiting_timeout=900.0),
        ))
        slots = _slots(w)
        failed = 0

        async def one(i: int, slot: _Slot) -> None:
            nonlocal failed
            room = _room(base, i)
            rx = decode.receiver(room, bootstrap_url=server.url, epoch=i)
            rx.init(slot.dst, slot.aux)
            tx = prefill.sender(room, num_pages=w.pages, aux_slot=slot.aux, epoch=i)
            parts = _chunks(slot.src, w.chunks)
            for j, part in enumerate(parts):
                tx.send(part, last=j == len(parts) - 1)
            if await rx.wait() is not KVPoll.Success or await tx.wait() is not KVPoll.Success:
                failed += 1

        await one(w.requests, slots[0])  # bootstrap, first-contact handshakes: not timed
        failed = 0
        todo = deque(range(w.requests))

        async def worker(slot: _Slot) -> None:
            await trio.lowlevel.checkpoint()
            while todo:
                await one(todo.popleft(), slot)

        cpu, start = time.process_time(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for slot in slots:
                nursery.start_soon(worker, slot)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        return Run(seconds, cpu, failed)


def run_trio(
    engine: EngineMaker, src: PoolSpec, dst: PoolSpec, w: FacadeWorkload, base: int
) -> Run:
    return trio.run(_trio_run, engine, src, dst, w, base)


# ------------------------------------------------------------------------------ threads


def run_thread(
    engine: EngineMaker, src: PoolSpec, dst: PoolSpec, w: FacadeWorkload, base: int
) -> Run:
    """A scheduler loop on this thread: each step it starts requests into free slots, polls
    the ones in flight, takes ``pop_released``; it sleeps ``w.step_s`` when nothing
    moved. A slot is free again once decode's Success was polled and prefill released the
    room's source pages."""
    from .. import sync

    with ExitStack() as stack:
        pe, de = engine(), engine()
        stack.callback(de.close)
        stack.callback(pe.close)
        thread = sync.TrioThread("trio_pd-bench")
        stack.callback(thread.close)
        boot = stack.enter_context(sync.open_bootstrap_server(thread=thread))
        prefill = stack.enter_context(sync.open_prefill(
            engine=pe, pool=src, bootstrap_url=boot.url, kv_heads=src.heads, thread=thread,
            config=PrefillConfig(bootstrap_timeout=900.0),
        ))
        decode = stack.enter_context(sync.open_decode(
            engine=de, pool=dst, thread=thread, config=DecodeConfig(waiting_timeout=900.0),
        ))
        slots = _slots(w)

        def start(i: int, slot: _Slot) -> tuple[Any, Any]:
            room = _room(base, i)
            tx = prefill.sender(room, epoch=i)
            tx.init(w.pages, slot.aux)
            rx = decode.receiver(room, bootstrap_url=boot.url, epoch=i)
            rx.init(slot.dst, slot.aux)
            parts = _chunks(slot.src, w.chunks)
            for j, part in enumerate(parts):
                tx.send(part, last=j == len(parts) - 1)
            return tx, rx

        def schedule(first: int, n: int) -> int:
            todo = deque(range(first, first + n))
            free = deque(range(w.concurrency))
            flying: dict[int, tuple[int, Any, Any]] = {}  # slot -> (room, tx, rx)
            released: set[int] = set()
            failed = 0
            end = time.perf_counter() + 60.0 + n * 0.05
            while todo or flying:
                moved = False
                while todo and free:
                    k = free.popleft()
                    i = todo.popleft()
                    tx, rx = start(i, slots[k])
                    flying[k] = (_room(base, i), tx, rx)
                    moved = True
                released.update(prefill.pop_released())
                decode.pop_released()
                for k, (room, tx, rx) in list(flying.items()):
                    rs = rx.poll()
                    if rs not in TERMINAL or room not in released:
                        continue  # (prefill releases its pages once it is terminal)
                    if rs is KVPoll.Failed or tx.poll() is not KVPoll.Success:
                        failed += 1
                    released.discard(room)
                    del flying[k]
                    free.append(k)
                    moved = True
                if not moved:
                    if time.perf_counter() > end:
                        raise RuntimeError("the facades phase (threads) waited too long")
                    time.sleep(w.step_s)
            return failed

        schedule(w.requests, 1)  # bootstrap, first-contact handshakes: not timed
        cpu, begin = time.process_time(), time.perf_counter()
        failed = schedule(0, w.requests)
        seconds, cpu = time.perf_counter() - begin, time.process_time() - cpu
        return Run(seconds, cpu, failed)


# ------------------------------------------------------------------------------ asyncio


async def _aio_run(
    engine: EngineMaker, src: PoolSpec, dst: PoolSpec, w: FacadeWorkload, base: int
) -> Run:
    from ..aio import open_trio_host

    pe, de = engine(), engine()
    try:
        async with (
            open_trio_host() as host,
            host.open_bootstrap_server() as boot,
            host.open_prefill(engine=pe, pool=src, bootstrap_url=boot.url, kv_heads=src.heads,
                              config=PrefillConfig(bootstrap_timeout=900.0)) as prefill,
            host.open_decode(engine=de, pool=dst,
                             config=DecodeConfig(waiting_timeout=900.0)) as decode,
        ):
            slots = _slots(w)
            failed = 0

            async def one(i: int, slot: _Slot) -> None:
                nonlocal failed
                room = _room(base, i)
                rx = await decode.receiver(room, bootstrap_url=boot.url, epoch=i)
                await rx.init(slot.dst, slot.aux)
                tx = await prefill.sender(room, num_pages=w.pages, aux_slot=slot.aux, epoch=i)
                parts = _chunks(slot.src, w.chunks)
                for j, part in enumerate(parts):
                    await tx.send(part, last=j == len(parts) - 1)
                try:
                    if await rx.wait() is not KVPoll.Success or await tx.wait() is not (
                        KVPoll.Success
                    ):
                        failed += 1
                except Exception:
                    failed += 1

            await one(w.requests, slots[0])  # bootstrap: not timed
            failed = 0
            todo = deque(range(w.requests))

            async def worker(slot: _Slot) -> None:
                await asyncio.sleep(0)
                while todo:
                    await one(todo.popleft(), slot)

            cpu, start = time.process_time(), time.perf_counter()
            await asyncio.gather(*(worker(slot) for slot in slots))
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            return Run(seconds, cpu, failed)
    finally:
        pe.close()
        de.close()


def run_asyncio(
    engine: EngineMaker, src: PoolSpec, dst: PoolSpec, w: FacadeWorkload, base: int
) -> Run:
    return asyncio.run(_aio_run(engine, src, dst, w, base))


# ------------------------------------------------------------------------------ the phase

DRIVERS: dict[str, Callable[[EngineMaker, PoolSpec, PoolSpec, FacadeWorkload, int], Run]] = {
    "trio": run_trio, "thread": run_thread, "asyncio": run_asyncio,
}


def measure(
    engine: EngineMaker, src: PoolSpec, dst: PoolSpec, w: FacadeWorkload,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every driver once per round, in turn; the medians (and ranges) over the rounds."""
    runs: dict[str, list[Run]] = {name: [] for name in DRIVERS}
    base = 1 << 45
    for _ in range(w.rounds):
        for name, driver in DRIVERS.items():
            runs[name].append(driver(engine, src, dst, w, base))
            base += w.requests + 1
    out: dict[str, Any] = {
        "workload": {"requests": w.requests, "pages": w.pages, "chunks": w.chunks,
                     "concurrency": w.concurrency, "rounds": w.rounds, "step_s": w.step_s},
        "measure": "process CPU (every thread) per request; wall = run seconds x "
                   "concurrency / requests",
    }
    cpu: dict[str, float] = {}
    for name, rs in runs.items():
        per = [r.cpu_seconds / w.requests * 1e6 for r in rs]
        wall = [r.seconds * w.concurrency / w.requests * 1e6 for r in rs]
        cpu[name] = round(statistics.median(per), 1)
        out[f"{name}_us_per_request"] = cpu[name]
        out[f"{name}_us_per_request_runs"] = [round(x, 1) for x in per]
        out[f"{name}_wall_us_per_request"] = round(statistics.median(wall), 1)
        out[f"{name}_failed"] = sum(r.failed for r in rs)
    out["thread_over_trio_us"] = round(cpu["thread"] - cpu["trio"], 1)
    out["asyncio_over_trio_us"] = round(cpu["asyncio"] - cpu["trio"], 1)
    progress("facades")
    return out
