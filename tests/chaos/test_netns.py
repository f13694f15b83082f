"""Chaos, scenario 3: a network partition between two network namespaces this test creates.

Bootstrap and prefill run in namespace A (10.200.n.1), decode in namespace B (10.200.n.2),
joined by a veth pair on a private /30; Mooncake's TCP transport and the ZeroMQ control plane
bind the namespace's address. Mid-transfer both ends of the veth pair go down, for 20 s and
for 45 s (longer than every deadline: heartbeat 3 s, MC_TRANSFER_TIMEOUT 5 s, the probe and
the ack timeout 10 s, the prefill bootstrap timeout 30 s), then up again.

While the link is down a probe of the other side cannot connect (unreachable, not refused):
liveness is UNKNOWN, so decode must keep every page of a failed room and prefill every page
of a failed engine call. After the link returns: 0 late writes (TCP may still deliver what
Mooncake queued), the drain proofs come, and new requests are served.

Kill during a partition: prefill is killed 2 s into a partition, while its writes to decode
sit in its kernel's send queues. Its kernel keeps those orphaned connections and retransmits
their bytes once the link is back. Decode must not hand the pages back on the refused
connect it then gets: it fences the writer off at its own end first (its engine's
connections from prefill's host shut down), so the retransmitted bytes meet a reset.

Skipped, with the reason, where ``ip netns add`` is not permitted. The namespaces (and with
them the veth pair) are deleted in a ``finally``; only addresses of those namespaces are used.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from .harness import (
    Cluster,
    NetPair,
    Proc,
    check_final,
    cluster,
    engine_calls,
    final,
    in_flight,
    netns_pair,
    netns_permitted,
    ns_connections,
    ns_counter,
    record,
    wait_done,
    wait_released,
)

pytestmark = [pytest.mark.chaos, pytest.mark.processes, pytest.mark.timeout(400)]

IN_FLIGHT = 16
AFTER = 8


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    return netns_permitted()


def _rel(events: dict[int, dict[str, Any]], t0: float) -> list[float]:
    return sorted(round(e["t"] - t0, 2) for e in events.values())


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}..{max(values):.2f}" if values else ".."


async def _in_flight_across(c: Cluster, net: NetPair) -> tuple[Proc, Proc, list[int]]:
    """Bootstrap and prefill in namespace A, decode in B; 4 rooms served, then
    ``IN_FLIGHT`` rooms announced and under way (each partly written). Returns the prefill
    and decode ranks and the rooms' indices."""
    await c.bootstrap(host=net.addr_a, netns=net.a)
    prefill = await c.rank("prefill", host=net.addr_a, netns=net.a)
    decode = await c.rank("decode", host=net.addr_b, netns=net.b)
    warm = c.submit(prefill, [decode], 4, pages=16, chunks=2, gap=0.0)
    got = await wait_done(decode, warm, 60)
    assert all(e["status"] == "Success" for e in got.values()), got
    base = await engine_calls(prefill)
    rooms = c.submit(prefill, [decode], IN_FLIGHT, chunks=16, gap=0.1)
    await in_flight(prefill, base, 2 * IN_FLIGHT, 30)
    return prefill, decode, rooms


async def _partition(tmp: Path, n: int, down_s: float) -> dict[str, Any]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with netns_pair(n) as net:
        async with cluster(tmp) as c:
            prefill, decode, rooms = await _in_flight_across(c, net)
            t0 = time.time()
            net.link(up=False)
            try:
                with trio.move_on_after(down_s):
                    # a release on proof other than a returned engine call, while the link
                    # is down, ends the wait early and fails the test below
                    def early(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
                        return [e for e in ev if e["ev"] == "released" and e["i"] in rooms
                                and e["proof"] not in ("success", "completed")]

                    async with trio.open_nursery() as watch:
                        watch.start_soon(decode.wait_for, early, down_s + 1, "early release")
                        watch.start_soon(prefill.wait_for, early, down_s + 1, "early release")
                # snapshot what each side did while the link was down
                dec_done = {e["i"]: e for e in decode.of("done") if e["i"] in rooms}
                pre_done = {e["i"]: e for e in prefill.of("done") if e["i"] in rooms}
                dec_early = [e for e in decode.of("released") if e["i"] in rooms
                             and e["proof"] != "success"]
                pre_early = [e for e in prefill.of("released") if e["i"] in rooms
                             and e["proof"] not in ("success", "completed")]
            finally:
                t_up = time.time()
                net.link(up=True)
            assert not dec_early, f"decode released while partitioned: {dec_early}"
            assert not pre_early, f"prefill released a failed call while partitioned: {pre_early}"

            done = await wait_done(decode, rooms, 120)
            failed = [i for i, e in done.items() if e["status"] != "Success"]
            released = await wait_released(decode, failed, 120)
            proofs = sorted({e["proof"] for e in released.values()})
            assert set(proofs) <= {"ack", "gone"}, proofs
            pdone = await wait_done(prefill, rooms, 120)
            prel = await wait_released(prefill, rooms, 120)

            new = c.submit(prefill, [decode], AFTER, pages=16, chunks=2, gap=0.0)
            after = await wait_done(decode, new, 90)
            served = sum(1 for e in after.values() if e["status"] == "Success")
            bad = {i: e.get("failure") for i, e in after.items() if e["status"] != "Success"}
            reports = {"prefill": await final(prefill), "decode": await final(decode)}
            row = dict(
                scenario=f"partition {down_s:g} s", in_flight=IN_FLIGHT, failed=len(failed),
                decode_failed_while_down=sum(
                    1 for e in dec_done.values() if e["status"] != "Success"),
                prefill_failed_while_down=sum(
                    1 for e in pre_done.values() if e["status"] != "Success"),
                decode_time_to_failed_s=_span(_rel({i: done[i] for i in failed}, t0)),
                prefill_time_to_terminal_s=_span(_rel(pdone, t0)),
                decode_release_after_link_up_s=_span(_rel(released, t_up)),
                decode_release_proofs=proofs,
                prefill_release_proofs=sorted({e["proof"] for e in prel.values()}),
                released_while_down=len(dec_early) + len(pre_early),
                served_after=served,
                late_writes=sum(r["late_writes"] for r in reports.values()),
                corrupt=sum(r["corrupt"] for r in reports.values()),
                guard_bytes_touched=sum(r["guard_bytes_touched"] for r in reports.values()),
                leaked=sum(r["leaked"] for r in reports.values()),
                failures=sorted({(e.get("failure") or "")[:90] for e in done.values()})[:3],
                after_failures=sorted({(f or "")[:90] for f in bad.values()})[:3],
                decode_stats={k: v for k, v in reports["decode"]["stats"].items() if v},
                prefill_stats={k: v for k, v in reports["prefill"]["stats"].items() if v},
            )
            record(row)
            for role, report in reports.items():
                check_final(report, role)
            assert served == AFTER, bad
            return row


async def test_partition_20s(tmp_path: Path) -> None:
    """The veth link down for 20 s mid-transfer, then up."""
    await _partition(tmp_path, 1, 20.0)


async def test_partition_longer_than_every_deadline(tmp_path: Path) -> None:
    """The veth link down for 45 s mid-transfer (past every deadline), then up."""
    await _partition(tmp_path, 2, 45.0)


#: kill prefill this long into the partition (its writes are then queued in its kernel), and
#: bring the link back this long after the partition began
KILL_AT = 2.0
DOWN = 20.0


def _queued_to(ns: str, host: str) -> list[int]:
    """Send queues of the connections in namespace ``ns`` to ``host`` that hold bytes."""
    return [r.tx_queue for r in ns_connections(ns) if r.conn[2] == host and r.tx_queue > 0]


async def test_kill_during_a_partition(tmp_path: Path) -> None:
    """Prefill killed ``KILL_AT`` s into a ``DOWN`` s partition: once the link is back,
    decode's probe is refused and its engine fences the writer's connections before any page
    goes back; the bytes the dead process's kernel still retransmits meet a reset (its
    orphaned connections leave its table). 0 late writes, every page back on that proof.

    (Before: at link-up the refused connect counted as proof, decode released its rooms, and
    the kernel delivered the queued bytes into them: 8 late pages in 2 of 2 runs.)"""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with netns_pair(3) as net:
        async with cluster(tmp_path, decode_config={"ack_timeout": 1.0}) as c:
            prefill, decode, rooms = await _in_flight_across(c, net)
            aborts_before = ns_counter(net.b, "TCPAbortOnData")
            t0 = time.time()
            net.link(up=False)
            try:
                await trio.sleep(KILL_AT)  # (the writes queue up behind the dead link)
                prefill.signal(signal.SIGKILL)
                with trio.fail_after(10):
                    await prefill.process.wait()
                orphaned = _queued_to(net.a, net.addr_b)  # what its kernel still holds
                await trio.sleep(DOWN - (time.time() - t0))
                early = [e for e in decode.of("released") if e["i"] in rooms
                         and e["proof"] != "success"]
            finally:
                t_up = time.time()
                net.link(up=True)
            assert not early, f"decode released while partitioned: {early}"

            done = await wait_done(decode, rooms, 120)
            failed = [i for i, e in done.items() if e["status"] != "Success"]
            released = await wait_released(decode, failed, 120)
            proofs = sorted({e["proof"] for e in released.values()})
            # The dead kernel's retransmissions meet resets: its orphans leave its table
            # (bounded: the backoff after DOWN s is at most a few tens of seconds)
            with trio.move_on_after(90):
                while _queued_to(net.a, net.addr_b):  # noqa: ASYNC110 - a kernel table
                    await trio.sleep(0.5)
            left = _queued_to(net.a, net.addr_b)
            t_drained = time.time()
            report = await final(decode)
            stats = report["stats"]
            row = dict(
                scenario=f"kill {KILL_AT:g} s into a {DOWN:g} s partition",
                in_flight=IN_FLIGHT, failed=len(failed),
                orphaned_connections_with_bytes=len(orphaned),
                orphaned_bytes=sorted(orphaned),
                decode_release_after_link_up_s=_span(_rel(released, t_up)),
                orphans_gone_after_link_up_s=round(t_drained - t_up, 1),
                decode_release_proofs=proofs,
                writers_fenced=stats["writers_fenced"],
                aborts_on_data=ns_counter(net.b, "TCPAbortOnData") - aborts_before,
                late_writes=report["late_writes"], leaked=report["leaked"],
                corrupt=report["corrupt"],
                decode_stats={k: v for k, v in stats.items() if v},
            )
            record(row)
            check_final(report, "decode")
            assert proofs == ["gone"], proofs
            assert stats["writers_fenced"] >= 1 and stats["released_peer_gone"] >= 1
            assert not left, f"the dead prefill's kernel still holds bytes for decode: {left}"
