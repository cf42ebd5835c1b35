"""The count of requests waiting unread in this process's sockets, read from the kernel."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator

import pytest

from serve_app.process.unread import UnreadRequests

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="sock_diag is Linux's")


@pytest.fixture
def listeners() -> Iterator[list[socket.socket]]:
    made = []
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        s = socket.socket(family)
        s.bind((host, 0))
        s.listen(16)
        made.append(s)
    yield made
    for s in made:
        s.close()


def _settle() -> None:
    time.sleep(0.05)  # loopback delivers at once; a little room for a loaded machine


def test_it_counts_connections_not_accepted_and_sockets_holding_unread_bytes(listeners: list[socket.socket]):
    first, second, v6 = listeners
    unread = UnreadRequests()
    found = unread.listeners()
    for s in listeners:  # found among this process's own listening sockets, each with its family
        assert (s.family, s.getsockname()[1]) in found
    assert unread.count() == 0
    clients = [socket.create_connection(s.getsockname()[:2]) for s in (first, second, second, v6)]
    _settle()
    assert unread.count() == 0  # connected, nothing sent
    clients[0].sendall(b"POST /v2/models/m/infer HTTP/1.1\r\n")
    _settle()
    assert unread.count() == 1  # a request in a connection not accepted yet
    accepted = [s.accept()[0] for s in (first, second, second, v6)]
    for c in clients[1:]:
        c.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\n")
    _settle()
    assert unread.count() == 4
    accepted[1].recv(1024)
    accepted[3].recv(1024)
    _settle()
    assert unread.count() == 2
    for c in clients + accepted:
        c.close()


def test_only_its_own_ports_count(listeners: list[socket.socket]):
    first, second, _ = listeners
    unread = UnreadRequests([(socket.AF_INET, first.getsockname()[1])])
    client = socket.create_connection(second.getsockname()[:2])
    peer = second.accept()[0]
    client.sendall(b"x")
    _settle()
    assert unread.count() == 0
    mine = socket.create_connection(first.getsockname()[:2])
    mine.sendall(b"x")
    _settle()
    assert unread.count() == 1  # a request in a connection not accepted yet
    for s in (client, peer, mine):
        s.close()
