"""What our own kernel proves about our TCP connections: that no byte we wrote to a host can
still reach it (the send-queue proof), and that no byte a host still sends us can reach
memory (the receiving fence).

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

What it does not cover, said where the quarantine uses it (:mod:`trio_pd.agents._peers`): an engine
that keeps a failed call's bytes in its own memory and writes them on a connection opened
after the proof; and the bytes the peer's kernel has acknowledged but its engine has not read
yet (the peer reads them into the pages at once; its drain ack, sent after this proof, reaches
it after them).

The same tables give the receiving side its fence (:func:`fence_accepted`). A writer's
bytes that a dead or closing writer still has on their way to us come in on connections our
own process accepted (Mooncake's TCP transport runs in the receiver's process). Shut down
(``shutdown(SHUT_RDWR)``) such a connection, and then see it either gone, no longer held by
this process (the engine saw the end of the stream and closed it: nothing reads it any more),
or past the shutdown with nothing left unread: from then on the kernel answers any byte that
still arrives on it with a reset (a segment with new data on a socket shut for reading, in
FIN_WAIT or LAST_ACK, is refused: RFC 1122; Linux counts it ``TCPAbortOnData``), and no byte
of it can reach memory.

Linux only (``/proc/net/tcp`` and ``/proc/net/tcp6`` of the calling process's network
namespace). Elsewhere :func:`snapshot` returns None: no evidence either way. Where the tables
exist but cannot be read now (no descriptor left, a procfs error), every function here raises
:class:`OSError`: a check that cannot run proves nothing, and is never taken for "drained".
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import time
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DrainWatch", "Row", "fence_accepted", "listening_ports", "parse", "rows", "snapshot"]

#: TCP states (include/net/tcp_states.h) whose send queue tells nothing: the connection cannot
#: send (TIME_WAIT, CLOSE, LISTEN) or has had its FIN, so all its data, acknowledged (FIN_WAIT2)
_QUIET = {"05", "06", "07", "0A"}
#: a connection being opened: data written to it is yet to go (never "seen empty")
_OPENING = {"02", "03"}
_LISTEN = "0A"
#: states in which no new byte can reach a reader any more once nothing is left unread: after
#: our shutdown (FIN_WAIT1, FIN_WAIT2, CLOSING), after the peer's FIN and ours (LAST_ACK),
#: and the closed ones (TIME_WAIT, CLOSE)
_SHUT = {"04", "05", "06", "07", "0B", "09"}

_PROC = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))

#: a connection: (local address, local port, remote address, remote port)
Conn = tuple[str, int, str, int]


@dataclass(frozen=True, slots=True)
class Row:
    """One line of ``/proc/net/tcp`` or ``tcp6``."""

    conn: Conn
    #: the state, as the kernel prints it (two hex digits: "01" ESTABLISHED, "0A" LISTEN)
    state: str
    #: bytes sent and not yet acknowledged by the peer's kernel, and bytes received that no
    #: reader has taken yet
    tx_queue: int
    rx_queue: int
    #: the socket's inode; 0 for a socket no process holds (an orphan, or one still waiting
    #: in a listener's accept queue)
    inode: int


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


def rows(text: str) -> list[Row]:
    """Every connection in ``text`` (the contents of ``/proc/net/tcp`` or ``tcp6``)."""
    out: list[Row] = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        local, remote = _addr(parts[1]), _addr(parts[2])
        tx, rx = (int(q, 16) for q in parts[4].split(":"))
        out.append(Row((*local, *remote), parts[3], tx, rx, int(parts[9])))
    return out


def parse(text: str, hosts: Iterable[str], inodes: Container[int] | None = None) -> dict[Conn, int]:
    """The connections in ``text`` (the contents of ``/proc/net/tcp`` or ``tcp6``) whose remote
    address is one of ``hosts`` (numeric), each with its send queue in bytes, or -1 while it is
    being opened. Connections that cannot carry data any more are left out (see ``_QUIET``),
    and, given ``inodes``, those of sockets neither in it nor orphaned (inode 0)."""
    want = {str(ipaddress.ip_address(h)) for h in hosts}
    out: dict[Conn, int] = {}
    for row in rows(text):
        if row.state in _QUIET or row.conn[2] not in want:
            continue
        if inodes is not None and row.inode != 0 and row.inode not in inodes:
            continue
        out[row.conn] = -1 if row.state in _OPENING else row.tx_queue
    return out


def _own_sockets() -> dict[int, int]:
    """The sockets this process holds open (``/proc/self/fd``): inode -> descriptor. Raises
    :class:`OSError` if the directory cannot be listed (no descriptor left): an empty answer
    would make every connection of ours look like someone else's."""
    out: dict[int, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # (closed meanwhile)
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(fd)
    return out


def _tables() -> list[Row] | None:
    """Every row of this namespace's TCP tables; None if there are none (not Linux).
    :class:`OSError` if they exist but cannot be read now."""
    found = [p for p in _PROC if p.exists()]
    if not found:
        return None
    out: list[Row] = []
    for path in found:
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue  # (tcp6 without IPv6)
        out.extend(rows(text))
    return out


def snapshot(hosts: Iterable[str]) -> dict[Conn, int] | None:
    """:func:`parse` of this network namespace's TCP tables, now, for our own sockets and the
    orphans; None where there are no tables (not Linux). :class:`OSError` where they exist but
    cannot be read now (no descriptor left): the caller must take that as "unknown", never as
    "nothing queued". Blocking reads of procfs: cheap, but run it in a thread, as the tables
    may be large."""
    want = {str(ipaddress.ip_address(h)) for h in hosts}
    table = _tables()
    if table is None:
        return None
    inodes = _own_sockets()
    out: dict[Conn, int] = {}
    for row in table:
        if row.state in _QUIET or row.conn[2] not in want:
            continue
        if row.inode != 0 and row.inode not in inodes:
            continue
        out[row.conn] = -1 if row.state in _OPENING else row.tx_queue
    return out


def listening_ports() -> set[int]:
    """The TCP ports this process listens on now (empty where there are no tables).
    :class:`OSError` if they cannot be read."""
    table = _tables()
    if table is None:
        return set()
    ours = _own_sockets()
    return {row.conn[1] for row in table if row.state == _LISTEN and row.inode in ours}


def fence_accepted(port: int, hosts: Iterable[str], *, bound: float) -> tuple[int, int]:
    """Shut down every connection this process accepted on local ``port`` from one of
    ``hosts`` (numeric), and wait, at most ``bound`` seconds, until none of them can bring
    another byte to a reader (module docstring). Connections still in the listener's accept
    queue are watched too, and shut down once the engine accepts them.

    Returns ``(connections, unresolved)``: how many were fenced, and how many could not be
    seen past the point of no delivery within ``bound`` (0: the fence holds). Blocking (a
    thread): it sleeps between looks. :class:`OSError` if the tables cannot be read, or a
    connection of ours cannot be shut down (no descriptor left to reach it): then nothing is
    proven. Linux only: :class:`OSError` (ENOSYS) where there are no tables."""
    want = {str(ipaddress.ip_address(h)) for h in hosts}

    def look() -> tuple[dict[Conn, Row], dict[int, int]]:
        table = _tables()
        if table is None:
            raise OSError(errno.ENOSYS, "no TCP tables to read (/proc/net/tcp)")
        mine = {
            row.conn: row for row in table
            if row.conn[1] == port and row.conn[2] in want and row.state != _LISTEN
        }
        return mine, _own_sockets()

    first, _ = look()
    targets = {conn for conn, row in first.items() if row.state not in ("06", "07")}
    shut: set[Conn] = set()
    deadline = time.monotonic() + bound
    while True:
        now, ours = look()
        unresolved = 0
        for conn in targets:
            row = now.get(conn)
            if row is None or (row.inode != 0 and row.inode not in ours):
                continue  # gone, or closed by the engine (an orphan now: nothing reads it)
            fd = ours.get(row.inode)
            if fd is not None and conn not in shut:
                _shutdown(fd, row.inode)
                shut.add(conn)
                unresolved += 1
                continue
            if row.inode == 0 and row.state in _SHUT:
                continue  # closed by the engine after our shutdown
            if fd is not None and row.state in _SHUT and row.rx_queue == 0:
                continue  # shut, and every byte it received has been read
            unresolved += 1  # still readable, or waiting to be accepted
        if unresolved == 0 or time.monotonic() >= deadline:
            return len(targets), unresolved
        time.sleep(0.01)


def _shutdown(fd: int, inode: int) -> None:
    """``shutdown(SHUT_RDWR)`` the socket ``inode`` behind descriptor ``fd`` of this process,
    through a duplicate (the engine's descriptor stays valid: its next read ends, and it
    closes it). Nothing if ``fd`` is another socket by now."""
    dup = os.dup(fd)
    try:
        same = os.fstat(dup).st_ino == inode
        sock = socket.socket(fileno=dup) if same else None
    except BaseException:
        os.close(dup)
        raise
    if sock is None:
        os.close(dup)
        return  # closed and the number reused meanwhile: not the connection we meant
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:  # (already reset, or closed meanwhile)
            raise
    finally:
        sock.close()


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
