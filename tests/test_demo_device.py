"""``trio-pd demo --device cuda`` without a GPU: refused up front, in one line, where the device
path cannot run; and the demo on device pools end to end on the CUDA stand-in of
tests/helpers/fake_cuda.py, whose "device" allocations are host memory it checks every copy
against. Pool creation, the fill, the sanitizer's poison, the aux stamp and the verification
all go through trio_pd.io._cuda's copies there, and the engines are asked to register device
memory. The real device run is tests/test_gpu.py's ``test_demo_on_device_pools``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from trio_pd import KVPoll, cli
from trio_pd.core._memory import stamp_aux_row
from trio_pd.engines import mooncake as mooncake_adapter
from trio_pd.io import _cuda
from trio_pd.testing import device
from trio_pd.testing.device import DeviceKVPool
from trio_pd.testing.pools import SOURCE_POISON
from trio_pd.tools import _demo

from .helpers import fake_cuda as kinds
from .helpers.engines import ENGINES

ROOT = Path(__file__).resolve().parent.parent
SMALL: dict[str, Any] = dict(requests=12, concurrency=4, max_tokens=96, chunk_pages=2, layers=2)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> kinds.FakeRuntime:
    return kinds.install_fake_cuda(monkeypatch)


@pytest.fixture
def engine_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The demo's engines record what they are asked to register (NIXL's fake VRAM is handed
    on as the host memory it is: tests/helpers/fake_cuda.py's RecordingBinding)."""
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(_demo, "make_engine", lambda name: kinds.recording_engine(name, calls))
    return calls


#: cli.main sets engine log variables (GLOG_minloglevel): keep them out of other tests
pytestmark = pytest.mark.usefixtures("keep_environ")


# ------------------------------------------------------------------ refused up front


def test_cli_refuses_device_cuda_on_this_machine() -> None:
    """No cuda-python or no device here: one line naming what is missing, exit status 2,
    and nothing started (not even the security line on stdout)."""
    if _cuda.device_count():
        pytest.skip("this machine has a CUDA device")
    proc = subprocess.run(
        [sys.executable, "-m", "trio_pd", "demo", "--device", "cuda", "--requests", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("trio-pd demo: error: --device cuda "), line
    assert re.search(r"needs (cuda-python|a CUDA driver|a CUDA device)|no CUDA device", line)


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> str:
    """``trio-pd demo ARGV`` in this process; the one error line (exit 2, nothing run)."""

    def started(*_a: Any, **_kw: Any) -> Any:
        raise AssertionError("the demo started despite a bad --device")

    monkeypatch.setattr(_demo, "run_in_process", started)
    monkeypatch.setattr(_demo, "run_processes", started)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", *argv])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "", (exit_.value.code, out, err)
    (line,) = err.splitlines()
    assert line.startswith("trio-pd demo: error: "), line
    return line


def test_device_cuda_refusals_name_what_is_missing(
    fake_cuda: kinds.FakeRuntime, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each missing piece, as the stand-in plays it: a Mooncake wheel that moves host memory
    only, too little device memory for the pools, no device, no driver, no cuda-python."""
    assert _demo.DemoOptions(device="cuda", **SMALL).option_problem() is None
    argv = ["--device", "cuda", "--requests", "2"]
    monkeypatch.setattr(mooncake_adapter, "_cuda_build", lambda: False)
    line = _refusal(argv, capsys, monkeypatch)
    assert "--engine mooncake" in line and "non-CUDA build" in line, line
    monkeypatch.setattr(mooncake_adapter, "_cuda_build", lambda: True)
    fake_cuda.memory = 1 << 20
    line = _refusal(argv, capsys, monkeypatch)
    assert "on cuda:0, more than the 0.0 GiB free there" in line, line
    fake_cuda.devices = 0
    assert "needs a CUDA device" in _refusal(argv, capsys, monkeypatch)
    fake_cuda.driver = False
    assert "needs a CUDA device" in _refusal(argv, capsys, monkeypatch)
    monkeypatch.setattr(_cuda, "runtime", lambda: None)
    assert "needs cuda-python" in _refusal(argv, capsys, monkeypatch)


def test_nixl_without_vram_is_refused(
    fake_cuda: kinds.FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(device, "_nixl_problem", lambda: "NIXL's UCX backend cannot move "
                        "device memory here (it lists ['DRAM_SEG'])")
    problem = _demo.DemoOptions(device="cuda", engine="nixl", **SMALL).option_problem()
    assert problem == ("--device cuda --engine nixl: NIXL's UCX backend cannot move device "
                       "memory here (it lists ['DRAM_SEG'])")


# ------------------------------------------------------------------ the demo on the stand-in


def _all_verified(opts: _demo.DemoOptions, summary: dict[str, Any]) -> None:
    """No corrupt, late, leaked or hung page, and the run passes the demo's own check."""
    for key in ("corrupt_pages", "source_uaf_pages", "late_writes", "leaked_pages", "hung",
                "released_by_timeout"):
        assert summary[key] == 0, (key, summary)
    assert summary["device"] == "cuda"
    assert _demo.check(opts, summary) == []


def _device_path_taken(fake: kinds.FakeRuntime, calls: list[tuple[Any, ...]],
                       engine_name: str) -> None:
    """The pools were device memory of the stand-in, freed by the end; the engines were asked
    to register them as device memory; the fill, the poison, the aux rows and the read-back
    went through CUDA copies."""
    assert fake.allocs == {}, "a device pool was not freed"
    if engine_name == "mooncake":
        locations = {loc for name, loc, *_ in calls if name == "register"}
        assert locations == {"cuda:0"}, locations
    else:
        regs = {(mem, dev) for name, mem, descs in (c[:3] for c in calls) if name == "reg"
                for _, _, dev in descs}
        assert regs == {("VRAM", 0)}, regs
    seen = {(fn, kind) for fn, kind, *_ in fake.calls}
    assert {
        ("memcpy2d", "cudaMemcpyHostToDevice"),  # prefill fills its pages
        ("memcpy2d", "cudaMemcpyDeviceToHost"),  # decode reads them back; poison checks
        ("memset2d", None),  # the sanitizer poisons freed pages
        ("memcpy", "cudaMemcpyHostToDevice"),  # the aux row and its stamp
        ("memcpy", "cudaMemcpyDeviceToHost"),  # the stamp read back
    } <= seen, seen
    assert {dev for *_, dev in fake.calls} == {0}


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1)])
async def test_demo_on_device_pools_of_the_stand_in(
    engine_name: str, prefill_tp: int, decode_tp: int, fake_cuda: kinds.FakeRuntime,
    engine_calls: list[tuple[Any, ...]],
) -> None:
    """Every request succeeds and every byte of it was read back from the device and
    checked: the verified bytes are exactly the plan's pages times the bytes of a page of
    every decode rank's heads."""
    opts = _demo.DemoOptions(engine=engine_name, device="cuda", prefill_tp=prefill_tp,
                             decode_tp=decode_tp, **SMALL)
    with trio.fail_after(60):
        summary = await _demo.run_in_process(opts)
    _all_verified(opts, summary)
    assert summary["succeeded"] == opts.requests, summary
    page = 2 * opts.layers * opts.page_size * opts.head_bytes * opts.kv_heads
    assert summary["bytes"] == page * sum(r.num_pages for r in _demo.plan_requests(opts))
    _device_path_taken(fake_cuda, engine_calls, engine_name)


@pytest.mark.parametrize("engine_name", ENGINES)
async def test_demo_aborts_and_faults_on_device_pools_of_the_stand_in(
    engine_name: str, fake_cuda: kinds.FakeRuntime, engine_calls: list[tuple[Any, ...]],
) -> None:
    """tests/test_demo.py's aborts-and-faults run on device pools: requests abort or fail,
    and still no page is corrupt, written late or leaked (the quarantine fence makes this
    ~11 s)."""
    opts = _demo.DemoOptions(
        engine=engine_name, device="cuda", requests=30, concurrency=8, max_tokens=256,
        chunk_pages=2, layers=1, abort_rate=0.3, fault_rate=0.2, seed=0, quarantine_fence=1.0,
    )
    with trio.fail_after(60):
        summary = await _demo.run_in_process(opts)
    _all_verified(opts, summary)
    assert summary["succeeded"] > 0 and summary["aborted"] > 0, summary
    assert summary["engine_errors"] >= 1, summary  # the faults really happened (seeded)
    assert summary["quarantined"] == summary["released_after_quarantine"]
    _device_path_taken(fake_cuda, engine_calls, engine_name)


def test_verification_reads_the_device_pages(fake_cuda: kinds.FakeRuntime) -> None:
    """The demo's check of a Success on a device pool: the bytes read back from the device
    are what prefill wrote, the aux row carries the room's stamp; one changed byte is a
    corrupt page, and source poison there a source use-after-free."""
    opts = _demo.DemoOptions(device="cuda", **SMALL)
    pool = _demo._pool(opts, 0, 1)
    assert isinstance(pool, DeviceKVPool)
    try:
        req = _demo.Request(0, room=77, epoch=5, tokens=48, abort=None, num_pages=3)
        pages, slot = np.array([9, 2, 30]), 4
        pool.fill(pages, req.room)
        pool.fill_aux(slot, req.room)
        stamp_aux_row(pool.spec, slot, req.room, req.epoch)
        result = _demo.RankResult("decode", 0)
        _demo._verify(result, pool, pages, slot, req)
        assert (result.corrupt_pages, result.bytes) == (0, pool.read(pages).nbytes)
        want = pool.expected(req.room, 3)
        # one byte of page 2 (the request's second page) in buffer 1, and all of page 30
        # (its third) source poison: what a write from released source pages leaves
        _cuda.memset(pool.spec.buffer_bases[1] + 2 * pool.item_len + 7, ~want[1, 1, 7] & 0xFF,
                     1, 0)
        pool.page_rows().poison(np.array([30]), SOURCE_POISON)
        _demo._verify(result, pool, pages, slot, req)
        assert result.corrupt_pages == 2 and result.source_uaf_pages >= 1
        stamp_aux_row(pool.spec, slot, req.room, req.epoch + 1)  # another use of the room
        pool.fill(pages, req.room)
        _demo._verify(result, pool, pages, slot, req)
        assert result.corrupt_pages == 3
    finally:
        pool.close()


def test_device_reaches_rank_processes_and_the_headline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--processes`` hands every rank process the options as JSON (run_processes ->
    ``_worker``), ``device`` with them, so each rank builds device pools; the headline and
    the JSON say where the pools were."""
    opts = _demo.DemoOptions(device="cuda", requests=1)
    assert _demo.DemoOptions(**json.loads(json.dumps(asdict(opts)))).device == "cuda"
    done = {0: int(KVPoll.Success)}
    summary = _demo.summarize(opts, [_demo.RankResult("prefill", 0, outcomes=dict(done)),
                                     _demo.RankResult("decode", 0, outcomes=dict(done))], 1.0)
    assert summary["device"] == "cuda"
    cli._print_summary(summary, [])
    assert "layout mha, pools on cuda:0, prefill TP 1" in capsys.readouterr().out
    cli._print_summary(_demo.summarize(_demo.DemoOptions(requests=1), [], 1.0), [])
    assert "layout mha, prefill TP 1" in capsys.readouterr().out
