"""SGLang's PD connector API, over trio_pd: a scheduler loop written against SGLang's
``KVManager`` / ``KVSender`` / ``KVReceiver`` drives trio_pd unchanged.

The classes here have the names, signatures and keyword names of SGLang's connector classes
(they are trio_pd's own code; SGLang is never imported). Underneath, each :class:`KVManager`
runs one :mod:`trio_pd.sync` facade (a :class:`~trio_pd.sync.SyncPrefill` or
:class:`~trio_pd.sync.SyncDecode` on a trio thread of its own), and each sender or receiver
is a thin handle over the facade's. docs/sglang.md maps every call, field and knob.

Three things differ between the two APIs, and the adapter bridges each:

* **When pages are free.** SGLang's loops free a request's KV pages and metadata slot as soon
  as ``poll()`` says Success or Failed. trio_pd hands them back later, through
  ``pop_released()``, once no engine call can still read (prefill) or write (decode) them. By
  default (``free_on_terminal=True``) the adapter's ``poll()`` therefore holds a terminal
  status back, reporting Transferring, until trio_pd has handed the room's pages back: what
  ``poll()`` says is then safe to act on exactly as SGLang's loop does. With
  ``free_on_terminal=False`` ``poll()`` reports at once and the scheduler frees pages when
  :meth:`KVManager.pop_released` returns the room, the trio_pd way.
* **The aux rows.** trio_pd's first aux buffer's row starts with its own 16-byte
  ``(room, epoch)`` stamp; SGLang has several metadata buffers (output ids, logprobs, hidden
  states...), each indexed by the request's aux slot, with no room for a stamp. The adapter
  registers a host buffer of its own (:class:`AuxRows`, a 16-byte stamp row per slot) as the
  pool's first aux buffer and SGLang's metadata buffers, in order, as the further aux
  buffers (:attr:`~trio_pd.PoolSpec.extra_aux`): the engine moves each request's metadata
  items in place, with its last chunk, and nothing is copied. (``native_aux=False``: the
  older mapping, the stamp and every metadata item in one row of the adapter's, gathered at
  the last ``send()`` and scattered at the first Success ``poll()``.)
* **Epochs.** trio_pd tells uses of a room id apart by an epoch that every rank of a request
  must agree on; SGLang has none, and draws a fresh random 63-bit room id per request. The
  adapter derives the epoch from the room id (:func:`room_epoch`), so every rank agrees with
  no router involved.

DP attention maps onto trio_pd's DP-attention routing (docs/topologies.md): a prefill
manager with ``server_args.dp_size > 1`` runs its agent as DP rank ``engine_rank //
attn_tp_size`` (``enable_dp_attention``; ``engine_rank`` is SGLang's TP rank across the DP
ranks, and ``engine_rank % attn_tp_size`` the attention TP rank) or ``KVArgs.system_dp_rank``
(DP without DP attention), and announces the DP rank of every room it creates to the
bootstrap service; a decode receiver learns it from there by itself.

Pipeline parallelism maps directly: a prefill manager runs its agent as PP stage
``KVArgs.pp_rank`` of ``server_args.pp_size``, its KV buffers (the stage's layers) starting
at model layer ``KVArgs.prefill_start_layer`` (``open_prefill(pp_rank=, pp_size=,
first_layer=)``); a ``KVSender``'s ``pp_rank`` must be its manager's. Only the last stage
writes the metadata (aux) rows, as SGLang's last PP rank makes the output. A decode manager
reads the stages from the bootstrap service (``disaggregation_prefill_pp`` is not needed).

State buffers of hybrid models map onto trio_pd's state components
(:class:`~trio_pd.StateSpec`): each of ``KVArgs.state_types`` (Mamba, sliding window, DSA
index) is one component of the pool, built from its ``state_data_ptrs`` / ``_lens`` /
``_item_lens`` (:func:`states_from_kvargs`), and the ``state_indices`` a sender's last
``send()`` or a receiver's ``send_metadata()`` gives, one list per state type, are the
request's slots of each (``state_slots=`` of the facade), moved with the last chunk and
freed with the pages.

What trio_pd does not do raises :class:`~trio_pd.ConfigurationError` naming the knob:
pipeline parallelism on decode (``pp_size``, ``KVArgs.pp_rank`` / ``prefill_start_layer``
of a decode manager), state types other than those (``KVArgs.state_types``), a DP rank
other than 0 named on the decode side
(``init(prefill_dp_rank)``, ``KVArgs.system_dp_rank`` of a decode manager), and (with
``native_aux=False`` only) device memory for the metadata buffers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from .. import sync
from ..agents._decode import DecodeConfig
from ..agents._prefill import PrefillAgent, PrefillConfig, layer_range
from ..core._closing import ClosesOnExit
from ..core._errors import ConfigurationError, ProtocolError, TransferAborted, TransferError
from ..core._memory import (
    AUX_STAMP,
    PoolSpec,
    StateSpec,
    as_index,
    check_aux_slot,
    describe_pool,
    page_ids,
)
from ..core._state import KVPoll as KVPoll
from ..core._stats import AgentStatistics
from ..core._topology import head_range
from ..engines import ENGINE_NAMES, TransferEngine, make_engine
from ..io._security import SECURE_ENV, TOKEN_ENV

__all__ = [
    "AuxRows",
    "DisaggregationMode",
    "KVArgs",
    "KVBootstrapServer",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTransferMetric",
    "PrefillInfo",
    "check_server_args",
    "config_from_env",
    "get_kv_class",
    "pool_from_kvargs",
    "room_epoch",
    "sglang_plugin",
    "states_from_kvargs",
]

# SGLang's ``KVPoll`` values are ints (Failed=0, Bootstrapping=1, WaitingForInput=2,
# Transferring=3, Success=4); trio_pd's KVPoll is an IntEnum with those very values, so it
# *is* the adapter's KVPoll: ``KVPoll.Success == 4``, and ``min()`` over the ranks' statuses
# (how SGLang combines them across TP ranks) works as on ints.
_TERMINAL = (KVPoll.Success, KVPoll.Failed)
#: what a held-back terminal status reads as (forward of every non-terminal one)
_HELD = KVPoll.Transferring
#: SGLang's default bootstrap port (``--disaggregation-bootstrap-port``)
DEFAULT_BOOTSTRAP_PORT = 8998
_I63 = (1 << 63) - 1
_log = logging.getLogger("trio_pd.compat.sglang")


class DisaggregationMode(enum.Enum):
    """The side a :class:`KVManager` serves. Any object with ``.value`` (SGLang's own enum)
    or a plain ``"prefill"`` / ``"decode"`` works as well."""

    PREFILL = "prefill"
    DECODE = "decode"


def _mode(mode: object) -> Literal["prefill", "decode"]:
    value = getattr(mode, "value", mode)
    if isinstance(value, str) and value.lower() in ("prefill", "decode"):
        return "prefill" if value.lower() == "prefill" else "decode"
    raise ConfigurationError(
        f"disaggregation_mode must be 'prefill' or 'decode' (a str or an enum with that "
        f".value), not {mode!r}"
    )


@dataclass
class KVArgs:
    """What a scheduler tells the connector about its rank's memory: SGLang's ``KVArgs``,
    same attribute names. Make one empty and set the attributes, as SGLang's scheduler does;
    any object with these attributes works in its place (missing optional ones read as their
    defaults here).

    KV buffers, in trio_pd's pool order (MHA: K of every layer, then V of every layer; MLA:
    one per layer): ``kv_data_ptrs`` (addresses), ``kv_data_lens`` (bytes of each buffer),
    ``kv_item_lens`` (bytes of one page in each). Metadata buffers, all indexed by the same
    aux slot: ``aux_data_ptrs``, ``aux_data_lens``, ``aux_item_lens`` (bytes of one slot's
    item in each): the pool's aux buffers after the adapter's stamp rows (host memory only
    with ``KVManager(native_aux=False)``, which copies them). State buffers of hybrid
    models, one entry per ``state_types`` entry: ``state_data_ptrs``, ``state_data_lens``,
    ``state_item_lens`` (bytes of one slot), and for Mamba across TP sizes
    ``state_dim_per_tensor``: the pool's state components (:func:`states_from_kvargs`).
    """

    #: this rank's TP rank within its prefill (or decode) attention TP group; with DP
    #: attention, SGLang's TP rank across the DP ranks, whose attention TP rank is it modulo
    #: the attention TP size (and, on prefill, whose DP rank is the quotient)
    engine_rank: int = 0
    kv_data_ptrs: list[int] = field(default_factory=list)
    kv_data_lens: list[int] = field(default_factory=list)
    kv_item_lens: list[int] = field(default_factory=list)
    aux_data_ptrs: list[int] = field(default_factory=list)
    aux_data_lens: list[int] = field(default_factory=list)
    aux_item_lens: list[int] = field(default_factory=list)
    #: state buffers of hybrid models, one entry per state type (each one state component
    #: of the pool, :func:`states_from_kvargs`): SGLang's ``StateType`` of each ("mamba",
    #: "swa", "dsa"; a str enum or a str)
    state_types: list[Any] = field(default_factory=list)
    #: per state type, its buffers' addresses (a Mamba type: conv and SSM state per layer; a
    #: sliding-window or DSA type: one buffer per layer)
    state_data_ptrs: list[list[int]] = field(default_factory=list)
    #: per state type, each buffer's bytes
    state_data_lens: list[list[int]] = field(default_factory=list)
    #: per state type, the bytes of one slot in each buffer
    state_item_lens: list[list[int]] = field(default_factory=list)
    #: per state type, for Mamba across TP sizes: each buffer's TP-split (outermost) dim on
    #: this rank (empty: none given, the slots are rank-local)
    state_dim_per_tensor: list[list[int]] = field(default_factory=list)
    #: per state type, per buffer: a Mamba conv state's head-sharded sub-blocks (None: one
    #: block); given, the type's slots stay rank-local
    state_conv_shard_groups: list[list[Any]] = field(default_factory=list)
    #: per state type: dims outside the TP-split one; given (> 1), the slots stay rank-local
    state_slice_outer_counts: list[Any] = field(default_factory=list)
    #: the RDMA device filter handed to the Mooncake engine ("" or None: all devices)
    ib_device: str | None = None
    #: the rank's GPU (informational: where each buffer lives is asked of CUDA)
    gpu_id: int = 0
    #: KV heads this rank holds (MHA); 1 for MLA
    kv_head_num: int = 1
    #: KV heads of the whole model (MHA); left 0, taken to be ``kv_head_num`` (TP 1)
    total_kv_head_num: int = 0
    #: tokens per page
    page_size: int = 1
    #: informational: trio_pd learns the decode side's TP size from its registrations
    decode_tp_size: int = 1
    #: prefill, with DP but no DP attention (``server_args.dp_size > 1``): this rank's DP
    #: rank; must be 0 otherwise
    system_dp_rank: int = 0
    #: prefill: this rank's PP stage (``server_args.pp_size`` stages); must be 0 on decode
    pp_rank: int = 0
    #: prefill: the model layer the stage's first KV buffer is (``open_prefill``'s
    #: ``first_layer``); must be 0 on decode
    prefill_start_layer: int = 0


def room_epoch(room: int) -> int:
    """The epoch the adapter gives room ``room`` on every rank: a fixed mix of the room id
    (in trio_pd's epoch range, ``[0, 2**63)``). SGLang draws a random room id per request,
    so the epoch still tells one request from another; two uses of the *same* room id are
    not told apart (trio_pd then refuses the second while the first is still tracked)."""
    return (room * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _I63


# ---------------------------------------------------------------------------------- checks


def _get(args: object, name: str, default: Any) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def _ints(args: object, name: str) -> list[int]:
    raw = _get(args, name, [])
    try:
        return [int(v) for v in raw]
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"KVArgs.{name} must be a list of ints, got {raw!r}") from exc


def _int(args: object, name: str, default: int) -> int:
    raw = _get(args, name, default)
    try:
        return int(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"KVArgs.{name} must be an int, got {raw!r}") from exc


def _unsupported(knob: str, value: object, why: str) -> ConfigurationError:
    return ConfigurationError(f"{knob}={value!r} is not supported by trio_pd: {why}")


def check_kvargs(args: object, *, system_dp: bool = False, pipeline: bool = False) -> None:
    """Refuse the KVArgs fields trio_pd has no equivalent for, naming the field:
    ``pp_rank`` / ``prefill_start_layer`` other than 0 (unless ``pipeline``: a prefill rank,
    whose PP stage they are; decode has no PP stages),
    ``system_dp_rank`` other than 0 (unless ``system_dp``: a prefill rank of an instance
    with DP and no DP attention, whose DP rank it is). Raises
    :class:`~trio_pd.ConfigurationError`. (The state buffers are checked where they become
    the pool's state components, :func:`states_from_kvargs`.)"""
    knobs = [] if pipeline else [
        ("pp_rank", "pipeline parallelism on decode (a decode rank holds every layer)"),
        ("prefill_start_layer", "pipeline parallelism on decode (a decode rank holds every "
         "layer)"),
    ]
    if not system_dp:
        knobs.append((
            "system_dp_rank", "data-parallel ranks other than 0 (only a prefill manager with "
            "server_args.dp_size > 1 has one)",
        ))
    for knob, why in knobs:
        value = _int(args, knob, 0)
        if value != 0:
            raise _unsupported(f"KVArgs.{knob}", value, why)


#: SGLang's switch for its deferred decode KV release (default on) and the deadline after
#: which its scheduler frees a failed request's pages without a drain (default 30 s)
DEFERRED_RELEASE_ENV: Final = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
DEFERRED_RELEASE_TIMEOUT_ENV: Final = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
#: the variable that turns the SGLang plugin (:func:`sglang_plugin`) on
PLUGIN_ENV: Final = "TRIO_PD_SGLANG"


def _env_flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """An SGLang boolean variable, parsed as SGLang parses it."""
    raw = environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("true", "1", "yes", "y"):
        return True
    if value in ("false", "0", "no", "n"):
        return False
    raise ConfigurationError(f"{name}={raw!r}: not a boolean")


#: the server arguments and variables whose SGLang code paths call the connector in ways
#: trio_pd does not serve: (what, is it set?, why), checked when a manager is built
_REFUSED_FLAGS: Final[tuple[tuple[str, str, Callable[[object, Mapping[str, str]], bool],
                                  str], ...]] = (
    ("both", "--disaggregation-decode-allocation-policy",
     lambda a, e: str(getattr(a, "disaggregation_decode_allocation_policy", None) or "early")
     != "early",
     "only the 'early' policy: 'prefill_complete' calls mark_prefill_complete() and reads "
     "conclude_state, which trio_pd's rooms do not have"),
    ("both", "--disaggregation-enable-kv-checksum",
     lambda a, e: bool(getattr(a, "disaggregation_enable_kv_checksum", False)),
     "the KV checksum is SGLang's own CUDA digest of its pools (should_verify_kv_checksum)"),
    ("both", "SGLANG_DISAGG_STAGING_BUFFER",
     lambda a, e: _env_flag(e, "SGLANG_DISAGG_STAGING_BUFFER", False),
     "SGLang's staging buffer hands its KV tensors to the manager (set_kv_buffer_tensors); "
     "trio_pd stages head slices itself (PrefillConfig.staging_bytes)"),
    ("both", "--enable-memory-saver",
     lambda a, e: bool(getattr(a, "enable_memory_saver", False)),
     "releasing the KV memory calls deregister_buffer_to_engine() on the manager; trio_pd's "
     "pools stay registered while the manager lives"),
    ("prefill", "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX",
     lambda a, e: _env_flag(e, "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX", False),
     "the early send of a cached prefix waits on a CUDA event set on the sender "
     "(_early_send_wait_event)"),
    ("decode", "--disaggregation-decode-host-receive-threshold",
     lambda a, e: float(getattr(a, "disaggregation_decode_host_receive_threshold", 1.0)
                        if getattr(a, "disaggregation_decode_host_receive_threshold", None)
                        is not None else 1.0) < 1,
     "host receive sends KV to host destinations (send_metadata(destination=HOST), "
     "is_abort_release_safe() on the receiver)"),
    ("decode", "--enable-hisparse",
     lambda a, e: bool(getattr(a, "enable_hisparse", False)),
     "HiSparse sends device_kv_indices beside the host pages (send_metadata("
     "device_kv_indices=))"),
)


def check_server_args(
    server_args: object, mode: str = "decode", environ: Mapping[str, str] | None = None
) -> None:
    """Refuse, naming the flag, the SGLang server arguments and environment variables under
    which SGLang's scheduler would call the connector in a way trio_pd does not serve (the
    call table in docs/sglang.md says which call each one brings), so that they fail when
    the manager is built, never in the middle of a request; and ``pp_size`` other than 1
    on decode (pipeline parallelism on decode). A prefill manager's ``pp_size`` is its PP
    size; decode's ``disaggregation_prefill_pp`` is not needed: a decode rank reads the
    stages from the bootstrap service.

    On decode with SGLang's deferred KV release on (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_
    KV_RELEASE``, default on), its scheduler frees a failed request's pages at its deadline
    (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``, default 30 s) whether or
    not the writers drained: anything but ``inf`` there is refused (:func:`sglang_plugin`
    sets it when the variable is unset). Raises :class:`~trio_pd.ConfigurationError`."""
    env = os.environ if environ is None else environ
    value = getattr(server_args, "pp_size", None)
    if mode != "prefill" and value not in (None, 1):
        raise _unsupported("server_args.pp_size", value,
                           "pipeline parallelism on decode (a decode rank holds every layer)")
    for side, flag, is_set, why in _REFUSED_FLAGS:
        if side in ("both", mode) and is_set(server_args, env):
            raise ConfigurationError(f"{flag} is not supported by trio_pd: {why}")
    if mode == "decode" and _env_flag(env, DEFERRED_RELEASE_ENV, True):
        raw = env.get(DEFERRED_RELEASE_TIMEOUT_ENV)
        try:
            timeout = 30.0 if raw is None else float(raw)
        except ValueError:
            raise ConfigurationError(f"{DEFERRED_RELEASE_TIMEOUT_ENV}={raw!r}: not a "
                                     "number") from None
        if timeout != math.inf:
            raise ConfigurationError(
                f"{DEFERRED_RELEASE_TIMEOUT_ENV}={raw if raw is not None else '30 (unset)'}: "
                "SGLang's scheduler would free a failed request's KV pages at that deadline "
                "even while a prefill rank may still write them; with trio_pd set it to inf "
                "(the pages are released when trio_pd proves the writers drained)"
            )


# ---------------------------------------------------------------------------------- aux rows


class AuxRows:
    """The adapter's own aux buffer, registered as the pool's first aux buffer: one host row
    per aux slot, starting with trio_pd's 16-byte stamp.

    ``native=True`` (what :class:`KVManager` uses unless told otherwise): a row is the stamp
    alone, and SGLang's metadata buffers are the pool's further aux buffers
    (:attr:`~trio_pd.PoolSpec.extra_aux`, :attr:`extra_aux`), each indexed by the same aux
    slot: the engine reads a request's metadata items from prefill's buffers and writes them
    into decode's in place, with the last chunk. Nothing is copied (:meth:`gather` and
    :meth:`scatter` only check the slot), and the metadata buffers may live anywhere an
    engine reaches (CUDA is asked where each lives).

    ``native=False`` (the class's default; a pool an older trio_pd pairs with, whose pools
    have one aux buffer): a row is the stamp followed by each SGLang metadata buffer's item
    for that slot, in the order of ``aux_data_ptrs``. Prefill fills a row with
    :meth:`gather` before the request's last chunk goes to trio_pd; decode empties one with
    :meth:`scatter` once the request succeeded. Each is one ``ctypes.memmove`` per metadata
    buffer, :attr:`bytes_per_request` bytes in all, on the scheduler's thread. The metadata
    buffers must then be host memory (memmove cannot reach a device); a pointer CUDA reports
    as device memory is refused. trio_pd moves :attr:`row_len` bytes per request over the
    engine (native: the stamp and every metadata item, in one block per buffer).

    ``rows`` (a ``(slots, row_len)`` uint8 array) lives as long as this object: keep it (the
    :class:`KVManager` does) while the pool is registered.
    """

    def __init__(self, args: object, *, native: bool = False) -> None:
        self.native = native
        ptrs = _ints(args, "aux_data_ptrs")
        lens = _ints(args, "aux_data_lens")
        items = _ints(args, "aux_item_lens")
        if not ptrs:
            raise ConfigurationError(
                "KVArgs.aux_data_ptrs is empty: trio_pd moves a metadata row with every "
                "request and needs at least one metadata buffer to size its aux slots"
            )
        slots = _common_slots(
            ptrs, lens, items, "aux_data_ptrs, aux_data_lens and aux_item_lens",
            lambda i: f"metadata buffer {i}",
            "every metadata buffer is indexed by the same aux slot",
        )
        if not native:  # (native: the engine reaches them wherever they live)
            for i, ptr in enumerate(ptrs):
                _require_host(ptr, f"KVArgs.aux_data_ptrs[{i}]")
        self.ptrs: tuple[int, ...] = tuple(ptrs)
        self.item_lens: tuple[int, ...] = tuple(items)
        #: native: the metadata buffers as :func:`~trio_pd.describe_pool`'s ``extra_aux``,
        #: ``((address, bytes), item bytes)`` each, in the order of ``aux_data_ptrs``;
        #: empty otherwise
        self.extra_aux: tuple[tuple[tuple[int, int], int], ...] = (
            tuple(((p, n), it) for p, n, it in zip(ptrs, lens, items, strict=True))
            if native else ()
        )
        #: where each metadata buffer's item starts inside a row (none when native)
        self.offsets: tuple[int, ...] = () if native else tuple(
            AUX_STAMP.size + sum(items[:i]) for i in range(len(items))
        )
        self.slots = slots
        self.row_len = AUX_STAMP.size + (0 if native else sum(items))
        self.rows: npt.NDArray[np.uint8] = np.zeros((slots, self.row_len), dtype=np.uint8)
        self._base = int(self.rows.ctypes.data)

    @property
    def bytes_per_request(self) -> int:
        """Bytes :meth:`gather` (prefill) or :meth:`scatter` (decode) copies per request."""
        return self.row_len - AUX_STAMP.size

    def _copies(self, slot: int) -> list[tuple[int, int, int]]:
        """``(row part, metadata item, bytes)`` of slot ``slot`` for each metadata buffer,
        after checking the slot; none when native (the engine moves the buffers in place)."""
        check_aux_slot(slot, self.slots)
        if self.native:
            return []
        row = self._base + slot * self.row_len
        return [(row + off, ptr + slot * item, item)
                for ptr, item, off in zip(self.ptrs, self.item_lens, self.offsets, strict=True)]

    def gather(self, slot: int) -> None:
        """Copy slot ``slot`` of every metadata buffer into row ``slot`` (after the stamp);
        native: only check the slot (the engine reads the metadata buffers)."""
        for part, item, n in self._copies(slot):
            ctypes.memmove(part, item, n)

    def scatter(self, slot: int) -> None:
        """Copy row ``slot`` (after the stamp) into slot ``slot`` of every metadata buffer;
        native: only check the slot (the engine wrote the metadata buffers)."""
        for part, item, n in self._copies(slot):
            ctypes.memmove(item, part, n)


def _prefix_pages(tokens: object, page_size: int, where: str) -> int:
    """SGLang's ``decode_prefix_len`` (tokens; None: 0) as whole pages, or
    :class:`~trio_pd.ProtocolError`."""
    if tokens is None:
        return 0
    if not isinstance(tokens, int | np.integer) or isinstance(tokens, bool) or tokens < 0:
        raise ProtocolError(f"{where}: decode_prefix_len must be an int >= 0, not {tokens!r}")
    if int(tokens) % page_size:
        raise ProtocolError(
            f"{where}: decode_prefix_len {int(tokens)} is not a whole number of pages of "
            f"{page_size} tokens"
        )
    return int(tokens) // page_size


def _common_slots(
    ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int], lists: str,
    buffer: Callable[[int], str], same: str,
) -> int:
    """How many slots (items) each of several buffers holds, which must be one number:
    ``ptrs``, ``lens`` and ``items`` (named ``lists``) give one address, size and item size
    per buffer; ``buffer(i)`` names buffer ``i`` and ``same`` says why the counts must agree
    in the :class:`~trio_pd.ConfigurationError` otherwise."""
    if not len(ptrs) == len(lens) == len(items):
        raise ConfigurationError(
            f"{lists} need one entry per buffer, got {len(ptrs)}, {len(lens)} and {len(items)}"
        )
    slots: int | None = None
    for i, (ptr, length, item) in enumerate(zip(ptrs, lens, items, strict=True)):
        if ptr <= 0 or item <= 0 or length < item:
            raise ConfigurationError(
                f"{buffer(i)}: address {ptr:#x}, {length} bytes, items of {item} bytes: needs "
                "an address and at least one item"
            )
        held = length // item
        if slots is not None and held != slots:
            raise ConfigurationError(
                f"{buffer(i)} holds {held} slots of {item} bytes, buffer 0 holds {slots}: {same}"
            )
        slots = held
    assert slots is not None
    return slots


def _require_host(ptr: int, what: str) -> None:
    """Refuse a pointer CUDA reports as device memory (without cuda-python nothing can
    tell, and every pointer counts as host memory)."""
    from ..io._cuda import classify

    kind = classify(ptr)
    if kind.is_device:
        raise ConfigurationError(
            f"{what} is in {kind} memory: the adapter copies metadata rows with memmove, "
            "host memory only; allocate SGLang's metadata buffers on the host"
        )


# ---------------------------------------------------------------------------------- states

#: the SGLang state types (``StateType`` values) the adapter maps onto state components
STATE_TYPES: Final = ("mamba", "swa", "dsa")


def _state_kind(value: object, i: int) -> str:
    raw = getattr(value, "value", value)
    if not isinstance(raw, str):
        raise ConfigurationError(
            f"KVArgs.state_types[{i}] must be a StateType (a str enum) or a str, got {value!r}"
        )
    if raw.lower() not in STATE_TYPES:
        raise _unsupported(f"KVArgs.state_types[{i}]", raw,
                           f"trio_pd maps the state types {', '.join(STATE_TYPES)}")
    return raw.lower()


def _nested_ints(args: object, name: str) -> list[list[int]]:
    """``KVArgs.name`` as one list of ints per state type (a None entry reads as empty)."""
    raw = _get(args, name, [])
    try:
        return [[] if inner is None else [int(v) for v in inner] for inner in raw]
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"KVArgs.{name} must be a list (one entry per state type) of lists of ints, "
            f"got {raw!r}"
        ) from exc


def _given(entry: object) -> bool:
    """Whether a ``state_conv_shard_groups`` / ``state_slice_outer_counts`` entry says
    anything: an int above 1 somewhere in it (None, empty lists and 1s say nothing)."""
    if entry is None:
        return False
    if isinstance(entry, int | np.integer):
        return int(entry) > 1
    if not isinstance(entry, Sequence | np.ndarray) or isinstance(entry, str | bytes):
        raise ConfigurationError(
            f"KVArgs.state_conv_shard_groups / state_slice_outer_counts: entries must be "
            f"ints, lists or None, got {entry!r}"
        )
    return any(_given(e) for e in entry)


def _more_slicing(args: object, i: int) -> bool:
    """Whether SGLang slices state type ``i`` by more than its per-tensor dims (conv
    sub-blocks sharded one by one, or dims outside the split one)."""
    for name in ("state_conv_shard_groups", "state_slice_outer_counts"):
        raw = _get(args, name, [])
        if i < len(raw) and _given(raw[i]):
            return True
    return False


def _mamba_segments(
    args: object, i: int, items: Sequence[int], dims: Sequence[int], where: str,
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The segments of a Mamba state type with per-tensor dims: each buffer's slot is one
    segment of ``dim`` units of ``item // dim`` bytes (the TP-split outermost dim, as
    SGLang's sliced transfer cuts it); none (rank-local slots) when SGLang slices the type
    further (:func:`_more_slicing`)."""
    if len(dims) != len(items):
        raise ConfigurationError(
            f"{where}: state_dim_per_tensor[{i}] has {len(dims)} entries, but the type has "
            f"{len(items)} buffers (one dim per buffer, or none)"
        )
    if _more_slicing(args, i):
        return ()
    segments = []
    for b, (item, dim) in enumerate(zip(items, dims, strict=True)):
        if dim < 1 or item % dim:
            raise ConfigurationError(
                f"{where}, buffer {b}: state_dim_per_tensor {dim} does not cut its "
                f"{item}-byte slot into whole rows"
            )
        segments.append(((item // dim, dim),))
    return tuple(segments)


def states_from_kvargs(args: object, *, is_mla: bool = False) -> tuple[StateSpec, ...]:
    """The pool's state components (:class:`~trio_pd.StateSpec`) for the state buffers
    SGLang describes in ``args``: one per entry of ``KVArgs.state_types``, in that order.

    * the name is the type's value ("mamba", "swa", "dsa"; a type named twice: "swa.0",
      "swa.1"...), the buffers ``(state_data_ptrs[i][b], state_item_lens[i][b])``, and the
      slots ``state_data_lens // state_item_lens``, the same for every buffer of the type;
    * how TP splits a slot: "mamba" with ``state_dim_per_tensor`` by ``segments``, one per
      buffer, ``dim`` units of ``item // dim`` bytes (rank-local when
      ``state_conv_shard_groups`` or ``state_slice_outer_counts`` slice it further);
      "mamba" without dims and "swa": rank-local (prefill and decode TP must match, as
      SGLang requires); "dsa": replicated on an MLA backend (``is_mla``), where SGLang moves
      the index pages whole between any TP sizes, else rank-local.

    No state types: no components. Raises :class:`~trio_pd.ConfigurationError` naming what
    disagrees: lists of different lengths (across types, or across one type's buffers), a
    type other than those, a buffer without an address or a whole slot, buffers of one type
    with different slot counts, dims that do not divide their slot.
    """
    raw_types = list(_get(args, "state_types", []))
    ptrs = _nested_ints(args, "state_data_ptrs")
    lens = _nested_ints(args, "state_data_lens")
    items = _nested_ints(args, "state_item_lens")
    dims = _nested_ints(args, "state_dim_per_tensor")
    if not (raw_types or ptrs or lens or items):
        return ()
    if not len(raw_types) == len(ptrs) == len(lens) == len(items):
        raise ConfigurationError(
            "state_types, state_data_ptrs, state_data_lens and state_item_lens need one entry "
            f"per state type, got {len(raw_types)}, {len(ptrs)}, {len(lens)} and {len(items)}"
        )
    if dims and len(dims) != len(raw_types):
        raise ConfigurationError(
            f"state_dim_per_tensor needs one entry per state type ({len(raw_types)}), got "
            f"{len(dims)}"
        )
    kinds = [_state_kind(t, i) for i, t in enumerate(raw_types)]
    out = []
    for i, kind in enumerate(kinds):
        p, n, it = ptrs[i], lens[i], items[i]
        where = f"state type {i} ({kind})"
        if not p:
            raise ConfigurationError(f"{where}: state_data_ptrs[{i}] is empty, no buffer")
        slots = _common_slots(
            p, n, it,
            f"{where}: state_data_ptrs[{i}], state_data_lens[{i}] and state_item_lens[{i}]",
            lambda b: f"{where}, buffer {b}",  # noqa: B023 (called at once)
            "every buffer of a state type is indexed by the same slot",
        )
        name = kind if kinds.count(kind) == 1 else f"{kind}.{kinds[:i].count(kind)}"
        segments = (_mamba_segments(args, i, it, dims[i], where)
                    if kind == "mamba" and dims and dims[i] else ())
        out.append(StateSpec(
            name, slots, tuple(zip(p, it, strict=True)),
            replicated=kind == "dsa" and is_mla, segments=segments,
        ))
    return tuple(out)


# ---------------------------------------------------------------------------------- the pool


def pool_from_kvargs(
    args: object,
    *,
    is_mla: bool,
    aux: AuxRows,
    num_pages: int | None = None,
    tp_size: int | None = None,
    tp_rank: int | None = None,
) -> PoolSpec:
    """The :class:`~trio_pd.PoolSpec` of the KV buffers SGLang describes in ``args`` (a
    :class:`KVArgs` or any object with its attributes), with ``aux`` as its (first) aux
    buffer and, when ``aux`` is native, SGLang's metadata buffers as the further aux
    buffers (:attr:`AuxRows.extra_aux`).

    * layout ``"mla"`` if ``is_mla`` (one buffer per layer, one replicated latent "head"),
      else ``"mha"``: K of every layer then V of every layer, so ``num_layers`` is half the
      buffers;
    * ``heads`` is ``kv_head_num``; ``first_head`` the first global head this rank holds
      (``tp_rank``, when given, in place of ``engine_rank``: the attention TP rank):
      ``head_range(engine_rank, tp_size, total_kv_head_num)`` when ``tp_size`` (the
      attention TP size) is given, which also covers GQA replication, else
      ``engine_rank * kv_head_num`` when ``total_kv_head_num > kv_head_num`` (0 otherwise);
    * ``head_bytes`` is ``kv_item_lens / (page_size * heads)``, and ``num_pages`` what every
      buffer holds (``kv_data_lens // kv_item_lens``; a smaller ``num_pages`` uses only the
      first pages);
    * ``states``: the state components of ``state_types`` (:func:`states_from_kvargs`).

    Where each buffer lives is asked of CUDA (host memory without cuda-python). Raises
    :class:`~trio_pd.ConfigurationError` with the reason when the buffers disagree: lists of
    different lengths, an odd number of MHA buffers, buffers whose page sizes in bytes or
    page counts differ, a page that is not ``page_size x heads`` whole heads, a head range
    outside the model's, state buffers :func:`states_from_kvargs` refuses, or overlapping
    buffers (a state buffer that is also a KV buffer among them).
    """
    states = states_from_kvargs(args, is_mla=is_mla)
    ptrs = _ints(args, "kv_data_ptrs")
    lens = _ints(args, "kv_data_lens")
    items = _ints(args, "kv_item_lens")
    if not ptrs:
        raise ConfigurationError("KVArgs.kv_data_ptrs is empty: no KV buffer to register")
    if not len(ptrs) == len(lens) == len(items):
        raise ConfigurationError(
            "kv_data_ptrs, kv_data_lens and kv_item_lens need one entry per KV buffer, got "
            f"{len(ptrs)}, {len(lens)} and {len(items)}"
        )
    page_size = _int(args, "page_size", 1)
    if page_size < 1:
        raise ConfigurationError(f"KVArgs.page_size must be >= 1, got {page_size}")
    rank = _int(args, "engine_rank", 0) if tp_rank is None else tp_rank
    layout: Literal["mha", "mla"]
    if is_mla:
        layout, num_layers, heads, first_head = "mla", len(ptrs), 1, 0
    else:
        if len(ptrs) % 2:
            raise ConfigurationError(
                f"an MHA pool has a K and a V buffer per layer (K[0..L-1] then V[0..L-1]), "
                f"got {len(ptrs)} buffers; pass is_mla=True for an MLA pool"
            )
        layout, num_layers = "mha", len(ptrs) // 2
        heads = _int(args, "kv_head_num", 1)
        total = _int(args, "total_kv_head_num", 0) or heads
        if heads < 1 or total < heads:
            raise ConfigurationError(
                f"KVArgs.kv_head_num={heads} with total_kv_head_num={total}: need "
                "1 <= kv_head_num <= total_kv_head_num"
            )
        if tp_size is not None:
            try:
                first_head, count = head_range(rank, tp_size, total)
            except ValueError as exc:
                raise ConfigurationError(f"engine_rank {rank} of TP {tp_size}: {exc}") from None
            if count != heads:
                raise ConfigurationError(
                    f"engine_rank {rank} of TP {tp_size} holds {count} of {total} KV heads, "
                    f"but KVArgs.kv_head_num is {heads}"
                )
        else:
            first_head = rank * heads if total > heads else 0
        if first_head + heads > total:
            raise ConfigurationError(
                f"engine_rank {rank} would hold heads {first_head}..{first_head + heads - 1}, "
                f"past the model's {total} (total_kv_head_num)"
            )
    item_len = items[0]
    for i, n in enumerate(items):
        if n != item_len:
            raise ConfigurationError(
                f"kv_item_lens[{i}] is {n} bytes but kv_item_lens[0] is {item_len}: trio_pd "
                "needs one page size in bytes for every buffer (K and V heads of one size)"
            )
    if item_len < 1 or item_len % (page_size * heads):
        raise ConfigurationError(
            f"kv_item_lens {item_len} is not page_size {page_size} x {heads} head(s) of a "
            "whole number of bytes"
        )
    head_bytes = item_len // (page_size * heads)
    held = [n // item_len for n in lens]
    for i, n in enumerate(held):
        if n != held[0]:
            raise ConfigurationError(
                f"KV buffer {i} holds {n} pages of {item_len} bytes (kv_data_lens[{i}] = "
                f"{lens[i]}), buffer 0 holds {held[0]}: every buffer holds the same pages"
            )
    if held[0] < 1:
        raise ConfigurationError(f"the KV buffers hold no whole page of {item_len} bytes")
    if num_pages is None:
        num_pages = held[0]
    elif not 1 <= num_pages <= held[0]:
        raise ConfigurationError(f"num_pages={num_pages}: the KV buffers hold {held[0]} pages")
    return describe_pool(
        layout=layout, page_size=page_size, num_layers=num_layers, head_bytes=head_bytes,
        buffers=[(p, n) for p, n in zip(ptrs, lens, strict=True)], aux=aux.rows,
        aux_item_len=aux.row_len, heads=heads, first_head=first_head, num_pages=num_pages,
        aux_slots=aux.slots, extra_aux=aux.extra_aux, states=states,
    )


# ---------------------------------------------------------------------------------- env knobs

#: SGLang environment variable -> (side, trio_pd config field, type)
ENV_KNOBS: Mapping[str, tuple[str, str, type]] = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": ("prefill", "bootstrap_timeout", float),
    "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE": ("prefill", "workers", int),
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": ("decode", "waiting_timeout", float),
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": ("decode", "heartbeat_interval", float),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": ("decode", "heartbeat_misses", int),
}


#: the decode landing area the adapter asks for (``DecodeConfig.landing_bytes``): SGLang's
#: pages are small and handed out in no order, so a request is one engine block per page
#: per buffer without it. Used for host pools only (the agent turns it off for others);
#: :data:`LANDING_ENV` sets another size, 0 turns it off
LANDING_BYTES = 64 << 20
LANDING_ENV = "TRIO_PD_LANDING_BYTES"


def config_from_env(
    mode: object,
    environ: Mapping[str, str] | None = None,
    base: PrefillConfig | DecodeConfig | None = None,
) -> PrefillConfig | DecodeConfig:
    """The trio_pd config for ``mode``'s side (``"prefill"`` or ``"decode"``): ``base`` (or
    the defaults, decode's with a landing area of :data:`LANDING_BYTES`) with each SGLang
    environment variable of :data:`ENV_KNOBS` that is set in ``environ`` (default
    ``os.environ``) applied, and on decode :data:`LANDING_ENV` (bytes, 0: no landing area).
    Raises :class:`~trio_pd.ConfigurationError` naming a variable whose value does not
    parse or is not positive (not negative, for :data:`LANDING_ENV`)."""
    side = _mode(mode)
    env = os.environ if environ is None else environ
    config: PrefillConfig | DecodeConfig = base or (
        PrefillConfig() if side == "prefill" else DecodeConfig(landing_bytes=LANDING_BYTES)
    )
    changes: dict[str, Any] = {}
    raw_landing = env.get(LANDING_ENV)
    if raw_landing is not None and side == "decode":
        try:
            changes["landing_bytes"] = int(raw_landing)
        except ValueError:
            raise ConfigurationError(f"{LANDING_ENV}={raw_landing!r}: not a number") from None
        if changes["landing_bytes"] < 0:
            raise ConfigurationError(f"{LANDING_ENV}={raw_landing!r}: must not be negative")
    for name, (knob_side, attr, kind) in ENV_KNOBS.items():
        raw = env.get(name)
        if raw is None or knob_side != side:
            continue
        try:
            value = kind(raw)
        except ValueError:
            raise ConfigurationError(f"{name}={raw!r}: not a number") from None
        if not value > 0 or (kind is float and not math.isfinite(value)):
            raise ConfigurationError(f"{name}={raw!r}: must be positive")
        changes[attr] = value
    return dataclasses.replace(config, **changes) if changes else config


# ---------------------------------------------------------------------------------- manager


def _wildcard(host: str) -> bool:
    return host.strip("[]") in ("", "0.0.0.0", "::", "*")


def _bootstrap_url(addr: str) -> str:
    """SGLang passes ``host:port``; trio_pd wants a URL (a full one is kept as it is)."""
    return addr if "://" in addr else f"http://{addr}"


def _served_bootstrap_url(server_args: object, server_host: str) -> str:
    """Where SGLang's ``server_args`` put a prefill rank's bootstrap service (a wildcard
    ``host`` is reached on loopback)."""
    port = int(getattr(server_args, "disaggregation_bootstrap_port", None)
               or DEFAULT_BOOTSTRAP_PORT)
    boot_host = "127.0.0.1" if _wildcard(server_host) else server_host
    return f"http://{boot_host}:{port}"


def _make_engine(server_args: object, args: object, host: str) -> TransferEngine:
    """The engine ``server_args.disaggregation_transfer_backend`` names, for a rank on ``host``."""
    backend = str(getattr(server_args, "disaggregation_transfer_backend", None)
                  or "mooncake")
    if backend not in ENGINE_NAMES:
        raise _unsupported(
            "--disaggregation-transfer-backend", backend,
            f"trio_pd runs over {' or '.join(ENGINE_NAMES)}",
        )
    if backend == "mooncake":
        device = _get(args, "ib_device", "") or str(
            getattr(server_args, "disaggregation_ib_device", None) or ""
        )
        return make_engine("mooncake", host=host, device=device)
    return make_engine(backend)


def _state_slots(
    pool: PoolSpec, state_indices: object, what: str
) -> list[npt.NDArray[np.int64]] | None:
    """SGLang's ``state_indices`` as the facade's ``state_slots``: one list of slot ids
    per state type of ``KVArgs.state_types`` (``pool``'s states), in order (a None entry: no
    slot of that type; a bare int: one slot). None or an empty list (SGLang's connector
    reads both as "no states"): none given. Raises :class:`~trio_pd.ProtocolError` for any
    other shape; the slots themselves (inside their component, none repeated) are checked
    by the facade."""
    if state_indices is None:
        return None
    names = [st.name for st in pool.states]
    if isinstance(state_indices, str | bytes | Mapping) or not isinstance(
        state_indices, Sequence | np.ndarray
    ):
        raise ProtocolError(f"{what}: state_indices must be a list, one entry per state "
                            f"type, got {state_indices!r}")
    entries = list(state_indices)
    if not entries:
        return None
    if len(entries) != len(names):
        raise ProtocolError(
            f"{what}: state_indices has {len(entries)} entries, but KVArgs.state_types "
            f"names {len(names)} state type(s) {names}: give one list of slots per state "
            "type (None for a type the request has no slot of)"
        )
    out = []
    for name, entry in zip(names, entries, strict=True):
        if entry is None:
            out.append(np.empty(0, dtype=np.int64))
            continue
        try:
            arr = np.asarray(entry)
        except (TypeError, ValueError):
            arr = np.asarray(object())
        if arr.ndim > 1 or (arr.size and arr.dtype.kind not in "iu") or (
            not arr.size and arr.dtype.kind not in "iuf"
        ):
            raise ProtocolError(f"{what}: state_indices for {name!r} must be a list of "
                                f"slot ids (ints), got {entry!r}")
        out.append(arr.reshape(-1).astype(np.int64))
    return out


class KVManager(ClosesOnExit):
    """One rank's connector: SGLang's ``KVManager(args, disaggregation_mode, server_args,
    is_mla_backend=False)``. Builds the pool from ``args`` (:func:`pool_from_kvargs`, with
    the adapter's :class:`AuxRows`), the transfer engine, and the :mod:`trio_pd.sync` facade
    (:attr:`facade`), on its own trio thread unless ``thread=`` is given. A prefill manager
    registers with its bootstrap service here (:meth:`register_to_bootstrap`).

    From ``server_args`` (any object; missing attributes read as SGLang's defaults):
    ``disaggregation_transfer_backend`` ("mooncake" or "nixl"), ``host`` and
    ``disaggregation_bootstrap_port`` (where a prefill rank's bootstrap service is),
    ``tp_size`` / ``dp_size`` / ``enable_dp_attention`` (the attention TP size; on prefill
    with ``dp_size > 1`` also the agent's DP rank, see the module's docstring) and
    ``pp_size`` (must be 1). ``disaggregation_mode`` is "prefill" or "decode", a str or an
    enum with that ``.value``.

    trio_pd's own keywords: ``engine`` (a :class:`~trio_pd.engines.TransferEngine` to use
    instead of building one; the caller then closes it), ``host`` (the address peers reach
    this rank on; default ``server_args.host``), ``bootstrap_url`` (prefill: instead of
    ``http://{server_args.host}:{disaggregation_bootstrap_port}``), ``config`` (a
    :class:`~trio_pd.PrefillConfig` / :class:`~trio_pd.DecodeConfig`; default: the SGLang
    environment variables, :func:`config_from_env`), ``num_pages``, ``thread``,
    ``free_on_terminal`` (see :meth:`KVSender.poll`), ``facade_kw`` (more keywords for
    :func:`trio_pd.sync.open_prefill` / :func:`~trio_pd.sync.open_decode`: ``token``,
    ``call_timeout``...), and ``native_aux`` (default True: the metadata buffers are the
    pool's further aux buffers, moved in place; False: the adapter copies them through its
    own aux rows, for peers on a trio_pd with one aux buffer; see :class:`AuxRows`; both
    sides of a pair must agree).

    Any thread but a trio thread. Blocks until the agent serves (prefill: registered);
    raises :class:`~trio_pd.ConfigurationError` for what cannot work, and what the facade
    raises at start. :meth:`close` (or the ``with`` block) closes the facade, then the engine
    if the manager built it.
    """

    def __init__(
        self,
        args: object,
        disaggregation_mode: object,
        server_args: object = None,
        is_mla_backend: bool | None = False,
        *,
        engine: TransferEngine | None = None,
        host: str | None = None,
        bootstrap_url: str | None = None,
        config: PrefillConfig | DecodeConfig | None = None,
        num_pages: int | None = None,
        thread: sync.TrioThread | None = None,
        free_on_terminal: bool = True,
        facade_kw: Mapping[str, Any] | None = None,
        native_aux: bool = True,
    ) -> None:
        self.kv_args = args
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.mode: Literal["prefill", "decode"] = _mode(disaggregation_mode)
        self.disaggregation_mode = disaggregation_mode
        self.free_on_terminal = free_on_terminal
        dp_size = max(1, int(getattr(server_args, "dp_size", 1) or 1))
        dp_attention = bool(getattr(server_args, "enable_dp_attention", False))
        check_kvargs(args, system_dp=self.mode == "prefill" and dp_size > 1 and not dp_attention,
                     pipeline=self.mode == "prefill")
        check_server_args(server_args, self.mode)
        #: prefill, pipeline parallelism: the PP stage (``KVArgs.pp_rank``), the PP size
        #: (``server_args.pp_size``) and the stage's first model layer
        #: (``KVArgs.prefill_start_layer``) the agent registers; 0, 1, 0 on decode
        self.pp_rank, self.pp_size, self.first_layer = 0, 1, 0
        if self.mode == "prefill":
            self.pp_size = max(1, int(getattr(server_args, "pp_size", 1) or 1))
            self.pp_rank = _int(args, "pp_rank", 0)
            self.first_layer = _int(args, "prefill_start_layer", 0)
        tp = int(getattr(server_args, "tp_size", 1) or 1)
        if dp_attention:
            tp //= dp_size
        self.tp_size = max(1, tp)
        engine_rank = _int(args, "engine_rank", 0)
        #: the attention TP rank (``engine_rank``, modulo the attention TP size with DP
        #: attention) and, on prefill, the DP rank and size the agent registers
        self.tp_rank = engine_rank % self.tp_size if dp_attention else engine_rank
        self.dp_rank, self.dp_size = 0, 1
        if self.mode == "prefill" and dp_size > 1:
            self.dp_size = dp_size
            self.dp_rank = (engine_rank // self.tp_size if dp_attention
                            else _int(args, "system_dp_rank", 0))
            if not 0 <= self.dp_rank < dp_size:
                raise ConfigurationError(
                    f"DP rank {self.dp_rank} (from KVArgs.engine_rank {engine_rank} or "
                    f"system_dp_rank) is outside [0, server_args.dp_size={dp_size})"
                )
        self.aux = AuxRows(args, native=native_aux)
        self.pool: PoolSpec = pool_from_kvargs(
            args, is_mla=self.is_mla_backend, aux=self.aux, num_pages=num_pages,
            tp_size=self.tp_size, tp_rank=self.tp_rank,
        )
        total = 1 if self.is_mla_backend else (_int(args, "total_kv_head_num", 0)
                                               or self.pool.heads)
        self._kv_heads = total
        server_host = str(getattr(server_args, "host", None) or "127.0.0.1")
        self.host = host if host is not None else server_host
        if bootstrap_url is None:
            bootstrap_url = _served_bootstrap_url(server_args, server_host)
        self.bootstrap_url = bootstrap_url
        self.config = config or config_from_env(self.mode)
        self._facade_kw = dict(facade_kw or {})
        self._thread = thread
        #: rooms handed to trio_pd whose pages are not back yet (``free_on_terminal`` only)
        self._held: dict[int, _Handle] = {}
        self._lock = threading.Lock()
        self._closed = False
        #: SGLang's deferred decode KV release (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_
        #: RELEASE``, default on; always off on prefill): a decode receiver then says Failed
        #: at once, and the scheduler holds the pages until :meth:`is_abort_release_safe`
        self.enable_deferred_decode_kv_release = (
            self.mode == "decode" and _env_flag(os.environ, DEFERRED_RELEASE_ENV, True)
        )
        #: decode, SGLang's ``prefill_info_table``: a :class:`PrefillInfo` per prefill
        #: bootstrap address, from :meth:`try_ensure_parallel_info` on
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        #: bytes of one page in every KV buffer, and of one request's metadata items
        #: (:meth:`KVSender.get_transfer_metric`)
        self.page_bytes = sum(_ints(args, "kv_item_lens"))
        self.aux_bytes = sum(self.aux.item_lens)
        #: decode: rooms SGLang's scheduler released (``clear_deferred_abort_state``) before
        #: trio_pd had proved them drained; never with the release deadline at inf
        self.released_before_drain = 0
        problem = shared_token_problem(self._facade_kw, f"SGLang {self.mode} rank")
        if problem is not None:
            raise problem
        self._owns_engine = engine is None
        if engine is None:
            engine = _make_engine(server_args, args, self.host)
        self.engine: TransferEngine = engine
        self._facade: sync.SyncPrefill | sync.SyncDecode | None = None
        try:
            if self.mode == "prefill":
                self.register_to_bootstrap()
            else:
                self._facade = sync.open_decode(
                    engine=engine, pool=self.pool, tp_rank=self.tp_rank, tp_size=self.tp_size,
                    kv_heads=self._kv_heads, host=self.host, config=self.config,
                    thread=thread, **self._facade_kw,
                )
        except BaseException:
            if self._owns_engine:
                engine.close()
            raise

    def register_to_bootstrap(self) -> None:
        """Prefill: start the agent, which registers this rank with the bootstrap service at
        :attr:`bootstrap_url` (the constructor already did; calling again does nothing).
        Decode registers nothing: a no-op. Blocks until registered, at most the facade's
        ``start_timeout``."""
        if self.mode != "prefill" or self._facade is not None:
            return
        dp = {"dp_rank": self.dp_rank, "dp_size": self.dp_size} if self.dp_size > 1 else {}
        if self.pp_size > 1 or self.pp_rank or self.first_layer:
            dp |= {"pp_rank": self.pp_rank, "pp_size": self.pp_size,
                   "first_layer": self.first_layer}
        self._facade = sync.open_prefill(
            engine=self.engine, pool=self.pool, bootstrap_url=self.bootstrap_url,
            tp_rank=self.tp_rank, tp_size=self.tp_size, kv_heads=self._kv_heads,
            host=self.host, config=self.config, thread=self._thread,
            **{**dp, **self._facade_kw},
        )

    @property
    def facade(self) -> sync.SyncPrefill | sync.SyncDecode:
        """The :mod:`trio_pd.sync` facade underneath. Any thread; never blocks."""
        assert self._facade is not None
        return self._facade

    def statistics(self) -> AgentStatistics:
        """The agent's counters (:meth:`trio_pd.sync.SyncPrefill.statistics`)."""
        return self.facade.statistics()

    def pop_released(self) -> list[int]:
        """The rooms whose pages are free again since the last call, each once (as
        :meth:`trio_pd.sync.SyncPrefill.pop_released`: on prefill every room given
        ``init``; on decode the rooms given ``send_metadata`` that failed). Only with
        ``free_on_terminal=False``; otherwise ``poll()`` consumes them, and this raises
        RuntimeError. Any thread; never blocks."""
        if self.free_on_terminal:
            raise RuntimeError(
                "KVManager.pop_released: with free_on_terminal=True a terminal poll() means "
                "the pages are free; pass free_on_terminal=False to free them from here"
            )
        return self.facade.pop_released()

    def close(self) -> None:
        """Close the facade (open rooms fail), then the engine if the manager built it.
        Idempotent. Any thread but a trio thread; blocks at most the facade's
        ``close_timeout``. If the facade's close times out
        (:class:`~trio_pd.TransferTimeout`) the engine is left open: the agent still closing
        may still use it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._facade is not None:
            self._facade.close()
        if self._owns_engine:
            self.engine.close()

    # -------------------------------------------------------------- the release gate

    def _hold(self, h: _Handle) -> None:
        """Book ``h``'s room before its pages go to trio_pd (so a release that comes at
        once still finds it)."""
        if not self.free_on_terminal:
            return
        with self._lock:
            if h.room in self._held:  # (a second init of a handle, as the facade says)
                raise ProtocolError(f"room {h.room} is still in use on this rank")
            self._held[h.room] = h

    def _unhold(self, h: _Handle) -> None:
        with self._lock:
            if self._held.get(h.room) is h:
                del self._held[h.room]

    def _released(self, h: _Handle) -> bool:
        """Whether trio_pd has handed ``h``'s pages back (taking what ``pop_released``
        says for every room of this manager)."""
        if h._freed:
            return True
        rooms = self.facade.pop_released()
        if rooms:
            with self._lock:
                for room in rooms:
                    other = self._held.pop(room, None)
                    if other is not None:
                        other._freed = True
        return h._freed

    # -------------------------------------------------------------- SGLang's decode calls

    #: SGLang's capability flags: the adapter answers SGLang's deferred decode KV release
    #: with trio_pd's drain; no host destinations, no runtime role switch
    supports_deferred_decode_kv_release: Final = True
    supports_host_destination: Final = False
    supports_role_switch: Final = False

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: SGLang's "is the prefill instance at ``bootstrap_addr`` known?". Always
        True at once: each receiver resolves its prefill instance itself (and fails its
        request, naming the address, if that cannot be done by ``DecodeConfig``'s bootstrap
        deadline). Records the address in :attr:`prefill_info_table`. Any thread; never
        blocks."""
        self.prefill_info_table.setdefault(str(bootstrap_addr), _SELF_ROUTED)
        return True

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """Decode, SGLang's deferred release: True once no prefill rank can still write the
        pages of failed or aborted room ``bootstrap_room`` (trio_pd has drained it: every
        prefill rank acknowledged the abort, or was proven gone), and for a room that holds
        no pages here. ``required_acks`` is not needed: trio_pd's drain waits for every
        prefill rank of the room. Needs ``free_on_terminal`` (the default; otherwise
        :meth:`pop_released` says it, and this raises RuntimeError). Any thread; never
        blocks."""
        if not self.free_on_terminal:
            raise RuntimeError("KVManager.is_abort_release_safe: with free_on_terminal=False "
                               "the released rooms come out of pop_released()")
        with self._lock:
            held = self._held.get(int(bootstrap_room))
        return held is None or self._released(held)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """Decode, SGLang's deferred release: the scheduler has released the room's pages.
        Forgets the room. If trio_pd had not proved it drained (SGLang's deadline came
        first, which :func:`check_server_args` refuses), the room is counted in
        :attr:`released_before_drain` and logged. Any thread; never blocks."""
        with self._lock:
            held = self._held.get(int(bootstrap_room))
        if held is not None and not self._released(held):
            with self._lock:
                self.released_before_drain += 1
                self._held.pop(int(bootstrap_room), None)
            _log.warning(
                "room %s: SGLang released its KV pages before trio_pd proved the prefill "
                "writers drained; set %s=inf", bootstrap_room, DEFERRED_RELEASE_TIMEOUT_ENV,
            )

    def submit_prefill_recompute(self, receiver: KVReceiver, payload: object = None) -> None:
        """Decode, SGLang's PD rebootstrap (a retracted request whose prefix the prefill
        instance recomputes: ``pause_generation(mode="retract")``, DeepSeek-V4 pools): not
        served by trio_pd. The request fails cleanly (its room is aborted, so
        :meth:`KVReceiver.poll` says Failed and the pages go through the drain) rather than
        waiting for a recompute that never comes. Any thread; never blocks."""
        receiver.abort("PD rebootstrap (prefill recompute) is not supported by trio_pd")

    @property
    def _gates_terminal(self) -> bool:
        """Whether a terminal poll() waits for the pages (prefill: ``free_on_terminal``;
        decode: the same, unless SGLang's deferred release holds them instead)."""
        return self.free_on_terminal and not self.enable_deferred_decode_kv_release

    def _require(self, mode: str, what: str) -> None:
        if self.mode != mode:
            raise ConfigurationError(f"{what} needs a {mode} KVManager, this one is {self.mode}")

# ---------------------------------------------------------------------------------- handles


def _room(bootstrap_room: int | None) -> int:
    if bootstrap_room is None:
        raise ConfigurationError(
            "bootstrap_room=None is not supported: trio_pd needs the room id the prefill "
            "side uses for this request"
        )
    room = as_index(bootstrap_room, "bootstrap_room")
    if not 0 <= room <= _I63:
        raise ConfigurationError(f"bootstrap_room {room} outside [0, 2**63)")
    return room


@dataclass
class KVTransferMetric:
    """SGLang's ``KVTransferMetric``: what :meth:`KVSender.get_transfer_metric` returns after
    a request's transfer, read by SGLang's request metrics (same field names)."""

    #: from the request's first chunk handed over to the first :meth:`KVSender.poll` that
    #: saw Success (None until then)
    transfer_latency_s: float | None = None
    #: not measured by trio_pd (SGLang's backends may leave it None too)
    alloc_latency_s: float | None = None
    #: the KV, state and metadata bytes the request's chunks named, on this rank
    transfer_total_bytes: int | None = None


@dataclass(frozen=True)
class PrefillInfo:
    """What ``KVManager.prefill_info_table`` holds for a prefill instance: the two fields
    SGLang's decode scheduler reads to pick a prefill DP rank itself. The adapter's receivers
    route themselves (with DP attention, to the DP rank the prefill side announced to the
    bootstrap service), so the scheduler is told there is one: every request resolves to DP
    rank 0 at once, and ``KVReceiver.init`` takes it as "route yourself"."""

    dp_size: int = 1
    follow_bootstrap_room: bool = True


_SELF_ROUTED: Final = PrefillInfo()


class _Handle:
    """What the sender and receiver share: the facade's handle, the room, the gate."""

    _h: sync.SyncSender | sync.SyncReceiver

    def __init__(self, mgr: KVManager, room: int) -> None:
        self._mgr = mgr
        #: the manager, under the name SGLang's scheduler reads (``sender.kv_mgr``)
        self.kv_mgr = mgr
        self.room = room
        self.bootstrap_room = room
        #: pages were handed to trio_pd (init / send_metadata ran)
        self._given = False
        #: trio_pd handed the pages back (set once, under the manager's lock)
        self._freed = False

    def _gated(self, status: KVPoll) -> KVPoll:
        """``status``, or Transferring while a terminal one must wait for the pages."""
        if (
            status in _TERMINAL and self._given and self._mgr._gates_terminal
            and not self._mgr._released(self)
        ):
            return _HELD
        return status

    @property
    def failure(self) -> TransferError | None:
        """Why the room failed (None unless it did). Any thread; never blocks."""
        return self._h.failure

    def failure_exception(self) -> None:
        """Raise the room's failure (a :class:`~trio_pd.TransferError`) if it failed; else
        return None. SGLang's loop calls it on Failed to log the reason. Any thread; never
        blocks."""
        self._h.failure_exception()

    def clear(self) -> None:
        """SGLang's per-room cleanup. Nothing to do: the adapter forgets a room by itself
        once its pages are free (or, on decode, once it succeeded). Any thread."""


class KVSender(_Handle):
    """SGLang's ``KVSender(mgr, bootstrap_addr, bootstrap_room,
    req_has_disagg_prefill_dp_rank=False)``: the prefill scheduler's handle for one request.
    Nothing reaches trio_pd's room before :meth:`init`. ``bootstrap_addr`` is not needed
    (the rank's bootstrap service is the manager's, and decode ranks announce themselves),
    nor is ``req_has_disagg_prefill_dp_rank`` (with DP the sender announces the room's DP
    rank to the bootstrap service either way).

    Any thread; never blocks. Raises :class:`~trio_pd.ConfigurationError` for a
    ``bootstrap_room`` of None, or a decode manager.
    """

    def __init__(
        self,
        mgr: KVManager,
        bootstrap_addr: str | None,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        mgr._require("prefill", "KVSender")
        super().__init__(mgr, _room(bootstrap_room))
        facade = mgr.facade
        assert isinstance(facade, sync.SyncPrefill)
        self._h = self._sender = facade.sender(self.room, epoch=room_epoch(self.room))
        if mgr.dp_size > 1:  # as SGLang's sender: the decode side routes by it from now
            facade.thread.post(_announce, facade, self.room, room_epoch(self.room))
        self._num: int | None = None
        self._sent = 0
        #: layer-wise (``send(layers=)``): pages sent so far, layer by layer; None before
        self._layer_sent: list[int] | None = None
        self._aux_index = 0
        self._claim = threading.Lock()  # init and abort decide here who came first
        #: aborted before init: the room never reaches trio_pd's facade
        self._early = False
        #: before init: what decode has said about the room (written by the trio thread,
        #: moves forward only: Bootstrapping, then WaitingForInput or Failed)
        self._boot = KVPoll.Bootstrapping
        self._probing = False  # a look at decode's metadata is on its way
        self._started: float | None = None  # the first chunk handed over
        self._latency: float | None = None  # until the first poll that saw Success

    def pop_decode_prefix_len(self) -> int:
        """How many of the request's first tokens the decode side holds already (its radix
        cache), for a scheduler that then sends only the rest: always 0 here. A decode
        prefix is honoured by trio_pd's prefill rank itself, which learns it from decode's
        metadata and skips those pages as it writes; so the scheduler sends the whole
        request, and the decode side names the prefix (``send_metadata(...,
        decode_prefix_len=)``). Any thread; never blocks."""
        return 0

    def get_max_transfer_tokens(self) -> int | None:
        """The most tokens one :meth:`send` may carry: None, no limit. trio_pd cuts and
        coalesces a chunk's pages into engine calls itself (``PrefillConfig.coalesce_pages``,
        ``batch_blocks``), so the scheduler sends each chunk whole. Any thread."""
        return None

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """Whether the scheduler makes a :meth:`send` for a chunk of ``num_pages`` pages:
        yes when it has pages, and always for the last one, which carries the metadata
        rows and state slots even with no page (a request whose pages all went earlier).
        Any thread."""
        return num_pages > 0 or bool(last_chunk)

    def get_transfer_metric(self) -> KVTransferMetric:
        """The request's transfer figures on this rank (:class:`KVTransferMetric`): latency
        from the first chunk handed over to the first :meth:`poll` that saw Success, and the
        bytes its chunks named (pages x the bytes of a page in every KV buffer, plus the
        metadata items). SGLang's prefill loop reads it once a request succeeded. Any
        thread; never blocks."""
        mgr = self._mgr
        total = self._sent * mgr.page_bytes + (mgr.aux_bytes if self._num is not None else 0)
        return KVTransferMetric(transfer_latency_s=self._latency, transfer_total_bytes=total)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """Create the room: ``num_kv_indices`` source *pages* will come through :meth:`send`,
        and the request's metadata is in slot ``aux_index`` of the metadata buffers.

        The scheduler's thread. Blocks as :meth:`trio_pd.sync.SyncSender.init` does (for a
        room id still held; it says what it raises). ``aux_index=None``
        raises :class:`~trio_pd.ConfigurationError`: the metadata row travels with the KV.
        """
        if aux_index is None:
            raise _unsupported("aux_index", None, "the request's metadata row travels with "
                               "its KV, in its aux slot")
        num, slot = int(num_kv_indices), int(aux_index)
        with self._claim:
            early = self._early
            if not early:
                self._mgr._hold(self)
                self._given = True  # (before the room exists: a poll meanwhile is gated)
        if early:  # aborted first: Failed already, and decode was told; chunks are dropped
            self._num, self._aux_index = num, slot
            return
        try:
            self._sender.init(num, slot)
        except BaseException:
            self._given = False
            self._mgr._unhold(self)
            raise
        self._num, self._aux_index = num, slot

    def abort(self, reason: str = "aborted by the scheduler") -> None:
        """Abort the room. Idempotent. Any thread; never blocks.

        What :meth:`poll` then says: Failed (:meth:`failure_exception` raises
        :class:`~trio_pd.TransferAborted`), unless the room had already succeeded on this
        rank (every decode rank it writes to was sent its Success): that Success stands,
        and poll() shows it, with ``free_on_terminal``, once the source pages are back, as
        it would have without the abort. Either way the pages come back once no engine
        call can still read them.

        An abort before :meth:`init` (SGLang aborts requests still in its bootstrap queue,
        whose loop then never calls init) still reaches the decode side at once: the adapter
        posts an empty room, aborted, to the prefill agent, which fails decode's request
        for it; an init that comes afterwards does nothing, and poll() says Failed."""
        with self._claim:
            early = not self._given and not self._early
            if early:
                self._early = True
        self._sender.abort(reason)
        if early:
            facade = self._mgr.facade
            facade.thread.post(_fail_early, facade, self.room, room_epoch(self.room), reason)

    def send(
        self,
        kv_indices: npt.ArrayLike,
        state_indices: Sequence[Any] | None = None,
        num_kv_tokens: int | None = None,
        *,
        layers: range | None = None,
    ) -> None:
        """Hand the next chunk of source page ids over; the chunk that brings the total to
        ``num_kv_indices`` is the last, and carries the request's metadata rows (read in
        place by the engine; with ``native_aux=False`` gathered into the adapter's aux row
        first, :meth:`AuxRows.gather`): the scheduler must have written them by then, as
        SGLang's does, and leave them until the request's pages are free. The page ids are
        copied. ``num_kv_tokens`` (the tokens the chunk covers) is not needed: trio_pd
        moves whole pages, and a last page that is partly filled is moved whole.

        ``state_indices``, with the last chunk: the request's source slots of each state
        type, one list per entry of ``KVArgs.state_types`` (None for a type it has none of),
        as SGLang's scheduler passes them; slot ``i`` of a type goes to decode's slot ``i``
        (``send_metadata``'s). They are the room's, like its pages, until those are free.

        The scheduler's thread; never blocks. Raises :class:`~trio_pd.ProtocolError` as
        :meth:`trio_pd.sync.SyncSender.send` (before init, bad ids, past the total; state
        slots outside their state type, repeated, or before the last chunk), and for
        ``state_indices`` that are not one list per state type.

        ``layers`` (trio_pd's, not SGLang's; docs/layerwise.md): ``range(a, b)`` of the
        pool's layers (the stage's own with pipeline parallelism): only those layers of the
        chunk are ready, and they move while the model computes the next. The send that
        completes every layer of every page is the last. Where SGLang's forward pass would
        call it: once a layer's KV for the chunk is in memory (on a GPU, after that layer's
        kernels completed: a CUDA event recorded after the layer, waited for before this
        call), from the scheduler's thread, with the chunk's ``kv_indices``; the chunk's
        ordinary ``send`` is then left out.
        """
        if self._num is None:
            raise ProtocolError(f"room {self.room}: send before init")
        slots = _state_slots(self._mgr.pool, state_indices, f"room {self.room}: send")
        ids = page_ids(kv_indices)
        if self._started is None:
            self._started = time.perf_counter()
        if layers is not None or self._layer_sent is not None:
            self._send_layers(ids, slots, layers)
            return
        if self._early:
            self._sent += len(ids)
            return
        last = self._sent + len(ids) >= self._num
        if slots is not None and not last and not any(len(s) for s in slots):
            slots = None  # (no slot named: nothing to move before the last chunk)
        if last and self._sent + len(ids) == self._num:
            self._mgr.aux.gather(self._aux_index)
        self._sender.send(ids, last=last, state_slots=slots)
        self._sent += len(ids)

    def _send_layers(
        self, ids: npt.NDArray[np.int64], slots: Any, layers: range | None
    ) -> None:
        """:meth:`send` of some layers: the last is the one that completes every layer."""
        assert self._num is not None
        num_layers = self._mgr.pool.num_layers
        a, b = layer_range(layers) or (0, num_layers)
        if not 0 <= a < b <= num_layers:
            raise ProtocolError(
                f"room {self.room}: layers [{a}, {b}) are not inside the pool's {num_layers}"
            )
        after = list(self._layer_sent or [self._sent] * num_layers)
        after[a:b] = [after[a] + len(ids)] * (b - a)
        if self._early:
            self._layer_sent, self._sent = after, min(after)
            return
        last = min(after) >= self._num
        if slots is not None and not last and not any(len(s) for s in slots):
            slots = None  # (no slot named: nothing to move before the last chunk)
        if last and min(after) == self._num:
            self._mgr.aux.gather(self._aux_index)
        self._sender.send(ids, layers=layers, last=last, state_slots=slots)
        self._layer_sent, self._sent = after, min(after)

    def poll(self) -> KVPoll:
        """The request's :class:`KVPoll`, as SGLang's: Bootstrapping until every decode rank
        this rank writes to has sent its metadata for the request (decode has reserved its
        pages; SGLang's bootstrap queue holds the request until then), then WaitingForInput
        (call :meth:`init`), Transferring, Success or Failed. Failed before :meth:`init`
        too, when decode aborted the request first.

        With ``free_on_terminal`` (the default) a terminal status shows only once trio_pd has
        handed the room's source pages back (until then it reads Transferring): SGLang's loop
        frees the pages and the metadata slot on a terminal status, and may then. Otherwise
        it shows at once and the pages come back through :meth:`KVManager.pop_released`.

        Any thread; never blocks: before :meth:`init` it reads what the trio thread last
        found (and asks again, one look at a time), so a step that sees Bootstrapping may be
        followed by one that sees WaitingForInput.
        """
        if self._num is None and not self._early:
            boot = self._boot
            if boot is KVPoll.Bootstrapping and not self._probing:
                self._probing = True
                if not self._mgr.facade.thread.post(_look_at_decode, self):
                    self._probing = False
            return boot
        status = self._gated(self._sender.poll())
        if status is KVPoll.Success and self._latency is None and self._started is not None:
            self._latency = time.perf_counter() - self._started
        return status

    #: SGLang's prefill pipeline parallelism polls each sender through this name
    poll_pp_consensus = poll

    def failure_exception(self) -> None:
        """Raise why the room failed (a :class:`~trio_pd.TransferError`); before
        :meth:`init` a request decode aborted first raises
        :class:`~trio_pd.TransferAborted`. Else return None. Any thread; never blocks."""
        if self._num is None and not self._early and self._boot is KVPoll.Failed:
            raise TransferAborted(f"room {self.room} was aborted by decode before prefill "
                                  "created it")
        super().failure_exception()


def _look_at_decode(sender: KVSender) -> None:
    """On the trio thread: what decode has said so far about ``sender``'s room
    (:meth:`trio_pd.PrefillAgent.decode_metadata`), for its poll before init."""
    agent = sender._mgr.facade.agent
    assert isinstance(agent, PrefillAgent)
    seen = agent.decode_metadata(sender.room, room_epoch(sender.room))
    if seen is KVPoll.Failed:
        sender._boot = KVPoll.Failed
    elif seen >= KVPoll.WaitingForInput:
        sender._boot = KVPoll.WaitingForInput
    sender._probing = False


def _announce(facade: sync.SyncPrefill, room: int, epoch: int) -> None:
    """On the trio thread: tell the bootstrap service now that this DP rank holds ``room``
    (SGLang's prefill side does when it makes the sender; the agent's own announcement at
    ``init`` is then not sent again). Only TP rank 0 of a DP rank has an announcer."""
    agent = facade.agent
    assert isinstance(agent, PrefillAgent)
    if agent.dp_announcer is not None:
        agent.dp_announcer.announce(room, epoch)


def _fail_early(facade: sync.SyncPrefill | sync.SyncDecode, room: int, epoch: int,
                reason: str) -> None:
    """On the trio thread: create ``room`` with no pages on the prefill agent and abort it,
    so that decode's request for it fails now, not at its waiting deadline. Nothing is read
    from the pool for it."""
    agent = facade.agent
    assert isinstance(agent, PrefillAgent)
    try:
        sender = agent.sender(room, num_pages=0, aux_slot=0, epoch=epoch)
    except TransferError:  # the room id is still tracked (a use of it is under way)
        return
    sender.abort(reason)


class KVReceiver(_Handle):
    """SGLang's ``KVReceiver(mgr, bootstrap_addr, bootstrap_room=None)``: the decode
    scheduler's handle for one request, served by the prefill instance whose bootstrap
    service is at ``bootstrap_addr`` (``host:port``, or a full URL).

    The trio_pd room is made here, so the prefill instance is resolved while the request
    waits in SGLang's queues; :meth:`poll` says Bootstrapping until :meth:`init` (or
    :meth:`send_metadata`), as SGLang's receiver.

    The scheduler's thread (not a trio thread). Blocks as
    :meth:`trio_pd.sync.SyncDecode.receiver` does (for a room id still held). Raises
    :class:`~trio_pd.ConfigurationError` for ``bootstrap_room=None`` or a prefill manager.
    """

    #: SGLang asks before it would send a request's KV to host memory (its host receive,
    #: which the manager refuses)
    supports_host_destination: bool = False
    #: SGLang's staging buffer (refused by the manager)
    require_staging: bool = False

    def __init__(
        self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int | None = None
    ) -> None:
        mgr._require("decode", "KVReceiver")
        super().__init__(mgr, _room(bootstrap_room))
        facade = mgr.facade
        assert isinstance(facade, sync.SyncDecode)
        self.bootstrap_addr = bootstrap_addr
        self._h = self._receiver = facade.receiver(
            self.room, bootstrap_url=_bootstrap_url(bootstrap_addr),
            epoch=room_epoch(self.room),
        )
        self._aux_index = 0
        self._delivered = False
        self._deliver_lock = threading.Lock()
        self._started = False  # init(prefill_dp_rank) or send_metadata came
        self._aborted = False  # abort() came (Failed at once with deferred release)
        #: SGLang's deferred release: True once the room's pages were handed to trio_pd and
        #: the room failed or was aborted, so the scheduler must hold the pages until
        #: :meth:`KVManager.is_abort_release_safe` says trio_pd drained them
        self.abort_notified = False
        #: SGLang takes ``len(bootstrap_infos)`` as the acks its release waits for; trio_pd's
        #: drain already waits for every prefill rank of the room, so it is one
        self.bootstrap_infos: list[str] = [bootstrap_addr]

    def init(
        self,
        prefill_dp_rank: int | npt.ArrayLike | None = None,
        aux_index: int | None = None,
        kv_indices: npt.ArrayLike | None = None,
        state_indices: Sequence[Any] | None = None,
    ) -> None:
        """Both of SGLang's forms. ``init(prefill_dp_rank)``: the prefill DP rank SGLang
        picked; any int (or None) is taken, and only ends Bootstrapping: the receiver routes
        itself, with DP attention to the DP rank the prefill side announced to the bootstrap
        service (``KVManager.prefill_info_table`` tells the scheduler there is one DP rank,
        so it resolves none). ``init(kv_indices, aux_index, state_indices)`` (older SGLang,
        the three positionally, or by keyword): the same as :meth:`send_metadata`."""
        if kv_indices is None and (
            prefill_dp_rank is None or isinstance(prefill_dp_rank, int | np.integer)
        ):
            if aux_index is not None or state_indices is not None:
                raise ProtocolError("init(prefill_dp_rank): aux_index and state_indices go to "
                                    "send_metadata")
            self._started = True
            return
        if kv_indices is None:
            pages = prefill_dp_rank
        elif prefill_dp_rank is None or isinstance(prefill_dp_rank, int | np.integer):
            pages = kv_indices  # (by keyword)
        else:  # older SGLang, positionally: init(kv_indices, aux_index, state_indices)
            if state_indices is not None:
                raise ProtocolError("init(kv_indices, aux_index, state_indices): state_indices "
                                    "given twice")
            pages, state_indices = prefill_dp_rank, kv_indices  # type: ignore[assignment]
        assert pages is not None
        self.send_metadata(pages, aux_index, state_indices)

    def send_metadata(
        self,
        kv_indices: npt.ArrayLike,
        aux_index: int | None = None,
        state_indices: Sequence[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: object = None,
    ) -> None:
        """Ask for the request's KV into destination pages ``kv_indices`` and its metadata
        into slot ``aux_index`` of the metadata buffers, and its state slots into
        ``state_indices``: one list per entry of ``KVArgs.state_types`` (None for a type it
        has none of), prefill's slot ``i`` of a type into slot ``i`` here. From here the
        pages and state slots are trio_pd's until Success (or, failed, until the drain:
        :meth:`KVManager.is_abort_release_safe` with SGLang's deferred release, else a
        Failed :meth:`poll` with ``free_on_terminal``, else :meth:`KVManager.pop_released`).

        ``destination``: SGLang's ``KVTransferDestination``; only its device value (or
        None) is taken, host destinations are refused when the manager is built.

        The scheduler's thread; never blocks. Raises :class:`~trio_pd.ProtocolError` as
        :meth:`trio_pd.sync.SyncReceiver.init` (bad page ids or aux slot; state slots outside
        their state type or repeated) and for ``state_indices`` that are not one list per
        state type, and :class:`~trio_pd.ConfigurationError` for ``aux_index=None`` or a host
        destination.

        ``decode_prefix_len``: the request's first tokens this rank holds already (its radix
        cache; a multiple of ``KVArgs.page_size``, else :class:`~trio_pd.ProtocolError`);
        ``kv_indices`` are then the pages after them, and the prefill ranks skip the prefix
        (``prefix_pages`` of :meth:`trio_pd.sync.SyncReceiver.init`). The prefill side's
        scheduler sends the whole request: its :meth:`KVSender.pop_decode_prefix_len` is 0.
        """
        if aux_index is None:
            raise _unsupported("aux_index", None, "the request's metadata row travels with "
                               "its KV, in its aux slot")
        if str(getattr(destination, "value", destination) or "device") != "device":
            raise _unsupported("destination", destination, "trio_pd writes decode's device "
                               "(registered) KV pages only")
        prefix_pages = _prefix_pages(decode_prefix_len, self._mgr.pool.page_size,
                                     f"room {self.room}")
        slots = _state_slots(self._mgr.pool, state_indices, f"room {self.room}: send_metadata")
        self._aux_index = int(aux_index)
        self._mgr._hold(self)
        self._given = True
        self._started = True
        try:
            self._receiver.init(kv_indices, self._aux_index, prefix_pages=prefix_pages,
                                state_slots=slots or ())
        except BaseException:
            self._given = False
            self._mgr._unhold(self)
            raise

    def poll(self) -> KVPoll:
        """The request's :class:`KVPoll`: Bootstrapping until :meth:`init` and the prefill
        instance is resolved, WaitingForInput (call :meth:`send_metadata`), Transferring,
        then Success or Failed.

        Success shows only once the request's metadata is in the metadata buffers (with
        ``native_aux=False``, scattered there by the first poll that sees it); the pages
        hold the KV and are the scheduler's.

        Failed: with SGLang's deferred decode KV release (its default, and the manager's
        :attr:`KVManager.enable_deferred_decode_kv_release`) at once, after :meth:`abort`
        too, while the pages stay held until :meth:`KVManager.is_abort_release_safe` says
        trio_pd drained them. Without it, and with ``free_on_terminal`` (the default),
        Failed shows only once no prefill rank can still write the pages (until then it
        reads Transferring), so a scheduler that frees on Failed is right to.

        Any thread; never blocks on the trio thread (with ``native_aux=False`` the first
        Success copies the row).
        """
        deferred = self._mgr.enable_deferred_decode_kv_release
        if self._aborted and deferred and not self._delivered:
            status = self._receiver.poll()
            if status is not KVPoll.Success:  # (unless the facade had handed Success out)
                return KVPoll.Failed
        status = self._receiver.poll()
        if status is KVPoll.Success:
            if not self._delivered:
                self._deliver()
            return status
        if not self._started and status is not KVPoll.Failed:
            return KVPoll.Bootstrapping
        if status is KVPoll.Failed and deferred:
            return status
        return self._gated(status)

    #: SGLang's pipeline-parallel polling reads this name (the same as poll())
    poll_pp_consensus = poll

    def abort(self, reason: str = "aborted by the scheduler") -> None:
        """Give the request up. Idempotent. Any thread; never blocks.

        Once :meth:`poll` has returned Success the abort changes nothing: the pages hold the
        KV and are the scheduler's. Before that, it decides, whatever the transfer does
        next: :meth:`poll` says Failed from now on (:meth:`failure_exception` raises
        :class:`~trio_pd.TransferAborted`), also for a room whose KV had all arrived but
        whose Success poll() had not yet returned. Pages given by :meth:`send_metadata`
        then stay trio_pd's until no prefill rank can write them: after the drain (every
        prefill rank acknowledged the abort, or was proven gone), or at once for a room
        that had succeeded unseen (its writers were done: trio_pd hands the pages back
        unclaimed, counted ``released_unclaimed``). With SGLang's deferred release (its
        default) :attr:`abort_notified` is then True, and
        :meth:`KVManager.is_abort_release_safe` says when the scheduler may free the pages;
        without it a Failed poll() shows only then (with ``free_on_terminal``)."""
        self._aborted = True
        self._receiver.abort(reason)
        if self._given and not self._delivered:
            self.abort_notified = True

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """SGLang's call for a request that failed without the scheduler aborting it: make
        sure every prefill rank stops writing, and hold the pages for the drain. The adapter
        aborts the room (on a failed one this changes nothing: trio_pd drains it either
        way) and, if its pages were handed over and Success was not delivered, sets
        :attr:`abort_notified`. ``force_arm`` changes nothing (trio_pd always waits for the
        drain of a room that holds pages). Any thread."""
        if self.abort_notified:
            return
        self._receiver.abort("failed: the scheduler releases the request")
        if self._given and not self._delivered:
            self.abort_notified = True

    def clear(self) -> None:
        """SGLang's per-room cleanup, after Success, after a released failure, or for a
        request dropped before it was given pages. A room still open that was never given
        pages is aborted, so that it stops resolving its prefill instance (nothing to
        drain). Any thread; never blocks."""
        if not self._given and self._receiver.poll() not in _TERMINAL:
            self._receiver.abort("dropped by the scheduler before its pages were allocated")

    def _deliver(self) -> None:
        with self._deliver_lock:
            if self._delivered:
                return
            self._mgr.aux.scatter(self._aux_index)
            self._delivered = True
        self._mgr._unhold(self)  # a room that succeeded never comes out of pop_released


def shared_token_problem(kwargs: Mapping[str, Any], what: str) -> ConfigurationError | None:
    """Security is on by default (docs/security.md), and SGLang runs its bootstrap service,
    prefill ranks and decode ranks in separate processes: a token made in one process
    (what trio_pd does for one that runs every side) is known to no other. So here the
    token must be shared: ``token=`` (``facade_kw``) or ``TRIO_PD_TOKEN`` in the environment
    of every process, the same secret; or security turned off explicitly (``secure=False``
    or ``TRIO_PD_SECURE=0``, which every agent logs). The error, or None when it holds."""
    if kwargs.get("token") or os.environ.get(TOKEN_ENV):
        return None
    off = os.environ.get(SECURE_ENV, "").strip().lower() in ("0", "false", "off", "no")
    if kwargs.get("secure") is False or (kwargs.get("secure") is None and off):
        return None
    return ConfigurationError(
        f"{what}: authentication is on and SGLang's processes must share the cluster "
        f"token: set {TOKEN_ENV} to one secret in the environment of every SGLang process "
        f"(prefill, decode, and the bootstrap service's), or {SECURE_ENV}=0 to run open "
        "(docs/sglang.md)"
    )


class KVBootstrapServer(ClosesOnExit):
    """SGLang's ``KVBootstrapServer(host, port)``: trio_pd's bootstrap service
    (:func:`trio_pd.open_bootstrap_server`) on a trio thread (its own, or ``thread=``),
    serving from construction until :meth:`close`. ``kwargs`` go to the service (``token``,
    ``certfile``...). :attr:`url` is what prefill managers take as ``bootstrap_url`` and
    decode receivers as ``bootstrap_addr``; :attr:`port` the bound port (0 asks for a free
    one).

    Any thread but a trio thread. Blocks until the service accepts connections; raises what
    it raises at start (:class:`~trio_pd.BootstrapError`, :class:`~trio_pd.ConfigurationError`
    for a host off loopback without a token...).
    """

    def __init__(
        self, host: str, port: int, *, thread: sync.TrioThread | None = None, **kwargs: Any
    ) -> None:
        problem = shared_token_problem(kwargs, "SGLang bootstrap service")
        if problem is not None:
            raise problem
        self._server = sync.open_bootstrap_server(host=host, port=port, thread=thread,
                                                  **kwargs)
        self.host: str = self._server.server.host
        self.port: int = self._server.server.port
        self.url: str = self._server.url

    def close(self) -> None:
        """Stop the service (and its trio thread if it has its own). Idempotent."""
        self._server.close()


# ---------------------------------------------------------------------------------- the plugin


def sglang_plugin() -> None:
    """SGLang's general plugin hook for trio_pd (entry point ``trio_pd`` of the group
    ``sglang.srt.plugins``, which SGLang loads in each of its processes): with
    ``TRIO_PD_SGLANG=1`` in the environment it makes SGLang's class mapping
    (``sglang.srt.disaggregation.utils.get_kv_class``) answer this module's
    :class:`KVManager`, :class:`KVSender`, :class:`KVReceiver` and
    :class:`KVBootstrapServer` for the transfer backends trio_pd runs over (``mooncake``,
    ``nixl``: ``--disaggregation-transfer-backend`` still picks the engine); SGLang's own
    ``KVArgs`` stays. It also sets ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_
    TIMEOUT=inf`` where it is unset (:func:`check_server_args` says why). Without the
    variable it does nothing, so installing trio_pd beside SGLang changes nothing by itself.
    """
    if not _env_flag(os.environ, PLUGIN_ENV, False):
        return
    os.environ.setdefault(DEFERRED_RELEASE_TIMEOUT_ENV, "inf")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", get_kv_class, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.utils.setup_state_kv_args", with_decode_heads,
        HookType.AROUND,
    )


def with_decode_heads(original: Callable[..., Any], kv_args: Any, token_to_kv_pool: Any,
                      *args: Any, **kwargs: Any) -> Any:
    """SGLang's ``setup_state_kv_args`` (which both schedulers call on their ``KVArgs``
    right before building the manager), then, where SGLang left them unset (its decode
    scheduler does), ``kv_head_num`` from the pool's ``head_num`` and
    ``total_kv_head_num`` as that times the attention TP size: trio_pd's decode pool
    needs its heads to pair with a prefill rank's head slices. (With GQA replication,
    more decode ranks than KV heads, that total is too large; see docs/sglang.md.)"""
    result = original(kv_args, token_to_kv_pool, *args, **kwargs)
    heads = getattr(token_to_kv_pool, "head_num", None)
    if isinstance(heads, int) and getattr(kv_args, "kv_head_num", None) is None:
        kv_args.kv_head_num = heads
        if getattr(kv_args, "total_kv_head_num", None) is None:
            from sglang.srt.runtime_context import get_parallel

            kv_args.total_kv_head_num = heads * int(get_parallel().attn_tp_size)
    return result


#: SGLang's ``KVClassType`` values -> the adapter's classes
_CLASSES: Final[Mapping[str, type]] = {
    "manager": KVManager, "sender": KVSender, "receiver": KVReceiver,
    "bootstrap_server": KVBootstrapServer,
}


def get_kv_class(original: Callable[[Any, Any], Any], transfer_backend: Any,
                 class_type: Any) -> Any:
    """SGLang's ``get_kv_class(transfer_backend, class_type)`` with trio_pd's classes for
    the backends trio_pd runs over (:func:`sglang_plugin` installs it around SGLang's own,
    ``original``): the manager, sender, receiver and bootstrap server; ``KVArgs`` and every
    other backend are SGLang's."""
    backend = str(getattr(transfer_backend, "value", transfer_backend))
    chosen = _CLASSES.get(str(getattr(class_type, "value", class_type)))
    if backend in ENGINE_NAMES and chosen is not None:
        return chosen
    return original(transfer_backend, class_type)
