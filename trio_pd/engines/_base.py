"""The small protocol every transfer engine adapter implements.

Every method here is *blocking* and thread-safe: the trio layer calls the data-moving ones only
from threads, never on the event loop: writes and ``add_peer`` on the destination's lane
(``trio_pd.io._lane.Lane``), probes through ``trio.to_thread.run_sync`` with a limiter of their own.
An adapter never retries and never hides an error: a failed write raises
:class:`~trio_pd.EngineError`, which means "outcome unknown" (some blocks may have landed).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

import numpy as np
import numpy.typing as npt

from ..core._memory import Region as Region  # (the protocol's vocabulary: adapters import it here)

Addrs = npt.NDArray[np.uint64]
Lens = npt.NDArray[np.uint64]


class Pending(Protocol):
    """A write that has started. :meth:`wait` returns once every block is complete, or raises
    :class:`~trio_pd.EngineError` ("outcome unknown"). Call it exactly once."""

    def wait(self) -> None: ...


class Deferred:
    """A :class:`Pending` that does all of its work in :meth:`wait` (a blocking write)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def wait(self) -> None:
        self._fn()


def check_lengths(src: Addrs, dst: Addrs, lens: Lens) -> int:
    """The number of blocks; :class:`ValueError` if the three arrays differ in length."""
    n = len(src)
    if len(dst) != n or len(lens) != n:
        raise ValueError(f"src, dst, lens differ in length: {n}, {len(dst)}, {len(lens)}")
    return n


class FenceOutcome(enum.Enum):
    """What :meth:`TransferEngine.fence_writer` proved."""

    #: this engine no longer takes that writer's writes into our memory: none can land any more
    PROVEN = "proven"
    #: nothing is proven: the engine (or the transport it uses) has no such fence, or the
    #: writer's engine still runs and could send what it queued on a new connection
    UNPROVEN = "unproven"
    #: the fence could not be made or checked now (no descriptor left, tables unreadable, a
    #: connection still holding unread bytes at the bound): try again later
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Fence:
    """The answer of :meth:`TransferEngine.fence_writer`: what it proved, and why, in words
    fit for a log line."""

    outcome: FenceOutcome
    detail: str
    #: connections the fence shut (those it found from the writer's hosts)
    connections: int = 0

    @property
    def proven(self) -> bool:
        return self.outcome is FenceOutcome.PROVEN


def fence_writer(engine: TransferEngine, session: str, hosts: Sequence[str]) -> Fence:
    """``engine.fence_writer(session, hosts)``, or UNPROVEN for an engine that has none."""
    fence: Callable[[str, Sequence[str]], Fence] | None = getattr(engine, "fence_writer", None)
    if fence is None:
        return Fence(FenceOutcome.UNPROVEN, f"engine {engine.name!r} has no target-side fence")
    return fence(session, hosts)


#: what writes of several rooms to one peer may weigh in all to join one engine call, for an
#: engine that does not say (``join_bytes``): small writes only, whose cost is the call
JOIN_BYTES = 1 << 20


def join_bytes(engine: TransferEngine) -> int:
    """The bytes up to which ``engine`` is best given the chunk writes of several rooms to one
    peer as one call (``engine.join_bytes``; :data:`JOIN_BYTES` where it does not say).

    Joining saves a call, its completion and a wake-up of the event loop per room. What it
    may cost is the engine's own: a transport that moves one call's blocks in order finishes
    every joined room at the end of the whole call, and the rooms behind it start late
    (Mooncake's TCP transport: large joined writes moved 0.80-0.90 GB/s against 1.03-1.24
    alone: 1 MiB, small writes only); one that moves a call's blocks as fast as separate calls
    loses nothing (NIXL over UCX: 32 MiB, about 4 ms of writing here, which is what an abort
    of a room in such a call may wait for). docs/bench.md has both measurements."""
    return int(getattr(engine, "join_bytes", JOIN_BYTES))


def keeps_failed_calls(engine: TransferEngine) -> bool:
    """Whether ``engine`` may still hold a failed write's blocks after the call returned (it
    offers ``call_mark`` and ``flushed``: Mooncake's TCP transport does). For an engine that
    does not, a call that returned, failed or not, holds nothing."""
    return callable(getattr(engine, "call_mark", None))


def call_mark(engine: TransferEngine, peer: str) -> int | None:
    """``engine.call_mark(peer)``: where its calls to ``peer`` stand now, so that
    :func:`flushed` can tell when a call made from now on has completed (and so every block
    queued to ``peer`` before it has left the engine); None where the engine can give no
    such proof. Only for an engine that :func:`keeps_failed_calls`."""
    mark: Callable[[str], int | None] = engine.call_mark  # type: ignore[attr-defined]
    return mark(peer)


def flushed(engine: TransferEngine, peer: str, mark: int) -> bool:
    """``engine.flushed(peer, mark)``: has a call to ``peer`` made at or after ``mark``
    (:func:`call_mark`) completed?"""
    done: Callable[[str, int], bool] = engine.flushed  # type: ignore[attr-defined]
    return done(peer, mark)


def start_write(engine: TransferEngine, peer: str, src: Addrs, dst: Addrs, lens: Lens) -> Pending:
    """Start a write and return its :class:`Pending`: ``engine.submit`` where the engine can
    have several writes in flight (Mooncake, NIXL), else a :class:`Deferred` ``engine.write``.

    ``submit`` may block briefly (and on the first call to a peer, for the engine's handshake):
    call it from a thread, like ``write``."""
    submit: Callable[[str, Addrs, Addrs, Lens], Pending] | None = getattr(engine, "submit", None)
    if submit is None:
        return Deferred(lambda: engine.write(peer, src, dst, lens))
    return submit(peer, src, dst, lens)


@runtime_checkable
class TransferEngine(Protocol):
    """What trio_pd needs from an engine. One instance per rank (per agent)."""

    #: short engine name for metrics and errors ("mooncake", "nixl")
    name: str

    @property
    def session_id(self) -> str:
        """How peers address this engine (Mooncake: "host:rpc_port"; NIXL: agent name)."""
        ...

    def register(self, regions: list[Region]) -> None:
        """Register memory with the engine. Call before publishing :attr:`session_id`."""
        ...

    def unregister(self, regions: list[Region]) -> None:
        """Deregister memory. Only once no call can still touch it."""
        ...

    def metadata(self) -> bytes:
        """Opaque bytes a peer must load before writing to us (NIXL agent metadata; empty
        for Mooncake). Travels in the REGISTER message."""
        ...

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        """Make a peer addressable (NIXL: add_remote_agent). Idempotent."""
        ...

    def remove_peer(self, session_id: str) -> None:
        """Forget a peer (it re-registers after a restart). Idempotent."""
        ...

    def write(self, peer: str, src: Addrs, dst: Addrs, lens: Lens) -> None:
        """Write ``lens[i]`` bytes from local ``src[i]`` to the peer's ``dst[i]``, for all i,
        and return when every block is complete. Raises EngineError on any failure.

        An engine that can keep several writes in flight also offers
        ``submit(peer, src, dst, lens) -> Pending`` (optional: see :func:`start_write`).

        A failed call may leave blocks in an engine that goes on sending them after the
        call returned (Mooncake's TCP transport does). Such an engine also offers
        ``call_mark(peer) -> int | None`` and ``flushed(peer, mark) -> bool`` (optional: see
        :func:`keeps_failed_calls`): a call made after the mark that completes proves that
        nothing queued before it is left; None from ``call_mark`` says nothing can."""
        ...

    def probe(self, peer: str) -> bool:
        """True if the peer's engine answers, False if it is provably gone. May block for as
        long as the engine's own probe does; callers bound it."""
        ...

    def fence_writer(self, session: str, hosts: Sequence[str]) -> Fence:
        """Make sure no write of the writer whose engine session is ``session`` (on one of
        ``hosts``, numeric addresses) can land in our memory any more, *at this end*, and say
        whether that is proven. The receiving side calls it before it hands back pages a
        writer that stopped answering may still write (a refused connect only says that
        nothing listens there: an agent may have closed while its engine still delivers,
        and a killed process's kernel keeps sending what its sockets held).

        May block (a thread, bounded by the adapter). Never raises for the fence itself:
        trouble is UNKNOWN. Each adapter says what its fence is, per transport
        (docs/lifetimes.md, "What proves a writer gone"); an engine with none answers
        UNPROVEN, and the pages stay held."""
        ...

    def close(self) -> None:
        """Release the engine. Idempotent."""
        ...


@runtime_checkable
class ClosingEngine(TransferEngine, Protocol):
    """A :class:`TransferEngine` that is also its own context manager: leaving
    ``with make_engine(...) as engine:`` closes it. The adapters here all are (and so is
    :class:`~trio_pd.engines.fault.FaultEngine`); trio_pd asks no more than
    :class:`TransferEngine` of an engine it is given."""

    def __enter__(self) -> Self: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
