"""Every control message that must arrive (an ABORT, an ABORT_ACK, a Failed STATUS) goes
through the outbox, and one policy retries it.

**The policy.** A send is tried at once. If the peer's socket refuses it (full: the peer is
not reading), the message waits in that endpoint's queue under a key the caller chooses, such
as ``("abort", room)``. Once per ``retry_interval`` the endpoint's queue is sent again, oldest
first, and the round stops at the first refusal: the socket is still full, and trying the rest
would only reorder them. A message sent again under a key already waiting replaces the waiting
one, which keeps its place and its give-up deadline. A message still undelivered
``give_up_after`` seconds after its first refusal is dropped, counted ``outbox_dropped``, and
the caller hears of it through ``on_drop``; so does the oldest message of an endpoint whose
queue would grow past ``max_per_peer``. Drops are logged at WARNING at most once per endpoint
per ``give_up_after`` window; the warning says how many went unlogged since the last one.

**Why one policy.** Before the outbox, each such message had its own: the prefill agent
retried an ABORT_ACK every 50 ms forever, with a new timer per attempt; it retried a Failed
STATUS for 60 s, then dropped it; and the decode agent, for every rank whose ABORT send failed,
scheduled a retry of the *whole room*. With two full sockets every round scheduled two more,
so the timers doubled every 50 ms (2,049 of them after half a second) and so did the sends.
Here the work per round is one timer and one pass over each stalled endpoint's queue, whatever
was asked to be sent and how often.

**Invariant:** per ``(endpoint, key)`` at most one message is pending; per endpoint at most
one timer is scheduled. Memory is bounded by ``max_per_peer`` times the number of endpoints;
the agent calls :meth:`Outbox.forget` for a peer it drops.

The outbox never sees a socket: it is given the control plane's ``send_nowait`` and the
agent's :class:`~trio_pd.io._timers.Timers`, and it never raises out of a timer action.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import trio

from ..core import _wire
from ..core._errors import ConfigurationError
from ..core._stats import Counters
from ._timers import Timers

log = logging.getLogger("trio_pd.outbox")

SendNowait = Callable[[str, _wire.Message, npt.NDArray[np.int32] | None], bool]
OnDrop = Callable[[str, Hashable], None]


@dataclass(slots=True)
class _Pending:
    """One message waiting for its endpoint's socket to take it."""

    msg: _wire.Message  # replaced by a newer send under the same key
    pages: npt.NDArray[np.int32] | None
    give_up_at: float  # set once, when the message is first queued; a replacement keeps it


class Outbox:
    """Every control message that must arrive goes through here: tried at once, and if the
    peer's socket is full, queued per endpoint and retried by one timer per endpoint until it
    is delivered, replaced, cancelled, forgotten, or given up (see the module docstring)."""

    def __init__(
        self,
        send_nowait: SendNowait,
        timers: Timers,
        counters: Counters,
        *,
        retry_interval: float = 0.05,
        give_up_after: float = 60.0,
        max_per_peer: int = 4096,
        on_drop: OnDrop | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        if not (retry_interval > 0 and math.isfinite(retry_interval)):
            raise ConfigurationError(f"retry_interval must be positive, not {retry_interval!r}")
        if not give_up_after >= 0:
            raise ConfigurationError(f"give_up_after must be >= 0, not {give_up_after!r}")
        if max_per_peer < 1:
            raise ConfigurationError(f"max_per_peer must be at least 1, not {max_per_peer!r}")
        self._send_nowait = send_nowait
        self._timers = timers
        self._counters = counters
        self._retry_interval = retry_interval
        self._give_up_after = give_up_after
        self._max_per_peer = max_per_peer
        self._on_drop = on_drop
        self._clock = clock
        #: endpoint -> its pending messages by key, oldest first (dict order is send order).
        #: An endpoint is a key here exactly while it has at least one pending message.
        self._queues: dict[str, dict[Hashable, _Pending]] = {}
        #: endpoints whose retry timer is in ``timers``. Added when that timer is scheduled;
        #: removed only once it has run and scheduled no successor. ``cancel`` and ``forget``
        #: leave the entry: the timer then finds nothing (or newer messages) and ends.
        self._scheduled: set[str] = set()
        #: endpoint -> (no drop warning before this time, drops not logged since the last)
        self._quiet: dict[str, tuple[float, int]] = {}

    # ------------------------------------------------------------------ what the agent calls

    def send(
        self,
        endpoint: str,
        key: Hashable,
        msg: _wire.Message,
        pages: npt.NDArray[np.int32] | None = None,
    ) -> bool:
        """Send ``msg`` to ``endpoint`` now if its socket takes it: True. Otherwise it is
        queued under ``(endpoint, key)`` for retry: False.

        A message already pending under the same ``(endpoint, key)`` is replaced by this one
        (it keeps its place in the queue and its give-up deadline), so sending the same ABORT
        or ack again never multiplies it. While the endpoint has messages pending, a new one is
        not tried ahead of them: it joins the queue behind them, and order per endpoint is
        kept. An exception from ``send_nowait`` on the immediate try (a message that cannot be
        encoded: the caller's bug) propagates, and nothing is queued.
        """
        queue = self._queues.get(endpoint)
        if queue is None:
            if self._send_nowait(endpoint, msg, pages):
                return True
            queue = self._queues[endpoint] = {}
        elif key in queue:
            queue[key].msg, queue[key].pages = msg, pages
            return False
        overflow = len(queue) >= self._max_per_peer
        if overflow:
            oldest = next(iter(queue))
            del queue[oldest]
        queue[key] = _Pending(msg, pages, self._clock() + self._give_up_after)
        self._schedule(endpoint)
        if overflow:  # last: on_drop may call back into the outbox
            self._dropped(endpoint, oldest, f"more than {self._max_per_peer} pending")
        return False

    def cancel(self, endpoint: str, key: Hashable) -> None:
        """Drop the message pending under ``(endpoint, key)``, if any (it is moot now: the room
        it was about is gone). Not counted as dropped; ``on_drop`` is not called."""
        queue = self._queues.get(endpoint)
        if queue is not None and queue.pop(key, None) is not None and not queue:
            del self._queues[endpoint]

    def forget(self, endpoint: str) -> None:
        """Drop everything pending for ``endpoint``, silently: the peer is gone or has
        re-registered elsewhere, so what it was owed is moot. No further attempt is made."""
        self._queues.pop(endpoint, None)
        self._quiet.pop(endpoint, None)

    def pending(self, endpoint: str | None = None) -> int:
        """How many messages wait for ``endpoint``, or for every endpoint (a gauge)."""
        if endpoint is not None:
            return len(self._queues.get(endpoint, ()))
        return sum(len(queue) for queue in self._queues.values())

    # ------------------------------------------------------------------ the retry round

    def _schedule(self, endpoint: str) -> None:
        if endpoint not in self._scheduled:
            self._scheduled.add(endpoint)
            self._timers.after(self._retry_interval, self._retry, endpoint)

    def _retry(self, endpoint: str) -> None:
        """The timer action for ``endpoint``: one round, then the next timer if anything is
        still pending. Never raises. The endpoint stays in ``_scheduled`` during the round, so
        a send from inside it (``on_drop``) schedules nothing of its own."""
        try:
            self._round(endpoint)
        except Exception:  # a bug here must not end the agent's timer task, nor this endpoint
            log.exception("outbox round for %s failed", endpoint)
        try:
            if self._queues.get(endpoint):
                self._timers.after(self._retry_interval, self._retry, endpoint)
            else:
                self._scheduled.discard(endpoint)
        except Exception:
            self._scheduled.discard(endpoint)
            log.exception("outbox could not schedule the next round for %s", endpoint)

    def _round(self, endpoint: str) -> None:
        """Drop what is past its deadline, then resend oldest first until a refusal."""
        now = self._clock()
        while queue := self._queues.get(endpoint):
            key = next(iter(queue))
            pending = queue[key]
            # Deadlines never decrease along a queue (a replacement keeps its place and its
            # deadline), so what is past its deadline is always at the front.
            if pending.give_up_at <= now:
                del queue[key]
                self._dropped(endpoint, key, f"undelivered after {self._give_up_after} s")
                continue
            self._counters.bump("outbox_retried")
            try:
                sent = self._send_nowait(endpoint, pending.msg, pending.pages)
            except Exception:
                log.exception("outbox could not send %r to %s", pending.msg, endpoint)
                del queue[key]
                self._dropped(endpoint, key, "the send raised")
                continue
            if not sent:
                return  # the socket is still full: the rest waits for the next round
            del queue[key]
        self._queues.pop(endpoint, None)

    def _dropped(self, endpoint: str, key: Hashable, why: str) -> None:
        """Count, log (rate-limited) and report one message already removed from its queue."""
        if endpoint in self._queues and not self._queues[endpoint]:
            del self._queues[endpoint]
        self._counters.bump("outbox_dropped")
        now = self._clock()
        quiet_until, unlogged = self._quiet.get(endpoint, (-math.inf, 0))
        if now >= quiet_until:
            log.warning(
                "gave up a control message to %s (key %r): %s%s", endpoint, key, why,
                f"; {unlogged} more dropped since the last warning" if unlogged else "",
            )
            self._quiet[endpoint] = (now + self._give_up_after, 0)
        else:
            self._quiet[endpoint] = (quiet_until, unlogged + 1)
        if self._on_drop is not None:
            try:
                self._on_drop(endpoint, key)
            except Exception:
                log.exception("on_drop(%r, %r) raised", endpoint, key)
