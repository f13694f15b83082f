"""The last steps of an agent's close, each bounded on its own.

Once an agent's rooms are settled and its tasks have ended, ``open_prefill`` and
``open_decode`` still have waiting steps to run: wait for abandoned probe threads to leave
the engine, deregister the pool (and the landing or staging area), close the bootstrap
clients, close the control plane (its sockets, then the ZeroMQ context's ``term``). Each of
them may hang where an engine or a peer does (a probe thread inside Mooncake's
``send_probe``, an ``unregister`` that never returns).

One deadline over all of them would skip every step after the one that hung: the control
plane's sockets and context, the bootstrap clients' connections, a landing area's
deregistration. So each step runs under a deadline of its own (:data:`STEP_TIMEOUT`),
shielded from the caller's cancellation; one that runs past it is given up, with a warning
that names it, and the next step runs all the same. The closes that do not wait (a socket's
``close``) happen at the start of their step, before its first schedule point, so they are
never given up.

Giving up never frees memory an engine may still write: a deregistration that did not
return leaves its region registered (its thread is abandoned, still inside the engine), so
an area of ours whose deregistration did not return is kept for the life of the process,
and the warning says that the pool's regions may still be registered.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

import trio
import trio.lowlevel

from ..core._memory import Region
from ..engines import TransferEngine
from ..io._probe import wait_idle

log = logging.getLogger("trio_pd.close")

A = TypeVar("A")

__all__ = ["STEP_TIMEOUT", "bounded", "deregister_area", "unregister", "wait_probe_threads"]

#: seconds one waiting step of an agent's close may take (waiting for probe threads, one
#: deregistration, closing the bootstrap clients, the control plane's ``term``); past it the
#: step is given up, logged, and the next one runs
STEP_TIMEOUT = 10.0


async def bounded(what: str, step: Callable[[], Awaitable[object]]) -> bool:
    """Run ``step()`` shielded, for at most :data:`STEP_TIMEOUT` seconds. True if it
    returned; False, with a warning naming ``what``, if it ran past the deadline or raised
    (an :class:`Exception`: it is logged, not raised, so that the next step runs).

    **Cancellation:** shielded: the caller's cancellation does not reach the step; it is
    delivered at the caller's next checkpoint.
    """
    failed: Exception | None = None
    with trio.CancelScope(shield=True) as scope:
        scope.deadline = trio.current_time() + STEP_TIMEOUT
        try:
            await step()
        except Exception as exc:
            failed = exc
        # (a schedule point on every path, that no cancellation can interrupt)
        await trio.lowlevel.cancel_shielded_checkpoint()
    if failed is not None:
        log.warning("agent close: %s failed, given up: %r", what, failed)
        return False
    if scope.cancelled_caught:
        log.warning("agent close: %s did not finish within %g s, given up", what, STEP_TIMEOUT)
        return False
    return True


async def unregister(engine: TransferEngine, regions: list[Region], what: str) -> bool:
    """Deregister ``regions`` from ``engine`` in a thread, a step of its own (:func:`bounded`).
    True once the engine returned. False (logged) if it raised or did not return within
    :data:`STEP_TIMEOUT`: then the thread is abandoned, still inside the engine, and the
    regions may still be registered, so the caller must keep any memory of its own among
    them."""
    done = await bounded(
        f"deregistering {what}",
        partial(trio.to_thread.run_sync, engine.unregister, regions, abandon_on_cancel=True),
    )
    if not done:
        log.warning("agent close: %s may still be registered with the engine %s: its memory "
                    "must not be freed while the engine lives", what, engine.name)
    return done


async def deregister_area(
    engine: TransferEngine, region: Region, what: str, area: A, held: bool, kept: list[A]
) -> None:
    """Deregister ``region``, an area of ours (a landing or staging area), a step of its own
    (:func:`unregister`). The area goes to ``kept`` (memory for the life of the process)
    when ``held`` (a write may still land in it or read it: decided before the first
    schedule point, so a close cut short keeps it too) or when its deregistration did not
    return (the engine may still hold it registered)."""
    if held:
        kept.append(area)
    if not await unregister(engine, [region], what) and not held:
        kept.append(area)


async def wait_probe_threads(limiter: trio.CapacityLimiter, within: float) -> bool:
    """Wait, a step of its own, at most ``within`` (and :data:`STEP_TIMEOUT`) seconds, until
    no abandoned probe thread holds a token of ``limiter`` (:func:`~trio_pd.io._probe.
    wait_idle`). True if none does; False, logged, if one is still inside the engine then:
    the close goes on (the agent does not close the engine; whoever does should know)."""
    idle: list[bool] = []

    async def wait() -> None:
        idle.append(await wait_idle(limiter, min(within, STEP_TIMEOUT)))

    if not await bounded("waiting for the probe threads", wait):
        return False
    if not idle[0]:
        log.warning("agent close: a probe thread is still inside the engine after %g s; "
                    "closing without it", min(within, STEP_TIMEOUT))
    return idle[0]
