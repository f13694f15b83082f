"""SGLang 0.5.23's own PD scheduler queues move requests through trio_pd, with aborts on
both sides, every byte checked, no page leaked or freed before the drain, no late write
(tests/sglang/harness.py says what stands in for the rest of SGLang)."""

from __future__ import annotations

import random
import time

import pytest

from .harness import LAYERS, PAGE, Cluster, Req, cluster, forward, received, release

pytestmark = pytest.mark.timeout(180)


def _step_prefill(c: Cluster) -> list[Req]:
    """One prefill scheduler step, as SGLang's event loop makes it: pop what finished
    bootstrapping, run it (the stand-in forward), send its KV as the batch result does,
    poll the inflight queue."""
    ps = c.prefill
    bq = ps.disagg_prefill_bootstrap_queue
    ps.waiting_queue.extend(bq.pop_bootstrapped())
    for req in ps.waiting_queue:
        forward(c, req)
        ps.checkpoint_disagg_prefill = lambda r: None  # (no prefix cache here)
        ps.disagg_prefill_inflight_queue.append(req)
        if req.tokens > 2 * PAGE and req.bootstrap_room % 2:  # chunked: a first part
            ps.send_kv_chunk(req, last_chunk=False, end_idx=2 * PAGE)
        ps.send_kv_chunk(req, last_chunk=True)
    ps.waiting_queue = []
    return ps.process_disagg_prefill_inflight_queue()


def test_sglang_queues_move_verified_requests_with_aborts(
    engine_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(25)
    n = 40
    with cluster(engine_name, monkeypatch) as c:
        mgr = c.decode_prealloc.kv_manager
        freed_unsafe: list[int] = []
        real_free = c.d.pages.free

        def free(pages: list[int]) -> None:  # decode pages go back: only after the drain
            for dr in list(c.decode_transfer.queue) + [e[0] for e in
                                                      c.decode_transfer._deferred_releases]:
                if dr.req.pages == pages and not mgr.is_abort_release_safe(
                    dr.req.bootstrap_room, 1
                ):
                    freed_unsafe.append(dr.req.bootstrap_room)
            real_free(pages)

        c.d.pages.free = free  # type: ignore[method-assign]
        plan = []
        for _ in range(n):
            room = next(c.rooms)
            tokens = rng.randrange(1, 40)
            what = rng.choice(["ok"] * 5 + ["abort_decode", "abort_prefill", "abort_boot"])
            plan.append((room, tokens, what))
        outcome: dict[int, str] = {}
        pending = list(plan)
        d_reqs: dict[int, Req] = {}
        p_reqs: dict[int, Req] = {}
        deadline = time.monotonic() + 30
        while pending or c.decode_prealloc.queue or c.decode_transfer.queue or (
            c.decode_transfer._deferred_releases
        ) or c.prefill.disagg_prefill_inflight_queue or (
            c.prefill.disagg_prefill_bootstrap_queue.queue
        ):
            assert time.monotonic() < deadline, f"the queues did not drain: {_left(c)}"
            busy = (len(c.decode_prealloc.queue) + len(c.decode_transfer.queue)
                    + len(c.decode_transfer._deferred_releases)
                    + len(c.prefill.disagg_prefill_inflight_queue)
                    + len(c.prefill.disagg_prefill_bootstrap_queue.queue))
            while pending and busy < 8:
                busy += 1
                room, tokens, what = pending.pop(0)
                d = Req(rid=f"d{room}", bootstrap_room=room, tokens=tokens,
                        bootstrap_port=c.port)
                p = Req(rid=f"p{room}", bootstrap_room=room, tokens=tokens)
                d_reqs[room], p_reqs[room] = d, p
                c.decode_prealloc.add(d)
                c.prefill.disagg_prefill_bootstrap_queue.add(p, num_kv_heads=2)
                if what == "abort_boot":  # abort_request on the bootstrap queue
                    p.disagg_kv_sender.abort()
            # prefill
            for req in _step_prefill(c):
                outcome.setdefault(req.bootstrap_room, "prefill_done")
            for req in list(c.prefill.disagg_prefill_inflight_queue):
                if plan_of(plan, req.bootstrap_room) == "abort_prefill":
                    req.disagg_kv_sender.abort()  # abort_request on the inflight queue
            # decode
            pre, failed = c.decode_prealloc.pop_preallocated()
            c.decode_transfer.extend(pre)
            for dr in list(c.decode_transfer.queue):
                if plan_of(plan, dr.req.bootstrap_room) == "abort_decode":
                    dr.kv_receiver.abort()  # abort_request on the transfer queue
            for req in c.decode_transfer.pop_transferred():
                assert received(c, req), f"room {req.bootstrap_room}: wrong bytes"
                assert req.output_ids[-1] == req.bootstrap_room % 30000 + 1
                outcome[req.bootstrap_room] = "verified"
                release(c.d, req)  # (decoding ends, the request's pages go back)
            c.decode_transfer.resolve_deferred_releases()
            for dr in failed:
                outcome.setdefault(dr.req.bootstrap_room, "decode_failed")
            time.sleep(0.002)
        verified = sum(1 for o in outcome.values() if o == "verified")
        ok = [room for room, _, what in plan if what == "ok"]
        assert all(outcome.get(room) == "verified" for room in ok), outcome
        assert verified >= len(ok) > 0
        assert not freed_unsafe, f"decode pages freed before the drain: {freed_unsafe}"
        assert mgr.released_before_drain == 0
        for side in (c.p, c.d):
            assert side.pages.double_frees == 0
            assert len(side.pages.free_pages) == side.pages.total, "leaked pages"
        # no late write: every page is free now, and each still holds the poison (or
        # was never used)
        for buf in (*c.d.pool.k_buffer, *c.d.pool.v_buffer):
            for page in range(1, c.d.pages.total + 1):
                v = buf[page * PAGE:(page + 1) * PAGE]
                assert bool((v == 7.0).all()) or bool((v == 0).all()), f"late write, page {page}"
        # the adapter's decode rank has a landing area: scattered rooms land through it,
        # and every landing page is back once the queues drained
        stats = mgr.statistics()
        assert stats.rooms_landed > 0 and stats.landing_held == 0, stats
        print(f"verified {verified} of {n}; layers {LAYERS}; landed {stats.rooms_landed}, "
              f"landing_full {stats.landing_full}, landing_held {stats.landing_held}")


def plan_of(plan: list[tuple[int, int, str]], room: int) -> str:
    return next(what for r, _, what in plan if r == room)


def _left(c: Cluster) -> str:
    """What each queue still holds, with its poll, for a failure message."""
    pq, tq = c.decode_prealloc.queue, c.decode_transfer.queue
    iq = c.prefill.disagg_prefill_inflight_queue
    bq = c.prefill.disagg_prefill_bootstrap_queue.queue
    return (
        f"prealloc {[(d.req.bootstrap_room, d.kv_receiver.poll()) for d in pq]} "
        f"transfer {[(d.req.bootstrap_room, d.kv_receiver.poll()) for d in tq]} "
        f"deferred {len(c.decode_transfer._deferred_releases)} "
        f"inflight {[(r.bootstrap_room, r.disagg_kv_sender.poll()) for r in iq]} "
        f"bootstrap {[(r.bootstrap_room, r.disagg_kv_sender.poll()) for r in bq]}"
    )
