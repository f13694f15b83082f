"""Chaos, scenarios 1 and 2: bootstrap, prefill and decode as separate OS processes on
guarded, poisoned pools; kill -9 (then a restart) and SIGSTOP (then SIGCONT) of each side in
the middle of transfers.

Each asserts: every room in flight when the fault hit is terminal within its bound; pages go
back only on proof (and which proof); while a stopped peer's liveness is unknown no page is
released; new requests are served after recovery; after the drain 0 late writes, 0 corrupt
pages, 0 guard bytes touched and 0 pages leaked on every live rank.
"""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from .harness import (
    Cluster,
    Proc,
    check_final,
    cluster,
    engine_calls,
    final,
    in_flight,
    record,
    wait_done,
    wait_released,
)

pytestmark = [pytest.mark.chaos, pytest.mark.processes, pytest.mark.timeout(300)]

IN_FLIGHT = 16  # requests under way when the fault hits (64 pages, 16 chunks, 0.1 s apart)
AFTER = 8  # requests served after recovery
#: SIGSTOP length: longer than MC_TRANSFER_TIMEOUT (5 s) and than a probe (ack_timeout 10 s)
STOP_S = 15.0


def _rel(events: dict[int, dict[str, Any]], t0: float) -> list[float]:
    return sorted(round(e["t"] - t0, 2) for e in events.values())


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}..{max(values):.2f}" if values else ".."


async def _serve_after(c: Cluster, prefill: Proc, decode: Proc) -> tuple[int, list[str]]:
    """New requests after recovery (the caller asserts all succeed, verified): how many
    succeeded, and the failures of the others."""
    new = c.submit(prefill, [decode], AFTER, pages=16, chunks=2, gap=0.0)
    done = await wait_done(decode, new, 60)
    ok = sum(1 for e in done.values() if e["status"] == "Success")
    bad = sorted({str(e.get("failure"))[:120] for e in done.values() if e["status"] != "Success"})
    await wait_done(prefill, new, 30)
    return ok, bad


async def _warm(c: Cluster, prefill: Proc, decode: Proc) -> None:
    first = c.submit(prefill, [decode], 4, pages=16, chunks=2, gap=0.0)
    done = await wait_done(decode, first, 60)
    assert all(e["status"] == "Success" for e in done.values()), done


#: a landing area of 512 landing pages (32 KiB each: 8 buffers of a 4 KiB page): half the
#: rooms in flight land, the others find no free run (``landing_full``)
LANDING = {"random_pages": True, "decode_config": {"landing_bytes": 16 << 20}}


async def _stats(proc: Proc) -> dict[str, Any]:
    seen = len(proc.of("stats"))
    proc.send({"cmd": "stats"})
    got = await proc.wait_for(lambda ev: proc.of("stats")[seen:], 10, "stats")
    stats: dict[str, Any] = got[0]["stats"]
    return stats


async def _scenario(
    tmp: Path, victim_role: str, fault: str, landing: bool = False
) -> dict[str, Any]:
    async with cluster(tmp, **(LANDING if landing else {})) as c:
        await c.bootstrap()
        procs = {"prefill": await c.rank("prefill"), "decode": await c.rank("decode")}
        await _warm(c, procs["prefill"], procs["decode"])
        survivor_role = "decode" if victim_role == "prefill" else "prefill"
        victim, survivor = procs[victim_role], procs[survivor_role]

        base = await engine_calls(procs["prefill"])
        rooms = c.submit(procs["prefill"], [procs["decode"]], IN_FLIGHT, chunks=16, gap=0.1)
        await in_flight(procs["prefill"], base, 2 * IN_FLIGHT, 30)
        t0 = time.time()
        victim.signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

        done = await wait_done(survivor, rooms, 60)
        failed = [i for i, e in done.items() if e["status"] != "Success"]
        assert failed, "the fault hit no room in flight"
        failed_done = {i: done[i] for i in failed}
        # every room in flight is terminal within its bound
        bound = 15.0 if survivor_role == "decode" else 30.0
        assert max(_rel(failed_done, t0)) < bound, _rel(failed_done, t0)
        # the peer's loss is named as such, and logged once by the survivor
        victim_endpoint = victim.of("ready")[0]["endpoint"]
        if victim_role == "decode":
            not_lost = {e.get("failure") for e in failed_done.values()
                        if not str(e.get("failure")).startswith("PeerLost(")}
            assert not not_lost, f"failed rooms not PeerLost: {sorted(not_lost)[:3]}"
            lost = survivor.log_lines(f"decode peer {victim_endpoint} lost: ")
            gone = survivor.log_lines(f"decode peer {victim_endpoint} (engine session")
            assert len(lost) + len(gone) == 1, (lost, gone)
        else:
            lost = survivor.log_lines(f"at {victim_endpoint} lost: ")
            assert len(lost) == 1 and "heartbeats unanswered" in lost[0], lost

        held_while_stopped = 0
        if fault == "stop":
            # Held (liveness UNKNOWN) while the peer is stopped: not one page released on
            # decode; on prefill none of a failed engine call (its quarantine), while pages
            # whose calls all returned ("completed": no engine reads them) may go back.
            def early(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
                return [e for e in ev if e["ev"] == "released" and e["i"] in failed
                        and e["proof"] != "completed"]

            with trio.move_on_after(max(0.0, t0 + STOP_S - time.time())):
                await survivor.wait_for(early, STOP_S + 1, "a release while stopped")
            assert not early(survivor.events), f"released while stopped: {early(survivor.events)}"
            released_early = {e["i"] for e in survivor.of("released") if e["i"] in failed}
            held_while_stopped = len(failed) - len(released_early)
            if landing and victim_role == "prefill":
                # landing ranges are held like the pages, while the writer may still write
                stats = await _stats(survivor)
                assert stats["landing_held"] > 0 and stats["pages_held"] > 0, stats
            t_cont = time.time()
            victim.signal(signal.SIGCONT)
        released = await wait_released(survivor, failed, 90)
        proofs = sorted({e["proof"] for e in released.values()})
        if victim_role == "prefill" and fault == "kill":
            assert proofs == ["gone"], proofs
        if victim_role == "prefill" and fault == "stop":
            assert proofs == ["ack"], proofs
        if victim_role == "decode":
            assert set(proofs) <= {"completed", "quarantine_alive", "quarantine_gone"}, proofs

        if fault == "kill":
            await victim.process.wait()
            victim = await c.rank(victim_role)
            procs[victim_role] = victim
        served, after_failures = await _serve_after(c, procs["prefill"], procs["decode"])
        reports = {role: await final(procs[role]) for role in ("prefill", "decode")}
        row = dict(
            scenario=f"{fault} {victim_role}", in_flight=IN_FLIGHT, failed=len(failed),
            succeeded_in_flight=IN_FLIGHT - len(failed),
            time_to_failed_s=_span(_rel(failed_done, t0)),
            time_to_release_s=_span(_rel(released, t0)),
            release_proofs=proofs,
            held_while_stopped=held_while_stopped,
            release_after_sigcont_s=(
                _span(_rel(released, t_cont)) if fault == "stop" else None
            ),
            served_after=served,
            after_failures=after_failures,
            late_writes=sum(r["late_writes"] for r in reports.values()),
            corrupt=sum(r["corrupt"] for r in reports.values()),
            guard_bytes_touched=sum(r["guard_bytes_touched"] for r in reports.values()),
            leaked=sum(r["leaked"] for r in reports.values()),
            failures=sorted({e.get("failure") or "" for e in failed_done.values()})[:3],
            survivor_stats={k: v for k, v in reports[survivor_role]["stats"].items() if v},
        )
        if landing:
            row["landing"] = {k: reports["decode"]["stats"][k]
                              for k in ("rooms_landed", "landing_full", "landing_held")}
        record(row)
        for role, report in reports.items():
            check_final(report, role)
        if landing:
            assert reports["decode"]["stats"]["rooms_landed"] > 0, row
        assert served == AFTER, f"after recovery {AFTER - served} failed: {after_failures}"
        return row


@pytest.mark.parametrize("victim", ["prefill", "decode"])
async def test_kill9_mid_transfer_then_restart_short(tmp_path: Path, victim: str) -> None:
    """kill -9 of one side while 16 rooms are being written, then a new process of it. Also
    the short chaos run .ci/run makes (``-k short``: these two, about 20 s)."""
    await _scenario(tmp_path, victim, "kill")


@pytest.mark.parametrize("victim", ["prefill", "decode"])
async def test_sigstop_longer_than_every_deadline(tmp_path: Path, victim: str) -> None:
    """SIGSTOP of one side for 15 s (longer than the engine's 5 s deadline and the 10 s probe),
    then SIGCONT: rooms fail, pages stay held while liveness is unknown, and go back on the
    drain acks once the peer runs again."""
    await _scenario(tmp_path, victim, "stop")


@pytest.mark.parametrize(("victim", "fault"), [
    ("prefill", "kill"), ("prefill", "stop"), ("decode", "kill"),
])
async def test_prefill_lost_mid_landed_writes(tmp_path: Path, victim: str, fault: str) -> None:
    """The same with decode's landing area on and pages scattered on both sides (rooms land):
    kill -9 or SIGSTOP of prefill while landed rooms are being written. Each landed room's
    landing range is held as its pages are (on the proof, never while a stopped writer may
    still write), and every landing page is back once the rooms drained (decode's
    ``landing_held`` 0), with 0 late writes, corrupt pages and leaks. And kill -9 of decode
    mid landed writes (its area goes with it): prefill's rooms fail and come back on their
    proofs, and a new decode process lands rooms again."""
    await _scenario(tmp_path, victim, fault, landing=True)


LATE_S = 1.5  # a failed call's bytes land this long after it gave up (within the fence)


@pytest.mark.parametrize("engine", ["mooncake", pytest.param("nixl", marks=pytest.mark.skipif(
    importlib.util.find_spec("nixl_cu12") is None, reason="nixl-cu12 not installed"))])
async def test_prefill_agent_closed_process_and_engine_alive(tmp_path: Path, engine: str) -> None:
    """Writes give up with an engine error while their bytes are still on their way (they
    land ``LATE_S`` s later); then the prefill agent closes, its process and its engine
    alive. The closing agent keeps answering until those rooms' quarantines end and acks
    them; decode releases each on that ack (never on the refused connect it would get from
    a closed agent), so not one byte lands after release.

    (Before: decode released on "gone" as soon as the closed agent's port refused, and the
    queued bytes landed in released pages.)"""
    async with cluster(
        tmp_path, engine=engine, fault=True,
        prefill_config={"quarantine_fence": 3.0}, decode_config={"ack_timeout": 0.5},
    ) as c:
        await c.bootstrap()
        prefill, decode = await c.rank("prefill"), await c.rank("decode")
        await _warm(c, prefill, decode)
        prefill.send({"cmd": "fault", "kind": "late", "delay": LATE_S, "calls": 4})
        rooms = c.submit(prefill, [decode], 8, pages=16, chunks=2, gap=0.0)
        done = await wait_done(decode, rooms, 60)
        failed = [i for i, e in done.items() if e["status"] != "Success"]
        assert failed, "no write failed"
        t0 = time.time()
        prefill.send({"cmd": "close_agent"})
        closed = await prefill.wait_for(lambda ev: prefill.of("agent_closed"), 60, "close")
        released = await wait_released(decode, failed, 60)
        prefill.send({"cmd": "late_done"})
        late = await prefill.wait_for(lambda ev: prefill.of("late_done"), 60, "late writes")
        report = await final(decode)
        prefill_stats = closed[-1]["stats"]
        proofs = sorted({e["proof"] for e in released.values()})
        row = dict(
            scenario=f"prefill agent closed, engine alive ({engine})", failed=len(failed),
            late_blocks=late[-1]["blocks"],
            close_took_s=round(closed[-1]["t"] - t0, 2),
            decode_release_after_close_s=_span(_rel(released, t0)),
            decode_release_proofs=proofs,
            rooms_unacked_at_close=prefill_stats["rooms_unacked_at_close"],
            late_writes=report["late_writes"], leaked=report["leaked"], corrupt=report["corrupt"],
            decode_stats={k: v for k, v in report["stats"].items() if v},
        )
        record(row)
        check_final(report, "decode")
        assert late[-1]["ok"] and late[-1]["blocks"] > 0
        assert proofs == ["ack"], proofs
        assert prefill_stats["rooms_unacked_at_close"] == 0
