"""The NIXL adapter (``nixl_cu12._api.nixl_agent`` over the UCX backend).

One :class:`NixlEngine` per rank: one NIXL agent whose name is the session id. A peer must load
our agent metadata (:meth:`metadata`, taken *after* :meth:`register`) with :meth:`add_peer`
before it can write to us; trio_pd ships it in the REGISTER message.

What the adapter sets up, and why (measured with nixl-cu12 1.5.1 on loopback):

* **Quiet logging.** NIXL's Python logger prints INFO lines ("Backend UCX was instantiated",
  "Initialized NIXL agent") for every agent, to **stdout** (where they would corrupt a JSON
  report). If ``NIXL_LOG_LEVEL`` is not set, the adapter sets
  it to ``WARN`` (it must be set before ``nixl_cu12`` is first imported; if it was imported
  earlier, the ``nixl`` logger's level is lowered directly).
* **No crash at exit.** The wheel's UCX module for AWS EFA links two copies of libibverbs and
  libnl (the bundled and the system one); when both are loaded the process segfaults in
  ``rtnl_tc_unregister`` while unloading libraries at exit (exit status 139 after a clean
  run). If ``UCX_MODULES`` is not set, the adapter sets it to ``^efa`` (load every UCX module
  but that one) before the first agent is built. Set ``UCX_MODULES`` yourself on EFA hosts.
* **A progress thread that sleeps.** NIXL's UCX backend needs a progress thread on the target
  side (without one, a write's data lands but the initiator never sees it complete). The
  Python wrapper builds that thread with ``pthrDelay = 0``, which makes it poll without ever
  blocking: one full core per agent, even when idle. The adapter builds the agent with a
  ``pthrDelay`` of ``progress_delay_us`` (default 1000 µs): the thread then blocks in
  ``poll()`` on UCX's event descriptors with a 1 ms timeout (measured: idle CPU from 100 % of
  a core to about 2 %, same throughput and small-write latency). ``progress_delay_us=0``
  keeps NIXL's busy polling.
* **Thread safety.** The trio layer calls :meth:`write` from several threads at once. The agent
  is built with ``NIXL_THREAD_SYNC_RW`` (transfers share a reader lock, metadata changes take
  it exclusively); the Python wrapper's default, ``NONE``, is not thread-safe.

Limits:

* NIXL has no liveness call: :meth:`probe` sends an empty notification and reports the
  connection lost only once UCX has noticed (a killed peer: milliseconds; a hung one: only
  when UCX's keepalive gives up). See :meth:`probe`.

Memory kinds. NIXL names a memory type (DRAM, or VRAM with a CUDA device id) in every
descriptor list, and one list holds one type. The adapter registers each region with its own
type, from the region's :class:`~trio_pd.core._memory.MemoryKind` (a region of unstated kind takes
the ``mem_type`` / ``device_id`` the engine was built with), so one agent can hold a pool whose
KV buffers are on a GPU and whose aux buffer is in host memory. A write's remote descriptors
must carry the types the *peer* registered, which NIXL's metadata does not hand back to Python:
:meth:`NixlEngine.metadata` therefore starts with a short trio_pd header listing the registered
regions and their kinds, and :meth:`NixlEngine.add_peer` reads it. A write whose blocks span
several (local, remote) type pairs (KV pages from VRAM plus the aux row from DRAM) is posted as
one NIXL request per pair and completes when all of them have.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..core._closing import ClosesOnExit
from ..core._errors import ConfigurationError, EngineError
from ..core._memory import HOST, MemoryKind
from ._base import Addrs, Deferred, Fence, FenceOutcome, Lens, Pending, Region, check_lengths

_PIP_NAME = "nixl-cu12"  # pip install --no-deps nixl-cu12 (its torch requirement is not needed)

#: first and longest sleep between completion checks of a write (seconds)
POLL_FIRST_S = 20e-6
POLL_MAX_S = 1e-3

#: default ``pthrDelay`` of the UCX progress thread (µs); NIXL rounds it up to whole ms
DEFAULT_PROGRESS_DELAY_US = 1000

#: a write gives up after this many seconds plus one per GB it carries (Mooncake's rule)
DEFAULT_TRANSFER_TIMEOUT_S = 5.0

_build_lock = threading.Lock()

#: :meth:`NixlEngine.metadata` is this, the number of regions, one record per region, then
#: NIXL's own agent metadata
_META_MAGIC = b"trio-pd/nixl-kinds/1\n"
_META_COUNT = struct.Struct("<I")
#: base, length, CUDA device (-1: host memory)
_META_REGION = struct.Struct("<QQq")
_META_MAX_REGIONS = 1 << 16


def _nixl_type(kind: MemoryKind) -> tuple[str, int]:
    """NIXL's memory type and device id for memory of ``kind``."""
    return ("DRAM", 0) if kind.device is None else ("VRAM", kind.device)


def _pack_metadata(regions: list[Region], agent_metadata: bytes) -> bytes:
    records = b"".join(
        _META_REGION.pack(r.base, r.length, -1 if r.kind is None or r.kind.device is None
                          else r.kind.device)
        for r in regions
    )
    return _META_MAGIC + _META_COUNT.pack(len(regions)) + records + agent_metadata


def _unpack_metadata(metadata: bytes) -> tuple[list[Region] | None, bytes]:
    """The regions a peer's :meth:`NixlEngine.metadata` lists (None: bytes without trio_pd's
    header, NIXL metadata alone) and its NIXL agent metadata. EngineError if malformed."""
    if not metadata.startswith(_META_MAGIC):
        return None, metadata
    at = len(_META_MAGIC)
    try:
        (count,) = _META_COUNT.unpack_from(metadata, at)
        if count > _META_MAX_REGIONS:
            raise ValueError(f"{count} regions")
        at += _META_COUNT.size
        regions = []
        for _ in range(count):
            base, length, device = _META_REGION.unpack_from(metadata, at)
            at += _META_REGION.size
            regions.append(Region(base, length, HOST if device < 0 else MemoryKind.cuda(device)))
    except (struct.error, ValueError) as exc:
        raise EngineError(f"nixl: malformed trio_pd metadata header: {exc}") from exc
    return regions, metadata[at:]


class _KindMap:
    """The memory kind of every region one agent registered, to tell each block's kind by its
    first byte. ``single`` is the kind of every block when all regions share one (no lookup)."""

    __slots__ = ("bases", "codes", "default", "ends", "kinds", "single")

    def __init__(self, regions: list[Region], default: MemoryKind) -> None:
        ordered = sorted(regions, key=lambda r: r.base)
        kinds = sorted({r.kind or default for r in ordered}, key=str)
        self.single: MemoryKind | None = kinds[0] if len(kinds) == 1 else None
        if not ordered:
            self.single = default
        if default not in kinds:
            kinds.append(default)
        self.kinds: list[MemoryKind] = kinds
        self.default = kinds.index(default)
        self.bases = np.array([r.base for r in ordered], dtype=np.uint64)
        self.ends = np.array([r.end for r in ordered], dtype=np.uint64)
        self.codes = np.array([kinds.index(r.kind or default) for r in ordered], dtype=np.intp)

    def codes_of(self, addrs: Addrs) -> npt.NDArray[np.intp]:
        """Index into :attr:`kinds` of each address's region (:attr:`default` outside all)."""
        pos = np.searchsorted(self.bases, addrs, side="right").astype(np.intp) - 1
        safe = np.maximum(pos, 0)
        inside = (pos >= 0) & (addrs < self.ends[safe]) if len(self.bases) else pos >= 0
        return np.where(inside, self.codes[safe] if len(self.bases) else 0, self.default)


class _Requests:
    """The requests of one write whose blocks span several memory-type pairs (one per pair):
    :meth:`wait` waits for every one (each exactly once) and raises the first error, with the
    others as notes."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[_Request]) -> None:
        self.parts = parts

    def wait(self) -> None:
        errors: list[BaseException] = []
        for part in self.parts:
            try:
                part.wait()
            except Exception as exc:
                errors.append(exc)
        if errors:
            for other in errors[1:]:
                errors[0].add_note(f"another part of the write failed too: {other}")
            raise errors[0]


def _set_env_defaults() -> None:
    os.environ.setdefault("UCX_MODULES", "^efa")
    if "NIXL_LOG_LEVEL" not in os.environ:
        os.environ["NIXL_LOG_LEVEL"] = "WARN"
        # read once, when nixl_cu12 is first imported; lower the logger too in case it was
        logger = logging.getLogger("nixl")
        if logger.level < logging.WARNING:
            logger.setLevel(logging.WARNING)


def import_api() -> Any:
    """NIXL's Python API module, with :func:`_set_env_defaults` applied first.
    :class:`~trio_pd.ConfigurationError`, saying what to install, if ``nixl_cu12`` is
    missing or does not load."""
    _set_env_defaults()
    try:
        from nixl_cu12 import _api
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == "nixl_cu12"
        raise ConfigurationError(
            "the NIXL engine needs the `nixl_cu12` module, which is "
            + ("not installed" if missing else f"installed but does not load ({exc})")
            + f": pip install 'trio-pd[nixl]' && pip install --no-deps {_PIP_NAME} (its "
            "declared torch dependency is not needed)"
        ) from exc
    return _api


def _build_agent(api: Any, name: str, progress_delay_us: int) -> Any:
    """``nixl_agent(name, config)`` with the sync mode and progress-thread delay set.

    ``nixl_agent.__init__`` fills a ``nixlAgentConfig`` and then assigns ``pthrDelay = 0``.
    For the duration of the constructor the bindings' config class is replaced by a subclass
    whose ``pthrDelay`` setter keeps at least ``progress_delay_us``; nothing else changes.
    """
    config = api.nixl_agent_config(
        backends=["UCX"],
        enable_prog_thread=True,
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
    )
    bindings = api.nixlBind
    base: Any = getattr(bindings, "nixlAgentConfig", None)
    descriptor: Any = getattr(base, "pthrDelay", None)
    if progress_delay_us <= 0 or base is None or descriptor is None:
        return api.nixl_agent(name, config)

    class _Config(base):  # type: ignore[misc]
        # the wrapper assigns pthrDelay = 0 after building the config: keep our floor
        @property
        def pthrDelay(self) -> int:
            return int(descriptor.__get__(self, base))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            descriptor.__set__(self, max(int(value), progress_delay_us))

    with _build_lock:
        bindings.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgentConfig = base


class _Request:
    """One posted NIXL request (the :class:`Pending` of :meth:`NixlEngine.submit`)."""

    __slots__ = ("agent", "blocks", "deadline", "error", "handle", "owner", "peer", "state")

    def __init__(
        self, agent: Any, handle: Any, peer: str, blocks: int, owner: NixlEngine | None = None
    ) -> None:
        self.owner = owner
        self.agent = agent
        self.handle = handle
        self.peer = peer
        self.blocks = blocks
        self.state = "posting"
        self.deadline = 0.0
        self.error: EngineError | None = None

    def fail(self, exc: Exception) -> None:
        self.error = EngineError(
            f"nixl write to {self.peer} of {self.blocks} blocks failed ({self.state!r}): "
            f"{exc!r}: outcome unknown: some blocks may have been written"
        )
        self.error.__cause__ = exc

    def wait(self) -> None:
        if self.handle is None:
            raise RuntimeError("a nixl request was waited twice")
        agent, handle = self.agent, self.handle
        self.handle = None
        if self.error is None:
            try:
                delay = POLL_FIRST_S
                while self.state == "PROC":
                    if time.monotonic() > self.deadline:
                        self.state = "timed out"
                        break
                    time.sleep(delay)
                    delay = min(delay * 2, POLL_MAX_S)
                    self.state = agent.check_xfer_state(handle)
                if self.state != "DONE":
                    self.error = EngineError(
                        f"nixl write to {self.peer} of {self.blocks} blocks ended "
                        f"{self.state!r}: outcome unknown: some blocks may have been written"
                    )
            except Exception as exc:
                self.fail(exc)
        if self.state == "timed out" and self.owner is not None:
            # Still posted: releasing it does not stop it (measured over UCX's tcp: the
            # blocks landed once the peer resumed, read from the source after the release).
            # Kept until it ends; the engine's flushed() says when (NixlEngine.flushed).
            self.owner._keep_unfinished(self.peer, handle)
            assert self.error is not None
            self.error.add_note("the request is still posted: the adapter keeps it until it "
                                "ends (NixlEngine.flushed)")
            raise self.error
        try:
            agent.release_xfer_handle(handle)
        except Exception as exc:
            # An unfinished request is cancelled on release; if NIXL cannot cancel it, it
            # keeps the handle and releases it when the agent goes away.
            note = f"nixl could not release the request: {exc!r}"
            if self.error is None:
                self.error = EngineError(
                    f"nixl write to {self.peer} of {self.blocks} blocks: {note}"
                )
                self.error.__cause__ = exc
            else:
                self.error.add_note(note)
        if self.error is not None:
            raise self.error


def _xfer_descs(agent: Any, addrs: Addrs, lens: Lens, kind: MemoryKind) -> Any:
    """NIXL transfer descriptors for blocks at ``addrs`` of ``lens`` bytes in memory of
    ``kind``."""
    mem_type, device = _nixl_type(kind)
    rows = np.empty((len(addrs), 3), dtype=np.uint64)
    rows[:, 0] = addrs
    rows[:, 1] = lens
    rows[:, 2] = device
    return agent.get_xfer_descs(rows, mem_type)


def _parts(
    local: _KindMap, remote: _KindMap, src: Addrs, dst: Addrs
) -> list[tuple[MemoryKind, MemoryKind, npt.NDArray[np.intp] | None]]:
    """The blocks grouped by (local kind, remote kind): one NIXL request each. ``None``
    for indices: all the blocks (the common case: one kind on each side, no lookup)."""
    if local.single is not None and remote.single is not None:
        return [(local.single, remote.single, None)]
    width = len(remote.kinds)
    pairs = local.codes_of(src) * width + remote.codes_of(dst)
    found = np.unique(pairs)
    if len(found) == 1:
        k = int(found[0])
        return [(local.kinds[k // width], remote.kinds[k % width], None)]
    return [
        (local.kinds[int(k) // width], remote.kinds[int(k) % width], np.flatnonzero(pairs == k))
        for k in found
    ]


def _register_region(agent: Any, r: Region, kind: MemoryKind) -> Any:
    """Register ``r`` as memory of ``kind`` with ``agent``: its registration descriptors."""
    mem_type, device = _nixl_type(kind)
    try:
        descs = agent.get_reg_descs([(r.base, r.length, device, "")], mem_type)
        agent.register_memory(descs)
    except Exception as exc:
        raise EngineError(f"nixl register of {r} failed: {exc!r}") from exc
    return descs


def _errors(api: Any, *names: str) -> tuple[type[BaseException], ...]:
    """The binding's exception classes of these names (those this version has)."""
    return tuple(getattr(api.nixlBind, n) for n in names if hasattr(api.nixlBind, n))


def _tear_down(
    agent: Any, unfinished: list[Any], peers: list[str], regs: list[tuple[Region, Any]]
) -> list[str]:
    """Release the kept requests, forget the peers, deregister the regions: what failed."""
    for handle in unfinished:  # (NIXL cancels what it can; the agent's end stops the rest)
        with contextlib.suppress(Exception):
            agent.release_xfer_handle(handle)
    errors: list[str] = []
    for peer in peers:
        try:
            agent.remove_remote_agent(peer)
        except Exception as exc:
            errors.append(f"remove {peer}: {exc!r}")
    for region, descs in regs:
        try:
            agent.deregister_memory(descs)
        except Exception as exc:
            errors.append(f"deregister {region}: {exc!r}")
    return errors


class _Unfinished:
    """Requests that timed out while still posted, per peer: kept, not released (a release
    asks NIXL to cancel, and a cancelled write may still land), until NIXL says they ended.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[str, list[Any]] = {}

    def keep(self, peer: str, handle: Any) -> None:
        with self._lock:
            self._handles.setdefault(peer, []).append(handle)

    def ended(self, peer: str, agent: Any) -> bool:
        """Whether none of ``peer``'s kept requests is still "PROC" (asked of ``agent``;
        None: the agent is gone, and its requests with it). Those that ended are released
        and forgotten."""
        with self._lock:
            handles = self._handles.get(peer, [])
            if agent is None:
                self._handles.pop(peer, None)
                return True
            left = []
            for handle in handles:
                try:
                    state = agent.check_xfer_state(handle)
                except Exception:
                    state = "ERR"
                if state == "PROC":
                    left.append(handle)
                    continue
                with contextlib.suppress(Exception):
                    agent.release_xfer_handle(handle)
            if left:
                self._handles[peer] = left
            else:
                self._handles.pop(peer, None)
            return not left

    def take_all(self) -> list[Any]:
        """Every kept request, forgotten here (the agent's close releases them)."""
        with self._lock:
            handles = [h for hs in self._handles.values() for h in hs]
            self._handles.clear()
            return handles


class NixlEngine(ClosesOnExit):
    """A NIXL agent over UCX. The agent name (``name``, default ``"trio-pd-<uuid>"``) is the
    session id and must be unique among the agents that talk to each other.

    ``mem_type`` is "DRAM" for host pools or "VRAM" for device pools; ``device_id`` is the
    CUDA device ordinal of VRAM pools (0 for DRAM). They apply to regions registered without
    a kind; a region's own :class:`~trio_pd.core._memory.MemoryKind` wins (module docstring).
    ``progress_delay_us``: see the module docstring. ``transfer_timeout_s``: see
    :meth:`write`. Raises :class:`~trio_pd.ConfigurationError` if the wheel is missing,
    :class:`~trio_pd.EngineError` if the agent cannot be built."""

    name = "nixl"
    join_bytes = 32 << 20  # (other rooms' writes join one call up to this: engines.join_bytes)

    def __init__(
        self,
        name: str | None = None,
        *,
        mem_type: str = "DRAM",
        device_id: int = 0,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> None:
        if mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type must be 'DRAM' or 'VRAM', not {mem_type!r}")
        api = import_api()
        self._name = name if name is not None else f"trio-pd-{uuid.uuid4().hex}"
        #: the kind of a region registered without one
        self._default = HOST if mem_type == "DRAM" else MemoryKind.cuda(device_id)
        self._timeout_s = transfer_timeout_s
        try:
            self._agent: Any = _build_agent(api, self._name, progress_delay_us)
        except Exception as exc:
            raise EngineError(f"nixl agent {self._name!r} could not be built: {exc!r}") from exc
        #: the binding's errors for a peer gone, and for metadata it will not load over
        self._gone_errors = _errors(api, "nixlRemoteDisconnectError", "nixlNotFoundError")
        self._not_allowed = _errors(api, "nixlNotAllowedError")
        self._lock = threading.Lock()  # registrations, peers, close
        self._registered: dict[int, tuple[Region, Any]] = {}  # base -> (region, reg descs)
        self._peers: dict[str, bytes] = {}  # session id -> metadata loaded
        # Kinds of our regions and of each loaded peer's: replaced whole (under _lock) when
        # they change, read without the lock by writes
        self._local = _KindMap([], self._default)
        self._peer_kinds: dict[str, _KindMap] = {}
        self._closed = False
        #: requests that timed out still posted, per peer, kept until they end (flushed)
        self._unfinished = _Unfinished()

    def __repr__(self) -> str:
        return f"<NixlEngine {self._name}{' closed' if self._closed else ''}>"

    @property
    def write_deadline_s(self) -> float:
        """How long a write waits for its handle before giving up (seconds, a few-MB call)."""
        return float(self._timeout_s) + 1.0

    @property
    def session_id(self) -> str:
        return self._name

    def _live_agent(self) -> Any:
        agent = self._agent
        if self._closed or agent is None:
            raise EngineError(f"nixl engine {self._name} is closed")
        return agent

    # -- memory ------------------------------------------------------------------------------

    def register(self, regions: list[Region]) -> None:
        """Register each region with its own memory type (one descriptor list per region, so
        each can be deregistered on its own): DRAM for host memory, VRAM with the device id for
        memory of a CUDA device, the engine's ``mem_type`` for a region of unstated kind. Take
        :meth:`metadata` afterwards: it describes what is registered."""
        with self._lock:
            agent = self._live_agent()
            try:
                for r in regions:
                    if r.base in self._registered:
                        raise EngineError(f"nixl: region at {r.base:#x} is already registered")
                    kind = r.kind or self._default
                    descs = _register_region(agent, r, kind)
                    self._registered[r.base] = (Region(r.base, r.length, kind), descs)
            finally:
                self._local = _KindMap([r for r, _ in self._registered.values()], self._default)

    def unregister(self, regions: list[Region]) -> None:
        with self._lock:
            agent = self._live_agent()
            unknown = [r for r in regions if r.base not in self._registered]
            if unknown:
                raise EngineError(f"nixl: unregister of regions never registered: {unknown}")
            for r in regions:
                _, descs = self._registered.pop(r.base)
                self._local = _KindMap([r for r, _ in self._registered.values()], self._default)
                try:
                    agent.deregister_memory(descs)
                except Exception as exc:
                    raise EngineError(f"nixl deregister of {r} failed: {exc!r}") from exc

    # -- peers -------------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """What a peer's :meth:`add_peer` loads: trio_pd's header (our registered regions and
        where they live; module docstring), then our NIXL agent metadata (connection info and
        registered memory)."""
        with self._lock:
            agent = self._live_agent()
            regions = [r for r, _ in self._registered.values()]
            try:
                return _pack_metadata(regions, bytes(agent.get_agent_metadata()))
            except Exception as exc:
                raise EngineError(f"nixl get_agent_metadata failed: {exc!r}") from exc

    def add_peer(self, session_id: str, metadata: bytes) -> None:
        """Load a peer's metadata. Idempotent for the same bytes.

        New bytes for a known peer are loaded over the old ones: NIXL merges them when the
        peer only registered more memory (its connections stay up), and refuses them
        (``NIXL_ERR_NOT_ALLOWED``) when the connection info changed because the peer
        restarted under the same name; then the old peer is removed first (dropping UCX's
        connection to it) and the new metadata loaded. The regions and kinds in trio_pd's
        header give the memory types of later writes' remote descriptors (bytes without the
        header: every remote block takes this engine's own ``mem_type``).
        """
        regions, agent_metadata = _unpack_metadata(metadata)
        with self._lock:
            agent = self._live_agent()
            known = self._peers.get(session_id)
            if known == metadata:
                return
            retry = self._not_allowed if known is not None else ()
            try:
                try:
                    loaded = agent.add_remote_agent(agent_metadata)
                except retry:
                    agent.remove_remote_agent(session_id)
                    del self._peers[session_id]
                    self._peer_kinds.pop(session_id, None)
                    loaded = agent.add_remote_agent(agent_metadata)
            except Exception as exc:
                raise EngineError(f"nixl add_peer({session_id!r}) failed: {exc!r}") from exc
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != session_id:
                with contextlib.suppress(Exception):  # undo; the error below says why
                    agent.remove_remote_agent(name)
                raise EngineError(
                    f"nixl add_peer: metadata for {session_id!r} names agent {name!r}"
                )
            self._peers[session_id] = metadata
            self._peer_kinds[session_id] = _KindMap(regions or [], self._default)

    def remove_peer(self, session_id: str) -> None:
        """Forget a peer (and drop UCX's connection to it). Idempotent."""
        with self._lock:
            if self._closed or session_id not in self._peers:
                return
            del self._peers[session_id]
            self._peer_kinds.pop(session_id, None)
            try:
                self._agent.remove_remote_agent(session_id)
            except Exception as exc:
                raise EngineError(f"nixl remove_peer({session_id!r}) failed: {exc!r}") from exc

    # -- data --------------------------------------------------------------------------------

    def write(self, peer: str, src: Addrs, dst: Addrs, lens: Lens) -> None:
        """One NIXL WRITE request for all blocks; returns when it is DONE: :meth:`submit`,
        then its ``wait()``."""
        self.submit(peer, src, dst, lens).wait()

    def submit(self, peer: str, src: Addrs, dst: Addrs, lens: Lens) -> Pending:
        """Post one NIXL WRITE request for all blocks and return at once; the returned
        :class:`Pending`'s ``wait()`` returns when the request is DONE (call it exactly once:
        it also releases the request).

        The wait polls ``check_xfer_state`` with sleeps growing from 20 µs to 1 ms, so a
        waiting thread uses next to no CPU (a caller that keeps a second request in flight,
        as a lane does, hides the sleeps' overshoot). NIXL has no deadline of its own (a
        write to a stopped peer waits forever), so the wait gives up after
        ``transfer_timeout_s`` plus one second per GB of the call, like Mooncake's
        ``MC_TRANSFER_TIMEOUT``; the deadline counts from the post.

        A request NIXL refuses (unknown peer, a block outside what either side registered)
        raises :class:`~trio_pd.EngineError` here, before anything is sent. "ERR", the
        deadline, or any exception after posting raise from ``wait()``, meaning "outcome
        unknown": some blocks may have been written, and after a deadline some may still
        land. The request handle is always released (for an unfinished request that asks
        NIXL to cancel it).

        Blocks of several memory-type pairs (module docstring) become one request per pair:
        all are built before any is posted, so a refusal still posts nothing, and ``wait()``
        returns once every one is DONE.
        """
        n = check_lengths(src, dst, lens)
        if n == 0:
            return Deferred(lambda: None)
        agent = self._live_agent()
        built: list[tuple[Any, int, int]] = []  # (handle, blocks, bytes)
        try:
            remote_kinds = self._peer_kinds.get(peer) or _KindMap([], self._default)
            for local_kind, remote_kind, idx in _parts(self._local, remote_kinds, src, dst):
                s, d, sizes = (src, dst, lens) if idx is None else (src[idx], dst[idx], lens[idx])
                local = _xfer_descs(agent, s, sizes, local_kind)
                remote = _xfer_descs(agent, d, sizes, remote_kind)
                handle = agent.initialize_xfer("WRITE", local, remote, peer, b"")
                built.append((handle, len(s), int(sizes.sum())))
        except Exception as exc:
            # Refused while building the request: nothing was posted, no byte moved.
            for handle, _, _ in built:
                with contextlib.suppress(Exception):
                    agent.release_xfer_handle(handle)
            raise EngineError(
                f"nixl write to {peer}: request of {n} blocks refused: {exc!r}"
            ) from exc
        flights: list[_Request] = []
        for handle, blocks, nbytes in built:
            flight = _Request(agent, handle, peer, blocks, self)
            flight.deadline = time.monotonic() + self._timeout_s + nbytes / 1e9
            try:
                flight.state = agent.transfer(handle)
            except Exception as exc:
                flight.fail(exc)  # wait() releases the handle and raises
            flights.append(flight)
        return flights[0] if len(flights) == 1 else _Requests(flights)

    def _keep_unfinished(self, peer: str, handle: Any) -> None:
        self._unfinished.keep(peer, handle)

    def call_mark(self, peer: str) -> int | None:
        """0: NIXL proves a failed request over by its own state (:meth:`flushed`), whatever
        was called after it."""
        return 0

    def flushed(self, peer: str, mark: int) -> bool:
        """Whether no request to ``peer`` that timed out is still posted. A request that
        ended "ERR", or that NIXL refused, left nothing behind; one that timed out still
        "PROC" is kept, not released (module docstring), and asked again here: once it has
        ended (DONE or ERR) it is released and forgotten. (``mark`` is not used: a later
        request that completes proves nothing about an earlier one here.)"""
        return self._unfinished.ended(peer, None if self._closed else self._agent)

    def probe(self, peer: str) -> bool:
        """False only if UCX reports the connection to a loaded peer lost; True otherwise
        (also for a peer whose metadata we never loaded: unknown is not gone). Never blocks.

        NIXL has no liveness call. This sends the peer an empty notification: UCX refuses it
        at once (``NIXL_ERR_REMOTE_DISCONNECT``) once it has seen the peer's process go away
        (measured: within milliseconds of a kill on loopback). A *hung* peer (stopped process,
        black-holed host) still looks alive until UCX's own keepalive gives up. trio_pd never
        reads NIXL notifications: each probe leaves one empty message queued at the peer, and
        each probe drops the ones queued here.
        """
        agent = self._live_agent()
        try:
            if not agent.check_remote_metadata(peer):
                # We never loaded this peer (decode never loads prefill's metadata): nothing
                # here can prove it gone, and a False would let pages go without a drain.
                return True
            agent.send_notif(peer, b"")
        except self._gone_errors:
            return False
        except Exception as exc:
            raise EngineError(f"nixl probe of {peer!r} failed: {exc!r}") from exc
        finally:
            with contextlib.suppress(Exception):
                agent.get_new_notifs()
        return True

    def fence_writer(self, session: str, hosts: Sequence[str]) -> Fence:
        """UNPROVEN: NIXL over UCX offers no fence at the receiving end. Measured with
        nixl-cu12 1.5.1 (UCX 1.23) on one host: UCX carries a write between two processes by
        ``cma`` (``process_vm_writev`` made by the writer's own threads; the receiver takes
        no part), and forced onto ``tcp`` by its put over TCP, written into our memory by our
        progress thread; in both, a write made after we deregistered the region, and after
        we registered it again, landed. Decode never loads a writer's metadata, so there is
        no remote agent of it here to remove. The pages stay held until the writer's drain
        ack (docs/lifetimes.md, "What proves a writer gone")."""
        self._live_agent()
        return Fence(FenceOutcome.UNPROVEN, "NIXL/UCX has no receiving-side fence (cma and tcp "
                     "writes land whatever this agent registers)")

    def close(self) -> None:
        """Forget peers, deregister what is still registered, drop the agent. Idempotent.

        Call it only once no write can still be running.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            agent, self._agent = self._agent, None
            peers = list(self._peers)
            self._peers.clear()
            self._peer_kinds.clear()
            regs = list(self._registered.values())
            self._registered.clear()
        errors = _tear_down(agent, self._unfinished.take_all(), peers, regs)
        del agent  # the agent's destructor stops its progress thread
        if errors:
            raise EngineError(f"nixl close of {self._name}: " + "; ".join(errors))
