"""The demo driver (``trio_pd.tools._demo``) and the ``trio-pd demo`` command, on real engines."""

from __future__ import annotations

import json
import sys

import trio

from trio_pd import KVPoll
from trio_pd.tools._demo import (
    DemoOptions,
    RankResult,
    check,
    plan_requests,
    run_in_process,
    summarize,
)

SMALL = dict(requests=20, concurrency=8, max_tokens=256, chunk_pages=4, layers=2)


async def test_demo_clean_run(engine_name: str) -> None:
    opts = DemoOptions(engine=engine_name, **SMALL)  # type: ignore[arg-type]
    with trio.fail_after(30):
        summary = await run_in_process(opts)
    assert summary["succeeded"] == summary["requests"] == opts.requests, summary
    assert summary["failed"] == summary["aborted"] == 0
    assert summary["corrupt_pages"] == summary["source_uaf_pages"] == 0
    assert summary["bytes"] > 0
    assert check(opts, summary) == []


async def test_demo_aborts_and_faults_leave_no_trace(engine_name: str) -> None:
    """Aborts at random points on both sides plus engine faults: requests fail or abort, but
    no page is corrupt, written late or leaked, nothing hangs, and nothing was freed by a
    timeout (every release had its drain proof). The quarantine fence makes this ~11 s.
    (Faults are drawn per engine call, and a backlog coalesces chunks into fewer calls: at
    0.2 this run sees 3-4 engine errors.)"""
    opts = DemoOptions(
        engine=engine_name, requests=30, concurrency=8, max_tokens=256, chunk_pages=2,
        layers=1, abort_rate=0.3, fault_rate=0.2, seed=0,
    )
    with trio.fail_after(40):
        summary = await run_in_process(opts)
    for key in ("late_writes", "leaked_pages", "hung", "released_by_timeout", "corrupt_pages",
                "source_uaf_pages"):
        assert summary[key] == 0, (key, summary)
    assert summary["succeeded"] + summary["failed"] + summary["aborted"] == opts.requests
    planned_aborts = sum(r.abort is not None for r in plan_requests(opts))
    assert planned_aborts > 0 and summary["aborted"] <= planned_aborts
    assert summary["succeeded"] > 0
    assert summary["engine_errors"] >= 1  # the faults really happened (seeded)
    # every lease quarantined by an engine error came back after its fence
    assert summary["quarantined"] == summary["released_after_quarantine"]
    assert check(opts, summary) == []


async def test_demo_faults_fail_only_the_rooms_in_their_calls(engine_name: str) -> None:
    """Injected write errors only, no aborts: every failed request had a room in a failed
    engine call (the blast radius of an error is its call), and the summary says so. Before
    the fix one error marked the peer failed and the rooms sent meanwhile failed too (8-23
    of 30 requests for 1-3 errors at ``--fault-rate 0.05``)."""
    opts = DemoOptions(
        engine=engine_name, requests=40, concurrency=8, max_tokens=256, chunk_pages=2,
        layers=1, fault_rate=0.1, fault_kinds=("fail", "partial"), seed=3,
        quarantine_fence=1.0,
    )
    with trio.fail_after(40):
        summary = await run_in_process(opts)
    assert summary["failed_engine_calls"] >= 1, summary  # the faults really happened (seeded)
    assert 1 <= summary["failed"] <= summary["rooms_in_failed_calls"], summary
    assert summary["peers_failed"] == 0, summary
    assert summary["blast_radius"]["failed_per_failed_call"] == round(
        summary["failed"] / summary["failed_engine_calls"], 2)
    assert check(opts, summary) == []


def test_check_flags_a_failure_beyond_its_call() -> None:
    opts = DemoOptions(requests=10, fault_rate=0.1)
    summary = {"requests": 10, "succeeded": 4, "failed": 6, "aborted": 0,
               "rooms_in_failed_calls": 2}
    assert any("more than the 2 rooms in failed engine calls" in p
               for p in check(opts, summary)), check(opts, summary)
    assert check(opts, {**summary, "rooms_in_failed_calls": 6}) == []


def test_check_flags_corrupt_pages() -> None:
    opts = DemoOptions(requests=3)
    decode = RankResult("decode", 0, outcomes={i: int(KVPoll.Success) for i in range(3)})
    prefill = RankResult("prefill", 0, outcomes=dict(decode.outcomes))
    clean = summarize(opts, [prefill, decode], 1.0)
    assert clean["succeeded"] == 3 and check(opts, clean) == []

    decode.corrupt_pages = 2
    problems = check(opts, summarize(opts, [prefill, decode], 1.0))
    assert any("corrupt_pages = 2" in p for p in problems), problems

    for key in ("late_writes", "leaked_pages", "hung", "released_by_timeout"):
        assert any(key in p for p in check(opts, {**clean, key: 1})), key
    assert check(opts, {**clean, "succeeded": 2}) == ["requests unaccounted for"]
    assert any("without injected faults" in p
               for p in check(opts, {**clean, "succeeded": 2, "failed": 1}))


async def test_demo_mla_with_default_kv_heads() -> None:
    """MLA ignores kv_heads (an MLA rank holds one replicated latent): the MHA default of 8
    must not make the bootstrap service refuse the ranks."""
    opts = DemoOptions(layout="mla", requests=4, max_tokens=64, concurrency=2, layers=1)
    with trio.fail_after(20):
        summary = await run_in_process(opts)
    assert summary["succeeded"] == 4


async def test_cli_demo_json() -> None:
    cmd = [sys.executable, "-m", "trio_pd.cli", "demo", "--json", "--requests", "20"]
    with trio.fail_after(60):
        proc = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    summary = json.loads(proc.stdout.decode())  # --json prints one object, nothing else
    for key in ("requests", "succeeded", "failed", "aborted", "bytes", "seconds", "gbps",
                "corrupt_pages"):
        assert key in summary, key
    assert summary["requests"] == summary["succeeded"] == 20
    assert summary["failed"] == summary["aborted"] == summary["corrupt_pages"] == 0
    assert summary["bytes"] > 0 and summary["seconds"] > 0



def test_a_rank_holding_fewer_heads_expects_the_bytes_of_those_heads() -> None:
    """The test pools' pattern XORed a room key by a byte's place in the page, so at
    4-byte heads a decode rank holding fewer heads than prefill expected other bytes than
    the (correct) ones it got: the demo at TP 1 -> 4 reported every page corrupt (a review
    found it). The key now goes by global head and byte: each rank's expected bytes are the
    slices of the whole pool's, at any head size."""
    from trio_pd.testing.pools import HostKVPool

    for head_bytes in (4, 6, 8, 16):
        whole = HostKVPool(layout="mha", num_pages=4, num_layers=1, page_size=4,
                           head_bytes=head_bytes, heads=4)
        want = whole.expected(7, 4).reshape(2, 4, 4, 4, head_bytes)  # buffers, pages, t, h, k
        for first in range(4):
            rank = HostKVPool(layout="mha", num_pages=4, num_layers=1, page_size=4,
                              head_bytes=head_bytes, heads=1, first_head=first)
            got = rank.expected(7, 4).reshape(2, 4, 4, 1, head_bytes)
            assert (got == want[:, :, :, first : first + 1]).all(), (head_bytes, first)


async def test_demo_landing_with_aborts_and_faults_leaves_no_trace(engine_name: str) -> None:
    """Scattered pages on both sides and a landing area on decode, with aborts at random
    points and engine faults: rooms land, and no page (landing pages included) is corrupt,
    written late or leaked, nothing hangs."""
    opts = DemoOptions(
        engine=engine_name, requests=30, concurrency=8, max_tokens=256, chunk_pages=2,
        layers=1, abort_rate=0.3, fault_rate=0.2, seed=0, random_pages=True,
        landing_bytes=1 << 20,
    )
    with trio.fail_after(40):
        summary = await run_in_process(opts)
    assert sum(r["rooms_landed"] for r in summary["ranks"]) > 0, summary["ranks"]
    assert summary["leaked_landing_pages"] == 0
    assert summary["engine_errors"] >= 1 and summary["aborted"] >= 1, summary
    assert check(opts, summary) == []


def test_check_flags_leaked_landing_pages() -> None:
    """A landing range never given back makes the run a failure, as a leaked page does."""
    opts = DemoOptions(requests=1)
    decode = RankResult("decode", 0, outcomes={0: int(KVPoll.Success)})
    prefill = RankResult("prefill", 0, outcomes=dict(decode.outcomes))
    decode.leaked_landing_pages = 3
    problems = check(opts, summarize(opts, [prefill, decode], 1.0))
    assert problems == ["leaked_landing_pages = 3"], problems


async def test_cli_demo_with_a_landing_area() -> None:
    """``trio-pd demo --random-pages --landing-bytes N``: the rooms land (the summary's ranks
    say how many), nothing leaks, exit 0."""
    cmd = [sys.executable, "-m", "trio_pd.cli", "demo", "--json", "--requests", "20",
           "--max-tokens", "256", "--random-pages", "--landing-bytes", str(4 << 20)]
    with trio.fail_after(60):
        proc = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    summary = json.loads(proc.stdout.decode())
    assert summary["succeeded"] == 20 and summary["leaked_landing_pages"] == 0
    assert sum(r["rooms_landed"] for r in summary["ranks"]) > 0, summary["ranks"]
