"""The Mooncake Transfer Engine adapter (``mooncake.engine.TransferEngine``).

One :class:`MooncakeEngine` per rank. It uses the engine's P2P handshake (no metadata server):
the session id is ``"host:rpc_port"`` and peers need nothing else, so :meth:`metadata` is empty
and :meth:`add_peer` / :meth:`remove_peer` do nothing.

What a call costs and how it fails (see ENGINES.md for the measurements):

* :meth:`write` is one or more ``batch_transfer_sync_write`` calls. Each releases the GIL and
  then busy-polls a CPU core until its blocks are done, so keep the number of threads calling
  it small.
* :meth:`submit` starts a write (``batch_transfer_async_write``) and returns a
  :class:`~trio_pd.engines.Pending`; several can be in flight to one peer, so the link stays
  busy while the caller handles the previous one (trio_pd's lanes do this). Its ``wait()``
  first *sleeps* through most of the time the batch is expected to take, from a running
  estimate of the link's rate, and lets the engine busy-poll only the rest.
* Both are thread-safe.
* :meth:`register` gives each region its location from its memory kind
  (:func:`mooncake_location`: ``cuda:N`` for a GPU's memory); regions on a GPU need the
  CUDA build of the wheel, and the adapter refuses them on the non-CUDA one.
* A return code of -1 means **"outcome unknown"**: a batch with one bad block fails after the
  others were written; a batch cut short by a dead peer may have landed in part. The adapter
  raises :class:`~trio_pd.EngineError` and never retries.
* More blocks in flight to one peer than the engine queues for it
  (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, about 2,048 by default) make it fail the call
  without delivering the admitted part, and can leave that link dead. The adapter raises that
  cap to 8,192 unless it is set, splits a call into sub-batches of at most
  :data:`MAX_BLOCKS_PER_CALL` blocks, and caps the blocks in flight to each peer, across all
  threads, at ``max_blocks_in_flight_per_peer`` (two full calls) and three quarters of the
  engine's cap.
* The receiving engine checks that destinations lie in memory it registered (-1 in ~0.1 ms),
  but the TCP transport does **not** check sources (0.3.13): a block from unregistered local
  memory is sent as is. trio_pd validates its blocks before calling the engine.
* A failed call is not over when it returns. The TCP transport keeps its blocks queued
  for the peer and still sends them afterwards, reading the source pages then: measured,
  a call whose first block the peer refused returned -1 in 1-4 ms while the other 511 MiB
  of it landed over the next 0.2-0.4 s; a call to a stopped peer returned -1 after 5 s, and
  its blocks landed when the peer resumed, 3 s or 35 s later (connections dropped at the
  30 s progress timeout and reopened for them). What proves them gone is a later call to
  the same peer that completes: the transport sends a peer's blocks in the order they were
  queued, on one connection per peer, which the adapter sets
  (``MC_TCP_LANES_PER_PEER=1``, :func:`_set_env_defaults`). :meth:`MooncakeEngine.call_mark`
  and :meth:`MooncakeEngine.flushed` give that proof; with more connections per peer (or
  RDMA) there is none.
* The receiving side's fence (:meth:`MooncakeEngine.fence_writer`): the TCP transport
  receives a writer's blocks on connections it accepted in this process, and writes each
  straight into our memory after checking its range against what is registered. The check
  knows addresses only, so re-registering a region stops nothing. Shutting those connections
  down does: the engine closes them, and a byte that still comes on one (a dead writer's
  kernel delivering what its sockets held) meets a reset. Other writers on the same host lose
  their call in flight (-1, outcome unknown) and reconnect for the next one. See
  docs/lifetimes.md, "What proves a writer gone", for what was measured.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..core._closing import ClosesOnExit
from ..core._errors import ConfigurationError, EngineError
from ..core._memory import MemoryKind
from ..core._wire import bracketed, check_advertised_host, ip_literal
from ..io._probe import _host_port
from ..io._sendq import fence_accepted, listening_ports
from ._base import Addrs, Deferred, Fence, FenceOutcome, Lens, Pending, Region, check_lengths

#: the most blocks one ``batch_transfer_sync_write`` call carries
MAX_BLOCKS_PER_CALL = 1024

#: default cap on blocks in flight to one peer, summed over every thread writing to it: two
#: full calls (and an aux block each), so a lane's second write is in flight while its first
#: runs. With 1,024, two coalesced calls of 513 blocks did not fit, and every second write
#: waited for the one before it (docs/bench.md, "pipelined").
MAX_BLOCKS_IN_FLIGHT_PER_PEER = 2 * (MAX_BLOCKS_PER_CALL + 32)

#: the engine's own cap on transfers queued to one peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``)
#: that trio_pd sets when the environment does not; past the cap the engine fails a call
#: without delivering the admitted part (its default, about 2,048, is too close to two calls)
DEFAULT_QUEUED_PER_PEER = "8192"

#: the per-call deadline set when the environment does not set one (seconds, as a string)
DEFAULT_TRANSFER_TIMEOUT_S = "5"

#: how long :meth:`MooncakeEngine.fence_writer` waits for the fenced connections to close,
#: and for the writer's engine port to answer a connect (seconds)
FENCE_BOUND_S = 2.0

#: engines are built one at a time in a process, so that each can tell its own TCP data port
#: from the listeners that appear while it initialises (see :func:`_data_port`)
_build_lock = threading.Lock()

_PIP_NAME = "mooncake-transfer-engine-non-cuda"  # or mooncake-transfer-engine on CUDA hosts

#: what ``batch_transfer_async_write`` returns when it started nothing (0: not submitted; -1, as an
#: unsigned id: the peer's segment could not be opened). Waiting on one crashes the process.
_NO_BATCH = (0, -1, (1 << 64) - 1)

#: a wait sleeps only if the batch is expected to need longer than this (seconds): shorter
#: sleeps overshoot
_MIN_SLEEP_S = 200e-6
#: ...and never longer than this, whatever the estimate says
_MAX_SLEEP_S = 0.05
#: it sleeps this fraction of the expected remaining time, then busy-waits the rest
_SLEEP_FRACTION = 0.8
#: batches smaller than this do not update the rate estimate (their time is mostly latency)
_RATE_MIN_BYTES = 256 << 10
#: a wait that ends this soon after the sleep found the batch already complete: it says only
#: that the link is faster than estimated, so the estimate is raised, not measured
_DONE_ON_WAKE_S = 50e-6
_MAX_RATE = 50e9


def import_engine_class() -> Any:
    """Mooncake's ``TransferEngine`` class. :class:`~trio_pd.ConfigurationError`, saying
    what to install, if the ``mooncake`` module is missing (``pip install trio-pd`` without
    an extra) or does not load (the Debian libraries it links against are missing)."""
    try:
        from mooncake.engine import TransferEngine
    except ModuleNotFoundError as exc:
        if exc.name not in ("mooncake", "mooncake.engine"):
            raise
        raise ConfigurationError(
            "the Mooncake engine needs the `mooncake` module, which is not installed: pip "
            f"install 'trio-pd[cpu]' (or {_PIP_NAME}; on CUDA hosts 'trio-pd[cuda]')"
        ) from exc
    except ImportError as exc:
        raise ConfigurationError(
            f"the `mooncake` module is installed but does not load ({exc}); it needs the "
            "Debian libraries libibverbs1 librdmacm1 libnuma1, even for TCP"
        ) from exc
    return TransferEngine


def _quiet_info_logs() -> None:
    """Mooncake logs "Batch Transfer completed!" at INFO for every batch an async wait sees
    finish, on stderr; its bundled glog does not read ``GLOG_minloglevel`` from the
    environment. Set glog's ``minloglevel`` flag to ``GLOG_minloglevel`` if the user set it,
    else to 1 (warnings and errors stay). Process-wide, like every glog flag."""
    import ctypes

    from mooncake import engine as _binding

    level = os.environ.get("GLOG_minloglevel", "1")  # noqa: SIM112 (glog's own spelling)
    try:
        flag = ctypes.c_int32.in_dll(ctypes.CDLL(_binding.__file__), "_ZN3fLI17FLAGS_minloglevelE")
        flag.value = int(level)
    except (OSError, ValueError):  # another build: its logs stay as they are
        pass


def _set_env_defaults() -> None:
    """Environment knobs the engine reads when the Python object is built.

    ``MC_TRANSFER_TIMEOUT`` (whole seconds, ``atoi``; values below 5 become 5; default 30) is
    read by the constructor of the Python binding's ``TransferEngine``. Every sync call then
    gives up after ``MC_TRANSFER_TIMEOUT`` seconds plus one nanosecond per byte of the call
    (an allowance of 1 GB/s) and returns -1.

    trio_pd relies on that deadline for one thing only: a write call that has been handed to a
    thread *returns* within a known bound, so the shielded wait for it in the trio layer is
    bounded and the call's pages can be quarantined on time. It is **not** a fence for the
    bytes: on timeout the engine frees the batch without cancelling the requests already
    queued, and the transport still delivers them afterwards, reading the source then
    (measured: a write to a stopped peer returned -1 after 5.0 s; every block landed once the
    peer was resumed, 3 s or 35 s later). Pages touched by a failed call stay quarantined
    until something stronger says no write can land: a later call to the peer that
    completed (:meth:`MooncakeEngine.flushed`), or the peer's proven death.

    Nor does it bound the *first* call to a peer: that call opens the peer's segment with a
    handshake that has no deadline of its own (about 60 s against a stopped peer, like
    ``send_probe``).

    The default here is 5 seconds (the engine's own floor) instead of the engine's 30, and is
    applied only when the variable is not already set.

    ``MC_TCP_LANES_PER_PEER``: connections (the transport's "lanes") the TCP transport
    opens to one peer, each with its own queue; by default several, and blocks queued on one
    can land after a later call's blocks on another completed (measured: a one-byte call
    made right after a failed call completed while 1-3 of the failed call's blocks were
    still to land, in 3 of 6 runs). With one, the transport delivers a peer's blocks in the
    order they were queued, and a call that completes proves every block queued before it
    delivered or dropped (24 of 24 runs; no slower on loopback: 2.3-2.8 GB/s for 256 KiB to
    4 MiB blocks, against 1.4-2.7 with the default). Set to 1 unless it, or the older
    ``MC_TCP_MAX_CONNECTIONS_PER_PEER``, is set; with another value
    :meth:`MooncakeEngine.call_mark` answers None (no proof).

    ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (at most 65535): transfers the TCP transport
    queues to one peer; more fail the call (see the module docstring). Set to
    :data:`DEFAULT_QUEUED_PER_PEER` when not set; the adapter's per-peer budget stays at three
    quarters of it whatever it is (:func:`_queue_cap`).
    """
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", DEFAULT_TRANSFER_TIMEOUT_S)
    os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", DEFAULT_QUEUED_PER_PEER)
    if "MC_TCP_MAX_CONNECTIONS_PER_PEER" not in os.environ:
        os.environ.setdefault("MC_TCP_LANES_PER_PEER", "1")


def _one_lane() -> bool:
    """Whether the TCP transport opens one connection per peer (see :func:`_set_env_defaults`):
    the variable the engine reads says 1."""
    value = os.environ.get(
        "MC_TCP_LANES_PER_PEER", os.environ.get("MC_TCP_MAX_CONNECTIONS_PER_PEER", "")
    )
    return value.strip() == "1"


#: whether this process's Mooncake engines reach their peers over IPv6: fixed when the first
#: one is built (None: none built yet), because Mooncake reads ``MC_USE_IPV6`` once per process
_ipv6_process: bool | None = None
_family_lock = threading.Lock()


def _check_family(host: str) -> None:
    """Fix, or check, the address family of this process's Mooncake engines.

    Mooncake (0.3.13) resolves the peers its handshake dials as IPv4 unless ``MC_USE_IPV6``
    is set (to any value: ``0`` turns it on too), and then as IPv6 only; it reads the variable
    once per process. So the first engine built decides: an IPv6 literal ``host`` sets
    ``MC_USE_IPV6=1`` when it is not set, and every engine of the process must then be of the
    family the variable says. One that is not is refused here, with
    :class:`~trio_pd.ConfigurationError`, instead of failing every write to its peers. A
    host given as a name is not checked (nothing is resolved here)."""
    global _ipv6_process
    address = ip_literal(host)
    with _family_lock:
        if _ipv6_process is None:
            if address is not None and address.version == 6:
                os.environ.setdefault("MC_USE_IPV6", "1")
            _ipv6_process = "MC_USE_IPV6" in os.environ
        ipv6 = _ipv6_process
    if address is None or (address.version == 6) == ipv6:
        return
    if ipv6:
        raise ConfigurationError(
            f"mooncake engine: host {host!r} is an IPv4 address, but this process's Mooncake "
            "engines reach their peers over IPv6 (MC_USE_IPV6 was set, to any value, when "
            "the first was built; Mooncake reads it once per process): give every Mooncake "
            "engine of the process an IPv6 address, or none of them and leave MC_USE_IPV6 "
            "unset"
        )
    raise ConfigurationError(
        f"mooncake engine: host {host!r} is an IPv6 address, but this process's Mooncake "
        "engines reach their peers over IPv4 (the first was built without MC_USE_IPV6, "
        "which Mooncake reads once per process): give every Mooncake engine of the process "
        "an IPv6 address from the first on, or an IPv4 one"
    )


def _queue_cap() -> int:
    """The most blocks the adapter lets be in flight to one peer under the engine's own queue
    cap: three quarters of ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (2,048 if unreadable)."""
    try:
        cap = int(os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "2048"))
    except ValueError:
        cap = 2048
    return max(1, min(cap, 65535) * 3 // 4)


def mooncake_location(kind: MemoryKind | None) -> str:
    """The location a region of ``kind`` is registered with: ``"cuda:N"`` for memory of CUDA
    device N; ``"*"`` for host memory and for a region whose kind is not stated, which has
    Mooncake find the location itself (for host pages their NUMA node, ``"cpu:N"``: naming
    ``"cpu:0"`` here would tie every host region to node 0's NICs)."""
    if kind is None or kind.device is None:
        return "*"
    return f"cuda:{kind.device}"


def _listening() -> set[int] | None:
    try:
        return listening_ports()
    except OSError:
        return None


def _rdma_possible() -> bool:
    """Whether the engine may pick RDMA: an RDMA device is present and ``MC_FORCE_TCP`` is
    not set (Mooncake uses RDMA whenever it finds a device)."""
    if os.environ.get("MC_FORCE_TCP", "") not in ("", "0"):
        return False
    try:
        return any(os.scandir("/sys/class/infiniband"))
    except OSError:
        return False


def _refuses(session: str) -> bool | None:
    """Does the host of ``session`` (``"host:rpc_port"``) refuse a connection to that port?
    True if it did, False if one connected (closed at once), None otherwise (unreachable, no
    answer within :data:`FENCE_BOUND_S`, a session that does not parse, no descriptor)."""
    parsed = _host_port(session)
    if parsed is None:
        return None
    try:
        with socket.create_connection(parsed, timeout=FENCE_BOUND_S):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return None


@functools.cache
def _cuda_build() -> bool:
    """Whether the installed ``mooncake`` module comes from the CUDA build of the wheel (both
    builds install the same module name; the non-CUDA one is a distribution of its own)."""
    owners = importlib.metadata.packages_distributions().get("mooncake", [])
    return any(name.lower().replace("_", "-") == "mooncake-transfer-engine" for name in owners)


class _PeerBudget:
    """Blocks in flight per peer, across threads: ``hold(peer, n)`` blocks until ``n`` fit.

    A write that :meth:`try_take` turned away and that will :meth:`hold` later (at its
    ``wait()``) is *queued* for its peer; while one is, :meth:`try_take` turns every later
    write to that peer away too. Otherwise a later write could take the budget the queued
    one needs, and a caller that waits its writes in order (a lane) would wait on itself."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._cond = threading.Condition()
        self._in_flight: dict[str, int] = {}
        self._queued: dict[str, int] = {}

    @contextmanager
    def hold(self, peer: str, n: int) -> Iterator[None]:
        n = min(n, self._limit)  # a call never waits for more than the whole budget
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight.get(peer, 0) + n <= self._limit)
            self._in_flight[peer] = self._in_flight.get(peer, 0) + n
        try:
            yield
        finally:
            self.give(peer, n)

    def try_take(self, peer: str, n: int) -> bool:
        """Take ``n`` blocks of ``peer``'s budget if they fit now and no write to ``peer`` is
        queued; never blocks."""
        with self._cond:
            if peer in self._queued or self._in_flight.get(peer, 0) + n > self._limit:
                return False
            self._in_flight[peer] = self._in_flight.get(peer, 0) + n
            return True

    def queue(self, peer: str) -> None:
        """A write to ``peer`` that ``try_take`` turned away will ``hold`` later."""
        with self._cond:
            self._queued[peer] = self._queued.get(peer, 0) + 1

    def unqueue(self, peer: str) -> None:
        """That write is over (written or failed)."""
        with self._cond:
            left = self._queued[peer] - 1
            if left:
                self._queued[peer] = left
            else:
                del self._queued[peer]

    def give(self, peer: str, n: int) -> None:
        with self._cond:
            left = self._in_flight[peer] - n
            if left:
                self._in_flight[peer] = left
            else:
                del self._in_flight[peer]
            self._cond.notify_all()


class _Order:
    """The calls made to one peer, in the order they were handed to the engine: ``started``
    numbers them (the next call takes this number), ``proven`` is one past the number of the
    latest call seen complete. With one connection per peer, every call numbered below
    ``proven`` has left the engine (delivered or dropped)."""

    __slots__ = ("proven", "started")

    def __init__(self) -> None:
        self.started = 0
        self.proven = 0


class _Link:
    """What the waits know of one peer's link: when it should be free again, and how fast it
    has been moving bytes (an exponentially weighted average)."""

    __slots__ = ("busy_until", "done_at", "rate")

    def __init__(self) -> None:
        self.busy_until = 0.0  # expected end of the last batch submitted
        self.done_at = 0.0  # when the last batch was seen complete
        self.rate = 1e9  # bytes per second; corrected by the first large batches


class _PeerBook:
    """What the engine knows of each peer: the order of its calls (:class:`_Order`, which
    proves a failed call over) and its link's pace (:class:`_Link`, how long a wait sleeps).
    Thread-safe: one lock, held for the bookkeeping only, never across an engine call."""

    def __init__(self, *, ordered: bool) -> None:
        self._lock = threading.Lock()
        self._links: dict[str, _Link] = {}
        #: calls per peer, numbered in the order they were handed to the engine; they prove
        #: a failed call over only on one ordered connection (``ordered``)
        self._orders: dict[str, _Order] = {}
        self._ordered = ordered

    def expect(self, peer: str, nbytes: int, now: float) -> float:
        """When a batch of ``nbytes`` to ``peer`` submitted ``now`` should be complete (it
        queues behind the peer's earlier batches)."""
        with self._lock:
            link = self._links.get(peer)
            if link is None:
                link = self._links[peer] = _Link()
            expected_done = max(now, link.busy_until) + nbytes / link.rate
            link.busy_until = expected_done
            return expected_done

    def number(self, peer: str) -> int:
        """The number of the call to ``peer`` being handed to the engine now."""
        with self._lock:
            order = self._orders.get(peer)
            if order is None:
                order = self._orders[peer] = _Order()
            number = order.started
            order.started += 1
            return number

    def completed(self, peer: str, number: int) -> None:
        with self._lock:
            order = self._orders[peer]
            order.proven = max(order.proven, number + 1)

    def seen(self, flight: _InFlight, ok: bool, *, slept: bool, woke: float,
             done: float) -> None:
        """``flight`` was seen complete at ``done`` (``ok``: written), after a wait that
        ``slept`` until ``woke``: correct the link's pace, and the call's order when ok."""
        with self._lock:
            link = self._links[flight.peer]
            if ok and flight.nbytes >= _RATE_MIN_BYTES:
                if slept and done - woke < _DONE_ON_WAKE_S:
                    # complete before we looked: we only know it was faster than we thought
                    link.rate = min(link.rate * 1.25, _MAX_RATE)
                else:
                    took = done - max(flight.submitted, link.done_at)
                    if took > 0:
                        link.rate = 0.75 * link.rate + 0.25 * (flight.nbytes / took)
            link.done_at = done
            if not ok:
                link.busy_until = done  # whatever was queued behind it is not on time either
            else:
                order = self._orders[flight.peer]
                order.proven = max(order.proven, flight.number + 1)

    def mark(self, peer: str) -> int | None:
        """:meth:`MooncakeEngine.call_mark`."""
        if not self._ordered:
            return None
        with self._lock:
            order = self._orders.get(peer)
            return 0 if order is None else order.started

    def flushed(self, peer: str, mark: int) -> bool:
        """:meth:`MooncakeEngine.flushed`."""
        with self._lock:
            order = self._orders.get(peer)
            return order is not None and order.proven > mark


@dataclass(eq=False, slots=True)
class _InFlight:
    """One submitted batch (the :class:`Pending` of :meth:`MooncakeEngine.submit`)."""

    owner: MooncakeEngine
    peer: str
    bid: int
    blocks: int
    nbytes: int
    submitted: float
    expected_done: float
    #: its number in the peer's order of calls (:class:`_Order`)
    number: int = 0
    waited: bool = False

    def wait(self) -> None:
        self.owner._wait(self)


def _by_location(regions: list[Region]) -> dict[str, list[Region]]:
    """``regions`` by their Mooncake location (:func:`mooncake_location`), in the order the
    locations first appear; :class:`~trio_pd.EngineError` for a device region when the
    wheel is not the CUDA build."""
    groups: dict[str, list[Region]] = {}
    for r in regions:
        groups.setdefault(mooncake_location(r.kind), []).append(r)
    device = [loc for loc in groups if loc != "*"]
    if device and not _cuda_build():
        raise EngineError(
            f"mooncake: regions on {', '.join(device)} need the CUDA build of the wheel "
            f"(pip install mooncake-transfer-engine); {_PIP_NAME} moves host memory only"
        )
    return groups


def _register_groups(engine: Any, groups: dict[str, list[Region]]) -> None:
    """One ``batch_register_memory`` per location; on a failure, deregister what the
    earlier calls registered, then raise."""
    done: list[int] = []
    for location, group in groups.items():
        bases = [r.base for r in group]
        rc = engine.batch_register_memory(bases, [r.length for r in group], location)
        if rc != 0:
            error = EngineError(
                f"mooncake batch_register_memory of {len(group)} regions at "
                f"{location!r} returned {rc}",
                code=rc,
            )
            if done and engine.batch_unregister_memory(done) != 0:
                error.add_note(f"and deregistering the {len(done)} regions before failed")
            raise error
        done.extend(bases)


def _initialize(host: str, protocol: str, device: str) -> tuple[Any, int, int | None]:
    """A new engine on ``host`` (``initialize`` with the P2P handshake), its RPC port and its
    TCP transport's data port: the one listener, besides the RPC port, that initialising
    opened (None if that cannot be told: then there is no fence)."""
    _MooncakeTE = import_engine_class()
    _quiet_info_logs()
    bare = host.strip().removeprefix("[").removesuffix("]")
    with _build_lock:
        before = _listening()
        engine: Any = _MooncakeTE()
        rc = engine.initialize(bare, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise EngineError(
                f"mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}, {device!r}) "
                f"returned {rc}",
                code=rc,
            )
        after = _listening()
    rpc_port = engine.get_rpc_port()
    new = (after - before - {rpc_port}) if before is not None and after is not None else set()
    return engine, rpc_port, new.pop() if len(new) == 1 else None


def _fence(session: str, hosts: Sequence[str], port: int | None, *, rdma: bool) -> Fence:
    """:meth:`MooncakeEngine.fence_writer` for an engine whose TCP data port is ``port``
    (None: not known) and that may use RDMA (``rdma``)."""
    if rdma:
        return Fence(FenceOutcome.UNPROVEN, "this engine may use RDMA (an RDMA device is "
                     "present, MC_FORCE_TCP is not set): trio_pd makes no RDMA fence")
    if port is None:
        return Fence(FenceOutcome.UNPROVEN, "the TCP transport's data port of this engine "
                     "is not known")
    refused = _refuses(session)
    if refused is None:
        return Fence(FenceOutcome.UNKNOWN, f"the writer's engine port {session} gave no "
                     "answer")
    if not refused:
        return Fence(FenceOutcome.UNPROVEN, f"the writer's engine at {session} still "
                     "accepts connections: it may send what it queued on a new one")
    try:
        shut, left = fence_accepted(port, hosts, bound=FENCE_BOUND_S)
    except OSError as exc:
        return Fence(FenceOutcome.UNKNOWN, f"could not fence connections from "
                     f"{', '.join(hosts)}: {exc}")
    if left:
        return Fence(FenceOutcome.UNKNOWN, f"{left} of {shut} connections from "
                     f"{', '.join(hosts)} to data port {port} still readable after "
                     f"{FENCE_BOUND_S:g} s", shut)
    return Fence(FenceOutcome.PROVEN, f"the writer's engine at {session} refuses "
                 f"connections, and the {shut} connection(s) from {', '.join(hosts)} to "
                 f"data port {port} are shut and closed", shut)


class MooncakeEngine(ClosesOnExit):
    """A Mooncake Transfer Engine over the P2P handshake.

    ``host`` is the address peers reach this engine on: an IPv4 or IPv6 address (an IPv6 one
    with or without brackets; the session id brackets it, ``[::1]:PORT``) or a name. IPv6
    needs ``MC_USE_IPV6``, which Mooncake reads once per process: the first engine on an IPv6
    address sets it, and the process's engines must then all be IPv6 (see
    :func:`_check_family`; :class:`~trio_pd.ConfigurationError` otherwise). ``protocol`` is
    passed to
    ``initialize`` ("tcp" or "rdma"); note that it does not force the transport: the engine
    uses RDMA when it finds an RDMA NIC (set ``MC_FORCE_TCP=1`` to force TCP). ``device`` is the
    RDMA device filter ("" for all).

    Construction sets ``MC_TRANSFER_TIMEOUT`` to :data:`DEFAULT_TRANSFER_TIMEOUT_S` seconds if
    it is not set (see :func:`_set_env_defaults` for what that deadline does and does not
    promise). Raises :class:`~trio_pd.ConfigurationError` if the wheel is missing
    (:func:`import_engine_class`), :class:`~trio_pd.EngineError` if initialisation fails.
    """

    name = "mooncake"
    join_bytes = 1 << 20  # (other rooms' writes join one call up to this: engines.join_bytes)

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        protocol: str = "tcp",
        device: str = "",
        max_blocks_in_flight_per_peer: int = MAX_BLOCKS_IN_FLIGHT_PER_PEER,
    ) -> None:
        if max_blocks_in_flight_per_peer < 1:
            raise ValueError("max_blocks_in_flight_per_peer must be at least 1")
        check_advertised_host(host, "mooncake engine")  # (its session id is host:rpc_port)
        _check_family(host)
        _set_env_defaults()
        engine, rpc_port, data_port = _initialize(host, protocol, device)
        self._engine: Any = engine
        bare = host.strip().removeprefix("[").removesuffix("]")
        self._session_id = f"{bracketed(bare)}:{rpc_port}"
        #: the TCP transport's data port (None if it cannot be told: then there is no fence)
        self._data_port: int | None = data_port
        self._rdma = _rdma_possible()
        self._lock = threading.Lock()  # registration book and close
        self._registered: dict[int, int] = {}  # base -> length
        self._closed = False
        self._budget = _PeerBudget(min(max_blocks_in_flight_per_peer, _queue_cap()))
        #: each peer's calls in order and its link's pace
        self._peers = _PeerBook(ordered=not self._rdma and _one_lane())

    def __repr__(self) -> str:
        return f"<MooncakeEngine {self._session_id}{' closed' if self._closed else ''}>"

    @property
    def write_deadline_s(self) -> float:
        """How long a write call may take before the engine gives up on it (seconds, for a
        call of a few MB): ``MC_TRANSFER_TIMEOUT`` as the engine reads it (floor 5)."""
        try:
            value = int(os.environ.get("MC_TRANSFER_TIMEOUT", DEFAULT_TRANSFER_TIMEOUT_S))
        except ValueError:
            value = 30
        return float(max(5, value)) + 1.0

    @property
    def session_id(self) -> str:
        return self._session_id

    def _live_engine(self) -> Any:
        engine = self._engine
        if self._closed or engine is None:
            raise EngineError(f"mooncake engine {self._session_id} is closed")
        return engine

    # -- memory ------------------------------------------------------------------------------

    def register(self, regions: list[Region]) -> None:
        """Register the regions with their locations (:func:`mooncake_location`): one
        ``batch_register_memory`` call (it releases the GIL) per location, in the order the
        locations first appear. If a later call fails, what the earlier ones registered is
        deregistered again: a failed ``register`` leaves none of ``regions`` registered.

        A region on a CUDA device needs the CUDA build of the wheel
        (``mooncake-transfer-engine``): the non-CUDA one would move a device pointer as host
        memory and crash the process, so it refuses such a region with
        :class:`~trio_pd.EngineError` before registering anything."""
        if not regions:
            return
        groups = _by_location(regions)
        with self._lock:
            _register_groups(self._live_engine(), groups)
            for r in regions:
                self._registered[r.base] = r.length

    def unregister(self, regions: list[Region]) -> None:
        """Deregister regions this engine registered. Only once no call can still touch them."""
        if not regions:
            return
        with self._lock:
            engine = self._live_engine()
            unknown = [r for r in regions if r.base not in self._registered]
            if unknown:
                raise EngineError(f"mooncake: unregister of regions never registered: {unknown}")
            rc = engine.batch_unregister_memory([r.base for r in regions])
            if rc != 0:
                raise EngineError(
                    f"mooncake batch_unregister_memory of {len(regions)} regions returned {rc}",
                    code=rc,
                )
            for r in regions:
                del self._registered[r.base]

    # -- peers (the P2P handshake needs no metadata) -----------------------------------------

    def metadata(self) -> bytes:
        return b""

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        return None

    def remove_peer(self, session_id: str) -> None:
        return None

    # -- data --------------------------------------------------------------------------------

    def submit(self, peer: str, src: Addrs, dst: Addrs, lens: Lens) -> Pending:
        """Start writing every block to ``peer``; the returned :class:`Pending`'s ``wait()``
        returns when all are complete (call it exactly once).

        One async batch when the blocks fit in one sub-batch and in the peer's in-flight
        budget now; otherwise the write happens in ``wait()`` (a :class:`Deferred`
        :meth:`write`), so a caller that holds earlier batches of this peer in flight never
        blocks here on a budget only its own waits would free. Once a write to ``peer`` is
        deferred, later submits to it are deferred too until its ``wait()`` has finished:
        otherwise a later batch could take the budget that the deferred write, waited
        first, needs, and a caller that waits in order (a lane) would wait on itself for
        ever. :meth:`write`, made for one call at a time, busy-waits instead: sleeping only
        pays when the next batch is already queued behind this one. Raises
        :class:`~trio_pd.EngineError` if the engine refuses the batch (outcome unknown).
        """
        n = check_lengths(src, dst, lens)
        if n == 0:
            return Deferred(lambda: None)
        engine = self._live_engine()
        if n > MAX_BLOCKS_PER_CALL or not self._budget.try_take(peer, n):
            self._budget.queue(peer)

            def write_queued() -> None:
                try:
                    self.write(peer, src, dst, lens)
                finally:
                    self._budget.unqueue(peer)

            return Deferred(write_queued)
        try:
            return self._submit(engine, peer, src, dst, lens)
        except BaseException:
            self._budget.give(peer, n)
            raise

    def write(self, peer: str, src: Addrs, dst: Addrs, lens: Lens) -> None:
        """Write every block to ``peer``; returns when all are complete.

        Splits into sub-batches of :data:`MAX_BLOCKS_PER_CALL` blocks, issued one after the
        other, each holding its share of the peer's in-flight budget. The first failing
        sub-batch raises :class:`~trio_pd.EngineError` (later ones are not issued); earlier
        sub-batches are complete, the failing one may be written in part.
        """
        n = check_lengths(src, dst, lens)
        if n == 0:
            return
        engine = self._live_engine()
        parts = (n + MAX_BLOCKS_PER_CALL - 1) // MAX_BLOCKS_PER_CALL
        for k, lo in enumerate(range(0, n, MAX_BLOCKS_PER_CALL)):
            hi = min(lo + MAX_BLOCKS_PER_CALL, n)
            srcs = src[lo:hi].tolist()
            dsts = dst[lo:hi].tolist()
            sizes = lens[lo:hi].tolist()
            with self._budget.hold(peer, hi - lo):
                number = self._peers.number(peer)
                rc = engine.batch_transfer_sync_write(peer, srcs, dsts, sizes)
            if rc == 0:
                self._peers.completed(peer, number)
            else:
                raise EngineError(
                    f"mooncake write to {peer} failed (rc={rc}) in sub-batch {k + 1}/{parts} "
                    f"(blocks {lo}..{hi - 1} of {n}): outcome unknown: some blocks may have "
                    f"been written",
                    code=rc,
                )

    def _submit(self, engine: Any, peer: str, src: Addrs, dst: Addrs, lens: Lens) -> _InFlight:
        nbytes = int(lens.sum())
        now = time.monotonic()
        expected_done = self._peers.expect(peer, nbytes, now)
        number = self._peers.number(peer)
        bid = engine.batch_transfer_async_write(peer, src.tolist(), dst.tolist(), lens.tolist())
        if bid in _NO_BATCH:
            why = ("the engine did not submit the batch" if bid == 0 else
                   "the engine could not open the peer's segment")
            raise EngineError(
                f"mooncake write to {peer} did not start ({why}; batch id {bid}) for "
                f"{len(src)} blocks: outcome unknown",
                code=-1,
            )
        return _InFlight(self, peer, bid, len(src), nbytes, now, expected_done, number)

    def _wait(self, flight: _InFlight) -> None:
        """Sleep through most of the batch's expected time, then let the engine busy-wait the
        rest (``get_batch_transfer_status`` has the engine's own deadline, like
        ``batch_transfer_sync_write``), then give the blocks' budget back."""
        if flight.waited:
            raise RuntimeError("a mooncake batch was waited twice")  # it would crash
        flight.waited = True
        engine = self._engine
        try:
            if engine is None:
                raise EngineError(f"mooncake engine {self._session_id} closed, batch in flight")
            ahead = flight.expected_done - time.monotonic()
            slept = ahead > _MIN_SLEEP_S
            if slept:
                time.sleep(min(ahead * _SLEEP_FRACTION, _MAX_SLEEP_S))
            woke = time.monotonic()
            rc = engine.get_batch_transfer_status([flight.bid])
            done = time.monotonic()
        finally:
            self._budget.give(flight.peer, flight.blocks)
        self._peers.seen(flight, rc == 0, slept=slept, woke=woke, done=done)
        if rc != 0:
            raise EngineError(
                f"mooncake write to {flight.peer} failed (rc={rc}) for {flight.blocks} blocks: "
                f"outcome unknown: some blocks may have been written",
                code=rc,
            )

    def call_mark(self, peer: str) -> int | None:
        """Where the calls to ``peer`` stand now: :meth:`flushed` tells when a call handed to
        the engine from now on has completed. Taken after a failed call returned, that
        proves every block the failed call left queued delivered or dropped (module
        docstring). None where no call can prove it: the TCP transport may use more than
        one connection to a peer (``MC_TCP_LANES_PER_PEER`` is not 1), or RDMA may be in
        use, whose queues trio_pd has not measured."""
        return self._peers.mark(peer)

    def flushed(self, peer: str, mark: int) -> bool:
        """Whether a call to ``peer`` handed to the engine at or after ``mark``
        (:meth:`call_mark`) has completed: everything queued for the peer before it has
        left the engine."""
        return self._peers.flushed(peer, mark)

    def probe(self, peer: str) -> bool:
        """``send_probe`` answers at once for a live or a dead peer, but takes about 60 s for a
        hung one (stopped process, black-holed host): callers bound it."""
        return bool(self._live_engine().send_probe(peer) == 0)

    def fence_writer(self, session: str, hosts: Sequence[str]) -> Fence:
        """Make sure no write of the Mooncake engine ``session`` (``"host:rpc_port"``) on
        ``hosts`` can land in our memory any more.

        TCP transport: PROVEN once that engine refuses connections on its RPC port (it is
        closed, or its process is gone: it can open no new connection for what it queued)
        *and* every connection we accepted from ``hosts`` on our data port has been shut down
        and then seen closed by our engine, or past the shutdown with nothing left unread
        (:func:`~trio_pd.io._sendq.fence_accepted`): a byte that still comes on one meets a reset.
        Every writer on those hosts loses its connections: a call of another writer in flight
        then fails (-1, outcome unknown) and its next call reconnects (measured: about 1 s
        later). UNPROVEN while the writer's engine still accepts connections (it may send what
        it queued on a new one), when the data port of this engine is not known, and when the
        engine may use RDMA, whose fence (deregistering the memory region, which invalidates
        the rkey a stale write carries) trio_pd does not make. UNKNOWN when the writer's port
        gives no answer, or the tables or sockets cannot be read or reached, or a connection
        still holds unread bytes after :data:`FENCE_BOUND_S`."""
        self._live_engine()
        return _fence(session, hosts, self._data_port, rdma=self._rdma)

    def close(self) -> None:
        """Deregister what is still registered and drop the engine. Idempotent.

        Call it only once no write can still be running (the trio layer's shutdown order).
        The binding's destructor joins the engine's threads and takes 0.4-1 s **holding the
        GIL**: every Python thread, an event loop included, stalls for that long wherever
        close() runs (``trio.to_thread`` does not help). Close engines when nothing is
        timing-sensitive any more, e.g. all ranks of a process together at the end.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            engine, self._engine = self._engine, None
            bases = list(self._registered)
            self._registered.clear()
        try:
            if bases:
                rc = engine.batch_unregister_memory(bases)
                if rc != 0:
                    raise EngineError(
                        f"mooncake close: batch_unregister_memory of {len(bases)} regions "
                        f"returned {rc}",
                        code=rc,
                    )
        finally:
            del engine  # the binding's destructor closes segments and stops the engine
