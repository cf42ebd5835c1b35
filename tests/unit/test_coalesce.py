"""The router's uvicorn patch (serve_app.router.coalesce) against a real uvicorn server:
one socket write per plain response, and every kind of response still byte-for-byte right."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import uvicorn
from uvicorn.protocols.http import httptools_impl

from serve_app.router import coalesce


class CountingTransport:
    """Counts the writes a cycle makes on its connection."""

    writes: ClassVar[list[bytes]] = []

    def __init__(self, transport: Any) -> None:
        self.transport = transport

    def write(self, data: bytes) -> None:
        CountingTransport.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/fail-after-start":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        raise RuntimeError("boom")
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in (b"one", b"two", b"three"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    body = b"hello " + path.encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    cycle = httptools_impl.RequestResponseCycle
    monkeypatch.setattr(cycle, "send", cycle.send)  # undone after the test, patch and all
    monkeypatch.delattr(cycle, "_serve_app_coalesced", raising=False)
    init = cycle.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.transport = CountingTransport(self.transport)

    monkeypatch.setattr(cycle, "__init__", counting_init)
    assert coalesce.install()
    assert not coalesce.install()  # once per process
    CountingTransport.writes = []
    yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def exchange(port: int, raw: bytes, until: bytes | None = None) -> bytes:
    """What the server sends back: until it closes the connection, or until what it sent ends
    with `until` (never a stretch of silence, which a stalled test machine would cut short)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = b""
    try:
        while until is None or not data.endswith(until):
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        pass
    writer.close()
    return data


def serve_and(port: int, client: Any, asgi: Any = app, before_exit: Any = None) -> Any:
    """Run `client()` against a uvicorn server of `asgi`; `before_exit()` runs before the server
    stops (its shutdown waits for every call still in flight)."""
    config = uvicorn.Config(asgi, host="127.0.0.1", port=port, http="httptools", loop="asyncio", log_level="critical")
    server = uvicorn.Server(config)

    async def main() -> Any:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            return await client()
        finally:
            if before_exit is not None:
                before_exit()
            server.should_exit = True
            await task

    return asyncio.run(main())


def test_a_plain_response_is_one_write_and_keep_alive_holds(patched: None) -> None:
    port = free_port()
    two = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\n\r\n"  # pipelined on one connection
    data = serve_and(port, lambda: exchange(port, two, until=b"hello /b"))
    assert data.count(b"HTTP/1.1 200 OK") == 2
    assert data.endswith(b"hello /b") and b"hello /a" in data
    assert len(CountingTransport.writes) == 2  # one per response: head and body together
    first, second = CountingTransport.writes
    assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"hello /a")
    assert second.startswith(b"HTTP/1.1 200") and second.endswith(b"hello /b")


def test_head_chunks_close_and_failures_are_uvicorns_own(patched: None) -> None:
    port = free_port()

    async def client() -> list[bytes]:
        return [
            await exchange(port, b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n", until=b"0\r\n\r\n"),
            # A GET behind the HEAD on the same connection: whatever the server sent for the HEAD
            # arrives before the GET's answer, so a body it should not have sent would show.
            await exchange(port, b"HEAD /h HTTP/1.1\r\nhost: x\r\n\r\nGET /x HTTP/1.1\r\nhost: x\r\n\r\n", b"hello /x"),
            await exchange(port, b"GET /c HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"),
            await exchange(port, b"GET /fail-after-start HTTP/1.1\r\nhost: x\r\n\r\n"),
        ]

    stream, head, closed, failed = serve_and(port, client)
    assert stream.startswith(b"HTTP/1.1 200 OK") and b"transfer-encoding: chunked" in stream
    # A stream's head is not held for its first chunk (server-sent events reach the client at once).
    assert CountingTransport.writes[0].startswith(b"HTTP/1.1 200") and CountingTransport.writes[0].endswith(b"\r\n\r\n")
    assert stream.endswith(b"3\r\none\r\n3\r\ntwo\r\n5\r\nthree\r\n0\r\n\r\n")
    head_only = head.split(b"HTTP/1.1 200 OK")[1]
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 8" in head_only and head_only.endswith(b"\r\n\r\n")
    assert closed.startswith(b"HTTP/1.1 200 OK") and b"connection: close" in closed and closed.endswith(b"hello /c")
    # The head was held when the app failed: it still goes out before uvicorn closes the connection.
    assert failed.startswith(b"HTTP/1.1 200 OK") and b"content-length: 10" in failed


class Closing:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        assert not self.closing, "written after close (uvloop raises here)"
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing


def test_a_held_head_is_dropped_when_the_client_has_gone() -> None:
    transport = Closing()
    held = coalesce.HeldTransport(transport)  # type: ignore[arg-type]
    held.write(b"head")
    held.write(b"body")
    held.flush()
    assert transport.written == [b"headbody"]
    held.write(b"late head")
    transport.closing = True
    held.flush()
    assert transport.written == [b"headbody"] and held.pending == []
