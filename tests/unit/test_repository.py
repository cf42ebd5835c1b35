"""The repository extension's state without Ray: the ledger the routers share, and what an
unloaded model means to a router's catalog."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from serve_app.config import AppArgs
from serve_app.errors import Unavailable
from serve_app.router.routing.catalog import ModelCatalog
from serve_app.router.routing.repository import RepositoryLedger


def test_the_ledger_keeps_each_unload_until_its_load() -> None:
    ledger = RepositoryLedger()
    assert ledger.set("a", False, 1.0)["unloaded"] == {"a": 1.0}
    assert ledger.set("a", False, 5.0)["unloaded"] == {"a": 1.0}  # unloaded since the first call
    assert ledger.set("b", False, 2.0)["unloaded"] == {"a": 1.0, "b": 2.0}
    assert ledger.set("a", True, 3.0)["unloaded"] == {"b": 2.0}
    assert ledger.set("zzz", True, 4.0) == ledger.get() == {"unloaded": {"b": 2.0}, "added": {}}


def test_the_ledger_keeps_a_model_added_at_run_time_through_its_unloads() -> None:
    ledger = RepositoryLedger()
    assert ledger.set("reviews-it", True, 1.0, pool="reviews-*")["added"] == {"reviews-it": "reviews-*"}
    assert ledger.set("reviews-it", False, 2.0) == {"unloaded": {"reviews-it": 2.0}, "added": {"reviews-it": "reviews-*"}}
    assert ledger.set("reviews-it", True, 3.0, pool="reviews-*") == {"unloaded": {}, "added": {"reviews-it": "reviews-*"}}


def test_a_router_adds_each_model_the_ledger_added_before_it_hears_of_its_unload() -> None:
    from serve_app.router.routing.repository import SharedRepository

    heard: list[tuple[str, Any]] = []
    shared = SharedRepository("app", on_change=lambda unloaded: heard.append(("unloaded", unloaded)))
    shared.on_added = lambda added: heard.append(("added", added))
    shared._adopt({"unloaded": {"x": 1.0}, "added": {"x": "p-*", "y": "p-*"}})
    shared._adopt({"unloaded": {"x": 1.0}, "added": {"x": "p-*", "y": "p-*", "z": "q-*"}})
    assert heard == [("added", {"x": "p-*", "y": "p-*"}), ("unloaded", frozenset({"x"})), ("added", {"z": "q-*"})]


def catalog() -> ModelCatalog:
    args = AppArgs.model_validate(
        {"models": {"m": {"preset": "bert-tiny", "versions": {"2": {"preset": "bert-tiny"}}}, "n": {"preset": "bert-tiny"}}}
    )

    async def fetch(deployment: str) -> dict[str, Any]:
        raise AssertionError("not asked in these tests")

    return ModelCatalog(args, fetch)


def test_an_unloaded_model_is_refused_with_every_version_and_comes_back_when_loaded() -> None:
    c = catalog()
    c.set_unloaded(frozenset({"m"}))
    assert c.unloaded == {"m", "m-v2"} and c.unloaded_models() == {"m"}
    for deployment in ("m", "m-v2"):
        with pytest.raises(Unavailable, match="unloaded"):
            c.available(deployment)
    c.available("n")
    assert asyncio.run(c.is_ready("m")) is False
    c.set_unloaded(frozenset())
    c.available("m")


def test_a_readiness_answer_is_not_reused_across_an_unload() -> None:
    c = catalog()
    c._ready["n"] = (c.clock(), True)  # a fresh answer, within the reuse window
    c.set_unloaded(frozenset({"n"}))
    assert asyncio.run(c.is_ready("n")) is False
