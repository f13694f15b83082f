"""Addresses and certificates for tests on loopback."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    """A loopback port nobody listens on (bound, then closed at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def self_signed(tmp: Path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key, in ``tmp``: ``(cert, key)``
    paths (openssl makes them)."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    return str(cert), str(key)
