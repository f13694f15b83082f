"""Authentication: when it is on, the cluster token, CURVE keys, the REGISTER proof and the
ZAP handler that names the key behind every control message (SPEC §6; docs/security.md).

Three mechanisms, each closing one way in:

* **The cluster token** (``token=`` or ``TRIO_PD_TOKEN``) authenticates HTTP: every
  ``PUT /route`` and ``GET /route`` carries ``Authorization: Bearer <token>``, and the
  bootstrap service answers ``401`` without it. So only the cluster can publish a prefill
  rank, and with it the rank's CURVE public key.
* **ZeroMQ CURVE** encrypts and authenticates the control plane. Every agent makes a keypair
  when it starts; its PULL sockets are CURVE servers, and every PUSH socket it opens is a
  CURVE client that names the peer's public key, so it can only talk to the process that
  holds the matching secret key. The ZAP handler (:func:`serve_zap`, one per ZeroMQ context)
  accepts any CURVE client and sets the connection's User-Id to the client's public key
  (z85), so every message received can be attributed to a key.
* **The REGISTER proof.** CURVE alone lets anyone make a key and connect; what stops a
  stranger's REGISTER is :func:`register_mac`: an HMAC-SHA256 under the cluster token of the
  decode rank's endpoint, key, engine and engine session. A REGISTER whose proof does not
  verify, or whose key is not the key that sent it, is refused (:class:`AuthenticationError`,
  counted ``auth_refused``).

From there the agents check every message against the key that registered: prefill takes a
TRANSFER or an ABORT only from the key that registered its endpoint, and answers a PING only
from a registered key; decode takes a STATUS or an ABORT_ACK only from the key the bootstrap
service published for the prefill rank the room resolved (and a PONG likewise).

:func:`resolve` decides whether it is on: on by default as soon as a host an agent binds is
not loopback (127.0.0.0/8, ::1, ``localhost``); then a missing token is a
:class:`~trio_pd.ConfigurationError` unless ``secure=False`` was passed explicitly.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import trio
import zmq
import zmq.utils.z85

from ._errors import ConfigurationError
from ._stats import Counters
from ._wire import ip_literal
from ._zmq import Socket

log = logging.getLogger("trio_pd.security")

__all__ = [
    "TOKEN_ENV",
    "ZAP_ENDPOINT",
    "Keypair",
    "Security",
    "is_loopback",
    "register_mac",
    "resolve",
    "serve_zap",
]

TOKEN_ENV: Final = "TRIO_PD_TOKEN"
"""The environment variable read for the cluster token when ``token=`` is not given."""

ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler (RFC 27) about every new connection."""

Z85_KEY_CHARS: Final = 40
"""A CURVE public key in z85: 32 bytes, 40 characters."""


def is_loopback(host: str) -> bool:
    """Is ``host`` a loopback address (127.0.0.0/8, ``::1``, optionally bracketed) or
    ``localhost``? A wildcard (``0.0.0.0``, ``::``, ``*``, ``""``) or any other name is not."""
    if host.strip().strip("[]").lower() == "localhost":
        return True
    address = ip_literal(host)
    return address is not None and address.is_loopback


@dataclass(frozen=True, slots=True)
class Keypair:
    """One agent's CURVE keypair, z85 bytes as libzmq takes them."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> Keypair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @property
    def public_text(self) -> str:
        """The public key as published (bootstrap ``control_key``, REGISTER)."""
        return self.public.decode("ascii")


@dataclass(frozen=True, slots=True)
class Security:
    """What :func:`resolve` decided for one agent or bootstrap service."""

    #: CURVE on the control plane, REGISTER proofs and identity checks
    curve: bool
    #: the cluster token, sent (clients) or required (the service) when set
    token: str | None

    @property
    def on(self) -> bool:
        return self.curve


def resolve(
    *, what: str, hosts: Iterable[str], token: str | None, secure: bool | None
) -> Security:
    """Decide security for ``what`` (for error messages) binding ``hosts``.

    ``token`` left out is read from :data:`TOKEN_ENV` (empty means none). ``secure``: None
    turns it on when any host is not loopback; True turns it on; False turns it off
    explicitly (the token, if any, is still sent or required over HTTP). On, without a
    token, raises :class:`~trio_pd.ConfigurationError`: CURVE keys that travel through an
    unauthenticated bootstrap service would authenticate nothing.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is not None and not isinstance(token, str):
        raise ConfigurationError(f"{what}: token must be a str")
    if token == "":
        token = None
    hosts = list(hosts)
    on = secure if secure is not None else not all(is_loopback(h) for h in hosts)
    if on and token is None:
        where = ", ".join(repr(h) for h in hosts)
        raise ConfigurationError(
            f"{what} binds {where}: authentication is on "
            f"({'secure=True' if secure else 'not loopback'}) and needs a cluster token: "
            f"pass token=... or set {TOKEN_ENV}, or pass secure=False to run open"
        )
    return Security(curve=bool(on), token=token)


def register_mac(
    token: str,
    *,
    endpoint: str,
    control_key: str,
    engine: str,
    session: str,
    decode_rank: int,
    decode_tp: int,
) -> bytes:
    """The REGISTER proof: HMAC-SHA256 under the cluster token of what a REGISTER claims.

    It binds the endpoint to the key (so a REGISTER replayed from another key, or naming
    another endpoint, fails) and to the engine session (where the KV goes)."""
    fields = (
        "trio_pd register v1", endpoint, control_key, engine, session,
        str(decode_rank), str(decode_tp),
    )
    message = "\x00".join(fields).encode("utf-8", "surrogateescape")
    return hmac.new(token.encode("utf-8"), message, hashlib.sha256).digest()


def check_register_mac(token: str, mac: bytes, **claims: object) -> bool:
    """Does ``mac`` prove ``claims`` (the keyword arguments of :func:`register_mac`)?
    Compared in constant time."""
    want = register_mac(token, **claims)  # type: ignore[arg-type]
    return hmac.compare_digest(want, bytes(mac))


async def serve_zap(sock: Socket, counters: Counters) -> None:
    """Answer libzmq's ZAP requests (RFC 27) on ``sock``, a REP socket bound to
    :data:`ZAP_ENDPOINT` in the context of the CURVE server sockets, until cancelled.

    Every CURVE client is accepted and its User-Id set to its public key in z85, which the
    control plane reads from each message (``zmq.Frame.get("User-Id")``). Any other
    mechanism (only CURVE servers consult us; a NULL or PLAIN client fails the handshake
    before it gets here) or a malformed request is denied and counted ``auth_refused``.

    libzmq waits for the answer before the connection carries any message, so a handshake
    waits while this task is not scheduled; nothing else does.

    **Cancellation:** safe at any point; a request left unanswered leaves its handshake
    pending, and the socket is closed by the control plane.
    """
    while True:
        frames = await sock.recv_multipart()
        # version, request id, domain, address, routing id, mechanism, credentials...
        request_id = frames[1] if len(frames) > 1 else b""
        status, text, user = b"400", b"malformed ZAP request", b""
        if len(frames) >= 6 and frames[0] == b"1.0":
            mechanism = frames[5]
            if mechanism == b"CURVE" and len(frames) == 7 and len(frames[6]) == 32:
                status, text = b"200", b"OK"
                user = zmq.utils.z85.encode(frames[6])
            else:
                status, text = b"400", b"only CURVE clients are accepted"
        if status != b"200":
            counters.bump("auth_refused")
            log.warning("refused a control connection: %s", text.decode())
        try:
            sock.send_multipart_nowait([b"1.0", request_id, status, text, user, b""])
        except trio.WouldBlock:  # a REP socket that just received can always answer
            log.warning("ZAP reply could not be sent")
