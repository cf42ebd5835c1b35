"""A real uvicorn server on a free port for a test's ASGI app, and a raw HTTP client for it."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn


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


def serve_and(port: int, client: Any, asgi: Any, before_exit: Any = None) -> Any:
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
