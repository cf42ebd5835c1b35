"""The router's app shell (serve_app.router.http.RouterApp): its edge runs before FastAPI's
stack, so a fault there must still answer in the protocol's shape, as FastAPI's last-resort
handler would, and never leave a caller without an answer. No Ray."""

from __future__ import annotations

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from serve_app.router.http import RouterApp, add_error_handlers

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def app_with_edge(fail_on: str) -> RouterApp:
    app = RouterApp()

    @app.get("/v2/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/boom")
    async def boom() -> dict[str, bool]:
        raise KeyError("a bug behind the edge")

    add_error_handlers(app)

    async def edge(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(fail_on):
            raise KeyError("a bug in the edge")
        await app.through_fastapi(scope, receive, send)

    app.edge = edge
    return app


async def call(app: RouterApp, method: str, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        return await client.request(method, path, content=b"{}")


async def messages(app: RouterApp, method: str, path: str) -> tuple[list[Message], Exception | None]:
    """What the app sends for one request, as Serve's replica would pass it on (a send that
    never refuses a second answer), and what it raised."""
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b"", "root_path": ""}
    try:
        await app(scope, receive, send)
    except Exception as e:
        return sent, e
    return sent, None


async def test_a_fault_in_the_edge_answers_500_in_each_protocols_shape() -> None:
    v2 = await call(app_with_edge("/v2/models"), "POST", "/v2/models/m/infer")
    assert v2.status_code == 500 and v2.json() == {"error": "internal error: KeyError"}
    openai = await call(app_with_edge("/v1"), "POST", "/v1/completions")
    assert openai.status_code == 500 and openai.json()["error"]["message"] == "internal error: KeyError"
    sent, raised = await messages(app_with_edge("/v2/models"), "POST", "/v2/models/m/infer")
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"] and raised is None


async def test_requests_past_the_edge_are_fastapis_as_before() -> None:
    app = app_with_edge("/nowhere")
    live = await call(app, "GET", "/v2/health/live")
    assert live.status_code == 200 and live.json() == {"live": True}
    boom = await call(app, "GET", "/v2/boom")
    assert boom.status_code == 500 and boom.json() == {"error": "internal error: KeyError"}
    missing = await call(app, "GET", "/v2/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()
    # FastAPI's last-resort handler answered, then raised: one answer, and the error goes on to Serve.
    sent, raised = await messages(app, "GET", "/v2/boom")
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert isinstance(raised, KeyError)
