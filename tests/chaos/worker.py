"""One rank of the chaos suite in its own OS process, driven line by line by the test.

The test is the router: it writes one JSON command a line on this process's stdin, and
reads JSON events (lines starting ``CHAOS ``) from its stdout. Unlike the demo's ``_worker``
(a fixed plan run to the end), this rank serves requests as they are announced, so a rank
killed mid-run can be restarted and served new requests while its peer keeps running.

Pools are guarded and poisoned: the allocator hands out only the middle rows of the KV pool
and of the aux rows; the rows before and after (never registered for any room, but inside the
engine's registered region) hold :data:`GUARD_POISON` and must still hold it at the end. Freed
rows are poisoned by :class:`~trio_pd.testing.pools.PageAllocator`, whose sanitizer counts
late writes. Every page release says on what proof it happened, read from the agent's
counters at that instant (the release callback runs synchronously inside the agent):

- decode: ``success`` (the request succeeded and the test handed the pages back),
  ``gone`` (``released_peer_gone``: the writer was proven gone), ``timeout``
  (``released_by_timeout``; never with the default drain policy) or ``ack`` (a drain ack);
- prefill: ``success`` / ``completed`` (the room's engine calls all returned),
  ``quarantine`` (a failed call's quarantine ended: the peer answered a probe after the
  engine's deadline, or was proven gone: ``peers_lost`` tells which).

Commands: ``{"cmd": "req", "i", "room", "epoch", "pages", "chunks", "gap"}``,
``{"cmd": "drain", "bound"}`` (wait until every row is back, then print the final report),
``{"cmd": "stats"}``, ``{"cmd": "exit"}``, ``{"cmd": "close_agent"}`` (close the agent but
keep the process and its engine: ``agent_closed`` once closed; later commands but ``req``
still work), and, for a prefill rank started with the option ``"fault": true`` (its engine
in a :class:`~trio_pd.engines.fault.FaultEngine`), ``{"cmd": "fault", "kind", "calls",
"delay", "min_blocks"}`` (the next ``calls`` writes get that fault, those of at least
``min_blocks`` blocks) and ``{"cmd": "late_done"}`` (wait
until the ``late`` faults' writes were made: ``late_done``). Run as
``python tests/chaos/worker.py ROLE BOOTSTRAP_URL HOST OPTIONS_JSON``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import trio
import trio.lowlevel

from trio_pd import DecodeConfig, KVPoll, PrefillConfig, open_decode, open_prefill
from trio_pd.core._errors import AdmissionClosed
from trio_pd.core._plan import chunk_ranges
from trio_pd.engines import make_engine
from trio_pd.engines.fault import Fault, FaultEngine
from trio_pd.testing.pools import DEST_POISON, SOURCE_POISON, HostKVPool, PageAllocator, page_rows
from trio_pd.tools._demo import RankResult, Request, _verify

GUARD_POISON = 0xA5
GUARD_ROWS = 4


def emit(ev: str, **fields: Any) -> None:
    print("CHAOS " + json.dumps({"ev": ev, "t": time.time(), **fields}), flush=True)


class Turns:
    """Requests take their pages in the order their commands came, as a scheduler's queue
    hands out memory. Without it, trio starts the tasks of a batch in no fixed order: with
    pools that hold two rooms, prefill and decode could give pages to different rooms first
    and each wait for the other's, until the bootstrap deadline failed them."""

    def __init__(self) -> None:
        self.next = 0
        self._ended: set[int] = set()
        self._moved = trio.Event()

    async def wait(self, turn: int) -> None:
        while self.next != turn:
            await self._moved.wait()

    def end(self, turn: int) -> None:
        """``turn`` has its pages, or will not wait for them (cancelled): the next goes."""
        self._ended.add(turn)
        while self.next in self._ended:
            self._ended.discard(self.next)
            self.next += 1
        self._moved.set()
        self._moved = trio.Event()


class Rank:
    def __init__(self, role: str, opts: dict[str, Any]) -> None:
        self.role = role
        self.opts = opts
        pages, slots = int(opts["pool_pages"]), int(opts["aux_slots"])
        self.pool = HostKVPool(
            layout="mha", num_pages=pages + 2 * GUARD_ROWS, num_layers=int(opts["layers"]),
            page_size=int(opts["page_size"]), head_bytes=int(opts["head_bytes"]),
            heads=int(opts["kv_heads"]), aux_slots=slots + 2 * GUARD_ROWS,
        )
        poison = SOURCE_POISON if role == "prefill" else DEST_POISON
        rows = page_rows(self.pool)
        g = GUARD_ROWS
        self.pages = PageAllocator(rows[g : g + pages], poison)
        if opts.get("random_pages"):  # rows handed out in a random order (scattered rooms)
            ids = self.pages.alloc_nowait(self.pages.capacity)
            assert ids is not None
            self.pages.free(np.random.default_rng(pages).permutation(ids))
        self.aux = PageAllocator(self.pool.aux[g : g + slots], poison)
        self.guards = [rows[:g], rows[g + pages :], self.pool.aux[:g], self.pool.aux[g + slots :]]
        for guard in self.guards:
            guard[...] = GUARD_POISON
        self.result = RankResult(role, 0)
        self.proofs: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.agent: Any = None
        #: the prefill rank's engine wrapper when started with opts ``fault`` (see command)
        self.fault: FaultEngine | None = None
        self.turns = Turns()
        self.arrived = 0  # requests commanded so far: the next one's turn

    async def take_pages(self, turn: int, n: int) -> tuple[Any, Any]:
        """``n`` page rows and an aux row, in the order the requests came."""
        try:
            await self.turns.wait(turn)
            rows = await self.pages.alloc(n)
            try:
                aux_rows = await self.aux.alloc(1)
            except BaseException:  # (cancelled waiting for an aux row: the rows go back)
                self.pages.free(rows)
                raise
        finally:
            self.turns.end(turn)
        return rows, aux_rows

    def guard_bytes_touched(self) -> int:
        return sum(int((g != GUARD_POISON).sum()) for g in self.guards)

    def proof(self, lost_before: int = 0) -> str:
        """Which counter moved since the previous release: the proof of this one (prefill: a
        quarantine ended by a peer proven gone if ``peers_lost`` grew since the room began)."""
        names = ("released_peer_gone", "released_by_timeout", "released_after_quarantine",
                 "acks_received")
        now = {n: self.agent.counters[n] for n in names}
        moved = {n for n in names if now[n] != self.last.get(n, 0)}
        self.last = now
        if self.role == "decode":
            if "released_peer_gone" in moved:
                return "gone"
            if "released_by_timeout" in moved:
                return "timeout"
            return "ack"
        if "released_after_quarantine" in moved:
            lost = self.agent.counters["peers_lost"] > lost_before
            return "quarantine_gone" if lost else "quarantine_alive"
        return "completed"

    def released(self, i: int, proof: str) -> None:
        self.proofs[proof] = self.proofs.get(proof, 0) + 1
        emit("released", i=i, proof=proof)

    async def prefill_one(self, cmd: dict[str, Any], turn: int) -> None:
        i, n = int(cmd["i"]), int(cmd["pages"])
        rows, aux_rows = await self.take_pages(turn, n)
        pages, aux = rows + GUARD_ROWS, aux_rows + GUARD_ROWS  # the pool's own ids
        self.pool.fill(pages, int(cmd["room"]))
        self.pool.fill_aux(int(aux[0]), int(cmd["room"]))
        sender: Any = None
        lost_before = self.agent.counters["peers_lost"]

        def release() -> None:
            self.pages.free(rows)
            self.aux.free(aux_rows)
            ok = sender is not None and sender.poll() is KVPoll.Success
            self.released(i, "success" if ok else self.proof(lost_before))

        sender = self.agent.sender(
            int(cmd["room"]), num_pages=n, aux_slot=int(aux[0]), on_release=release,
            epoch=int(cmd["epoch"]),
        )
        ranges = chunk_ranges(n, max(1, math.ceil(n / int(cmd.get("chunks", 1)))))
        for k, (a, b) in enumerate(ranges):
            if k:
                await trio.sleep(float(cmd.get("gap", 0.0)))  # the scheduler computes
            try:
                sender.send(pages[a:b], last=k == len(ranges) - 1)
            except AdmissionClosed:
                break
        with trio.move_on_after(float(self.opts["request_bound"])):
            status = await sender.wait()
            emit("done", i=i, status=status.name, failure=repr(sender.failure))
            return
        emit("done", i=i, status="HUNG", failure=None)

    async def decode_one(self, cmd: dict[str, Any], turn: int) -> None:
        i, n = int(cmd["i"]), int(cmd["pages"])
        rows, aux_rows = await self.take_pages(turn, n)
        pages, aux = rows + GUARD_ROWS, aux_rows + GUARD_ROWS  # the pool's own ids

        def release() -> None:
            self.pages.free(rows)
            self.aux.free(aux_rows)
            self.released(i, self.proof())

        receiver = self.agent.receiver(
            int(cmd["room"]), bootstrap_url=self.opts["url"], epoch=int(cmd["epoch"])
        )
        receiver.init(pages, int(aux[0]), on_release=release)
        with trio.move_on_after(float(self.opts["request_bound"])):
            status = await receiver.wait()
            if status is KVPoll.Success:
                req = Request(i, int(cmd["room"]), int(cmd["epoch"]), 0, None, n)
                before = self.result.corrupt_pages
                _verify(self.result, self.pool, pages, int(aux[0]), req)
                self.pages.free(rows)
                self.aux.free(aux_rows)
                self.released(i, "success")
                emit("done", i=i, status="Success", corrupt=self.result.corrupt_pages - before)
            else:
                emit("done", i=i, status=status.name, failure=repr(receiver.failure))
            return
        emit("done", i=i, status="HUNG", failure=None)

    def final(self) -> dict[str, Any]:
        late = (self.pages.late_writes + self.aux.late_writes + self.pages.late_in_free_rows()
                + self.aux.late_in_free_rows())
        return dict(
            late_writes=late, leaked=self.pages.outstanding + self.aux.outstanding,
            corrupt=self.result.corrupt_pages, source_uaf=self.result.source_uaf_pages,
            guard_bytes_touched=self.guard_bytes_touched(), proofs=self.proofs,
            stats=asdict(self.agent.statistics()),
        )

    async def serve(self, host: str) -> None:
        engine: Any = make_engine(self.opts.get("engine", "mooncake"), host=host)
        if self.role == "prefill" and self.opts.get("fault"):
            engine = self.fault = FaultEngine(engine)
        try:
            commands_tx, commands = trio.open_memory_channel[dict[str, Any]](math.inf)
            async with trio.open_nursery() as outer:
                outer.start_soon(_read_commands, commands_tx)
                if await self.serve_agent(engine, host, commands):
                    # the agent closed; this process and its engine live on
                    emit("agent_closed", stats=asdict(self.agent.statistics()))
                    async for cmd in commands:
                        if not await self.command(cmd):
                            break
                outer.cancel_scope.cancel()
        finally:
            engine.close()

    async def serve_agent(
        self, engine: Any, host: str, commands: trio.MemoryReceiveChannel[dict[str, Any]]
    ) -> bool:
        """Run the agent until ``exit`` (False) or ``close_agent`` (True: the caller keeps the
        process and the engine)."""
        if self.role == "prefill":
            cm: Any = open_prefill(
                engine=engine, pool=self.pool.spec, bootstrap_url=self.opts["url"],
                host=host, kv_heads=self.pool.spec.heads,
                config=PrefillConfig(**self.opts.get("prefill_config", {})),
            )
        else:
            cm = open_decode(
                engine=engine, pool=self.pool.spec, host=host,
                config=DecodeConfig(**self.opts.get("decode_config", {})),
            )
        async with cm as agent, trio.open_nursery() as nursery:
            self.agent = agent
            emit("ready", role=self.role, pid=os.getpid(), endpoint=agent.endpoint,
                 session=engine.session_id)
            one = self.prefill_one if self.role == "prefill" else self.decode_one
            async for cmd in commands:
                if cmd["cmd"] == "req":
                    nursery.start_soon(one, cmd, self.arrived)
                    self.arrived += 1
                elif cmd["cmd"] == "close_agent":
                    nursery.cancel_scope.cancel()
                    return True
                elif not await self.command(cmd):
                    break
            nursery.cancel_scope.cancel()
        return False

    async def command(self, cmd: dict[str, Any]) -> bool:
        """One command other than ``req``; False for ``exit``."""
        if cmd["cmd"] == "stats":
            emit("stats", stats=asdict(self.agent.statistics()))
        elif cmd["cmd"] == "drain":
            with trio.move_on_after(float(cmd.get("bound", 30))):
                await self.pages.wait_all_returned()
                await self.aux.wait_all_returned()
            emit("final", **self.final())
        elif cmd["cmd"] == "fault":  # the next ``calls`` writes get this fault
            assert self.fault is not None, "start the rank with opts fault=True"
            first = self.fault.statistics().calls
            kind, calls = cmd["kind"], int(cmd["calls"])
            delay = float(cmd.get("delay", 0.0))
            least = int(cmd.get("min_blocks", 0))  # (smaller writes, barriers say, go through)
            self.fault.policy = lambda i, _p, n: (
                Fault(kind, delay_s=delay) if first <= i < first + calls and n >= least
                else None
            )
        elif cmd["cmd"] == "late_done":  # every late write of a fault has been made
            assert self.fault is not None
            ok = await trio.to_thread.run_sync(self.fault.wait_late, 30.0)
            emit("late_done", ok=ok, blocks=self.fault.statistics().late_blocks)
        elif cmd["cmd"] == "exit":
            return False
        return True


async def _read_commands(tx: trio.MemorySendChannel[dict[str, Any]]) -> None:
    """One JSON command a line from stdin, until it closes."""
    async with tx:
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        buf = b""
        async for data in stdin:
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                await tx.send(json.loads(line))


def main() -> None:
    role, url, host, raw = sys.argv[1:5]
    opts = json.loads(raw)
    opts["url"] = url
    os.environ.setdefault("GLOG_minloglevel", "1")
    trio.run(Rank(role, opts).serve, host)
    # skip interpreter teardown (Mooncake's threads): the test has the final report
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
