"""The bootstrap client's HTTP: one pooled httpx client per service, the token's proof on
every request that needs it (:class:`TokenProof`), and each answer read bounded
(:data:`MAX_ANSWER_BYTES`), checked for the service's proof, and turned into the error its
status means (:meth:`Transport.request`).
"""

from __future__ import annotations

import hmac
import os
import socket
import ssl
import time
from collections import deque
from http import HTTPStatus
from typing import Any, Final, TypeVar

import httpx
import msgspec

from ..core._errors import BootstrapError, BootstrapUnreachable, NotReady, UnknownRank
from ..io._security import (
    ANSWER_HEADER,
    AUTH_SCHEME,
    NONCE_HEADER,
    STALE_HEADER,
    answer_mac,
    request_mac,
)

_T = TypeVar("_T")

#: the most bytes of one answer the client reads: a whole topology is at most a few MiB
#: (the service takes a rank's registration of at most 64 KiB), so 32 MiB leaves room for
#: 512 ranks of that size
MAX_ANSWER_BYTES: Final = 32 * 1024 * 1024


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception behind it (causes, contexts, members of groups), nearest
    first, each once."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return seen


def _untrusted(exc: BaseException) -> str | None:
    """What the certificate verification that failed under ``exc`` said, or None."""
    for e in _causes(exc):
        if isinstance(e, ssl.SSLCertVerificationError):
            return str(e.verify_message or e.reason or e)
    return None


def transport_reason(exc: BaseException) -> str:
    """Why a connection failed, in words, from the most telling exception behind ``exc``:
    httpx's own message says only "all attempts to connect ... failed" for a refused
    connection, and nothing at all for a failed TLS handshake."""
    causes = _causes(exc)
    for e in causes:
        if isinstance(e, ssl.SSLCertVerificationError):
            return f"TLS certificate verification failed: {e.verify_message or e.reason}"
    for e in causes:
        if isinstance(e, ssl.SSLError):
            return f"TLS handshake failed: {e.reason or e}"
        if isinstance(e, socket.gaierror):
            return f"cannot resolve the host name ({e.strerror or e})"
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
        if isinstance(e, TimeoutError):
            return "connection timed out"
        if isinstance(e, OSError) and e.errno:
            return os.strerror(e.errno).lower()
    for e in causes:
        if str(e):
            return f"{type(e).__name__}: {e}"
    return type(exc).__name__


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


#: the service's paths that need no proof of the token
OPEN_PATHS: Final = frozenset({"/health", "/metrics", "/nonce"})


class TokenProof(httpx.Auth):
    """httpx authentication that proves the cluster token without sending it
    (docs/security.md): each request to a path that needs the token carries
    ``Authorization: TRIO-PD-HMAC <nonce> <proof>``, :func:`~trio_pd.io._security.request_mac`
    over a one-time nonce the service issued, the method, the target and the body.

    Nonces come from the service's answers (each hands out a fresh one) and, when none is
    left, from ``GET /nonce``; at most :data:`KEEP` are kept, each used only within
    :data:`MAX_AGE` seconds of its arrival (the service takes it for 30). An answer ``401``
    that says the nonce was stale (:data:`~trio_pd.io._security.STALE_HEADER`: expired, or
    issued by a service since restarted) is retried once with the nonce it handed out.
    """

    requires_request_body = True
    KEEP = 16
    MAX_AGE = 10.0

    def __init__(self, token: str) -> None:
        self.token = token
        self._nonces: deque[tuple[str, float]] = deque(maxlen=self.KEEP)

    def keep(self, response: httpx.Response) -> None:
        """Keep the nonce ``response`` hands out, if any."""
        nonce = response.headers.get(NONCE_HEADER)
        if nonce:
            self._nonces.append((nonce, time.monotonic()))

    def _take(self) -> str | None:
        while self._nonces:
            nonce, at = self._nonces.pop()
            if time.monotonic() - at < self.MAX_AGE:
                return nonce
        return None

    def _sign(self, request: httpx.Request, nonce: str) -> None:
        proof = request_mac(
            self.token, nonce, request.method, request.url.raw_path, request.content
        )
        request.headers["authorization"] = f"{AUTH_SCHEME} {nonce} {proof}"

    def auth_flow(self, request: httpx.Request) -> Any:
        if request.url.path in OPEN_PATHS:
            yield request
            return
        nonce = self._take()
        if nonce is None:
            fetch = httpx.Request("GET", request.url.copy_with(path="/nonce", query=None))
            answer = yield fetch
            self.keep(answer)
            nonce = self._take() or ""
        self._sign(request, nonce)
        response = yield request
        if response.status_code == 401 and response.headers.get(STALE_HEADER):
            fresh = response.headers.get(NONCE_HEADER)
            if fresh:  # (its nonce may have expired, or been taken by an earlier try)
                self._sign(request, fresh)
                response = yield request
        self.keep(response)



class Transport:
    """The HTTP to one bootstrap service at ``url`` (no trailing slash) for a
    :class:`~trio_pd.BootstrapClient`: pooled connections, no timeout of its own, proxy
    settings from the environment ignored, the token (None: none) proven on every request
    that needs it and every answer to one checked under it."""

    def __init__(self, url: str, token: str | None, verify: ssl.SSLContext | str | bool) -> None:
        self.url = url
        self.token = token
        # Certificate verification only means something for https; skipping it for plain
        # http avoids loading the CA bundle (~80 ms) for every client.
        plain = httpx.URL(self.url).scheme == "http"
        if isinstance(verify, str):  # a CA bundle (a self-signed service's certificate)
            verify = ssl.create_default_context(cafile=verify)
        #: the IP address the last answer came from (None: none yet)
        self.server_address: str | None = None
        #: the pooled connections (``GET /health`` reads through it directly)
        self.http = httpx.AsyncClient(
            base_url=self.url, timeout=None, trust_env=False, verify=False if plain else verify,
            auth=None if token is None else TokenProof(token),
        )

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request, its answer read whole but kept only up to :data:`MAX_ANSWER_BYTES`:
        past that the answer is a :class:`BootstrapError` (a 400 MiB one used to grow the
        decode process by 800 MiB). One that says it is longer is refused unread; one that
        does not say is read to its end and dropped (leaving httpx's stream half read warns
        of unclosed generators), so a service that never stops is ended by the caller's
        timeout, with at most the bound in memory."""
        too_big = BootstrapError(
            f"{method} {path} on bootstrap service {self.url}: the answer is over "
            f"{MAX_ANSWER_BYTES} bytes"
        )
        try:
            async with self.http.stream(method, path, **kwargs) as streamed:
                stream = streamed.extensions.get("network_stream")
                try:
                    server = stream.get_extra_info("server_addr") if stream else None
                except OSError:  # (the service answered and closed already: ENOTCONN)
                    server = None
                if isinstance(server, tuple) and server:
                    self.server_address = str(server[0])
                declared = streamed.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > MAX_ANSWER_BYTES:
                    raise too_big
                body: bytearray | None = bytearray()
                async for chunk in streamed.aiter_bytes():  # (decoded: a gzip bomb counts)
                    if body is not None:
                        body += chunk
                        if len(body) > MAX_ANSWER_BYTES:
                            body = None  # (what is left is read and dropped)
        except httpx.TransportError as exc:
            untrusted = _untrusted(exc)
            if untrusted is not None:  # (not a service that has not started: no retry helps)
                raise BootstrapError(
                    f"bootstrap service at {self.url}: TLS certificate verification failed: "
                    f"{untrusted} (trust its certificate with bootstrap_verify=, "
                    "docs/security.md)"
                ) from exc
            raise BootstrapUnreachable(
                f"bootstrap service at {self.url} unreachable: {transport_reason(exc)}"
            ) from exc
        if body is None:
            raise too_big
        if self.token is not None and path not in OPEN_PATHS:
            self._check_answer(method, path, streamed, bytes(body))
        response = httpx.Response(
            streamed.status_code, headers=streamed.headers, content=bytes(body),
            request=streamed.request,
        )
        if response.status_code == 200:
            return response
        try:
            reason = msgspec.json.decode(response.content, type=dict[str, Any])["error"]
        except (msgspec.DecodeError, KeyError):
            reason = response.text[:200]
        message = (
            f"{method} {path} on bootstrap service {self.url}: "
            f"{response.status_code} {_phrase(response.status_code)}: {reason}"
        )
        if response.status_code == 503:
            raise NotReady(message)
        if response.status_code == 404 and path == "/route":
            raise UnknownRank(message)
        raise BootstrapError(message)

    def _check_answer(
        self, method: str, path: str, streamed: httpx.Response, body: bytes
    ) -> None:
        """The answer must carry the service's proof of the token, bound to the nonce of
        the request it answers (:func:`~trio_pd.io._security.answer_mac`): otherwise it was not
        the cluster's service that wrote it, or it was altered on the way (a route's CURVE
        key swapped), and it is refused whatever it says."""
        assert self.token is not None
        claim = streamed.request.headers.get("authorization", "").split(" ")
        nonce = claim[1] if len(claim) == 3 else ""
        fresh = streamed.headers.get(NONCE_HEADER, "")
        want = answer_mac(self.token, nonce, streamed.status_code, body, fresh)
        if not hmac.compare_digest(want, streamed.headers.get(ANSWER_HEADER, "")):
            raise BootstrapError(
                f"{method} {path} on bootstrap service {self.url}: the answer "
                f"({streamed.status_code}) does not prove the cluster token (a service "
                "without the token, or an answer altered on the way): refused"
            )

    def decode(self, response: httpx.Response, type_: type[_T]) -> _T:
        try:
            return msgspec.json.decode(response.content, type=type_)
        except msgspec.DecodeError as exc:
            raise BootstrapError(
                f"bootstrap service at {self.url} sent a malformed {type_.__name__}: {exc}"
            ) from exc
