"""``trio-pd bench``: quick mode end to end (subprocess, as a user runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("engine", ["mooncake"])
def test_bench_quick_json_and_plot(engine: str, tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "trio_pd.cli", "bench", "--quick", "--json", "--engine", engine,
         "--plot", str(png)],
        capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    for key in ("ceiling_gbps", "trio_pd_gbps", "ratio", "overhead_us", "loop_lateness_ms",
                "abort_release_ms", "scale"):
        assert key in r, key
    assert r["ceiling_gbps"] > 0 and r["trio_pd_gbps"] > 0 and r["ratio"] > 0
    assert r["corrupt_pages"] == 0 and r["failed"] == 0
    assert r["verified_bytes"] > 0
    for key in ("overhead_us", "loop_lateness_ms", "abort_release_ms", "abort_release_burst_ms"):
        assert set(r[key]) >= {"p50", "p99"}, key
    assert r["overhead_us"]["p50"] is not None
    # overhead = each sample minus its own write, timed on the lane's thread: positive, and
    # smaller than the whole send -> Success time by about the engine's time
    assert 0 < r["engine_call_in_run_us"]["p50"] < r["trio_pd_chunk_us"]["p50"]
    assert 0 < r["overhead_us"]["p50"] < r["trio_pd_chunk_us"]["p50"]
    assert r["overhead_vs_direct_us"]["p50"] is not None
    assert r["engine_call_isolated_us"]["p50"] > 0
    assert r["loop_lateness_ms"]["p99"] >= r["loop_lateness_ms"]["p50"] >= 0
    assert r["abort_samples"] == 0 or r["abort_release_ms"]["p50"] > 0
    assert r["abort_burst_samples"] == 0 or r["abort_release_burst_ms"]["p50"] > 0
    assert [x["rooms"] for x in r["scale"]] == r["options"]["scale_rooms"]
    for x in r["scale"]:
        assert x["gbps"] > 0 and x["bytes_per_room"] > 0 and x["failed"] == 0
    # the event loop's CPU per request, and the thread facade beside the trio API
    assert r["loop_cpu_us_per_request"] > 0 and r["loop_cpu_us_per_mib"] > 0
    assert 0 < r["facade_poll_us"]["p50"] < r["facade_hop_us"]["p50"]  # poll() never hops
    assert r["facade_chunk_us"]["p50"] > 0
    assert r["facade_chunk_vs_trio_us"] == round(
        r["facade_chunk_us"]["p50"] - r["trio_pd_chunk_us"]["p50"], 1)
    # the same bytes at TP 1->1 and 1->4, verified by the demo's runner
    tp = r["tp_mismatch"]
    assert tp["tp1_1_gbps"] > 0 and tp["tp1_4_gbps"] > 0
    assert tp["ratio"] == round(tp["tp1_4_gbps"] / tp["tp1_1_gbps"], 3)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
