"""``trio-pd bench``: quick mode end to end (subprocess, as a user runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from trio_pd import KVPoll, cli
from trio_pd.tools import _bench, _demo

from .helpers.engines import ENGINES

# CPU and timing figures: measured alone, after the parallel pass
pytestmark = pytest.mark.serial


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
    # every run is verified, each round's timed run and its lateness run: per run, the
    # load's bytes but for its aux rows (checked apart, by stamp)
    runs = 2 * r["options"]["ceiling_repeats"]
    assert r["verified_bytes"] % runs == 0
    assert 0 <= r["bytes"] - r["verified_bytes"] // runs <= 1024 * r["requests"]
    assert r["loop_samples"] > 0  # the lateness run happened
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
    # the same requests through the trio API and both facades, alternated: process CPU per
    # request of each, and each facade's excess over the trio API
    f = r["facades"]
    for name in ("trio", "thread", "asyncio"):
        assert f[f"{name}_us_per_request"] > 0 and f[f"{name}_wall_us_per_request"] > 0, f
        assert f[f"{name}_failed"] == 0, f
        assert len(f[f"{name}_us_per_request_runs"]) == f["workload"]["rounds"]
    for name in ("thread", "asyncio"):
        assert f[f"{name}_over_trio_us"] == round(
            f[f"{name}_us_per_request"] - f["trio_us_per_request"], 1)
    assert "facades<=300us/request" in r["targets"]
    # the same bytes at TP 1->1 and 1->4, verified by the demo's runner
    tp = r["tp_mismatch"]
    assert tp["tp1_1_gbps"] > 0 and tp["tp1_4_gbps"] > 0
    assert tp["ratio"] == round(tp["tp1_4_gbps"] / tp["tp1_1_gbps"], 3)
    # the layer-wise phase: both modes ran, every request verified
    lw = r["layerwise"]
    assert lw["corrupt"] == 0 and "layerwise_tail<=2_layers" in r["targets"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ --preset peer


@pytest.mark.processes
@pytest.mark.parametrize("engine", ENGINES)
def test_bench_peer_preset_quick(engine: str, tmp_path: Path) -> None:
    """``--preset peer --quick``: prefill and decode ran in processes of their own (not this
    test's, not the bench's, not each other's), every request verified on decode, nothing
    corrupt, late, leaked or hung; the figures, the table and the plot are there."""
    png = tmp_path / "peer.png"
    proc = subprocess.run(
        [sys.executable, "-m", "trio_pd.cli", "bench", "--preset", "peer", "--quick", "--json",
         "--engine", engine, "--plot", str(png)],
        capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["preset"] == "peer" and r["options"]["engine"] == engine
    p = r["peer"]
    w = p["workload"]
    assert (w["requests"], w["pages"], w["item_bytes"], w["buffers"], w["chunk_pages"],
            w["concurrency"]) == (20, 32, 16 << 10, 16, 8, 8)
    assert w["request_bytes"] == 32 * 16 * (16 << 10)
    assert p["requests"] == p["succeeded"] == p["verified_requests"] == 20
    assert p["verified_bytes"] == 20 * w["request_bytes"]
    for key in ("failed", "corrupt_pages", "source_uaf_pages", "late_writes", "leaked_pages",
                "hung", "released_by_timeout"):
        assert p[key] == 0, key
    assert p["problems"] == []
    assert p["gbps"] > 0 and p["requests_per_s"] > 0 and p["seconds"] > 0
    assert 0 < p["request_ms"]["p50"] <= p["request_ms"]["p99"]
    # one process per role: the test's, the bench's, prefill's and decode's all differ
    pids = [os.getpid(), p["bench_pid"], p["prefill"]["pid"], p["decode"]["pid"]]
    assert len(set(pids)) == 4 and all(x > 0 for x in pids), pids
    for role in ("prefill", "decode"):
        x = p[role]
        # the process's CPU (every thread) includes its event loop's filling / verifying
        assert x["cpu_ms_per_request"] > x["harness_ms_per_request"] > 0, x
        assert x["cpu_ms_per_request"] == round(x["cpu_seconds"] / 20 * 1e3, 3)
    assert _bench.problems(r) == []
    console = Console(record=True, width=200)
    console.print(_bench.table(r))
    text = console.export_text()
    assert "--preset peer" in text and "20 of 20 requests" in text, text
    assert f"pid {p['decode']['pid']}" in text, text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.processes
def test_bench_peer_preset_with_landing_pages(tmp_path: Path) -> None:
    """``--preset peer --landing-bytes N``: decode's rank has a landing area, every request
    (scattered pages) lands and is verified, every chunk is staged on prefill."""
    proc = subprocess.run(
        [sys.executable, "-m", "trio_pd.cli", "bench", "--preset", "peer", "--quick", "--json",
         "--landing-bytes", str(64 << 20)],
        capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    p = json.loads(proc.stdout)["peer"]
    assert p["workload"]["landing_bytes"] == 64 << 20
    assert p["requests"] == p["succeeded"] == p["verified_requests"] == 20
    assert p["decode"]["rooms_landed"] == 20 and p["decode"]["landing_full"] == 0
    assert p["prefill"]["chunks_staged"] >= p["prefill"]["engine_calls"] > 0
    assert p["problems"] == []


def test_peer_preset_options() -> None:
    """The preset's workload as the demo runs it, and what --quick shrinks."""
    full, quick = _bench.BenchOptions.peer(), _bench.BenchOptions.peer("nixl", quick=True)
    assert (full.load_requests, quick.load_requests) == (200, 20)
    assert full.item_len == 16 << 10 and full.num_buffers == 16 and quick.engine == "nixl"
    d = _bench.peer_demo_options(full)
    assert d.random_pages and d.requests == 200 and d.concurrency == 8 and d.chunk_pages == 8
    assert d.min_tokens == d.max_tokens == 32 * d.page_size
    assert full.option_problem() is None
    assert len(_bench.phases(quick)) == 20  # one progress step per request


def test_peer_preset_counts_what_the_processes_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_peer's figures come from the rank processes' reports, one progress step per
    request; a corrupt page, or a request decode did not verify, is a problem (exit 1)."""
    opts = _bench.BenchOptions.peer(quick=True)
    d = _bench.peer_demo_options(opts)
    n = d.requests
    done = dict.fromkeys(range(n), int(KVPoll.Success))
    runs: list[dict[str, Any]] = []

    async def fake(options: Any, progress: Any, **_: Any) -> dict[str, Any]:
        assert options == d
        for _ in range(n):
            progress()
        dec = _demo.RankResult("decode", 0, outcomes=dict(done), pid=11, cpu_seconds=2.0,
                               harness_cpu_seconds=0.5, bytes=runs[-1]["bytes"],
                               corrupt_pages=runs[-1]["corrupt"],
                               active=[(1.0 + i, 1.5 + i) for i in range(n)])
        pre = _demo.RankResult("prefill", 0, outcomes=dict(done), pid=12, cpu_seconds=1.0,
                               harness_cpu_seconds=0.25)
        return _demo.summarize(options, [pre, dec], 30.0)

    monkeypatch.setattr(_demo, "run_processes", fake)
    ticks: list[str] = []
    runs.append({"bytes": n * opts.request_bytes, "corrupt": 0})
    r = _bench.run(opts, ticks.append)
    assert len(ticks) == len(_bench.phases(opts)) == n
    p = r["peer"]
    assert p["verified_requests"] == n and _bench.problems(r) == []
    assert (p["prefill"]["pid"], p["decode"]["pid"]) == (12, 11)
    assert p["decode"]["cpu_ms_per_request"] == 2.0 / n * 1e3
    assert p["decode"]["harness_ms_per_request"] == 0.5 / n * 1e3
    assert p["request_ms"] == {"p50": 500.0, "p99": 500.0} and p["seconds"] == n * 0.5
    runs.append({"bytes": (n - 1) * opts.request_bytes, "corrupt": 0})
    assert any("verified 19 requests" in x for x in _bench.problems(_bench.run(opts)))
    runs.append({"bytes": n * opts.request_bytes, "corrupt": 3})
    assert any("corrupt_pages = 3" in x for x in _bench.problems(_bench.run(opts)))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--preset", "peer", "--coalesce-pages", "4"], "--coalesce-pages"),
        (["--preset", "bogus"], "--preset"),
        (["--landing-bytes", "1024"], "--landing-bytes"),
        (["--preset", "peer", "--landing-bytes", "-1"], "--landing-bytes"),
    ],
)
def test_bench_refuses_bad_preset_combinations(
    argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def started(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the bench started running despite a bad option")

    for module, name in ((_demo, "run_processes"), (_bench, "run"), (_bench, "run_peer")):
        monkeypatch.setattr(module, name, started)
    saved = dict(os.environ)  # main() sets engine log variables
    try:
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "--quick", *argv])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("trio-pd bench: error: "), err
    assert says in lines[0], lines[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_bench_layers_preset_json_and_plot(engine: str, tmp_path: Path) -> None:
    """``--preset layers``: only the layer-wise phase, whole requests against layer by
    layer, alternated; every field there, every request verified, the plot written."""
    png = tmp_path / "layers.png"
    proc = subprocess.run(
        [sys.executable, "-m", "trio_pd.cli", "bench", "--preset", "layers", "--quick",
         "--json", "--engine", engine, "--layer-compute-ms", "1.5", "--plot", str(png)],
        capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    lw = r["layerwise"]
    o = lw["options"]
    assert o["compute_ms"] == 1.5 and o["engine"] == engine
    assert lw["corrupt"] == 0
    for mode in ("whole", "layerwise"):
        for key in ("after_compute_ms", "ttft_ms"):
            d = lw[f"{mode}_{key}"]
            assert 0 < d["min"] <= d["p50"] <= d["max"], (mode, key, d)
        assert len(lw[f"{mode}_after_compute_ms_runs"]) == o["rounds"]
        # a request takes at least its compute
        assert lw[f"{mode}_ttft_ms"]["min"] >= o["layers"] * o["compute_ms"]
    assert lw["request_bytes"] == lw["layer_bytes"] * o["layers"]
    assert set(r["targets"]) == {"layerwise_tail<=2_layers"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
