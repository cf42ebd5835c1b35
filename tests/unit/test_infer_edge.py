"""v2 infer's edge in one call (serve_app/router/infer_edge.py) answers as the middlewares do, layer
by layer: the same status, body and headers for each kind of request, on a router without Ray."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serve_app.config import AppArgs
from serve_app.contract import BatchReply
from serve_app.router.http import RouterApp, build_http_app
from serve_app.router.parts import build_parts
from tests.conftest import tiny_args

TEXT = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["the food was good"]}]}
# Headers that differ between any two answers (timings, request ids), left out of the comparison.
VARYING = {b"server-timing"}


def router(model_dir: Path, **extra: Any) -> RouterApp:
    args = AppArgs.model_validate({**tiny_args(model_dir), **extra})

    async def send(payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None) -> BatchReply:
        return BatchReply([np.array([[0.5, -0.5]] * len(p), np.float32) for p in payloads], 0.0, 0.0)

    async def nothing() -> None:
        return None

    return build_http_app(build_parts(args, {}, "r", lambda model: send), nothing, nothing)


async def call(entry: Any, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict[bytes, bytes], bytes]:
    chunks = iter([{"type": "http.request", "body": body, "more_body": False}])
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return next(chunks, {"type": "http.disconnect"})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b"", "root_path": "",
             "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1)}  # fmt: skip
    await entry(scope, receive, send)
    head = {k: v for k, v in sent[0]["headers"] if k not in VARYING}
    return sent[0]["status"], head, b"".join(m.get("body", b"") for m in sent[1:])


def both(app: RouterApp, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> list[tuple[int, dict, bytes]]:
    """The answer through the layers (the app as Serve calls it) and through the one-call edge."""

    async def run() -> list[tuple[int, dict, bytes]]:
        return [await call(app, path, body, headers), await call(app.direct_infer, path, body, headers)]

    return asyncio.run(run())


def with_length(body: bytes, *headers: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v2/models/bert-heavy/infer", json.dumps(TEXT).encode(), 200),
        ("/v2/models/text-classify/infer", json.dumps(TEXT).encode(), 200),
        ("/v2/models/bert-heavy/infer", b'{"inputs": [', 400),
        ("/v2/models/nobody/infer", json.dumps(TEXT).encode(), 404),
        ("/v2/models/bert-heavy/versions/9/infer", json.dumps(TEXT).encode(), 404),
    ],
)
def test_an_answer_is_the_same_through_the_layers_and_in_one_call(
    tiny_model_dir: Path, path: str, body: bytes, status: int
) -> None:
    layered, direct = both(router(tiny_model_dir), path, body, with_length(body, (b"x-priority", b"high")))
    assert layered == direct
    assert direct[0] == status


def test_a_body_over_the_limit_is_refused_from_its_length_the_same_way(tiny_model_dir: Path) -> None:
    body = json.dumps({"inputs": [{**TEXT["inputs"][0], "data": ["x" * 2000]}]}).encode()
    app = router(tiny_model_dir, limits={"max_request_bytes": 1024})
    layered, direct = both(app, "/v2/models/bert-heavy/infer", body, with_length(body))
    assert layered == direct and direct[0] == 413
    assert app.state.parts.inflight_bytes.held == 0  # its room given back


def test_a_bad_key_is_refused_the_same_way_before_the_body(tiny_model_dir: Path) -> None:
    body = json.dumps(TEXT).encode()
    app = router(tiny_model_dir, tenants=[{"name": "team", "key_sha256": hashlib.sha256(b"k1").hexdigest()}])
    headers = with_length(body, (b"authorization", b"Bearer wrong"))
    layered, direct = both(app, "/v2/models/bert-heavy/infer", body, headers)
    assert layered == direct and direct[0] == 401
    ok = both(app, "/v2/models/bert-heavy/infer", body, with_length(body, (b"authorization", b"Bearer k1")))
    assert ok[0] == ok[1] and ok[1][0] == 200


def test_the_routers_own_overload_refuses_low_priority_the_same_way(tiny_model_dir: Path) -> None:
    body = json.dumps(TEXT).encode()
    app = router(tiny_model_dir, scheduling={"router_delay_target_ms": 10, "anonymous_max_priority": "high"})
    parts = app.state.parts
    assert parts.gate is not None and parts.gate.shedding is not None
    parts.gate.shedding.level = 1.0  # the router's loop late for long enough: all of low is shed
    layered, direct = both(app, "/v2/models/bert-heavy/infer", body, with_length(body, (b"x-priority", b"low")))
    assert layered == direct and direct[0] == 503 and b"retry-after" in direct[1]
    high = both(app, "/v2/models/bert-heavy/infer", body, with_length(body, (b"x-priority", b"high")))
    assert high[1][0] == 200


def test_a_traced_request_goes_through_the_layers(tiny_model_dir: Path) -> None:
    body = json.dumps(TEXT).encode()
    app = router(tiny_model_dir)
    seen: list[str] = []
    layered = app.edge

    async def watching(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["path"])
        await layered(scope, receive, send)

    app.infer_edge.layered = watching  # type: ignore[attr-defined]
    parent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    asyncio.run(call(app.direct_infer, "/v2/models/bert-heavy/infer", body, with_length(body, (b"traceparent", parent))))
    asyncio.run(call(app.direct_infer, "/v2/models/bert-heavy/infer", body, with_length(body)))
    assert seen == ["/v2/models/bert-heavy/infer"]  # the traced one only
