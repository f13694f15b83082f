"""A child process goes down with its parent, however the parent ends.

``trio-pd demo --processes`` runs the bootstrap service and every rank in child processes of
their own process groups (a terminal's Ctrl-C reaches only the parent, which stops them in
order). If the parent ends without stopping them (a second Ctrl-C, SIGKILL, a crash), they
must not go on: a bootstrap service left listening with parent 1, ranks writing progress
into a closed pipe.

The parent holds the write end of a pipe (:class:`Lifeline`) and never writes to it; each
child gets the read end (its number in :data:`ENV`) and watches it (:func:`hold`). However
the parent ends, the kernel closes its end; the child's read returns end-of-file and the
child exits at once, status :data:`ORPHANED`. ``PR_SET_PDEATHSIG`` would not do: it fires
when the *thread* that started the child ends, and trio starts processes from a worker
thread that may end long before the parent does.

Pure standard library; a child holds its lifeline before it imports anything heavy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import NoReturn

#: the environment variable that tells a child which file descriptor is its lifeline
ENV = "TRIO_PD_LIFELINE_FD"

#: a child's exit status once its parent is gone (nobody is left to read it): 128 + SIGHUP,
#: as for a process whose terminal hung up
ORPHANED = 129


class Lifeline:
    """The parent's side: a pipe whose read end every child started with :meth:`env` and
    :attr:`pass_fds` inherits. :meth:`close` once the children have ended (the end of the
    process closes it too, which is the point)."""

    def __init__(self) -> None:
        # both ends close-on-exec: only a child given pass_fds inherits the read end, and no
        # child ever holds the write end (which would keep the line open after we are gone)
        self._read, self._write = os.pipe()

    @property
    def pass_fds(self) -> tuple[int]:
        return (self._read,)

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` plus the variable that tells the child where its lifeline is."""
        return {**env, ENV: str(self._read)}

    def close(self) -> None:
        for fd in (self._read, self._write):
            os.close(fd)


def hold() -> None:
    """The child's side: if this process was started with a lifeline, watch it from a
    daemon thread and exit the process at once (:func:`parent_gone`) when the parent's end
    closes. Does nothing without one. The variable is removed from ``os.environ``, so a
    process this one starts does not inherit it."""
    fd = os.environ.pop(ENV, None)
    if fd is None:
        return

    def watch() -> None:
        try:
            while os.read(int(fd), 64):  # the parent never writes: b"" is its end closing
                pass
        except OSError:
            pass
        parent_gone()

    threading.Thread(target=watch, name="trio_pd lifeline", daemon=True).start()


def say(line: str) -> None:
    """Print ``line`` to stdout, the parent's pipe, at once. If the parent is gone (the
    pipe is broken), end this process quietly instead of raising BrokenPipeError."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        parent_gone()


def parent_gone() -> NoReturn:
    """End this child now: nobody reads what it would report, and nothing it holds
    (sockets, registered memory) outlives the process. ``os._exit``: no traceback, and no
    flush of a stdout whose reader is gone."""
    os._exit(ORPHANED)
