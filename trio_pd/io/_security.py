"""Authentication: when it is on, the cluster token, CURVE keys, the REGISTER proof and the
ZAP handler that names the key behind every control message (SPEC §6; docs/security.md).

Three mechanisms, each closing one way in:

* **The cluster token** (``token=`` or ``TRIO_PD_TOKEN``) authenticates HTTP without
  crossing it: every ``/route`` request carries :func:`request_mac`, a proof of the token
  over a one-time nonce the service issued and the request, and the bootstrap service
  answers ``401`` without a valid one (or to a replay); every answer carries
  :func:`answer_mac`. So only the cluster can publish a prefill rank, and with it the
  rank's CURVE public key, and nobody on the path can swap that key.
* **ZeroMQ CURVE** encrypts and authenticates the control plane. Every agent makes a keypair
  when it starts; its PULL sockets are CURVE servers, and every PUSH socket it opens is a
  CURVE client that names the peer's public key, so it can only talk to the process that
  holds the matching secret key. The ZAP handler (:func:`serve_zap`, one per ZeroMQ context)
  admits only CURVE clients whose key the agent knows or its bootstrap service vouches for
  (:class:`ZapGate`), and sets the connection's User-Id to the client's public key (z85),
  so every message received can be attributed to a key, and a stranger's never arrives.
* **The REGISTER proof.** CURVE alone lets anyone make a key and connect; what stops a
  stranger's REGISTER is :func:`register_mac`: an HMAC-SHA256 under the cluster token of the
  decode rank's endpoint, key, engine and engine session. A REGISTER whose proof does not
  verify, or whose key is not the key that sent it, is refused (:class:`AuthenticationError`,
  counted ``auth_refused``).

From there the agents check every message against the key that registered: prefill takes a
TRANSFER or an ABORT only from the key that registered its endpoint, and answers a PING only
from a registered key; decode takes a STATUS or an ABORT_ACK only from the key the bootstrap
service published for the prefill rank the room resolved (and a PONG likewise).

:func:`resolve` decides whether it is on: always, unless turned off explicitly
(``secure=False``, or ``TRIO_PD_SECURE=0``), which logs one warning line. The token is
``token=``, or ``TRIO_PD_TOKEN``, or, for a process that binds only loopback, one made in
the process (:func:`process_token`); otherwise a missing token is a
:class:`~trio_pd.ConfigurationError`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import trio
import zmq
import zmq.utils.z85

from ..core._errors import ConfigurationError
from ..core._stats import Counters
from ..core._wire import ip_literal
from ._zmq import Socket

log = logging.getLogger("trio_pd.security")

__all__ = [
    "TOKEN_ENV",
    "SECURE_ENV",
    "ZAP_ENDPOINT",
    "ANSWER_HEADER",
    "AUTH_SCHEME",
    "NONCE_HEADER",
    "STALE_HEADER",
    "Keypair",
    "Security",
    "ZapGate",
    "is_loopback",
    "default_token",
    "process_token",
    "answer_mac",
    "register_mac",
    "request_mac",
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


SECURE_ENV: Final = "TRIO_PD_SECURE"
"""The environment variable read when ``secure=`` is not given: ``0`` (or ``false``, ``off``,
``no``) turns security off explicitly, as ``secure=False`` does; anything else, or unset,
leaves it on."""

_process_token: str | None = None


def process_token() -> str:
    """This process's own cluster token, made (random, 32 bytes) on first use: what every
    agent and bootstrap service of this process proves when no token was given and none is
    in :data:`TOKEN_ENV`, so that one process running both sides (the demo, a test, a
    single-host service) is authenticated with no configuration. Another process never
    knows it: a cluster of several processes shares one through :data:`TOKEN_ENV`."""
    global _process_token
    if _process_token is None:
        _process_token = secrets.token_urlsafe(32)
    return _process_token


def resolve(
    *,
    what: str,
    hosts: Iterable[str],
    token: str | None,
    secure: bool | None,
    generate: bool = True,
) -> Security:
    """Decide security for ``what`` (for messages) binding ``hosts``.

    On unless turned off explicitly: ``secure=False``, or, with ``secure`` left out,
    :data:`SECURE_ENV` set to ``0``; being off is logged, one warning line (the caller's
    ``what``). ``token`` left out is read from :data:`TOKEN_ENV` (empty means none); with
    none there, a process binding only loopback uses :func:`process_token` (one process
    runs every side; ``generate=False`` refuses that, for a service other processes must
    reach), and anything else is a :class:`~trio_pd.ConfigurationError`: CURVE keys that
    travel through an unauthenticated bootstrap service would authenticate nothing. Off,
    the token (given or from the environment), if any, is still proven over HTTP.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is not None and not isinstance(token, str):
        raise ConfigurationError(f"{what}: token must be a str")
    if token == "":
        token = None
    hosts = list(hosts)
    how = "secure=False"
    if secure is None and os.environ.get(SECURE_ENV, "").strip().lower() in _OFF_WORDS:
        secure, how = False, f"{SECURE_ENV}={os.environ[SECURE_ENV]}"
    if secure is False:
        risk = (
            "no token required: anyone who reaches it can publish and read routes"
            if "bootstrap" in what else
            "no CURVE on the control plane, no identity checks: anyone who reaches its "
            "ports can register, forge transfers and read routes"
        )
        log.warning("%s: security is OFF (%s): %s (docs/security.md)", what, how, risk)
        return Security(curve=False, token=token)
    if token is None:
        if generate and all(is_loopback(h) for h in hosts):
            return Security(curve=True, token=process_token())
        where = ", ".join(repr(h) for h in hosts)
        raise ConfigurationError(
            f"{what} binds {where}: authentication is on and needs a cluster token shared "
            f"by every process of the cluster: pass token=... or set {TOKEN_ENV} (the same "
            f"in every process), or pass secure=False (or {SECURE_ENV}=0) to run open"
        )
    return Security(curve=True, token=token)


_OFF_WORDS: Final = frozenset({"0", "false", "off", "no"})


def default_token() -> str | None:
    """The token a client given none proves (a :class:`~trio_pd.BootstrapClient` made
    without ``token=``): :data:`TOKEN_ENV`, else none when :data:`SECURE_ENV` turns
    security off, else :func:`process_token` (the one every service of this process made
    without a token requires)."""
    token = os.environ.get(TOKEN_ENV) or None
    if token is not None:
        return token
    if os.environ.get(SECURE_ENV, "").strip().lower() in _OFF_WORDS:
        return None
    return process_token()


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


AUTH_SCHEME: Final = "TRIO-PD-HMAC"
"""``Authorization: TRIO-PD-HMAC <nonce> <mac>``: a bootstrap request's proof of the token."""
NONCE_HEADER: Final = "x-trio-pd-nonce"
"""The header every answer of a bootstrap service with a token carries: a fresh nonce."""
STALE_HEADER: Final = "x-trio-pd-stale-nonce"
"""On a ``401`` for a nonce the service does not take (expired, or not its own): retry."""
ANSWER_HEADER: Final = "x-trio-pd-answer"
"""The header that authenticates an answer: :func:`answer_mac` for the request's nonce."""


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def request_mac(token: str, nonce: str, method: str, target: bytes, body: bytes) -> str:
    """The proof a bootstrap request carries instead of the token (docs/security.md):
    HMAC-SHA256 under the token of a nonce the service issued, the method, the target (path
    and query string, as sent) and the body's SHA-256. The token itself never travels; a
    proof is good for that one request, once."""
    message = "\x00".join(
        ("trio_pd request v1", nonce, method, target.decode("latin-1"), _digest(body))
    ).encode("utf-8", "surrogateescape")
    return hmac.new(token.encode("utf-8"), message, hashlib.sha256).hexdigest()


def answer_mac(token: str, nonce: str, status: int, body: bytes, next_nonce: str) -> str:
    """The proof on a bootstrap service's answer: HMAC-SHA256 under the token of the
    request's nonce, the status, the body's SHA-256 and the nonce the answer hands out, so
    that an answer cannot be altered (a route's CURVE key swapped), nor one answer passed
    off as another's."""
    message = "\x00".join(
        ("trio_pd answer v1", nonce, str(status), _digest(body), next_nonce)
    ).encode("utf-8", "surrogateescape")
    return hmac.new(token.encode("utf-8"), message, hashlib.sha256).hexdigest()


def check_register_mac(token: str, mac: bytes, **claims: object) -> bool:
    """Does ``mac`` prove ``claims`` (the keyword arguments of :func:`register_mac`)?
    Compared in constant time."""
    want = register_mac(token, **claims)  # type: ignore[arg-type]
    return hmac.compare_digest(want, bytes(mac))


#: a lookup callback: is this z85 key vouched for (by the bootstrap service)?
Vouch = Callable[[str], Awaitable[bool]]


class ZapGate:
    """Who may hold a control-plane session: the allow-list the ZAP handler answers from.

    A CURVE client is admitted when its key is *known* (``known(key)``: a key the agent was
    told by the bootstrap service or a verified REGISTER) or, failing that, *vouched* for by
    ``vouch`` (the prefill side asks its bootstrap service whether a decode rank announced
    the key behind the cluster token). Everyone else is a stranger: refused before its
    handshake completes, so nothing it sends ever reaches the agent (counted
    ``strangers_refused`` and ``auth_refused``, logged at most once per
    :data:`LOG_INTERVAL`).

    Bounded: at most :data:`MAX_LOOKUPS` lookups in flight (a key arriving beyond that is
    refused at once; its client's reconnection asks again), each at most
    :data:`LOOKUP_TIMEOUT` seconds; keys a lookup vouched for and keys it refused are
    remembered in two LRU tables of :data:`MAX_REMEMBERED` keys, a refusal for
    :data:`REFUSAL_TTL` seconds only (a decode rank that announces its key a moment
    later gets in on its next reconnection).
    """

    MAX_LOOKUPS = 8
    LOOKUP_TIMEOUT = 2.0
    MAX_REMEMBERED = 4096
    REFUSAL_TTL = 1.0
    LOG_INTERVAL = 10.0

    def __init__(
        self, counters: Counters, known: Callable[[bytes], bool], vouch: Vouch | None = None
    ) -> None:
        self.counters = counters
        self.known = known
        self.vouch = vouch
        self.lookups = 0
        self._vouched: OrderedDict[bytes, None] = OrderedDict()
        self._refused: OrderedDict[bytes, float] = OrderedDict()
        self._logged_at = -math.inf
        self._unlogged = 0

    def admits_now(self, key: bytes) -> bool | None:
        """True/False when the answer is known without a lookup; None: ask ``vouch``, with
        a lookup slot taken for it (at once: the task that looks up starts later, and the
        requests read meanwhile must see the slot taken); :meth:`look_up` gives it back."""
        if self.known(key) or key in self._vouched:
            if key in self._vouched:
                self._vouched.move_to_end(key)
            return True
        if self.vouch is None:
            return False
        refused_at = self._refused.get(key)
        if refused_at is not None and trio.current_time() - refused_at < self.REFUSAL_TTL:
            return False
        if self.lookups >= self.MAX_LOOKUPS:
            return False
        self.lookups += 1
        return None

    async def look_up(self, key: bytes) -> bool:
        """Ask ``vouch`` about ``key`` (in the slot :meth:`admits_now` took); remember the
        answer. A lookup that fails or takes too long refuses."""
        assert self.vouch is not None
        ok = False
        try:
            with trio.move_on_after(self.LOOKUP_TIMEOUT):
                ok = await self.vouch(key.decode("ascii"))
        except Exception as exc:  # (the service unreachable, a refusal: not vouched)
            log.debug("ZAP lookup of a control key failed: %r", exc)
            await trio.lowlevel.checkpoint()
        finally:
            self.lookups -= 1
        table: OrderedDict[bytes, Any] = self._vouched if ok else self._refused
        table.pop(key, None)
        while len(table) >= self.MAX_REMEMBERED:
            table.popitem(last=False)
        table[key] = None if ok else trio.current_time()
        if ok:
            self._refused.pop(key, None)
        return ok

    def refused(self, why: str) -> None:
        self.counters.bump("strangers_refused")
        self.counters.bump("auth_refused")
        now = trio.current_time()
        if now - self._logged_at < self.LOG_INTERVAL:
            self._unlogged += 1
            return
        more = f" (and {self._unlogged} more not logged)" if self._unlogged else ""
        self._logged_at, self._unlogged = now, 0
        log.warning("refused a control connection: %s%s", why, more)


def _zap_reply(sock: Socket, envelope: list[bytes], request_id: bytes, ok: bool,
               text: bytes, user: bytes = b"") -> None:
    status = b"200" if ok else b"400"
    try:
        sock.send_multipart_nowait([*envelope, b"1.0", request_id, status, text, user, b""])
    except (trio.WouldBlock, trio.ClosedResourceError):  # (that handshake then times out)
        log.debug("a ZAP reply could not be sent")


async def serve_zap(sock: Socket, gate: ZapGate) -> None:
    """Answer libzmq's ZAP requests (RFC 27) on ``sock``, a ROUTER socket bound to
    :data:`ZAP_ENDPOINT` in the context of the CURVE server sockets, until cancelled.

    A CURVE client that ``gate`` admits has its User-Id set to its public key in z85, which
    the control plane reads from each message (``zmq.Frame.get("User-Id")``); any other is
    refused (``400``) and its handshake fails, before any message of it is delivered. Any
    other mechanism (only CURVE servers consult us; a NULL or PLAIN client fails the
    handshake before it gets here) or a malformed request is refused too.

    libzmq's I/O thread never waits for us: it sends the request and goes on, and completes
    the handshake when the answer arrives. A key that needs a lookup is answered by a task
    of its own (a ROUTER socket answers requests in any order), at most
    :attr:`ZapGate.MAX_LOOKUPS` at once, so a slow bootstrap service delays only those
    handshakes (each bounded by the sockets' handshake timeout).

    **Cancellation:** safe at any point; a request left unanswered leaves its handshake
    pending until libzmq's handshake timeout, and the socket is closed by the control plane.
    """
    async with trio.open_nursery() as nursery:
        while True:
            frames = await sock.recv_multipart()
            # routing id, empty delimiter, then version, request id, domain, address,
            # identity, mechanism, credentials...
            if len(frames) < 3 or frames[1] != b"":
                continue  # not a ZAP request: nobody to answer
            envelope, frames = frames[:2], frames[2:]
            request_id = frames[1] if len(frames) > 1 else b""
            if not (len(frames) >= 6 and frames[0] == b"1.0"):
                gate.refused("malformed ZAP request")
                _zap_reply(sock, envelope, request_id, False, b"malformed ZAP request")
                continue
            if not (frames[5] == b"CURVE" and len(frames) == 7 and len(frames[6]) == 32):
                gate.refused("not a CURVE client")
                _zap_reply(sock, envelope, request_id, False, b"only CURVE clients are accepted")
                continue
            key = zmq.utils.z85.encode(frames[6])
            admitted = gate.admits_now(key)
            if admitted is None:
                nursery.start_soon(_answer_after_lookup, sock, gate, envelope, request_id, key)
            elif admitted:
                _zap_reply(sock, envelope, request_id, True, b"OK", key)
            else:
                gate.refused("a CURVE key nobody vouched for")
                _zap_reply(sock, envelope, request_id, False, b"unknown key")


async def _answer_after_lookup(
    sock: Socket, gate: ZapGate, envelope: list[bytes], request_id: bytes, key: bytes
) -> None:
    if await gate.look_up(key):
        _zap_reply(sock, envelope, request_id, True, b"OK", key)
    else:
        gate.refused("a CURVE key the bootstrap service does not vouch for")
        _zap_reply(sock, envelope, request_id, False, b"unknown key")
