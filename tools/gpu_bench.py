"""A short device bench: device -> device through each engine, against ``cudaMemcpy``
device-to-device on the same bytes as the ceiling. Run by tools/gpu-check; on its own:

    python tools/gpu_bench.py --json gpu-bench.json [--mib 256] [--block-kib 1024]

Both buffers are ``cudaMalloc`` on device 0 (trio_pd.io._cuda). Each engine gets a writer and a
reader engine in this process (loopback: Mooncake over TCP unless it finds RDMA, NIXL over
UCX), registers the buffers with their kind (``cuda:0``), and writes the whole source as
``block``-sized blocks scattered into the destination; the destination is copied back and
checked against the source once per engine, so a figure is only reported for bytes that
arrived. Exit status: 0 if every engine ran and verified (or was skipped, unless
``--require``), 1 otherwise; the JSON says which and why.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
import time
from typing import Any

import numpy as np

from trio_pd.core._memory import MemoryKind
from trio_pd.engines import Region, TransferEngine, make_engine
from trio_pd.io import _cuda

DEVICE = 0


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_name() -> str:
    rt: Any = _cuda.runtime()
    try:
        err, props = rt.cudaGetDeviceProperties(DEVICE)
        if err != rt.cudaError_t.cudaSuccess:
            return "?"
        return bytes(props.name).split(b"\0")[0].decode(errors="replace")
    except Exception:
        return "?"


def _timed(fn: Any, repeat: int) -> list[float]:
    fn()  # warm-up (connections, first-touch, lazy CUDA set-up)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _figures(nbytes: int, seconds: list[float]) -> dict[str, float]:
    best, median = min(seconds), float(np.median(seconds))
    return {"best_s": best, "median_s": median, "best_gbps": nbytes / best / 1e9,
            "median_gbps": nbytes / median / 1e9}


def _engine(kind: str) -> tuple[TransferEngine | None, str | None]:
    """An engine that can move device memory, or the reason this build cannot."""
    if kind == "mooncake":
        if importlib.util.find_spec("mooncake") is None:
            return None, "mooncake not installed"
        from trio_pd.engines import mooncake

        if not mooncake._cuda_build():
            return None, "the installed Mooncake wheel is the non-CUDA build"
        return make_engine(kind), None
    if importlib.util.find_spec("nixl_cu12") is None:
        return None, "nixl_cu12 not installed"
    engine = make_engine(kind)
    mems = engine._agent.get_backend_mem_types("UCX")  # type: ignore[attr-defined]
    if not any("VRAM" in str(m) for m in mems):
        engine.close()
        return None, f"NIXL's UCX backend lists no VRAM ({mems})"
    return engine, None


def bench_engine(kind: str, src: int, dst: int, nbytes: int, block: int, repeat: int,
                 pattern: np.ndarray) -> dict[str, Any]:
    writer, why = _engine(kind)
    if writer is None:
        return {"skipped": why}
    reader, why = _engine(kind)
    if reader is None:
        writer.close()
        return {"skipped": why}
    try:
        here = MemoryKind.cuda(DEVICE)
        writer.register([Region(src, nbytes, here)])
        reader.register([Region(dst, nbytes, here)])
        writer.add_peer(reader.session_id, reader.metadata())
        n = nbytes // block
        order = np.random.default_rng(7).permutation(n).astype(np.uint64)
        srcs = np.uint64(src) + np.arange(n, dtype=np.uint64) * np.uint64(block)
        dsts = np.uint64(dst) + order * np.uint64(block)
        lens = np.full(n, block, dtype=np.uint64)
        _cuda.memset(dst, 0, nbytes, DEVICE)
        seconds = _timed(lambda: writer.write(reader.session_id, srcs, dsts, lens), repeat)
        got = np.frombuffer(_cuda.read(dst, nbytes, DEVICE), dtype=np.uint8).reshape(n, block)
        verified = bool(np.array_equal(got[order.astype(np.int64)], pattern.reshape(n, block)))
        return {"blocks": n, "verified": verified, **_figures(nbytes, seconds)}
    except Exception as exc:  # a failing engine is a result, not the end of the bench
        return {"error": repr(exc)}
    finally:
        writer.close()
        reader.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write the results here (else: stdout only)")
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per write (MiB)")
    ap.add_argument("--block-kib", type=int, default=1024, help="block size (KiB)")
    ap.add_argument("--repeat", type=int, default=5, help="timed writes per engine")
    ap.add_argument("--engines", default="mooncake,nixl")
    ap.add_argument("--require", action="store_true", help="a skipped engine fails the bench")
    args = ap.parse_args(argv)

    _cuda.require_device(DEVICE, "the device bench")
    nbytes, block = args.mib << 20, args.block_kib << 10
    if nbytes % block:
        ap.error("--mib must be a multiple of --block-kib")
    pattern = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
    src = _cuda.malloc(nbytes, DEVICE)
    dst = _cuda.malloc(nbytes, DEVICE)
    try:
        _cuda.write(src, pattern, DEVICE)
        ceiling = _figures(nbytes, _timed(
            lambda: _cuda.memcpy(dst, src, nbytes, "d2d", DEVICE), args.repeat))
        engines = {
            kind: bench_engine(kind, src, dst, nbytes, block, args.repeat, pattern)
            for kind in args.engines.split(",")
        }
    finally:
        _cuda.free(src, DEVICE)
        _cuda.free(dst, DEVICE)
    result = {
        "device": _device_name(), "bytes": nbytes, "block": block, "repeat": args.repeat,
        "ceiling_cudaMemcpy_d2d": ceiling, "engines": engines,
        "versions": {d: _version(d) for d in (
            "trio-pd", "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda",
            "nixl-cu12", "cuda-bindings", "cuda-python")},
    }
    for r in engines.values():
        if "best_gbps" in r:
            r["share_of_ceiling"] = r["best_gbps"] / ceiling["best_gbps"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    ok = all(r.get("verified") or ("skipped" in r and not args.require)
             for r in engines.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
