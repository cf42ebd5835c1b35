"""/router/status without Ray: the fan-out to generators is bounded, and only operators may read it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from serve_app.config import TenantConfig
from serve_app.contract import Priority
from serve_app.errors import Forbidden, Unauthorized
from serve_app.router.admission.callers import Callers, build_registry
from serve_app.router.routing.catalog import RecentAnswers


class Generator:
    def __init__(self) -> None:
        self.calls = 0

    async def stats(self) -> dict[str, int]:
        self.calls += 1
        await asyncio.sleep(0.01)
        return {"running": self.calls}


def test_a_burst_of_status_calls_asks_each_generator_once_per_ttl():
    gpt, clock = Generator(), [0.0]
    recent = RecentAnswers(ttl_s=1.0, clock=lambda: clock[0])

    async def burst() -> list[Any]:
        return await asyncio.gather(*(recent.get("gpt", gpt.stats) for _ in range(20)))

    answers = asyncio.run(burst())
    # The first call asks; the rest of the burst, arriving while it is in flight, get the last answer (none yet).
    assert gpt.calls == 1
    assert answers[0] == {"running": 1} and all(a is None for a in answers[1:])
    assert asyncio.run(recent.get("gpt", gpt.stats)) == {"running": 1} and gpt.calls == 1  # within the TTL
    clock[0] += 1.0
    assert asyncio.run(recent.get("gpt", gpt.stats)) == {"running": 2} and gpt.calls == 2


def test_a_generator_that_fails_to_answer_shows_as_none():
    async def broken() -> dict[str, Any]:
        raise RuntimeError("replica gone")

    assert asyncio.run(RecentAnswers().get("gpt", broken)) is None


def _callers() -> Callers:
    tenants = [
        TenantConfig(name="ops", key_env="STATUS_TEST_OPS", operator=True),
        TenantConfig(name="app", key_env="STATUS_TEST_APP"),
    ]
    return Callers(build_registry(tenants), Priority.NORMAL)


def test_with_keys_only_operators_read_the_status(monkeypatch):
    monkeypatch.setenv("STATUS_TEST_OPS", "ops-key")
    monkeypatch.setenv("STATUS_TEST_APP", "app-key")
    callers = _callers()
    assert callers.operator("Bearer ops-key").name == "ops"
    with pytest.raises(Forbidden):
        callers.operator("Bearer app-key")
    with pytest.raises(Unauthorized):
        callers.operator(None)


def test_an_open_server_shows_its_status_to_anyone():
    assert Callers(build_registry([]), Priority.NORMAL).operator(None).name == "anonymous"
