"""One socket write per response on the router's HTTP server, not two.

Serve's direct ingress runs uvicorn's httptools protocol, which writes a response's status
line and headers as soon as the app sends `http.response.start`, and its body in a
second write. Each write is a send() on the socket: for the small answers of an
inference router the two system calls cost more than anything the router does in Python
for the request. `install` makes the router process's uvicorn hold the head of a response
until its first body message, and write both at once. Nothing else changes: the bytes, their
order, flow control, keep-alive and closing are uvicorn's own. Only responses that declare
their length are held: a stream's head goes out at once, as before.

The patch keys on uvicorn's `RequestResponseCycle.send` and its `transport` attribute; the
unit test runs a real uvicorn server with it, so an upgrade that moves either fails there.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http import httptools_impl

_MARK = "_serve_app_coalesced"


class HeldTransport:
    """Stands in for a connection's transport from a response's start to its first body
    message: writes wait, and go out in one when the cycle flushes (or before a close)."""

    __slots__ = ("pending", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.pending.append(data)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        # A client gone meanwhile: uvicorn writes nothing to it either (and uvloop would raise).
        if pending and not self.transport.is_closing():
            self.transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def _sized(start: Any) -> bool:
    """A response that declares its length: held until its body. A stream's head (server-sent
    events) goes out at once, so its client hears back before the first event is ready."""
    return any(name.lower() == b"content-length" for name, _ in start.get("headers", ()))


def install() -> bool:
    """Patch uvicorn's httptools cycle in this process (once); False if it was already."""
    cycle = httptools_impl.RequestResponseCycle
    if getattr(cycle, _MARK, False):
        return False
    original = cycle.send

    async def send(self: Any, message: Any) -> None:
        held = self.transport
        if not isinstance(held, HeldTransport):
            if message["type"] != "http.response.start" or self.response_started or not _sized(message):
                await original(self, message)
                return
            held = self.transport = HeldTransport(held)
        try:
            await original(self, message)
        except BaseException:
            self.transport = held.transport
            held.flush()
            raise
        if message["type"] != "http.response.start":  # the first body: the head goes out with it
            self.transport = held.transport
            held.flush()

    cycle.send = send  # type: ignore[method-assign]
    setattr(cycle, _MARK, True)
    return True
