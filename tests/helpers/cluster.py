"""Clusters built the way the demo builds them: P prefill ranks, each closable on its own,
and D decode ranks, on one bootstrap service."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import trio

from trio_pd import (
    DecodeAgent,
    DecodeConfig,
    PrefillAgent,
    PrefillConfig,
    open_decode,
    open_prefill,
)
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.testing.pools import HostKVPool
from trio_pd.tools._demo import DemoOptions, _pool


@dataclass
class Rank:
    """A prefill rank of a cluster: closable on its own (``scope``; ``closed`` once it is)."""

    agent: PrefillAgent
    pool: HostKVPool
    engine: TransferEngine
    scope: trio.CancelScope
    closed: trio.Event


@dataclass
class Cluster:
    """Prefill ranks and decode ranks on one bootstrap service."""

    url: str
    prefill: list[Rank]
    decode: list[DecodeAgent]
    decode_pools: list[HostKVPool]


async def _serve_prefill(
    engine: TransferEngine,
    pool: HostKVPool,
    url: str,
    rank: int,
    opts: DemoOptions,
    config: PrefillConfig | None,
    scope: trio.CancelScope,
    closed: trio.Event,
    task_status: trio.TaskStatus[PrefillAgent] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        with scope:
            async with open_prefill(
                engine=engine, pool=pool.spec, bootstrap_url=url, tp_rank=rank,
                tp_size=opts.prefill_tp, kv_heads=opts.kv_heads if opts.layout == "mha" else 1,
                config=config,
            ) as agent:
                task_status.started(agent)
                await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(engine.close)  # never on the event loop
        closed.set()


@asynccontextmanager
async def open_cluster(
    engine_name: str,
    url: str,
    opts: DemoOptions,
    *,
    wrap: dict[int, Callable[[TransferEngine], TransferEngine]] | None = None,
    prefill_config: PrefillConfig | None = None,
    decode_config: DecodeConfig | None = None,
) -> AsyncIterator[Cluster]:
    """P prefill ranks (each closable on its own through its scope) and D decode ranks, built
    the way the demo builds them, on one bootstrap service."""
    wrap = wrap or {}
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        cluster = Cluster(url, [], [], [])
        for rank in range(opts.prefill_tp):
            engine = make_engine(engine_name)
            if rank in wrap:
                engine = wrap[rank](engine)
            pool = _pool(opts, rank, opts.prefill_tp)
            scope, closed = trio.CancelScope(), trio.Event()
            agent = await nursery.start(
                _serve_prefill, engine, pool, url, rank, opts, prefill_config, scope, closed
            )
            cluster.prefill.append(Rank(agent, pool, engine, scope, closed))
        for rank in range(opts.decode_tp):
            engine = make_engine(engine_name)
            stack.push_async_callback(trio.to_thread.run_sync, engine.close)
            pool = _pool(opts, rank, opts.decode_tp)
            agent = await stack.enter_async_context(
                open_decode(engine=engine, pool=pool.spec, tp_rank=rank, tp_size=opts.decode_tp,
                            config=decode_config)
            )
            cluster.decode.append(agent)
            cluster.decode_pools.append(pool)
        try:
            yield cluster
        finally:
            for r in cluster.prefill:
                r.scope.cancel()
