"""The quarantine fences of prefill (SPEC §5.6: quarantines end on proof only): they keep an
errored write's pages out until its decode peers are proven quiet or gone.

Liveness is three-valued (:class:`~trio_pd.core._state.Liveness`, probed by
:mod:`trio_pd.io._probe`, marked by :mod:`trio_pd.agents._peer_probes`):
a quarantine ends once every peer the failed call wrote to answered ALIVE after the engine's
own deadline for the call, or refused a connect where it listened (it closed, or its process
is gone), *and* the kernel shows that every byte we wrote to the peers' hosts has been
received there (:mod:`trio_pd.io._sendq`: an engine that gave up on a call may have left its
bytes in a TCP send queue, which the link delivers whenever it moves again). A refusal alone
ends nothing. UNKNOWN (a hung probe, an unreachable host, a check that could not run) keeps
the pages out for another fence (``quarantine_unknown``), and so do bytes still queued
(``quarantine_undrained``).

An engine may keep a failed call's blocks queued in its own memory and send them after the
call returned (Mooncake's TCP transport does; so does NIXL with a request that timed out
still posted: :func:`~trio_pd.engines.keeps_failed_calls`); neither a probe nor our kernel
sees those. For such an engine, the quarantine of a failed call to a peer that answers also
waits for the engine's proof that nothing of the call is left
(:func:`~trio_pd.engines.flushed`: on Mooncake a later call to that peer that completed; on
NIXL the kept request's own end). Where
none has since the call failed, the fence makes one, on the peer's lane: it writes again
the first byte of the failed call's last block (the same byte, from source pages the
quarantine still holds, into a page decode holds until our ack). An engine that cannot give
that proof keeps the pages out, counted ``quarantine_unflushed``, as does a barrier that
fails.

Every decision above is :class:`~trio_pd.core._fences.Fences`'s (pure): the fence and its
timer, what each look asks and in which order, what each answer means, when a quarantine
ends. :class:`Quarantines` is its shell: it carries the effects out and answers the looks
with probes, the engine's flush and the kernel's send queues.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable
from functools import partial
from typing import TYPE_CHECKING, assert_never

import numpy as np
import trio

from ..core._fences import (
    CheckDrain,
    EndFence,
    Fence,
    FenceDeadlines,
    FenceDue,
    Fences,
    Flush,
    Look,
    ProbePeers,
    ProveFlush,
)
from ..core._rooms import Arm, Count, Warn
from ..core._state import Lease
from ..engines import call_mark, flushed, keeps_failed_calls
from ..io import _probe, _sendq

if TYPE_CHECKING:
    from ._peers import DecodePeer, PeerRegistry

log = logging.getLogger("trio_pd.prefill")


@functools.cache
def _warn_no_tables() -> None:
    log.warning(
        "no TCP tables to read on this host (/proc/net/tcp): a quarantine ends when its peers "
        "answer after the engine's deadline, without the kernel's word that the failed call's "
        "bytes are gone"
    )


class Quarantines:
    """The shell of one prefill rank's quarantine fences (:class:`Fences`, which decides):
    carries out what it makes due, and answers its looks with probes of the peers, the
    engine's flush and the kernel's send queues. The engine, the timers, the counters, the
    nursery, the lanes' engine calls and the probes are the registry's
    (:class:`~trio_pd.agents._peers.PeerRegistry`), read from it at each use."""

    def __init__(self, registry: PeerRegistry) -> None:
        self._registry = registry
        self.fences: Fences[DecodePeer] = Fences(FenceDeadlines(registry.fence))
        self._deadline_passed = self._timer_due  # (one bound method for every deadline)

    def fenced(self) -> set[int]:
        """The ids of the peers some quarantine waits on (they may not be dropped)."""
        return self.fences.fenced()

    def failed_calls(
        self, lease: Lease, calls: list[tuple[DecodePeer, tuple[int, int]]]
    ) -> None:
        """The engine calls of ``lease``'s chunk that failed, each with the (source,
        destination) of its last block: told by the chunk runner as the chunk settles, just
        before the lease's quarantine starts (:meth:`quarantine` takes them)."""
        self.fences.failed_calls(lease, calls)

    def quarantine(self, lease: Lease, peers: list[DecodePeer], end: Callable[[], None]) -> None:
        """``lease``'s write errored: keep its pages out until every peer it wrote to answers
        a probe after the engine's own deadline for the call (by then the engine has given
        the call up), or refuses connections, with our kernel's send queues to them seen
        empty (what the call left there has been received), and, for an engine that keeps a
        failed call's blocks, the engine's proof that nothing of each failed call to a peer
        that answers is left (:meth:`_flush`). ``end()`` runs once, on that proof."""
        engine = self._registry.engine

        def mark_of(peer: DecodePeer) -> int | None:
            return call_mark(engine, peer.session)

        keeps = keeps_failed_calls(engine)
        self._carry(self.fences.quarantine(lease, peers, end, mark_of if keeps else None))

    def _carry(self, due: FenceDue[DecodePeer]) -> None:
        """Carry out what the fences made due. Synchronous: it never waits."""
        for effect in due:
            match effect:
                case Arm(after=after, key=key):
                    self._registry.timers.after(after, self._deadline_passed, key)
                case Count(name=name):
                    self._registry.counters.bump(name)
                case Warn(message=message):
                    log.warning("%s", message)
                case Look(fence=fence):
                    if self._registry.nursery is not None:
                        self._registry.nursery.start_soon(self._look, fence)
                case EndFence(end=end):
                    end()
                case _:
                    assert_never(effect)

    def _timer_due(self, key: Hashable) -> None:
        """A deadline the fences armed has passed: they decide what that means."""
        self._carry(self.fences.handle_timer(key))

    async def _look(self, fence: Fence[DecodePeer]) -> None:
        """Answer what the fences ask of ``fence``, in their order, until they have decided."""
        await trio.lowlevel.checkpoint()
        while (check := self.fences.next_check(fence)) is not None:
            match check:
                case ProbePeers(peers=peers):
                    states = [await self._registry.probes.liveness(p) for p in peers]
                    due = self.fences.on_liveness(fence, states)
                case ProveFlush(flush=flush):
                    due = self.fences.on_flush(fence, flush, await self._flush(flush))
                case CheckDrain(peers=peers):
                    drained = await self._sent_bytes_acknowledged(peers)
                    due = self.fences.on_drain(fence, drained)
                case _:
                    assert_never(check)
            self._carry(due)

    async def _flush(self, flush: Flush[DecodePeer]) -> str | None:
        """Has the engine proven that nothing of the failed call ``flush`` is left in it
        (:func:`~trio_pd.engines.flushed`)? On Mooncake a later call to the peer that
        completed proves it (the engine sends a peer's blocks in order); if none has, make
        one: the first byte of the failed call's last block written again, on the peer's
        lane. (On NIXL only the kept request's end proves it; the write changes nothing.)
        None once proven; otherwise why not."""
        peer, mark = flush.peer, flush.mark
        if mark is None:
            await trio.lowlevel.checkpoint()
            return (f"engine {self._registry.engine.name!r} cannot prove that a failed call's "
                    f"blocks to {peer.session} are gone (for Mooncake: more than one TCP "
                    "connection per peer, or RDMA)")
        if flushed(self._registry.engine, peer.session, mark):
            await trio.lowlevel.checkpoint()
            return None
        src, dst = flush.tail
        one = np.ones(1, dtype=np.uint64)
        barrier = partial(self._registry.engine.write, peer.session,
                          np.array([src], dtype=np.uint64), np.array([dst], dtype=np.uint64), one)
        try:
            await self._registry.run_engine_call(peer.lane, barrier)
        except Exception as exc:  # (LaneClosed: it registered again; an engine error)
            await trio.lowlevel.checkpoint()
            return f"a barrier write to {peer.session} failed: {exc}"
        if flushed(self._registry.engine, peer.session, mark):
            return None
        return f"the engine holds a failed call's blocks to {peer.session} still"

    async def _sent_bytes_acknowledged(self, peers: list[DecodePeer]) -> bool | None:
        """Has every TCP connection of ours to these peers' hosts been seen with an empty send
        queue (see :mod:`trio_pd.io._sendq`), within one ``fence``? An engine's failed call may
        have left bytes there, which TCP delivers (into pages) whenever the link moves again:
        a peer answering a probe proves only that the link moves now.

        False if not within the fence, or if a peer's host does not resolve. True at once for
        peers reached over no TCP at all (in-process). Where the platform has no such tables
        (not Linux) there is no such evidence: True, with a warning once, so the quarantine
        rests on the engine's deadline alone there. None (unknown, counted ``checks_unknown``)
        where the tables exist but cannot be read now, e.g. with no descriptor left: a check
        that cannot run is never taken for "drained"."""
        await trio.lowlevel.checkpoint()
        hosts: set[str] = set()
        for peer in peers:
            named = await _probe.peer_hosts(self._registry.engine, peer.session, peer.endpoint)
            if named is not None and not named:
                return False
            hosts.update(named or ())
        if not hosts:
            return True
        watch = _sendq.DrainWatch()
        with trio.move_on_after(self.fences.deadlines.fence):
            while True:
                try:
                    snap = await trio.to_thread.run_sync(_sendq.snapshot, sorted(hosts))
                except (OSError, RuntimeError) as exc:  # (no descriptor, no thread)
                    self._registry.counters.bump("checks_unknown")
                    log.warning("send queues to %s could not be read: %r", sorted(hosts), exc)
                    return None
                if snap is None:
                    _warn_no_tables()
                    return True
                if watch.observe(snap):
                    return True
                await trio.sleep(self.fences.deadlines.drain_poll)
        log.info("send queues to %s not seen empty in %d looks: %s", sorted(hosts),
                 watch.looks, sorted(watch.pending))
        return False

    def drop_fences(self) -> None:
        """The agent is closing: the rooms end their own quarantines (our own pages)."""
        self.fences.clear()
