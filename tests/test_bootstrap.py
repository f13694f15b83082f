"""The bootstrap HTTP service and its client, against the real server on loopback."""

from __future__ import annotations

import errno
import gc
import json
import socket
import ssl
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from trio_pd.bootstrap import _bootstrap
from trio_pd.bootstrap._bootstrap import BootstrapServer, open_bootstrap_server, serve_bootstrap
from trio_pd.bootstrap._bootstrap_client import (
    BootstrapClient,
    PrefillRankInfo,
    Topology,
    transport_reason,
)
from trio_pd.bootstrap._bootstrap_limits import MAX_BODY_BYTES
from trio_pd.core._errors import (
    BootstrapError,
    BootstrapUnreachable,
    NotReady,
    TransferError,
    UnknownRank,
)

from .helpers.net import free_port

# Raw requests at the service's HTTP mechanics: security off, explicitly (with it on, the
# default, a stranger gets nowhere: tests/test_auth.py)
pytestmark = pytest.mark.usefixtures("insecure")



def rank_info(tp_rank: int, tp_size: int = 4, **changes: Any) -> PrefillRankInfo:
    fields: dict[str, Any] = {
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "endpoint": f"tcp://127.0.0.1:{5000 + tp_rank}",
        "engine": "mooncake",
        "engine_session": f"127.0.0.1:{16000 + tp_rank}",
        "layout": "mha",
        "kv_heads": 8,
        "page_size": 16,
    }
    fields.update(changes)
    return PrefillRankInfo(**fields)


def as_json(info: PrefillRankInfo, **changes: Any) -> bytes:
    fields = msgspec.structs.asdict(info)
    fields.update(changes)
    return json.dumps(fields).encode()


@pytest.fixture
async def server() -> AsyncIterator[BootstrapServer]:
    async with open_bootstrap_server() as server:
        yield server


@pytest.fixture
async def http(server: BootstrapServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, trust_env=False, verify=False) as http:
        yield http


@pytest.fixture
async def client(server: BootstrapServer) -> AsyncIterator[BootstrapClient]:
    async with BootstrapClient(server.url) as client:
        yield client


async def register_all(client: BootstrapClient, tp_size: int = 4) -> None:
    for rank in range(tp_size):
        await client.register(rank_info(rank, tp_size))


# -- port, health ------------------------------------------------------------------------------


async def test_port_zero_gives_a_real_port_and_url(server: BootstrapServer) -> None:
    assert server.port > 0
    assert server.host == "127.0.0.1"
    assert server.url == f"http://127.0.0.1:{server.port}"
    async with open_bootstrap_server() as other:
        assert other.port != server.port


async def test_health(server: BootstrapServer, http: httpx.AsyncClient) -> None:
    response = await http.get("/health")
    assert response.status_code == 200
    assert response.text == "OK"
    async with BootstrapClient(server.url) as client:
        assert await client.health() is True


async def test_binding_a_busy_port_raises_bootstrap_error(server: BootstrapServer) -> None:
    with pytest.raises(BootstrapError, match="cannot bind"):
        async with open_bootstrap_server(port=server.port):
            pytest.fail("bound a port that is in use")  # pragma: no cover


# -- GET /route --------------------------------------------------------------------------------


async def test_not_ready_until_every_rank_registered(
    http: httpx.AsyncClient, client: BootstrapClient
) -> None:
    # Nothing registered: 503, not 404.
    assert (await http.get("/route")).status_code == 503
    assert (await http.get("/route", params={"tp_rank": "0"})).status_code == 503
    with pytest.raises(NotReady):
        await client.topology()

    for rank in (3, 0, 2):  # out of order, rank 1 missing
        await client.register(rank_info(rank))
    for params in ({}, {"tp_rank": "-1"}, {"tp_rank": "0"}, {"tp_rank": "1"}):
        response = await http.get("/route", params=params)
        assert response.status_code == 503, params
        assert "3 of 4" in response.json()["error"]
    with pytest.raises(NotReady, match="503"):
        await client.topology()
    with pytest.raises(NotReady):
        await client.rank(0)

    await client.register(rank_info(1))
    topology = await client.topology()
    assert topology == Topology(tp_size=4, ranks=[rank_info(r) for r in range(4)])
    assert (await http.get("/route", params={"tp_rank": "-1"})).json() == msgspec.json.decode(
        msgspec.json.encode(topology)  # (JSON's form: tuples are lists)
    )
    assert await client.rank(2) == rank_info(2)
    response = await http.get("/route", params={"tp_rank": "2"})
    assert response.status_code == 200
    assert msgspec.json.decode(response.content, type=PrefillRankInfo) == rank_info(2)


async def test_unknown_rank_is_404(http: httpx.AsyncClient, client: BootstrapClient) -> None:
    await client.register(rank_info(0))
    # tp_size is already known, so rank 4 can never exist: 404 even before the topology is
    # complete (a client should not wait for it).
    assert (await http.get("/route", params={"tp_rank": "4"})).status_code == 404
    await register_all(client)
    assert (await http.get("/route", params={"tp_rank": "4"})).status_code == 404
    with pytest.raises(UnknownRank, match="404"):
        await client.rank(17)


@pytest.mark.parametrize(
    "query",
    [
        "tp_rank=abc",
        "tp_rank=1.5",
        "tp_rank=",
        "tp_rank=+1",
        "tp_rank=%201",
        "tp_rank=-2",
        "tp_rank=99999999999999999999",
        "tp_rank=1&tp_rank=2",
        "rank=1",
        "tp_rank=1&extra=x",
        "tp_rank=%ff",
        "&&",
    ],
)
async def test_bad_query_is_400(
    server: BootstrapServer, http: httpx.AsyncClient, client: BootstrapClient, query: str
) -> None:
    await register_all(client)
    response = await http.get(f"/route?{query}")
    assert response.status_code == 400, response.text
    assert response.json()["ok"] is False
    assert server.statistics().malformed == 1


# -- PUT /route --------------------------------------------------------------------------------


BAD_BODIES = {
    "not json": b"not json",
    "truncated": as_json(rank_info(0))[:-5],
    "not utf-8": b'{"tp_rank": "\xff"}',
    "array": b"[]",
    "empty object": b"{}",
    "empty body": b"",
    "missing field": json.dumps({"tp_rank": 0, "tp_size": 4}).encode(),
    "string rank": as_json(rank_info(0), tp_rank="0"),
    "rank == size": as_json(rank_info(0), tp_rank=4),
    "negative rank": as_json(rank_info(0), tp_rank=-1),
    "size 0": as_json(rank_info(0), tp_size=0, tp_rank=0),
    "unknown layout": as_json(rank_info(0), layout="gqa"),
    "mla with 8 heads": as_json(rank_info(0), layout="mla", kv_heads=8),
    "page size 0": as_json(rank_info(0), page_size=0),
    "empty endpoint": as_json(rank_info(0), endpoint=""),
    "no engine": as_json(rank_info(0), engine=""),
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
async def test_malformed_registration_is_400_and_counted(
    server: BootstrapServer, http: httpx.AsyncClient, body: bytes
) -> None:
    response = await http.put("/route", content=body)
    assert response.status_code == 400, response.text
    assert response.json()["ok"] is False
    assert response.json()["error"]
    stats = server.statistics()
    assert stats.malformed == 1
    assert stats.requests == {("PUT", "/route", 400): 1}
    assert stats.registered_ranks == 0
    # The server still serves, and still registers.
    assert (await http.get("/health")).status_code == 200
    ok = await http.put("/route", content=as_json(rank_info(0)))
    assert ok.status_code == 200
    assert ok.json() == {"ok": True}
    assert server.statistics().registered_ranks == 1


async def test_client_register_reports_the_refusal(client: BootstrapClient) -> None:
    with pytest.raises(BootstrapError, match=r"400 Bad Request: tp_rank 5 is outside"):
        await client.register(rank_info(5))


async def test_many_malformed_requests_do_not_disturb_the_server(
    server: BootstrapServer, http: httpx.AsyncClient, client: BootstrapClient
) -> None:
    async with trio.open_nursery() as nursery:
        for body in list(BAD_BODIES.values()) * 4:
            nursery.start_soon(partial(http.put, "/route", content=body))
        nursery.start_soon(register_all, client)
    assert server.statistics().malformed == 4 * len(BAD_BODIES)
    assert (await client.topology()).tp_size == 4


async def test_conflicting_registration_is_409(
    server: BootstrapServer, http: httpx.AsyncClient, client: BootstrapClient
) -> None:
    await client.register(rank_info(0, tp_size=4))
    # A lone rank may re-register with another shape (nothing to disagree with).
    await client.register(rank_info(0, tp_size=2))
    await client.register(rank_info(0, tp_size=4))
    await client.register(rank_info(1, tp_size=4))
    for conflicting in (
        rank_info(2, tp_size=8),
        rank_info(2, page_size=32),
        rank_info(2, kv_heads=4),
        rank_info(2, engine="nixl"),
        rank_info(1, tp_size=2),  # replacing rank 1 must still agree with rank 0
    ):
        response = await http.put("/route", content=msgspec.json.encode(conflicting))
        assert response.status_code == 409, conflicting
        assert "disagrees" in response.json()["error"]
    with pytest.raises(BootstrapError, match="409 Conflict"):
        await client.register(rank_info(3, layout="mla", kv_heads=1))
    stats = server.statistics()
    assert stats.malformed == 0  # well-formed, only inconsistent
    assert stats.requests[("PUT", "/route", 409)] == 6
    assert stats.registered_ranks == 2
    assert stats.tp_size == 4


async def test_reregistration_replaces_the_rank(
    server: BootstrapServer, client: BootstrapClient
) -> None:
    await register_all(client)
    restarted = rank_info(1, endpoint="tcp://127.0.0.1:6001", engine_session="127.0.0.1:17001")
    await client.register(restarted)
    topology = await client.topology()
    assert topology.ranks[1] == restarted
    assert [r.tp_rank for r in topology.ranks] == [0, 1, 2, 3]
    assert await client.rank(1) == restarted
    assert server.statistics().registered_ranks == 4


async def test_concurrent_registration_of_many_ranks(
    server: BootstrapServer, client: BootstrapClient
) -> None:
    tp_size = 64
    result: list[Topology] = []

    async def register_one(rank: int) -> None:
        async with BootstrapClient(server.url) as own:
            await own.register(rank_info(rank, tp_size))

    async def wait() -> None:
        result.append(await client.wait_topology())

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            for rank in reversed(range(tp_size)):
                nursery.start_soon(register_one, rank)
    assert result[0] == Topology(tp_size, [rank_info(r, tp_size) for r in range(tp_size)])
    stats = server.statistics()
    assert stats.requests[("PUT", "/route", 200)] == tp_size
    assert stats.ready


# -- wait_topology -----------------------------------------------------------------------------


async def test_wait_topology_waits_through_503(
    server: BootstrapServer, client: BootstrapClient
) -> None:
    for rank in range(3):
        await client.register(rank_info(rank))
    send, receive = trio.open_memory_channel[Topology](1)

    async def wait() -> None:
        await send.send(await client.wait_topology())

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            # Until the client has been told "not ready" at least twice, it is waiting.
            while server.statistics().requests.get(("GET", "/route", 503), 0) < 2:
                await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.WouldBlock):
                receive.receive_nowait()
            await client.register(rank_info(3))
            topology = await receive.receive()
    assert topology.tp_size == 4
    assert len(topology.ranks) == 4


async def test_wait_topology_waits_for_the_server_to_start() -> None:
    port = free_port()
    async with BootstrapClient(f"http://127.0.0.1:{port}") as client:
        # Nobody listens yet: connection refused, retried.
        with pytest.raises(BootstrapUnreachable):
            await client.topology()
        send, receive = trio.open_memory_channel[Topology](1)

        async def wait() -> None:
            await send.send(await client.wait_topology())

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                async with open_bootstrap_server(port=port) as server:
                    async with BootstrapClient(server.url) as registrar:
                        await register_all(registrar, tp_size=2)
                    topology = await receive.receive()
    assert topology.tp_size == 2


async def test_wait_topology_obeys_the_callers_deadline(client: BootstrapClient) -> None:
    with trio.move_on_after(0.3) as scope:
        await client.wait_topology()
    assert scope.cancelled_caught


# -- errors from an unreachable service --------------------------------------------------------


async def test_unreachable_service() -> None:
    async with BootstrapClient(f"http://127.0.0.1:{free_port()}/") as client:
        assert await client.health() is False
        with pytest.raises(BootstrapUnreachable, match=r"unreachable: connection refused$") as info:
            await client.topology()
        assert isinstance(info.value, BootstrapError)
        assert isinstance(info.value, TransferError)
        with pytest.raises(BootstrapUnreachable):
            await client.register(rank_info(0))
        with pytest.raises(BootstrapUnreachable):
            await client.rank(0)


def test_a_transport_failure_is_told_by_its_real_cause() -> None:
    """httpx says "all attempts to connect ... failed" for a refused connection and nothing
    for a failed TLS handshake: the reason comes from the exceptions behind its error."""

    def wrapped(cause: BaseException) -> httpx.ConnectError:
        error = httpx.ConnectError(str(cause) if isinstance(cause, OSError) else "")
        error.__cause__ = cause
        return error

    refused = OSError("all attempts to connect to 127.0.0.1:1 failed")
    refused.__cause__ = ExceptionGroup("all attempts", [ConnectionRefusedError(111, "x")])
    assert transport_reason(wrapped(refused)) == "connection refused"
    dns = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert transport_reason(wrapped(dns)) == (
        "cannot resolve the host name (Name or service not known)"
    )
    cert = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] ...")
    cert.verify_message = "self-signed certificate"
    broken = trio.BrokenResourceError()
    broken.__context__ = cert
    assert transport_reason(wrapped(broken)) == (
        "TLS certificate verification failed: self-signed certificate"
    )
    unreachable = OSError(errno.EHOSTUNREACH, "No route to host")
    assert transport_reason(wrapped(unreachable)) == "no route to host"
    assert transport_reason(httpx.ReadError("")) == "ReadError"


async def test_wait_register_waits_for_the_server_to_start_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    async with BootstrapClient(f"http://127.0.0.1:{port}") as client:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.wait_register, rank_info(0, tp_size=1))
                while client.waiting is None:  # noqa: ASYNC110 - no event to wait on
                    await trio.sleep(0.01)
                async with open_bootstrap_server(port=port) as server:
                    stats = server.statistics
                    while not stats().requests.get(("PUT", "/route", 200)):  # noqa: ASYNC110
                        await trio.sleep(0.01)
                    assert (await client.topology()).tp_size == 1
    said = [r.getMessage() for r in caplog.records if r.name == "trio_pd.bootstrap"]
    assert len(said) == 1 and "connection refused; retrying for up to" in said[0], said


async def test_no_answer_says_what_the_service_last_said() -> None:
    async with BootstrapClient(f"http://127.0.0.1:{free_port()}") as client:
        with trio.move_on_after(0.2):
            await client.wait_topology()
        error = client.no_answer(0.2, "prefill instance x")
        assert isinstance(error, BootstrapUnreachable)
        assert str(error).startswith("prefill instance x: no answer within 0.2 s (")
        assert str(error).endswith("unreachable: connection refused)")
    async with open_bootstrap_server() as server, BootstrapClient(server.url) as client:
        assert client.server_address is None
        await client.register(rank_info(0, tp_size=2))
        assert client.server_address == "127.0.0.1"  # (where the answer came from)
        with trio.move_on_after(0.2):
            await client.wait_topology()
        error = client.no_answer(0.2)
        assert type(error) is BootstrapError and "not ready within 0.2 s" in str(error)
        assert "503" in str(error)


async def test_health_is_false_for_a_non_200_answer(server: BootstrapServer) -> None:
    # Another HTTP service on the address (here: a path prefix that answers 404).
    async with BootstrapClient(server.url + "/elsewhere") as client:
        assert await client.health() is False


# -- other paths, methods, sizes ---------------------------------------------------------------


async def test_unknown_path_is_404_and_wrong_method_405(
    server: BootstrapServer, http: httpx.AsyncClient
) -> None:
    for path in ("/", "/nope", "/route/", "/health/x", "/ROUTE"):
        assert (await http.get(path)).status_code == 404, path
    assert (await http.put("/nope", content=b"{}")).status_code == 404
    for method, path, allow in (
        ("POST", "/route", "GET, PUT"),
        ("DELETE", "/route", "GET, PUT"),
        ("PUT", "/health", "GET"),
        ("POST", "/metrics", "GET"),
        ("HEAD", "/health", "GET"),
    ):
        response = await http.request(method, path)
        assert response.status_code == 405, (method, path)
        assert response.headers["allow"] == allow
    response = await http.request("BREW", "/route")
    assert response.status_code == 405
    stats = server.statistics()
    assert stats.requests[("GET", "<other>", 404)] == 5
    assert stats.requests[("<other>", "/route", 405)] == 1
    assert stats.malformed == 0
    assert (await http.get("/health")).status_code == 200


async def test_body_size_limit(server: BootstrapServer, http: httpx.AsyncClient) -> None:
    body = as_json(rank_info(0))
    exactly = body + b" " * (MAX_BODY_BYTES - len(body))
    response = await http.put("/route", content=exactly)
    assert response.status_code == 200

    one_more = exactly + b" "
    response = await http.put("/route", content=one_more)
    assert response.status_code == 413  # refused on Content-Length, before reading

    async def chunked() -> AsyncIterator[bytes]:
        # No Content-Length: the limit is enforced on what arrives.
        for _ in range(20):
            yield b" " * 8192

    response = await http.put("/route", content=chunked())
    assert response.status_code == 413

    stats = server.statistics()
    assert stats.requests[("PUT", "/route", 413)] == 2
    assert stats.malformed == 2
    assert (await http.get("/health")).status_code == 200


# -- statistics and metrics --------------------------------------------------------------------


async def test_statistics_count_by_route_and_status(
    server: BootstrapServer, http: httpx.AsyncClient, client: BootstrapClient
) -> None:
    initial = server.statistics()
    assert initial.total_requests == 0
    assert (initial.registered_ranks, initial.tp_size, initial.ready) == (0, None, False)
    await client.health()
    await client.health()
    with pytest.raises(NotReady):
        await client.topology()
    await register_all(client, tp_size=2)
    await client.topology()
    await client.rank(1)
    await http.put("/route", content=b"{")
    stats = server.statistics()
    assert dict(stats.requests) == {
        ("GET", "/health", 200): 2,
        ("GET", "/route", 503): 1,
        ("PUT", "/route", 200): 2,
        ("GET", "/route", 200): 2,
        ("PUT", "/route", 400): 1,
    }
    assert stats.total_requests == 8
    assert (stats.malformed, stats.registered_ranks, stats.tp_size, stats.ready) == (
        1,
        2,
        2,
        True,
    )
    with pytest.raises(TypeError):
        stats.requests[("GET", "/health", 200)] = 0  # type: ignore[index]


async def test_metrics_are_opt_in(http: httpx.AsyncClient) -> None:
    response = await http.get("/metrics")
    assert response.status_code == 404


async def test_metrics_export_the_statistics() -> None:
    registry = CollectorRegistry()
    async with open_bootstrap_server(metrics_registry=registry) as server:
        async with BootstrapClient(server.url) as client:
            await client.register(rank_info(0, tp_size=2))
            await client.health()
            async with httpx.AsyncClient(
                base_url=server.url, trust_env=False, verify=False
            ) as http:
                await http.put("/route", content=b"nope")
                response = await http.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        text = response.text
        assert (
            'trio_pd_bootstrap_requests_total{method="PUT",route="/route",status="200"} 1.0' in text
        )
        assert (
            'trio_pd_bootstrap_requests_total{method="GET",route="/health",status="200"} 1.0'
            in text
        )
        assert "trio_pd_bootstrap_malformed_requests_total 1.0" in text
        assert "trio_pd_bootstrap_registered_ranks 1.0" in text
        assert "trio_pd_bootstrap_ready 0.0" in text
        assert registry.get_sample_value("trio_pd_bootstrap_malformed_requests_total") == 1

        # One server per registry.
        with pytest.raises(BootstrapError, match="metrics"):
            async with open_bootstrap_server(metrics_registry=registry):
                pytest.fail("two servers exported into one registry")  # pragma: no cover

    # Unregistered on exit: the registry can serve the next server.
    assert registry.get_sample_value("trio_pd_bootstrap_malformed_requests_total") is None
    async with open_bootstrap_server(metrics_registry=registry):
        assert registry.get_sample_value("trio_pd_bootstrap_malformed_requests_total") == 0


# -- connections and shutdown ------------------------------------------------------------------


async def read_until_eof(stream: trio.SocketStream) -> bytes:
    data = bytearray()
    while chunk := await stream.receive_some():
        data += chunk
    return bytes(data)


async def test_half_open_connections_neither_block_serving_nor_shutdown() -> None:
    async with open_bootstrap_server() as server:
        # A client that stops in the middle of its request line / headers.
        headers_only = await trio.open_tcp_stream("127.0.0.1", server.port)
        await headers_only.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        # A client that sends the headers of a registration and part of its body; it
        # asks for "100 Continue", which tells us the request reached the service.
        partial_body = await trio.open_tcp_stream("127.0.0.1", server.port)
        await partial_body.send_all(
            b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n"
        )
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += await partial_body.receive_some()
        assert interim.startswith(b"HTTP/1.1 100")
        await partial_body.send_all(b'{"tp_rank": 0')

        # The service answers everyone else meanwhile.
        async with BootstrapClient(server.url) as client:
            assert await client.health()
            await register_all(client, tp_size=2)
            assert (await client.topology()).tp_size == 2

        closing_started = trio.current_time()
    shutdown_took = trio.current_time() - closing_started

    assert shutdown_took < 1.0
    # The half-finished registration was answered 503, then both were closed.
    with trio.fail_after(1):
        answer = await read_until_eof(partial_body)
        assert answer.startswith(b"HTTP/1.1 503")
        assert b"shutting down" in answer
        assert await read_until_eof(headers_only) == b""
    await headers_only.aclose()
    await partial_body.aclose()
    assert server.statistics().registered_ranks == 2
    gc.collect()  # a socket leaked by the shutdown would warn (an error here) now


async def test_shutdown_closes_idle_keep_alive_connections_promptly() -> None:
    async with open_bootstrap_server() as server:
        client = BootstrapClient(server.url)
        assert await client.health()  # leaves a pooled keep-alive connection open
        start = trio.current_time()
    assert trio.current_time() - start < 0.5
    assert await client.health() is False
    await client.aclose()
    gc.collect()


async def test_serve_bootstrap_runs_until_cancelled() -> None:
    async with trio.open_nursery() as nursery:
        server: BootstrapServer = await nursery.start(serve_bootstrap, "127.0.0.1", 0)
        async with BootstrapClient(server.url) as client:
            assert await client.health()
            await client.register(rank_info(0, tp_size=1))
            start = trio.current_time()
            nursery.cancel_scope.cancel(reason="test done")
    assert trio.current_time() - start < 1.0
    async with BootstrapClient(server.url) as client:
        assert await client.health() is False


async def test_cancelling_the_block_shuts_the_server_down() -> None:
    with trio.move_on_after(0.2) as scope:
        async with open_bootstrap_server() as server:
            await trio.sleep_forever()
    assert scope.cancelled_caught
    async with BootstrapClient(server.url) as client:
        assert await client.health() is False


async def test_cancelled_at_any_point_of_startup_it_stops_promptly() -> None:
    # Cancels serve_bootstrap / open_bootstrap_server after 0, 1, 2... scheduling points:
    # during the bind, hypercorn's startup, and once it serves. None of them may hang.
    for checkpoints in range(40):
        with trio.fail_after(2):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_bootstrap)
                for _ in range(checkpoints):
                    await trio.lowlevel.checkpoint()
                nursery.cancel_scope.cancel(reason="test")

            with trio.CancelScope() as scope:

                async def cancel_soon(n: int = checkpoints) -> None:
                    for _ in range(n):
                        await trio.lowlevel.checkpoint()
                    scope.cancel(reason="test")

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_soon)
                    async with open_bootstrap_server():
                        await trio.sleep_forever()
    gc.collect()


async def test_a_shutdown_that_overruns_is_cut_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Make a request in flight outlive hypercorn's grace period: the backstop must end it.
    monkeypatch.setattr(_bootstrap, "_GRACEFUL_TIMEOUT", 30.0)
    monkeypatch.setattr(BootstrapServer, "_begin_shutdown", lambda self: None)
    async with open_bootstrap_server() as server:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(
            b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n"
        )
        assert (await stream.receive_some()).startswith(b"HTTP/1.1 100")
        closing_started = trio.current_time()
    assert trio.current_time() - closing_started < 2.0
    assert "shutdown overran" in caplog.text
    with trio.fail_after(1):
        assert await read_until_eof(stream) == b""
    await stream.aclose()
    gc.collect()


# -------------------------------------------------------------- a service that lies


async def _answer_everything_with(
    body: bytes, stream: trio.SocketStream, *, length: bool = True
) -> None:
    """A fake bootstrap service: every request gets ``body`` as a 200 JSON answer (without
    ``length``, no Content-Length: the body ends where the connection does)."""
    data = b""
    try:
        while b"\r\n\r\n" not in data and len(data) < 65536:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            data += chunk
        declared = b"content-length: %d\r\n" % len(body) if length else b""
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%s"
            b"connection: close\r\n\r\n%s" % (declared, body)
        )
    finally:
        await stream.aclose()


@pytest.mark.parametrize("body", [
    b'{"tp_size": 0, "ranks": []}',
    b'{"tp_size": 1, "pp_size": 0, "ranks": []}',
    b'{"tp_size": -3, "ranks": []}',
    b'{"tp_size": 1000000000, "ranks": []}',
], ids=["tp0", "pp0", "tp-3", "tp1e9"])
async def test_a_topology_that_does_not_add_up_is_a_bootstrap_error(
    nursery: trio.Nursery, body: bytes
) -> None:
    """A TP or PP size of 0 (or less) with no ranks passed the client's check (the ranks
    expected for it are none), and decode then took ``ranks[0]`` and died of IndexError
    with every room it served; a TP size of 10**9 would have built a list of 10**9 pairs
    to compare with. Now each is refused before that."""
    listeners = await nursery.start(partial(
        trio.serve_tcp, partial(_answer_everything_with, body), 0, host="127.0.0.1"
    ))
    port = listeners[0].socket.getsockname()[1]
    async with BootstrapClient(f"http://127.0.0.1:{port}") as liar:
        with trio.fail_after(5), pytest.raises(BootstrapError, match="ranks for TP"):
            await liar.topology()


@pytest.mark.parametrize("length", [True, False], ids=["declared", "undeclared"])
async def test_an_answer_too_big_to_be_a_topology_is_refused(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, length: bool
) -> None:
    """The client read a whole answer however big (a 400 MiB one grew the process by 800
    MiB); past MAX_ANSWER_BYTES (32 MiB; lowered here to keep the test small) it is now a
    BootstrapError, refused unread when its Content-Length says so, else read to its end
    and dropped, keeping no more than the bound."""
    from trio_pd.bootstrap import _bootstrap_transport

    monkeypatch.setattr(_bootstrap_transport, "MAX_ANSWER_BYTES", 1 << 20)
    body = b'{"tp_size": 1, "ranks": [], "pad": "' + b"x" * (3 << 20) + b'"}'
    listeners = await nursery.start(partial(
        trio.serve_tcp, partial(_answer_everything_with, body, length=length), 0,
        host="127.0.0.1",
    ))
    port = listeners[0].socket.getsockname()[1]
    async with BootstrapClient(f"http://127.0.0.1:{port}") as liar:
        with trio.fail_after(5), pytest.raises(BootstrapError, match="answer is over 1048576"):
            await liar.topology()
