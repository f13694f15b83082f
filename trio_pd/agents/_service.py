"""Tasks of an agent that outlive a cancellation of its block, until its close is done.

Closing an agent is not instant: decode keeps serving while the drain acks of its failed
rooms come in, and prefill while its quarantined writes are proven over. Both need their
control listener, their timers and their probes to keep running after the block that holds
the agent was cancelled. So those run under shielded cancel scopes of their own, which the
agent's close cancels once it is done.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


async def serve(scope: trio.CancelScope, run: Callable[[], Awaitable[object]]) -> None:
    """Run ``run()`` inside ``scope`` (made with ``shield=True``): it ends when ``scope`` is
    cancelled, not when the nursery around it is.

    **Cancellation:** only through ``scope``.
    """
    with scope:
        await run()


async def serve_nursery(
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[trio.Nursery] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Open a nursery inside ``scope`` (made with ``shield=True``) and hand it out
    (``nursery.start``): tasks started in it live until ``scope`` is cancelled.

    **Cancellation:** only through ``scope``; its tasks are cancelled with it.
    """
    with scope:
        async with trio.open_nursery() as nursery:
            task_status.started(nursery)
            await trio.sleep_forever()
