"""The demo: a bootstrap service, P prefill ranks and D decode ranks on loopback, real engines,
N concurrent requests of random prompt lengths sent in chunks, every Success verified byte for
byte, aborts and engine faults at random points, and a lifetime sanitizer on every allocator.
The pools are host memory or, with ``device="cuda"`` (``--device cuda``), memory of CUDA
device 0 (:class:`~trio_pd.testing.device.DeviceKVPool`): :func:`make_pool` picks them
(``trio-pd bench --device`` too).

The same per-rank drivers run all ranks in one process (default) or one OS process per rank
(``--processes``). Every process derives the same request plan from the seed, so the only
thing that crosses a process boundary is what trio_pd itself sends.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Final, Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import trio
import trio.lowlevel

from ..agents._decode import DecodeConfig, open_decode
from ..agents._prefill import PrefillConfig, PrefillSender, open_prefill
from ..bootstrap._bootstrap import open_bootstrap_server
from ..core._errors import AdmissionClosed
from ..core._memory import PoolSpec, read_aux_stamp
from ..core._plan import chunk_ranges
from ..core._state import KVPoll
from ..core._topology import head_range
from ..core._wire import MAX_AUX_BUFFERS
from ..engines import TransferEngine, make_engine
from ..engines.fault import FaultEngine
from ..io import _lifeline
from ..io._security import TOKEN_ENV
from ..testing.device import DeviceKVPool
from ..testing.pools import (
    DEST_POISON,
    SOURCE_POISON,
    HostKVPool,
    PageAllocator,
    Rows,
    StateShape,
    extra_aux_lens,
)

ABORT_POINTS = ("before_bootstrap", "between_chunks", "mid_chunk", "after_last")
#: the CUDA device of every pool with ``--device cuda`` (pick another GPU with
#: ``CUDA_VISIBLE_DEVICES``)
DEMO_DEVICE = 0
#: the agent counters each rank's entry of the summary's ``ranks`` carries (how the bytes
#: went: engine calls, staged chunks, landed rooms); the bench's peer preset reports them too
RANK_COUNTERS: Final = ("engine_calls", "chunks_staged", "rooms_landed", "landing_full")
Side = Literal["prefill", "decode"]
_T = TypeVar("_T")


@dataclass(frozen=True)
class DemoOptions:
    requests: int = 200
    concurrency: int = 32
    page_size: int = 16
    layers: int = 4
    layout: Literal["mha", "mla"] = "mha"
    kv_heads: int = 8
    head_bytes: int = 32
    min_tokens: int = 1
    max_tokens: int = 1024
    chunk_pages: int = 16
    prefill_tp: int = 1
    decode_tp: int = 1
    engine: str = "mooncake"
    #: where every rank's KV pool and aux buffer live: host memory, or CUDA device 0
    #: (:class:`~trio_pd.testing.device.DeviceKVPool`; every rank, in every process)
    device: Literal["host", "cuda"] = "host"
    abort_rate: float = 0.0
    fault_rate: float = 0.0
    #: which faults --fault-rate injects (trio_pd.engines.fault kinds), and their delay
    fault_kinds: tuple[str, ...] = ("fail", "partial", "delay_before", "delay_after")
    fault_delay: float = 0.01
    seed: int = 0
    #: a request not terminal this long after it started counts as hung
    request_bound: float = 60.0
    #: authentication (docs/security.md), on unless turned off (``--insecure``): CURVE on the
    #: control plane, the REGISTER proofs and identity checks, and a random cluster token
    #: for the bootstrap service. Off, every agent logs one warning line saying so
    secure: bool = True
    #: pages handed out in a random order on each side (a random page layout: a request's
    #: pages lie scattered over the pool) instead of the allocator's first-free order,
    #: whose runs the planner merges into a few large blocks
    random_pages: bool = False
    #: the decode agent's landing area (``DecodeConfig.landing_bytes``; 0: none): rooms whose
    #: pages are scattered are written there in few blocks and copied into their pages
    landing_bytes: int = 0
    #: aux buffers after the first (a serving engine's metadata buffers), of
    #: :func:`~trio_pd.testing.pools.extra_aux_lens` bytes a row: every slot's row in each is
    #: filled, moved with the last chunk, verified and sanitized like the first aux buffer's
    aux_buffers: int = 0
    #: per-buffer geometry (host pools): head-major pages ("hnd") instead of token-major,
    #: V buffers with their own bytes per head (MHA: K != V), and bytes of padding after
    #: every page (a page stride longer than the page)
    page_layout: Literal["nhd", "hnd"] = "nhd"
    v_head_bytes: int | None = None
    page_pad: int = 0
    #: decode holds every request's first tokens already (its own prefix cache): that many
    #: (a multiple of ``page_size``) are not sent, and each decode rank asks for the rest
    prefix_tokens: int = 0
    #: DP attention: this many prefill DP ranks (each ``prefill_tp`` ranks) behind the one
    #: bootstrap service, each serving every ``prefill_dp``-th request; decode learns which
    #: DP rank holds a room from the bootstrap service
    prefill_dp: int = 1
    #: pipeline parallelism: this many prefill PP stages (each ``prefill_tp`` ranks, in every
    #: DP rank), stage ``s`` holding layers ``[s * layers / S, (s + 1) * layers / S)``;
    #: decode holds every layer and gathers each range from its stage
    prefill_pp: int = 1
    #: state components every pool has (:data:`STATE_KINDS`): "mamba" (per layer a conv
    #: state of x, B and C rows and an SSM state of heads, one slot a request, split over
    #: TP by their units), "swa" (a sliding-window pool: a request's last
    #: :data:`SWA_WINDOW` pages, K and V per layer, token-major, split by heads) and "nsa"
    #: (an index page per KV page, per layer, the same on every TP rank). Filled, moved with
    #: the last chunk, verified and sanitized like the pages
    states: tuple[str, ...] = ()
    #: how long a prefill rank keeps the pages of a failed engine call before it probes
    #: (``PrefillConfig.quarantine_fence``; None: the engine's own write deadline plus a
    #: margin, 6 s and more). Tests whose faults are all injected around calls that return
    #: at once shorten it; a real write still under way at the fence would then show as a
    #: late write
    quarantine_fence: float | None = None
    #: layer-wise streaming (docs/layerwise.md): each chunk is sent layer by layer, each
    #: layer after a short simulated compute, the last layer of the last chunk ``last``;
    #: an abort "mid-chunk" lands after the first chunk's first layer
    layerwise: bool = False

    @property
    def stage_layers(self) -> int:
        """Layers of one prefill PP stage."""
        return self.layers // self.prefill_pp

    @property
    def prefill_ranks(self) -> int:
        """Prefill ranks in all: TP x PP x DP."""
        return self.prefill_tp * self.prefill_pp * self.prefill_dp

    @property
    def prefix_pages(self) -> int:
        return self.prefix_tokens // self.page_size

    @property
    def buffer_head_bytes(self) -> tuple[int, ...]:
        """Bytes per head of each buffer (empty: all ``head_bytes``)."""
        if self.v_head_bytes is None or self.layout != "mha":
            return ()
        return (self.head_bytes,) * self.layers + (self.v_head_bytes,) * self.layers

    def option_problem(self) -> str | None:
        """What makes these options unusable, in the CLI's option names, or None.

        Checked before anything starts: every count positive, the rates in [0, 1], the TP
        sizes and heads paired by the same rules the agents apply
        (:func:`trio_pd.core._topology.pairing_problem`), and the pools within this machine's
        memory. MLA has one latent head, so ``kv_heads`` must be 1 with it (the demo's own
        runners ignore ``kv_heads`` for MLA; the CLI passes 1 unless told otherwise).
        """
        for name in ("requests", "concurrency", "page_size", "layers", "kv_heads",
                     "head_bytes", "min_tokens", "max_tokens", "chunk_pages", "prefill_tp",
                     "decode_tp", "prefill_dp", "prefill_pp"):
            value = getattr(self, name)
            if value < 1:
                return f"{_flag(name)} must be at least 1, got {value}"
        for name in ("abort_rate", "fault_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                return f"{_flag(name)} must be between 0 and 1, got {value}"
        if not 0 <= self.aux_buffers < MAX_AUX_BUFFERS:
            return (f"--aux-buffers must be between 0 and {MAX_AUX_BUFFERS - 1}, got "
                    f"{self.aux_buffers}")
        if self.page_layout not in ("nhd", "hnd"):
            return f"--page-layout must be nhd or hnd, got {self.page_layout!r}"
        if self.v_head_bytes is not None and (self.layout != "mha" or self.v_head_bytes < 1):
            return ("--v-head-bytes is the V buffers' bytes per head of an mha pool: a "
                    f"positive int with --layout mha, got {self.v_head_bytes}")
        if self.page_pad < 0:
            return f"--page-pad must be at least 0, got {self.page_pad}"
        if self.layers % self.prefill_pp:
            return (f"--layers ({self.layers}) must be a multiple of --prefill-pp "
                    f"({self.prefill_pp}): the stages hold the layers evenly")
        if self.prefill_pp > 1 and (self.v_head_bytes is not None or self.device != "host"):
            return "--prefill-pp runs with host pools of one head size (no --v-head-bytes)"
        unknown_states = [k for k in self.states if k not in STATE_KINDS]
        if unknown_states or len(set(self.states)) != len(self.states):
            return (f"--state: unknown or repeated component(s) "
                    f"{', '.join(unknown_states) or ','.join(self.states)}; choose from "
                    f"{','.join(STATE_KINDS)}")
        if self.states and (self.device != "host" or self.prefill_pp > 1):
            return "--state runs with host pools and one prefill PP stage"
        split = [k for k in self.states if k != "nsa"]
        bad_tp = [tp for tp in (self.prefill_tp, self.decode_tp) if STATE_UNITS % tp]
        if split and bad_tp:
            return (f"--state {split[0]} splits {STATE_UNITS} units over TP: TP "
                    f"{bad_tp[0]} does not divide them")
        if self.prefix_tokens < 0 or self.prefix_tokens % self.page_size:
            return (f"--prefix-tokens must be a multiple of --page-size ({self.page_size}) and "
                    f"at least 0, got {self.prefix_tokens}")
        if not (math.isfinite(self.fault_delay) and self.fault_delay >= 0):
            return f"--fault-delay must be a number of seconds >= 0, got {self.fault_delay}"
        fence = self.quarantine_fence
        if fence is not None and not (math.isfinite(fence) and fence > 0):
            return f"quarantine_fence must be a positive number of seconds, got {fence}"
        if not (math.isfinite(self.request_bound) and self.request_bound > 0):
            return f"request_bound must be a positive number of seconds, got {self.request_bound}"
        if self.max_tokens < self.min_tokens:
            return (f"--max-tokens ({self.max_tokens}) must be at least --min-tokens "
                    f"({self.min_tokens})")
        from ..engines.fault import FAULT_KINDS

        # (a stalled call waits for a test to release it: nothing in the demo would)
        kinds = [k for k in FAULT_KINDS if k != "stall"]
        unknown = [k for k in self.fault_kinds if k not in kinds]
        if unknown or not self.fault_kinds:
            return (f"--fault-kinds: unknown kind(s) {', '.join(unknown) or '(none given)'}; "
                    f"choose from {','.join(kinds)} (stall: nothing in the demo releases a "
                    "stalled call, the run would never end)")
        return (self._topology_problem() or self.engine_problem() or self._device_problem()
                or self._memory_problem())

    def engine_problem(self) -> str | None:
        """Why ``--engine`` cannot be built here (its module is not installed or does not
        load: :func:`trio_pd.engines.require_engine`, with what to install), or None."""
        from ..core._errors import ConfigurationError
        from ..engines import require_engine

        try:
            require_engine(self.engine)
        except ConfigurationError as exc:
            return f"--engine {self.engine}: {exc}"
        return None

    def _device_problem(self) -> str | None:
        """With ``--device cuda``: cuda-python, a CUDA device and an engine build that moves
        device memory (:func:`trio_pd.testing.device.engine_problem`), or what is missing."""
        if self.device == "host":
            return None
        if self.page_layout != "nhd" or self.v_head_bytes is not None or self.page_pad:
            return ("--page-layout, --v-head-bytes and --page-pad are for host pools: "
                    "the device pools are token-major and packed")
        if self.aux_buffers:
            return "--aux-buffers is for host pools: a device pool has one aux buffer"
        if self.device != "cuda":
            return f"--device must be host or cuda, got {self.device!r}"
        from ..core._errors import ConfigurationError
        from ..io._cuda import require_device
        from ..testing.device import engine_problem

        try:
            require_device(DEMO_DEVICE, "--device cuda")
        except ConfigurationError as exc:
            return str(exc)
        problem = engine_problem(self.engine)
        return None if problem is None else f"--device cuda --engine {self.engine}: {problem}"

    def _topology_problem(self) -> str | None:
        from ..bootstrap._bootstrap_ranks import MAX_TP_SIZE
        from ..core._topology import pairing_problem, source_ranks

        for name in ("prefill_tp", "decode_tp"):
            if getattr(self, name) > MAX_TP_SIZE:
                return f"{_flag(name)} must be at most {MAX_TP_SIZE}, got {getattr(self, name)}"
        pair = f"--prefill-tp {self.prefill_tp} cannot pair with --decode-tp {self.decode_tp}"
        try:
            source_ranks(0, self.prefill_tp, self.decode_tp)  # the agents' TP pairing rule
        except ValueError as exc:
            return f"{pair}: {exc}"
        if self.layout == "mla" and self.kv_heads != 1:
            return (f"--layout mla: MLA has one latent head, so --kv-heads must be 1 (or left "
                    f"out), got {self.kv_heads}")
        # every pool as the demo builds it (head_range), then each decode rank paired with
        # the prefill instance as the agents pair them
        pools: dict[str, list[tuple[int, int]]] = {}
        for name in ("prefill_tp", "decode_tp"):
            tp = getattr(self, name)
            try:
                pools[name] = [_heads(self, rank, tp) for rank in range(tp)]
            except ValueError as exc:
                return f"--kv-heads {self.kv_heads} does not fit {_flag(name)} {tp}: {exc}"
        for rank, (first, count) in enumerate(pools["decode_tp"]):
            problem = pairing_problem(
                layout=self.layout, page_size=self.page_size, head_bytes=self.head_bytes,
                num_layers=self.layers, aux_item_len=0, kv_heads=self.kv_heads,
                prefill_tp=self.prefill_tp, peer_layout=self.layout,
                peer_page_size=self.page_size, peer_head_bytes=self.head_bytes,
                peer_num_layers=self.layers, peer_aux_item_len=0, peer_rank=rank,
                peer_tp=self.decode_tp, peer_heads=count, peer_first_head=first,
            )
            if problem is not None:
                return f"{pair}: {problem}"
        return None

    def _memory_problem(self) -> str | None:
        buffers = 2 * self.layers if self.layout == "mha" else self.layers
        head_bytes = self.buffer_head_bytes or (self.head_bytes,) * buffers
        total = 0
        for tp, copies in ((self.prefill_tp, self.prefill_dp), (self.decode_tp, 1)):
            heads = copies * sum(_heads(self, rank, tp)[1] for rank in range(tp))
            total += sum(self.pool_pages * (self.page_size * heads * hb + self.page_pad)
                         for hb in head_bytes)
        have: int | None
        if self.device == "cuda":  # every rank's pool is on the one device
            from ..testing.device import device_free_bytes

            have = device_free_bytes(DEMO_DEVICE)
            where = f"on cuda:{DEMO_DEVICE}, more than the {{}} GiB free there"
        else:
            try:
                have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError):
                have = None
            where = "of host memory, more than this machine's {} GiB"
        if have is not None and total > have:
            return (f"the pools would need {total / 2**30:.1f} GiB "
                    + where.format(f"{have / 2**30:.1f}")
                    + " (pool pages per rank = --concurrency x pages of --max-tokens x 2: "
                    "lower either)")
        return None

    @property
    def max_pages(self) -> int:
        return math.ceil(self.max_tokens / self.page_size)

    @property
    def pool_pages(self) -> int:
        # room for every in-flight request, plus pages held for drains and quarantines
        return self.concurrency * self.max_pages * 2

    @property
    def aux_slots(self) -> int:
        return self.concurrency * 4


#: the state components ``--state`` offers, and the units (heads, rows) a split one has
STATE_KINDS: Final = ("mamba", "swa", "nsa")
STATE_UNITS: Final = 8
#: pages a sliding-window request keeps (its last ones)
SWA_WINDOW: Final = 4


def state_shapes(opts: DemoOptions, tp: int) -> tuple[StateShape, ...]:
    """The state components of a TP rank of ``tp``, in ``opts.states``' order."""
    u, layers = STATE_UNITS // tp, opts.layers
    out = []
    segs: tuple[tuple[tuple[int, int], ...], ...]
    for kind in opts.states:
        if kind == "mamba":
            conv = ((32, u), (16, u), (16, u))  # x, B and C rows of a conv state
            ssm = ((64, u),)  # SSM heads
            segs = (conv,) * layers + (ssm,) * layers
            out.append(StateShape(kind, tuple(sum(a * b for a, b in g) for g in segs),
                                  segments=segs))
        elif kind == "swa":  # a token-major page: one segment of heads per token slot
            page = ((opts.head_bytes, u),) * opts.page_size
            segs = (page,) * (2 * layers)
            out.append(StateShape(kind, tuple(sum(a * b for a, b in g) for g in segs),
                                  segments=segs))
        else:  # nsa: an index page of 16 bytes a token, replicated
            out.append(StateShape(kind, (opts.page_size * 16,) * layers, replicated=True))
    return tuple(out)


def state_slot_counts(opts: DemoOptions) -> tuple[int, ...]:
    """Slots of each state component of a pool (room for every request in flight, and
    those held for drains and quarantines)."""
    per = {"mamba": opts.aux_slots, "swa": opts.aux_slots * SWA_WINDOW,
           "nsa": opts.pool_pages}
    return tuple(per[k] for k in opts.states)


def request_state_slots(opts: DemoOptions, num_pages: int) -> tuple[int, ...]:
    """How many slots of each component a request of ``num_pages`` pages has."""
    per = {"mamba": 1, "swa": min(SWA_WINDOW, num_pages), "nsa": num_pages}
    return tuple(per[k] for k in opts.states)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _heads(opts: DemoOptions, rank: int, tp: int) -> tuple[int, int]:
    """``(first_head, count)`` of the pool of TP rank ``rank`` of ``tp``."""
    return head_range(rank, tp, opts.kv_heads) if opts.layout == "mha" else (0, 1)


@dataclass(frozen=True)
class Request:
    index: int
    room: int
    epoch: int
    tokens: int
    abort: tuple[Side, str] | None
    num_pages: int


def plan_requests(opts: DemoOptions) -> list[Request]:
    rng = random.Random(opts.seed)
    out = []
    rooms = rng.sample(range(1, 1 << 40), opts.requests)
    for i in range(opts.requests):
        tokens = rng.randint(opts.min_tokens, opts.max_tokens)
        abort: tuple[Side, str] | None = None
        if rng.random() < opts.abort_rate:
            abort = (rng.choice(("prefill", "decode")), rng.choice(ABORT_POINTS))
        out.append(
            Request(i, rooms[i], rng.getrandbits(62), tokens, abort,
                    math.ceil(tokens / opts.page_size))
        )
    return out


@dataclass
class RankResult:
    role: str
    rank: int
    outcomes: dict[int, int] = field(default_factory=dict)  # request index -> KVPoll
    corrupt_pages: int = 0
    source_uaf_pages: int = 0
    late_writes: int = 0
    leaked_pages: int = 0
    #: decode: landing pages still held once every request's pages came back (a landing
    #: range never given back; trio_pd.core._landing)
    leaked_landing_pages: int = 0
    hung: int = 0
    bytes: int = 0
    abort_release_ms: list[float] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    #: decode: ``(start, end)`` of each Successful request, ``time.monotonic()`` seconds
    #: from ``receiver.init`` to its Success (one clock for every process of the host)
    active: list[tuple[float, float]] = field(default_factory=list)
    #: the rank's process; its CPU seconds (every thread: ``time.process_time()``) while the
    #: rank ran its requests, and of those the event loop thread's seconds spent filling
    #: (prefill) or verifying (decode) pages and in the page allocator's sanitizer
    #: (poisoning, checking poison): the demo's own work. Ranks sharing a process report
    #: the same process's CPU
    pid: int = field(default_factory=os.getpid)
    cpu_seconds: float = 0.0
    harness_cpu_seconds: float = 0.0
    #: prefill with ``fault_rate``: the engine calls that raised (the FaultEngine's count:
    #: injected faults, and real errors alike)
    failed_engine_calls: int = 0


class DemoPool(Protocol):
    """What a rank asks of its pool, wherever the pool lives: :class:`DeviceKVPool` has it,
    and :class:`_HostPool` gives :class:`HostKVPool` the same reading side."""

    spec: PoolSpec

    def fill(self, pages: npt.NDArray[np.int64], room: int) -> None: ...
    def fill_aux(self, slot: int, room: int) -> None: ...
    def expected(self, room: int, npages: int) -> npt.NDArray[np.uint8]: ...
    def aux_ok(self, slot: int, room: int) -> bool: ...

    def read(self, pages: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
        """What ``pages`` hold, on the host: shape (buffers, len(pages), item_len)."""
        ...

    def page_rows(self) -> Rows: ...
    def aux_rows(self) -> Rows: ...

    def close(self) -> None:
        """Free the memory; only once no engine has it registered or may write it."""
        ...


def _pool(opts: DemoOptions, rank: int, tp: int, pp_rank: int | None = None) -> DemoPool:
    """Rank ``rank`` of ``tp``'s pool, in host memory or on the device (``opts.device``):
    the one place the demo picks its pool class. ``pp_rank``: a prefill pool of that PP
    stage (its layers only; their bytes those of the model's layers); None: every layer."""
    first, heads = _heads(opts, rank, tp)
    stage: dict[str, Any] = {}
    if pp_rank is not None and opts.prefill_pp > 1:
        stage = dict(first_layer=pp_rank * opts.stage_layers, model_layers=opts.layers)
    if opts.states:
        stage.update(states=state_shapes(opts, tp), state_slots=state_slot_counts(opts),
                     tp_rank=rank)
    shape: dict[str, Any] = dict(
        layout=opts.layout, num_pages=opts.pool_pages,
        num_layers=opts.stage_layers if stage else opts.layers,
        page_size=opts.page_size, head_bytes=opts.head_bytes, heads=heads, first_head=first,
        aux_slots=opts.aux_slots,
    )
    return make_pool(opts.device, host=dict(
        page_layout=opts.page_layout, buffer_head_bytes=opts.buffer_head_bytes,
        page_pad=opts.page_pad, extra_aux_lens=extra_aux_lens(opts.aux_buffers), **stage,
    ), **shape)


def make_pool(device: str, host: dict[str, Any] | None = None, **shape: Any) -> DemoPool:
    """A pool of ``shape`` (the keywords :class:`HostKVPool` and :class:`DeviceKVPool`
    share) on CUDA device :data:`DEMO_DEVICE` for ``device="cuda"``, in host memory
    otherwise: the one place the demo (:func:`_pool`) and ``trio-pd bench`` pick a pool
    class. ``host``: keywords only a host pool takes (per-buffer geometry, more aux buffers,
    a PP stage's layers)."""
    if device == "cuda":
        return DeviceKVPool(**shape, device=DEMO_DEVICE)
    return HostKVPool(**shape, **(host or {}))


class _Owned:
    """The engines and pools of ranks whose caller closes them once no rank is still moving
    bytes (Mooncake's close() holds the GIL for up to a second): every engine first, then
    every pool, since a pool is freed only once no engine has it registered (its own) or may
    still write into it (a peer's)."""

    def __init__(self) -> None:
        self.engines: list[TransferEngine] = []
        self.pools: list[DemoPool] = []

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        # only once every engine closed: one that failed to may still have a pool registered
        # (its memory then goes with the process)
        for pool in self.pools:
            pool.close()


def _engine(opts: DemoOptions, role: str, rank: int) -> TransferEngine:
    engine = make_engine(opts.engine)
    if role == "prefill" and opts.fault_rate > 0:
        return FaultEngine.random(
            engine, opts.fault_rate, seed=opts.seed * 1000 + rank,
            kinds=opts.fault_kinds,  # type: ignore[arg-type]  # checked by FaultEngine
            delay_s=opts.fault_delay,
        )
    return engine


async def _send_layers(
    sender: PrefillSender, pages: npt.NDArray[np.int64], last: bool, state_slots: Any,
    layers: int, rng: random.Random, abort_after_first: bool,
) -> None:
    """One chunk, layer by layer (``DemoOptions.layerwise``): each layer after a short
    simulated compute (on top of the chunk's); the state slots with the last layer of the
    last chunk. With ``abort_after_first`` the scheduler aborts once the first layer is
    sent: the request then has some layers written and the others never (the next layer's
    send raises AdmissionClosed, as a model loop's would)."""
    await trio.sleep(rng.random() * 0.0005)  # the first layer's compute
    for layer in range(layers):
        if layer:
            await trio.sleep(rng.random() * 0.0005)  # the layer's compute
        final = last and layer == layers - 1
        sender.send(pages, layers=range(layer, layer + 1), last=final,
                    state_slots=state_slots if final else None)
        if abort_after_first and layer == 0:
            sender.abort("demo: abort between layers")


async def _bounded_wait(wait: Callable[[], Any], bound: float) -> KVPoll | None:
    with trio.move_on_after(bound):
        result: KVPoll = await wait()
        return result
    return None


async def _all_returned(allocs: list[PageAllocator], bound: float) -> None:
    """Wait (at most ``bound`` s) until every allocator has every row back: quarantines and
    drain acks included."""
    with trio.move_on_after(bound):
        await trio.lowlevel.checkpoint()
        for alloc in allocs:
            await alloc.wait_all_returned()


async def run_prefill_rank(
    opts: DemoOptions,
    rank: int,
    bootstrap_url: str,
    progress: Callable[[], None] = lambda: None,
    *,
    owned: _Owned,
    token: str | None = None,
    sink: list[RankResult] | None = None,
) -> RankResult:
    """One prefill rank. Its pool and engine go to ``owned``, for the caller to close.
    ``sink`` gets the result object at once, so that a run that is cancelled (Ctrl-C) still
    has what this rank counted so far. With ``prefill_dp`` DP ranks, ``rank`` counts the
    prefill ranks of every DP rank: TP rank ``rank % prefill_tp`` of DP rank ``rank //
    prefill_tp``, which serves the requests whose index is its DP rank modulo
    ``prefill_dp``."""
    result = RankResult("prefill", rank)
    if sink is not None:
        sink.append(result)
    group, tp_rank = divmod(rank, opts.prefill_tp)
    dp, pp = divmod(group, opts.prefill_pp)  # (rank = (dp * PP + pp) * TP + tp)
    first_layer = pp * opts.stage_layers
    # before the engine: a CUDA context first
    pool = _pool(opts, tp_rank, opts.prefill_tp, pp_rank=pp)
    owned.pools.append(pool)
    pages_alloc = _page_allocator(opts, pool, SOURCE_POISON, rank)
    aux_alloc = PageAllocator(pool.aux_rows(), SOURCE_POISON)
    states = _StateSlots(opts, pool, SOURCE_POISON)
    engine = _engine(opts, "prefill", rank)
    rng = random.Random(opts.seed * 7 + rank)
    slots = trio.Semaphore(opts.concurrency)
    try:
        async with open_prefill(
            engine=engine, pool=pool.spec, bootstrap_url=bootstrap_url, tp_rank=tp_rank,
            tp_size=opts.prefill_tp, kv_heads=opts.kv_heads if opts.layout == "mha" else 1,
            config=PrefillConfig(bootstrap_timeout=opts.request_bound,
                                 quarantine_fence=opts.quarantine_fence),
            token=token, secure=opts.secure,
            dp_rank=dp, dp_size=opts.prefill_dp,
            pp_rank=pp, pp_size=opts.prefill_pp, first_layer=first_layer,
        ) as agent:

            async def one(req: Request) -> None:
                try:
                    pages = await pages_alloc.alloc(req.num_pages)
                    aux = await aux_alloc.alloc(1)
                    state_slots = await states.alloc(req.num_pages)
                    cpu = time.thread_time()
                    pool.fill(pages, req.room)
                    pool.fill_aux(int(aux[0]), req.room)
                    states.fill(state_slots, req.room)
                    result.harness_cpu_seconds += time.thread_time() - cpu

                    def release() -> None:
                        pages_alloc.free(pages)
                        aux_alloc.free(aux)
                        states.free(state_slots)

                    sender = agent.sender(
                        req.room, num_pages=req.num_pages, aux_slot=int(aux[0]),
                        on_release=release, epoch=req.epoch,
                    )
                    point = req.abort[1] if req.abort and req.abort[0] == "prefill" else None
                    if point == "before_bootstrap":
                        sender.abort("demo: abort before bootstrap")
                    ranges = chunk_ranges(req.num_pages, opts.chunk_pages)
                    for i, (a, b) in enumerate(ranges):
                        last = i == len(ranges) - 1
                        await trio.sleep(rng.random() * 0.002)  # the scheduler computes
                        try:
                            if opts.layerwise:
                                await _send_layers(sender, pages[a:b], last, state_slots,
                                                   pool.spec.num_layers, rng,
                                                   point == "mid_chunk" and i == 0)
                            else:
                                sender.send(pages[a:b], last=last,
                                            state_slots=state_slots if last else None)
                        except AdmissionClosed:
                            break
                        if point == "mid_chunk" and i == 0:
                            sender.abort("demo: abort mid-chunk")
                        if point == "between_chunks" and i == 0 and not last:
                            await trio.sleep(rng.random() * 0.002)
                            sender.abort("demo: abort between chunks")
                    if point == "after_last":
                        sender.abort("demo: abort after the last chunk")
                    status = await _bounded_wait(sender.wait, opts.request_bound)
                    if status is None:
                        result.hung += 1
                    else:
                        result.outcomes[req.index] = int(status)
                finally:
                    slots.release()
                    progress()

            cpu = time.process_time()
            async with trio.open_nursery() as nursery:
                for req in plan_requests(opts):
                    if req.index % opts.prefill_dp != dp:
                        continue  # another DP rank's request (decode finds out which)
                    await slots.acquire()
                    nursery.start_soon(one, req)
            result.cpu_seconds = time.process_time() - cpu
            result.harness_cpu_seconds += pages_alloc.cpu_seconds
            # quarantined leases come back after their fence; wait for them
            await _all_returned([pages_alloc, aux_alloc, *states.allocs], agent.peers.fence + 5)
            # counted before the agent closes: closing hands every page back, whatever it held
            result.leaked_pages = (
                pages_alloc.outstanding + sum(a.outstanding for a in states.allocs)
            )
            result.stats = asdict(agent.statistics())
    finally:
        owned.engines.append(engine)  # closed by the caller (_Owned)
        if isinstance(engine, FaultEngine):
            result.failed_engine_calls = engine.statistics().errors
    result.late_writes = (
        pages_alloc.late_writes + aux_alloc.late_writes + pages_alloc.late_in_free_rows()
        + aux_alloc.late_in_free_rows() + states.late_writes
    )
    return result


async def run_decode_rank(
    opts: DemoOptions,
    rank: int,
    bootstrap_url: str,
    progress: Callable[[], None] = lambda: None,
    *,
    owned: _Owned,
    token: str | None = None,
    sink: list[RankResult] | None = None,
) -> RankResult:
    """One decode rank; ``owned`` and ``sink`` as for :func:`run_prefill_rank`."""
    result = RankResult("decode", rank)
    if sink is not None:
        sink.append(result)
    pool = _pool(opts, rank, opts.decode_tp)  # before the engine: a CUDA context first
    owned.pools.append(pool)
    pages_alloc = _page_allocator(opts, pool, DEST_POISON, rank)
    aux_alloc = PageAllocator(pool.aux_rows(), DEST_POISON)
    states = _StateSlots(opts, pool, DEST_POISON)
    engine = _engine(opts, "decode", rank)
    rng = random.Random(opts.seed * 11 + rank)
    slots = trio.Semaphore(opts.concurrency)
    try:
        async with open_decode(
            engine=engine, pool=pool.spec, tp_rank=rank, tp_size=opts.decode_tp,
            config=DecodeConfig(waiting_timeout=opts.request_bound,
                                landing_bytes=opts.landing_bytes),
            token=token, secure=opts.secure,
        ) as agent:

            async def one(req: Request) -> None:
                try:
                    # the first pages come from this rank's "prefix cache" (not sent)
                    prefix = min(opts.prefix_pages, req.num_pages)
                    pages = await pages_alloc.alloc(req.num_pages - prefix)
                    aux = await aux_alloc.alloc(1)
                    state_slots = await states.alloc(req.num_pages)
                    aborted_at: list[float] = []

                    def release() -> None:
                        pages_alloc.free(pages)
                        aux_alloc.free(aux)
                        states.free(state_slots)
                        if aborted_at:
                            waited = time.perf_counter() - aborted_at[0]
                            result.abort_release_ms.append(waited * 1e3)

                    def abort(why: str) -> None:
                        aborted_at.append(time.perf_counter())
                        receiver.abort(why)

                    receiver = agent.receiver(
                        req.room, bootstrap_url=bootstrap_url, epoch=req.epoch
                    )
                    point = req.abort[1] if req.abort and req.abort[0] == "decode" else None
                    if point == "before_bootstrap":
                        abort("demo: abort before bootstrap")
                    started = time.monotonic()
                    receiver.init(pages, int(aux[0]), on_release=release, prefix_pages=prefix,
                                  state_slots=state_slots)
                    if point in ("between_chunks", "mid_chunk", "after_last"):
                        await trio.sleep(rng.random() * 0.01)
                        if receiver.poll() is not KVPoll.Success:
                            abort(f"demo: abort ({point})")
                    status = await _bounded_wait(receiver.wait, opts.request_bound)
                    if status is None:
                        result.hung += 1
                        return
                    result.outcomes[req.index] = int(status)
                    if status is KVPoll.Success:
                        result.active.append((started, time.monotonic()))
                        cpu = time.thread_time()
                        _verify(result, pool, pages, int(aux[0]), req, prefix)
                        result.corrupt_pages += states.bad(state_slots, req.room)
                        result.harness_cpu_seconds += time.thread_time() - cpu
                        pages_alloc.free(pages)  # the request's KV is ours again: done with it
                        aux_alloc.free(aux)
                        states.free(state_slots)
                finally:
                    slots.release()
                    progress()

            cpu = time.process_time()
            async with trio.open_nursery() as nursery:
                for req in plan_requests(opts):
                    await slots.acquire()
                    nursery.start_soon(one, req)
            result.cpu_seconds = time.process_time() - cpu
            result.harness_cpu_seconds += pages_alloc.cpu_seconds
            await _all_returned([pages_alloc, aux_alloc, *states.allocs], opts.request_bound)
            # counted before the agent closes: closing hands every page back, whatever it held
            result.leaked_pages = (
                pages_alloc.outstanding + sum(a.outstanding for a in states.allocs)
            )
            result.stats = asdict(agent.statistics())
            result.leaked_landing_pages = result.stats["landing_held"]
    finally:
        owned.engines.append(engine)  # closed by the caller (_Owned)
        if isinstance(engine, FaultEngine):
            result.failed_engine_calls = engine.statistics().errors
    result.late_writes = (
        pages_alloc.late_writes + aux_alloc.late_writes + pages_alloc.late_in_free_rows()
        + aux_alloc.late_in_free_rows() + states.late_writes
    )
    return result


class _StateSlots:
    """A rank's slots of each state component: an allocator (and sanitizer) per component
    over the pool's slots, and a request's slots of each."""

    def __init__(self, opts: DemoOptions, pool: DemoPool, poison: int) -> None:
        self.opts = opts
        self.pool = pool if isinstance(pool, HostKVPool) else None
        self.allocs = [PageAllocator(self.pool.state_rows(c), poison)
                       for c in range(len(opts.states))] if self.pool is not None else []

    async def alloc(self, num_pages: int) -> list[npt.NDArray[np.int64]]:
        await trio.lowlevel.checkpoint()
        counts = request_state_slots(self.opts, num_pages) if self.allocs else ()
        return [await a.alloc(n) for a, n in zip(self.allocs, counts, strict=True)]

    def fill(self, slots: list[npt.NDArray[np.int64]], room: int) -> None:
        for c, ids in enumerate(slots):
            assert self.pool is not None
            self.pool.fill_state(c, ids, room)

    def bad(self, slots: list[npt.NDArray[np.int64]], room: int) -> int:
        """Slots of the request that do not hold its bytes, over every component."""
        pool = self.pool
        return sum(pool.bad_state_slots(c, ids, room) for c, ids in enumerate(slots)) if (
            pool is not None) else 0

    def free(self, slots: list[npt.NDArray[np.int64]]) -> None:
        for a, ids in zip(self.allocs, slots, strict=True):
            a.free(ids)

    @property
    def late_writes(self) -> int:
        return sum(a.late_writes + a.late_in_free_rows() for a in self.allocs)


class _TimedAllocator(PageAllocator):
    """Adds up the CPU time of the calling thread (the event loop's) in the sanitizer's
    poison checks (``alloc_nowait``) and poisoning (``free``): the demo's own work."""

    cpu_seconds = 0.0

    def alloc_nowait(self, n: int) -> npt.NDArray[np.int64] | None:
        start = time.thread_time()
        try:
            return super().alloc_nowait(n)
        finally:
            self.cpu_seconds += time.thread_time() - start

    def free(self, ids: npt.NDArray[np.int64]) -> None:
        start = time.thread_time()
        try:
            super().free(ids)
        finally:
            self.cpu_seconds += time.thread_time() - start


def _page_allocator(
    opts: DemoOptions, pool: DemoPool, poison: int, rank: int
) -> _TimedAllocator:
    alloc = _TimedAllocator(pool.page_rows(), poison)
    if opts.random_pages:  # every page freed in a random order comes back out in that order
        ids = alloc.alloc_nowait(alloc.capacity)
        assert ids is not None
        alloc.free(np.random.default_rng([opts.seed, poison, rank]).permutation(ids))
        alloc.cpu_seconds = 0.0
    return alloc


def _verify(
    result: RankResult, pool: DemoPool, pages: npt.NDArray[np.int64], aux: int, req: Request,
    prefix: int = 0,
) -> None:
    """``pages`` hold the request's pages from ``prefix`` on (the first are decode's own)."""
    got = pool.read(pages)  # a device pool's pages are copied to the host
    want = pool.expected(req.room, prefix + len(pages))[:, prefix:]
    bad = ~(got == want).reshape(got.shape[0], len(pages), -1).all(axis=2).all(axis=0) if len(
        pages) else np.zeros(0, dtype=bool)
    result.corrupt_pages += int(bad.sum())
    if bad.any():
        source_poison = (got[:, bad, :] == SOURCE_POISON).any(axis=(0, 2))
        result.source_uaf_pages += int(source_poison.sum())
    stamp = read_aux_stamp(pool.spec, aux)
    if stamp != (req.room, req.epoch) or not pool.aux_ok(aux, req.room):
        result.corrupt_pages += 1
    result.bytes += int(got.nbytes)


# ---------------------------------------------------------------------- the whole demo


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end]`` intervals."""
    total = 0.0
    end = -math.inf
    for a, b in sorted((float(a), float(b)) for a, b in intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(
    opts: DemoOptions, results: list[RankResult], seconds: float, *, interrupted: bool = False
) -> dict[str, Any]:
    """The run's summary. ``interrupted``: the run was stopped (Ctrl-C); requests some
    decode rank has no outcome for count as ``unfinished`` instead of failed."""
    reqs = plan_requests(opts)
    decode = [r for r in results if r.role == "decode"]
    succeeded = failed = aborted = unfinished = 0
    for req in reqs:
        outcomes = [r.outcomes.get(req.index) for r in decode]
        ok = bool(decode) and all(o == int(KVPoll.Success) for o in outcomes)
        if ok:
            succeeded += 1
        elif interrupted and (not decode or None in outcomes):
            unfinished += 1
        elif req.abort is not None:
            aborted += 1
        else:
            failed += 1
    def stat(name: str) -> int:
        return sum(r.stats.get(name, 0) for r in results)

    calls_failed = sum(r.failed_engine_calls for r in results)
    in_failed = stat("rooms_in_failed_calls")
    ms = sorted(m for r in decode for m in r.abort_release_ms)
    request_ms = [(b - a) * 1e3 for r in decode for a, b in r.active]
    total_bytes = sum(r.bytes for r in decode)
    in_flight = _union_seconds([iv for r in decode for iv in r.active])
    return {
        "requests": len(reqs),
        "succeeded": succeeded,
        "failed": failed,
        "aborted": aborted,
        "unfinished": unfinished,
        "interrupted": interrupted,
        "bytes": total_bytes,
        "seconds": round(seconds, 3),
        "gbps": round(total_bytes / seconds / 1e9, 3) if seconds > 0 else 0.0,
        "transfer_seconds": round(in_flight, 3),
        "transfer_gbps": round(total_bytes / in_flight / 1e9, 3) if in_flight > 0 else 0.0,
        "corrupt_pages": sum(r.corrupt_pages for r in results),
        "source_uaf_pages": sum(r.source_uaf_pages for r in results),
        "late_writes": sum(r.late_writes for r in results),
        "leaked_pages": sum(r.leaked_pages for r in results),
        "leaked_landing_pages": sum(r.leaked_landing_pages for r in results),
        "hung": max((r.hung for r in results), default=0),
        "quarantined": stat("quarantined"),
        "released_after_quarantine": stat("released_after_quarantine"),
        "released_by_timeout": stat("released_by_timeout"),
        "released_peer_gone": stat("released_peer_gone"),
        "engine_errors": stat("engine_errors"),
        # the blast radius of engine errors: the calls that raised, the rooms that rode in
        # them, and the failed requests per failed call (at most the rooms per failed call)
        "failed_engine_calls": calls_failed,
        "rooms_in_failed_calls": in_failed,
        "blast_radius": {
            "failed_per_failed_call": round(failed / calls_failed, 2) if calls_failed else None,
            "rooms_per_failed_call": round(in_failed / calls_failed, 2) if calls_failed else None,
        },
        "peers_failed": stat("peers_failed"),
        "abort_release_ms": {
            "p50": round(_pct(ms, 50), 3) if ms else None,
            "p99": round(_pct(ms, 99), 3) if ms else None,
        },
        "engine": opts.engine,
        "device": opts.device,
        "layout": opts.layout,
        "prefill_tp": opts.prefill_tp,
        "prefill_pp": opts.prefill_pp,
        "decode_tp": opts.decode_tp,
        "kv_heads": opts.kv_heads,
        # decode's Successful requests, receiver.init -> Success
        "request_ms": {
            "p50": round(_pct(request_ms, 50), 3) if request_ms else None,
            "p99": round(_pct(request_ms, 99), 3) if request_ms else None,
        },
        "ranks": [
            {"role": r.role, "rank": r.rank, "pid": r.pid, "cpu_seconds": round(r.cpu_seconds, 4),
             "harness_cpu_seconds": round(r.harness_cpu_seconds, 4),
             **{k: r.stats.get(k, 0) for k in RANK_COUNTERS}}
            for r in results
        ],
    }


def _pct(values: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(values), p))


async def _until(interrupt: Interrupt | None, body: Callable[[], Awaitable[object]]) -> None:
    """Run ``body``; if ``interrupt`` asks to stop before it returns, cancel it."""
    async with trio.open_nursery() as nursery:
        if interrupt is not None:

            async def watch() -> None:
                await interrupt.stop.wait()
                nursery.cancel_scope.cancel(reason="the demo was interrupted")

            nursery.start_soon(watch)
        await body()
        nursery.cancel_scope.cancel(reason="the demo finished")


@dataclass
class Interrupt:
    """What a run hears of the signals that stop it (:func:`run_sigint_aware`). Made
    outside the run, so the caller can read :attr:`signal` once it has ended."""

    #: set by the first SIGINT (Ctrl-C) or SIGTERM: stop the work, and still report it
    stop: trio.Event = field(default_factory=trio.Event)
    #: set by a second one where that does not end the process: stop at once
    now: trio.Event = field(default_factory=trio.Event)
    #: the number of the first signal, once there was one
    signal: int | None = None

    @property
    def asked(self) -> bool:
        """A signal asked the run to stop."""
        return self.stop.is_set()


async def run_sigint_aware(
    run: Callable[[Interrupt], Awaitable[_T]],
    interrupt: Interrupt | None = None,
    *,
    second: Literal["exit", "now", "ignore"] = "exit",
    notice: str | None = None,
) -> _T:
    """``await run(interrupt)``, where the first SIGINT (Ctrl-C) or SIGTERM sets
    ``interrupt.stop`` instead of ending the process, so ``run`` can stop its work and still
    report; ``notice``, if given, is printed on stderr then. A second signal, by ``second``:
    ``"exit"`` ends the process at once (exit status 128 + the signal); ``"now"`` sets
    ``interrupt.now`` (the run stops without waiting for what it would have waited for, and
    still reports); ``"ignore"`` does nothing. (trio delivers a signal that arrives again
    before the first was taken once.)"""
    interrupt = interrupt or Interrupt()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    if interrupt.signal is None:
                        interrupt.signal = signum
                        interrupt.stop.set()
                        if notice is not None:
                            print(notice, file=sys.stderr, flush=True)
                    elif second == "exit":
                        print("trio-pd: interrupted again, exiting now", file=sys.stderr,
                              flush=True)
                        os._exit(128 + signum)
                    elif second == "now":
                        interrupt.now.set()

            nursery.start_soon(watch)
            result = await run(interrupt)
            nursery.cancel_scope.cancel(reason="the run finished")
    return result


async def run_in_process(
    opts: DemoOptions,
    progress: Callable[[], None] = lambda: None,
    *,
    interrupt: Interrupt | None = None,
) -> dict[str, Any]:
    """Every rank as tasks of one trio run. If ``interrupt`` asks, the ranks stop, decode
    first (closing, it fails its rooms and gets their drain acks from the still-running
    prefill ranks), then prefill, and the summary says what they had done (``interrupted``,
    ``unfinished``)."""
    results: list[RankResult] = []
    owned = _Owned()
    token = secrets.token_urlsafe(24) if opts.secure else None
    start = time.perf_counter()
    prefill_scope, decode_scope = trio.CancelScope(), trio.CancelScope()
    decode_done = trio.Event()

    async def side(scope: trio.CancelScope, ranks: Sequence[Callable[[], Awaitable[object]]],
                   done: trio.Event | None = None) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for rank in ranks:
                    nursery.start_soon(rank)
        if done is not None:
            done.set()

    async def ranks() -> None:
        async with (
            open_bootstrap_server(token=token, secure=opts.secure) as server,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(side, prefill_scope, [
                partial(run_prefill_rank, opts, p, server.url, lambda: None, owned=owned,
                        token=token, sink=results)
                for p in range(opts.prefill_ranks)
            ])
            nursery.start_soon(side, decode_scope, [
                partial(run_decode_rank, opts, d, server.url,
                        progress if d == 0 else lambda: None, owned=owned, token=token,
                        sink=results)
                for d in range(opts.decode_tp)
            ], decode_done)

    async def stop_in_order() -> None:
        if interrupt is None:
            await trio.sleep_forever()  # cancelled once the ranks are done
            return
        await interrupt.stop.wait()
        decode_scope.cancel(reason="the demo was interrupted")
        with trio.move_on_after(INTERRUPT_GRACE_S):
            await decode_done.wait()
        prefill_scope.cancel(reason="the demo was interrupted")

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_in_order)
            await ranks()
            nursery.cancel_scope.cancel(reason="the demo finished")
        seconds = time.perf_counter() - start
    finally:
        owned.close()
    return summarize(opts, results, seconds, interrupted=_is_set(interrupt))


def _is_set(interrupt: Interrupt | None) -> bool:
    return interrupt is not None and interrupt.asked


async def run_worker(
    role: str, rank: int, url: str, opts: DemoOptions, *, interrupt: Interrupt | None = None
) -> None:
    """One rank in its own process (``--processes``): progress lines, then a JSON result
    (also when ``interrupt`` stopped the rank early), on stdout, the parent's pipe. If the
    parent is gone, the process ends quietly (:func:`trio_pd.io._lifeline.say`)."""
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        _lifeline.say(f"progress {done}")

    fn = run_prefill_rank if role == "prefill" else run_decode_rank
    owned = _Owned()
    results: list[RankResult] = []
    # from here on an interrupt stops the rank and still gets its report (run_processes
    # sends SIGINT only to ranks that said this; the others it kills)
    _lifeline.say("started")
    try:
        await _until(interrupt, partial(fn, opts, rank, url, tick, owned=owned, sink=results))
        _lifeline.say("result " + json.dumps(asdict(results[0])))
    finally:
        owned.close()


async def run_processes(
    opts: DemoOptions,
    progress: Callable[[], None] = lambda: None,
    *,
    interrupt: Interrupt | None = None,
) -> dict[str, Any]:
    """Bootstrap, every prefill rank and every decode rank as separate OS processes.

    The child processes run in process groups of their own, so a terminal's Ctrl-C reaches
    only this one. If ``interrupt`` asks to stop, the rank processes that have started their
    run are sent SIGINT, decode ranks first and prefill ranks once those ended (as in
    :func:`run_in_process`): each stops and reports what it did. Ranks that have not ended
    within :data:`INTERRUPT_GRACE_S`, or when ``interrupt.now`` is set, are killed, and so
    is, at once, a rank process still starting up (it has done nothing to report).

    Every child holds a :class:`~trio_pd.io._lifeline.Lifeline` to this process: however it
    ends (SIGKILL included), they end with it."""
    exe = [sys.executable, "-m", "trio_pd.cli"]
    results: list[RankResult] = []
    procs: list[_RankProcess] = []
    start = time.perf_counter()
    lifeline = _lifeline.Lifeline()
    # --secure: every process reads the token from TRIO_PD_TOKEN (kept out of argv)
    env = lifeline.env(os.environ)
    env.pop(TOKEN_ENV, None)
    if opts.secure:
        env[TOKEN_ENV] = secrets.token_urlsafe(24)
    spawn = partial(trio.lowlevel.open_process, stdout=subprocess.PIPE, env=env,
                    process_group=0, pass_fds=lifeline.pass_fds)
    try:
        boot = await spawn([*exe, "bootstrap", "--port", "0",
                            *(() if opts.secure else ("--insecure",))])
    except BaseException:
        lifeline.close()
        raise
    try:
        assert boot.stdout is not None
        url = (await _read_line(boot.stdout)).strip()
        workers = [("prefill", p) for p in range(opts.prefill_ranks)] + [
            ("decode", d) for d in range(opts.decode_tp)
        ]
        async with trio.open_nursery() as outer:
            with trio.CancelScope() as ranks:
                if interrupt is not None:
                    outer.start_soon(_forward_interrupt, interrupt, procs, ranks)
                async with trio.open_nursery() as nursery:
                    for role, rank in workers:
                        nursery.start_soon(
                            _worker_process, spawn, exe, role, rank, url, opts, results,
                            progress if (role, rank) == ("decode", 0) else lambda: None,
                            procs, interrupt,
                        )
            outer.cancel_scope.cancel(reason="every rank process ended")
    finally:
        boot.terminate()
        with trio.CancelScope(shield=True):
            await boot.wait()
        lifeline.close()
    if len(results) != len(workers) and not _is_set(interrupt):
        raise RuntimeError(f"{len(workers) - len(results)} rank processes gave no result")
    return summarize(opts, results, time.perf_counter() - start,
                     interrupted=_is_set(interrupt))


#: seconds an interrupted run gives its decode ranks (in-process) or its rank processes
#: (``--processes``) to stop and report; more than a decode agent's close_timeout (10 s)
INTERRUPT_GRACE_S = 20.0


@dataclass
class _RankProcess:
    role: str
    proc: trio.Process
    #: it printed "started": from then on SIGINT makes it stop and report
    started: bool = False
    ended: trio.Event = field(default_factory=trio.Event)


async def _forward_interrupt(
    interrupt: Interrupt, procs: list[_RankProcess], ranks: trio.CancelScope
) -> None:
    """Stop the rank processes in order once ``interrupt`` asks; kill them (cancel
    ``ranks``) past the grace period or when ``interrupt.now`` is set."""
    await interrupt.stop.wait()
    async with trio.open_nursery() as nursery:

        async def hurry() -> None:
            await interrupt.now.wait()
            ranks.cancel(reason="interrupted again: the rank processes are killed")

        nursery.start_soon(hurry)
        await _stop_in_order(procs, ranks)
        nursery.cancel_scope.cancel(reason="the rank processes ended")


async def _stop_in_order(procs: list[_RankProcess], ranks: trio.CancelScope) -> None:
    with trio.move_on_after(INTERRUPT_GRACE_S) as grace:
        await trio.lowlevel.checkpoint()
        for side in ("decode", "prefill"):
            mine = [rp for rp in procs if rp.role == side]
            for rp in mine:
                if rp.proc.returncode is None:
                    if rp.started:
                        rp.proc.send_signal(signal.SIGINT)
                    else:
                        rp.proc.kill()
            for rp in mine:
                await rp.ended.wait()
    if grace.cancelled_caught:
        ranks.cancel(reason="rank processes did not report in time after the interrupt")


async def _worker_process(
    spawn: Callable[[list[str]], Awaitable[trio.Process]], exe: list[str], role: str,
    rank: int, url: str, opts: DemoOptions, results: list[RankResult],
    progress: Callable[[], None], procs: list[_RankProcess], interrupt: Interrupt | None,
) -> None:
    cmd = [*exe, "_worker", role, str(rank), url, json.dumps(asdict(opts))]
    await trio.lowlevel.checkpoint()
    if _is_set(interrupt):
        return
    proc = await spawn(cmd)
    me = _RankProcess(role, proc)
    procs.append(me)
    try:
        assert proc.stdout is not None
        buf = b""
        async for data in proc.stdout:
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                text = line.decode()
                if text.startswith("progress"):
                    progress()
                elif text == "started":
                    me.started = True
                elif text.startswith("result "):
                    raw = json.loads(text[7:])
                    raw["outcomes"] = {int(k): v for k, v in raw["outcomes"].items()}
                    results.append(RankResult(**raw))
        code = await proc.wait()
    finally:
        if proc.returncode is None:  # cancelled: never leave a rank process behind
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
        me.ended.set()
    if code != 0 and not _is_set(interrupt):
        raise RuntimeError(f"{role} rank {rank} exited with {code}")


async def _read_line(stream: trio.abc.ReceiveStream) -> str:
    await trio.lowlevel.checkpoint()
    buf = b""
    while b"\n" not in buf:
        data = await stream.receive_some(1024)
        if not data:
            raise RuntimeError("bootstrap process exited before printing its URL")
        buf += data
    return buf.split(b"\n", 1)[0].decode()


def check(opts: DemoOptions, summary: dict[str, Any]) -> list[str]:
    """What makes a demo run a failure (the command exits 1). In an interrupted run,
    requests failed by the interruption itself are not held against it."""
    problems = []
    for key in ("corrupt_pages", "late_writes", "leaked_pages", "leaked_landing_pages", "hung",
                "released_by_timeout"):
        if summary.get(key):
            problems.append(f"{key} = {summary[key]}")
    counted = (summary["succeeded"] + summary["failed"] + summary["aborted"]
               + summary.get("unfinished", 0))
    if counted != summary["requests"]:
        problems.append("requests unaccounted for")
    if summary["failed"] and opts.fault_rate == 0 and not summary.get("interrupted"):
        problems.append(f"failed = {summary['failed']} without injected faults")
    in_calls = summary.get("rooms_in_failed_calls", 0)
    if summary["failed"] > in_calls and opts.fault_rate > 0 and not summary.get("interrupted"):
        problems.append(f"failed = {summary['failed']}, more than the {in_calls} rooms in "
                        "failed engine calls (a failure spread beyond its call)")
    return problems


#: glog's threshold: 0 info, 1 warnings, 2 errors, 3 fatal only
_GLOG_LEVEL = "GLOG_minloglevel"


def quiet_engine_logs(verbose: bool) -> None:
    """Keep the engines' own log lines off stderr in CLI runs, unless asked for.

    Mooncake logs through glog on stderr, and a healthy start already prints an error
    ("Local segment descriptor not found") and warnings ("No RDMA devices found", ...)
    that tear the progress bar. Without ``verbose`` glog is set to fatal messages only;
    with it, to warnings and errors. A ``GLOG_minloglevel`` the user set wins either way
    (``GLOG_minloglevel=0`` shows everything). The Mooncake adapter applies the variable
    when it builds an engine, so this must run before the first engine exists; rank
    processes inherit it. Engine failures still reach trio_pd as errors it counts.
    """
    os.environ.setdefault(_GLOG_LEVEL, "1" if verbose else "3")


__all__ = [
    "DemoOptions",
    "check",
    "plan_requests",
    "quiet_engine_logs",
    "run_in_process",
    "run_processes",
    "run_sigint_aware",
    "run_worker",
]
