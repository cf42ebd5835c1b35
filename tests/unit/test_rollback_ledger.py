"""Rollbacks shared between an application's routers (serve_app/router/routing/rollback_ledger.py): the
ledger's merging, a router's exchange with it, and a router that goes on alone when the ledger
cannot be reached. The Ray actor itself, with a router replaced under a rolled-back canary: the
last test of tests/integration/test_scheduling.py."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from ray.exceptions import RayActorError

from serve_app.config import TrafficConfig
from serve_app.router.routing import rollback_ledger
from serve_app.router.routing.rollback_ledger import RollbackLedger, SharedRollbacks
from serve_app.scheduling.traffic import TrafficPolicy

RULE = {"window_s": 30, "min_requests": 20, "max_error_rate_increase": 0.05}


def policy(weights: dict[str, float]) -> TrafficPolicy:
    p = TrafficPolicy({"m": "1"})
    p.update({"m": TrafficConfig.model_validate({"weights": weights, "rollback": RULE})})
    return p


def condemn(p: TrafficPolicy, version: str = "2") -> None:
    """Calls that roll `version` back: its baseline answers, it fails every time."""
    for _ in range(100):
        p.record("m", "1", 0.01, failed=False)
    for _ in range(20):
        p.record("m", version, 0.01, failed=True)
    assert len(p.check_rollbacks()) == 1


def test_the_rollback_ledger_keeps_every_routers_rollbacks_once_and_is_bounded():
    ledger = RollbackLedger(max_entries=2)
    assert ledger.exchange([("m", "2", 10.0, "first")], []) == [("m", "2", 10.0, "first")]
    assert ledger.exchange([("m", "2", 10.0, "second"), ("n", "3", 5.0, "x")], []) == [
        ("m", "2", 10.0, "first"),  # the first reason given stands
        ("n", "3", 5.0, "x"),
    ]
    assert ledger.exchange([], []) == [("m", "2", 10.0, "first"), ("n", "3", 5.0, "x")]  # a fresh router learns both
    assert ledger.exchange([("o", "2", 20.0, "again")], [])[-1] == ("o", "2", 20.0, "again")
    assert len(ledger.entries) == 2 and ("m", "2", 10.0) not in ledger.entries  # the oldest went


def test_a_router_running_another_weight_removes_the_rollback_so_the_old_weight_is_judged_afresh():
    ledger = RollbackLedger()
    ledger.exchange([("m", "2", 10.0, "bad")], [("m", "1", 90.0), ("m", "2", 10.0)])
    assert ledger.exchange([], [("m", "1", 90.0), ("m", "2", 10.0)]) == [("m", "2", 10.0, "bad")]  # same weight: stands
    assert ledger.exchange([], [("m", "2", 0.0), ("other", "2", 10.0)]) == []  # the operator set it to 0
    # Weight 10 again (the model fixed): nothing left to adopt.
    assert policy({"1": 90, "2": 10}).adopt(ledger.exchange([], [("m", "2", 10.0)])) == []


class LocalActor:
    """The ledger behind the call shape of a Ray actor handle (`exchange.remote(...)`, awaited)."""

    def __init__(self, ledger: RollbackLedger) -> None:
        self.ledger = ledger
        self.exchange = self
        self.error: Exception | None = None

    def remote(self, *args: Any) -> asyncio.Future[Any]:
        result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.error is not None:
            result.set_exception(self.error)
        else:
            result.set_result(self.ledger.exchange(*args))
        return result


def test_routers_exchange_rollbacks_through_the_ledger_and_keep_a_handle_that_only_timed_out(monkeypatch):
    actor = LocalActor(RollbackLedger())
    lookups: list[str] = []

    def look_up(app: str) -> LocalActor:
        lookups.append(app)
        return actor

    monkeypatch.setattr(rollback_ledger, "ledger_actor", look_up)
    deciding, later = policy({"1": 90, "2": 10}), policy({"1": 90, "2": 10})
    one, two = SharedRollbacks("app"), SharedRollbacks("app")

    async def main() -> None:
        condemn(deciding)
        assert await one.exchange(deciding) == []  # its own: nothing to adopt
        (adopted,) = await two.exchange(later)
        assert (adopted.model, adopted.version) == ("m", "2") and later.effective_weights()[("m", "2")] == 0.0
        actor.error = TimeoutError()
        assert await two.exchange(later) == [] and two.actor is actor  # slow, not gone: kept
        actor.error = RayActorError()
        assert await two.exchange(later) == [] and two.actor is None  # gone: looked up again next time
        actor.error = None
        assert await two.exchange(later) == [] and two.actor is actor

    asyncio.run(main())
    assert lookups == ["app", "app", "app"]


def test_a_router_that_cannot_reach_the_ledger_decides_alone_and_tries_again(monkeypatch, caplog):
    calls = []

    def unreachable(app_name: str) -> object:
        calls.append(app_name)
        raise RuntimeError("no Ray here")

    monkeypatch.setattr(rollback_ledger, "ledger_actor", unreachable)
    p = policy({"1": 9, "2": 1})
    shared = SharedRollbacks("app")

    async def main() -> None:
        with caplog.at_level(logging.WARNING, logger="ray.serve"):
            assert await shared.exchange(p) == []
            assert await shared.exchange(p) == []

    asyncio.run(main())
    assert calls == ["app", "app"]  # looked up again each tick
    assert len([r for r in caplog.records if "deciding alone" in r.message]) == 1  # said once per run of failures
    assert p.effective_weights()[("m", "2")] == pytest.approx(0.1)


def test_a_rolled_back_version_made_the_baseline_is_not_kept_rolled_back():
    p = policy({"1": 90, "2": 10})
    condemn(p)
    p.update({"m": TrafficConfig.model_validate({"weights": {"1": 90, "2": 10}, "baseline": "2", "rollback": RULE})})
    assert p.models["m"].rolled_back == {}  # every router agrees: adopt() skips baselines too
