"""How the router's edge answers one v2 infer call (serve_app.router.edge.infer_edge.answer) and matches
its path, as plain ASGI, without Ray or FastAPI."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.responses import Response

from serve_app.errors import InvalidInput
from serve_app.router.edge import direct, infer_edge


@pytest.mark.parametrize(
    ("path", "route"),
    [
        ("/v2/models/bert-heavy/infer", ("bert-heavy", None)),
        ("/v2/models/bert-heavy/versions/2/infer", ("bert-heavy", "2")),
        ("/v2/models//infer", None),
        ("/v2/models/a/b/infer", None),
        ("/v2/models/a/versions//infer", None),
        ("/v2/models/a/ready", None),
        ("/x/v2/models/a/infer", None),
    ],
)
def test_infer_route_matches_what_the_fastapi_routes_match(path: str, route: tuple[str, str | None] | None) -> None:
    assert direct.infer_route(path) == route


def test_the_first_of_a_repeated_header_wins_and_others_are_ignored() -> None:
    raw = [(b"x-priority", b"high"), (b"x-priority", b"low"), (b"cookie", b"c"), (b"authorization", b"Bearer k")]
    assert infer_edge.wanted_headers(raw) == {b"x-priority": "high", b"authorization": "Bearer k"}


class Answering:
    """`infer_edge.answer` for v2 infer paths, as InferEdge calls it once the edge let the call in;
    anything else to `app`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        route = direct.infer_route(scope["path"]) if scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        await infer_edge.answer(None, scope, receive, send, route, infer_edge.wanted_headers(scope["headers"]))  # type: ignore[arg-type]


def _call(
    path: str, answer: Any, body_messages: list[dict[str, Any]], method: str = "POST", wrap: Any = lambda app: app
) -> tuple[list[dict], list]:
    """Run one request through the answer (inside `wrap`, for the middlewares around it), with
    `answer` standing in for the endpoint; returns what was sent and the paths passed on."""
    passed: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        passed.append(scope["path"])

    sent: list[dict[str, Any]] = []
    messages = iter(body_messages)

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: Any) -> None:
        sent.append(message)

    gate = wrap(Answering(inner))
    scope = {"type": "http", "method": method, "path": path, "headers": [(b"x-priority", b"low"), (b"x-session-key", b"s1")]}
    original = infer_edge.answer_infer
    infer_edge.answer_infer = answer  # type: ignore[assignment]
    try:
        asyncio.run(gate(scope, receive, send))
    finally:
        infer_edge.answer_infer = original
    return sent, passed


def _body(sent: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_infer_is_answered_with_the_body_read_in_chunks_and_the_headers_passed() -> None:
    seen: dict[str, Any] = {}

    async def answer(parts: Any, name: str, version: Any, read_body: Any, headers: Any) -> Response:
        seen.update(name=name, version=version, body=await read_body(), priority=headers.priority, session=headers.session_key)
        return Response(b'{"ok":true}', media_type="application/json")

    chunks: list[dict[str, Any]] = [
        {"type": "http.request", "body": b'{"a"', "more_body": True},
        {"type": "http.request", "body": b":1}"},
    ]
    sent, passed = _call("/v2/models/m/versions/3/infer", answer, chunks)
    assert seen == {"name": "m", "version": "3", "body": b'{"a":1}', "priority": "low", "session": "s1"} and passed == []
    assert _body(sent) == (200, {"ok": True})


def test_a_body_of_many_chunks_is_grown_as_they_come_and_a_single_chunk_is_not_copied() -> None:
    seen: list[Any] = []

    async def answer(parts: Any, name: str, version: Any, read_body: Any, headers: Any) -> Response:
        seen.append(await read_body())
        return Response(b"{}", media_type="application/json")

    chunks: list[dict[str, Any]] = [{"type": "http.request", "body": bytes([i]) * 1000, "more_body": True} for i in range(5)]
    _call("/v2/models/m/infer", answer, [*chunks, {"type": "http.request", "body": b"end"}])
    assert isinstance(seen[0], bytearray) and seen[0] == b"".join(c["body"] for c in chunks) + b"end"
    only = b'{"inputs": []}'
    _call("/v2/models/m/infer", answer, [{"type": "http.request", "body": only}])
    assert seen[1] is only


def test_errors_leave_in_the_v2_shape_and_a_bug_is_a_500_without_its_text() -> None:
    async def bad_input(*args: Any) -> Response:
        raise InvalidInput("input 'text' is missing")

    async def bug(*args: Any) -> Response:
        raise RuntimeError("secret detail")

    status, body = _body(_call("/v2/models/m/infer", bad_input, [])[0])
    assert status == 400 and body == {"error": "input 'text' is missing"}
    status, body = _body(_call("/v2/models/m/infer", bug, [])[0])
    assert status == 500 and "secret" not in body["error"] and "RuntimeError" in body["error"]


def test_a_client_that_left_gets_no_answer() -> None:
    async def answer(parts: Any, name: str, version: Any, read_body: Any, *rest: Any) -> Response:
        await read_body()
        return Response(b"{}")

    sent, _ = _call("/v2/models/m/infer", answer, [{"type": "http.disconnect"}])
    assert sent == []


@pytest.mark.parametrize(
    ("max_bytes", "inflight", "status", "retry_after"),
    [(10, 1 << 20, 413, None), (1 << 20, 1024 + 4, 503, b"1")],
    ids=["over the body limit", "over the bytes in flight"],
)
def test_the_edges_refusals_in_a_chunked_body_read_keep_their_status(max_bytes, inflight, status, retry_after) -> None:  # type: ignore[no-untyped-def]
    """The body limit and the in-flight bytes are enforced as a chunked body arrives, by raising into
    the read: answered 413, and 503 + Retry-After."""
    from serve_app.router.edge.checks import BodyLimit, InflightBytes

    async def answer(parts: Any, name: str, version: Any, read_body: Any, *rest: Any) -> Response:
        await read_body()
        return Response(b"{}")

    chunks: list[dict[str, Any]] = [{"type": "http.request", "body": b"x" * 1024, "more_body": True}] * 3
    sent, _ = _call(
        "/v2/models/m/infer",
        answer,
        [*chunks, {"type": "http.request"}],
        wrap=lambda app: BodyLimit(app, max_bytes=max_bytes, inflight=InflightBytes(inflight)),
    )
    got, body = _body(sent)
    assert got == status and set(body) == {"error"}
    assert dict(sent[0]["headers"]).get(b"retry-after") == retry_after
