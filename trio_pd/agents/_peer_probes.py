"""Failed marks and probes of prefill's decode peers (SPEC §5.7: a peer that is not alive fails
fast).

A failed engine call fails the rooms in that call and nothing else while its peer answers: the
call's rooms, and any chunk for that peer that comes meanwhile, wait for a probe of the peer
(:meth:`PeerProbes.verdict`). ALIVE: the failure stays with the call's rooms (the engine's
error), and the waiting chunks go ahead. Anything else marks the peer failed
(:meth:`PeerProbes.mark_failed`): the call's rooms fail with :class:`~trio_pd.PeerLost` naming
why, and later chunks fail fast until a probe answers ALIVE or the peer registers again.

Liveness is three-valued (:class:`~trio_pd.core._state.Liveness`, probed by
:mod:`trio_pd.io._probe`); what a quarantine makes of it is :mod:`trio_pd.agents._quarantine`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from ..core._state import Liveness
from ..io import _probe

if TYPE_CHECKING:
    from ._peers import DecodePeer, PeerRegistry

log = logging.getLogger("trio_pd.prefill")


@dataclass(eq=False, slots=True)
class _Probe:
    """A probe of one peer under way and, once ``done``, what it answered."""

    done: trio.Event = field(default_factory=trio.Event)
    state: Liveness = Liveness.UNKNOWN


class PeerProbes:
    """Owns each decode peer's failed mark (``failed``, ``lost``), its probe under way
    (``probe``, one at a time per peer, run in the registry's nursery) and the end of its
    registration (``gone``): every change of those fields is made here. The engine, the
    fence, the counters and the nursery are the registry's (:class:`~trio_pd.agents._peers.
    PeerRegistry`), read from it at each use."""

    def __init__(self, registry: PeerRegistry) -> None:
        self._registry = registry

    def mark_failed(self, peer: DecodePeer, why: str) -> None:
        """``peer`` is not alive as far as we know (``why``): later chunks to it fail fast with
        :class:`~trio_pd.PeerLost` until a probe answers ALIVE or it registers again. Counted
        (``peers_failed``) and logged once per mark (a peer proven gone was logged as such)."""
        peer.lost = why
        if peer.failed:
            return
        peer.failed = True
        self._registry.counters.bump("peers_failed")
        if not peer.gone:
            log.warning("decode peer %s lost: %s; chunks to it fail fast until it answers a probe",
                        peer.endpoint, why)

    def reprobe(self, peer: DecodePeer) -> None:
        """Probe ``peer`` in the background unless a probe of it is under way (a chunk met its
        failed mark: one that answers ALIVE ends it)."""
        self._start_probe(peer)

    async def verdict(self, peer: DecodePeer) -> Liveness:
        """Is ``peer`` alive? The answer of the probe of it under way, or of a new one, applied
        to its failed mark (see :meth:`liveness`). Asked when an engine call to it failed, and
        by a chunk for it that comes while that probe runs: until the answer, nobody can tell a
        failed call (its rooms fail, nothing else) from a lost peer (everything to it fails).

        **Cancellation:** cancellable while it waits; the probe carries on for the others
        (it is the registry's task). A cancelled caller learns nothing."""
        probe = self._start_probe(peer)
        if probe is None:  # the agent is closing: no probe starts any more
            await trio.lowlevel.checkpoint()
            return Liveness.UNKNOWN
        await probe.done.wait()
        return probe.state

    def _start_probe(self, peer: DecodePeer) -> _Probe | None:
        if peer.probe is None and self._registry.nursery is not None:
            peer.probe = _Probe()
            self._registry.nursery.start_soon(self._probe_failed, peer, peer.probe)
        return peer.probe

    async def liveness(self, peer: DecodePeer) -> Liveness:
        """Probe ``peer``: ALIVE when its engine answers; REFUSED when its control endpoint or
        its engine's port refuses connections (its registration is over; no proof that our
        bytes to it are gone); UNKNOWN otherwise. The answer sets or ends its failed mark:
        marked only while it is not alive (SPEC §5.7). A peer whose registration is over
        answers GONE at once (a registration that no chunk can use any more)."""
        if peer.gone:
            await trio.lowlevel.checkpoint()
            return Liveness.GONE
        state = await _probe.probe(
            self._registry.engine,
            peer.session,
            control_endpoint=peer.endpoint,
            timeout=self._registry.fence,
            threads=self._registry.probe_threads,
            counters=self._registry.counters,
        )
        if state is Liveness.ALIVE:
            if peer.failed:  # any probe that answers ends the fast-fail mark
                peer.failed = False
                self._registry.counters.bump("peers_back")
                log.info("decode peer %s answers a probe again: chunks to it go ahead",
                         peer.endpoint)
        elif state is Liveness.REFUSED:
            why = "refuses connections where it listened (its agent or process is gone)"
            self.registration_over(peer, why)
            self.mark_failed(peer, f"it {why}")
        else:
            self.mark_failed(
                peer,
                f"no answer to a probe within {self._registry.fence:g} s (unreachable, stopped "
                "or hung: its liveness is unknown)",
            )
        return state

    async def _probe_failed(self, peer: DecodePeer, probe: _Probe) -> None:
        try:
            probe.state = await self.liveness(peer)
        finally:
            if peer.probe is probe:
                peer.probe = None
            probe.done.set()

    def registration_over(self, peer: DecodePeer, why: str) -> None:
        """``peer``'s registration is over (``why``): counted and logged once. Its quarantines
        still end at their fence only, once our send queues to it are seen drained
        (:meth:`Fences.on_drain <trio_pd.core._fences.Fences.on_drain>`): neither
        a refusal nor a new session proves our bytes to it gone."""
        if peer.gone:
            return
        peer.gone = True
        self._registry.counters.bump("peers_lost")
        log.warning("decode peer %s (engine session %s) %s: its registration is over",
                    peer.endpoint, peer.session, why)
