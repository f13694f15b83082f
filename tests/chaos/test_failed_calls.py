"""Chaos: engine calls that fail while the engine still holds their blocks.

A prefill process whose writes to a decode process fail the way Mooncake's TCP transport
fails a call with a block the peer refuses (``bad_block`` around the real engine): the call
returns -1 at once, and the engine goes on sending the call's other blocks afterwards. Big
pages (4 MiB), so each failed call leaves a quarter of a GiB on its way. Each failed room's
quarantine ends, and decode gets its drain ack, only once a later call to the peer has
completed (the engine's proof that nothing of the failed call is left).

Asserts: every failed room's pages go back on both sides (prefill: a quarantine that ended;
decode: the drain ack), and, after the drain, 0 late writes, 0 corrupt, 0 guard bytes
touched, 0 leaked on both.

(This scenario did not show late writes with the rule undone either, in 3 runs: the calls'
few large blocks landed before the quarantine ended. The test that fails without it is
tests/test_call_barrier.py, whose calls are 1,024 blocks of 1 MiB.)
"""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path

import pytest
import trio

from .harness import check_final, cluster, final, record, wait_done, wait_released

pytestmark = [pytest.mark.chaos, pytest.mark.processes, pytest.mark.timeout(300)]

#: 4 layers, K and V, 16 tokens of 8 heads of 4 KiB: 4 MiB pages
BIG = dict(pool_pages=160, aux_slots=16, head_bytes=4096)
ROOMS = 6


async def test_failed_calls_the_engine_still_delivers(tmp_path: Path) -> None:
    async with cluster(
        tmp_path, fault=True, **BIG,
        prefill_config={"quarantine_fence": 0.1}, decode_config={"ack_timeout": 0.3},
    ) as c:
        await c.bootstrap()
        prefill, decode = await c.rank("prefill"), await c.rank("decode")
        # (the first request of this page size costs each side some seconds of pattern
        # building, which may miss heartbeats: warm up until a round succeeds)
        for _ in range(3):
            warm = c.submit(prefill, [decode], 2, pages=4, chunks=1, gap=0.0)
            warmed = await wait_done(decode, warm, 60)
            if all(e["status"] == "Success" for e in warmed.values()):
                break
            await trio.sleep(2.0)
        else:
            raise AssertionError([e.get("failure") for e in warmed.values()])
        # every write of many blocks fails with a refused first block; the quarantines' one-
        # block barriers go through
        prefill.send({"cmd": "fault", "kind": "bad_block", "calls": 1000, "min_blocks": 2})
        rooms = c.submit(prefill, [decode], ROOMS, pages=64, chunks=1, gap=0.3)
        done = await wait_done(decode, rooms, 120)
        failed = [i for i, e in done.items() if e["status"] != "Success"]
        assert failed, "no write failed"
        released = await wait_released(decode, failed, 120)
        src_released = await wait_released(prefill, failed, 120)
        reports = {"prefill": await final(prefill), "decode": await final(decode)}
        prefill_stats = reports["prefill"]["stats"]
        row = dict(
            scenario="failed calls the engine still delivers (mooncake, bad_block)",
            rooms=ROOMS, failed=len(failed),
            decode_release_proofs=sorted({e["proof"] for e in released.values()}),
            prefill_release_proofs=sorted({e["proof"] for e in src_released.values()}),
            quarantine_unflushed=prefill_stats.get("quarantine_unflushed", 0),
            late_writes=sum(r["late_writes"] for r in reports.values()),
            corrupt=sum(r["corrupt"] for r in reports.values()),
            leaked=sum(r["leaked"] for r in reports.values()),
        )
        record(row)
        for role, report in reports.items():
            check_final(report, role)
        assert row["decode_release_proofs"] == ["ack"], row


STOP_S = 10.0  # longer than NIXL's write deadline (5 s) and the quarantine fence after it


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None, reason="nixl-cu12 not installed")
async def test_nixl_over_tcp_requests_that_time_out_while_decode_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NIXL with UCX's ``tcp`` transport (so that a stopped decode stops the writes; between
    two processes of one host UCX otherwise writes with ``cma`` and the writes complete).
    Decode is stopped with rooms in flight: their requests time out at NIXL's deadline,
    still posted, and land when decode resumes. The adapter keeps each such request until it
    has ended, and the quarantine waits for that (``quarantine_unflushed`` counts the waits):
    no page is released before the bytes are in. (Measured: 1 or 8 of 8 rooms failed, 0 late,
    0 leaked. With the request released at its deadline instead, 2 runs showed no late write
    either: while decode is stopped its probe gives no answer, which keeps the quarantine, and
    the bytes land within milliseconds of the resume. tests/test_call_barrier.py tests the
    adapter's rule itself.)"""
    monkeypatch.setenv("UCX_TLS", "tcp")  # (the cluster's processes inherit it)
    async with cluster(
        tmp_path, engine="nixl", prefill_config={"quarantine_fence": 1.0},
        decode_config={"ack_timeout": 0.5},
    ) as c:
        await c.bootstrap()
        prefill, decode = await c.rank("prefill"), await c.rank("decode")
        warm = c.submit(prefill, [decode], 2, pages=16, chunks=2, gap=0.0)
        warmed = await wait_done(decode, warm, 60)
        assert all(e["status"] == "Success" for e in warmed.values()), warmed
        rooms = c.submit(prefill, [decode], 8, pages=64, chunks=8, gap=0.05)
        await trio.sleep(0.3)  # (writes under way)
        decode.signal(signal.SIGSTOP)
        t0 = time.time()
        await trio.sleep(STOP_S)
        decode.signal(signal.SIGCONT)
        done = await wait_done(decode, rooms, 120)
        failed = [i for i, e in done.items() if e["status"] != "Success"]
        if failed:
            await wait_released(decode, failed, 120)
            await wait_released(prefill, failed, 120)
        reports = {"prefill": await final(prefill), "decode": await final(decode)}
        prefill_stats = reports["prefill"]["stats"]
        row = dict(
            scenario="nixl over tcp, decode stopped 10 s with requests posted",
            rooms=len(rooms), failed=len(failed),
            engine_errors=prefill_stats.get("engine_errors", 0),
            quarantined=prefill_stats.get("quarantined", 0),
            quarantine_unflushed=prefill_stats.get("quarantine_unflushed", 0),
            stopped_at=round(t0, 2),
            late_writes=sum(r["late_writes"] for r in reports.values()),
            corrupt=sum(r["corrupt"] for r in reports.values()),
            leaked=sum(r["leaked"] for r in reports.values()),
        )
        record(row)
        for role, report in reports.items():
            check_final(report, role)
