"""Proof from our own kernel that no byte we wrote to a host can still reach it.

An engine call that failed or timed out is not a proof that its writes are over. Measured on a
20 s partition between two network namespaces (docs/reliability.md, scenario 3): Mooncake's TCP
transport gave up on the call at its 5 s deadline, but kept the connection, with a 16 KiB
block and its header still in the kernel's send queue (``tx_queue`` 0x4018 in
``/proc/net/tcp`` on all four of its connections to the decode's data port, for the whole
outage). When the link came back, TCP retransmitted those bytes and the decode engine wrote
them into pages that had already been handed back: after the peer had answered a probe, and
after the drain ack.

What the kernel does know: a TCP connection's send queue (``tx_queue``: bytes the process
wrote that the peer's kernel has not acknowledged, plus a FIN) is empty at an instant exactly
when every byte written to it before that instant has been received by the peer's kernel.
So once each connection of ours to the peer's host has been *seen* with an empty send queue
(or has gone from the table: reset, or closed with everything acknowledged), nothing written
before the first look can arrive later. "Ours": the sockets this process holds open, and the
orphans of the namespace (closed by their process, still sending; the kernel no longer says
whose they were). A connection still being opened
(SYN_SENT / SYN_RECV) has not been seen empty. Connections that appear while we watch are
watched too (an engine may open one for work it queued before), so the proof is conservative.

What it does not cover, said where the quarantine uses it (:mod:`trio_pd._peers`): an engine
that keeps a failed call's bytes in its own memory and writes them on a connection opened
after the proof; and the bytes the peer's kernel has acknowledged but its engine has not read
yet (the peer reads them into the pages at once; its drain ack, sent after this proof, reaches
it after them).

Linux only (``/proc/net/tcp`` and ``/proc/net/tcp6`` of the calling process's network
namespace). Elsewhere :func:`snapshot` returns None: no evidence either way.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DrainWatch", "parse", "snapshot"]

#: TCP states (include/net/tcp_states.h) whose send queue tells nothing: the connection cannot
#: send (TIME_WAIT, CLOSE, LISTEN) or has had its FIN, so all its data, acknowledged (FIN_WAIT2)
_QUIET = {"05", "06", "07", "0A"}
#: a connection being opened: data written to it is yet to go (never "seen empty")
_OPENING = {"02", "03"}

_PROC = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))

#: a connection: (local address, local port, remote address, remote port)
Conn = tuple[str, int, str, int]


def _addr(text: str) -> tuple[str, int]:
    """``"0100007F:1F90"`` (or 32 hex digits for IPv6) as ``("127.0.0.1", 8080)``: the kernel
    prints each 32-bit word in host byte order (little-endian here). An IPv4-mapped IPv6
    address is given as IPv4."""
    hexip, hexport = text.split(":")
    raw = b"".join(bytes.fromhex(hexip[i : i + 8])[::-1] for i in range(0, len(hexip), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(hexport, 16)


def parse(text: str, hosts: Iterable[str], inodes: Container[int] | None = None) -> dict[Conn, int]:
    """The connections in ``text`` (the contents of ``/proc/net/tcp`` or ``tcp6``) whose remote
    address is one of ``hosts`` (numeric), each with its send queue in bytes, or -1 while it is
    being opened. Connections that cannot carry data any more are left out (see ``_QUIET``),
    and, given ``inodes``, those of sockets neither in it nor orphaned (inode 0)."""
    want = {str(ipaddress.ip_address(h)) for h in hosts}
    out: dict[Conn, int] = {}
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10 or parts[3] in _QUIET:
            continue
        if inodes is not None and parts[9] != "0" and int(parts[9]) not in inodes:
            continue
        remote = _addr(parts[2])
        if remote[0] not in want:
            continue
        local = _addr(parts[1])
        queued = -1 if parts[3] in _OPENING else int(parts[4].split(":")[0], 16)
        out[(local[0], local[1], remote[0], remote[1])] = queued
    return out


def _own_socket_inodes() -> set[int]:
    """The inodes of the sockets this process holds open (``/proc/self/fd``)."""
    inodes: set[int] = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # (closed meanwhile)
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def snapshot(hosts: Iterable[str]) -> dict[Conn, int] | None:
    """:func:`parse` of this network namespace's TCP tables, now, for our own sockets and the
    orphans; None where there are none to read (not Linux). Blocking reads of procfs: cheap,
    but run it in a thread, as the tables may be large."""
    hosts = list(hosts)
    inodes = _own_socket_inodes()
    out: dict[Conn, int] = {}
    read = False
    for path in _PROC:
        try:
            text = path.read_text()
        except OSError:
            continue
        read = True
        out.update(parse(text, hosts, inodes))
    return out if read else None


@dataclass(slots=True)
class DrainWatch:
    """The proof above, built from successive snapshots: :meth:`observe` each, until
    :attr:`drained`. ``pending`` holds the connections not yet seen with an empty send
    queue; a connection absent from a snapshot has closed (or reset) and leaves it."""

    pending: set[Conn] = field(default_factory=set)
    seen: set[Conn] = field(default_factory=set)
    looks: int = 0

    def observe(self, snap: dict[Conn, int]) -> bool:
        self.looks += 1
        for conn, queued in snap.items():
            if conn not in self.seen:
                self.seen.add(conn)
                self.pending.add(conn)
            if queued == 0:
                self.pending.discard(conn)
        # gone from the table: closed with everything acknowledged, or reset; a connection
        # that comes back with the same addresses is a new one
        self.pending.intersection_update(snap)
        self.seen.intersection_update(snap)
        return self.drained

    @property
    def drained(self) -> bool:
        return self.looks > 0 and not self.pending
