"""The router's direct v2 infer path (serve_app.router.edge.direct) in a real uvicorn server: which
calls take it, the request id, a client that leaves, and the install through Serve's hook."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from serve_app.router.edge import callwatch, direct
from tests.unit.fakes import VirtualTimeLoop
from tests.unit.uvicorn_server import exchange, free_port, serve_and


class Recorder:
    """An ASGI app that says who answered; `slow` waits until cancelled or released, and `after`
    goes on awaiting once it has answered."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = asyncio.Event()
        self.cancelled = 0
        self.release = asyncio.Event()
        self.finished = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # the body, as every endpoint reads it
        try:
            if scope["path"].startswith("/v2/models/slow/"):
                self.started.set()
                await self.release.wait()
            body = self.name.encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
            if scope["path"].startswith("/v2/models/pause/"):
                await asyncio.sleep(0.05)  # a handler that yields between its answer's head and body
            await send({"type": "http.response.body", "body": body})
            if scope["path"].startswith("/v2/models/after/"):
                await asyncio.sleep(0.05)  # what a handler may still do after its answer (metrics, spans)
            self.finished += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


@pytest.fixture
def apps(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Recorder, Recorder]]:
    router, serve = Recorder("router"), Recorder("serve")
    monkeypatch.setattr(direct, "APP", router)
    monkeypatch.setattr(direct, "BUILT", False)
    monkeypatch.setattr(direct, "TIMEOUT_S", 60.0)
    monkeypatch.setattr(direct, "APP_LOOP", None)
    yield router, serve


def on_this_loop(app: Any) -> Any:
    """The middleware as Serve builds it in the server's loop, the router's app on that loop too."""

    async def build(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not hasattr(build, "lane"):
            direct.APP_LOOP = asyncio.get_running_loop()
            build.lane = direct.DirectInfer(app)  # type: ignore[attr-defined]
        await build.lane(scope, receive, send)  # type: ignore[attr-defined]

    return build


def post(path: str, headers: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n{headers}\r\n{{}}".encode()


def run_server(app: Any, client: Any, *waiting: Recorder) -> Any:
    """`client(port)` against a real uvicorn server of `app`; calls still waiting in `waiting` are
    released before the server stops (its shutdown waits for them)."""
    port = free_port()

    def release() -> None:
        for recorder in waiting:
            recorder.release.set()

    return serve_and(port, lambda: client(port), app, release)


def test_v2_infer_goes_to_the_router_and_everything_else_through_serve(apps: tuple[Recorder, Recorder]) -> None:
    lane = on_this_loop(apps[1])

    async def client(port: int) -> list[bytes]:
        paths = ["/v2/models/m/infer", "/v2/models/m/versions/2/infer", "/v2/models/m/ready", "/v1/completions", "/router/status"]
        return [await exchange(port, post(p, "connection: close\r\n")) for p in paths]

    answers = run_server(lane, client)
    assert direct.active()
    assert [a.rsplit(b"\r\n\r\n", 1)[1] for a in answers] == [b"router", b"router", b"serve", b"serve", b"serve"]
    get_infer = b"GET /v2/models/m/infer HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    get = run_server(lane, lambda port: exchange(port, get_infer))
    assert get.endswith(b"serve")  # only POST is an infer call


def test_the_callers_request_id_comes_back_and_a_new_one_otherwise(apps: tuple[Recorder, Recorder]) -> None:
    lane = on_this_loop(apps[1])

    async def client(port: int) -> list[bytes]:
        return [
            await exchange(port, post("/v2/models/m/infer", "x-request-id: abc-1\r\nconnection: close\r\n")),
            await exchange(port, post("/v2/models/m/infer", "connection: close\r\n")),
            await exchange(port, post("/v2/models/m/infer", "connection: close\r\n")),
        ]

    given, new1, new2 = run_server(lane, client)
    assert b"x-request-id: abc-1\r\n" in given

    def rid(answer: bytes) -> bytes:
        return next(line.split(b": ", 1)[1] for line in answer.split(b"\r\n") if line.startswith(b"x-request-id: "))

    assert len(rid(new1)) == 36 and rid(new1) != rid(new2)


def test_a_client_that_leaves_cancels_its_call_and_the_server_answers_the_next(apps: tuple[Recorder, Recorder]) -> None:
    router, serve = apps
    lane = on_this_loop(serve)

    async def client(port: int) -> tuple[int, bytes]:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/v2/models/slow/infer"))
        await writer.drain()
        await asyncio.wait_for(router.started.wait(), 10)
        writer.close()  # the client gives up while its call waits
        for _ in range(500):
            if router.cancelled:
                break
            await asyncio.sleep(0.01)
        cancelled = router.cancelled
        after = await exchange(port, post("/v2/models/m/infer", "connection: close\r\n"))
        return cancelled, after

    cancelled, after = run_server(lane, client, router)
    assert cancelled == 1
    assert after.startswith(b"HTTP/1.1 200") and after.endswith(b"router")


def test_a_handler_that_has_answered_is_not_cancelled_by_the_answers_end_or_the_connection_closing(
    apps: tuple[Recorder, Recorder],
) -> None:
    router, serve = apps
    lane = on_this_loop(serve)

    async def client(port: int) -> bytes:
        answer = await exchange(port, post("/v2/models/after/infer", "connection: close\r\n"))
        for _ in range(500):
            if router.finished or router.cancelled:
                break
            await asyncio.sleep(0.01)
        return answer

    assert run_server(lane, client).endswith(b"router")
    assert (router.finished, router.cancelled) == (1, 0)


def test_a_finished_call_leaves_nothing_for_the_garbage_collector(apps: tuple[Recorder, Recorder]) -> None:
    """A call's watch, request cycle and task go when it ends, by reference counting. Held in a
    reference cycle they would wait for a full collection: under a spike that is thousands of
    calls, with what they reference, in the router's heap, and every full collection after the
    spike walks them with the event loop stopped."""
    lane = on_this_loop(apps[1])

    async def client(port: int) -> list[bytes]:
        return [await exchange(port, post("/v2/models/m/infer", "connection: close\r\n")) for _ in range(5)]

    def alive() -> dict[int, str]:
        kinds = (callwatch.ClientWatch, RequestResponseCycle)
        return {id(o): type(o).__name__ for o in gc.get_objects() if isinstance(o, kinds)}

    gc.collect()
    gc.disable()
    try:
        before = alive()  # what earlier tests may have left (a kept traceback), not this one's
        answers = run_server(lane, client)
        left = [kind for key, kind in alive().items() if key not in before]
    finally:
        gc.enable()
    assert [a.rsplit(b"\r\n\r\n", 1)[1] for a in answers] == [b"router"] * 5
    assert left == []


def test_an_answers_head_goes_out_only_with_its_body(apps: tuple[Recorder, Recorder]) -> None:
    """A router killed after uvicorn wrote an answer's head but before its body leaves an answer
    nobody can replay (HAProxy has passed the head on): the head waits for the body, and the two
    reach the server together."""
    _router, serve = apps
    lane = on_this_loop(serve)
    written: list[tuple[str, float]] = []

    async def server_side(scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def recorded(message: Any) -> None:
            written.append((message["type"], asyncio.get_running_loop().time()))
            await send(message)

        await lane(scope, receive, recorded)

    assert run_server(server_side, lambda port: exchange(port, post("/v2/models/pause/infer", "connection: close\r\n"))).endswith(
        b"router"
    )
    assert [kind for kind, _ in written] == ["http.response.start", "http.response.body"]
    assert written[1][1] - written[0][1] < 0.01  # not the handler's 50 ms apart


def test_a_call_past_the_timeout_gets_a_504_in_v2_shape(apps: tuple[Recorder, Recorder], monkeypatch: pytest.MonkeyPatch) -> None:
    router, serve = apps
    monkeypatch.setattr(direct, "TIMEOUT_S", 0.2)
    lane = on_this_loop(serve)
    answer = run_server(lane, lambda port: exchange(port, post("/v2/models/slow/infer", "connection: close\r\n")), router)
    assert answer.startswith(b"HTTP/1.1 504") and b"x-request-id: " in answer
    assert b'{"error":"the request took longer than 0.2 s (limits.infer_timeout_s)"}' in answer
    assert router.cancelled == 1


def test_a_server_on_another_loop_than_the_routers_sends_everything_through_serve(apps: tuple[Recorder, Recorder]) -> None:
    direct.APP_LOOP = asyncio.new_event_loop()  # the router's code on a loop of its own (a thread of Serve's)
    try:
        answer = run_server(
            direct.DirectInfer(apps[1]), lambda port: exchange(port, post("/v2/models/m/infer", "connection: close\r\n"))
        )
    finally:
        direct.APP_LOOP.close()
    assert answer.endswith(b"serve") and not direct.active()


def test_install_takes_the_hook_from_the_environment_and_leaves_an_operators_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct, "APP", None)
    monkeypatch.setattr(direct, "APP_LOOP", None)
    monkeypatch.setenv(direct.HOOK_ENV, direct.HOOK)
    app = object()
    assert not direct.install(app, 5.0)  # no event loop running: no loop to tell the server's by
    assert direct.middlewares() == []  # a process without a router's app: Serve's server gets nothing

    async def installed() -> bool:
        return direct.install(app, 5.0) and direct.install(app, 5.0)

    assert asyncio.run(installed())
    assert direct.APP is app and direct.TIMEOUT_S == 5.0
    # What Serve builds from the hook when it starts the router's server: our middleware.
    assert [m.cls for m in direct.middlewares()] == [direct.DirectInfer]

    monkeypatch.setattr(direct, "APP", None)
    monkeypatch.setenv(direct.HOOK_ENV, "their.module:middlewares")  # an operator's own hook stays theirs
    assert not asyncio.run(installed()) and direct.APP is None

    monkeypatch.delenv(direct.HOOK_ENV)  # a plain `serve run`: Serve's wrapper
    assert not asyncio.run(installed()) and direct.APP is None

    monkeypatch.setenv(direct.HOOK_ENV, direct.HOOK)
    monkeypatch.setattr(sys, "version_info", (3, 10, 14))  # asyncio without Task.uncancel()
    assert not asyncio.run(installed()) and direct.APP is None


def test_the_direct_path_is_opt_in_and_its_setting_names_the_hook() -> None:
    from serve_app.tools.ingress_env import DIRECT_INFER_ENV, INGRESS_ENV

    assert direct.HOOK_ENV not in INGRESS_ENV
    assert DIRECT_INFER_ENV == {direct.HOOK_ENV: direct.HOOK}


def this_task() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    assert task is not None
    return task


def test_the_time_limit_expires_only_late_calls_and_keeps_no_timer_once_they_are_done() -> None:
    # On a virtual clock: on a loaded machine a real loop stalled past the limit would see the
    # quick call's wake-up and the expiry in one turn, and expire both.
    deadlines = callwatch.Deadlines()
    cycle = SimpleNamespace(disconnected=False)

    async def call(hold_s: float) -> tuple[str, float]:
        watch = callwatch.ClientWatch(cycle, this_task(), asyncio.Event())
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadlines.add(watch, 0.2)
        try:
            await asyncio.sleep(hold_s)
            return "done", loop.time() - started
        except asyncio.CancelledError:
            return ("expired" if watch.timed_out else "cancelled"), loop.time() - started
        finally:
            deadlines.discard(watch)

    async def main() -> tuple[tuple[str, float], tuple[str, float]]:
        return await asyncio.gather(call(0.01), call(30.0))

    loop = VirtualTimeLoop()
    try:
        (quick, _), (slow, waited) = loop.run_until_complete(main())
    finally:
        loop.close()
    assert (quick, slow) == ("done", "expired")
    assert 0.2 <= waited < 30.0
    assert not deadlines.calls and deadlines.timer is None


def test_the_time_limit_still_fires_for_calls_on_a_later_event_loop() -> None:
    """A tick left pending on a loop that closed must not keep the next loop's calls unlimited."""
    deadlines = callwatch.Deadlines()
    cycle = SimpleNamespace(disconnected=False)

    async def call(hold_s: float) -> str:
        watch = callwatch.ClientWatch(cycle, this_task(), asyncio.Event())
        deadlines.add(watch, 0.2)
        try:
            await asyncio.sleep(hold_s)
            return "done"
        except asyncio.CancelledError:
            return "expired" if watch.timed_out else "cancelled"
        finally:
            deadlines.discard(watch)

    async def first() -> None:
        # A call that never finishes its turn on this loop: the loop closes with its tick pending.
        watch = callwatch.ClientWatch(cycle, this_task(), asyncio.Event())
        deadlines.add(watch, 0.2)

    asyncio.run(first())
    assert deadlines.timer is not None and deadlines.calls
    deadlines.calls.clear()  # its loop is gone
    assert asyncio.run(call(30.0)) == "expired"
