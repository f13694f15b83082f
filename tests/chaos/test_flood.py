"""Chaos, scenario 8: a descriptor flood. An attacker opens raw TCP connections (no ZeroMQ
greeting, no key) to both agents' control endpoints, more than their process can hold, and
keeps them open (reopening each one the agents close), while requests run and an engine call
fails. The agents run in one child process (tests/chaos/flood.py) at a lowered
``RLIMIT_NOFILE``; this process is the attacker.

Asserts: no agent dies; every request ends (Success, or Failed with a reason); what could
not get a descriptor is counted (``resources_exhausted``, ``checks_unknown``); once the
flood stops, requests succeed again. With the hard limit above the soft one, the agents
raise theirs and the same flood costs them nothing.
"""

from __future__ import annotations

import json
import time

import pytest

from .flood import Child, Flood

pytestmark = [pytest.mark.chaos, pytest.mark.processes, pytest.mark.timeout(400)]


def _local(stats: dict[str, dict[str, int]]) -> dict[str, int]:
    names = ("resources_exhausted", "checks_unknown", "failed", "succeeded", "peers_failed")
    return {f"{side}.{n}": stats[side][n] for side in ("prefill", "decode") for n in names}


@pytest.mark.parametrize("hard", [True, False], ids=["at-the-hard-limit", "raised"])
def test_a_descriptor_flood_kills_no_agent(hard: bool) -> None:
    child = Child(1024, hard=hard)
    flood = None
    try:
        first = child.ask(requests=1)["outcomes"]
        assert first == ["Success"], first
        t0 = time.monotonic()
        flood = Flood(child.started["endpoints"], 1100 // 4 + 1, sustain=True)
        opened = flood.open_count()
        during = child.ask(requests=4)["outcomes"]
        child.ask(fault=True)
        faulted = child.ask(requests=2)["outcomes"]
        flooded_s = time.monotonic() - t0
        flood.close()
        after = [child.ask(requests=1)["outcomes"][0] for _ in range(6)]
        stats = child.ask(stats=True)
        print(json.dumps({
            "hard": hard, "limit": child.started["limit"], "opened": opened,
            "closed_by_agents": flood.closed_by_peer, "refused": flood.refused,
            "flooded_s": round(flooded_s, 1), "during": during, "faulted": faulted,
            "after": after, **_local(stats),
        }))
        for outcome in during + faulted:
            assert outcome == "Success" or outcome.startswith("Failed"), outcome
        assert after[-3:] == ["Success"] * 3, after
        if hard:
            assert child.started["limit"] == 1024
        else:
            assert child.started["limit"] > 1024
            assert during == ["Success"] * 4, during
            assert stats["prefill"]["resources_exhausted"] == 0
            assert stats["decode"]["resources_exhausted"] == 0
    finally:
        if flood is not None:
            flood.close()
        status, log = child.close()
    assert status == 0, log[-3000:]
