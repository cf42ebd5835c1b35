"""The same-node link (serve_app.link): a real unix socket between a server and clients on one
loop, no Ray. The handler stands in for `Classifier.run`."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serve_app.contract import BatchReply, LinkAddress
from serve_app.errors import InvalidInput
from serve_app.link.client import BROKEN_S, LinkClient, LinkedSender
from serve_app.link.frames import LinkBroken, encode
from serve_app.link.server import LinkServer, socket_dir, sweep_stale

UNPICKLED: list[str] = []


def _tripped() -> str:
    UNPICKLED.append("tripped")
    return "tripped"


class Tripwire:
    """Records its own unpickling."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _tripped, ()


class Replica:
    """A handler that answers each payload doubled, after `delay_s`; records the router ids.
    Every batch waits while `release` is clear; one whose first payload is "held" also waits for
    `held`."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.routers: list[str] = []
        self.release = asyncio.Event()
        self.release.set()
        self.held = asyncio.Event()

    async def run(self, payloads: list[Any], router: str, queued: int, lane: str, traces: Any) -> BatchReply:
        self.routers.append(router)
        await self.release.wait()
        if payloads and isinstance(payloads[0], str) and payloads[0] == "held":
            await self.held.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if payloads and isinstance(payloads[0], str) and payloads[0] == "boom":
            raise InvalidInput("bad payload")
        return BatchReply([p * 2 for p in payloads], 0.0, 0.001)


def serve(tmp_path: Path, replica: Replica, node: str = "n1") -> LinkServer:
    return LinkServer(replica.run, node, directory=tmp_path)


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Polls the loop's own progress (no fixed sleeps a loaded machine could outrun)."""
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.005)


def done_soon(awaitable: Any) -> Any:
    return asyncio.wait_for(awaitable, 10.0)


def test_calls_come_back_with_their_own_results_in_any_order(tmp_path: Path) -> None:
    async def main() -> None:
        replica = Replica()
        server = serve(tmp_path, replica)
        first, second = await asyncio.gather(server.start(), server.start())  # two batches' first answers at once
        assert first == second and len(list(tmp_path.glob("*.sock"))) == 1
        client = LinkClient(first)
        held = asyncio.ensure_future(client.call(["held"], "r1", 0, "bulk", None))
        await until(lambda: server.inflight == 1)
        arrays = await done_soon(client.call([np.arange(3)], "r1", 0, "bulk", None))  # overtakes the held call
        assert np.array_equal(arrays.results[0], np.arange(3) * 2) and not held.done()
        replica.held.set()
        assert (await done_soon(held)).results == ["heldheld"]
        assert client.inflight == 0 and server.inflight == 0
        client.close()
        await server.close(1.0)
        assert not list(tmp_path.glob("*.sock"))

    asyncio.run(main())


def test_the_handlers_exception_reaches_the_caller_and_the_link_stays_up(tmp_path: Path) -> None:
    async def main() -> None:
        server = serve(tmp_path, Replica())
        client = LinkClient(await server.start())
        with pytest.raises(InvalidInput, match="bad payload"):
            await done_soon(client.call(["boom"], "r", 0, "bulk", None))
        assert (await done_soon(client.call([5], "r", 0, "bulk", None))).results == [10]
        client.close()
        await server.close(1.0)

    asyncio.run(main())


def test_a_connection_without_the_token_is_not_served(tmp_path: Path) -> None:
    async def main() -> None:
        replica = Replica()
        server = serve(tmp_path, replica)
        address = await server.start()
        wrong = LinkClient(LinkAddress(address.path, b"not the token", address.node_id))
        with pytest.raises(LinkBroken):
            await done_soon(wrong.call([1], "intruder", 0, "bulk", None))
        assert replica.routers == [] and wrong.broken
        # A raw connection that sends a call frame first, without the token, is closed, and
        # nothing it sent is unpickled (loading `Tripwire` would record it).
        reader, writer = await asyncio.open_unix_connection(address.path)
        writer.write(encode(7, (Tripwire(), "raw", 0, "bulk", None)))
        assert await done_soon(reader.read()) == b""
        assert replica.routers == [] and UNPICKLED == []
        writer.close()
        await server.close(1.0)

    asyncio.run(main())


def test_a_connection_that_never_sends_its_whole_token_is_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("serve_app.link.server.HELLO_TIMEOUT_S", 0.2)

    async def main() -> None:
        server = serve(tmp_path, Replica())
        address = await server.start()
        reader, writer = await asyncio.open_unix_connection(address.path)
        writer.write(address.token[:5])  # then silence
        assert await done_soon(reader.read()) == b""
        writer.close()
        await server.close(1.0)

    asyncio.run(main())


def test_the_socket_directory_is_private_to_its_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    path = socket_dir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700 and path.stat().st_uid == os.getuid()
    os.chmod(path, 0o777)  # someone opened it up: no socket goes there
    with pytest.raises(PermissionError):
        socket_dir()
    # A symlink planted where the directory goes, even to a private directory of this user's.
    path.rmdir()
    private = tmp_path / "elsewhere"
    private.mkdir(mode=0o700)
    path.symlink_to(private)
    with pytest.raises(PermissionError):
        socket_dir()


def test_calls_in_flight_fail_as_link_broken_when_the_replica_goes(tmp_path: Path) -> None:
    async def main() -> None:
        replica = Replica()
        replica.release.clear()  # the batch never finishes: the replica dies under it
        server = serve(tmp_path, replica)
        client = LinkClient(await server.start())
        call = asyncio.ensure_future(client.call([1], "r", 0, "bulk", None))
        await until(lambda: server.inflight == 1)
        for writer in list(server._writers):  # what the process's death does to its sockets
            writer.transport.abort()
        with pytest.raises(LinkBroken):
            await done_soon(call)
        with pytest.raises(LinkBroken):
            await done_soon(client.call([1], "r", 0, "bulk", None))
        replica.release.set()
        await server.close(1.0)

    asyncio.run(main())


class DeadWriter:
    """A connection that closed under the client before its reader task saw it: `closing` as
    asyncio's transports say it, or not yet, with a write that raises as uvloop's then does."""

    def __init__(self, closing: bool) -> None:
        self.closing = closing
        self.closed = False

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        raise RuntimeError("unable to perform operation on <UnixTransport closed=True>; the handler is closed")

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("closing", [True, False])
def test_a_call_on_a_connection_that_just_closed_is_link_broken(tmp_path: Path, closing: bool) -> None:
    async def main() -> None:
        replica = Replica()
        server = serve(tmp_path, replica)
        client = LinkClient(await server.start())
        assert (await done_soon(client.call([1], "r", 0, "bulk", None))).results == [2]
        dead = DeadWriter(closing)
        client._writer = dead  # type: ignore[assignment]  # the replica died a moment ago
        with pytest.raises(LinkBroken):
            await done_soon(client.call([2], "r", 0, "bulk", None))
        assert client.broken and dead.closed and not client._pending and client.inflight == 0
        await server.close(1.0)

    asyncio.run(main())


def test_a_batch_whose_connection_just_closed_goes_through_serve(tmp_path: Path) -> None:
    async def main() -> None:
        server, _, send = await learned(tmp_path, Replica())
        assert (await done_soon(send([1], 0, "bulk", None))).results == [2]  # over the link
        (link,) = send.links.values()
        link._writer = DeadWriter(False)  # type: ignore[assignment]
        assert (await done_soon(send([3], 0, "bulk", None))).results == [6]  # through Serve, no 500
        assert send.counts["link_broken"] == 1 and not send.links
        await server.close(1.0)

    asyncio.run(main())


def test_shutdown_lets_running_batches_finish_and_turns_new_ones_away(tmp_path: Path) -> None:
    async def main() -> None:
        replica = Replica()
        server = serve(tmp_path, replica)
        address = await server.start()
        client = LinkClient(address)
        # Held until the new call was turned away: however slow the machine, it is still running then.
        running = asyncio.ensure_future(client.call(["held"], "r", 0, "bulk", None))
        await until(lambda: server.inflight == 1)
        closing = asyncio.ensure_future(server.close(5.0))
        await until(lambda: server.closing)
        with pytest.raises(LinkBroken, match="shutting down"):
            await done_soon(client.call([2], "r", 0, "bulk", None))
        assert not running.done()
        replica.held.set()
        assert (await done_soon(running)).results == ["heldheld"]
        await done_soon(closing)
        assert not Path(address.path).exists()

    asyncio.run(main())


class Handle:
    """Serve's handle as the sender sees it: answers and names a link."""

    def __init__(self, link: LinkAddress | None) -> None:
        self.link = link
        self.calls = 0

    async def __call__(self, payloads: list[Any], queued: int, lane: str, traces: Any) -> BatchReply:
        self.calls += 1
        return BatchReply([2 * p for p in payloads], 0.0, 0.001, link=self.link)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def learned(tmp_path: Path, replica: Replica, clock: Clock | None = None) -> tuple[LinkServer, Handle, LinkedSender]:
    """A replica's link server, Serve's handle to it, and a sender that has learned the link from
    one batch through Serve (router id "r", node "n1")."""
    server = serve(tmp_path, replica)
    handle = Handle(await server.start())
    send = LinkedSender(handle, "r", "n1", clock=clock or Clock())
    await done_soon(send([1], 0, "bulk", None))
    return server, handle, send


def test_the_sender_finds_a_local_link_through_serve_and_then_uses_it(tmp_path: Path) -> None:
    async def main() -> None:
        replica, clock = Replica(), Clock()
        server = serve(tmp_path, replica)
        handle = Handle(await server.start())
        send = LinkedSender(handle, "router-1", "n1", discover_s=1.0, clock=clock)
        assert (await done_soon(send([1], 0, "bulk", None))).results == [2]
        assert handle.calls == 1 and replica.routers == []
        for _ in range(3):
            assert (await done_soon(send([3], 0, "bulk", None))).results == [6]
        assert handle.calls == 1 and replica.routers == ["router-1"] * 3
        assert send.snapshot() == {"links": 1, "over_link": 3, "through_serve": 1, "link_broken": 0}
        clock.now += 1.0  # once a second a batch goes through Serve, to find replicas started since
        await done_soon(send([1], 0, "bulk", None))
        assert handle.calls == 2
        await done_soon(send([1], 0, "bulk", None))
        assert replica.routers == ["router-1"] * 4
        send.close()
        await server.close(1.0)

    asyncio.run(main())


def test_the_sender_keeps_to_serve_for_other_nodes_heavy_batches_and_full_links(tmp_path: Path) -> None:
    async def main() -> None:
        replica = Replica()
        server = serve(tmp_path, replica, node="n2")
        remote = Handle(await server.start())
        send = LinkedSender(remote, "r", "n1", clock=Clock())
        for _ in range(3):
            await done_soon(send([1], 0, "bulk", None))
        assert remote.calls == 3 and not send.links  # a socket on another node is out of reach

        local = LinkServer(replica.run, "n1", directory=tmp_path)
        handle = Handle(await local.start())
        send = LinkedSender(handle, "r", "n1", max_inflight=2, clock=Clock(), handle_only=lambda p: p[0] == "heavy")
        await done_soon(send([1], 0, "bulk", None))
        await done_soon(send(["heavy"], 0, "bulk", None))
        assert handle.calls == 2 and replica.routers == []
        replica.release.clear()
        held = [asyncio.ensure_future(send([1], 0, "bulk", None)) for _ in range(2)]
        await until(lambda: local.inflight == 2)
        await done_soon(send([1], 0, "bulk", None))  # the link holds two: the third goes through Serve
        assert handle.calls == 3
        replica.release.set()
        await asyncio.gather(*held)
        assert len(replica.routers) == 2
        await server.close(1.0)
        await local.close(1.0)

    asyncio.run(main())


def test_a_replica_shutting_down_finishes_the_links_batches_and_the_next_go_through_serve(tmp_path: Path) -> None:
    async def main() -> None:
        replica = Replica()
        server, handle, send = await learned(tmp_path, replica)
        held = asyncio.ensure_future(send(["held"], 0, "bulk", None))
        await until(lambda: server.inflight == 1)
        closing = asyncio.ensure_future(server.close(5.0))
        await until(lambda: server.closing)
        assert (await done_soon(send([2], 0, "bulk", None))).results == [4]  # turned away: through Serve
        assert handle.calls == 2 and not send.links
        replica.held.set()
        assert (await done_soon(held)).results == ["heldheld"]  # finished over the link, not sent again
        assert handle.calls == 2 and replica.routers == ["r"]
        assert send.snapshot() == {"links": 0, "over_link": 1, "through_serve": 2, "link_broken": 1}
        await done_soon(closing)

    asyncio.run(main())


def test_a_batch_whose_link_breaks_goes_through_serve_and_the_link_is_forgotten(tmp_path: Path) -> None:
    async def main() -> None:
        replica, clock = Replica(), Clock()
        server, handle, send = await learned(tmp_path, replica, clock)
        assert (await done_soon(send([1], 0, "bulk", None))).results == [2]  # over the link, connected
        assert replica.routers == ["r"]
        await server.close(1.0)  # the replica went away
        handle.link = None  # and Serve now routes to another, without a link
        assert (await done_soon(send([4], 0, "bulk", None))).results == [8]  # through Serve, at once
        assert not send.links and handle.calls == 2
        assert send.snapshot() == {"links": 0, "over_link": 1, "through_serve": 2, "link_broken": 1}
        assert (await done_soon(send([4], 0, "bulk", None))).results == [8]
        assert handle.calls == 3
        # A reply that still names the failed link (a replica Serve has not yet dropped) does not
        # bring it back while its failure is recent; a minute later it may.
        assert server.address is not None
        handle.link = server.address
        await done_soon(send([4], 0, "bulk", None))
        assert not send.links
        clock.now += BROKEN_S
        await done_soon(send([4], 0, "bulk", None))
        assert list(send.links) == [server.address.path] and not send.broken

    asyncio.run(main())


def test_a_starting_replica_removes_the_sockets_of_dead_ones_and_keeps_live_ones(tmp_path: Path) -> None:
    import socket

    async def main() -> None:
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(str(tmp_path / "dead.sock"))  # bound, never listening: a replica killed mid-way
        dead.close()
        assert sweep_stale(tmp_path) == 0  # too young: it may be a replica about to listen
        os.utime(tmp_path / "dead.sock", (0, 0))
        live = serve(tmp_path, Replica())
        address = await live.start()
        assert not (tmp_path / "dead.sock").exists()
        os.utime(address.path, (0, 0))  # old, but listening: kept
        starting = serve(tmp_path, Replica())
        await starting.start()
        assert Path(address.path).exists()
        assert sweep_stale(tmp_path) == 0
        await live.close(1.0)
        await starting.close(1.0)

    asyncio.run(main())
