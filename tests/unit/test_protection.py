"""Priority protection inside the router, without Ray: the policy on a fake clock, then the
gate that applies it on a bare Starlette app over real ASGI."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app.config import AppArgs
from serve_app.contract import Priority
from serve_app.errors import InvalidInput, Overloaded
from serve_app.router.parts import build_parts
from serve_app.router.protect import PriorityGuard
from serve_app.router.shedgate import ShedGate
from serve_app.scheduling.protection import ClassProtection
from tests.conftest import tiny_args

HIGH, NORMAL, LOW = Priority.HIGH, Priority.NORMAL, Priority.LOW


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _protection(clock: Clock, start: int = 2) -> ClassProtection:
    return ClassProtection(target_s=0.001, window_s=1.0, start=start, adjust_every_s=0.05, clock=clock)


def test_with_no_higher_class_arriving_nothing_is_capped():
    clock = Clock()
    p = _protection(clock)
    assert all(p.enter(LOW) for _ in range(50)) and all(p.enter(NORMAL) for _ in range(50))
    assert p.in_flight[LOW] == 50 and p.refused == {}


def test_while_high_arrives_low_is_capped_at_its_limit_and_freed_by_departures():
    clock = Clock()
    p = _protection(clock, start=2)
    assert p.enter(HIGH)
    assert p.enter(LOW) and p.enter(LOW) and not p.enter(LOW)
    assert p.enter(NORMAL) and p.enter(NORMAL) and not p.enter(NORMAL)  # high guards normal too
    p.leave(LOW)
    assert p.enter(LOW)
    assert p.refused == {"low": 1, "normal": 1}
    clock.now += 1.5  # high stopped arriving: the window has passed
    assert p.enter(LOW) and p.enter(LOW)


def test_normal_traffic_protects_high_only_and_low_is_guarded_by_normal():
    clock = Clock()
    p = _protection(clock, start=1)
    assert p.enter(NORMAL)
    assert p.enter(LOW) and not p.enter(LOW)  # normal arrived: low is capped
    assert p.enter(NORMAL) and p.enter(NORMAL)  # nothing above normal arrived: not capped


def test_the_limit_halves_while_the_loop_is_late_and_grows_by_one_while_on_time_and_binding():
    clock = Clock()
    p = _protection(clock, start=8)
    assert p.enter(HIGH)  # both lower classes are guarded from now on
    for _ in range(8):
        assert p.enter(LOW) and p.enter(NORMAL)  # both limits bind
    clock.now += 0.06
    p.follow(0.0015)  # late for low (1 ms), on time for normal (2 ms)
    assert p.limit[LOW] == 4 and p.limit[NORMAL] == 9
    p.follow(0.0030)  # within the same period: no change
    assert p.limit[LOW] == 4
    for _ in range(4):
        clock.now += 0.06
        p.follow(0.0030)
    assert p.limit[LOW] == 0.25 and p.limit[NORMAL] == 9 / 16
    for _ in range(8):
        p.leave(LOW)
    assert p.enter(HIGH) and not p.enter(LOW)  # under one: none at all while high arrives
    clock.now += 0.06
    p.follow(0.0)
    assert p.limit[LOW] == 1.25 and p.enter(LOW)
    assert p.status() == {"limit": {"low": 1, "normal": 1}, "in_flight": {"low": 1, "normal": 8}, "refused": {"low": 1}}


def test_a_limit_moves_only_while_its_class_is_guarded_and_grows_only_while_it_binds():
    clock = Clock()
    p = _protection(clock, start=4)
    for _ in range(3):
        clock.now += 0.06
        p.follow(0.0)  # on time, nothing above arriving: no reason to move
        p.follow(0.0)
    assert p.limit[LOW] == 4
    clock.now += 0.06
    p.follow(1.0)
    assert p.limit[LOW] == 4  # late, but nothing to protect
    assert p.enter(HIGH) and p.enter(LOW)  # one in flight under a limit of four: not binding
    clock.now += 0.06
    p.follow(0.0)
    assert p.limit[LOW] == 4
    clock.now += 0.06
    p.follow(1.0)
    assert p.limit[LOW] == 2


def test_a_target_must_be_positive():
    with pytest.raises(ValueError):
        ClassProtection(target_s=0.0)


def _guard(model_dir: Path, clock: Clock, rng: float = 1.0) -> tuple[PriorityGuard, ClassProtection, list[float]]:
    args = tiny_args(model_dir)
    args["scheduling"] = {"router_protect_delay_ms": 1, "anonymous_max_priority": "high"}
    parts = build_parts(AppArgs.model_validate(args), {}, "r", lambda model: None)  # type: ignore[arg-type,return-value]
    assert parts.protection is not None
    protection = ClassProtection(target_s=0.001, start=1, clock=clock)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    guard = PriorityGuard(parts.callers, protection, parts.catalog.is_known, rng=lambda: rng, sleep=sleep)
    return guard, protection, slept


def test_the_guard_holds_a_refusal_at_most_half_the_requests_own_timeout(tiny_model_dir: Path):
    guard, _, _ = _guard(tiny_model_dir, Clock(), rng=1.0)
    assert guard.hold_s({}) == 1.0
    assert guard.hold_s({"x-request-timeout-ms": "300"}) == 0.15
    guard.held = guard.max_held
    assert guard.hold_s({}) == 0.0


def test_the_guard_judges_only_a_class_the_headers_settle_on_a_known_model(tiny_model_dir: Path):
    clock = Clock()
    guard, protection, _ = _guard(tiny_model_dir, clock)
    assert guard.enter("bert-heavy", {"x-priority": "high"}) == (HIGH, None)
    assert guard.enter("bert-heavy", {"x-priority": "low"}) == (LOW, None)
    # Capped now, but these pass uncounted: the class may be in the body; the model is unknown;
    # the header is bad (the full path answers those with their 404 and 400).
    assert guard.enter("bert-heavy", {}) == (None, None)
    assert guard.enter("nope", {"x-priority": "low"}) == (None, None)
    assert guard.enter("bert-heavy", {"x-priority": "lowest"}) == (None, None)
    priority, refusal = guard.enter("bert-heavy", {"x-priority": "low"})
    assert priority is None and refusal is not None and refusal.status_code == 503
    assert guard.enter("", {"x-priority": "normal"}) == (NORMAL, None)  # generation: no model name
    assert protection.in_flight == {LOW: 1, NORMAL: 1} and protection.refused == {"low": 1}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_gate_counts_requests_in_flight_and_refuses_the_excess_after_a_hold(tiny_model_dir: Path):
    guard, protection, slept = _guard(tiny_model_dir, Clock(), rng=0.0)
    release, bodies = asyncio.Event(), list[bytes]()

    async def infer(request: Request) -> Response:
        bodies.append(await request.body())
        if request.headers.get("x-fail"):
            raise RuntimeError("boom")
        await release.wait()
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v2/models/{name}/infer", infer, methods=["POST"])])
    app.add_middleware(ShedGate, check=lambda path, name, headers: None, guard=guard)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        url = "/v2/models/bert-heavy/infer"
        release.set()
        high = await client.post(url, json={}, headers={"X-Priority": "high"})
        release.clear()
        first = asyncio.ensure_future(client.post(url, json={}, headers={"X-Priority": "low"}))
        await asyncio.wait_for(_until(lambda: protection.in_flight[LOW] == 1), 5)
        refused = await client.post(url, json={}, headers={"X-Priority": "low", "X-Request-Timeout-Ms": "100"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "higher-priority" in refused.json()["error"]
        assert slept == [0.05]  # half of HOLD_S (rng 0), capped at half of its own 100 ms timeout
        release.set()
        assert (await asyncio.wait_for(first, 5)).status_code == 200 and high.status_code == 200
        failed = await client.post(url, json={}, headers={"X-Priority": "low", "X-Fail": "1"})
        assert failed.status_code == 500
    assert protection.in_flight[LOW] == 0  # given back after an answer and after a failure
    assert len(bodies) == 3 and protection.refused == {"low": 1} and guard.held == 0


async def _until(done: Callable[[], bool]) -> None:
    while not done():
        await asyncio.sleep(0.001)


def _capped_grpc(model_dir: Path) -> tuple[Any, Any, list[float]]:
    """The router's gRPC service, without Ray, with priority protection on and low and normal capped
    at nothing (they are refused while a higher class arrives); the guard's holds are recorded, not slept."""
    from serve_app.router.grpc_service import GrpcInference

    args = tiny_args(model_dir)
    args["scheduling"] = {"router_protect_delay_ms": 1, "anonymous_max_priority": "high"}
    parts = build_parts(AppArgs.model_validate(args), {}, "r", lambda model: None)  # type: ignore[arg-type,return-value]
    assert parts.guard is not None and parts.protection is not None
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    parts.guard.sleep = sleep
    # A clock that stands still: a high arrival stays within the window however slow the machine.
    parts.protection.clock = Clock()
    parts.protection.limit = {LOW: 0.0, NORMAL: 0.0}
    return GrpcInference(parts), parts, slept


def test_grpc_requests_are_guarded_as_http_requests_are(tiny_model_dir: Path):
    """Triton's gRPC clients reach the router through Serve's gRPC proxy, not the HTTP gate: the
    same guard counts them, and refuses a capped class with Overloaded (UNAVAILABLE + retry)."""
    from tritonclient.grpc import service_pb2 as pb

    from serve_app.router.infer_v2 import InferHeaders

    service, parts, slept = _capped_grpc(tiny_model_dir)
    request = pb.ModelInferRequest(model_name="bert-heavy")
    request.inputs.add(name="text", datatype="BYTES", shape=[1])  # no contents: malformed once admitted

    with pytest.raises(InvalidInput):  # high goes on to the full path, and is given back after it
        asyncio.run(service.model_infer(request, InferHeaders(priority="high")))
    with pytest.raises(Overloaded, match="higher-priority") as refused:
        asyncio.run(service.model_infer(request, InferHeaders(priority="low", timeout_ms="400")))
    assert refused.value.retry_after_s == 1.0 and slept and slept[0] <= 0.2
    assert parts.protection.refused == {"low": 1} and parts.protection.in_flight[LOW] == 0
    assert parts.inflight_bytes.held == 0


def test_a_grpc_streamed_generation_is_guarded_for_as_long_as_it_streams(tiny_model_dir: Path):
    """ModelStreamInfer on the generator counts under the same guard as an HTTP generation: a capped
    class gets its refusal as the stream's error message, and an admitted one is given back when
    its stream ends, however it ends."""
    from tritonclient.grpc import service_pb2 as pb

    from serve_app.router.catalog import PROMPT_INPUT
    from serve_app.router.infer_v2 import InferHeaders

    service, parts, _ = _capped_grpc(tiny_model_dir)
    entered: list[Priority] = []
    enter = parts.protection.enter

    def counted(priority: Priority) -> bool:
        entered.append(priority)
        return enter(priority)

    parts.protection.enter = counted  # type: ignore[method-assign]
    request = pb.ModelInferRequest(model_name="gpt", id="1")
    request.inputs.add(name=PROMPT_INPUT, datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"hello")

    async def stream(priority: str) -> list[pb.ModelStreamInferResponse]:
        async def one() -> Any:
            yield request

        return [r async for r in service.model_stream_infer(one(), InferHeaders(priority=priority))]

    # High is admitted and counted while it streams; here no generator replica exists, so its
    # stream ends in an error, and it is given back all the same.
    (failed,) = asyncio.run(stream("high"))
    assert failed.error_message and "higher-priority" not in failed.error_message
    assert entered == [HIGH] and parts.protection.in_flight[HIGH] == 0
    # High has arrived, so low is capped: refused before any replica is asked, with the guard's message.
    (refused,) = asyncio.run(stream("low"))
    assert "higher-priority" in refused.error_message and parts.protection.refused == {"low": 1}
    assert entered == [HIGH, LOW] and parts.protection.in_flight[LOW] == 0
