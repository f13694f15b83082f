"""The process's file descriptor budget: raised once toward the hard limit, and said.

Every connection to an agent holds a descriptor from its accept until it closes: a peer's,
and a stranger's too, until the ZeroMQ handshake timeout closes a connection that never
proved a key (``ControlPlane.HANDSHAKE_TIMEOUT``). The common default soft limit, 1,024, is
small enough that a flood of raw TCP connections used it up; the hard limit is usually far
higher, and a process may raise its own soft limit up to it without privileges. So every
agent raises it as it starts (:func:`prepare`; the first one does, the others find it done)
and logs one line saying what the process can hold; whatever still runs out is a counted,
local failure where it happens (``resources_exhausted``, ``checks_unknown``).
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("trio_pd")

#: the soft limit is raised at most this far (an unlimited hard limit is not a number the
#: kernel takes for RLIMIT_NOFILE: it stops at ``fs.nr_open``, often 1,048,576)
CEILING = 1 << 20


def raise_soft_limit() -> tuple[int, int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (at most
    :data:`CEILING`) where the kernel allows it; returns ``(before, now, hard)``. A refusal
    (a sandbox, a container's policy) keeps the limit it had: nothing is raised."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = CEILING if hard == resource.RLIM_INFINITY else min(hard, CEILING)
    now = before
    if before != resource.RLIM_INFINITY and before < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            now = want
        except (OSError, ValueError):
            pass
    return before, now, hard


def _in_use() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc, or no descriptor left to read it with
        return None


def prepare(what: str) -> int:
    """For an agent starting (``what`` names it): raise the soft limit, and log one line
    saying what the process can hold. Returns the soft limit now."""
    before, now, hard = raise_soft_limit()
    shown_hard = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    raised = f"raised from {before} " if now != before else ""
    used = _in_use()
    log.info(
        "%s: file descriptors: soft limit %d (%shard %s), %s in use; every peer and every "
        "connection to this process (strangers' included, until their handshake times out) "
        "holds one",
        what, now, raised, shown_hard, "?" if used is None else used,
    )
    return now
