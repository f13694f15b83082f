"""SGLang 0.5.23's own PD scheduler queues on CPU, with no model: the prefill bootstrap
queue and the scheduler's prefill methods (``send_kv_chunk``, the inflight queue), the
decode prealloc and transfer queues, each built by its own ``__init__`` from the
installed SGLang and polling through SGLang's ``poll_and_all_reduce`` helpers (a one-rank
gloo group), over ``trio_pd.compat.sglang``'s classes.

What stands in for the rest of SGLang here, and only that: the process-wide configuration
(``get_parallel`` / ``get_disagg``... return the few fields these queues read), the
scheduler object (the attributes the queues read), the requests (the fields the queues
read and write), a page allocator (:class:`Pages`, which also counts what is freed twice
or leaked) and the prefix cache calls (``release_kv_cache`` frees the request's pages).
The KV pool is SGLang's real ``MHATokenToKVPool`` on CPU, and the metadata buffers SGLang's
``MetadataBuffers``; a "forward pass" writes each token's K and V bytes from the request's
room (:func:`token_bytes`), so decode can check every byte it received.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from sglang.srt import runtime_context
from sglang.srt.disaggregation import decode as sg_decode
from sglang.srt.disaggregation import prefill as sg_prefill
from sglang.srt.disaggregation import utils as sg_utils
from sglang.srt.disaggregation.utils import (
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    TransferBackend,
)
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

from trio_pd.compat import sglang as adapter

PAGE = 4  # tokens a page
HEADS, HEAD_DIM, LAYERS = 2, 8, 2
TOKENS = 256  # tokens each side's pool holds
MAX_REQS = 16


def token_bytes(room: int, tokens: int) -> torch.Tensor:
    """The K (or V) values a "forward pass" writes for a request's tokens: a function of
    the room and the token, so a misplaced or stale page shows."""
    rng = np.random.default_rng(room % (1 << 32))
    return torch.from_numpy(
        rng.standard_normal((tokens, HEADS, HEAD_DIM)).astype(np.float16)
    )


class _NoOps:
    """Time stats, metrics, trace contexts: SGLang records; nothing is checked here."""

    def __getattr__(self, name: str) -> _NoOps:
        return _NoOps()

    def __call__(self, *a: Any, **k: Any) -> None:
        return None


class Pages:
    """A page allocator over a pool: page ids ``1..n`` (SGLang keeps page 0 as padding),
    each page's tokens are ``page * PAGE ..``. Counts double frees, and freed pages are
    poisoned so a late write or a stale read shows."""

    def __init__(self, pool: MHATokenToKVPool, pages: int) -> None:
        self.pool = pool
        self.free_pages = list(range(1, pages))
        self.total = len(self.free_pages)
        self.double_frees = 0
        self.page_size = PAGE

    def alloc(self, n: int) -> list[int] | None:
        if len(self.free_pages) < n:
            return None
        taken, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return taken

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p in self.free_pages:
                self.double_frees += 1
                continue
            for buf in (*self.pool.k_buffer, *self.pool.v_buffer):
                buf[p * PAGE:(p + 1) * PAGE] = 7.0  # poison
            self.free_pages.append(p)

    def available_size(self) -> int:
        return len(self.free_pages) * PAGE

    def translate_kv_indices_for_transfer(self, ids: torch.Tensor) -> torch.Tensor:
        return ids  # (no unified memory: virtual ids are physical)

    def get_kvcache(self) -> MHATokenToKVPool:
        return self.pool


@dataclass
class Req:
    """The fields of SGLang's ``Req`` the PD queues read and write."""

    rid: str
    bootstrap_room: int
    tokens: int
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int | None = None
    disagg_prefill_dp_rank: int | None = None
    output_ids: list[int] = field(default_factory=list)
    metadata_buffer_index: int = -1
    pending_bootstrap: bool = False
    prefill_attempt_count: int = 0
    is_retracted: bool = False
    start_send_idx: int = 0
    disagg_decode_prefix_len: int = 0
    extend_end: int = 0
    finished_reason: Any = None
    to_finish: Any = None
    cached_tokens: int = 0
    cached_tokens_device: int = 0
    cached_tokens_host: int = 0
    cached_tokens_storage: int = 0
    return_logprob: bool = False
    return_sampling_mask: bool = False
    return_routed_experts: bool = False
    hidden_states_tensor: Any = None
    discard_output_reason: Any = None
    cache_request_handle: Any = None
    swa_branching_seqlen: Any = None
    inflight_middle_chunks: int = 0
    pd_rebootstrap_forced_output_id: Any = None
    priority: int = 0
    lora_id: Any = None
    lock: Any = None
    #: the harness's own: this side's pages of the request
    pages: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.origin_input_ids = list(range(self.tokens))
        self.sampling_params = SimpleNamespace(max_new_tokens=8)
        self.time_stats = _NoOps()
        self.kv = SimpleNamespace(req_pool_idx=None, holds_kv=False, holds_mamba=False,
                                  retraction_backup=None, cache_protected_len=0,
                                  kv_committed_len=0)
        self.logprob = SimpleNamespace()

    @property
    def seqlen(self) -> int:
        return self.tokens + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def get_mm_token_counts(self) -> tuple[int, int, int]:
        return 0, 0, 0


def _config(**disagg: Any) -> dict[str, Any]:
    """The process-wide configuration accessors, with the fields these queues read."""
    group = dist.group.WORLD
    parallel = SimpleNamespace(
        tp_rank=0, pp_rank=0, pp_size=1, dp_rank=0, attn_tp_size=1, attn_tp_rank=0,
        attn_tp_group=SimpleNamespace(cpu_group=group), pp_group=None,
        enable_dsa_cache_layer_split=False,
    )
    d = SimpleNamespace(
        disaggregation_enable_kv_checksum=False, optimistic_prefill_attempts=0,
        disaggregation_decode_allocation_policy="early",
        disaggregation_decode_host_receive_threshold=1.0,
        disaggregation_decode_enable_radix_cache=False, disaggregation_ib_device=None,
        disaggregation_transfer_backend="mooncake", disaggregation_bootstrap_port=None,
        disaggregation_decode_retraction_backup="none",
    )
    for k, v in disagg.items():
        setattr(d, k, v)
    return {
        "get_parallel": lambda: parallel,  # (also trio_pd's plugin hook reads it)
        "get_disagg": lambda: d,
        "get_device": lambda: SimpleNamespace(gpu_id=0),
        "get_schedule": lambda: SimpleNamespace(chunked_prefill_size=8192),
        "get_memory": lambda: SimpleNamespace(disable_radix_cache=True),
    }


def _install(mp: pytest.MonkeyPatch, sides: dict[str, Side], **disagg: Any) -> None:
    """Point SGLang's module-level accessors at the stand-ins (for the test only)."""
    for name, fn in _config(**disagg).items():
        for mod in (sg_prefill, sg_decode, sg_utils, runtime_context):
            if hasattr(mod, name):
                mp.setattr(mod, name, fn)

    def release_kv_cache(req: Req, tree_cache: Any, checkpoint: bool = False) -> None:
        release(sides[tree_cache.side], req)

    for mod in (sg_prefill, sg_decode):
        mp.setattr(mod, "release_kv_cache", release_kv_cache)
    mp.setattr(sg_decode, "ensure_mamba_capacity", lambda *a, **k: True)


class _Tree:
    """The prefix cache the queues call into: ``finish`` / ``lock`` record nothing."""

    disable = True

    def __init__(self, side: str) -> None:
        self.side = side

    def __hash__(self) -> int:
        return hash(self.side)

    def __eq__(self, other: object) -> bool:
        return other == self.side or (isinstance(other, _Tree) and other.side == self.side)

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None

    def supports_mamba(self) -> bool:
        return False


def _scheduler(side: str, pool: MHATokenToKVPool, alloc: Pages, engine: str) -> Any:
    """The attributes of SGLang's ``Scheduler`` the PD queues read."""
    s = SimpleNamespace()
    s.server_args = SimpleNamespace(
        disaggregation_transfer_backend=engine, host="127.0.0.1", tp_size=1, dp_size=1,
        pp_size=1, enable_dp_attention=False, disaggregation_bootstrap_port=None,
    )
    s.tp_worker = SimpleNamespace(
        model_runner=SimpleNamespace(effective_logical_max_total_num_tokens=TOKENS,
                                     kv_cache_dtype_str="float16"),
        is_hybrid_swa=False,
    )
    s.kv_shard_widening = 1
    s.token_to_kv_pool_allocator = alloc
    s.rust_server = None
    s.model_config = SimpleNamespace(
        hf_text_config=SimpleNamespace(), num_hidden_layers=LAYERS,
        get_total_num_kv_heads=lambda: HEADS, hf_config=SimpleNamespace(),
    )
    s.req_to_token_pool = ReqToTokenPool(size=MAX_REQS, max_context_len=TOKENS,
                                         device="cpu", enable_memory_saver=False)
    s.tree_cache = _Tree(side)
    s.random_seed = 0
    s.output_streamer = SimpleNamespace(stream_output=lambda *a, **k: None)
    s.metrics_reporter = SimpleNamespace(enable_metrics=False, kv_transfer_latency_ms=0,
                                         kv_transfer_speed_gb_s=0)
    s.metrics_collector = _NoOps()
    s.batch_result_processor = _NoOps()
    s.scheduler_stage_metrics = _NoOps()
    s.running_batch = SimpleNamespace(reqs=[])
    s.waiting_queue = []
    s.enable_priority_scheduling = False
    s.enable_hisparse = False
    s.enable_lora = False
    s.enable_decode_hicache = False
    s.enable_overlap = False
    s.enable_staging = False
    s.spec_algorithm = SimpleNamespace(is_none=lambda: True, is_eagle=lambda: False)
    s.attn_cp_cpu_group = dist.group.WORLD
    s.attn_tp_cpu_group = dist.group.WORLD
    s.disagg_decode_prealloc_queue = None
    s.processed_tokens_counter = 0
    s.chunked_req = None
    s.tp_size = 1
    return s


class PrefillScheduler(sg_prefill.SchedulerDisaggregationPrefillMixin):
    """SGLang's prefill scheduler methods (the mixin, unchanged) on the stand-in state."""

    def __init__(self, state: Any) -> None:
        self.__dict__.update(vars(state))

    def _release_aborted_request(self, req: Req) -> None:
        pass  # (the scheduler's own bookkeeping of an aborted request)


class DecodePrealloc(sg_decode.DecodePreallocQueue):
    """SGLang's decode prealloc queue; only its memory budgeting (which reads the radix
    cache, the SWA and Mamba pools this test has none of) is the stand-in allocator's."""

    def _check_if_req_exceed_kv_capacity(self, req: Any) -> bool:
        return False

    def _uses_swa_tail_prealloc(self) -> bool:
        return False

    def _uses_swa_reservation(self) -> bool:
        return False

    def _allocatable_token_budgets(self, *a: Any, **k: Any) -> int:
        return self.token_to_kv_pool_allocator.available_size()

    def _prealloc_reservation_fits(self, full: int, swa: int, **k: Any) -> bool:
        return self.token_to_kv_pool_allocator.available_size() >= full

    def _hicache_pending_restore_tokens(self) -> int:
        return 0

    def _pre_alloc(self, req: Any, *a: Any, **k: Any) -> torch.Tensor:
        idx = self.req_to_token_pool.alloc([req])
        assert idx is not None
        req.kv.req_pool_idx = idx[0]
        alloc: Pages = self.token_to_kv_pool_allocator
        got = alloc.alloc(-(-req.tokens // PAGE))
        assert got is not None
        req.pages = got
        req.kv.holds_kv = True
        tokens = torch.tensor([p * PAGE + t for p in got for t in range(PAGE)][: req.tokens])
        self.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, req.tokens)), tokens)
        return tokens


@dataclass
class Side:
    pool: MHATokenToKVPool
    pages: Pages
    state: Any


def _side(name: str, engine: str) -> Side:
    pool = MHATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.float16,
                            head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS,
                            device="cpu", enable_memory_saver=False)
    pages = Pages(pool, TOKENS // PAGE)
    return Side(pool, pages, _scheduler(name, pool, pages, engine))


def _metadata() -> tuple[ReqToMetadataIdxAllocator, MetadataBuffers]:
    return ReqToMetadataIdxAllocator(2 * MAX_REQS), MetadataBuffers(
        2 * MAX_REQS, hidden_size=16, hidden_states_dtype=torch.float32,
        max_sampling_mask_tokens=1,
    )


@dataclass
class Cluster:
    """One prefill rank and one decode rank as SGLang's scheduler builds them."""

    prefill: PrefillScheduler
    decode_prealloc: DecodePrealloc
    decode_transfer: sg_decode.DecodeTransferQueue
    p: Side
    d: Side
    boot: adapter.KVBootstrapServer
    port: int
    rooms: Iterator[int] = field(default_factory=lambda: itertools.count(0x5EED0001))


@contextmanager
def cluster(engine: str, mp: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """The bootstrap service, a prefill scheduler's queues and a decode scheduler's queues
    over ``engine``, through SGLang's class mapping with trio_pd's plugin hook."""
    if not dist.is_initialized():
        import tempfile

        store = dist.FileStore(tempfile.mktemp(prefix="trio_pd-sglang-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    mp.setenv(adapter.DEFERRED_RELEASE_TIMEOUT_ENV, "inf")
    backend = TransferBackend(engine)
    # SGLang's own class mapping, as the plugin makes it answer (sglang_plugin)
    original = sg_utils.get_kv_class

    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        return adapter.get_kv_class(original, transfer_backend, class_type)

    for mod in (sg_prefill, sg_decode, sg_utils):
        mp.setattr(mod, "get_kv_class", get_kv_class)
    setup = sg_utils.setup_state_kv_args

    def setup_state_kv_args(kv_args: Any, pool: Any, *a: Any, **k: Any) -> Any:
        return adapter.with_decode_heads(setup, kv_args, pool, *a, **k)

    for mod in (sg_prefill, sg_decode):
        mp.setattr(mod, "setup_state_kv_args", setup_state_kv_args)
    with ExitStack() as stack:
        boot = get_kv_class(backend, sg_utils.KVClassType.BOOTSTRAP_SERVER)(
            host="127.0.0.1", port=0)
        stack.callback(boot.close)
        p, d = _side("prefill", engine), _side("decode", engine)
        for side in (p, d):
            side.state.server_args.disaggregation_bootstrap_port = boot.port
        _install(mp, {"prefill": p, "decode": d})
        # prefill: the scheduler's init_disaggregation, prefill branch
        ps = p.state
        ps.req_to_metadata_buffer_idx_allocator, ps.disagg_metadata_buffers = _metadata()
        ps.disagg_prefill_bootstrap_queue = sg_prefill.PrefillBootstrapQueue(
            token_to_kv_pool=p.pool, draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=ps.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=ps.disagg_metadata_buffers, gpu_id=0, bootstrap_port=boot.port,
            max_total_num_tokens=TOKENS, scheduler=ps, scheduler_stage_metrics=_NoOps(),
            transfer_backend=backend,
        )
        stack.callback(ps.disagg_prefill_bootstrap_queue.kv_manager.close)
        ps.disagg_prefill_inflight_queue = []
        ps.disagg_prefill_pending_chunk_rids = set()
        ps.kv_checksum_computer = None
        prefill = PrefillScheduler(ps)
        prefill.disagg_prefill_bootstrap_queue.scheduler = prefill
        # decode: the scheduler's init_disaggregation, decode branch
        ds = d.state
        ds.req_to_metadata_buffer_idx_allocator, ds.disagg_metadata_buffers = _metadata()
        transfer = sg_decode.DecodeTransferQueue(
            req_to_metadata_buffer_idx_allocator=ds.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=ds.disagg_metadata_buffers, scheduler=ds,
            tree_cache=ds.tree_cache,
        )
        prealloc = DecodePrealloc(
            req_to_token_pool=ds.req_to_token_pool, token_to_kv_pool_allocator=d.pages,
            draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=ds.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=ds.disagg_metadata_buffers, scheduler=ds,
            transfer_queue=transfer, tree_cache=ds.tree_cache, gpu_id=0,
            bootstrap_port=boot.port, max_total_num_tokens=TOKENS,
            num_reserved_decode_tokens=0, transfer_backend=backend,
        )
        stack.callback(prealloc.kv_manager.close)
        ds.disagg_decode_prealloc_queue = prealloc
        ds.disagg_decode_transfer_queue = transfer
        yield Cluster(prefill, prealloc, transfer, p, d, boot, boot.port)


def forward(c: Cluster, req: Req) -> None:
    """The prefill "forward pass": pages for the request, its KV written token by token,
    its first output token."""
    ps = c.prefill
    idx = ps.req_to_token_pool.alloc([req])
    assert idx is not None
    req.kv.req_pool_idx = idx[0]
    got = c.p.pages.alloc(-(-req.tokens // PAGE))
    assert got is not None
    req.pages, req.kv.holds_kv = got, True
    slots = torch.tensor([p * PAGE + t for p in got for t in range(PAGE)][: req.tokens])
    ps.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, req.tokens)), slots)
    values = token_bytes(req.bootstrap_room, req.tokens)
    for layer in range(LAYERS):
        c.p.pool.k_buffer[layer][slots] = values + layer
        c.p.pool.v_buffer[layer][slots] = -values - layer
    req.output_ids.append(req.bootstrap_room % 30000 + 1)
    req.extend_end = req.tokens


def received(c: Cluster, req: Req) -> bool:
    """Whether decode's pages hold the request's every K and V byte."""
    slots = c.d.state.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.tokens]
    values = token_bytes(req.bootstrap_room, req.tokens)
    return all(
        torch.equal(c.d.pool.k_buffer[layer][slots], values + layer)
        and torch.equal(c.d.pool.v_buffer[layer][slots], -values - layer)
        for layer in range(LAYERS)
    )


def release(side: Side, req: Req) -> None:
    """A request's pages and request slot go back (SGLang's ``release_kv_cache``)."""
    if req.kv.holds_kv:
        side.state.req_to_token_pool.free(req)
        side.pages.free(req.pages)
        req.pages = []
        req.kv.holds_kv = False


def aborted(reason: str = "Aborted by AbortReq.") -> FINISH_ABORT:
    return FINISH_ABORT(reason)
