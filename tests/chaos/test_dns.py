"""Chaos, scenario 9: a host name whose DNS never answers.

A network namespace whose resolver (``/etc/netns/NS/resolv.conf``, which ``ip netns exec``
mounts over ``/etc/resolv.conf``) points at an address where every query vanishes: a lookup
of a name not in ``/etc/hosts`` hangs for the resolver's whole timeout. A prefill and a
decode agent run in one process in it (loopback, authentication off, so that a plain ZeroMQ
socket can reach the listener: with it on, only a registered peer could send the same PING).
The attacker sends prefill one PING whose reply endpoint names such a host, then requests
run.

Asserts: the child's resolver really hangs (a lookup of the name is still unanswered after
3 s); the PING is refused and counted (``bad_messages``); every request after it succeeds,
each well within the decode's heartbeat bound (3 s: before, libzmq resolved the name on the
agent's I/O thread, every socket stalled, and decode declared prefill lost).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from .harness import _ip, netns_permitted

pytestmark = [pytest.mark.chaos, pytest.mark.processes, pytest.mark.timeout(300)]

CHILD = r"""
import json, socket, sys, threading, time
import numpy as np
import trio
import zmq
from trio_pd.core import _wire
from trio_pd import open_bootstrap_server, open_decode, open_prefill
from trio_pd.engines import make_engine
from trio_pd.testing.pools import HostKVPool

def pool():
    return HostKVPool(layout="mha", num_pages=64, num_layers=2, page_size=16, head_bytes=32,
                      heads=8)

answered = []
threading.Thread(target=lambda: answered.append(repr(socket.getaddrinfo("stall.invalid", 1))),
                 daemon=True).start()

async def main():
    src, dst = pool(), pool()
    src.fill(np.arange(64), room=1)
    pe, de = make_engine("mooncake"), make_engine("mooncake")
    out = {}
    try:
        async with (
            open_bootstrap_server(secure=False) as boot,
            open_prefill(engine=pe, pool=src.spec, bootstrap_url=boot.url, kv_heads=8,
                         secure=False) as pf,
            open_decode(engine=de, pool=dst.spec, secure=False) as dc,
        ):
            async def one(room):
                s = pf.sender(room, num_pages=1, aux_slot=0)
                r = dc.receiver(room, bootstrap_url=boot.url)
                r.init(np.arange(room, room + 1), aux_slot=1)
                t0 = time.monotonic()
                s.send(np.arange(room, room + 1), last=True)
                with trio.move_on_after(30):
                    st = await r.wait()
                    return [st.name if r.failure is None else repr(r.failure),
                            round(time.monotonic() - t0, 3)]
                return ["no answer in 30 s", 30.0]
            out["before"] = await one(1)
            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.connect(pf.control.heartbeat_endpoint)
            ping = _wire.Ping(v=_wire.WIRE_VERSION, nonce=7, endpoint="tcp://stall.invalid:5555")
            header = _wire.msgspec.msgpack.encode(
                {"t": "ping", "v": ping.v, "nonce": ping.nonce, "endpoint": ping.endpoint})
            push.send(header)
            await trio.sleep(3)
            out["resolver_answered_within_3s"] = bool(answered)
            out["after"] = [await one(room) for room in range(2, 8)]
            out["prefill_bad_messages"] = pf.statistics().bad_messages
            out["decode_peers_lost"] = dc.statistics().peers_lost
            push.close(0)
            ctx.term()
    finally:
        pe.close()
        de.close()
    print(json.dumps(out), flush=True)

trio.run(main)
"""


@contextmanager
def namespace_without_dns() -> Iterator[str]:
    """A namespace (``$CHAOS_NETNS_PREFIX``, default ``tpdc``) with loopback up and a
    resolver that never answers; removed, with its resolv.conf, on the way out."""
    prefix = os.environ.get("CHAOS_NETNS_PREFIX", "tpdc")
    ns = f"{prefix}-dns-{os.getpid() % 10000}"
    etc = Path("/etc/netns") / ns
    made = False
    try:
        _ip("netns", "add", ns)
        made = True
        _ip("-n", ns, "link", "set", "lo", "up")
        # The nameserver's address lies behind a veth pair whose other end has no address:
        # a permanent neighbour entry sends the query there, where it is dropped (not for
        # that end, no forwarding), and no ICMP error comes back to end the wait early.
        _ip("-n", ns, "link", "add", "dns0", "address", "02:00:00:00:00:01", "type", "veth",
            "peer", "name", "dns1", "address", "02:00:00:00:00:02")
        _ip("-n", ns, "addr", "add", "10.203.0.1/24", "dev", "dns0")
        for dev in ("dns0", "dns1"):
            _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", ns, "neigh", "add", "10.203.0.2", "lladdr", "02:00:00:00:00:02", "dev", "dns0",
            "nud", "permanent")
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text("nameserver 10.203.0.2\noptions timeout:30 attempts:3\n")
        yield ns
    finally:
        if made:
            try:
                _ip("netns", "del", ns)
            except (OSError, subprocess.SubprocessError):
                pass
        if etc.exists():
            for child in etc.iterdir():
                child.unlink()
            etc.rmdir()


def test_a_ping_naming_a_host_whose_dns_never_answers_stalls_nothing() -> None:
    why = netns_permitted()
    if why is not None:
        pytest.skip(why)
    with namespace_without_dns() as ns:
        done = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", CHILD],
            capture_output=True, text=True, timeout=240, env={**os.environ},
        )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(got))
    assert got["before"][0] == "Success"
    assert got["resolver_answered_within_3s"] is False  # (the set-up: DNS really hangs)
    assert got["prefill_bad_messages"] == 1
    assert [outcome for outcome, _ in got["after"]] == ["Success"] * 6, got["after"]
    assert got["decode_peers_lost"] == 0
