"""The router's ShedGate on a bare Starlette app: no Ray, real ASGI over httpx."""

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app.router.edge.shedgate import Check, ShedGate, infer_target

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


class RefuseLow:
    """A check that refuses `X-Priority: low` and records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, str]]] = []

    def __call__(self, path: str, name: str, headers: dict[str, str]) -> Response | None:
        self.calls.append((path, name, headers))
        if headers.get("x-priority") == "low":
            return JSONResponse({"error": "m: overloaded"}, status_code=503, headers={"Retry-After": "2"})
        return None


def _client(check: Check, bodies: list[bytes] | None = None) -> httpx.AsyncClient:
    """The gate in front of an app that records each body it reads into `bodies`."""
    bodies = [] if bodies is None else bodies

    async def infer(request: Request) -> Response:
        bodies.append(await request.body())
        return JSONResponse({"ok": request.path_params["name"]})

    app = Starlette(routes=[Route("/v2/models/{name}/infer", infer, methods=["POST"])])
    app.add_middleware(ShedGate, check=check)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def test_a_refused_class_never_reaches_the_app_and_others_pass():
    check, bodies = RefuseLow(), list[bytes]()
    async with _client(check, bodies) as client:
        refused = await client.post("/v2/models/m/infer", json={"inputs": []}, headers={"X-Priority": "low"})
        assert refused.status_code == 503 and refused.json() == {"error": "m: overloaded"}
        assert refused.headers["retry-after"] == "2"
        ok = await client.post("/v2/models/m/infer", json={"inputs": []}, headers={"X-Priority": "high"})
        assert ok.status_code == 200 and ok.json() == {"ok": "m"}
        # Not an infer call: the check is not even asked.
        assert (await client.get("/v2/models/m/infer")).status_code == 405
    assert len(bodies) == 1  # only the high request's body was ever read
    path = "/v2/models/m/infer"
    assert [(p, n, h["x-priority"]) for p, n, h in check.calls] == [(path, "m", "low"), (path, "m", "high")]


async def test_a_check_that_refuses_nothing_lets_everything_pass():
    async with _client(lambda path, name, headers: None) as client:
        resp = await client.post("/v2/models/m/infer", json={}, headers={"X-Priority": "low"})
    assert resp.status_code == 200


async def test_generation_paths_are_judged_with_no_model_name():
    check = RefuseLow()

    async def completions(request: Request) -> Response:
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.add_middleware(ShedGate, check=check)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        refused = await client.post("/v1/completions", json={}, headers={"X-Priority": "low"})
        ok = await client.post("/v1/completions", json={})
    assert refused.status_code == 503 and ok.status_code == 200
    assert [(p, n) for p, n, _ in check.calls] == [("/v1/completions", ""), ("/v1/completions", "")]
