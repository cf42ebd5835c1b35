"""Router replicas that follow their own load, on a real Serve app started as users start it
(`ray start`, then `serve run CONFIG`): each router reports the cores it uses
(`record_autoscaling_stats`), and `RouterLoadPolicy` adds a router under load and takes it
away when the load ends. The CPU target is set low so that a 2-core machine's load shows it.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.cli_serving import app_config, running_replicas, serve_run, wait_for

pytestmark = pytest.mark.integration

PORT = 8131
URL = f"http://127.0.0.1:{PORT}"
RAY_PORT = 6395
TARGET_CORES = 0.2  # an idle router uses a few hundredths of a core; one under load, several tenths
POLICY = "serve_app.scheduling.autoscale:RouterLoadPolicy"


def _config(model_dir: Path) -> dict[str, Any]:
    router_scaling = {
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": 2,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2,
        "upscale_delay_s": 1,
        "downscale_delay_s": 4,
        "policy": {"policy_function": POLICY, "policy_kwargs": {"target_cores": TARGET_CORES}},
    }
    return app_config(
        PORT,
        {"model_dir": str(model_dir), "models": {"bert-light": {"preset": "bert-tiny"}}},
        [
            {"name": "router", "ray_actor_options": {"num_cpus": 0.1}, "autoscaling_config": router_scaling},
            {"name": "bert-light", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}},
        ],
    )


@pytest.fixture(scope="module")
def app(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_SERVE_ENABLE_HA_PROXY": "0"}
    start = ["--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats"]
    path = tmp_path_factory.mktemp("routers") / "config.yaml"
    for _ in serve_run(env, start, RAY_PORT, _config(tiny_model_dir), path, URL):
        yield env


def _routers(env: dict[str, str]) -> int:
    return running_replicas(env, RAY_PORT, "router")


def test_routers_scale_out_on_their_own_cpu_and_back_in_when_it_falls(app):
    wait_for(lambda: _routers(app) == 1, 60, "an idle app kept more than one router")
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["the food was great"]}]}
    statuses: list[int] = []

    async def load() -> bool:
        async with httpx.AsyncClient(base_url=URL, timeout=30) as client:
            stop = asyncio.Event()

            async def worker() -> None:
                while not stop.is_set():
                    try:
                        statuses.append((await client.post("/v2/models/bert-light/infer", json=body)).status_code)
                    except httpx.HTTPError:  # counted as no answer
                        statuses.append(0)

            workers = [asyncio.ensure_future(worker()) for _ in range(12)]
            deadline = time.monotonic() + 90
            scaled = False
            while time.monotonic() < deadline and not scaled:
                await asyncio.sleep(1)
                scaled = await asyncio.to_thread(_routers, app) == 2
            stop.set()
            await asyncio.gather(*workers)
            return scaled

    assert asyncio.run(load()), "a router under load never got a second replica"
    # Serve may refuse while the new router starts (503 with Retry-After); never a 5xx of ours.
    assert statuses and set(statuses) <= {0, 200, 503}, sorted(set(statuses))
    assert statuses.count(0) <= 0.01 * len(statuses), statuses.count(0)
    assert statuses.count(200) > 0.9 * len(statuses)
    wait_for(lambda: _routers(app) == 1, 90, "the routers never scaled back in once the load ended")
