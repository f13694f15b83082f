"""A fault-injecting wrapper around a real engine, for tests and the demo's ``--fault-rate``.

:class:`FaultEngine` delegates everything to the engine it wraps. For each :meth:`~FaultEngine.
write` it asks a *policy* — ``policy(call_index, peer, nblocks) -> Fault | None`` — whether to
inject a :class:`Fault`, and what kind:

``delay_before``
    sleep ``delay_s``, then make the real call.
``delay_after``
    make the real call, then sleep ``delay_s`` (the bytes have landed; the caller hears late).
``fail``
    raise :class:`~trio_pd.EngineError` without calling the engine: nothing is written.
``partial``
    write the first half of the blocks for real, then raise
    :class:`~trio_pd.EngineError`: the realistic Mooncake failure (a batch with one bad block
    returns -1 after writing the others).
``stall``
    block inside ``write()`` on :attr:`FaultEngine.stalls` (a :class:`StallGate`) until the
    test releases the call, then make the real call.
``late``
    take a copy of the blocks' bytes, raise :class:`~trio_pd.EngineError` at once, and write
    the copy for real ``delay_s`` later, in a thread of its own: a call the engine gave up on
    while its bytes were still queued, which land afterwards, whatever the caller did with
    its source pages meanwhile (``delay_s`` should stay within the engine's
    ``write_deadline_s``, which is the bound a quarantine waits out). The copy is registered
    with the wrapped engine for that write: host memory only. :meth:`FaultEngine.wait_late`
    waits for those writes.
``bad_block``
    make the real call with its first block's destination moved outside anything the peer
    can have registered: the peer's engine refuses that block, and the call fails as a
    real partial failure does. What the wrapped engine does with the call's other blocks is
    its own (Mooncake's TCP transport returns -1 at once and still delivers them, reading
    the source pages after the call returned; NIXL refuses the whole request before sending
    anything).

A stalled call is numbered in the order it reached the gate (0, 1, ...). A test learns that
call ``k`` has entered the engine with ``gate.wait_stalled(k + 1)`` (blocking, for threads) or
``await gate.wait_stalled_async(k + 1)`` (trio), lets it go with :meth:`StallGate.release`,
and opens the gate for good with :meth:`StallGate.release_all`. None of these sleep.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt
import trio

from ..core._closing import ClosesOnExit
from ..core._errors import EngineError
from ..core._memory import HOST
from ._base import (
    Addrs,
    Fence,
    Lens,
    Region,
    TransferEngine,
    call_mark,
    fence_writer,
    flushed,
    join_bytes,
    keeps_failed_calls,
)

FaultKind = Literal["delay_before", "delay_after", "fail", "partial", "stall", "late", "bad_block"]
FAULT_KINDS: tuple[FaultKind, ...] = (
    "delay_before", "delay_after", "fail", "partial", "stall", "late", "bad_block",
)

#: how far ``bad_block`` moves the first block's destination: past any memory a peer can have
#: registered (1 TiB), and still a valid address
_BAD_OFFSET = 1 << 40


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault. ``delay_s`` is used by the delay kinds, ``code`` is the
    :attr:`~trio_pd.EngineError.code` of the error raised by ``fail`` and ``partial``."""

    kind: FaultKind
    delay_s: float = 0.0
    code: int = -1

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {FAULT_KINDS}")
        if self.delay_s < 0:
            raise ValueError("delay_s must not be negative")


#: ``policy(call_index, peer, nblocks)``: the fault for this write() call, or None
Policy = Callable[[int, str, int], Fault | None]


@dataclass(frozen=True, slots=True)
class FaultStats:
    """Counters of a :class:`FaultEngine` (a snapshot)."""

    #: write() calls made (empty ones included)
    calls: int
    #: write() calls that raised, injected or real
    errors: int
    #: injected faults, by kind
    faults: dict[str, int] = field(default_factory=dict)
    #: blocks the wrapped engine reported written (a partial fault's first half included)
    blocks_written: int = 0
    #: probe() calls answered by the override instead of the wrapped engine
    probes_overridden: int = 0
    #: probe() calls that entered the ``probe_hang`` sleep (counted on entry)
    probes_hung: int = 0
    #: fence_writer() calls answered by ``fence_override``
    fences_overridden: int = 0
    #: blocks of ``late`` faults whose delayed real call has been made (written or failed)
    late_blocks: int = 0


class StallGate:
    """Where ``stall`` faults wait. Thread-safe; the async method needs a trio run.

    Call ``k`` (the k-th call to reach the gate, from 0) passes once more than ``k`` releases
    were granted, or once the gate is open. Releases granted before calls arrive are kept.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._entered = 0  # calls that reached the gate
        self._passed = 0  # calls that left it
        self._granted = 0  # releases granted
        self._open = False
        self._arrivals: list[int] = []  # write() call index of each arrival

    @property
    def entered(self) -> int:
        """How many calls have reached the gate so far."""
        with self._cond:
            return self._entered

    @property
    def arrivals(self) -> list[int]:
        """The write() call index (``call_index`` of the policy) of each call that reached
        the gate, in arrival order."""
        with self._cond:
            return list(self._arrivals)

    @property
    def waiting(self) -> int:
        """How many calls are held at the gate now."""
        with self._cond:
            return self._entered - self._passed

    def _hold(self, call_index: int) -> int:
        """Called by the stalled write(): block until this call may go. Returns its number."""
        with self._cond:
            k = self._entered
            self._entered += 1
            self._arrivals.append(call_index)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._open or self._granted > k)
            self._passed += 1
            return k

    def release(self, n: int = 1) -> None:
        """Let the next ``n`` calls (in arrival order) go, whether they arrived yet or not."""
        if n < 0:
            raise ValueError("n must not be negative")
        with self._cond:
            self._granted += n
            self._cond.notify_all()

    def release_all(self) -> None:
        """Open the gate: every held call, and every later one, goes at once."""
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def wait_stalled(self, n: int, timeout: float | None = None) -> bool:
        """Block until at least ``n`` calls have reached the gate (in total). False on
        timeout, or if the gate was opened (:meth:`release_all`) before that: an open gate
        holds nothing, so waiting for it to hold a call could last forever."""
        with self._cond:
            return self._cond.wait_for(lambda: self._entered >= n or self._open, timeout) and (
                self._entered >= n
            )

    async def wait_stalled_async(self, n: int) -> None:
        """Wait until at least ``n`` calls have reached the gate (in total).

        Raises :class:`RuntimeError` if the gate is opened before that.

        **Cancellation:** cancellable at any point; the helper thread that waits on the gate
        is abandoned and finishes on its own when a call arrives or the gate opens (this
        thread is no engine call).
        """
        reached = await trio.to_thread.run_sync(self.wait_stalled, n, abandon_on_cancel=True)
        if not reached:
            raise RuntimeError(f"stall gate opened before {n} calls reached it")


class FaultEngine(ClosesOnExit):
    """Wraps ``inner`` (any :class:`~trio_pd.engines.TransferEngine`) and injects the faults
    ``policy`` picks, one decision per :meth:`write` call. Thread-safe.

    ``probe_override``: None delegates :meth:`probe`; True or False answers without asking
    the wrapped engine (False makes a live peer look dead).

    ``probe_hang``: seconds :meth:`probe` sleeps (``time.sleep``, in the caller's thread)
    before it answers, like Mooncake's ``send_probe`` against a stopped peer. 0 answers at once.

    ``fence_override``: None delegates :meth:`fence_writer`; a :class:`~trio_pd.engines.Fence`
    is answered instead (an UNPROVEN one makes an engine with a fence look like one without).
    """

    def __init__(
        self,
        inner: TransferEngine,
        policy: Policy | None = None,
        *,
        probe_override: bool | None = None,
        probe_hang: float = 0.0,
        fence_override: Fence | None = None,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.policy: Policy = policy if policy is not None else (lambda _i, _p, _n: None)
        self.probe_override = probe_override
        self.probe_hang = probe_hang
        self.fence_override = fence_override
        self.stalls = StallGate()
        self._lock = threading.Lock()
        self._calls = 0
        self._errors = 0
        self._faults: dict[str, int] = {}
        self._blocks_written = 0
        self._probes_overridden = 0
        self._probes_hung = 0
        self._fences_overridden = 0
        self._late: list[threading.Timer] = []
        self._late_done = 0
        self._late_pending: dict[str, int] = {}  # peer -> late writes not made yet
        self._inner_failed: set[str] = set()  # peers a call of the wrapped engine failed to

    @classmethod
    def random(
        cls,
        inner: TransferEngine,
        rate: float,
        seed: int,
        *,
        kinds: Sequence[FaultKind] = ("fail", "partial", "delay_before", "delay_after"),
        delay_s: float = 0.01,
    ) -> FaultEngine:
        """Inject a fault into a fraction ``rate`` of write() calls, of a kind drawn evenly from
        ``kinds``. The draw for call ``i`` depends only on ``seed`` and ``i``, not on which
        thread got there first. ``stall`` is left out by default: nothing would release it."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError("rate must be within [0, 1]")
        if not kinds:
            raise ValueError("kinds must not be empty")
        choices = tuple(kinds)
        for kind in choices:
            Fault(kind)  # validates

        def policy(call_index: int, peer: str, nblocks: int) -> Fault | None:
            rng = random.Random(f"{seed}:{call_index}")
            if rng.random() >= rate:
                return None
            return Fault(rng.choice(choices), delay_s=delay_s)

        return cls(inner, policy)

    def __repr__(self) -> str:
        return f"<FaultEngine around {self.inner!r}>"

    # -- delegated ---------------------------------------------------------------------------

    @property
    def write_deadline_s(self) -> float:
        """The wrapped engine's deadline (the fence the trio layer waits out)."""
        return float(getattr(self.inner, "write_deadline_s", 10.0))

    @property
    def join_bytes(self) -> int:
        """The wrapped engine's bound on a joined call (:func:`~trio_pd.engines.join_bytes`):
        faults land on the calls the wrapped engine would really be given."""
        return join_bytes(self.inner)

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, regions: list[Region]) -> None:
        self.inner.register(regions)

    def unregister(self, regions: list[Region]) -> None:
        self.inner.unregister(regions)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        self.inner.add_peer(session_id, metadata)

    def remove_peer(self, session_id: str) -> None:
        self.inner.remove_peer(session_id)

    def close(self) -> None:
        self.inner.close()

    def fence_writer(self, session: str, hosts: Sequence[str]) -> Fence:
        """The wrapped engine's fence, or ``fence_override`` when set (counted in
        ``fences_overridden``)."""
        override = self.fence_override
        if override is None:
            return fence_writer(self.inner, session, hosts)
        with self._lock:
            self._fences_overridden += 1
        return override

    def call_mark(self, peer: str) -> int | None:
        """The wrapped engine's mark where it keeps failed calls' blocks and one of its calls
        to ``peer`` failed; else 0 (then only ``late`` faults leave blocks behind, and
        :meth:`flushed` knows of them)."""
        with self._lock:
            inner_failed = peer in self._inner_failed
        if not inner_failed or not keeps_failed_calls(self.inner):
            return 0
        return call_mark(self.inner, peer)

    def flushed(self, peer: str, mark: int) -> bool:
        """False while a ``late`` fault's write to ``peer`` is still to be made. Otherwise
        True where no call of the wrapped engine to ``peer`` has failed (an injected
        ``fail`` or ``partial`` leaves nothing behind: this wrapper made, or skipped, each
        call it passed on), else the wrapped engine's answer."""
        with self._lock:
            if self._late_pending.get(peer):
                return False
            inner_failed = peer in self._inner_failed
        if not inner_failed or not keeps_failed_calls(self.inner):
            return True
        return flushed(self.inner, peer, mark)

    def probe(self, peer: str) -> bool:
        hang = self.probe_hang
        if hang > 0:
            with self._lock:
                self._probes_hung += 1
            time.sleep(hang)
        override = self.probe_override
        if override is None:
            return self.inner.probe(peer)
        with self._lock:
            self._probes_overridden += 1
        return override

    # -- faults ------------------------------------------------------------------------------

    def statistics(self) -> FaultStats:
        with self._lock:
            return FaultStats(
                calls=self._calls,
                errors=self._errors,
                faults=dict(self._faults),
                blocks_written=self._blocks_written,
                probes_overridden=self._probes_overridden,
                probes_hung=self._probes_hung,
                fences_overridden=self._fences_overridden,
                late_blocks=self._late_done,
            )

    def _inner_write(self, peer: str, src: Addrs, dst: Addrs, lens: Lens) -> None:
        try:
            self.inner.write(peer, src, dst, lens)
        except BaseException:
            with self._lock:
                self._inner_failed.add(peer)
            raise
        with self._lock:
            self._blocks_written += len(src)

    def write(self, peer: str, src: Addrs, dst: Addrs, lens: Lens) -> None:
        n = len(src)
        with self._lock:
            index = self._calls
            self._calls += 1
        try:
            fault = self.policy(index, peer, n)
            if fault is not None:
                with self._lock:
                    self._faults[fault.kind] = self._faults.get(fault.kind, 0) + 1
            self._write(fault, index, peer, src, dst, lens)
        except BaseException:
            with self._lock:
                self._errors += 1
            raise

    def _write(
        self, fault: Fault | None, index: int, peer: str, src: Addrs, dst: Addrs, lens: Lens
    ) -> None:
        n = len(src)
        if fault is None:
            self._inner_write(peer, src, dst, lens)
        elif fault.kind == "delay_before":
            time.sleep(fault.delay_s)
            self._inner_write(peer, src, dst, lens)
        elif fault.kind == "delay_after":
            self._inner_write(peer, src, dst, lens)
            time.sleep(fault.delay_s)
        elif fault.kind == "fail":
            raise EngineError(
                f"injected fault in write #{index} to {peer}: fail ({n} blocks, none written)",
                code=fault.code,
            )
        elif fault.kind == "partial":
            half = n // 2
            if half:
                self._inner_write(peer, src[:half], dst[:half], lens[:half])
            raise EngineError(
                f"injected fault in write #{index} to {peer}: partial ({half} of {n} blocks "
                f"written): outcome unknown",
                code=fault.code,
            )
        elif fault.kind == "late":
            copy = np.empty(int(lens.sum()), dtype=np.uint8)
            offsets = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.uint64)
            for s_addr, off, ln in zip(src.tolist(), offsets.tolist(), lens.tolist(), strict=True):
                ctypes.memmove(copy.ctypes.data + off, s_addr, ln)
            region = Region(int(copy.ctypes.data), max(copy.nbytes, 1), HOST)
            self.inner.register([region])
            args = (peer, np.uint64(copy.ctypes.data) + offsets, dst, lens, region, copy)
            late = threading.Timer(fault.delay_s, self._late_write, args)
            late.daemon = True
            with self._lock:
                self._late.append(late)
                self._late_pending[peer] = self._late_pending.get(peer, 0) + 1
            late.start()
            raise EngineError(
                f"injected fault in write #{index} to {peer}: late ({n} blocks to be written "
                f"in {fault.delay_s:g} s): outcome unknown",
                code=fault.code,
            )
        elif fault.kind == "bad_block":
            moved = dst.copy()
            moved[0] = moved[0] + np.uint64(_BAD_OFFSET)
            self._inner_write(peer, src, moved, lens)
            raise EngineError(  # (the engine accepted every block: not what was asked)
                f"injected fault in write #{index} to {peer}: bad_block, but the engine "
                f"wrote the call",
                code=fault.code,
            )
        else:  # stall
            self.stalls._hold(index)
            self._inner_write(peer, src, dst, lens)

    def _late_write(
        self, peer: str, src: Addrs, dst: Addrs, lens: Lens, region: Region,
        copy: npt.NDArray[np.uint8],
    ) -> None:
        try:
            self._inner_write(peer, src, dst, lens)
        except Exception:  # (the engine may have closed meanwhile: nothing landed)
            pass
        with contextlib.suppress(Exception):
            self.inner.unregister([region])
        del copy  # (kept alive until the write is over)
        with self._lock:
            self._late_done += len(src)
            self._late_pending[peer] -= 1

    def wait_late(self, timeout: float) -> bool:
        """Block until every ``late`` write started so far has been made (or failed), for
        at most ``timeout`` seconds in all; False if one had not by then."""
        end = time.monotonic() + timeout
        with self._lock:
            late = list(self._late)
        for timer in late:
            timer.join(max(0.0, end - time.monotonic()))
        return not any(timer.is_alive() for timer in late)
