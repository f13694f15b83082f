"""Two hosts, one of them misconfigured: a prefill rank left on its default host.

The bootstrap service and the prefill rank run in network namespace A, the decode rank in
namespace B, joined by a veth pair (the harness's ``netns_pair``). The bootstrap service
listens on A's veth address, but the prefill rank (and its Mooncake engine) keep
``host="127.0.0.1"``, so the control endpoint and engine session it publishes mean "this
host" to whoever reads them. Seen from B they name B itself: decode must refuse the instance
with an error that names the address and the option to set, instead of "authentication off"
or a peer that "stopped answering".

Skipped, with the reason, where ``ip netns add`` is not permitted. The namespaces (and with
them the veth pair) are deleted in a ``finally``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .harness import cluster, netns_pair, netns_permitted, wait_done

pytestmark = [pytest.mark.chaos, pytest.mark.processes, pytest.mark.timeout(180)]


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    return netns_permitted()


async def test_a_loopback_prefill_seen_from_another_host_is_refused_by_name(
    tmp_path: Path,
) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with netns_pair(7) as net:
        async with cluster(tmp_path, request_bound=20.0) as c:
            await c.bootstrap(host=net.addr_a, netns=net.a)
            prefill = await c.rank("prefill", host="127.0.0.1", netns=net.a)
            decode = await c.rank("decode", host=net.addr_b, netns=net.b)
            rooms = c.submit(prefill, [decode], 1, pages=4, chunks=1, gap=0.0)
            done = await wait_done(decode, rooms, 30)
    failure = done[rooms[0]]
    assert failure["status"] == "Failed", failure
    text = failure["failure"]
    assert text.startswith("IncompatiblePeer("), text
    assert "tcp://127.0.0.1:" in text and "a loopback address" in text, text
    assert f"answered from {net.addr_a}" in text, text
    assert "open_prefill(host=)" in text and "make_engine('mooncake', host=)" in text, text
