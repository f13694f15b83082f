"""Hosting the agents on trio threads (trio_pd.sync), driven from plain threads: a
bootstrap service, a prefill and a decode facade over real engines; waiting on a plain thread;
and the books and the aborting thread of a scheduler test (the SGLang adapter's tests use
them too)."""

from __future__ import annotations

import collections
import heapq
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio_pd.sync as sync
from trio_pd import KVPoll
from trio_pd.engines import make_engine
from trio_pd.testing.pools import HostKVPool

from .agents import host_pool

#: bound on every wait for something that must happen (seconds)
BOUND = 20.0


def poll_until(pred: Callable[[], bool], bound: float = BOUND) -> None:
    """Wait, on this plain thread, until ``pred()``; AssertionError after ``bound`` s."""
    deadline = time.monotonic() + bound
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


@dataclass
class Agents:
    boot: sync.SyncBootstrapServer
    prefill: sync.SyncPrefill
    decode: sync.SyncDecode
    src: HostKVPool
    dst: HostKVPool


@contextmanager
def agents(
    engine_name: str = "mooncake",
    *,
    wrap: Callable[[Any], Any] | None = None,
    shared: bool = False,
    num_pages: int = 64,
    aux_slots: int = 16,
    prefill_kw: dict[str, Any] | None = None,
    decode_kw: dict[str, Any] | None = None,
) -> Iterator[Agents]:
    """A bootstrap service, a prefill and a decode facade, each on its own trio thread (or,
    ``shared``, all on one), over two real engines; the engines close last."""
    src, dst = host_pool(num_pages=num_pages, aux_slots=aux_slots), host_pool(
        num_pages=num_pages, aux_slots=aux_slots
    )
    with ExitStack() as stack:
        pe = stack.enter_context(make_engine(engine_name))
        de = stack.enter_context(make_engine(engine_name))
        thread = stack.enter_context(sync.TrioThread("test-shared")) if shared else None
        boot = stack.enter_context(sync.open_bootstrap_server(thread=thread))
        prefill = stack.enter_context(sync.open_prefill(
            engine=wrap(pe) if wrap else pe, pool=src.spec, bootstrap_url=boot.url,
            kv_heads=2, thread=thread, **(prefill_kw or {}),
        ))
        decode = stack.enter_context(
            sync.open_decode(engine=de, pool=dst.spec, thread=thread, **(decode_kw or {}))
        )
        yield Agents(boot, prefill, decode, src, dst)


@dataclass
class Books:
    """What the threads report, for the checks at the end."""

    errors: list[BaseException] = field(default_factory=list)
    handles: queue.SimpleQueue[tuple[str, Any, Any]] = field(
        default_factory=queue.SimpleQueue
    )
    aborted: set[int] = field(default_factory=set)
    #: what the aborted handles' poll() said just before the abort
    abort_points: collections.Counter[str] = field(default_factory=collections.Counter)
    prefill_outcome: dict[int, KVPoll] = field(default_factory=dict)
    decode_outcome: dict[int, KVPoll] = field(default_factory=dict)
    prefill_popped: collections.Counter[int] = field(default_factory=collections.Counter)
    decode_popped: collections.Counter[int] = field(default_factory=collections.Counter)
    #: decode rooms given pages by init
    decode_inited: set[int] = field(default_factory=set)
    verified: int = 0
    corrupt: int = 0
    done: threading.Event = field(default_factory=threading.Event)


def guarded(books: Books, fn: Callable[..., None], *args: Any) -> Callable[[], None]:
    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:
            books.errors.append(exc)
            books.done.set()

    return run


def _abort(handle: Any) -> None:
    """The default abort of :func:`aborter`."""
    handle.abort("aborted by the test's second thread")


def aborter(books: Books, abort: Callable[[Any], None] = _abort) -> None:
    """The second thread: aborts the planned requests a little after their handle exists,
    with ``abort(handle)`` (any books with ``handles``, ``done``, ``abort_points`` and
    ``aborted``: the SGLang adapter's test uses it too)."""
    due: list[tuple[float, int, Any]] = []
    while not books.done.is_set() or due:
        try:
            side, req, handle = books.handles.get(timeout=0.002)
            if req.abort == side:
                heapq.heappush(due, (time.monotonic() + req.abort_after, req.index, handle))
        except queue.Empty:
            pass
        while due and due[0][0] <= time.monotonic():
            _, _index, handle = heapq.heappop(due)
            books.abort_points[f"{type(handle).__name__} {handle.poll().name}"] += 1
            abort(handle)
            books.aborted.add(handle.room)
