"""The router's end of the link (see `server`): one connection per replica, calls pipelined on it,
and the choice, per batch, between a replica's link and Serve's handle."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Callable
from typing import Any

from serve_app.contract import BatchReply, LinkAddress
from serve_app.link.frames import LinkBroken, encode, read_frame
from serve_app.scheduling.dispatcher import SendBatch

# How long a link that failed is not learned again from Serve's replies.
BROKEN_S = 60.0


class LinkClient:
    """One connection to one replica's link, opened on the first call."""

    def __init__(self, address: LinkAddress) -> None:
        self.address = address
        self.inflight = 0
        self.broken = False
        self.retiring = False  # no new calls; closed once those in flight have their answers
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._opening: asyncio.Lock | None = None

    async def call(self, *args: Any) -> Any:
        """The handler's result on the replica, or its exception; LinkBroken if the link failed."""
        if self.broken or self.retiring:
            raise LinkBroken("link already closed")
        self.inflight += 1
        try:
            writer = await self._open()
            call_id = next(self._ids)
            self._write(writer, encode(call_id, args))
            # Registered after the write: its answer can only come once this call awaits it, and a
            # write that fails leaves no future behind whose exception nobody would retrieve.
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._pending[call_id] = future
            try:
                ok, value = await future
            finally:
                self._pending.pop(call_id, None)
        finally:
            self.inflight -= 1
            if self.retiring and not self.inflight:
                self.close()
        if not ok:
            raise value
        return value

    def _write(self, writer: asyncio.StreamWriter, frame: bytes) -> None:
        """The frame onto the connection; LinkBroken where the connection closed before the reader
        task saw it (the replica died a moment ago). uvloop raises RuntimeError on a closed
        transport, and asyncio's own loop drops the write: neither may reach the request as a 500."""
        try:
            if writer.is_closing():
                raise ConnectionResetError("the link's connection is closed")
            writer.write(frame)
        except (RuntimeError, OSError) as e:
            self._fail(LinkBroken(f"link: cannot send ({e})"))
            raise LinkBroken(str(e)) from e

    def retire(self) -> None:
        """Take no more calls and close once those in flight are answered: a replica that turned
        one call away (it is shutting down) still finishes the ones it holds."""
        self.retiring = True
        if not self.inflight:
            self.close()

    def close(self) -> None:
        self._fail(LinkBroken("link closed"))

    async def _open(self) -> asyncio.StreamWriter:
        if self._writer is not None:
            return self._writer
        self._opening = self._opening or asyncio.Lock()
        async with self._opening:
            if self.broken:  # another call's connect failed while this one waited
                raise LinkBroken("link closed while opening")
            if self._writer is None:
                try:
                    reader, writer = await asyncio.open_unix_connection(self.address.path)
                except OSError as e:
                    self._fail(LinkBroken(f"link: cannot connect ({e})"))
                    raise LinkBroken(str(e)) from e
                if self.broken:  # closed while connecting: this connection is nobody's
                    writer.close()
                    raise LinkBroken("link closed while opening")
                writer.write(self.address.token)
                self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))
                self._writer = writer
            if self.broken:
                raise LinkBroken("link closed while opening")
            return self._writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        error: Exception = LinkBroken("the replica closed the link")
        try:
            while True:
                call_id, body = await read_frame(reader)
                future = self._pending.get(call_id)
                if future is not None and not future.done():
                    future.set_result(body)
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
            pass
        except Exception as e:  # a frame that cannot be read: nothing after it can be trusted
            error = LinkBroken(f"link: bad frame ({type(e).__name__}: {e})")
        self._fail(error)

    def _fail(self, error: Exception) -> None:
        self.broken = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None and self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()


class LinkedSender:
    """A model's batches from one router: over the link of a replica on this node while one is
    known and has room, else through Serve's handle.

    Replies through Serve name their replica's link, so the links are found as Serve spreads
    batches; one batch through Serve every `discover_s` finds replicas that started since.
    `max_inflight` batches per link, past which Serve's own balancing takes the surplus (on a
    node whose replicas are few against the cluster's, the link would otherwise take all).
    Batches `handle_only` picks (heavy ones, which Serve passes by reference) always go through Serve.
    A batch whose link breaks under it goes through Serve at once: Serve's routing, not the link's,
    knows which replicas live, and the dispatcher's own retry stays for a replica Serve finds dead."""

    def __init__(
        self,
        via_handle: SendBatch,
        router_id: str,
        node_id: str,
        max_inflight: int = 4,
        discover_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        handle_only: Callable[[list[Any]], bool] = lambda payloads: False,
    ) -> None:
        self.via_handle = via_handle
        self.handle_only = handle_only
        self.router_id = router_id
        self.node_id = node_id
        self.max_inflight = max_inflight
        self.discover_s = discover_s
        self.clock = clock
        self.links: dict[str, LinkClient] = {}  # socket path -> client
        self.broken: dict[str, float] = {}  # paths of links that failed -> when: not learned again soon
        self._last_handle = float("-inf")
        self.counts = {"over_link": 0, "through_serve": 0, "link_broken": 0}  # batches, for /router/status

    async def __call__(self, payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None) -> BatchReply:
        link = None if self.handle_only(payloads) else self._pick()
        if link is None:
            return await self._through_serve(payloads, queued, lane, traces)
        try:
            reply = await link.call(payloads, self.router_id, queued, lane, traces)
        except LinkBroken:  # the replica went, or is going: the batch goes through Serve instead
            self.counts["link_broken"] += 1
            self._forget(link)
            return await self._through_serve(payloads, queued, lane, traces)
        self.counts["over_link"] += 1
        return reply

    async def _through_serve(self, payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None) -> BatchReply:
        self._last_handle = self.clock()
        self.counts["through_serve"] += 1
        reply = await self.via_handle(payloads, queued, lane, traces)
        self._learn(reply.link)
        return reply

    def _pick(self) -> LinkClient | None:
        if not self.links or self.clock() - self._last_handle >= self.discover_s:
            return None
        # The least busy; ties broken at random, so that light load spreads too.
        link = min(self.links.values(), key=lambda c: (c.inflight, random.random()))
        return link if link.inflight < self.max_inflight else None

    def _learn(self, address: LinkAddress | None) -> None:
        """A replica's link, if on this node, new, and not one that failed within `BROKEN_S` (a
        replica restarted in place listens on a new path; one this router cannot reach would
        otherwise fail every second)."""
        if address is None or address.node_id != self.node_id or address.path in self.links:
            return
        now = self.clock()
        self.broken = {path: when for path, when in self.broken.items() if now - when < BROKEN_S}
        if address.path not in self.broken:
            self.links[address.path] = LinkClient(address)

    def _forget(self, link: LinkClient) -> None:
        self.links.pop(link.address.path, None)
        self.broken[link.address.path] = self.clock()
        link.retire()

    def snapshot(self) -> dict[str, Any]:
        return {"links": len(self.links), **self.counts}

    def close(self) -> None:
        for link in self.links.values():
            with contextlib.suppress(Exception):
                link.close()
        self.links.clear()
