"""The CURVE keys a control plane knows (docs/security.md): whose key each endpoint we send to
must hold, and which clients our listening sockets admit.

With CURVE off every call here is a no-op and nothing is kept. With it on, a PUSH socket is
made only for an endpoint that :meth:`Keyring.authorize` gave a key (keys from the bootstrap
service or a verified REGISTER, and reply endpoints a PING named), and the ZAP handler
admits only keys :meth:`Keyring.authorize` or :meth:`Keyring.admit` was given. Every table is
bounded, oldest dropped first.
"""

from __future__ import annotations

from collections import OrderedDict

from ..core._errors import AuthenticationError
from ._security import Keypair


class Keyring:
    """Owns one control plane's CURVE keys: our keypair, the key each endpoint we send to
    must hold, and the allow-list of client keys. Closing a socket whose key changed is the
    caller's (:meth:`authorize` says when)."""

    #: most endpoints :meth:`authorize` remembers a key for (oldest forgotten first), for
    #: registered peers and for reply endpoints (``reply=True``)
    MAX_KEYS = 65_536
    MAX_REPLY_KEYS = 4096

    def __init__(self, keys: Keypair | None) -> None:
        #: CURVE on: our keypair (None: CURVE off, every call here a no-op)
        self.keys = keys
        #: endpoint -> the peer's CURVE public key (z85), most recently authorised last: keys
        #: from the bootstrap service or a verified REGISTER, and (bounded apart, so that
        #: they cannot push those out) reply endpoints a PING named
        self._server_keys: OrderedDict[str, bytes] = OrderedDict()
        self._reply_keys: OrderedDict[str, bytes] = OrderedDict()
        #: keys whose clients the ZAP handler admits (LRU, at most MAX_KEYS + MAX_REPLY_KEYS):
        #: every key :meth:`authorize` or :meth:`admit` was given
        self._admitted: OrderedDict[bytes, None] = OrderedDict()

    def authorize(self, endpoint: str, key: str, *, reply: bool = False) -> bool:
        """With CURVE on, sends to ``endpoint`` go to the holder of public key ``key`` (z85)
        only; True when that replaces another key (the endpoint's socket must then be
        closed, so that the next send makes one for the new key). No-op with CURVE off.
        Bounded, oldest dropped first: :data:`MAX_KEYS` for peers' own endpoints, and apart
        from them :data:`MAX_REPLY_KEYS` for reply endpoints a peer named (``reply=True``: a
        PING's), so that a peer naming many cannot push a registered peer's key out."""
        if self.keys is None:
            return False
        raw = key.encode("ascii")
        if len(raw) != 40:
            raise AuthenticationError(f"{endpoint}: not a z85 CURVE public key: {key!r}")
        table, bound = (
            (self._reply_keys, self.MAX_REPLY_KEYS) if reply else
            (self._server_keys, self.MAX_KEYS)
        )
        if reply and endpoint in self._server_keys:
            return False  # a peer's own endpoint keeps the key it registered with
        old = self.server_key(endpoint)
        self._reply_keys.pop(endpoint, None)
        table.pop(endpoint, None)
        while len(table) >= bound:
            table.popitem(last=False)
        table[endpoint] = raw
        self._admit(raw)
        return old is not None and old != raw

    def server_key(self, endpoint: str) -> bytes | None:
        """The key the holder of ``endpoint`` must prove (None: none authorised)."""
        return self._server_keys.get(endpoint) or self._reply_keys.get(endpoint)

    def admit(self, key: str) -> None:
        """With CURVE on, let the holder of ``key`` (z85) hold a session with our sockets
        (the ZAP handler's allow-list; :meth:`authorize` admits its key too). Bounded, least
        recently admitted forgotten first. No-op with CURVE off."""
        if self.keys is None:
            return
        raw = key.encode("ascii")
        if len(raw) != 40:
            raise AuthenticationError(f"not a z85 CURVE public key: {key!r}")
        self._admit(raw)

    def _admit(self, raw: bytes) -> None:
        self._admitted.pop(raw, None)
        while len(self._admitted) >= self.MAX_KEYS + self.MAX_REPLY_KEYS:
            self._admitted.popitem(last=False)
        self._admitted[raw] = None

    def admits(self, raw: bytes) -> bool:
        """Is the z85 key ``raw`` on the allow-list (without asking the plane's vouch)?"""
        return raw in self._admitted
