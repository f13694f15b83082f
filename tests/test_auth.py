"""Authentication and integrity (SPEC §6; docs/security.md; issue 14, "anyone who reaches a
port can take the KV").

With security on (forced on loopback with ``secure=True`` and a token), every attack of the
issue is refused and counted while real requests succeed, verified byte for byte: a forged
REGISTER, TRANSFER, STATUS, ABORT_ACK and route, a plain (non-CURVE) ZeroMQ client, and the
bootstrap service without the token. Where it is cheap, the same attack is shown succeeding
with security off (``test_*_off``), which is how each was seen failing before.

The attacker is a real ZeroMQ CURVE client with a key of its own; it is even given the
victims' public keys (public keys are not secrets), so what stops it is the identity checks,
not ignorance of a key. Synchronisation is on counters (``auth_refused``) the agents bump
when they refuse, polled under ``trio.fail_after``.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import trio
import zmq
import zmq.utils.monitor

from trio_pd import (
    AuthenticationError,
    BootstrapError,
    ConfigurationError,
    DecodeConfig,
    IncompatiblePeer,
    KVPoll,
    PrefillConfig,
    open_bootstrap_server,
    open_decode,
    open_prefill,
)
from trio_pd.bootstrap._bootstrap_client import BootstrapClient, PrefillRankInfo, TokenProof
from trio_pd.core import _wire
from trio_pd.core._stats import Counters
from trio_pd.engines import make_engine
from trio_pd.io._control import ControlPlane
from trio_pd.io._security import (
    Keypair,
    ZapGate,
    answer_mac,
    is_loopback,
    process_token,
    register_mac,
    resolve,
)
from trio_pd.io._zmq import Socket, open_socket

from .helpers.agents import Pair, host_pool, open_pair, poll_until
from .helpers.net import self_signed
from .helpers.peers import raw_push, register, transfer

V = _wire.WIRE_VERSION
TOKEN = "test-cluster-token"


# ------------------------------------------------------------------------ helpers


@asynccontextmanager
async def secure_pair(engine_name: str, **boot: Any) -> AsyncIterator[Pair]:
    """Bootstrap, one prefill and one decode rank on loopback with security forced on."""
    src, dst = host_pool(), host_pool()
    pe, de = make_engine(engine_name), make_engine(engine_name)
    try:
        async with (
            open_bootstrap_server(token=TOKEN, secure=True, **boot) as server,
            open_prefill(
                engine=pe, pool=src.spec, bootstrap_url=server.url, kv_heads=2,
                token=TOKEN, secure=True,
            ) as prefill,
            open_decode(engine=de, pool=dst.spec, token=TOKEN, secure=True) as decode,
        ):
            yield Pair(prefill, decode, src, dst, server.url, pe)
    finally:
        pe.close()
        de.close()


async def request(pair: Pair, room: int, *, src0: int = 0, dst0: int = 100) -> KVPoll:
    """One real 4-page request through both agents; asserts the bytes when it succeeds."""
    src_pages, dst_pages = np.arange(src0, src0 + 4), np.arange(dst0, dst0 + 4)
    aux = room % 32
    pair.src.fill(src_pages, room=room)
    pair.src.fill_aux(aux, room=room)
    sender = pair.prefill.sender(room, num_pages=4, aux_slot=aux)
    receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
    receiver.init(dst_pages, aux)
    sender.send(src_pages[:2])
    sender.send(src_pages[2:], last=True)
    with trio.fail_after(20):
        status = await receiver.wait()
    if status is KVPoll.Success:
        assert pair.verify(room, dst_pages, aux), f"room {room}: bytes differ"
    return status


@asynccontextmanager
async def curve_push(endpoint: str, server_key: str, keys: Keypair) -> AsyncIterator[Socket]:
    """An attacker's CURVE client to ``endpoint``: a key of its own, the victim's public key."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = open_socket(ctx, zmq.PUSH)
    try:
        sock.zsock.curve_serverkey = server_key.encode()
        sock.zsock.curve_publickey = keys.public
        sock.zsock.curve_secretkey = keys.secret
        sock.connect(endpoint)
        yield sock
    finally:
        sock.close()
        ctx.term()


async def announce(url: str, keys: Keypair) -> None:
    """Have the bootstrap service vouch for ``keys`` (a token holder reading a route with its
    key, as a decode rank does): prefill ranks then admit its control connections."""
    async with BootstrapClient(url, token=TOKEN) as client:
        client.announce_key = keys.public_text
        await client.topology()


async def refused(agent: Any, before: int, n: int = 1) -> None:
    """Wait until ``agent`` counted ``n`` more authentication refusals than ``before``."""
    with trio.fail_after(10):
        await poll_until(lambda: agent.statistics().auth_refused >= before + n)


# ------------------------------------------------------------------------ the mechanisms


def test_loopback_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRIO_PD_TOKEN", raising=False)
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "*", "10.0.0.5", "example.com"):
        assert not is_loopback(host), host
    monkeypatch.delenv("TRIO_PD_SECURE", raising=False)
    # on by default everywhere: on loopback with this process's own token (one process
    # runs every side), elsewhere with a token shared by the cluster
    for secure in (None, True):
        sec = resolve(what="x", hosts=["127.0.0.1"], token=None, secure=secure)
        assert sec.on and sec.token == process_token()
    assert len(process_token()) >= 40
    with pytest.raises(ConfigurationError, match="cluster token"):
        resolve(what="x", hosts=["10.0.0.5"], token=None, secure=None)
    with pytest.raises(ConfigurationError, match="cluster token"):  # (another process's)
        resolve(what="x", hosts=["127.0.0.1"], token=None, secure=None, generate=False)
    assert not resolve(what="x", hosts=["10.0.0.5"], token=None, secure=False).on
    monkeypatch.setenv("TRIO_PD_SECURE", "0")
    assert not resolve(what="x", hosts=["10.0.0.5"], token=None, secure=None).on
    assert resolve(what="x", hosts=["127.0.0.1"], token=None, secure=True).on
    monkeypatch.delenv("TRIO_PD_SECURE")
    monkeypatch.setenv("TRIO_PD_TOKEN", "from-env")
    sec = resolve(what="x", hosts=["0.0.0.0"], token=None, secure=None)
    assert sec.on and sec.token == "from-env"


def test_off_is_one_warning_line_per_agent(caplog: pytest.LogCaptureFixture) -> None:
    """Turning security off is an explicit choice that says so: one WARNING line for each
    agent or service that resolves it (and none when it is on)."""
    with caplog.at_level("WARNING", logger="trio_pd.security"):
        resolve(what="prefill rank 0", hosts=["127.0.0.1"], token=None, secure=None)
        assert caplog.records == []
        resolve(what="prefill rank 0", hosts=["127.0.0.1"], token=None, secure=False)
        resolve(what="decode rank 0", hosts=["127.0.0.1"], token=None, secure=False)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("prefill rank 0: security is OFF (secure=False)")
    assert lines[1].startswith("decode rank 0: security is OFF")


async def test_open_outside_loopback_needs_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRIO_PD_TOKEN", raising=False)
    with pytest.raises(ConfigurationError, match="cluster token"):
        async with open_bootstrap_server(host="0.0.0.0"):
            pass  # pragma: no cover
    pool = host_pool()
    eng = make_engine("mooncake")
    try:
        with pytest.raises(ConfigurationError, match="cluster token"):
            async with open_decode(engine=eng, pool=pool.spec, host="10.0.0.5"):
                pass  # pragma: no cover
        with pytest.raises(ConfigurationError, match="cluster token"):
            async with open_prefill(
                engine=eng, pool=pool.spec, bootstrap_url="http://127.0.0.1:1", host="10.0.0.5"
            ):
                pass  # pragma: no cover
    finally:
        eng.close()


async def test_a_wildcard_host_is_refused_where_it_would_be_published() -> None:
    """Agents bind *and publish* ``host`` (route, REGISTER, Mooncake's session id): a
    wildcard would tell peers on other machines to connect to themselves. Refused with a
    ConfigurationError that says what to give instead, before anything binds. (Before:
    ``host="0.0.0.0"`` was accepted and published as ``tcp://0.0.0.0:PORT``.) The bootstrap
    service may listen on a wildcard: its address is not published by it."""
    pool = host_pool()
    eng = make_engine("mooncake")
    try:
        for host in ("0.0.0.0", "::", "[::]", "*", ""):
            with pytest.raises(ConfigurationError, match="wildcard"):
                async with open_decode(engine=eng, pool=pool.spec, host=host, token=TOKEN):
                    pass  # pragma: no cover
            with pytest.raises(ConfigurationError, match="wildcard"):
                async with open_prefill(
                    engine=eng, pool=pool.spec, bootstrap_url="http://127.0.0.1:1", host=host,
                    token=TOKEN,
                ):
                    pass  # pragma: no cover
        with pytest.raises(ConfigurationError, match="wildcard"):
            make_engine("mooncake", host="0.0.0.0")
    finally:
        eng.close()
    async with open_bootstrap_server(host="0.0.0.0", token=TOKEN) as server:
        assert server.port > 0


def test_register_fields_are_left_off_the_wire_when_empty() -> None:
    """An unauthenticated REGISTER is byte for byte what an older peer sends (its decoder
    forbids unknown fields), and an authenticated one round-trips."""
    eng = make_engine("mooncake")
    try:
        plain = register("tcp://127.0.0.1:5", eng, host_pool().spec)
        header = _wire.encode(plain)[0]
        fields = msgspec.msgpack.decode(header)
        assert "control_key" not in fields and "auth" not in fields
        keys = Keypair.generate()
        signed = msgspec.structs.replace(
            plain, control_key=keys.public_text, auth=b"\x01" * 32
        )
        back, _ = _wire.decode(_wire.encode(signed))
        assert back == signed
    finally:
        eng.close()


# ------------------------------------------------------------------------ (a) real requests


async def test_secure_requests_succeed(engine_name: str) -> None:
    async with secure_pair(engine_name) as pair:
        assert pair.prefill.control.curve and pair.decode.control.curve
        for room in range(4):
            assert await request(pair, room, src0=4 * room, dst0=100 + 4 * room) is KVPoll.Success
        for agent in (pair.prefill, pair.decode):
            stats = agent.statistics()
            assert stats.auth_refused == 0 and stats.refused_messages == 0, stats
        peer = pair.prefill.peers.get(pair.decode.endpoint)
        assert peer is not None and peer.key == pair.decode.control.public_key


# ------------------------------------------------------------------------ (b) forged REGISTER


async def test_forged_register_is_refused(engine_name: str) -> None:
    """A REGISTER naming the live decode's endpoint with the attacker's engine session: without
    the token's proof, with a proof under a wrong token, and claiming the decode's own key
    while sent from another. Each is refused and counted; the registration stays the
    decode's, and requests before and after succeed."""
    async with secure_pair(engine_name) as pair:
        assert await request(pair, 1) is KVPoll.Success
        victim = pair.decode.endpoint
        before = pair.prefill.statistics().auth_refused
        attacker, evil = Keypair.generate(), make_engine(engine_name)
        await announce(pair.url, attacker)  # an insider's key: past the handshake
        try:
            forged = register(victim, evil, host_pool().spec)
            mac = register_mac(
                "wrong-token", endpoint=victim, control_key=attacker.public_text,
                engine=evil.name, session=evil.session_id, decode_rank=0, decode_tp=1,
            )
            tries = [
                msgspec.structs.replace(forged, control_key=attacker.public_text),
                msgspec.structs.replace(forged, control_key=attacker.public_text, auth=mac),
                msgspec.structs.replace(forged, control_key=pair.decode.control.public_key),
            ]
            async with curve_push(
                pair.prefill.endpoint, pair.prefill.control.public_key, attacker
            ) as sock:
                for msg in tries:
                    await sock.send_multipart(_wire.encode(msg))
                await refused(pair.prefill, before, len(tries))
        finally:
            evil.close()
        peer = pair.prefill.peers.get(victim)
        assert peer is not None
        assert peer.session == pair.decode.engine.session_id
        assert peer.key == pair.decode.control.public_key
        for room in (2, 3):
            assert await request(pair, room, src0=4 * room) is KVPoll.Success


async def test_forged_register_takes_the_peer_when_off(
    engine_name: str, insecure: None, bootstrap_url: str
) -> None:
    """The same forged REGISTER with security off replaces the decode's registration (the
    issue's attack: every later request's KV would go to the attacker's engine)."""
    async with open_pair(engine_name, bootstrap_url) as pair:
        assert await request(pair, 1) is KVPoll.Success
        evil = make_engine(engine_name)
        try:
            async with raw_push(pair.prefill.endpoint) as sock:
                forged = register(pair.decode.endpoint, evil, host_pool().spec)
                await sock.send_multipart(_wire.encode(forged))
                with trio.fail_after(10):
                    await poll_until(
                        lambda: (p := pair.prefill.peers.get(pair.decode.endpoint)) is not None
                        and p.session == evil.session_id
                    )
        finally:
            evil.close()


# ------------------------------------------------------------------------ (c) forged TRANSFER


async def test_forged_transfer_is_refused(engine_name: str) -> None:
    """A TRANSFER ahead of the real one, naming the decode's registered endpoint (and, second,
    the attacker's own), with pages of the attacker's choosing: refused and counted; the real
    TRANSFER then succeeds and the attacker's pages are untouched."""
    async with secure_pair(engine_name) as pair:
        assert await request(pair, 1) is KVPoll.Success  # decode registered
        room = 9
        pair.src.fill(np.arange(10, 14), room=room)
        pair.src.fill_aux(room, room=room)
        sender = pair.prefill.sender(room, num_pages=4, aux_slot=room)
        target = np.arange(200, 204, dtype=np.int32)  # pages decode holds as free
        before = pair.prefill.statistics().auth_refused
        attacker = Keypair.generate()
        await announce(pair.url, attacker)  # an insider's key: past the handshake
        async with curve_push(
            pair.prefill.endpoint, pair.prefill.control.public_key, attacker
        ) as sock:
            for endpoint in (pair.decode.endpoint, "tcp://127.0.0.1:9"):
                forged = transfer(room, 1234, endpoint, 4, aux_slot=room)
                await sock.send_multipart(_wire.encode(forged, target))
            await refused(pair.prefill, before, 2)
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        dst_pages = np.arange(120, 124)
        receiver.init(dst_pages, room)
        sender.send(np.arange(10, 14), last=True)
        with trio.fail_after(20):
            assert await receiver.wait() is KVPoll.Success
            assert await sender.wait() is KVPoll.Success
        assert pair.verify(room, dst_pages, room)
        assert not pair.dst.kv[:, 200:204].any(), "the attacker's pages were written"


# ------------------------------------------------------------ (d) forged STATUS, ABORT_ACK


async def test_forged_status_and_ack_are_refused(engine_name: str) -> None:
    """A STATUS (Failed, and Success), an ABORT_ACK and a BYE claiming prefill rank 0, for a
    live room, from a key that is not the rank's: refused and counted; the room then
    succeeds."""
    async with secure_pair(engine_name) as pair:
        assert await request(pair, 1) is KVPoll.Success
        room = 5
        receiver = pair.decode.receiver(room, bootstrap_url=pair.url)
        receiver.init(np.arange(130, 134), room)  # the prefill side is not fed yet
        epoch = receiver.epoch
        before = pair.decode.statistics()
        forged: list[_wire.Message] = [
            _wire.Status(v=V, room=room, epoch=epoch, rank=0, ok=False, reason="forged"),
            _wire.Status(v=V, room=room, epoch=epoch, rank=0, ok=True),
            _wire.AbortAck(v=V, room=room, epoch=epoch, rank=0),
            _wire.Bye(v=V, rank=0, endpoint=pair.prefill.endpoint),
        ]
        attacker = Keypair.generate()
        await announce(pair.url, attacker)  # (decode admits prefill ranks' keys only)
        async with curve_push(
            pair.decode.endpoint, pair.decode.control.public_key, attacker
        ) as sock:
            for msg in forged:
                await sock.send_multipart(_wire.encode(msg))
            with trio.fail_after(10):
                await poll_until(
                    lambda: pair.decode.statistics().strangers_refused
                    > before.strangers_refused
                )
        # the same checks as for forged messages: refused before any reached the handler
        after = pair.decode.statistics()
        assert after.refused_messages == before.refused_messages
        assert after.bad_messages == before.bad_messages
        assert receiver.poll() not in (KVPoll.Failed, KVPoll.Success)
        pair.src.fill(np.arange(20, 24), room=room)
        pair.src.fill_aux(room, room=room)
        sender = pair.prefill.sender(room, num_pages=4, aux_slot=room)
        sender.send(np.arange(20, 24), last=True)
        with trio.fail_after(20):
            assert await receiver.wait() is KVPoll.Success
        assert pair.verify(room, np.arange(130, 134), room)


async def test_forged_status_fails_the_room_when_off(
    engine_name: str, insecure: None, bootstrap_url: str
) -> None:
    async with open_pair(engine_name, bootstrap_url) as pair:
        assert await request(pair, 1) is KVPoll.Success
        receiver = pair.decode.receiver(5, bootstrap_url=bootstrap_url)
        receiver.init(np.arange(130, 134), 5)
        async with raw_push(pair.decode.endpoint) as sock:
            forged = _wire.Status(
                v=V, room=5, epoch=receiver.epoch, rank=0, ok=False, reason="forged"
            )
            await sock.send_multipart(_wire.encode(forged))
            with trio.fail_after(10):
                assert await receiver.wait() is KVPoll.Failed
        pair.prefill.sender(5, num_pages=4, aux_slot=5).abort()


# ------------------------------------------------------------------------ (e) the bootstrap service


def _info(tp_rank: int = 0, *, endpoint: str, key: str = "") -> bytes:
    return msgspec.json.encode(
        PrefillRankInfo(
            tp_rank=tp_rank, tp_size=1, endpoint=endpoint, engine="mooncake",
            engine_session="127.0.0.1:1", layout="mha", kv_heads=2, page_size=4,
            control_key=key,
        )
    )


def _refusing_endpoint() -> str:
    """A loopback endpoint nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


async def test_bootstrap_needs_the_token(engine_name: str) -> None:
    async with secure_pair(engine_name) as pair:
        live = pair.prefill.control.public_key
        async with httpx.AsyncClient(base_url=pair.url, trust_env=False) as http:
            body = _info(endpoint=_refusing_endpoint(), key=Keypair.generate().public_text)
            bad = {"authorization": "Bearer nope"}
            assert (await http.put("/route", content=body)).status_code == 401
            assert (await http.put("/route", content=body, headers=bad)).status_code == 401
            assert (await http.get("/route")).status_code == 401
            assert (await http.get("/route", params={"tp_rank": "0"})).status_code == 401
            assert (await http.get("/health")).status_code == 200
            # The squat: the right token, another key, while the real rank 0 is alive.
            squat = await http.put("/route", content=body, auth=TokenProof(TOKEN))
            assert squat.status_code == 409, squat.text
        async with BootstrapClient(pair.url, token=TOKEN) as client:
            assert (await client.rank(0)).control_key == live
        async with BootstrapClient(pair.url) as client:
            with pytest.raises(Exception, match="401"):
                await client.topology()
        assert await request(pair, 3) is KVPoll.Success  # nothing changed for the real ones


async def test_bootstrap_counts_refusals_and_replaces_a_dead_rank() -> None:
    async with (
        open_bootstrap_server(token=TOKEN, secure=True) as server,
        httpx.AsyncClient(base_url=server.url, trust_env=False, auth=TokenProof(TOKEN)) as http,
    ):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        alive = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        key_a, key_b = Keypair.generate().public_text, Keypair.generate().public_text
        try:
            assert (await http.put("/route", content=_info(endpoint=alive, key=key_a))).is_success
            # the same key may re-register; another is refused while the endpoint answers
            assert (await http.put("/route", content=_info(endpoint=alive, key=key_a))).is_success
            again = await http.put("/route", content=_info(endpoint=alive, key=key_b))
            assert again.status_code == 409
        finally:
            listener.close()
        # the old process is gone (its endpoint refuses): a restarted rank takes over
        took = await http.put("/route", content=_info(endpoint=_refusing_endpoint(), key=key_b))
        assert took.is_success, took.text
        async with httpx.AsyncClient(base_url=server.url, trust_env=False) as plain:
            assert (await plain.get("/route", headers={"authorization": "x"})).status_code == 401
        stats = server.statistics()
        assert stats.unauthorized == 1 and stats.refused_replacements == 1, stats


async def test_restarted_prefill_replaces_its_route(engine_name: str) -> None:
    """A prefill restarted on the same bootstrap service has a new CURVE key: its old
    endpoint refuses connections, so its new route is accepted and decode is served."""
    async with open_bootstrap_server(token=TOKEN, secure=True) as server:
        src, dst = host_pool(), host_pool()
        for attempt in range(2):
            pe, de = make_engine(engine_name), make_engine(engine_name)
            try:
                async with (
                    open_prefill(
                        engine=pe, pool=src.spec, bootstrap_url=server.url, kv_heads=2,
                        token=TOKEN, secure=True,
                    ) as prefill,
                    open_decode(engine=de, pool=dst.spec, token=TOKEN, secure=True) as decode,
                ):
                    pair = Pair(prefill, decode, src, dst, server.url, pe)
                    assert await request(pair, 10 + attempt) is KVPoll.Success
            finally:
                pe.close()
                de.close()
        assert server.statistics().refused_replacements == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a test cert")
async def test_bootstrap_over_tls(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    async with open_bootstrap_server(token=TOKEN, certfile=cert, keyfile=key) as server:
        assert server.url.startswith("https://")
        async with BootstrapClient(server.url, token=TOKEN, verify=cert) as client:
            assert await client.health()
            await client.register(
                msgspec.json.decode(_info(endpoint="tcp://127.0.0.1:5"), type=PrefillRankInfo)
            )
            assert (await client.topology()).tp_size == 1
        async with BootstrapClient(server.url, token=TOKEN) as client:  # untrusted cert
            assert not await client.health()


# ------------------------------------------------------------------------ (f) plain ZeroMQ clients


@asynccontextmanager
async def monitored_push(
    endpoint: str, server_key: str | None = None, keys: Keypair | None = None
) -> AsyncIterator[tuple[Socket, zmq.Socket[bytes]]]:
    """A PUSH client (plain, or CURVE with ``server_key``) whose monitor is attached before
    it connects: libzmq stops reconnecting after a protocol error, so a monitor attached
    later may miss the only failed handshake."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = open_socket(ctx, zmq.PUSH)
    mon = sock.zsock.get_monitor_socket()
    try:
        if server_key is not None and keys is not None:
            sock.zsock.curve_serverkey = server_key.encode()
            sock.zsock.curve_publickey = keys.public
            sock.zsock.curve_secretkey = keys.secret
        sock.connect(endpoint)
        yield sock, mon
    finally:
        sock.zsock.disable_monitor()
        mon.close(linger=0)
        sock.close()
        ctx.term()


async def _handshake_fails(mon: zmq.Socket[bytes]) -> None:
    """Wait for a client's monitor to report a failed handshake (polled: the monitor is a
    plain zmq socket used only here)."""
    failed = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    with trio.fail_after(10):
        while True:
            if mon.poll(0):
                event = zmq.utils.monitor.recv_monitor_message(mon)
                if event["event"] & failed:
                    return
            else:
                await trio.sleep(0.01)


async def test_plain_and_wrong_key_clients_never_reach_the_handler(engine_name: str) -> None:
    """A plain ZeroMQ client (no CURVE), and a CURVE client that names the wrong server key,
    fail the handshake: their REGISTER and garbage never reach the handler (no counter moves,
    no peer appears), and real requests still succeed."""
    async with secure_pair(engine_name) as pair:
        assert await request(pair, 1) is KVPoll.Success
        before = pair.prefill.statistics()
        evil = make_engine(engine_name)
        try:
            fake = "tcp://127.0.0.1:7"
            messages = [_wire.encode(register(fake, evil, host_pool().spec)), [b"\xc1garbage"]]
            wrong_key = Keypair.generate().public_text
            for server_key, keys in ((None, None), (wrong_key, Keypair.generate())):
                async with monitored_push(pair.prefill.endpoint, server_key, keys) as (sock, mon):
                    with trio.fail_after(10):
                        for frames in messages:
                            # queued until a handshake completes; waits while the socket has
                            # no pipe yet (its connect not yet made: seen under load)
                            await sock.send_multipart(frames)
                    await _handshake_fails(mon)
        finally:
            evil.close()
        assert await request(pair, 2) is KVPoll.Success
        after = pair.prefill.statistics()
        for name in ("bad_messages", "refused_messages", "handler_errors", "auth_refused"):
            assert getattr(after, name) == getattr(before, name), name
        assert pair.prefill.peers.get(fake) is None


async def test_unauthenticated_message_is_dropped_by_the_plane() -> None:
    """A CURVE plane hands its handler only messages with a User-Id, and the sender's key;
    a handler refusing with AuthenticationError is counted ``auth_refused``."""
    counters = Counters()
    server = ControlPlane("127.0.0.1", counters, keys=Keypair.generate())
    got: list[tuple[str, str]] = []

    def handle(msg: _wire.Message, _pages: Any, sender: str) -> None:
        got.append((type(msg).__name__, sender))
        raise AuthenticationError("no")

    client_keys = Keypair.generate()
    server.admit(client_keys.public_text)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve, handle)
            async with curve_push(server.endpoint, server.public_key, client_keys) as sock:
                ping = _wire.Ping(v=V, nonce=1, endpoint="tcp://127.0.0.1:9")
                await sock.send_multipart(_wire.encode(ping))
                with trio.fail_after(10):
                    await poll_until(lambda: counters["auth_refused"] == 1)
            nursery.cancel_scope.cancel()
        assert got == [("Ping", client_keys.public_text)]
        assert counters["refused_messages"] == 1
        with pytest.raises(AuthenticationError, match="no CURVE key"):
            server.send_nowait("tcp://127.0.0.1:9", ping)  # never to an unauthorised endpoint
    finally:
        with trio.CancelScope(shield=True):
            await server.aclose(linger=0)


async def test_reply_endpoints_cannot_push_out_registered_keys() -> None:
    """Keys for reply endpoints a PING names are bounded apart from registered peers' keys,
    and never replace the key a peer's own endpoint registered with."""
    plane = ControlPlane("127.0.0.1", Counters(), keys=Keypair.generate())
    plane.keyring.MAX_REPLY_KEYS = 8
    try:
        peer, other = Keypair.generate().public_text, Keypair.generate().public_text
        plane.authorize("tcp://127.0.0.1:10", peer)
        plane.authorize("tcp://127.0.0.1:10", other, reply=True)
        for port in range(100, 150):
            plane.authorize(f"tcp://127.0.0.1:{port}", other, reply=True)
        assert plane.keyring._server_keys == {"tcp://127.0.0.1:10": peer.encode()}
        assert len(plane.keyring._reply_keys) == 8
        with pytest.raises(AuthenticationError):
            plane.authorize("tcp://127.0.0.1:11", "not a key")
    finally:
        await plane.aclose(linger=0)


@pytest.mark.serial
async def test_transfer_from_a_dropped_peer_fails_its_room_at_once(engine_name: str) -> None:
    """With authentication on and room for one decode peer: decode A registers, decode B's
    REGISTER drops A (idle), then A sends a TRANSFER for a new room. It comes from the key of
    A's registration, now refused, so it reaches the room, which fails at once with the reason
    (:class:`IncompatiblePeer`: dropped, must register again), not at its bootstrap deadline.
    Before: the TRANSFER was dropped as unauthenticated and the room waited for the deadline."""
    src = host_pool()
    dst_a, dst_b = host_pool(), host_pool()
    engines = [make_engine(engine_name) for _ in range(3)]
    cfg = PrefillConfig(max_decode_peers=1, peer_idle_timeout=0.0)
    try:
        async with (
            open_bootstrap_server(token=TOKEN, secure=True) as server,
            open_prefill(
                engine=engines[0], pool=src.spec, bootstrap_url=server.url, kv_heads=2,
                token=TOKEN, secure=True, config=cfg,
            ) as prefill,
            # A's abort of room 3 is never acked (its registration is gone, so its ABORT is
            # refused): the room's pages stay held, unproven, and A's close stops waiting
            # for it after close_timeout, not the default 10 s
            open_decode(engine=engines[1], pool=dst_a.spec, token=TOKEN, secure=True,
                        config=DecodeConfig(close_timeout=0.5)) as a,
            open_decode(engine=engines[2], pool=dst_b.spec, token=TOKEN, secure=True) as b,
        ):
            pair = Pair(prefill, a, src, dst_a, server.url, engines[0])
            assert await request(pair, 1) is KVPoll.Success  # A registered, served
            pair_b = Pair(prefill, b, src, dst_b, server.url, engines[0])
            assert await request(pair_b, 2, src0=8) is KVPoll.Success  # B took A's slot
            assert prefill.statistics().peers_evicted == 1
            sender = prefill.sender(3, num_pages=2, aux_slot=3)
            receiver = a.receiver(3, bootstrap_url=server.url)
            receiver.init(np.arange(2), 3)
            with trio.fail_after(5):
                assert await sender.wait() is KVPoll.Failed
            assert isinstance(sender.failure, IncompatiblePeer), repr(sender.failure)
            assert "register again" in str(sender.failure)
            assert prefill.statistics().auth_refused == 0
            receiver.abort()
        assert a.statistics().rooms_unproven_at_close == 1  # held: no proof came
    finally:
        for e in engines:
            e.close()


# ------------------------------------------------------------------ (g) strangers at the ZAP gate


async def test_a_strangers_fresh_key_never_holds_a_session(engine_name: str) -> None:
    """A CURVE client with a fresh key (it knows the prefill's public key, as anyone may)
    connects and sends a REGISTER and garbage: its handshake fails at the ZAP handler, so
    nothing it sends reaches the agent (no message counter moves, no peer appears); it is
    counted ``strangers_refused``. Real requests go on. Before the allow-list the ZAP
    handler admitted every key, and the messages reached the handler (refused there)."""
    async with secure_pair(engine_name) as pair:
        assert await request(pair, 1) is KVPoll.Success
        before = pair.prefill.statistics()
        evil = make_engine(engine_name)
        try:
            fake = "tcp://127.0.0.1:7"
            async with monitored_push(
                pair.prefill.endpoint, pair.prefill.control.public_key, Keypair.generate()
            ) as (sock, mon):
                sock.send_multipart_nowait(_wire.encode(register(fake, evil, host_pool().spec)))
                sock.send_multipart_nowait([b"\xc1garbage"])
                with trio.fail_after(10):
                    while True:
                        if mon.poll(0):
                            event = zmq.utils.monitor.recv_monitor_message(mon)
                            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                                break
                        else:
                            await trio.sleep(0.01)
                with trio.fail_after(10):
                    await poll_until(
                        lambda: pair.prefill.statistics().strangers_refused
                        > before.strangers_refused
                    )
        finally:
            evil.close()
        assert await request(pair, 2) is KVPoll.Success
        after = pair.prefill.statistics()
        for name in ("bad_messages", "refused_messages", "handler_errors"):
            assert getattr(after, name) == getattr(before, name), name
        assert pair.prefill.peers.get(fake) is None


async def test_zap_lookups_are_bounded_and_never_stall_known_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plane whose vouch never answers: at most ``MAX_LOOKUPS`` lookups run at once,
    strangers beyond them are refused at once (counted); meanwhile a known key's messages
    arrive (nothing waits on the lookups but the strangers' own handshakes)."""
    # (no lookup may end while the test runs, however slow the host: then none is retried)
    monkeypatch.setattr(ZapGate, "LOOKUP_TIMEOUT", 60.0)
    counters = Counters()
    server = ControlPlane("127.0.0.1", counters, keys=Keypair.generate())
    asked: list[str] = []

    async def vouch(key: str) -> bool:
        asked.append(key)
        await trio.sleep_forever()
        raise AssertionError

    server.vouch = vouch
    friend = Keypair.generate()
    server.admit(friend.public_text)
    got: list[str] = []
    strangers = 12
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve, lambda msg, _p, sender: got.append(sender))
            async with AsyncExitStack() as stack:
                for _ in range(strangers):
                    await stack.enter_async_context(
                        curve_push(server.endpoint, server.public_key, Keypair.generate())
                    )
                with trio.fail_after(10):
                    await poll_until(lambda: len(asked) >= 8)
                    await poll_until(lambda: counters["strangers_refused"] >= strangers - 8)
                async with curve_push(server.endpoint, server.public_key, friend) as sock:
                    ping = _wire.Ping(v=V, nonce=1, endpoint="tcp://127.0.0.1:9")
                    await sock.send_multipart(_wire.encode(ping))
                    with trio.fail_after(5):
                        await poll_until(lambda: got == [friend.public_text])
                assert len(set(asked)) == len(asked) <= 8  # never more than MAX_LOOKUPS
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await server.aclose(linger=0)


async def test_bootstrap_vouches_for_announced_keys_only() -> None:
    """``GET /route?key=`` with the token records a decode rank's key; ``GET /key`` says
    whether the service vouches for one; both need the token."""
    async with open_bootstrap_server(token=TOKEN, secure=True) as server:
        async with BootstrapClient(server.url, token=TOKEN) as client:
            await client.register(
                msgspec.json.decode(_info(endpoint="tcp://127.0.0.1:5"), type=PrefillRankInfo)
            )
            decode, stranger = Keypair.generate(), Keypair.generate()
            assert not await client.vouches(decode.public_text)
            client.announce_key = decode.public_text
            await client.topology()
            assert await client.vouches(decode.public_text)
            assert not await client.vouches(stranger.public_text)
        async with BootstrapClient(server.url, token="wrong") as client:
            client.announce_key = stranger.public_text
            with pytest.raises(Exception, match="401"):
                await client.topology()
        async with BootstrapClient(server.url, token=TOKEN) as client:
            assert not await client.vouches(stranger.public_text)


# ------------------------------------------------- (h) the token proven, never sent (HTTP)


@asynccontextmanager
async def sniffing_proxy(
    target_port: int, swap: tuple[bytes, bytes] | None = None
) -> AsyncIterator[tuple[str, bytearray]]:
    """A TCP proxy on loopback in front of the bootstrap service: yields its URL and every
    byte that crossed it, both ways (what an eavesdropper on the path reads). ``swap``
    replaces bytes in the service's answers (an attacker on the path; same length, so the
    HTTP framing still holds)."""
    wire = bytearray()

    async def pump(src: trio.SocketStream, dst: trio.SocketStream, answers: bool) -> None:
        try:
            while data := await src.receive_some(65536):
                wire.extend(data)
                if answers and swap is not None:
                    data = data.replace(*swap)
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await dst.aclose()

    async def handle(client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream("127.0.0.1", target_port)
        async with client, server, trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, server, False)
            nursery.start_soon(pump, server, client, True)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, handle, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}", wire
        nursery.cancel_scope.cancel()


async def test_the_token_never_crosses_the_wire() -> None:
    """Every request a client makes with the token (register, topology, rank, a key
    lookup, a DP query) is read off loopback by a proxy: the token's bytes are nowhere in
    it, and every request still succeeds. Before the proofs, ``Authorization: Bearer
    <token>`` was in every request."""
    async with (
        open_bootstrap_server(token=TOKEN, secure=True) as server,
        sniffing_proxy(server.port) as (url, wire),
    ):
        async with BootstrapClient(url, token=TOKEN) as client:
            await client.register(
                msgspec.json.decode(_info(endpoint="tcp://127.0.0.1:5"), type=PrefillRankInfo)
            )
            client.announce_key = Keypair.generate().public_text
            assert (await client.topology()).tp_size == 1
            assert (await client.rank(0)).tp_rank == 0
            assert await client.vouches(client.announce_key)
        assert b"/route" in wire and b"TRIO-PD-HMAC" in wire
        assert TOKEN.encode() not in wire
        assert b"Bearer" not in wire


async def test_a_captured_request_replayed_is_refused() -> None:
    """A PUT /route captured on the path (headers and body, byte for byte) and sent again:
    ``401``, counted ``replayed``; the original was taken. A proof for one body does not
    prove another (the body is bound), nor another path."""
    async with open_bootstrap_server(token=TOKEN, secure=True) as server:
        sent: list[httpx.Request] = []

        async def capture(request: httpx.Request) -> None:
            if request.url.path == "/route":
                sent.append(request)

        async with httpx.AsyncClient(
            base_url=server.url, trust_env=False, auth=TokenProof(TOKEN),
            event_hooks={"request": [capture]},
        ) as http:
            body = _info(endpoint="tcp://127.0.0.1:5")
            assert (await http.put("/route", content=body)).status_code == 200
        captured = sent[-1]
        headers = {"authorization": captured.headers["authorization"],
                   "content-type": "application/json"}
        async with httpx.AsyncClient(base_url=server.url, trust_env=False) as raw:
            again = await raw.put("/route", content=captured.content, headers=headers)
            assert again.status_code == 401, again.text
            assert "replayed" in again.text
            assert server.statistics().replayed == 1
            # a fresh nonce, but the captured proof (of another nonce, body or path): refused
            fresh = (await raw.get("/nonce")).headers["x-trio-pd-nonce"]
            proof = captured.headers["authorization"].split(" ")[2]
            forged = {"authorization": f"TRIO-PD-HMAC {fresh} {proof}"}
            assert (await raw.put("/route", content=body, headers=forged)).status_code == 401
        assert server.statistics().unauthorized == 2


async def test_an_altered_answer_is_refused() -> None:
    """An attacker on the path swaps the prefill rank's CURVE key in the route answer for
    its own: the client refuses the answer (its proof no longer holds) rather than take the
    attacker's key. Before, the swapped key was taken, and decode would have encrypted its
    control messages to the attacker."""
    real, evil = Keypair.generate().public_text, Keypair.generate().public_text
    async with open_bootstrap_server(token=TOKEN, secure=True) as server:
        async with BootstrapClient(server.url, token=TOKEN) as client:
            await client.register(msgspec.json.decode(
                _info(endpoint="tcp://127.0.0.1:5", key=real), type=PrefillRankInfo
            ))
        swap = (real.encode(), evil.encode())
        async with (
            sniffing_proxy(server.port, swap=swap) as (url, _),
            BootstrapClient(url, token=TOKEN) as client,
        ):
            with pytest.raises(BootstrapError, match="does not prove"):
                await client.rank(0)
        async with BootstrapClient(server.url, token=TOKEN) as client:
            assert (await client.rank(0)).control_key == real


async def test_a_stale_nonce_is_retried_once() -> None:
    """A nonce the service does not take (expired, or from a service since restarted) is
    answered 401 with a fresh one, which the client uses at once: the call succeeds. A
    wrong token is not retried (one 401 per call)."""
    async with open_bootstrap_server(token=TOKEN, secure=True) as server:
        proof = TokenProof(TOKEN)
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, auth=proof) as http:
            proof._nonces.append(("0.00.00", time.monotonic()))
            body = _info(endpoint="tcp://127.0.0.1:5")
            assert (await http.put("/route", content=body)).status_code == 200
        assert server.statistics().unauthorized == 1
        # the 401 itself is the service's, bound to the nonce the request presented
        async with httpx.AsyncClient(base_url=server.url, trust_env=False) as raw:
            stale = await raw.get("/route", headers={"authorization": "TRIO-PD-HMAC 0.00.00 x"})
        assert stale.status_code == 401 and stale.headers["x-trio-pd-stale-nonce"] == "1"
        assert stale.headers["x-trio-pd-answer"] == answer_mac(
            TOKEN, "0.00.00", 401, stale.content, stale.headers["x-trio-pd-nonce"]
        )
        async with BootstrapClient(server.url, token="wrong") as client:
            with pytest.raises(BootstrapError, match="401"):
                await client.topology()
        assert server.statistics().unauthorized == 3


# ------------------------------------------------------------ (i) on by default, off on purpose


async def test_on_by_default_with_no_configuration(
    engine_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No token anywhere, no ``secure=``, everything on loopback in one process: CURVE is on
    on both agents and the service requires a proof (this process's token), real requests
    succeed, and a stranger is refused at the handshake. Before, loopback ran open."""
    monkeypatch.delenv("TRIO_PD_TOKEN", raising=False)
    monkeypatch.delenv("TRIO_PD_SECURE", raising=False)
    src, dst = host_pool(), host_pool()
    pe, de = make_engine(engine_name), make_engine(engine_name)
    try:
        async with (
            open_bootstrap_server() as server,
            open_prefill(engine=pe, pool=src.spec, bootstrap_url=server.url, kv_heads=2)
            as prefill,
            open_decode(engine=de, pool=dst.spec) as decode,
        ):
            pair = Pair(prefill, decode, src, dst, server.url, pe)
            assert prefill.control.curve and decode.control.curve
            assert await request(pair, 1) is KVPoll.Success
            async with httpx.AsyncClient(base_url=server.url, trust_env=False) as plain:
                assert (await plain.get("/route")).status_code == 401
            before = prefill.statistics().strangers_refused
            async with curve_push(prefill.endpoint, prefill.control.public_key,
                                  Keypair.generate()) as sock:
                await sock.send_multipart([b"\xc1garbage"])
                with trio.fail_after(10):
                    await poll_until(
                        lambda: prefill.statistics().strangers_refused > before
                    )
            assert prefill.statistics().bad_messages == 0
    finally:
        pe.close()
        de.close()


async def test_zap_gate_takes_a_lookup_slot_before_the_lookup_starts() -> None:
    """Many ZAP requests read in one go (before any lookup task has run): no more than
    ``MAX_LOOKUPS`` of them get a lookup; the rest are refused at once, and each slot is
    given back when its lookup ends. (A slot taken only once the task ran let 9 and more
    lookups start.)"""
    async def never(_key: str) -> bool:
        await trio.sleep_forever()
        raise AssertionError

    gate = ZapGate(Counters(), lambda _raw: False, never)
    keys = [Keypair.generate().public for _ in range(12)]
    answers = [gate.admits_now(k) for k in keys]
    assert answers.count(None) == ZapGate.MAX_LOOKUPS and answers.count(False) == 4
    gate.LOOKUP_TIMEOUT = 0.01
    async with trio.open_nursery() as nursery:
        for key, answer in zip(keys, answers, strict=True):
            if answer is None:
                nursery.start_soon(gate.look_up, key)
    assert gate.lookups == 0
