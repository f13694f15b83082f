"""A prefill instance of PP stages and its decode ranks on loopback, for the pipeline
parallelism and layer-wise tests: real bootstrap service, real agents on real engines, host
pools whose bytes are a function of the *model* layer."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import numpy as np

from trio_pd import (
    DecodeAgent,
    DecodeConfig,
    PrefillAgent,
    PrefillConfig,
    open_decode,
    open_prefill,
)
from trio_pd.core._memory import layer_buffers
from trio_pd.core._topology import head_range
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.testing.pools import HostKVPool

BOUND = 20.0
PAGE, HEAD_BYTES, PAGES = 4, 16, 64



# ------------------------------------------------------------------------------ a cluster


@dataclass
class Stage:
    """One prefill rank: TP rank ``tp_rank`` of PP stage ``pp_rank``."""

    agent: PrefillAgent
    pool: HostKVPool
    engine: TransferEngine
    pp_rank: int
    tp_rank: int


@dataclass
class Cluster:
    url: str
    layout: str
    layers: int
    stages: list[Stage]
    decode: list[DecodeAgent]
    decode_pools: list[HostKVPool]
    engines: list[TransferEngine] = field(default_factory=list)


def heads_of(layout: str, rank: int, tp: int, kv_heads: int) -> tuple[int, int]:
    return head_range(rank, tp, kv_heads) if layout == "mha" else (0, 1)


def pp_pool(layout: str, rank: int, tp: int, kv_heads: int, layers: int, *, first: int = 0,
          model: int | None = None) -> HostKVPool:
    first_head, heads = heads_of(layout, rank, tp, kv_heads)
    return HostKVPool(
        layout=layout,  # type: ignore[arg-type]
        num_pages=PAGES, num_layers=layers, page_size=PAGE, head_bytes=HEAD_BYTES,
        heads=heads, first_head=first_head, aux_slots=16, first_layer=first,
        model_layers=model,
    )


@asynccontextmanager
async def open_pp(
    engine_name: str,
    url: str,
    *,
    pp: int,
    prefill_tp: int,
    decode_tp: int,
    layout: str = "mha",
    layers: int = 4,
    kv_heads: int = 4,
    decode_layers: int | None = None,
    stage_layers: list[tuple[int, int]] | None = None,
    wrap: dict[tuple[int, int], Callable[[TransferEngine], TransferEngine]] | None = None,
    prefill_config: PrefillConfig | None = None,
    decode_config: DecodeConfig | None = None,
) -> AsyncIterator[Cluster]:
    """``pp`` stages of ``prefill_tp`` ranks (layers split evenly, or ``stage_layers``'
    ``(first, count)`` per stage) and ``decode_tp`` decode ranks of ``decode_layers``
    (default: every layer), on one bootstrap service."""
    wrap = wrap or {}
    kv = kv_heads if layout == "mha" else 1
    split = stage_layers or [(s * layers // pp, layers // pp) for s in range(pp)]
    async with AsyncExitStack() as stack:
        c = Cluster(url, layout, layers, [], [], [])
        for s, (first, count) in enumerate(split):
            for t in range(prefill_tp):
                engine: TransferEngine = make_engine(engine_name)
                stack.callback(engine.close)
                if (s, t) in wrap:
                    engine = wrap[s, t](engine)
                pool = pp_pool(layout, t, prefill_tp, kv, count, first=first, model=layers)
                agent = await stack.enter_async_context(open_prefill(
                    engine=engine, pool=pool.spec, bootstrap_url=url, tp_rank=t,
                    tp_size=prefill_tp, kv_heads=kv, pp_rank=s, pp_size=pp, first_layer=first,
                    config=prefill_config,
                ))
                c.stages.append(Stage(agent, pool, engine, s, t))
        for d in range(decode_tp):
            engine = make_engine(engine_name)
            stack.callback(engine.close)
            pool = pp_pool(layout, d, decode_tp, kv, decode_layers or layers)
            decode = await stack.enter_async_context(
                open_decode(engine=engine, pool=pool.spec, tp_rank=d, tp_size=decode_tp,
                            config=decode_config)
            )
            c.decode.append(decode)
            c.decode_pools.append(pool)
        yield c


def buffers_of_layer(layout: str, layers: int, layer: int) -> list[int]:
    return layer_buffers(layout, layers, layer, 1)


def check_layers(c: Cluster, room: int, dst: np.ndarray) -> None:
    """Every decode rank holds, in each layer's buffers, the bytes of that model layer
    (and of its heads): checked layer by layer, so a misplaced layer names itself."""
    for d, pool in enumerate(c.decode_pools):
        want = pool.expected(room, len(dst))
        got = pool.kv[:, dst, :]
        for layer in range(c.layers):
            for b in buffers_of_layer(c.layout, c.layers, layer):
                assert (got[b] == want[b]).all(), f"decode rank {d}: layer {layer} (buffer {b})"
