"""The replica's end of the link: a unix socket that runs routers' batches on the replica's loop.

Serve's handle call costs both processes a trip through Serve's request machinery and gRPC,
about as long as a small batch's run. A router on the same node can send its batches here
instead: one frame each way, the same handler (`Classifier.run`) behind it. Serve's handle
stays the way in and the fallback: a reply through it names this socket (`LinkAddress`), which
is how routers find it, and whatever the link cannot carry still goes through Serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from serve_app.contract import LinkAddress
from serve_app.link.frames import HELLO_ID, LinkBroken, encode, read_frame

log = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[Any]]


def socket_dir() -> Path:
    """A directory only this user can enter, so only this user's processes reach the sockets."""
    path = Path(tempfile.gettempdir()) / f"serve-app-links-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_uid != os.getuid() or path.stat().st_mode & 0o077:
        raise PermissionError(f"{path} is not private to this user")
    return path


class LinkServer:
    """Runs each call frame as `handler(*args)` and answers with its result or exception.
    Calls on one connection run concurrently and are answered as they finish."""

    def __init__(self, handler: Handler, node_id: str, directory: Path | None = None) -> None:
        self.handler = handler
        self.node_id = node_id
        self.directory = directory
        self.address: LinkAddress | None = None
        self.inflight = 0
        self.closing = False
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._connections: set[asyncio.Task[Any]] = set()  # one task per connection, serving it
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> LinkAddress:
        """Listen (once; later calls return the same address)."""
        if self.address is None:
            path = (self.directory or socket_dir()) / f"{uuid.uuid4().hex}.sock"
            self._server = await asyncio.start_unix_server(self._serve, path=str(path))
            self.address = LinkAddress(str(path), secrets.token_bytes(16), self.node_id)
        return self.address

    async def close(self, grace_s: float) -> None:
        """Stop taking calls, let those running finish (up to `grace_s`), then close. A call that
        arrives meanwhile is answered LinkBroken, which its router sends through Serve instead."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        for writer in list(self._writers):
            writer.close()
        if self._connections:  # each sees its end of stream and returns
            await asyncio.wait(self._connections, timeout=1.0)
        self.remove_socket()

    def remove_socket(self) -> None:
        if self.address is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.address is not None
        self._writers.add(writer)
        if (task := asyncio.current_task()) is not None:
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)
        try:
            call_id, token = await read_frame(reader)
            if call_id != HELLO_ID or not isinstance(token, bytes) or not hmac.compare_digest(token, self.address.token):
                return
            while True:
                call_id, args = await read_frame(reader)
                self._begin()
                asyncio.get_running_loop().create_task(self._answer(call_id, args, writer))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the router went away; its calls still running answer into a closed writer
        except Exception:
            log.exception("link: a connection failed")
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, call_id: int, args: Any, writer: asyncio.StreamWriter) -> None:
        try:
            if self.closing:
                raise LinkBroken("the replica is shutting down")
            body: tuple[bool, Any] = (True, await self.handler(*args))
        except Exception as e:
            body = (False, e)
        finally:
            self._end()
        try:
            frame = encode(call_id, body)
        except Exception as e:  # an unpicklable result: the call fails, not the link
            frame = encode(call_id, (False, RuntimeError(f"link: the reply could not be sent ({type(e).__name__}: {e})")))
        if not writer.is_closing():
            writer.write(frame)

    def _begin(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def _end(self) -> None:
        self.inflight -= 1
        if not self.inflight:
            self._idle.set()
