"""The router's background loops on a virtual clock: following the router count, and the
health check that sees a loop die."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from serve_app.config import AppArgs
from serve_app.router.background import ROUTER_COUNT_POLL_S, BackgroundLoops
from serve_app.router.routing.dispatchers import DispatcherPool
from tests.conftest import tiny_args
from tests.unit.fakes import virtual_time


def pool() -> DispatcherPool:
    def no_sends(model: str):  # type: ignore[no-untyped-def]
        raise AssertionError("no batch is sent here")

    return DispatcherPool(AppArgs.model_validate(tiny_args(Path("/nonexistent"))), no_sends)


@virtual_time
async def test_the_rate_share_follows_the_router_count_as_it_changes():
    loop = asyncio.get_running_loop()
    seen: list[int] = []

    async def count() -> int:  # one router, then three from t=12 s
        return 1 if loop.time() < 12 else 3

    loops = BackgroundLoops(pool(), {}, None, router_count=count, on_router_count=seen.append)
    loops.start()
    await asyncio.sleep(4 * ROUTER_COUNT_POLL_S)
    loops.check()
    await loops.stop()
    assert seen == [1, 3]  # told once per change, not once per poll


@virtual_time
async def test_a_loop_that_dies_fails_the_health_check():
    def broken_telemetry():  # type: ignore[no-untyped-def]
        raise RuntimeError("metrics backend gone")

    loops = BackgroundLoops(pool(), {}, None, telemetry=broken_telemetry)
    loops.start()
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="background loop ended"):
        loops.check()
    await loops.stop()


def test_the_router_count_is_the_controllers_running_replicas_not_the_configured_count():
    """An autoscaled router's replica context knows only its configured count; the controller
    knows how many run."""
    from serve_app.router.routing.replicas import ROUTER_DEPLOYMENT, DeploymentState, DeploymentStates

    answers = [{ROUTER_DEPLOYMENT: DeploymentState("HEALTHY", 3)}, {}, {ROUTER_DEPLOYMENT: DeploymentState("UPSCALING", 0)}]

    async def fetch() -> dict[str, DeploymentState]:
        return answers.pop(0)

    async def counts() -> list[int]:
        states = DeploymentStates(fetch, ttl_s=0.0)
        return [await states.running(ROUTER_DEPLOYMENT) for _ in range(3)]

    assert asyncio.run(counts()) == [3, 1, 1]  # never below one: the caller is a router
