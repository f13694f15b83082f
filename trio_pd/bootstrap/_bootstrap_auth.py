"""The bootstrap service's side of the cluster token (docs/security.md): the nonces it issues,
the proofs it checks (each taken once), and the decode keys it vouches for.

A request to a path that needs the token presents ``Authorization: TRIO-PD-HMAC <nonce>
<proof>``: :meth:`NonceGate.claim` checks the nonce before the body is read (one of ours,
issued under :data:`NONCE_TTL` ago), :meth:`NonceGate.check` the proof once the body is whole
(an HMAC under the token of the nonce, the method, the target and the body's digest; a proof
already taken is a replay). No I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections import OrderedDict
from typing import Final

from hypercorn.typing import HTTPScope

from ..core._errors import ConfigurationError
from ..io._security import AUTH_SCHEME, answer_mac, request_mac, resolve

logger = logging.getLogger("trio_pd.bootstrap")

#: Seconds a nonce the service issued may be used in (once) for a request's proof.
NONCE_TTL: Final = 30.0
#: Most nonces remembered as used at once (each until it expires): requests proven within
#: NONCE_TTL beyond it are answered 401 until some expire.
MAX_USED_NONCES: Final = 262_144
#: Most decode control keys the service vouches for at once (``GET /route?key=``); past it
#: the least recently announced is forgotten.
MAX_VOUCHED_KEYS: Final = 65_536
#: why a request is refused when its nonce is not one of ours or expired (the client may
#: retry once, with the nonce of the answer)
STALE_NONCE: Final = "unknown or expired nonce"


def resolve_auth(
    host: str,
    token: str | None,
    secure: bool | None,
    certfile: str | None,
    keyfile: str | None,
) -> tuple[str | None, tuple[str, str] | None]:
    """The token the service requires (``trio_pd.io._security.resolve``: required outside
    loopback) and its TLS files; :class:`~trio_pd.ConfigurationError` for what cannot
    work."""
    security = resolve(what="bootstrap service", hosts=[host], token=token, secure=secure)
    if (certfile is None) != (keyfile is None):
        raise ConfigurationError("bootstrap service: TLS needs both certfile and keyfile")
    tls = None if certfile is None or keyfile is None else (certfile, keyfile)
    return security.token, tls


def presented_nonce(scope: HTTPScope) -> str:
    """The nonce a request's ``Authorization`` names, valid or not ("" for none)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            parts = value.decode("latin-1").split(" ")
            if len(parts) == 3 and parts[0] == AUTH_SCHEME and len(parts[1]) <= 80:
                return parts[1]
    return ""


class NonceGate:
    """The nonces a service with a cluster token issues and the proofs it takes.

    Nonces are stateless (:meth:`issue`: the issue time and a tag under :attr:`_key`); a
    proof's nonce is remembered as used until it expires, so a captured request replayed is
    refused (counted :attr:`replayed`).
    """

    def __init__(self, token: str | None) -> None:
        #: the cluster token every proof is made under (None: the service checks none, and
        #: only issues nonces)
        self.token = token
        # the key of the nonces this service issues (new per service: a nonce of another
        # service, or of an earlier run of this one, is never ours)
        self._key = os.urandom(32)
        # nonces taken by a proof -> when they expire; oldest first (at most MAX_USED_NONCES)
        self._used: OrderedDict[str, float] = OrderedDict()
        #: ``401`` answers to a proof already taken
        self.replayed = 0

    def issue(self) -> str:
        """A fresh nonce: its issue time (ms, monotonic), 8 random bytes and a tag under a
        key of this service; checked without any state (:meth:`fresh`)."""
        stamp = f"{int(time.monotonic() * 1000):x}.{os.urandom(8).hex()}"
        tag = hmac.new(self._key, stamp.encode("ascii"), hashlib.sha256).hexdigest()
        return f"{stamp}.{tag[:32]}"

    def fresh(self, nonce: str) -> float | None:
        """When ``nonce`` (one of ours, issued under :data:`NONCE_TTL` ago) expires; None
        if it is not one of ours or too old."""
        parts = nonce.split(".")
        if len(parts) != 3 or len(nonce) > 80:
            return None
        stamp = f"{parts[0]}.{parts[1]}"
        tag = hmac.new(self._key, stamp.encode("ascii"), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(tag[:32], parts[2]):
            return None
        try:
            issued = int(parts[0], 16) / 1000
        except ValueError:
            return None
        expires = issued + NONCE_TTL
        return expires if issued <= time.monotonic() < expires else None

    def claim(self, scope: HTTPScope) -> tuple[str, str] | str:
        """The (nonce, proof) an authenticated request presents, or why it is refused
        before its body is read: no proof, or a nonce not ours, or expired."""
        given = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(given) != 1:
            return "no Authorization header"
        parts = given[0].decode("latin-1").split(" ")
        if len(parts) != 3 or parts[0] != AUTH_SCHEME:
            return f"Authorization must be {AUTH_SCHEME} <nonce> <proof>"
        if self.fresh(parts[1]) is None:
            return STALE_NONCE
        return parts[1], parts[2]

    def check(self, scope: HTTPScope, claim: tuple[str, str], body: bytes) -> str | None:
        """Why the request's proof fails (None: it holds). A proof is taken once: its nonce
        is remembered until it expires (at most :data:`MAX_USED_NONCES`; only holders of
        the token can add to them), so a captured request replayed is refused."""
        assert self.token is not None
        nonce, proof = claim
        target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"]
                                      else b"")
        want = request_mac(self.token, nonce, scope["method"], target, body)
        if not hmac.compare_digest(want, proof):
            return "the proof does not verify"
        now = time.monotonic()
        used = self._used
        while used:
            first, expires = next(iter(used.items()))
            if expires > now:
                break
            del used[first]
        if nonce in used:
            self.replayed += 1
            logger.warning("bootstrap: refused a replayed request (%s %s)",
                           scope["method"], scope["path"])
            return "a replayed request"
        if len(used) >= MAX_USED_NONCES:
            return "too many requests in flight; retry"
        until = self.fresh(nonce)
        used[nonce] = now if until is None else until
        return None

    def answer(self, nonce: str, status: int, body: bytes, next_nonce: str) -> str:
        """The service's proof over an answer to a request that presented ``nonce``
        (``x-trio-pd-answer``), which clients check: so they can tell an answer of ours,
        a ``401`` included, from one forged on the way."""
        assert self.token is not None
        return answer_mac(self.token, nonce, status, body, next_nonce)


class VouchedKeys:
    """Decode ranks' CURVE keys announced with ``GET /route?key=K`` (with the token): the
    service vouches for them (``GET /key``), so that prefill ranks admit their control
    connections (docs/security.md). Bounded: at most :data:`MAX_VOUCHED_KEYS`, least
    recently announced first out."""

    def __init__(self) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def vouch(self, key: str) -> None:
        self._keys.pop(key, None)
        while len(self._keys) >= MAX_VOUCHED_KEYS:
            self._keys.popitem(last=False)
        self._keys[key] = None
