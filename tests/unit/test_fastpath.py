"""The v2 infer fast path (serve_app/router/fastpath.py) as plain ASGI, without Ray or FastAPI."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.responses import Response

from serve_app.errors import InvalidInput
from serve_app.router import direct, fastpath


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
    assert fastpath.wanted_headers(raw) == {b"x-priority": "high", b"authorization": "Bearer k"}


def _call(
    path: str, answer: Any, body_messages: list[dict[str, Any]], method: str = "POST", wrap: Any = lambda app: app
) -> tuple[list[dict], list]:
    """Run one request through the fast path (inside `wrap`, for the middlewares around it), with
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

    gate = wrap(fastpath.InferFastPath(inner, parts=None))  # type: ignore[arg-type]
    scope = {"type": "http", "method": method, "path": path, "headers": [(b"x-priority", b"low"), (b"x-session-key", b"s1")]}
    original = fastpath.answer_infer
    fastpath.answer_infer = answer  # type: ignore[assignment]
    try:
        asyncio.run(gate(scope, receive, send))
    finally:
        fastpath.answer_infer = original
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


def test_other_requests_go_on_to_fastapi() -> None:
    sent, passed = _call("/v2/models/m/ready", None, [], method="GET")
    assert passed == ["/v2/models/m/ready"] and sent == []
    sent, passed = _call("/v2/models/m/infer", None, [], method="GET")
    assert passed == ["/v2/models/m/infer"]


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
    the read: the fast path answers them as the FastAPI route did, 413 and 503 + Retry-After."""
    from serve_app.router.edge import BodyLimit, InflightBytes

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
