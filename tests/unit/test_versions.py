"""Model versions in the router: deployments per version, outcomes recorded, shadows off the path."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from serve_app.config import AppArgs, TrafficConfig
from serve_app.contract import Priority
from serve_app.errors import InvalidInput, ModelFailure, NotFound
from serve_app.router.routing.versions import VersionedModels
from tests.unit.fakes import virtual_time


def args(**traffic: Any) -> AppArgs:
    return AppArgs.model_validate(
        {
            "models": {
                "m": {"preset": "bert-tiny", "batching": {"max_batch_size": 4}, "versions": {"2": {"preset": "bert-light"}}},
                "solo": {"preset": "bert-tiny"},
            },
            "traffic": traffic,
        }
    )


def test_each_version_is_a_deployment_that_inherits_what_it_leaves_out():
    a = args()
    assert a.versions("m") == {"1": "m", "2": "m-v2"} and a.versions("solo") == {"1": "solo"}
    v2 = a.deployment_config("m-v2")
    assert v2.preset == "bert-light" and v2.batching.max_batch_size == 4 and v2.version == "2"
    assert a.model_path("m-v2").name == "m-v2"


def test_a_version_of_another_family_or_an_unknown_traffic_target_is_refused():
    with pytest.raises(ValidationError, match="must be a bert model"):
        AppArgs.model_validate({"models": {"m": {"preset": "bert-tiny", "versions": {"2": {"preset": "gpt-tiny"}}}}})
    with pytest.raises(ValidationError, match="unknown version '3'"):
        args(m={"weights": {"1": 1, "3": 1}})
    with pytest.raises(ValidationError, match="unknown model"):
        args(nope={"weights": {"1": 1}})


class Models:
    """Deployments that answer with fixed logits, or fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Priority]] = []
        self.fail: dict[str, Exception] = {}
        self.release = asyncio.Event()
        self.hold: set[str] = set()

    async def submit(self, deployment: str, payload: Any, items: int, priority: Priority, *rest: Any) -> np.ndarray:
        self.calls.append((deployment, priority))
        if deployment in self.hold:
            await self.release.wait()
        if deployment in self.fail:
            raise self.fail[deployment]
        row = [2.0, 0.0] if deployment == "m" else [0.0, 2.0]
        return np.array([row] * items, dtype=np.float32)


def test_a_named_version_is_exact_and_an_unknown_one_is_404():
    v = VersionedModels(args(m={"weights": {"1": 1, "2": 1}}), Models().submit)
    assert v.deployment("m", "2") == "m-v2" and v.deployment("m", "1") == "m"
    with pytest.raises(NotFound, match="no version '7'"):
        v.deployment("m", "7")


def test_shadows_run_off_the_path_at_low_priority_and_their_failures_stay_there():
    async def main() -> None:
        models = Models()
        v = VersionedModels(args(m={"weights": {"1": 1}, "shadow": {"version": "2", "share": 1.0}}), models.submit)
        models.hold.add("m-v2")
        answer = await asyncio.wait_for(v.submit("m", ["a", "b"], 2, Priority.HIGH, None, None), 1)
        assert answer.shape == (2, 2)  # answered while the shadow is still held
        assert models.calls == [("m", Priority.HIGH), ("m-v2", Priority.LOW)]
        models.release.set()
        await asyncio.sleep(0.01)
        stats = v.shadows[("m", "2")]
        assert (stats.rows, stats.agreed, stats.errors) == (2, 0, 0)
        models.fail["m-v2"] = ModelFailure("boom")
        await v.submit("m", ["a"], 1, Priority.NORMAL, None, None)
        await asyncio.sleep(0.01)
        assert stats.errors == 1 and v.calls[("m", "1", "ok")] == 2

    virtual_time(main)()  # the sleeps let every mirror finish, whatever the machine's load


def test_mirrors_past_the_bound_are_dropped_oldest_first_and_counted():
    async def main() -> None:
        models = Models()
        v = VersionedModels(args(m={"weights": {"1": 1}, "shadow": {"version": "2", "max_inflight": 2}}), models.submit)
        models.hold.add("m-v2")
        for _ in range(5):
            await v.submit("m", ["a"], 1, Priority.NORMAL, None, None)
            await asyncio.sleep(0.01)  # the idle router sends a mirror as soon as none is out
        # One out (held), one waiting: the bound of 2 dropped the three waiting before it.
        assert v.mirrors.inflight == 1 and len(v.mirrors.waiting) == 1
        assert v.shadows[("m", "2")].yielded == 3 and v.shadows[("m", "2")].skipped == 0
        await v.stop()

    virtual_time(main)()  # the sleeps let every mirror finish, whatever the machine's load


def test_version_failures_count_toward_rollback_and_client_errors_do_not():
    async def main() -> None:
        models = Models()
        rule = {"window_s": 30, "min_requests": 20, "max_error_rate_increase": 0.1}
        v = VersionedModels(args(m={"weights": {"1": 1, "2": 1}, "rollback": rule}), models.submit)
        for _ in range(20):
            await v.submit("m", ["a"], 1, Priority.NORMAL, None, None)
        models.fail["m-v2"] = InvalidInput("bad")
        for _ in range(20):  # the callers' fault, every one: no evidence against the version
            with pytest.raises(InvalidInput):
                await v.submit("m-v2", ["a"], 1, Priority.NORMAL, None, None)
        assert v.policy.check_rollbacks() == []
        models.fail["m-v2"] = ModelFailure("boom")
        for _ in range(20):
            with pytest.raises(ModelFailure):
                await v.submit("m-v2", ["a"], 1, Priority.NORMAL, None, None)
        (event,) = v.policy.check_rollbacks()
        assert event.version == "2" and v.serving("m") == ["m"]
        assert v.calls[("m", "2", "refused")] == 20 and v.calls[("m", "2", "error")] == 20

    virtual_time(main)()  # the sleeps let every mirror finish, whatever the machine's load


def test_a_live_update_is_checked_against_the_catalog():
    v = VersionedModels(args(), Models().submit)
    with pytest.raises(ValueError, match="unknown version"):
        v.update({"m": TrafficConfig.model_validate({"weights": {"9": 1}})})
    v.update({"m": TrafficConfig.model_validate({"weights": {"2": 1}})})
    assert v.deployment("m", None) == "m-v2"


def test_mirrors_wait_for_the_routers_idle_time_and_the_wait_is_bounded():
    async def main() -> None:
        models = Models()
        busy: list[Collection[str]] = []
        clients = [True]

        def client_work(ignored: Collection[str]) -> bool:
            busy.append(ignored)
            return clients[0]

        shadow = {"version": "2", "max_inflight": 2}
        v = VersionedModels(args(m={"weights": {"1": 1}, "shadow": shadow}), models.submit, client_work=client_work)
        for _ in range(3):
            await v.submit("m", ["a"], 1, Priority.NORMAL, None, None)
        await asyncio.sleep(0.05)
        assert [d for d, _ in models.calls] == ["m", "m", "m"]  # nothing mirrored while clients are served
        assert v.shadows[("m", "2")].yielded == 1 and len(v.mirrors.waiting) == 2  # the oldest made room
        assert busy[-1] == {"m-v2"}  # client work at the candidate itself is not waited for
        clients[0] = False
        await asyncio.sleep(0.01)
        assert [d for d, _ in models.calls] == ["m", "m", "m", "m-v2", "m-v2"]
        assert v.shadows[("m", "2")].rows == 2 and v.mirrors.inflight == 0

    virtual_time(main)()  # the sleeps let every mirror finish, whatever the machine's load


@pytest.mark.parametrize("batch", [1, 3])
def test_an_idle_router_sends_the_shadows_batch_of_mirrors_at_once(batch: int):
    async def main() -> None:
        models = Models()
        clients = [True]
        shadow = {"version": "2", "max_inflight": 8, "batch": batch}
        v = VersionedModels(args(m={"weights": {"1": 1}, "shadow": shadow}), models.submit, client_work=lambda _: clients[0])
        models.hold.add("m-v2")
        for _ in range(4):
            await v.submit("m", ["a"], 1, Priority.NORMAL, None, None)
        clients[0] = False
        await asyncio.sleep(0.01)
        # Out at once: the shadow's batch, the rest waiting until those are done.
        assert v.mirrors.inflight == batch and len(v.mirrors.waiting) == 4 - batch
        await v.stop()

    virtual_time(main)()
