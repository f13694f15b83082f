"""The bench's layer-wise phase: what streaming a request's KV layer by layer buys.

One prefill and one decode rank on loopback (the bench's own pair), one request at a time.
A request's prefill is simulated as ``layers`` steps of ``compute_ms`` each (``trio.sleep``:
the GPU computes while the CPU waits). Two ways to send it, alternated round by round so
that both sample the same minutes of a shared box:

* **whole**: every layer of every page in one ``send`` after the last layer's compute (what
  a connector without layer-wise streaming does);
* **layer-wise**: ``send(pages, layers=range(l, l + 1))`` right after layer ``l``'s
  compute; the last layer's send is ``last``.

Measured per request, from the same clock: **after compute** (the last layer's compute done
→ decode's Success: the transfer left after the last layer, plus the STATUS) and **TTFT**
(request start → decode Success: the receiver is made, the TRANSFER sent, every layer
computed and moved). Every destination byte and aux row is verified after each request,
outside the timed region. With ``compute_ms`` at least one layer's transfer time, the
layer-wise tail is one layer's transfer, the whole one the request's.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import trio

from ..core._state import KVPoll

#: bytes of one page of one buffer: 16 tokens x 8 heads x 256 B (the bench's big pool)
PAGE_SIZE, KV_HEADS, HEAD_BYTES = 16, 8, 256


@dataclass(frozen=True)
class LayerBenchOptions:
    engine: str = "mooncake"
    #: model layers (MHA: a K and a V buffer each)
    layers: int = 8
    #: pages per request: 2 MiB per layer (K and V), 16 MiB a request with 8 layers
    pages: int = 32
    #: simulated prefill compute per layer (ms)
    compute_ms: float = 4.0
    #: rounds of one request of each mode, alternated (the order flips each round)
    rounds: int = 10
    secure: bool = True
    seed: int = 0
    #: where the pools live (as ``trio-pd bench --device``)
    device: str = "host"

    @classmethod
    def quick(cls, engine: str = "mooncake") -> LayerBenchOptions:
        return cls(engine=engine, layers=4, pages=8, compute_ms=2.0, rounds=2)

    @property
    def layer_bytes(self) -> int:
        return self.pages * 2 * PAGE_SIZE * KV_HEADS * HEAD_BYTES


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"p50": round(float(np.median(a)), 3), "min": round(float(a.min()), 3),
            "max": round(float(a.max()), 3)}


async def _one(pair: Any, src: Any, dst: Any, opts: LayerBenchOptions, room: int,
               layerwise: bool) -> tuple[float, float, bool]:
    """One request; (after compute ms, TTFT ms, bytes right)."""
    n = opts.pages
    src_pages = np.arange(n, dtype=np.int64)
    dst_pages = np.arange(n, dtype=np.int64)[::-1].copy()  # (no run shared with the source)
    src.fill(src_pages, room)
    src.fill_aux(0, room)
    dst.page_rows().poison(None, 0)
    compute = opts.compute_ms / 1e3
    t0 = time.perf_counter()
    rx = pair.decode.receiver(room, bootstrap_url=pair.url, epoch=room)
    rx.init(dst_pages, 1)
    tx = pair.prefill.sender(room, num_pages=n, aux_slot=0, epoch=room)
    for layer in range(opts.layers):
        await trio.sleep(compute)  # the layer's compute
        if layerwise:
            tx.send(src_pages, layers=range(layer, layer + 1), last=layer == opts.layers - 1)
    computed = time.perf_counter()
    if not layerwise:
        tx.send(src_pages, last=True)
    status = await rx.wait()
    done = time.perf_counter()
    await tx.wait_released()
    ok = status is KVPoll.Success and bool(
        (dst.read(dst_pages) == src.expected(room, n)).all()
    ) and dst.aux_ok(1, room)
    return (done - computed) * 1e3, (done - t0) * 1e3, ok


async def _run(opts: LayerBenchOptions) -> dict[str, Any]:
    from ._bench import BenchOptions, _open_pair
    from ._demo import make_pool

    def pool() -> Any:
        return make_pool(opts.device, layout="mha", num_pages=opts.pages, num_layers=opts.layers,
                         page_size=PAGE_SIZE, head_bytes=HEAD_BYTES, heads=KV_HEADS,
                         first_head=0, aux_slots=2)

    src, dst = pool(), pool()
    samples: dict[str, dict[str, list[float]]] = {
        m: {"after": [], "ttft": []} for m in ("whole", "layerwise")
    }
    corrupt = 0
    try:
        async with AsyncExitStack() as stack:
            pair = await _open_pair(
                stack, BenchOptions(engine=opts.engine, secure=opts.secure), src, dst
            )
            room = 1 + opts.seed * 1000
            for layerwise in (False, True):  # warm-up: the peers meet, not timed
                await _one(pair, src, dst, opts, room, layerwise)
                room += 1
            for r in range(opts.rounds):
                order = (False, True) if r % 2 == 0 else (True, False)
                for layerwise in order:
                    after, ttft, ok = await _one(pair, src, dst, opts, room, layerwise)
                    room += 1
                    corrupt += not ok
                    got = samples["layerwise" if layerwise else "whole"]
                    got["after"].append(after)
                    got["ttft"].append(ttft)
    finally:
        src.close()
        dst.close()
    out: dict[str, Any] = {"options": asdict(opts), "layer_bytes": opts.layer_bytes,
                           "request_bytes": opts.layer_bytes * opts.layers,
                           "corrupt": corrupt}
    for name, runs in samples.items():
        out[f"{name}_after_compute_ms"] = _stats(runs["after"])
        out[f"{name}_ttft_ms"] = _stats(runs["ttft"])
        out[f"{name}_after_compute_ms_runs"] = [round(x, 3) for x in runs["after"]]
    whole = out["whole_after_compute_ms"]["p50"]
    # one layer's transfer, estimated from the whole sends: what is left after the last
    # layer, over the layers (the STATUS's share included)
    out["layer_transfer_ms_est"] = round(whole / opts.layers, 3)
    out["after_compute_ratio"] = round(out["layerwise_after_compute_ms"]["p50"] / whole, 3)
    out["ttft_saved_ms"] = round(
        out["whole_ttft_ms"]["p50"] - out["layerwise_ttft_ms"]["p50"], 3
    )
    return out


def run_layerwise(opts: LayerBenchOptions) -> dict[str, Any]:
    """The phase, in a trio run of its own; the JSON-able summary."""
    return trio.run(_run, opts)


__all__ = ["LayerBenchOptions", "run_layerwise"]
