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
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import trio

from ..core._state import Lease, Liveness
from ..engines import call_mark, flushed, keeps_failed_calls
from ..io import _probe, _sendq

if TYPE_CHECKING:
    from ._peers import DecodePeer, PeerRegistry

log = logging.getLogger("trio_pd.prefill")

#: seconds between two looks at the kernel's send queues while a quarantine waits on them
_DRAIN_POLL = 0.05


@functools.cache
def _warn_no_tables() -> None:
    log.warning(
        "no TCP tables to read on this host (/proc/net/tcp): a quarantine ends when its peers "
        "answer after the engine's deadline, without the kernel's word that the failed call's "
        "bytes are gone"
    )


@dataclass(eq=False, slots=True)
class _Flush:
    """A failed call to ``peer`` whose blocks the engine may still hold: ``mark`` is where
    the engine's calls to the peer stood once it had returned (None: the engine can prove
    nothing), ``tail`` the (source, destination) of its last block."""

    peer: DecodePeer
    mark: int | None
    tail: tuple[int, int]


@dataclass(eq=False, slots=True)
class _Fence:
    lease: Lease
    peers: list[DecodePeer]
    end: Callable[[], None]
    #: the lease's failed calls that the engine must prove over (:meth:`Quarantines._flush`)
    flushes: list[_Flush] = field(default_factory=list)


class Quarantines:
    """Owns the quarantine fences of one prefill rank: the failed calls a settling chunk
    reports, each errored lease's fence, its timer, and the proofs that end it (probes of its
    peers, the engine's flush, the kernel's drained send queues). The engine, the fence, the
    timers, the counters, the nursery, the lanes' engine calls and the probes are the
    registry's (:class:`~trio_pd.agents._peers.PeerRegistry`), read from it at each use."""

    def __init__(self, registry: PeerRegistry) -> None:
        self._registry = registry
        self._fences: dict[Lease, _Fence] = {}
        #: a settling chunk's failed calls, until its quarantine takes them (:meth:`failed_calls`)
        self._failed: dict[Lease, list[tuple[DecodePeer, tuple[int, int]]]] = {}

    def fenced(self) -> set[int]:
        """The ids of the peers some quarantine waits on (they may not be dropped)."""
        return {id(p) for fence in self._fences.values() for p in fence.peers}

    def failed_calls(
        self, lease: Lease, calls: list[tuple[DecodePeer, tuple[int, int]]]
    ) -> None:
        """The engine calls of ``lease``'s chunk that failed, each with the (source,
        destination) of its last block: told by the chunk runner as the chunk settles, just
        before the lease's quarantine starts (:meth:`quarantine` takes them)."""
        self._failed[lease] = calls

    def quarantine(self, lease: Lease, peers: list[DecodePeer], end: Callable[[], None]) -> None:
        """``lease``'s write errored: keep its pages out until every peer it wrote to answers
        a probe after the engine's own deadline for the call (``fence``: by then the engine
        has given the call up), or refuses connections, with our kernel's send queues to them
        seen empty (what the call left there has been received), and, for an engine that
        keeps a failed call's blocks, the engine's proof that nothing of each failed call to
        a peer that answers is left (:meth:`_flush`). ``end()`` runs once, on that proof."""
        fence = _Fence(lease, peers, end)
        failed = self._failed.pop(lease, [])
        if failed and keeps_failed_calls(self._registry.engine):
            for peer, tail in failed:  # (the calls have returned: marks taken now are after)
                mark = call_mark(self._registry.engine, peer.session)
                fence.flushes.append(_Flush(peer, mark, tail))
        self._fences[lease] = fence
        self._rearm(fence)

    def _rearm(self, fence: _Fence) -> None:
        """Look at ``fence`` again once another ``fence`` seconds have passed."""
        self._registry.timers.after(self._registry.fence, partial(self._fence_passed, fence))

    def _fence_passed(self, fence: _Fence) -> None:
        if self._fences.get(fence.lease) is fence and self._registry.nursery is not None:
            self._registry.nursery.start_soon(self._confirm, fence)

    async def _confirm(self, fence: _Fence) -> None:
        await trio.lowlevel.checkpoint()
        states: list[Liveness] = []
        for peer in fence.peers:
            states.append(await self._registry.probes.liveness(peer))
        if self._fences.get(fence.lease) is not fence:
            return
        if any(s is Liveness.UNKNOWN for s in states):
            self._registry.counters.bump("quarantine_unknown")
            log.warning(
                "quarantine of %d pages kept: peer liveness unknown (%s)",
                fence.lease.npages, ", ".join(p.endpoint for p in fence.peers),
            )
            self._rearm(fence)
            return
        # what the engine kept of the failed calls to peers that answer: gone only once a
        # later call to the peer completed (a peer that refuses can be sent nothing more)
        alive = {id(p) for p, s in zip(fence.peers, states, strict=True) if s is Liveness.ALIVE}
        for flush in fence.flushes:
            if id(flush.peer) not in alive:
                continue
            why = await self._flush(flush)
            if self._fences.get(fence.lease) is not fence:
                return  # (ended meanwhile)
            if why is not None:
                self._registry.counters.bump("quarantine_unflushed")
                log.warning("quarantine of %d pages kept (%s): %s", fence.lease.npages,
                            flush.peer.endpoint, why)
                self._rearm(fence)
                return
        # every peer answered, or refused (closed, or its process gone): a refusal proves
        # nothing about the bytes already sent to it, so both wait for the kernel's word
        drained = await self._sent_bytes_acknowledged(fence.peers)
        if self._fences.get(fence.lease) is not fence:
            return  # (ended meanwhile)
        if drained:
            self._end_fence(fence)
            return
        if drained is None:
            self._registry.counters.bump("quarantine_unknown")
            why = "our send queues to them could not be read"
        else:
            self._registry.counters.bump("quarantine_undrained")
            why = "bytes written to them are still in the kernel's send queue"
        log.warning("quarantine of %d pages kept (%s): %s", fence.lease.npages,
                    ", ".join(p.endpoint for p in fence.peers), why)
        self._rearm(fence)

    async def _flush(self, flush: _Flush) -> str | None:
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
        with trio.move_on_after(self._registry.fence):
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
                await trio.sleep(_DRAIN_POLL)
        log.info("send queues to %s not seen empty in %d looks: %s", sorted(hosts),
                 watch.looks, sorted(watch.pending))
        return False

    def _end_fence(self, fence: _Fence) -> None:
        if self._fences.pop(fence.lease, None) is fence:
            fence.end()

    def drop_fences(self) -> None:
        """The agent is closing: the rooms end their own quarantines (our own pages)."""
        self._fences.clear()
        self._failed.clear()
