"""The router's edge checks on a bare FastAPI app with the router's error handlers: no Ray."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel

from serve_app.errors import Unauthorized
from serve_app.router.edge.checks import BodyLimit, InflightBytes, KeyGate
from serve_app.router.http import add_error_handlers

pytestmark = pytest.mark.anyio
LIMIT = 1024


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Body(BaseModel):
    prompt: str


def authenticate(authorization: str | None) -> object:
    if authorization != "Bearer good":
        raise Unauthorized("invalid API key")
    return object()


def app_and_reads() -> tuple[FastAPI, list[str]]:
    reads: list[str] = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: Body) -> dict[str, int]:  # FastAPI reads and parses this body itself
        reads.append("v1")
        return {"chars": len(body.prompt)}

    @app.post("/v2/models/{name}/infer")
    async def infer(request: Request) -> dict[str, int]:  # this endpoint reads its body itself
        body = await request.body()
        reads.append("v2")
        return {"bytes": len(body)}

    @app.get("/v2/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    app.add_middleware(BodyLimit, max_bytes=LIMIT, inflight=InflightBytes(100 * LIMIT))
    app.add_middleware(KeyGate, authenticate=authenticate)
    add_error_handlers(app)
    return app, reads


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def chunks(total: int) -> AsyncIterator[bytes]:
    """A body with no Content-Length (chunked), valid JSON only if read whole."""
    yield b'{"prompt": "'
    for _ in range(total // 100):
        yield b"x" * 100
    yield b'"}'


async def test_a_declared_body_over_the_limit_is_a_413_in_each_protocols_shape_before_any_read():
    app, reads = app_and_reads()
    key = {"Authorization": "Bearer good"}
    async with client(app) as c:
        v1 = await c.post("/v1/completions", content=b"x" * (LIMIT + 1), headers=key)
        v2 = await c.post("/v2/models/m/infer", content=b"x" * (LIMIT + 1), headers=key)
    assert v1.status_code == 413 and v1.json()["error"]["code"] == "payload_too_large"
    assert v2.status_code == 413 and "at most 1024" in v2.json()["error"]
    assert reads == []


async def test_a_streamed_body_is_refused_once_it_passes_the_limit():
    app, reads = app_and_reads()
    key = {"Authorization": "Bearer good"}
    async with client(app) as c:
        v1 = await c.post("/v1/completions", content=chunks(4 * LIMIT), headers=key)
        v2 = await c.post("/v2/models/m/infer", content=chunks(4 * LIMIT), headers=key)
        ok = await c.post("/v1/completions", content=chunks(LIMIT // 2), headers={**key, "Content-Type": "application/json"})
    assert v1.status_code == 413 and v1.json()["error"]["code"] == "payload_too_large"  # not FastAPI's 400
    assert v2.status_code == 413
    assert ok.status_code == 200 and reads == ["v1"]


async def test_without_a_valid_key_a_post_is_a_401_before_its_body_is_read():
    app, reads = app_and_reads()
    async with client(app) as c:
        missing = await c.post("/v1/completions", json={"prompt": "hi"})
        wrong = await c.post("/v2/models/m/infer", content=b"{}", headers={"Authorization": "Bearer bad"})
        health = await c.get("/v2/health/live")
        ok = await c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer good"})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "invalid_request_error"
    assert wrong.status_code == 401 and wrong.json() == {"error": "invalid API key"}
    assert health.status_code == 200 and ok.status_code == 200
    assert reads == ["v1"]


async def test_body_bytes_in_flight_are_bounded_over_all_requests_and_given_back():
    inflight = InflightBytes(limit=3 * 1000)
    release = asyncio.Event()
    app = FastAPI()

    @app.post("/v2/models/{name}/infer")
    async def infer(request: Request) -> dict[str, int]:
        body = await request.body()
        await release.wait()  # hold the body, as a request queued in the router does
        return {"bytes": len(body)}

    app.add_middleware(BodyLimit, max_bytes=LIMIT * 4, inflight=inflight)
    add_error_handlers(app)
    async with client(app) as c:
        held = [asyncio.ensure_future(c.post("/v2/models/m/infer", content=b"x" * 1000)) for _ in range(3)]
        while inflight.held < 3000:
            await asyncio.sleep(0.001)
        full = await c.post("/v2/models/m/infer", content=b"x" * 10)
        streamed = await c.post("/v2/models/m/infer", content=chunks(200))
        release.set()
        assert [(await r).status_code for r in held] == [200, 200, 200]
        again = await c.post("/v2/models/m/infer", content=b"x" * 1000)
    assert full.status_code == 503 and full.headers["Retry-After"] == "1" and "holds 3000 bytes" in full.json()["error"]
    assert streamed.status_code == 503 and streamed.headers["Retry-After"] == "1"
    assert again.status_code == 200 and inflight.held == 0
