"""Hosting the agents in asyncio (trio_pd.aio): a host with a bootstrap service, a prefill
and a decode agent over real engines, page allocators with the sanitizer, and a ticker that
watches how long the loop is held."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from trio_pd.aio import AioDecode, AioPrefill, TrioHost, open_trio_host
from trio_pd.engines import make_engine
from trio_pd.testing.pools import (
    DEST_POISON,
    SOURCE_POISON,
    HostKVPool,
    PageAllocator,
    page_rows,
)


def small_pool() -> HostKVPool:
    # few pages, so that the 20 rooms of the transfer test reuse them (the sanitizer's check)
    return HostKVPool(
        layout="mha", num_pages=32, num_layers=2, page_size=4, head_bytes=16, heads=2,
        aux_slots=32,
    )


class Ticker:
    """An asyncio task's view of the loop: wakes every 10 ms, records the longest gap
    between wakes (up to :meth:`stop` too) and how long it ran."""

    def __init__(self) -> None:
        self.ticks = 0
        self.longest = 0.0
        self.span = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        now = asyncio.get_running_loop().time()
        self.longest = max(self.longest, now - self._last)
        self.span = now - self._first

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._first = self._last = loop.time()
        while True:
            await asyncio.sleep(0.01)
            self.ticks += 1
            self.longest = max(self.longest, loop.time() - self._last)
            self._last = loop.time()


@dataclass
class Agents:
    host: TrioHost
    url: str
    prefill: AioPrefill
    decode: AioDecode
    src: HostKVPool
    dst: HostKVPool
    src_pages: PageAllocator
    dst_pages: PageAllocator


@asynccontextmanager
async def open_agents(
    ticker: Ticker | None = None, engine_name: str = "mooncake"
) -> AsyncIterator[Agents]:
    """A host with a bootstrap service, a prefill and a decode agent. ``ticker`` runs from
    just before the host starts until it has closed (the engines are made and closed,
    synchronously, outside that window)."""
    src, dst = small_pool(), small_pool()
    pe, de = make_engine(engine_name), make_engine(engine_name)
    if ticker is not None:
        ticker.start()
        await asyncio.sleep(0)  # (it has started)
    try:
        async with (
            open_trio_host() as host,
            host.open_bootstrap_server() as boot,
            host.open_prefill(engine=pe, pool=src.spec, bootstrap_url=boot.url) as prefill,
            host.open_decode(engine=de, pool=dst.spec) as decode,
        ):
            yield Agents(
                host, boot.url, prefill, decode, src, dst,
                PageAllocator(page_rows(src), SOURCE_POISON),
                PageAllocator(page_rows(dst), DEST_POISON),
            )
    finally:
        if ticker is not None:
            ticker.stop()
        pe.close()
        de.close()
