"""Helpers shared by test modules (imported by them, never by conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from trio_pd import EngineError
from trio_pd.engines import TransferEngine

#: Python source that defines ``take_every_descriptor()`` (lowers RLIMIT_NOFILE to 256, then
#: opens /dev/null until the process has no descriptor left; returns what it took) and
#: ``give_back(taken)``. Child scripts start with it: a process out of descriptors.
NO_DESCRIPTORS = """
import os, resource

def take_every_descriptor():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
    taken = []
    try:
        while True:
            taken.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        return taken

def give_back(taken):
    for fd in taken:
        os.close(fd)
"""


def run_child(source: str, timeout: float = 60.0) -> Any:
    """Run ``source`` in a fresh Python process and return the JSON it printed last;
    AssertionError with its stderr if it failed."""
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, timeout=timeout)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def write_again(engine: TransferEngine, peer: str, *blocks: Any, within: float = 5.0) -> int:
    """``engine.write(peer, *blocks)`` right after something cut or refused that engine's
    calls to ``peer``: the link must work again, but Mooncake's first call after a refusal
    or a cut connection may fail too (rc -1; seen a few times in hundreds of runs, under
    load), so at most two such failures are allowed, within ``within`` s. Returns how many
    there were; AssertionError, with them, past that."""
    errors: list[EngineError] = []
    deadline = time.monotonic() + within
    while True:
        try:
            engine.write(peer, *blocks)
            return len(errors)
        except EngineError as exc:
            errors.append(exc)
            assert len(errors) < 3 and time.monotonic() < deadline, errors
            time.sleep(0.2)
