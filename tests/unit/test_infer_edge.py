"""v2 infer's one way in (serve_app/router/edge/infer_edge.py), on a router without Ray: each kind of
request answered at the app's root and under a route prefix alike, traced or not, and no other
path left to a v2 infer call."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib.util
import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serve_app.config import AppArgs
from serve_app.contract import BatchReply
from serve_app.router.edge import infer_edge
from serve_app.router.edge.infer_edge import InferEdge
from serve_app.router.endpoints import endpoints_v2
from serve_app.router.http import RouterApp, build_http_app
from serve_app.router.parts import build_parts
from tests.conftest import tiny_args

ROOT = Path(__file__).resolve().parents[2]
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


async def call(
    entry: Any, path: str, body: bytes, headers: list[tuple[bytes, bytes]], root_path: str = ""
) -> tuple[int, dict[bytes, bytes], bytes]:
    chunks = iter([{"type": "http.request", "body": body, "more_body": False}])
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return next(chunks, {"type": "http.disconnect"})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b"", "root_path": root_path,
             "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1)}  # fmt: skip
    await entry(scope, receive, send)
    head = {k: v for k, v in sent[0]["headers"] if k not in VARYING}
    return sent[0]["status"], head, b"".join(m.get("body", b"") for m in sent[1:])


def both(app: RouterApp, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> list[tuple[int, dict, bytes]]:
    """The answer at the app's root, and under a route prefix (Serve passes the whole path beside
    `root_path`)."""

    async def run() -> list[tuple[int, dict, bytes]]:
        return [await call(app, path, body, headers), await call(app, "/api" + path, body, headers, root_path="/api")]

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
def test_an_answer_is_the_same_at_the_root_and_under_a_route_prefix(
    tiny_model_dir: Path, path: str, body: bytes, status: int
) -> None:
    layered, direct = both(router(tiny_model_dir), path, body, with_length(body, (b"x-priority", b"high")))
    assert layered == direct
    assert direct[0] == status


def test_a_body_over_the_limit_is_refused_from_its_length(tiny_model_dir: Path) -> None:
    body = json.dumps({"inputs": [{**TEXT["inputs"][0], "data": ["x" * 2000]}]}).encode()
    app = router(tiny_model_dir, limits={"max_request_bytes": 1024})
    layered, direct = both(app, "/v2/models/bert-heavy/infer", body, with_length(body))
    assert layered == direct and direct[0] == 413
    assert app.state.parts.inflight_bytes.held == 0  # its room given back


def test_a_bad_key_is_refused_before_the_body(tiny_model_dir: Path) -> None:
    body = json.dumps(TEXT).encode()
    app = router(tiny_model_dir, tenants=[{"name": "team", "key_sha256": hashlib.sha256(b"k1").hexdigest()}])
    headers = with_length(body, (b"authorization", b"Bearer wrong"))
    layered, direct = both(app, "/v2/models/bert-heavy/infer", body, headers)
    assert layered == direct and direct[0] == 401
    ok = both(app, "/v2/models/bert-heavy/infer", body, with_length(body, (b"authorization", b"Bearer k1")))
    assert ok[0] == ok[1] and ok[1][0] == 200


def test_the_routers_own_overload_refuses_low_priority(tiny_model_dir: Path) -> None:
    body = json.dumps(TEXT).encode()
    app = router(tiny_model_dir, scheduling={"router_delay_target_ms": 10, "anonymous_max_priority": "high"})
    parts = app.state.parts
    assert parts.gate is not None and parts.gate.shedding is not None
    parts.gate.shedding.level = 1.0  # the router's loop late for long enough: all of low is shed
    layered, direct = both(app, "/v2/models/bert-heavy/infer", body, with_length(body, (b"x-priority", b"low")))
    assert layered == direct and direct[0] == 503 and b"retry-after" in direct[1]
    high = both(app, "/v2/models/bert-heavy/infer", body, with_length(body, (b"x-priority", b"high")))
    assert high[1][0] == 200


def test_every_v2_infer_call_takes_the_one_path_traced_or_not(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = json.dumps(TEXT).encode()
    app = router(tiny_model_dir)
    edge = app.edge
    assert isinstance(edge, InferEdge)
    answered: list[str] = []
    passed_on: list[str] = []
    real_answer, layered = infer_edge.answer, edge.layered

    async def counting(parts: Any, scope: Any, *rest: Any) -> None:
        answered.append(scope["path"])
        await real_answer(parts, scope, *rest)

    async def watching(scope: Any, receive: Any, send: Any) -> None:
        passed_on.append(scope["path"])
        await layered(scope, receive, send)

    monkeypatch.setattr(infer_edge, "answer", counting)
    edge.layered = watching
    parent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for headers in (with_length(body), with_length(body, (b"traceparent", parent))):
        for path, root in (("/v2/models/bert-heavy/infer", ""), ("/api/v2/models/bert-heavy/versions/1/infer", "/api")):
            status, _, _ = asyncio.run(call(app, path, body, headers, root_path=root))
            assert status in (200, 404)  # version 1 may not exist; answered by the edge either way
    assert len(answered) == 4 and passed_on == []  # never the middlewares, never FastAPI's route
    asyncio.run(call(app, "/v2/models/bert-heavy/ready", b"", []))
    assert passed_on == ["/v2/models/bert-heavy/ready"]


def test_no_other_function_answers_v2_infer() -> None:
    """`answer_infer` is called from `infer_edge.answer` alone; the fast-path middleware is gone; the
    FastAPI route only documents the endpoint."""
    calls = []
    for path in sorted((ROOT / "serve_app").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "answer_infer":
                calls.append(str(path.relative_to(ROOT)))
    assert calls == ["serve_app/router/edge/infer_edge.py"]
    assert importlib.util.find_spec("serve_app.router.fastpath") is None
    source = inspect.getsource(endpoints_v2.infer)
    assert "answer_infer" not in source and "raise RuntimeError" in source
