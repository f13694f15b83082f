"""``trio-pd bench --device cuda`` without a GPU: refused up front, in one line, with the demo's
own reason where the device path cannot run; and the bench's phases on device pools of the
CUDA stand-in of tests/helpers/fake_cuda.py (its "device" allocations are host memory it
checks every copy against), on both engines: the pools are the stand-in's allocations, the
engines (the bare-engine ceiling's among them) are asked to register device memory, and every
byte is read back from the "device" and verified. The real device run is tools/gpu-check's.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from trio_pd import cli
from trio_pd.engines import mooncake as mooncake_adapter
from trio_pd.io import _cuda
from trio_pd.testing.device import DeviceKVPool
from trio_pd.tools import _bench, _demo

from .helpers import fake_cuda as kinds
from .helpers.engines import ENGINES

ROOT = Path(__file__).resolve().parent.parent

#: cli.main sets engine log variables (GLOG_minloglevel): keep them out of other tests; CPU
#: and timing figures are measured alone, after the parallel pass
pytestmark = [pytest.mark.usefixtures("keep_environ"), pytest.mark.serial]


# ------------------------------------------------------------------ refused up front


def test_cli_refuses_bench_device_cuda_on_this_machine() -> None:
    """No cuda-python or no device here: exit status 2, nothing on stdout, one line on
    stderr naming what is missing, in the demo's words (its own check made it)."""
    if _cuda.device_count():
        pytest.skip("this machine has a CUDA device")
    proc = subprocess.run(
        [sys.executable, "-m", "trio_pd", "bench", "--device", "cuda", "--quick", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert re.search(r"needs (cuda-python|a CUDA driver|a CUDA device)|no CUDA device", line)
    demo_reason = _demo.DemoOptions(device="cuda").option_problem()
    assert line == f"trio-pd bench: error: {demo_reason}", line


def test_bench_refusal_is_the_demos_and_comes_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """On the stand-in, a Mooncake wheel that moves host memory only: the bench refuses it
    with the demo's reason (engine_problem's), before any phase starts."""
    kinds.install_fake_cuda(monkeypatch)
    monkeypatch.setattr(mooncake_adapter, "_cuda_build", lambda: False)

    def started(*_a: Any, **_kw: Any) -> Any:
        raise AssertionError("the bench started despite a refused --device")

    monkeypatch.setattr(_bench, "_run_phases", started)
    monkeypatch.setattr(_bench, "run_peer", started)
    for extra in ([], ["--preset", "peer"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["bench", "--device", "cuda", "--quick", *extra])
        out, err = capsys.readouterr()
        assert exit_.value.code == 2 and out == "", (exit_.value.code, out, err)
        (line,) = err.splitlines()
        assert line == ("trio-pd bench: error: "
                        + str(_demo.DemoOptions(device="cuda").option_problem())), line
        assert "--device cuda --engine mooncake" in line and "non-CUDA build" in line, line


# ------------------------------------------------------------------ the bench on the stand-in

#: the smallest run that still has every phase: 2 requests of 32 pages (4 MiB each, two
#: 16-page chunks, so both ceiling granularities), 2 aborts, 10 rooms in the scale phase
TINY: dict[str, Any] = dict(total_mib=8, request_pages=32, abort_requests=2,
                            overhead_samples=5, scale_rooms=(10,))


def _registrations(calls: list[tuple[Any, ...]], engine: str) -> list[tuple[str, set[int]]]:
    """(kind, base addresses) of each registration the recording engines were asked for:
    Mooncake's location ("cpu", "cuda:0"), NIXL's memory type ("DRAM", "VRAM")."""
    if engine == "mooncake":
        return [(loc, set(bases)) for name, loc, bases, *_ in calls if name == "register"]
    return [(mem, {base for base, _, _ in descs})
            for name, mem, descs in (c[:3] for c in calls) if name == "reg"]


@pytest.mark.parametrize("engine_name", ENGINES)
def test_bench_on_device_pools_of_the_stand_in(
    engine_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every phase on device pools, both engines: the JSON says so (and names the device),
    every byte verified; the pools are the stand-in's allocations, all freed at the end; every
    engine, the bare ceiling's included, registered device memory and nothing else."""
    fake = kinds.install_fake_cuda(monkeypatch)
    fake.cudaGetDeviceProperties = lambda device: (  # type: ignore[attr-defined]
        fake.cudaError_t.cudaSuccess, SimpleNamespace(name=b"Stand-in GPU\0\0\0"))
    mallocs: list[tuple[int, int]] = []  # (address, bytes) of each device allocation
    malloc = fake.cudaMalloc

    def counted(size: int) -> Any:
        err, address = malloc(size)
        mallocs.append((address, size))
        return err, address

    monkeypatch.setattr(fake, "cudaMalloc", counted)
    # what each engine was asked: the bench's own (ceiling, agents, facade), and the TP
    # phase's through the demo's runner
    engines: dict[str, list[list[tuple[Any, ...]]]] = {"bench": [], "demo": []}

    def recorded(module: str, name: str) -> Any:
        engines[module].append([])
        return kinds.recording_engine(name, engines[module][-1])

    monkeypatch.setattr(_bench, "make_engine", partial(recorded, "bench"))
    monkeypatch.setattr(_demo, "make_engine", partial(recorded, "demo"))
    setups: list[_bench._Setup] = []
    setup = _bench._setup

    def kept(o: _bench.BenchOptions) -> _bench._Setup:
        setups.append(setup(o))
        return setups[-1]

    monkeypatch.setattr(_bench, "_setup", kept)

    opts = replace(_bench.BenchOptions.quick(engine_name), device="cuda", **TINY)
    r = _bench.run(opts)

    # the JSON: where the pools were, every byte of every run verified, nothing failed
    assert (r["device"], r["device_index"], r["device_name"]) == ("cuda", 0, "Stand-in GPU")
    assert r["options"]["device"] == "cuda"
    assert _bench.problems(r) == [] and r["corrupt_pages"] == 0 and r["failed"] == 0
    assert r["requests"] == opts.load_requests == 2
    # (each round runs the load twice: timed, then with the lateness probe; both verified)
    runs = 2 * opts.ceiling_repeats
    assert r["verified_bytes"] == runs * opts.load_requests * opts.request_bytes
    assert r["ceiling_gbps"] > 0 and r["trio_pd_gbps"] > 0
    # (and, on an engine that joins other rooms' writes, NIXL, the joined calls: fewer)
    joined = {"joined"} if engine_name == "nixl" else set()
    assert set(r["ceiling_calls"]) == {"per chunk", "coalesced"} | joined
    if joined:
        assert r["ceiling_calls"]["joined"] < r["ceiling_calls"]["coalesced"]
    tp = r["tp_mismatch"]
    assert tp["tp1_1_gbps"] > 0 and tp["tp1_4_gbps"] > 0 and "in place" in tp["note"]
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(_bench.table(r))
    assert "cuda:0 (Stand-in GPU)" in console.export_text()

    # the pools were the stand-in's device allocations (KV and aux), all freed by the end
    (s,) = setups
    # what the ceiling and trio_pd each moved: the pages, and one aux row per request
    assert r["bytes"] == opts.load_requests * (opts.request_bytes + s.src.spec.aux_item_len)
    pools = [s.src, s.dst, s.small_src, s.small_dst]
    assert all(isinstance(p, DeviceKVPool) for p in pools), pools
    for p in pools:
        spec, kv_bytes = p.spec, p.spec.num_buffers * p.spec.num_pages * p.spec.item_len
        assert (spec.buffer_bases[0], kv_bytes) in mallocs, spec
        assert (spec.aux_base, spec.aux_slots * spec.aux_item_len) in mallocs, spec
    assert fake.allocs == {}, "a device allocation was not freed"
    seen = {(fn, kind) for fn, kind, *_ in fake.calls}
    assert ("memcpy2d", "cudaMemcpyHostToDevice") in seen  # the source pages filled
    assert ("memcpy2d", "cudaMemcpyDeviceToHost") in seen  # the verification's read-back
    dst_kv = s.dst.spec.num_buffers * s.dst.spec.num_pages * s.dst.spec.item_len
    # the destination wiped before the run, one fill of every page of every buffer
    assert ("memset2d", None, s.dst.spec.buffer_bases[0], dst_kv, 0) in fake.calls

    # every engine registered device memory only: the bare-engine ceiling's pair (the one
    # engine that holds both the big and the tiny source pool), the agents', the TP phase's
    device_kind = "cuda:0" if engine_name == "mooncake" else "VRAM"
    registered: list[set[int]] = []
    for calls in engines["bench"] + engines["demo"]:
        regs = _registrations(calls, engine_name)
        assert regs and {kind for kind, _ in regs} == {device_kind}, regs
        registered.append(set().union(*(bases for _, bases in regs)))
    # ceiling, trio_pd, overhead, facade (8); the facades phase, a pair per driver (6); TP
    # 1->1, 1->4 (7); the layer-wise phase, one pair (2)
    assert len(registered) == 8 + 6 + 7 + 2
    big, tiny = s.src.spec.buffer_bases[0], s.small_src.spec.buffer_bases[0]
    assert any({big, tiny} <= bases for bases in registered), registered


def test_the_peer_preset_hands_the_device_to_the_demo() -> None:
    """``--preset peer --device cuda``: the demo's process runner gets the option, so each
    rank process builds its pools on the device (the demo's ``--processes`` path)."""
    opts = replace(_bench.BenchOptions.peer(quick=True), device="cuda")
    assert _bench.peer_demo_options(opts).device == "cuda"
    assert _bench.peer_demo_options(_bench.BenchOptions.peer()).device == "host"


def test_host_runs_say_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default stays host memory, and the JSON says so (no device name)."""
    assert _bench.BenchOptions().device == "host"
    assert cli._parser()[1]["bench"].parse_args([]).device == "host"
    monkeypatch.setattr(_bench, "_run_phases", lambda opts, progress: {"ran": opts.device})
    assert _bench.run(_bench.BenchOptions()) == {"ran": "host", "device": "host"}
