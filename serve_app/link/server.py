"""The replica's end of the link: a unix socket that runs routers' batches on the replica's loop.

Serve's handle call costs both processes a trip through Serve's request machinery and gRPC,
per batch. A router on the same node can send its batches here instead: one frame each way,
the same handler (`Classifier.run`) behind it. Serve's handle stays the way in and the
fallback: a reply through it names this socket (`LinkAddress`), which is how routers find it,
and whatever the link cannot carry still goes through Serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from serve_app.contract import LinkAddress
from serve_app.link.frames import HELLO_TIMEOUT_S, TOKEN_BYTES, LinkBroken, encode, read_frame

log = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[Any]]


def socket_dir() -> Path:
    """A directory only this user can enter, so only this user's processes reach the sockets.
    Not a symlink (another user could have planted one in the shared temp directory), owned by
    this user and closed to others; in a sticky temp directory nobody else can then replace it."""
    path = Path(tempfile.gettempdir()) / f"serve-app-links-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a directory private to this user")
    return path


def sweep_stale(directory: Path, min_age_s: float = 60.0) -> int:
    """Removes the sockets of replicas that died without closing them (killed, or `ray stop`):
    nothing listens on them, so a connect is refused at once. Only sockets older than
    `min_age_s`: a replica starting beside this one has bound its path an instant before it
    listens. Returns how many went."""
    removed, now = 0, time.time()
    for path in directory.glob("*.sock"):
        with contextlib.suppress(FileNotFoundError):
            if now - path.lstat().st_mtime < min_age_s:
                continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.setblocking(False)
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed += 1
            except OSError:  # busy (a full backlog) or anything else: leave it
                pass
    return removed


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
        self._starting: asyncio.Lock | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._connections: set[asyncio.Task[Any]] = set()  # one task per connection, serving it
        self._calls: set[asyncio.Task[None]] = set()  # calls running, held until they answer
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> LinkAddress:
        """Listen (once; later calls return the same address)."""
        if self.address is not None:  # every batch's reply asks
            return self.address
        # Batches on both lanes, or from several routers, can finish their first run together.
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self.address is None:
                directory = self.directory or socket_dir()
                sweep_stale(directory)
                path = directory / f"{uuid.uuid4().hex}.sock"
                self._server = await asyncio.start_unix_server(self._serve, path=str(path))
                self.address = LinkAddress(str(path), secrets.token_bytes(TOKEN_BYTES), self.node_id)
            return self.address

    async def close(self, grace_s: float) -> None:
        """Stop taking calls, let those running finish (up to `grace_s`), then close. A call that
        arrives meanwhile is answered LinkBroken, which its router sends through Serve instead."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(asyncio.TimeoutError):
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
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), HELLO_TIMEOUT_S)
            if not hmac.compare_digest(token, self.address.token):
                return
            while True:
                call_id, args = await read_frame(reader)
                self._begin()
                call = asyncio.get_running_loop().create_task(self._answer(call_id, args, writer))
                self._calls.add(call)
                # Counted out when done, even if cancelled before it ever ran.
                call.add_done_callback(self._ended)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass  # the router went away; its calls still running answer into a closed writer
        except Exception:
            log.exception("link: a connection failed")
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, call_id: int, args: Any, writer: asyncio.StreamWriter) -> None:
        cancelled = False
        try:
            if self.closing:
                raise LinkBroken("the replica is shutting down")
            body: tuple[bool, Any] = (True, await self.handler(*args))
        except asyncio.CancelledError:  # the replica's loop is going: the router sends it elsewhere
            body, cancelled = (False, LinkBroken("the batch was cancelled on the replica")), True
        except Exception as e:
            body = (False, e)
        try:
            frame = encode(call_id, body)
        except Exception as e:  # an unpicklable result: the call fails, not the link
            frame = encode(call_id, (False, RuntimeError(f"link: the reply could not be sent ({type(e).__name__}: {e})")))
        if not writer.is_closing():
            writer.write(frame)
        if cancelled:
            raise asyncio.CancelledError

    def _begin(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def _ended(self, call: asyncio.Task[None]) -> None:
        self._calls.discard(call)
        self.inflight -= 1
        if not self.inflight:
            self._idle.set()
