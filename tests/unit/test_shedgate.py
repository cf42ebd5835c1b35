"""The router's ShedGate on a bare Starlette app: no Ray, real ASGI over httpx."""

from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app.router.shedgate import ShedGate, infer_target, set_check

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_infer_target_reads_only_v2_infer_paths():
    assert infer_target("/v2/models/bert/infer") == "bert"
    assert infer_target("/v2/models/bert/versions/3/infer") == "bert"
    assert infer_target("/prefix/v2/models/bert/infer") == "bert"
    for path in ["/v2/models/bert", "/v2/models//infer", "/v2/models/a/b/infer", "/v1/completions", "/v2/models/bert/ready"]:
        assert infer_target(path) is None, path


@pytest.fixture
def calls() -> Iterator[list[tuple[str, str, dict[str, str]]]]:
    seen: list[tuple[str, str, dict[str, str]]] = []

    def check(path: str, name: str, headers: dict[str, str]) -> Response | None:
        seen.append((path, name, headers))
        if headers.get("x-priority") == "low":
            return JSONResponse({"error": "m: overloaded"}, status_code=503, headers={"Retry-After": "2"})
        return None

    set_check(check)
    yield seen
    set_check(None)


def _client() -> httpx.AsyncClient:
    bodies: list[bytes] = []

    async def infer(request: Request) -> Response:
        bodies.append(await request.body())
        return JSONResponse({"ok": request.path_params["name"]})

    app = Starlette(routes=[Route("/v2/models/{name}/infer", infer, methods=["POST"])])
    app.add_middleware(ShedGate)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def test_a_refused_class_never_reaches_the_app_and_others_pass(calls):
    async with _client() as client:
        refused = await client.post("/v2/models/m/infer", json={"inputs": []}, headers={"X-Priority": "low"})
        assert refused.status_code == 503 and refused.json() == {"error": "m: overloaded"}
        assert refused.headers["retry-after"] == "2"
        ok = await client.post("/v2/models/m/infer", json={"inputs": []}, headers={"X-Priority": "high"})
        assert ok.status_code == 200 and ok.json() == {"ok": "m"}
        # Not an infer call: the check is not even asked.
        assert (await client.get("/v2/models/m/infer")).status_code == 405
    path = "/v2/models/m/infer"
    assert [(p, n, h["x-priority"]) for p, n, h in calls] == [(path, "m", "low"), (path, "m", "high")]


async def test_without_a_check_everything_passes():
    set_check(None)
    async with _client() as client:
        resp = await client.post("/v2/models/m/infer", json={}, headers={"X-Priority": "low"})
    assert resp.status_code == 200
