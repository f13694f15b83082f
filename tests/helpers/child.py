"""Child processes: a fresh Python running a script, and the start of one that has used up
its file descriptors."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

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

