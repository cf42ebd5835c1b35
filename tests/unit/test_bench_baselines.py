"""The baselines that `compare` and `generation` measure ours against start as ours' front does:
a CPU priority given to ours' router is given to plain Ray Serve's replicas too."""

from __future__ import annotations

from pathlib import Path

import yaml

from benchmarks.generation import generation_config
from benchmarks.scenarios import Settings, plain_config

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "configs" / "local.yaml"


def _router_runtime_env(config: dict) -> dict:
    router = next(d for d in config["applications"][0]["deployments"] if d["name"] == "router")
    return router["ray_actor_options"]["runtime_env"]


def test_plain_replicas_start_at_the_niceness_ours_router_starts_at() -> None:
    shipped = yaml.safe_load(LOCAL.read_text())
    assert _router_runtime_env(shipped) == {"env_vars": {"RAY_worker_niceness": "0"}}
    [plain] = plain_config(Settings(["resnet-heavy"], ROOT / "models", LOCAL), "resnet-heavy")["applications"]
    [deployment] = plain["deployments"]
    assert deployment["ray_actor_options"]["runtime_env"] == _router_runtime_env(shipped)
    assert deployment["ray_actor_options"]["num_cpus"] == 0.3  # the model's own resources, kept


def test_plain_generator_starts_at_the_niceness_ours_router_starts_at() -> None:
    shipped = yaml.safe_load(LOCAL.read_text())
    config = generation_config(yaml.safe_load(LOCAL.read_text()), ROOT / "models", 4, [0.01])
    plain = next(a for a in config["applications"] if a["name"] == "plain")
    [deployment] = plain["deployments"]
    assert deployment["ray_actor_options"]["runtime_env"] == _router_runtime_env(shipped)


def test_a_router_without_a_runtime_env_leaves_plain_as_it_was(tmp_path: Path) -> None:
    config = yaml.safe_load(LOCAL.read_text())
    for d in config["applications"][0]["deployments"]:
        d.get("ray_actor_options", {}).pop("runtime_env", None)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    [plain] = plain_config(Settings(["resnet-heavy"], ROOT / "models", path), "resnet-heavy")["applications"]
    assert "runtime_env" not in plain["deployments"][0]["ray_actor_options"]
