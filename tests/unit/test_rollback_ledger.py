"""Rollbacks shared between an application's routers (serve_app/router/rollback_ledger.py): the
ledger's merging, and a router that goes on alone when the ledger cannot be reached. The Ray
actor itself: tests/integration/shared_serve/test_rollbacks.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from serve_app.config import TrafficConfig
from serve_app.router import rollback_ledger
from serve_app.router.rollback_ledger import RollbackLedger, SharedRollbacks
from serve_app.scheduling.traffic import TrafficPolicy


def test_the_rollback_ledger_keeps_every_routers_rollbacks_once_and_is_bounded():
    ledger = RollbackLedger(max_entries=2)
    assert ledger.exchange([("m", "2", 10.0, "first")]) == [("m", "2", 10.0, "first")]
    assert ledger.exchange([("m", "2", 10.0, "second"), ("n", "3", 5.0, "x")]) == [
        ("m", "2", 10.0, "first"),  # the first reason given stands
        ("n", "3", 5.0, "x"),
    ]
    assert ledger.exchange([]) == [("m", "2", 10.0, "first"), ("n", "3", 5.0, "x")]  # a fresh router learns both
    assert ledger.exchange([("m", "2", 20.0, "again")])[-1] == ("m", "2", 20.0, "again")
    assert len(ledger.entries) == 2 and ("m", "2", 10.0) not in ledger.entries  # the oldest went


def test_a_router_that_cannot_reach_the_ledger_decides_alone_and_tries_again(monkeypatch, caplog):
    calls = []

    def unreachable(app_name: str) -> object:
        calls.append(app_name)
        raise RuntimeError("no Ray here")

    monkeypatch.setattr(rollback_ledger, "ledger_actor", unreachable)
    policy = TrafficPolicy({"m": "1"})
    policy.update({"m": TrafficConfig.model_validate({"weights": {"1": 9, "2": 1}, "rollback": {}})})
    shared = SharedRollbacks("app")
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        assert asyncio.run(shared.exchange(policy)) == []
        assert asyncio.run(shared.exchange(policy)) == []
    assert calls == ["app", "app"]  # looked up again each tick
    assert len([r for r in caplog.records if "deciding alone" in r.message]) == 1  # said once per run of failures
    assert policy.effective_weights()[("m", "2")] == pytest.approx(0.1)
