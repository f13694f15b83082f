"""tools/sglang_bench.py runs both connectors end to end: a few requests through SGLang's
own Mooncake classes and through trio_pd's, switched only by TRIO_PD_SGLANG, every byte
verified (four rank processes in all: about a minute and a half here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "sglang_bench.py"


@pytest.mark.timeout(900)
def test_the_bench_moves_verified_requests_through_both_connectors(
    tmp_path: Path, sglang_runtime: None
) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(TOOL), "--quick", "--requests", "6", "--json", str(out)],
        capture_output=True, text=True, timeout=840,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    by = {r["connector"]: r for r in result["runs"]}
    assert set(by) == {"sglang", "trio_pd"}
    assert by["sglang"]["classes"] == [
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"] * 2
    assert by["trio_pd"]["classes"] == ["trio_pd.compat.sglang.KVManager"] * 2
    for r in by.values():
        assert (r["verified"], r["corrupt"], r["failed"]) == (6, 0, 0)
        assert r["gb_per_s"] > 0 and r["connector_ms"] > 0
    assert "| trio_pd / SGLang |" in done.stdout
