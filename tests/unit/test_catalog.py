"""The router's model catalog without Ray: names, routes, manifests and live readiness."""

from __future__ import annotations

import asyncio
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from serve_app.config import AppArgs
from serve_app.errors import NotFound
from serve_app.router.routing.catalog import ModelCatalog
from serve_app.router.routing.replicas import DeploymentState, DeploymentStates, parse_status
from tests.conftest import tiny_args


class Replicas:
    """The models' metadata calls: answered while `up`, failing (as a dead deployment's would) otherwise."""

    def __init__(self) -> None:
        self.up = True
        self.calls = 0

    async def fetch(self, model: str) -> dict[str, Any]:
        self.calls += 1
        if not self.up:
            raise RuntimeError("no replicas")
        manifest = {"name": model, "family": "bert", "inputs": [], "outputs": [], "version": "1"}
        return {"manifest": manifest, "batching": {"max_batch_size": 8}}


def catalog(replicas: Replicas, **kw: Any) -> ModelCatalog:
    return ModelCatalog(AppArgs.model_validate(tiny_args(Path("/nonexistent"))), replicas.fetch, **{"ready_ttl_s": 0, **kw})


def test_readiness_follows_the_replicas_and_not_the_cached_manifest():
    replicas = Replicas()
    c = catalog(replicas)
    assert asyncio.run(c.all_ready(["bert-heavy"]))
    replicas.up = False
    assert not asyncio.run(c.all_ready(["bert-heavy"]))  # the manifest is cached; readiness is not
    assert asyncio.run(c.manifest("bert-heavy")).version == "1"  # metadata still answers from the cache
    replicas.up = True
    assert asyncio.run(c.all_ready(["bert-heavy"]))


def test_names_routes_and_versions():
    c = catalog(Replicas())
    assert c.members("text-classify") == ["bert-light", "bert-heavy"] and c.members("gpt") == ["gpt"]
    assert c.answering_model("text-classify") == "bert-light" and c.platform("text-classify") == "ensemble"
    assert c.generators() == ["gpt"]
    with pytest.raises(NotFound, match="available"):
        c.known("nope")
    assert c.deployment("bert-heavy", "1") == c.deployment("bert-heavy", None) == "bert-heavy"
    assert c.deployment("text-classify", "1") == "bert-light" and c.versions("text-classify") == ["1"]
    with pytest.raises(NotFound, match="no version '2'"):
        c.deployment("bert-heavy", "2")
    with pytest.raises(NotFound, match="no version '2'"):
        c.deployment("text-classify", "2")


class Controller:
    """Serve's controller as the router asks it: each deployment's status and running replicas."""

    def __init__(self, states: dict[str, DeploymentState]) -> None:
        self.states = states
        self.calls = 0
        self.down = False

    async def fetch(self) -> dict[str, DeploymentState]:
        self.calls += 1
        await asyncio.sleep(0)
        if self.down:
            raise RuntimeError("controller unreachable")
        return self.states


def test_a_model_scaled_to_zero_is_ready_without_being_asked_and_others_are_still_asked():
    replicas = Replicas()
    controller = Controller({"bert-heavy": DeploymentState("HEALTHY", 0), "bert-light": DeploymentState("HEALTHY", 1)})
    c = ModelCatalog(
        AppArgs.model_validate(tiny_args(Path("/nonexistent"))),
        replicas.fetch,
        DeploymentStates(controller.fetch, ttl_s=60),
        ready_ttl_s=0,
    )
    assert asyncio.run(c.is_ready("bert-heavy")) and replicas.calls == 0  # a probe must not wake it
    assert asyncio.run(c.is_ready("bert-light")) and replicas.calls == 1
    replicas.up = False
    assert not asyncio.run(c.is_ready("bert-light"))  # a running model is still asked every time
    for status in ("UPDATING", "UNHEALTHY", "DEPLOY_FAILED"):  # deploying or broken at zero: not ready
        controller.states["bert-heavy"] = DeploymentState(status, 0)
        c.states = DeploymentStates(controller.fetch)
        assert not asyncio.run(c.is_ready("bert-heavy"))
    controller.down = True  # the controller cannot say: the replicas are asked, as before
    c.states = DeploymentStates(controller.fetch)
    replicas.up = True
    assert asyncio.run(c.is_ready("bert-heavy")) and replicas.calls > 2


def test_the_controller_is_asked_once_per_ttl_however_many_probes_arrive_together():
    controller = Controller({"m": DeploymentState("HEALTHY", 0)})
    now = [0.0]
    states = DeploymentStates(controller.fetch, ttl_s=1.0, clock=lambda: now[0])

    async def probes() -> list[bool]:
        return await asyncio.gather(*(states.scaled_to_zero("m") for _ in range(20)))

    assert asyncio.run(probes()) == [True] * 20 and controller.calls == 1
    now[0] = 0.5
    assert asyncio.run(states.scaled_to_zero("m")) and controller.calls == 1
    now[0] = 1.5
    assert asyncio.run(states.scaled_to_zero("m")) and controller.calls == 2
    assert not asyncio.run(states.scaled_to_zero("unknown"))


def test_serve_instance_details_are_read_with_statuses_as_strings_or_enums():
    class Status(Enum):
        HEALTHY = "HEALTHY"

    # The shape of Serve's public `serve.status()`: applications -> deployments -> status and
    # replica counts by state.
    status = SimpleNamespace(
        applications={
            "default": SimpleNamespace(
                deployments={
                    "cold": SimpleNamespace(status=Status.HEALTHY, replica_states={}),
                    "warm": SimpleNamespace(status="UPSCALING", replica_states={"RUNNING": 2, "STARTING": 1}),
                }
            )
        }
    )
    states = parse_status(status, "default")
    assert states["cold"] == DeploymentState("HEALTHY", 0) and states["cold"].scaled_to_zero
    assert states["warm"] == DeploymentState("UPSCALING", 2) and not states["warm"].scaled_to_zero
    assert parse_status(status, "other") == {}


def test_a_manifest_on_this_node_is_read_from_disk_without_asking_a_replica(tiny_model_dir):
    replicas = Replicas()
    replicas.up = False
    c = ModelCatalog(AppArgs.model_validate(tiny_args(tiny_model_dir)), replicas.fetch)
    manifest = asyncio.run(c.manifest("bert-light"))
    assert manifest.family == "bert" and replicas.calls == 0
    assert c.batching["bert-light"]["max_batch_size"] >= 1


def test_readiness_answers_are_reused_for_a_second_and_a_burst_of_probes_asks_each_model_once():
    replicas = Replicas()
    now = [0.0]
    c = catalog(replicas, ready_ttl_s=1.0, clock=lambda: now[0])

    async def probes() -> list[bool]:
        return await asyncio.gather(*(c.all_ready(["bert-heavy", "bert-light"]) for _ in range(50)))

    assert asyncio.run(probes()) == [True] * 50 and replicas.calls == 2
    replicas.up = False
    now[0] = 0.5
    assert asyncio.run(c.is_ready("bert-heavy")) and replicas.calls == 2  # within the second: the last answer
    now[0] = 1.5
    assert not asyncio.run(c.is_ready("bert-heavy")) and replicas.calls == 3  # then asked again


def test_a_model_that_cannot_load_is_refused_here_never_ready_and_left_out_of_server_readiness():
    from serve_app.errors import Unavailable
    from serve_app.router.routing.dispatchers import DispatcherPool

    replicas = Replicas()
    args = AppArgs.model_validate(tiny_args(Path("/nonexistent"))).model_copy(
        update={"unavailable": {"bert-light": "no tokenizer.json in /m: save it"}}
    )
    c = ModelCatalog(args, replicas.fetch, ready_ttl_s=0)
    with pytest.raises(Unavailable, match=r"model bert-light cannot load: no tokenizer\.json") as caught:
        asyncio.run(c.manifest("bert-light"))
    assert caught.value.status_code == 503 and caught.value.retry_after_s
    assert not asyncio.run(c.is_ready("bert-light")) and replicas.calls == 0  # its stand-in is never asked
    assert "bert-light" not in c.serving() and "bert-heavy" in c.serving()
    # Its route shows, and decodes for, the heavy tier; a cascade's call to the light tier gets the 503.
    assert c.deployment("text-classify", None) == "bert-heavy"
    pool = DispatcherPool(args, send_for=lambda model: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(Unavailable, match="cannot load"):
        pool.get("bert-light")
