"""How many of this process's TCP connections hold a request it has not read yet.

When a router's event loop falls behind, the requests it has not reached wait in the kernel: in
the receive buffers of its established connections (HAProxy keeps one per request in flight)
and in its listen backlog. No queue of ours sees them, and a loop's lateness cannot tell them
from a pause that left nobody waiting. The kernel can: Linux's sock_diag netlink interface
(what `ss` reads) reports each TCP socket's unread bytes. Here: the established sockets on the
ports this process listens on whose receive queue is not empty, accepted or still in the
listen backlog.

Only the sockets on our own listening ports are dumped (a filter the kernel runs), so a read
walks the router's connections and no one else's. Elsewhere than Linux, or where netlink is
refused, `count()` answers None and callers go on without it.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
from collections.abc import Callable

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCP_ESTABLISHED, TCP_LISTEN = 1, 10
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_JMP, INET_DIAG_BC_S_GE, INET_DIAG_BC_S_LE = 1, 2, 3

_NLMSGHDR = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBBBI48x")  # inet_diag_req_v2 with a zero socket id
_PORT = struct.Struct("!H")
_RQUEUE_AT, _INODE_AT = 56, 68  # inet_diag_msg offsets: after the 48-byte socket id and the timer
PORTS_RETRY_S = 5.0  # how long to wait before looking again for a listening port not bound yet


def _ports_filter(ports: list[int]) -> bytes:
    """inet_diag bytecode keeping the sockets whose local port is one of `ports`.

    Each op is (code, yes, no) in 4 bytes, a port comparison followed by its operand; the kernel
    steps `yes` bytes when the test holds and `no` bytes when not, and keeps the socket when it
    lands exactly on the program's end. Per port: `sport >= p`, `sport <= p`, then (but for the
    last port) a jump to the end; a failed test jumps to the next port's tests, or past the end
    (rejected) after the last one. Every op is reached by `yes` steps, as the kernel's check of
    the program requires of a jump's target."""
    op = struct.Struct("=BBH")
    program = b""
    for i, port in enumerate(ports):
        last = i == len(ports) - 1
        left = 16 if last else 20  # this port's bytes
        rest = sum(16 if j == len(ports) - 1 else 20 for j in range(i + 1, len(ports)))
        miss_ge = left + rest + 4 if last else left  # from the first test: past the end, or to the next port
        miss_le = left - 8 + rest + 4 if last else left - 8
        program += op.pack(INET_DIAG_BC_S_GE, 8, miss_ge) + op.pack(0, 0, port)
        program += op.pack(INET_DIAG_BC_S_LE, 8, miss_le) + op.pack(0, 0, port)
        if not last:
            program += op.pack(INET_DIAG_BC_JMP, 4, 4 + rest)  # matched: to the end
    return program


def _own_socket_inodes() -> set[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


class UnreadRequests:
    """`count()`: connections on this process's listening TCP ports holding bytes it has not read
    (a request, accepted or not). None where that cannot be read.

    The listening ports are found once (this process's listening sockets, by inode); a port bound
    later (a server that starts after its app) is looked for again every few seconds until one is.
    `listeners` ((family, port) pairs) fixes them instead."""

    def __init__(self, listeners: list[tuple[int, int]] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._listeners = list(listeners) if listeners is not None else []
        self._looked_at = -PORTS_RETRY_S
        self._seq = 0
        self._sock: socket.socket | None = None
        self.available = hasattr(socket, "AF_NETLINK")

    def count(self) -> int | None:
        if not self.available:
            return None
        try:
            listeners = self.listeners()
            if not listeners:
                return None
            families = sorted({family for family, _ in listeners})
            return sum(self._count(family, [p for f, p in listeners if f == family]) for family in families)
        except OSError as e:  # netlink refused (a sandbox, a kernel without sock_diag): stop asking
            if e.errno in (errno.EPERM, errno.EACCES, errno.EPROTONOSUPPORT, errno.ENOENT, errno.EAFNOSUPPORT):
                self.available = False
            self.close()
            return None

    def listeners(self) -> list[tuple[int, int]]:
        """(address family, port) of each TCP port this process listens on. A dump walks the
        kernel's whole table of one family's connections, so its ports are read in one dump a family."""
        if self._listeners:
            return self._listeners
        now = self.clock()
        if now - self._looked_at < PORTS_RETRY_S:
            return []
        self._looked_at = now
        mine = _own_socket_inodes()
        found = set()
        for family in (socket.AF_INET, socket.AF_INET6):
            for _, payload in self._dump(family, 1 << TCP_LISTEN, b""):
                if struct.unpack_from("=I", payload, _INODE_AT)[0] in mine:
                    found.add((family, _PORT.unpack_from(payload, 4)[0]))
        self._listeners = sorted(found)
        return self._listeners

    def _count(self, family: int, ports: list[int]) -> int:
        # A connection not accepted yet is an established socket too, its request in its queue.
        dump = self._dump(family, 1 << TCP_ESTABLISHED, _ports_filter(ports))
        return sum(1 for _, payload in dump if struct.unpack_from("=I", payload, _RQUEUE_AT)[0])

    def _dump(self, family: int, states: int, bytecode: bytes) -> list[tuple[int, memoryview]]:
        """(state, inet_diag_msg) of each TCP socket of `family` in `states` that the bytecode keeps."""
        sock = self._socket()
        self._seq += 1
        attr = struct.pack("=HH", 4 + len(bytecode), INET_DIAG_REQ_BYTECODE) + bytecode if bytecode else b""
        body = _REQ.pack(family, socket.IPPROTO_TCP, 0, 0, states) + attr
        head = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, self._seq, 0)
        sock.send(head + body)
        out: list[tuple[int, memoryview]] = []
        while True:
            data = memoryview(sock.recv(1 << 20))
            at = 0
            while at + _NLMSGHDR.size <= len(data):
                length, kind, _, seq, _ = _NLMSGHDR.unpack_from(data, at)
                if length < _NLMSGHDR.size:
                    raise OSError(errno.EPROTO, "malformed netlink message")
                if seq == self._seq:
                    if kind == NLMSG_DONE:
                        return out
                    if kind == NLMSG_ERROR:
                        code = -struct.unpack_from("=i", data, at + _NLMSGHDR.size)[0]
                        raise OSError(code, os.strerror(code))
                    payload = data[at + _NLMSGHDR.size : at + length]
                    out.append((payload[1], payload))
                at += (length + 3) & ~3

    def _socket(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
