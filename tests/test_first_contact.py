"""First contact between the parts of a deployment: start order, a bootstrap URL that is dead
or not trusted, and the real reason in the error and the log when one cannot be reached."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import trio

from trio_pd import (
    BootstrapError,
    ConfigurationError,
    DecodeConfig,
    KVPoll,
    PrefillConfig,
    open_bootstrap_server,
    open_decode,
    open_prefill,
)
from trio_pd.agents._sources import is_own_address, loopback_problem
from trio_pd.core import _wire
from trio_pd.core._errors import BootstrapUnreachable
from trio_pd.core._stats import Counters
from trio_pd.engines import TransferEngine, make_engine
from trio_pd.io._control import ControlPlane

from .helpers.agents import host_pool
from .helpers.net import free_port, self_signed


@pytest.fixture
async def engines() -> AsyncIterator[tuple[TransferEngine, TransferEngine]]:
    pe, de = make_engine("mooncake"), make_engine("mooncake")
    try:
        yield pe, de
    finally:
        pe.close()
        de.close()


def only_error(exc: BaseException) -> BaseException:
    """The one exception ``exc`` carries, however deep in exception groups (``open_*``
    nested in other blocks raises it wrapped)."""
    while isinstance(exc, BaseExceptionGroup):
        assert len(exc.exceptions) == 1, exc
        exc = exc.exceptions[0]
    return exc


def records(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------ start order


async def test_prefill_waits_for_a_bootstrap_service_that_starts_later(
    engines: tuple[TransferEngine, TransferEngine], caplog: pytest.LogCaptureFixture
) -> None:
    """``open_prefill`` before its bootstrap service is up: it retries (saying once that it
    waits, and why), registers once the service starts, and a request then goes through."""
    pe, de = engines
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    src, dst = host_pool(), host_pool()
    src.fill(np.arange(2), room=5)
    up = trio.Event()

    async def prefill_side(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with open_prefill(engine=pe, pool=src.spec, bootstrap_url=url, kv_heads=2) as p:
            task_status.started()
            sender = p.sender(5, num_pages=2, aux_slot=0)
            sender.send(np.arange(2), last=True)
            await up.wait()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            started = nursery.start(prefill_side)
            waiting = trio.Event()

            async def serve_late() -> None:
                # the prefill rank has tried and said so before the service exists
                while not records(caplog, "trio_pd.bootstrap"):  # noqa: ASYNC110 - a log
                    await trio.sleep(0.01)
                waiting.set()
                async with open_bootstrap_server(port=port):
                    await up.wait()

            nursery.start_soon(serve_late)
            await started
            assert waiting.is_set()
            async with open_decode(engine=de, pool=dst.spec) as decode:
                receiver = decode.receiver(5, bootstrap_url=url)
                receiver.init(np.arange(10, 12), aux_slot=1)
                assert await receiver.wait() is KVPoll.Success
            up.set()
    said = records(caplog, "trio_pd.bootstrap")
    assert len(said) == 1, [r.getMessage() for r in said]  # once, not per retry
    assert "connection refused" in said[0].getMessage()
    assert "retrying" in said[0].getMessage()
    assert (dst.kv[:, 10:12] == src.kv[:, 0:2]).all()


async def test_prefill_gives_up_at_its_bootstrap_timeout_with_the_reason(
    engines: tuple[TransferEngine, TransferEngine],
) -> None:
    pe, _ = engines
    config = PrefillConfig(bootstrap_timeout=0.5)
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises((BootstrapError, BaseExceptionGroup)) as info:
        with trio.fail_after(10):
            async with open_prefill(engine=pe, pool=host_pool().spec, bootstrap_url=url,
                                    kv_heads=2, config=config):
                pytest.fail("registered with nobody")
    error = only_error(info.value)
    assert isinstance(error, BootstrapUnreachable), error
    assert "no answer within 0.5 s" in str(error) and "connection refused" in str(error), error


# ------------------------------------------------------------------------ dead or untrusted URLs


@pytest.mark.parametrize("init", [False, True], ids=["before-init", "after-init"])
async def test_a_dead_bootstrap_url_fails_the_room_at_one_deadline_with_the_reason(
    engines: tuple[TransferEngine, TransferEngine], caplog: pytest.LogCaptureFixture, init: bool
) -> None:
    """Nothing listens at the URL: the room fails at ``bootstrap_timeout`` (not twice that),
    and the error and every warning say why: the connection was refused."""
    _, de = engines
    timeout = 1.5
    url = f"http://127.0.0.1:{free_port()}"
    async with open_decode(
        engine=de, pool=host_pool().spec, config=DecodeConfig(bootstrap_timeout=timeout)
    ) as decode:
        t0 = trio.current_time()
        receiver = decode.receiver(1, bootstrap_url=url)
        if init:
            receiver.init(np.arange(2), aux_slot=0)
        with trio.fail_after(4 * timeout):
            assert await receiver.wait() is KVPoll.Failed
        took = trio.current_time() - t0
    assert isinstance(receiver.failure, BootstrapError), receiver.failure
    reason = str(receiver.failure)
    assert "connection refused" in reason and f"within {timeout:g} s" in reason, reason
    # one deadline: the second one, started when the first ran out, is gone (2 x 1.5 s)
    assert took < 1.9 * timeout, took
    warned = [r.getMessage() for r in records(caplog, "trio_pd.decode")]
    assert warned and all("connection refused" in w for w in warned), warned


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a test cert")
async def test_an_untrusted_bootstrap_certificate_fails_at_once_and_says_why(
    engines: tuple[TransferEngine, TransferEngine], tmp_path: Path
) -> None:
    """A certificate the decode rank does not trust is not a service that has not started:
    the room fails at once (its deadline is 30 s), and the error names the certificate
    problem and the option that fixes it."""
    pe, de = engines
    cert, key = self_signed(tmp_path)
    token = "t" * 32
    async with open_bootstrap_server(token=token, certfile=cert, keyfile=key) as boot:
        async with open_decode(engine=de, pool=host_pool().spec, token=token) as decode:
            receiver = decode.receiver(1, bootstrap_url=boot.url)
            with trio.fail_after(10):
                assert await receiver.wait() is KVPoll.Failed
        reason = str(receiver.failure)
        assert "self-signed certificate" in reason and "bootstrap_verify" in reason, reason
        with pytest.raises((BootstrapError, BaseExceptionGroup)) as info:
            with trio.fail_after(10):
                async with open_prefill(engine=pe, pool=host_pool().spec,
                                        bootstrap_url=boot.url, kv_heads=2, token=token):
                    pytest.fail("registered with an untrusted service")
        error = only_error(info.value)
        assert isinstance(error, BootstrapError), error
        assert "self-signed certificate" in str(error), error


# ------------------------------------------------------------------------ IPv6


def _ipv6_loopback() -> str | None:
    """None if this host has ``::1``, else why not."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        return f"no IPv6 loopback here: {exc}"
    return None


needs_ipv6 = pytest.mark.skipif(_ipv6_loopback() is not None, reason=str(_ipv6_loopback()))


@needs_ipv6
async def test_a_control_plane_on_ipv6_binds_and_is_reached() -> None:
    """``host="::1"`` binds ``tcp://[::1]:PORT`` and another plane's PUSH reaches it; an IPv4
    plane still publishes its plain address (not the v4-mapped ``[::ffff:127.0.0.1]``)."""
    got: list[_wire.Message] = []
    arrived = trio.Event()

    def handle(msg: _wire.Message, _pages: object) -> None:
        got.append(msg)
        arrived.set()

    a, b = ControlPlane("::1", Counters()), ControlPlane("[::1]", Counters())
    v4 = ControlPlane("127.0.0.1", Counters())
    try:
        assert a.endpoint.startswith("tcp://[::1]:") and b.heartbeat_endpoint.startswith(
            "tcp://[::1]:"
        )
        assert v4.endpoint.startswith("tcp://127.0.0.1:")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.serve, handle)
            ping = _wire.Ping(v=_wire.WIRE_VERSION, nonce=7, endpoint=b.endpoint)
            assert b.send_nowait(a.endpoint, ping)
            with trio.fail_after(10):
                await arrived.wait()
            nursery.cancel_scope.cancel()
        assert got == [ping]
    finally:
        for plane in (a, b, v4):
            await plane.aclose()


@needs_ipv6
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "curve"])
async def test_ipv6_end_to_end(engine_name: str, secure: bool) -> None:
    """Bootstrap service, prefill and decode on ``::1`` (CURVE too): a request succeeds and
    its bytes arrive. The engines keep their default host here: a Mooncake engine on IPv6
    needs a process of its own (``test_mooncake_on_ipv6_in_a_process_of_its_own``)."""
    token = "ipv6-" + "t" * 32 if secure else None
    src, dst = host_pool(), host_pool()
    src.fill(np.arange(3), room=9)
    pe, de = make_engine(engine_name), make_engine(engine_name)
    try:
        async with (
            open_bootstrap_server(host="::1", token=token, secure=secure) as boot,
            open_prefill(engine=pe, pool=src.spec, bootstrap_url=boot.url, host="::1",
                         kv_heads=2, token=token, secure=secure) as prefill,
            open_decode(engine=de, pool=dst.spec, host="::1", token=token,
                        secure=secure) as decode,
        ):
            assert boot.url.startswith("http://[::1]:")
            assert prefill.endpoint.startswith("tcp://[::1]:")
            assert decode.endpoint.startswith("tcp://[::1]:")
            sender = prefill.sender(9, num_pages=3, aux_slot=0)
            receiver = decode.receiver(9, bootstrap_url=boot.url)
            receiver.init(np.arange(20, 23), aux_slot=2)
            sender.send(np.arange(3), last=True)
            with trio.fail_after(20):
                assert await receiver.wait() is KVPoll.Success, receiver.failure
                assert await sender.wait() is KVPoll.Success, sender.failure
    finally:
        pe.close()
        de.close()
    assert (dst.kv[:, 20:23] == src.kv[:, 0:3]).all()


_MOONCAKE_V6 = """
import os, numpy as np, trio
from trio_pd import ConfigurationError, KVPoll, open_bootstrap_server, open_decode, open_prefill
from trio_pd.engines import make_engine
from trio_pd.testing.pools import HostKVPool

def pool():
    return HostKVPool(layout="mha", num_pages=16, num_layers=2, page_size=4, head_bytes=16,
                      heads=2)

async def main():
    src, dst = pool(), pool()
    src.fill(np.arange(4), room=3)
    pe, de = make_engine("mooncake", host="::1"), make_engine("mooncake", host="::1")
    print("session", pe.session_id, os.environ.get("MC_USE_IPV6"))
    try:
        async with (
            open_bootstrap_server(host="::1") as boot,
            open_prefill(engine=pe, pool=src.spec, bootstrap_url=boot.url, host="::1") as p,
            open_decode(engine=de, pool=dst.spec, host="::1") as d,
        ):
            s = p.sender(3, num_pages=4, aux_slot=0)
            r = d.receiver(3, bootstrap_url=boot.url)
            r.init(np.arange(8, 12), aux_slot=1)
            s.send(np.arange(4), last=True)
            with trio.fail_after(20):
                print("status", (await r.wait()).name, r.failure)
        print("bytes", bool((dst.kv[:, 8:12] == src.kv[:, 0:4]).all()))
    finally:
        pe.close()
        de.close()
    try:
        make_engine("mooncake", host="127.0.0.1")
    except ConfigurationError as exc:
        print("refused", exc)

trio.run(main)
"""


@needs_ipv6
@pytest.mark.processes
def test_mooncake_on_ipv6_in_a_process_of_its_own(tmp_path: Path) -> None:
    """Mooncake reaches its peers over IPv6 only with ``MC_USE_IPV6``, read once per process:
    the first engine on an IPv6 address sets it, a request then succeeds over ``[::1]``, and
    an IPv4 engine in the same process is refused at once with the reason."""
    env = {k: v for k, v in os.environ.items() if k != "MC_USE_IPV6"}
    env["GLOG_minloglevel"] = "2"
    script = tmp_path / "v6.py"
    script.write_text(_MOONCAKE_V6)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
    )
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert lines[0].startswith("session [::1]:") and lines[0].endswith(" 1"), lines
    assert "status Success None" in lines and "bytes True" in lines, lines
    refused = [line for line in lines if line.startswith("refused ")]
    assert refused and "'127.0.0.1' is an IPv4 address" in refused[0], lines
    assert "MC_USE_IPV6" in refused[0]


def test_mooncake_refuses_an_ipv6_host_after_an_ipv4_engine() -> None:
    """This process's Mooncake engines are IPv4 (unless MC_USE_IPV6 was set before the
    first): an engine on an IPv6 address is refused at once, saying why, instead of failing
    every write to its peers."""
    if "MC_USE_IPV6" in os.environ:
        pytest.skip("MC_USE_IPV6 is set: this process's Mooncake engines are IPv6")
    make_engine("mooncake").close()
    with pytest.raises(ConfigurationError, match=r"'::1' is an IPv6 address.*MC_USE_IPV6"):
        make_engine("mooncake", host="::1")


# ------------------------------------------------------------------------ a loopback address seen
# from another host (end to end across two network namespaces: tests/chaos/test_two_hosts.py)


def test_own_addresses_are_told_without_sending_anything() -> None:
    assert is_own_address("127.0.0.1") and is_own_address("127.0.0.2")
    assert not is_own_address("192.0.2.1")  # TEST-NET-1: no host has it
    assert not is_own_address("not-an-address")
    if _ipv6_loopback() is None:
        assert is_own_address("::1")
        assert not is_own_address("2001:db8::1")  # documentation prefix


def test_a_loopback_address_from_another_host_is_named_with_its_option() -> None:
    published = [
        ("this decode rank's control endpoint", "tcp://10.0.0.2:4000", "open_decode(host=)"),
        ("this decode rank's engine session", "10.0.0.2:15001", "make_engine('mooncake', host=)"),
        ("prefill rank 0's control endpoint", "tcp://127.0.0.1:5555", "open_prefill(host=)"),
        ("prefill rank 0's engine session", "127.0.0.1:16000", "make_engine('mooncake', host=)"),
        ("prefill rank 1's control endpoint", "tcp://[::1]:5556", "open_prefill(host=)"),
        ("prefill rank 1's engine session", "trio-pd-0123abcd", "make_engine('nixl', host=)"),
    ]
    problem = loopback_problem(published, "10.0.0.1")
    assert problem is not None
    assert problem.startswith(
        "prefill rank 0's control endpoint is tcp://127.0.0.1:5555; prefill rank 0's engine "
        "session is 127.0.0.1:16000; prefill rank 1's control endpoint is tcp://[::1]:5556: a "
        "loopback address, but the bootstrap service answered from 10.0.0.1, another host"
    ), problem
    assert "Set open_prefill(host=) and make_engine('mooncake', host=) to an address" in problem
    assert loopback_problem(published[:2], "10.0.0.1") is None  # (a NIXL name has no host)
    own = [("this decode rank's control endpoint", "tcp://127.0.0.1:4000", "open_decode(host=)")]
    assert "Set open_decode(host=) to" in str(loopback_problem(own, "10.0.0.1"))
