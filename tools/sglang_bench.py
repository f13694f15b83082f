"""SGLang's own Mooncake connector against trio_pd's adapter, on one workload, in the shape
of SGLang's PD schedulers:

    nox -s sglang_bench                        # 3 alternated runs each, table on stdout
    nox -s sglang_bench -- --runs 5 --json out.json --plot docs/sglang-bench.png
    python tools/sglang_bench.py --quick       # in an environment that has SGLang 0.5.23

Each run starts two OS processes on loopback: a prefill rank (with the bootstrap server)
and a decode rank. Both build their connector the way SGLang's schedulers do: SGLang's
``ServerArgs`` published in its runtime context, SGLang's real ``MHATokenToKVPool`` and
``MetadataBuffers`` on CPU, ``KVArgs`` made by SGLang's own ``_init_kv_manager`` (of
``PrefillBootstrapQueue`` / ``DecodePreallocQueue``), the classes taken from SGLang's
``get_kv_class``, and SGLang's plugins loaded by ``load_plugins()``. The one difference
between the two connectors is the variable a deployment sets to switch: with
``TRIO_PD_SGLANG=1`` trio_pd's plugin makes ``get_kv_class`` answer
``trio_pd.compat.sglang``'s classes; without it, SGLang's ``MooncakeKVManager``,
``MooncakeKVSender``, ``MooncakeKVReceiver`` and ``MooncakeKVBootstrapServer``. Both run
the real Mooncake engine over loopback TCP (``MC_FORCE_TCP=1``).

The scheduler loop (the same code for both) makes the connector calls SGLang 0.5.23's
queues make, in their order, once per scheduler step (SGLang's functions named in
brackets):

* prefill: a new request makes its sender (``PrefillBootstrapQueue.create_sender``); each
  step polls the bootstrap queue (``pop_bootstrapped``, through SGLang's
  ``poll_and_all_reduce_attn_cp_tp_group``) and, on WaitingForInput, takes a metadata slot
  and calls ``init(num_pages, slot)``; then the request's chunks are "computed" one per step
  (``chunk_pages`` pages each: their KV bytes are written, the harness's work) and sent
  (``_send_kv_chunk``: ``get_max_transfer_tokens``, ``should_send_kv_chunk``, ``send(pages,
  state_indices, num_kv_tokens=)``, the metadata row written by ``MetadataBuffers.set_buf``
  before the last); the inflight queue is polled (``process_disagg_prefill_inflight_queue``)
  and a Success gives back pages and slot after ``get_transfer_metric()`` and ``clear()``.
* decode: a new request makes its receiver (``_create_receiver_and_enqueue``); pending ones
  are resolved (``_resolve_pending_reqs``: ``prefill_info_table.get``,
  ``try_ensure_parallel_info`` at most once a second, ``init(0)``); the prealloc queue is
  polled (``_update_handshake_waiters``) and, on WaitingForInput, pages and a metadata slot
  are allocated and ``send_metadata(pages, slot, None, decode_prefix_len=0)`` is called
  (``pop_preallocated``); the transfer queue is polled with SGLang's metadata gate
  (``pop_transferred``, ``poll_and_all_reduce``), and a Success is verified byte for byte
  (the harness's work), its pages and slot given back, ``clear()`` called.

Between steps the scheduler sleeps ``step_ms`` (where a real scheduler waits for the GPU's
forward pass). Pages are handed out in a shuffled order on both ranks (``--layout random``,
the default), so a request's pages are scattered: one block per page per buffer;
``--layout contiguous`` hands them out in order.

What is reported per connector, over the timed requests (after ``warmup`` untimed ones):
throughput (the KV bytes of the requests decode verified, over decode's wall time from the
first timed request to the last verified), and CPU per request on each rank: the process
(``time.process_time()``, every thread) less the harness's own work on the scheduler
thread (filling and verifying pages), split by thread: the scheduler thread (the loop
above, where SGLang's calls run), the connector's event loop and listener threads, its
transfer threads, and the threads that are not Python's (the engine's, by their kernel
name; ZeroMQ's apart). Also each request's median time in each stage of the loop, the load
average around each run, and every figure per run with the median and range over the
runs. ``--profile DIR`` records each rank with py-spy. The tool exits 1 if any request
failed or arrived corrupt.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

CONNECTORS = ("sglang", "trio_pd")
#: how each connector is named in the table and the plot
LABELS = {"sglang": "SGLang Mooncake classes", "trio_pd": "trio_pd.compat.sglang"}


@dataclass(frozen=True)
class Workload:
    """One run's requests, the same for both connectors."""

    requests: int = 200  # timed requests
    warmup: int = 8  # untimed requests before them (bootstrap, first connections)
    pages: int = 32  # pages per request
    chunk_pages: int = 8  # pages per chunk (one chunk per scheduler step)
    in_flight: int = 8  # requests each rank holds at once
    page_size: int = 16  # tokens per page
    heads: int = 8  # KV heads
    head_dim: int = 64  # fp16: 128 bytes per head per token, 16 KiB per page per buffer
    layers: int = 8  # K and V of each: 16 buffers
    pool_pages: int = 512  # pages each rank's pool holds
    step_ms: float = 1.0  # the scheduler's sleep between steps
    layout: str = "random"  # how pages are handed out: "random" (shuffled), "contiguous"
    seed: int = 25

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one buffer."""
        return self.page_size * self.heads * self.head_dim * 2

    @property
    def request_bytes(self) -> int:
        """KV bytes of one request, every buffer."""
        return self.pages * self.page_bytes * 2 * self.layers


# ------------------------------------------------------------------------------ the ranks


#: the cluster token both ranks of a run share (trio_pd's security is on by default; SGLang's
#: own connector has none to set)
_TOKEN = secrets.token_urlsafe(32)


def _sglang_env(connector: str) -> dict[str, str]:
    """What a rank's process runs with: loopback only, TCP, the switch, and one token."""
    env = dict(os.environ)
    env.setdefault("TRIO_PD_TOKEN", _TOKEN)
    env.update({
        "SGLANG_HOST_IP": "127.0.0.1",  # (SGLang's engine and sockets: never a NIC's address)
        "MC_FORCE_TCP": "1",
        "MOONCAKE_PROTOCOL": "tcp",
        "TRIO_PD_SGLANG": "1" if connector == "trio_pd" else "0",
    })
    return env


class _Req:
    """The fields of SGLang's ``Req`` that ``MetadataBuffers.set_buf`` reads."""

    def __init__(self, room: int, slot: int) -> None:
        self.bootstrap_room = room
        self.metadata_buffer_index = slot
        self.output_ids = [first_token(room)]
        self.cached_tokens = self.cached_tokens_device = 0
        self.cached_tokens_host = self.cached_tokens_storage = 0
        self.return_logprob = self.return_sampling_mask = False
        self.hidden_states_tensor = None

    def get_mm_token_counts(self) -> tuple[int, int, int]:
        return 0, 0, 0


def first_token(room: int) -> int:
    """The request's first output token, as prefill's metadata row carries it."""
    return room % 30011 + 1


class Rank:
    """One rank's process: SGLang's runtime context, pool, metadata buffers and connector
    (whichever ``get_kv_class`` answers), and the harness's page pattern."""

    def __init__(self, role: str, connector: str, port: int, work: Workload) -> None:
        self.role, self.connector, self.work = role, connector, work
        #: where the bootstrap server is (SGLang's ``{bootstrap_host}:{bootstrap_port}``)
        self.boot_addr = f"127.0.0.1:{port}"
        import warnings

        warnings.simplefilter("ignore")  # (SGLang's and torch's import-time warnings)
        _stand_in_torchvision()
        import logging

        logging.basicConfig(level=logging.WARNING)
        import numpy as np
        import torch
        import torch.distributed as dist
        from sglang.srt import runtime_context
        from sglang.srt.disaggregation import decode as sg_decode
        from sglang.srt.disaggregation import prefill as sg_prefill
        from sglang.srt.disaggregation import utils as sg_utils
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import ServerArgs

        self.np, self.sg_utils = np, sg_utils
        load_plugins()  # (trio_pd's plugin acts only with TRIO_PD_SGLANG=1)
        args = ServerArgs(
            model_path="sglang-bench", disaggregation_mode=role,
            disaggregation_transfer_backend="mooncake", host="127.0.0.1",
            disaggregation_bootstrap_port=port,
        )
        runtime_context.get_context().set_server_args(args)
        runtime_context.get_parallel().override_permanently(
            tp_rank=0, pp_rank=0, dp_rank=0, attn_tp_rank=0, attn_cp_rank=0,
            attn_dcp_rank=0, attn_dp_rank=0, pp_group=None,
        )
        store = dist.FileStore(tempfile.mktemp(prefix="sglang-bench-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        self.group = dist.group.WORLD
        backend = sg_utils.TransferBackend.MOONCAKE
        if connector == "sglang":  # (what SGLang's model runner does at start-up)
            from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
                init_mooncake_transfer_engine,
            )

            init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0)
        w = work
        self.pool = MHATokenToKVPool(
            size=w.pool_pages * w.page_size, page_size=w.page_size, dtype=torch.float16,
            head_num=w.heads, head_dim=w.head_dim, layer_num=w.layers, device="cpu",
            enable_memory_saver=False,
        )
        slots = 4 * w.in_flight
        self.metadata = sg_utils.MetadataBuffers(
            slots, hidden_size=16, hidden_states_dtype=torch.float32,
            max_sampling_mask_tokens=1,
        )
        self.slots = sg_utils.ReqToMetadataIdxAllocator(slots)
        model = _Ns(hf_text_config=_Ns(), num_hidden_layers=w.layers,
                    get_total_num_kv_heads=lambda: w.heads)
        scheduler = _Ns(
            rust_server=None, server_args=args, model_config=model, enable_hisparse=False,
            tp_worker=_Ns(model_runner=_Ns(kv_cache_dtype_str="float16")),
            req_to_token_pool=ReqToTokenPool(size=slots, max_context_len=w.pages * w.page_size,
                                             device="cpu", enable_memory_saver=False),
        )
        queue = _Ns(
            transfer_backend=backend, tp_rank=0, pp_rank=0, scheduler=scheduler,
            token_to_kv_pool=self.pool, draft_token_to_kv_pool=None, is_mla_backend=False,
            metadata_buffers=self.metadata, req_to_token_pool=scheduler.req_to_token_pool,
            enable_staging=False,
        )
        if role == "prefill":
            self.boot = sg_utils.get_kv_class(backend, sg_utils.KVClassType.BOOTSTRAP_SERVER)(
                host="127.0.0.1", port=port)
            self.manager = sg_prefill.PrefillBootstrapQueue._init_kv_manager(queue)
            self.sender_class = sg_utils.get_kv_class(backend, sg_utils.KVClassType.SENDER)
        else:
            self.manager = sg_decode.DecodePreallocQueue._init_kv_manager(queue)
            self.receiver_class = sg_utils.get_kv_class(backend, sg_utils.KVClassType.RECEIVER)
        self.class_name = type(self.manager).__module__ + "." + type(self.manager).__name__
        # the page pattern: buffer b's page j of room r holds words base[b] + key(r, j, b)
        buffers = [*self.pool.k_buffer, *self.pool.v_buffer]
        words = w.page_bytes // 8
        self.views = [b.view(torch.uint8).numpy().reshape(-1).view(np.uint64)
                      .reshape(-1, words) for b in buffers]
        rng = np.random.default_rng(w.seed)
        self.base = rng.integers(0, 2**63, size=(len(buffers), words), dtype=np.uint64)
        self.buffer_keys = rng.integers(0, 2**63, size=len(buffers), dtype=np.uint64)
        # a shuffled page allocator (page 0 is SGLang's padding page)
        free = list(range(1, w.pool_pages))
        if w.layout == "random":
            random.Random(f"{w.seed} {role}").shuffle(free)
        self.free_pages = deque(free)
        self.harness_s = 0.0  # thread CPU the scheduler thread spent on the harness's work
        self.profile: str | None = None  # (rank_main sets it)

    def alloc_pages(self, n: int) -> list[int]:
        return [self.free_pages.popleft() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self.free_pages.extend(pages)

    def _keys(self, room: int, first: int, n: int, b: int) -> Any:
        np = self.np
        j = np.arange(first, first + n, dtype=np.uint64)
        return np.uint64(room) * np.uint64(0x9E3779B97F4A7C15) + j * np.uint64(
            0xBF58476D1CE4E5B9) + self.buffer_keys[b]

    def fill(self, room: int, pages: list[int], first: int) -> None:
        """The "forward pass": pages ``pages`` (the request's ``first``.. ones) get their
        bytes in every buffer."""
        t = time.thread_time()
        for b, view in enumerate(self.views):
            view[pages] = self.base[b][None, :] + self._keys(room, first, len(pages), b)[:, None]
        self.harness_s += time.thread_time() - t

    def verify(self, room: int, pages: list[int], slot: int) -> bool:
        """Whether every byte of the request's pages and its metadata row arrived."""
        t = time.thread_time()
        ok = all(
            self.np.array_equal(view[pages], self.base[b][None, :]
                                + self._keys(room, 0, len(pages), b)[:, None])
            for b, view in enumerate(self.views)
        ) and int(self.metadata.output_ids[slot][0]) == first_token(room) and int(
            self.metadata.bootstrap_room[slot][0]) == room
        self.harness_s += time.thread_time() - t
        return ok

    def poll(self, handles: list[Any], decode_reqs: list[Any] | None = None) -> list[int]:
        """SGLang's polling helpers over a 1-rank group (the decode one with its metadata
        gate)."""
        if self.role == "prefill":
            return list(self.sg_utils.poll_and_all_reduce_attn_cp_tp_group(
                handles, self.group, self.group))
        return list(self.sg_utils.poll_and_all_reduce(
            handles, self.group, decode_reqs=decode_reqs, metadata_buffers=self.metadata))


class _Ns:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


@dataclass
class Flight:
    """One request on a rank."""

    room: int
    timed: bool
    handle: Any = None
    pages: list[int] = field(default_factory=list)
    slot: int = -1
    sent: int = 0  # prefill: pages sent
    # decode: what SGLang's metadata gate reads (``decode_req.req.bootstrap_room``...)
    metadata_buffer_index: int = -1
    #: when it entered each stage (perf_counter), for the stage times
    t: dict[str, float] = field(default_factory=dict)

    def mark(self, stage: str) -> None:
        self.t[stage] = time.perf_counter()

    @property
    def req(self) -> Flight:
        return self

    bootstrap_host = "127.0.0.1"


class Clock:
    """CPU of the process, of each Python thread and of the harness's work, from a start."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        if rank.profile:  # (py-spy writes its file when this process exits)
            subprocess.Popen(["py-spy", "record", "--threads", "--nonblocking", "--gil",
                              "-r", "100", "-f", "raw", "-o", rank.profile,
                              "-p", str(os.getpid())],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.harness = rank.harness_s
        self.wall = time.perf_counter()
        self.process = time.process_time()
        self.threads = _thread_cpu()

    def since(self) -> dict[str, Any]:
        now = _thread_cpu()
        per: dict[str, float] = {}
        for ident, (name, cpu) in now.items():
            before = self.threads.get(ident, (name, 0.0))[1]
            key = _thread_group(name)
            per[key] = per.get(key, 0.0) + cpu - before
        return {"wall_s": time.perf_counter() - self.wall,
                "process_s": time.process_time() - self.process, "threads_s": per,
                "harness_s": self.rank.harness_s - self.harness}


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """Every thread of this process by its Linux id: (name, CPU seconds). Python threads
    by their Python name and CPU clock; the others (the engine's, ZeroMQ's) by their
    kernel name and ``/proc`` ticks."""
    out: dict[int, tuple[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (f"native {comm}", (int(fields[11]) + int(fields[12])) / tick)
    for t in threading.enumerate():
        if t.ident is None or t.native_id is None:
            continue
        try:
            out[t.native_id] = (t.name, time.clock_gettime(time.pthread_getcpuclockid(t.ident)))
        except (OSError, ProcessLookupError):
            continue
    return out


def _thread_group(name: str) -> str:
    """Threads named by what they do (Python adds the target to unnamed threads)."""
    if name.startswith("native "):
        return "ZeroMQ I/O threads" if "ZMQbg" in name else "engine and other native threads"
    if name == "MainThread":
        return "scheduler"
    if name.startswith("trio_pd lane"):
        return "trio_pd lanes"
    if name.startswith("trio_pd"):
        return "trio_pd event loops"
    if name.startswith("Trio thread"):
        return "trio worker threads"
    if "(" in name and name.endswith(")"):
        return name[name.index("(") + 1:-1]  # "Thread-3 (transfer_worker)"
    return name.rstrip("0123456789_-")


#: what the plot shows: each thread group in one of these, in this order
KINDS = ("scheduler thread", "event loop and listener threads", "transfer threads",
         "engine's own threads", "other")
_LISTENERS = ("trio_pd event loops", "bootstrap_thread", "decode_thread", "HeartbeatChecker",
              "MooncakeFailedSessionProbe", "_run_server")
_TRANSFERS = ("trio_pd lanes", "transfer_worker", "ThreadPoolExecutor", "trio worker threads")


def _kind(group: str) -> str:
    """The kind of a thread group (:func:`_thread_group`)."""
    if group == "scheduler":
        return KINDS[0]
    if group in _LISTENERS:
        return KINDS[1]
    if group in _TRANSFERS or " from " in group:  # (trio names a worker by what it runs)
        return KINDS[2]
    if group == "engine and other native threads":
        return KINDS[3]
    return KINDS[4]


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Arrivals:
    """The requests arriving at a rank, in room order: the first ``warmup`` untimed; the
    timed part's :class:`Clock` starts with the first timed one."""

    def __init__(self, rank: Rank, rooms: list[int]) -> None:
        self.rank, self.rooms, self.todo = rank, rooms, deque(rooms)
        self.clock: Clock | None = None

    def admit(self, busy: int) -> list[Flight]:
        """The requests that arrive while the rank holds ``busy`` (and what arrives)
        below its ``in_flight``."""
        new = []
        while self.todo and busy + len(new) < self.rank.work.in_flight:
            room = self.todo.popleft()
            timed = len(self.rooms) - len(self.todo) > self.rank.work.warmup
            if timed and self.clock is None:
                self.clock = Clock(self.rank)
            new.append(Flight(room, timed))
            new[-1].mark("admitted")
        return new


def _say_why(f: Flight) -> None:
    """A failed room's reason, on this rank's stderr (the run's log file): the connector's
    ``failure_exception()`` raises it."""
    try:
        f.handle.failure_exception()
    except Exception as exc:  # (what the connector says, whatever its type)
        print(f"room {f.room} failed: {exc!r}", file=sys.stderr, flush=True)
    else:
        print(f"room {f.room} failed (no reason given)", file=sys.stderr, flush=True)


def run_prefill(rank: Rank, rooms: list[int]) -> dict[str, Any]:
    """SGLang's prefill scheduler loop over ``rooms`` (the first ``warmup`` untimed)."""
    w = rank.work
    arrivals = Arrivals(rank, rooms)
    boot: list[Flight] = []  # the bootstrap queue
    running: list[Flight] = []  # bootstrapped, chunks still to compute and send
    inflight: list[Flight] = []  # every chunk sent
    done_timed = 0
    failed = 0
    finished: list[Flight] = []
    left_timed = w.requests
    while left_timed:
        for f in arrivals.admit(len(boot) + len(running) + len(inflight)):
            f.handle = rank.sender_class(
                mgr=rank.manager, bootstrap_addr=rank.boot_addr,
                bootstrap_room=f.room, req_has_disagg_prefill_dp_rank=False,
            )
            boot.append(f)
        # pop_bootstrapped
        for f, poll in zip(list(boot), rank.poll([f.handle for f in boot]), strict=True):
            if poll == 2:  # WaitingForInput
                f.slot = rank.slots.alloc()
                f.mark("bootstrapped")
                f.handle.init(w.pages, f.slot)
                f.pages = rank.alloc_pages(w.pages)
                boot.remove(f)
                running.append(f)
            elif poll == 0:
                raise RuntimeError(f"room {f.room} failed in the bootstrap queue")
        # one chunk of each running request: computed, then sent (_send_kv_chunk)
        for f in list(running):
            n = min(w.chunk_pages, w.pages - f.sent)
            chunk = f.pages[f.sent:f.sent + n]
            rank.fill(f.room, chunk, f.sent)
            last = f.sent + n == w.pages
            state = None
            if last:
                rank.metadata.set_buf(_Req(f.room, f.slot))
                state = []  # (no state types: SGLang passes one entry per type)
            f.handle.get_max_transfer_tokens()
            if f.handle.should_send_kv_chunk(n, last):
                f.handle.send(rank.np.asarray(chunk, dtype=rank.np.int32), state,
                              num_kv_tokens=n * w.page_size)
            f.sent += n
            if last:
                running.remove(f)
                inflight.append(f)
                f.mark("sent")
        # process_disagg_prefill_inflight_queue
        for f, poll in zip(list(inflight), rank.poll([f.handle for f in inflight]),
                           strict=True):
            if poll in (4, 0):  # Success, Failed
                if poll == 4:
                    f.handle.get_transfer_metric()
                else:
                    failed += 1
                    _say_why(f)
                f.handle.clear()
                rank.free(f.pages)
                rank.slots.free(f.slot)
                inflight.remove(f)
                f.mark("done")
                if f.timed:
                    done_timed += 1
                    left_timed -= 1
                    finished.append(f)
        time.sleep(w.step_ms / 1000)
    assert arrivals.clock is not None
    return {**arrivals.clock.since(), "succeeded": done_timed - failed, "failed": failed,
            "stages_ms": _stages(finished, ["admitted", "bootstrapped", "sent", "done"])}


def run_decode(rank: Rank, rooms: list[int], bootstrap_addr: str) -> dict[str, Any]:
    """SGLang's decode scheduler loop over ``rooms`` (the first ``warmup`` untimed)."""
    w = rank.work
    mgr = rank.manager
    arrivals = Arrivals(rank, rooms)
    pending: list[Flight] = []  # receivers made, prefill DP rank not resolved
    prealloc: list[Flight] = []  # init(dp_rank) done, waiting for WaitingForInput
    transfer: list[Flight] = []  # send_metadata done
    verified = corrupt = failed = 0
    finished: list[Flight] = []
    last_ensure = -1e9
    left_timed = w.requests
    while left_timed:
        for f in arrivals.admit(len(pending) + len(prealloc) + len(transfer)):
            f.handle = rank.receiver_class(mgr=mgr, bootstrap_addr=bootstrap_addr,
                                           bootstrap_room=f.room)
            pending.append(f)
        # _resolve_pending_reqs: the prefill instance known, every request is DP rank 0
        if pending:
            known = mgr.prefill_info_table.get(bootstrap_addr) is not None
            now = time.monotonic()
            if not known and now - last_ensure >= 1.0:
                last_ensure = now
                known = mgr.try_ensure_parallel_info(bootstrap_addr)
            if known:
                for f in pending:
                    f.handle.init(0)
                    f.mark("resolved")
                prealloc.extend(pending)
                pending.clear()
        # _update_handshake_waiters + pop_preallocated
        for f, poll in zip(list(prealloc), rank.poll([f.handle for f in prealloc]),
                           strict=True):
            if poll == 2:
                f.mark("waiting")
                f.pages = rank.alloc_pages(w.pages)
                f.slot = f.metadata_buffer_index = rank.slots.alloc()
                f.handle.send_metadata(rank.np.asarray(f.pages, dtype=rank.np.int32),
                                       f.slot, None, decode_prefix_len=0)
                prealloc.remove(f)
                transfer.append(f)
            elif poll == 0:
                raise RuntimeError(f"room {f.room} failed in the prealloc queue")
        # pop_transferred
        for f, poll in zip(list(transfer), rank.poll([f.handle for f in transfer], transfer),
                           strict=True):
            if poll in (4, 0):
                if poll == 4 and rank.verify(f.room, f.pages, f.slot):
                    verified += f.timed
                elif poll == 4:
                    corrupt += 1
                else:
                    failed += 1
                    _say_why(f)
                f.handle.clear()
                rank.free(f.pages)
                rank.metadata.clear_slot(f.slot)
                rank.slots.free(f.slot)
                transfer.remove(f)
                f.mark("done")
                left_timed -= f.timed
                if f.timed:
                    finished.append(f)
        time.sleep(w.step_ms / 1000)
    assert arrivals.clock is not None
    return {**arrivals.clock.since(), "verified": verified, "corrupt": corrupt,
            "failed": failed,
            "stages_ms": _stages(finished, ["admitted", "resolved", "waiting", "done"])}


def _stages(flights: list[Flight], stages: list[str]) -> dict[str, float]:
    """The median time from each stage to the next over ``flights``, in ms."""
    out = {}
    for a, b in itertools.pairwise(stages):
        spans = [f.t[b] - f.t[a] for f in flights if a in f.t and b in f.t]
        if spans:
            out[f"{a}->{b}"] = round(1e3 * statistics.median(spans), 2)
    return out


def rank_main(argv: list[str]) -> None:
    """A rank's process (``--role``): set up, say READY, run, print one RESULT line."""
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--connector", choices=CONNECTORS, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--first-room", type=int, required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--profile", help="py-spy record this rank's timed part into this file")
    a = p.parse_args(argv)
    work = Workload(**json.loads(a.work))
    rank = Rank(a.role, a.connector, a.port, work)
    rank.profile = a.profile
    rooms = [a.first_room + i for i in range(work.warmup + work.requests)]
    _say("READY " + rank.class_name)
    if a.role == "prefill":
        result = run_prefill(rank, rooms)
    else:
        result = run_decode(rank, rooms, f"127.0.0.1:{a.port}")
    result["class"] = rank.class_name
    if a.connector == "trio_pd":
        stats = rank.manager.statistics()
        result["trio_pd"] = {k: getattr(stats, k) for k in (
            "succeeded", "failed", "engine_calls", "chunks_staged", "staging_full",
            "rooms_landed", "landing_full") if hasattr(stats, k)}
    _say("RESULT " + json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # (the connectors' daemon threads and engines go with the process)


def _stand_in_torchvision() -> None:
    """SGLang's configs import torchvision, which cannot load beside torch's CPU build;
    nothing on the PD path uses it (tests/sglang/conftest.py says more)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.sglang.standins import stand_in_torchvision

    stand_in_torchvision()


# ------------------------------------------------------------------------------ the runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Child:
    """A rank's process: its stdout read line by line on a thread, stderr to a file."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._err = log.open("w")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._err, env=env,
                                     text=True)
        self.lines: deque[str] = deque()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, prefix: str, deadline: float) -> str:
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise RuntimeError(f"{prefix.strip()} not seen (exit {self.proc.poll()}); the end of "
                           f"{self.log}:\n" + _tail(self.log))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._err.close()


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def one_run(connector: str, work: Workload, python: str, logs: Path, index: int,
            timeout: float, profile: str | None = None) -> dict[str, Any]:
    """One run of ``connector``: the prefill rank (and bootstrap server) first, then decode
    once prefill serves; each reports its RESULT line."""
    port = _free_port()
    first_room = random.Random(work.seed * 1000 + index).getrandbits(62) | 1
    base = [python, str(Path(__file__).resolve()), "_rank", "--connector", connector,
            "--port", str(port), "--first-room", str(first_room),
            "--work", json.dumps(asdict(work))]
    env = _sglang_env(connector)
    load = os.getloadavg()[0]
    deadline = time.monotonic() + timeout
    children: list[_Child] = []
    try:
        spy = (lambda role: ["--profile", f"{profile}/{index}-{connector}-{role}.txt"]
               ) if profile else (lambda role: [])
        prefill = _Child([*base, "--role", "prefill", *spy("prefill")], env,
                         logs / f"{index}-{connector}-p.log")
        children.append(prefill)
        prefill_class = prefill.wait_for("READY ", deadline)
        decode = _Child([*base, "--role", "decode", *spy("decode")], env,
                        logs / f"{index}-{connector}-d.log")
        children.append(decode)
        decode_class = decode.wait_for("READY ", deadline)
        d = json.loads(decode.wait_for("RESULT ", deadline))
        p = json.loads(prefill.wait_for("RESULT ", deadline))
    finally:
        for child in children:
            child.stop()
    r = summarize(connector, work, p, d, [prefill_class, decode_class])
    r["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]  # (before, after)
    return r


def _per_request_ms(rank: dict[str, Any], requests: int) -> dict[str, Any]:
    """A rank's CPU figures per request, in ms: the connector's share of the process (its
    CPU less the harness's work) and of the scheduler thread, and each thread group's."""
    threads = dict(rank["threads_s"])
    harness = rank["harness_s"]
    threads["scheduler"] = threads.get("scheduler", 0.0) - harness
    named = sum(threads.values())
    per = {name: round(1e3 * s / requests, 3) for name, s in sorted(threads.items())}
    per["unaccounted"] = round(1e3 * (rank["process_s"] - harness - named) / requests, 3)
    kinds = dict.fromkeys(KINDS, 0.0)
    for group, ms in per.items():
        kinds[_kind(group)] += ms
    return {
        "connector_ms": round(1e3 * (rank["process_s"] - harness) / requests, 3),
        "scheduler_ms": per["scheduler"],
        "harness_ms": round(1e3 * harness / requests, 3),
        "process_ms": round(1e3 * rank["process_s"] / requests, 3),
        "threads_ms": per,
        "kinds_ms": {k: round(v, 3) for k, v in kinds.items()},
    }


def summarize(connector: str, work: Workload, p: dict[str, Any], d: dict[str, Any],
              classes: list[str]) -> dict[str, Any]:
    n = work.requests
    return {
        "connector": connector,
        "classes": classes,
        "gb_per_s": round(d["verified"] * work.request_bytes / d["wall_s"] / 1e9, 4),
        "verified": d["verified"], "corrupt": d["corrupt"],
        "failed": d["failed"] + p["failed"],
        "decode_wall_s": round(d["wall_s"], 3),
        "stages_ms": {"prefill": p["stages_ms"], "decode": d["stages_ms"]},
        "prefill": _per_request_ms(p, n), "decode": _per_request_ms(d, n),
        "connector_ms": round(_per_request_ms(p, n)["connector_ms"]
                              + _per_request_ms(d, n)["connector_ms"], 3),
        "scheduler_ms": round(_per_request_ms(p, n)["scheduler_ms"]
                              + _per_request_ms(d, n)["scheduler_ms"], 3),
        # trio_pd's own counters, each rank's (landing pages: rooms_landed, chunks_staged)
        "trio_pd": {"prefill": p.get("trio_pd"), "decode": d.get("trio_pd")},
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and range of each figure per connector, and trio_pd's over SGLang's (medians;
    and per round, each trio_pd run over the SGLang run beside it)."""
    by = {c: [r for r in runs if r["connector"] == c] for c in CONNECTORS}
    figures = ("gb_per_s", "connector_ms", "scheduler_ms")
    out: dict[str, Any] = {}
    for c, rs in by.items():
        if rs:
            out[c] = {k: _spread([r[k] for r in rs]) for k in figures}
            for side in ("prefill", "decode"):
                out[c][side] = {k: _spread([r[side][k] for r in rs])
                                for k in ("connector_ms", "scheduler_ms", "harness_ms")}
    if by["sglang"] and by["trio_pd"]:
        out["trio_pd_over_sglang"] = {
            k: round(out["trio_pd"][k]["median"] / out["sglang"][k]["median"], 3)
            for k in figures
        }
        pairs = list(zip(by["sglang"], by["trio_pd"], strict=False))
        out["per_round"] = {
            k: [round(t[k] / s[k], 3) for s, t in pairs] for k in figures
        }
    return out


def table(result: dict[str, Any]) -> str:
    """The markdown table docs/bench.md shows."""
    cmp = result["summary"]
    rows = [
        ("throughput, GB/s of verified KV", "gb_per_s", None),
        ("CPU per request, both processes, ms", "connector_ms", None),
        ("... prefill process", "connector_ms", "prefill"),
        ("... decode process", "connector_ms", "decode"),
        ("scheduler thread per request, both ranks, ms", "scheduler_ms", None),
        ("... prefill", "scheduler_ms", "prefill"),
        ("... decode", "scheduler_ms", "decode"),
    ]
    have = [c for c in CONNECTORS if c in cmp]
    lines = ["| | " + " | ".join(LABELS[c] for c in have) + " | trio_pd / SGLang |",
             "|---|" + "---|" * (len(have) + 1)]
    for label, key, side in rows:
        cells = []
        for c in have:
            s = cmp[c][side][key] if side else cmp[c][key]
            cells.append(f"{s['median']:.3g} ({s['min']:.3g}-{s['max']:.3g})")
        ratio = ""
        if "trio_pd_over_sglang" in cmp:
            t, g = (cmp["trio_pd"][side], cmp["sglang"][side]) if side else (
                cmp["trio_pd"], cmp["sglang"])
            ratio = f"{t[key]['median'] / g[key]['median']:.2f}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Throughput and CPU per request, each run a dot, the bars medians; the CPU split by
    thread group on each rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    have = [c for c in CONNECTORS if any(r["connector"] == c for r in runs)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, c in enumerate(have):
        rs = [r for r in runs if r["connector"] == c]
        values = [r["gb_per_s"] for r in rs]
        ax1.bar(i, statistics.median(values), color=f"C{i}", alpha=0.6)
        ax1.plot([i] * len(values), values, "ko", ms=4)
    ax1.set_xticks(range(len(have)), [LABELS[c] for c in have], fontsize=8)
    ax1.set_ylabel("GB/s of verified KV (decode)")
    ax1.set_title("throughput (bar: median; dots: runs)", fontsize=9)
    x = 0.0
    ticks, names = [], []
    for c in have:
        rs = [r for r in runs if r["connector"] == c]
        for side in ("prefill", "decode"):
            bottom = 0.0
            for k, kind in enumerate(KINDS):
                v = statistics.median([r[side]["kinds_ms"][kind] for r in rs])
                ax2.bar(x, v, bottom=bottom, color=f"C{k}", label=kind if not ticks else None)
                bottom += v
            ax2.plot([x] * len(rs), [r[side]["connector_ms"] for r in rs], "ko", ms=4)
            ticks.append(x)
            names.append(f"{'SGLang' if c == 'sglang' else 'trio_pd'}\n{side}")
            x += 1
        x += 0.5
    ax2.set_xticks(ticks, names, fontsize=8)
    ax2.set_ylabel("CPU ms per request (harness's work excluded)")
    ax2.set_title("CPU per request by thread (bars: medians; dots: runs)", fontsize=9)
    ax2.legend(fontsize=7, loc="upper right", framealpha=0.9)
    w = result["workload"]
    fig.suptitle(
        f"SGLang harness shape, Mooncake over loopback TCP: {w['requests']} requests x "
        f"{w['pages']} pages x {w['page_size'] * w['heads'] * w['head_dim'] * 2 // 1024} KiB "
        f"x {2 * w['layers']} buffers, {w['chunk_pages']}-page chunks, {w['in_flight']} in "
        f"flight, {len([r for r in runs if r['connector'] == have[0]])} alternated runs each",
        fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_rank"]:
        rank_main(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs of each connector (3)")
    p.add_argument("--requests", type=int, help="timed requests per run (200)")
    p.add_argument("--quick", action="store_true", help="40 requests, 1 run each")
    p.add_argument("--layout", choices=["random", "contiguous"], default="random",
                   help="pages handed out shuffled (a request's pages scattered: one block "
                   "per page per buffer) or in order (a chunk is one block per buffer)")
    p.add_argument("--step-ms", type=float, help="the scheduler's sleep between steps (1)")
    p.add_argument("--connectors", default=",".join(CONNECTORS),
                   help="which to run, in each round's order (sglang,trio_pd)")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter of the SGLang environment the ranks run in")
    p.add_argument("--json", help="write every run and the summary here")
    p.add_argument("--plot", help="write the plot here (needs matplotlib)")
    p.add_argument("--replot", help="plot (and print the table of) an earlier --json file")
    p.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    p.add_argument("--profile", metavar="DIR",
                   help="record each rank's timed part with py-spy (--gil: the Python stacks "
                   "of the thread holding the GIL; py-spy on PATH) into DIR as collapsed stacks")
    a = p.parse_args(argv)
    if a.replot:
        result = json.loads(Path(a.replot).read_text())
        print(table(result))
        if a.plot:
            plot(result, a.plot)
        return 0
    work = Workload()
    if a.quick:
        work, a.runs = replace(work, requests=40), 1
    if a.requests:
        work = replace(work, requests=a.requests)
    work = replace(work, layout=a.layout)
    if a.step_ms is not None:
        work = replace(work, step_ms=a.step_ms)
    order = [c.strip() for c in a.connectors.split(",") if c.strip()]
    runs: list[dict[str, Any]] = []
    logs = Path(tempfile.mkdtemp(prefix="sglang-bench-"))
    for round_ in range(a.runs):
        # alternated: each round reverses the last one's order (A B, B A, A B...)
        for c in order if round_ % 2 == 0 else order[::-1]:
            print(f"round {round_ + 1}/{a.runs}: {c}", file=sys.stderr, flush=True)
            r = one_run(c, work, a.python, logs, len(runs), a.timeout, a.profile)
            print(f"  {r['gb_per_s']:.3f} GB/s, {r['connector_ms']:.1f} ms CPU per request "
                  f"({r['verified']} verified, {r['corrupt']} corrupt, {r['failed']} failed)",
                  file=sys.stderr, flush=True)
            if r["failed"] or r["corrupt"]:  # each rank's log says why (_say_why)
                for side in ("p", "d"):
                    log = logs / f"{len(runs)}-{c}-{side}.log"
                    print(f"  {log}:\n{_tail(log)}", file=sys.stderr, flush=True)
            runs.append(r)
    result = {"workload": asdict(work), "runs": runs, "summary": compare(runs),
              "load_average": os.getloadavg(), "cpus": os.cpu_count(), "logs": str(logs)}
    print(table(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if a.plot:
        plot(result, a.plot)
    bad = any(r["corrupt"] or r["failed"] or r["verified"] != work.requests for r in runs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
