"""The bootstrap service against slow and many clients: the request deadline and the
connection cap (slowloris: a request trickled a byte at a time, headers or body; a client
that takes no answer; more connections than the cap), on a real server on loopback.

Every loop is bounded in count (the bytes a client has to send, the requests it makes) and in
time (``move_on_after`` / ``fail_after``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import httpx
import msgspec
import pytest
import trio
from prometheus_client import CollectorRegistry

from trio_pd.bootstrap._bootstrap import BootstrapServer, open_bootstrap_server
from trio_pd.bootstrap._bootstrap_client import PrefillRankInfo
from trio_pd.core._errors import ConfigurationError

# Raw requests at the service's HTTP mechanics: security off, explicitly (with it on, the
# default, a stranger gets nowhere: tests/test_auth.py)
pytestmark = pytest.mark.usefixtures("insecure")


#: the request deadline the tests' servers get (seconds)
DEADLINE = 1.0
#: how late after the deadline a close may come (a loaded 2-core machine)
MARGIN = 0.7
#: a slow client sends one byte this often
INTERVAL = 0.5

#: a request head, to trickle from its first byte on
HEAD = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 40 + b"\r\n\r\n"
#: a whole registration head, sent at once, whose body is then trickled
PUT_HEAD = b"PUT /route HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n"
PUT_BODY = b'{"tp_rank": 0, "tp_size": 1, "endpoint": "' + b"a" * 70


@dataclass
class Slow:
    """What one slow client saw."""

    opened_at: float = 0.0
    closed_at: float | None = None  # None: still open when its time ran out
    answer: bytes = b""

    @property
    def took(self) -> float | None:
        """Seconds from connecting until the server closed the connection."""
        return None if self.closed_at is None else self.closed_at - self.opened_at


async def _read_to_close(stream: trio.SocketStream, client: Slow, done: trio.CancelScope) -> None:
    try:
        while data := await stream.receive_some():
            client.answer += data
    except trio.BrokenResourceError:
        pass  # a reset is a close too
    client.closed_at = trio.current_time()
    done.cancel(reason="the server closed the connection")


async def slow_client(
    port: int,
    head: bytes,
    drip: bytes,
    client: Slow,
    *,
    budget: float,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Connect, send ``head`` at once, then ``drip`` one byte every :data:`INTERVAL`, until
    the server closes the connection or ``budget`` seconds pass; ``client`` records it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    client.opened_at = trio.current_time()
    async with stream:
        await stream.send_all(head)
        task_status.started()
        with trio.move_on_after(budget):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_to_close, stream, client, nursery.cancel_scope)
                for byte in drip:
                    await trio.sleep(INTERVAL)
                    try:
                        await stream.send_all(bytes([byte]))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        await trio.sleep_forever()  # closed: the reader records it and ends us


async def until(
    condition: Callable[[], bool], server: BootstrapServer, limit: float = 2.0
) -> None:
    """Wait (polling, at most ``limit`` seconds) until ``condition()`` holds."""
    with trio.move_on_after(limit):
        for _ in range(int(limit / 0.01) + 1):
            if condition():
                return
            await trio.sleep(0.01)
    stats = server.statistics()
    raise AssertionError(
        f"not so within {limit} s: open {stats.open_connections}, shed "
        f"{stats.shed_connections}, timed out {stats.timed_out_connections}"
    )


def counts(server: BootstrapServer) -> tuple[int, int]:
    stats = server.statistics()
    return stats.open_connections, stats.shed_connections


def closed(server: BootstrapServer) -> Callable[[], bool]:
    return lambda: server.statistics().open_connections == 0


async def test_a_header_trickle_is_closed_at_the_deadline() -> None:
    async with open_bootstrap_server(request_timeout=DEADLINE) as server:
        client = Slow()
        await slow_client(server.port, HEAD[:1], HEAD[1:], client, budget=DEADLINE + 3)
        assert client.took is not None, "still open"
        assert DEADLINE - 0.05 <= client.took < DEADLINE + MARGIN, client.took
        assert client.answer == b""
        await until(closed(server), server)
        stats = server.statistics()
        assert (stats.timed_out_connections, stats.shed_connections) == (1, 0)
        assert stats.total_requests == 0


async def test_a_body_trickle_is_closed_at_the_deadline() -> None:
    async with open_bootstrap_server(request_timeout=DEADLINE) as server:
        client = Slow()
        await slow_client(server.port, PUT_HEAD, PUT_BODY, client, budget=DEADLINE + 3)
        assert client.took is not None, "still open"
        assert DEADLINE - 0.05 <= client.took < DEADLINE + MARGIN, client.took
        assert client.answer == b""  # closed, not answered
        await until(closed(server), server)
        stats = server.statistics()
        assert (stats.timed_out_connections, stats.shed_connections) == (1, 0)
        assert stats.total_requests == 0 and stats.registered_ranks == 0


@pytest.mark.serial
async def test_beyond_the_cap_the_oldest_slow_clients_make_room_and_health_answers() -> None:
    cap, slow, deadline = 4, 6, 2.0
    registry = CollectorRegistry()
    async with open_bootstrap_server(
        request_timeout=deadline, max_connections=cap, metrics_registry=registry
    ) as server:
        clients = [Slow() for _ in range(slow)]
        admitted: list[float] = []
        async with trio.open_nursery() as nursery:
            # One at a time, each admitted before the next, so the order of age is known.
            for i, client in enumerate(clients, start=1):
                await nursery.start(
                    partial(slow_client, server.port, HEAD[:1], HEAD[1:], client,
                            budget=deadline + 3)
                )
                want = (min(i, cap), max(0, i - cap))  # (open, shed)
                await until(lambda w=want: counts(server) == w, server)
                admitted.append(trio.current_time())

            # A normal client still gets in (the oldest slow one makes room) and is answered.
            start = trio.current_time()
            async with httpx.AsyncClient(base_url=server.url, trust_env=False) as http:
                with trio.fail_after(1):
                    response = await http.get("/health")
            answered = trio.current_time()
            assert response.status_code == 200 and response.text == "OK"
            assert answered - start < 0.5

        # Clients 1-3 were shed as 5, 6 and /health came in: closed at once, unanswered.
        for client, at in zip(clients[:3], [admitted[4], admitted[5], answered], strict=True):
            assert client.closed_at is not None and client.closed_at - at < 0.5
            assert client.answer == b""
        # Clients 4-6 were closed by the deadline, however they kept sending.
        for client in clients[3:]:
            assert client.took is not None, "still open"
            assert deadline - 0.05 <= client.took < deadline + MARGIN, client.took
            assert client.answer == b""
        await until(closed(server), server)
        stats = server.statistics()
        assert stats.shed_connections == 3
        assert stats.timed_out_connections == 3
        assert dict(stats.requests) == {("GET", "/health", 200): 1}
        assert registry.get_sample_value("trio_pd_bootstrap_shed_connections_total") == 3
        assert registry.get_sample_value("trio_pd_bootstrap_timed_out_connections_total") == 3
        assert registry.get_sample_value("trio_pd_bootstrap_open_connections") == 0


async def test_a_client_that_takes_no_answer_is_closed() -> None:
    # A topology of ~200 KB, asked for 60 times on one connection that reads nothing: the
    # answers (12 MB) overflow the socket buffers and a write of the server's blocks.
    ranks = 64
    async with open_bootstrap_server(request_timeout=DEADLINE) as server:
        async with httpx.AsyncClient(base_url=server.url, trust_env=False) as http:
            for rank in range(ranks):
                info = PrefillRankInfo(
                    tp_rank=rank, tp_size=ranks, endpoint="tcp://127.0.0.1:1" + "0" * 1000,
                    engine="mooncake", engine_session="s" * 1024, layout="mha", kv_heads=8,
                    page_size=16, heartbeat_endpoint="h" * 1024,
                )
                got = await http.put("/route", content=msgspec.json.encode(info))
                assert got.status_code == 200, got.text
        await until(closed(server), server)
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            await stream.send_all(b"GET /route HTTP/1.1\r\nHost: localhost\r\n\r\n" * 60)
            start = trio.current_time()
            await until(closed(server), server, limit=DEADLINE + 3)
            assert trio.current_time() - start < DEADLINE + MARGIN + 0.5
        stats = server.statistics()
        assert stats.timed_out_connections == 1
        assert 0 < stats.requests[("GET", "/route", 200)] < 60


@pytest.mark.parametrize(
    ("keyword", "value"),
    [("request_timeout", 0), ("request_timeout", float("inf")), ("request_timeout", -1.0),
     ("max_connections", 0), ("max_connections", 2.5), ("max_connections", True)],
)
async def test_limits_that_cannot_work_are_refused(keyword: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=keyword):
        async with open_bootstrap_server(**{keyword: value}):  # type: ignore[arg-type]
            pytest.fail("served with an impossible limit")  # pragma: no cover
