"""A failed engine call may still hold blocks inside the engine (SPEC §5.6): its quarantine,
and decode's drain ack after it, end only once the engine proves nothing of it is left.

Measured with the real Mooncake engine over TCP: a call whose first block the peer refuses
returns -1 within milliseconds, while the transport keeps the call's other blocks queued
and delivers them over the next hundreds of milliseconds, reading the source pages after
the call returned. The peer answers a probe meanwhile, and our kernel's send queues are
seen empty between blocks: the old proof (the engine's deadline, a probe, the send queues)
ended the quarantine, and decode released its pages, while those blocks were still to come.
"""

from __future__ import annotations

import time

import numpy as np
import trio

from trio_pd import DecodeConfig, KVPoll, PrefillConfig, open_decode, open_prefill
from trio_pd.engines import EngineError, make_engine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.testing.pools import DEST_POISON, HostKVPool, PageAllocator

from .conftest import host_pool

BOUND = 30.0

#: pages of 4 MiB (2 layers, K and V, 16 tokens of 2 heads of 32 KiB), written to decode's
#: pages in reverse order so that no two merge: a call of ``BIG`` pages is 1,024 blocks of
#: 1 MiB (and the aux row), which the engine takes 0.2-0.5 s to deliver
BIG = 256
#: rooms, one after the other: in each the first block of its one call is refused
ROUNDS = 3


def big_pool() -> HostKVPool:
    return host_pool(num_pages=BIG, page_size=16, head_bytes=32 << 10, aux_slots=4)


async def test_a_failed_call_still_delivering_keeps_decode_pages_until_it_is_flushed(
    bootstrap_url: str,
) -> None:
    """In each room the write's first block is refused by decode's engine (a real partial
    failure: ``bad_block``), so the call fails at once while the engine still sends the
    rest of it. Decode must get its drain ack only after those bytes are in: the pages it
    then releases, and hands out again for the next room, are checked by the sanitizer.
    Before, the quarantine ended on the fence, the probe and the send queues, and up to
    every page of the room was written after release."""
    src, dst = big_pool(), big_pool()
    pages_alloc = PageAllocator(dst.page_rows(), DEST_POISON)
    aux_alloc = PageAllocator(dst.aux_rows(), DEST_POISON)
    inner, de = make_engine("mooncake"), make_engine("mooncake")
    # (the quarantine's barrier writes are one block: they go through untouched)
    fault = FaultEngine(inner, lambda _i, _p, n: Fault("bad_block") if n > 1 else None)
    src.fill(np.arange(BIG), 5)
    src.fill_aux(0, 5)
    late: list[int] = []
    try:
        async with open_decode(
            engine=de, pool=dst.spec, config=DecodeConfig(ack_timeout=0.3),
        ) as decode, open_prefill(
            engine=fault, pool=src.spec, bootstrap_url=bootstrap_url, kv_heads=2,
            config=PrefillConfig(quarantine_fence=0.1),
        ) as prefill:
            for room in range(1, ROUNDS + 1):
                pages, aux = pages_alloc.alloc_nowait(BIG), aux_alloc.alloc_nowait(1)
                assert pages is not None and aux is not None
                released = trio.Event()

                def release(pages: np.ndarray = pages, aux: np.ndarray = aux,
                            released: trio.Event = released) -> None:
                    pages_alloc.free(pages)
                    aux_alloc.free(aux)
                    released.set()

                sender = prefill.sender(room, num_pages=BIG, aux_slot=0)
                receiver = decode.receiver(room, bootstrap_url=bootstrap_url)
                receiver.init(pages[::-1].copy(), int(aux[0]), on_release=release)
                sender.send(np.arange(BIG), last=True)
                with trio.fail_after(BOUND):
                    assert await sender.wait() is KVPoll.Failed
                    assert await receiver.wait() is KVPoll.Failed
                    await released.wait()
                    await sender.wait_released()
                assert isinstance(sender.failure, EngineError)
                t = time.monotonic()
                await trio.sleep(0.8)  # (what the engine still held has landed by now)
                late.append(pages_alloc.late_in_free_rows())
                assert time.monotonic() - t < 5
            stats = prefill.statistics()
            assert decode.statistics().acks_received == ROUNDS
    finally:
        fault.close()
        de.close()
    assert late == [0] * ROUNDS, f"pages written after release, per room: {late}"
    assert pages_alloc.late_writes == 0 and aux_alloc.late_in_free_rows() == 0
    assert stats.released_after_quarantine == ROUNDS
