"""The routers scenario's config and report (the run itself needs Ray: `python -m benchmarks routers`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import yaml

from benchmarks.routers import markdown, mean_rows, routers_config


def test_the_model_is_pinned_to_one_replica_and_the_routers_to_the_count_asked():
    base = yaml.safe_load(Path("configs/local.yaml").read_text())
    config = routers_config(base, Path("/m"), "resnet-heavy", 2)
    app = config["applications"][0]
    (router,) = [d for d in app["deployments"] if d["name"] == "router"]
    (model,) = [d for d in app["deployments"] if d["name"] == "resnet-heavy"]
    assert router["num_replicas"] == 2 and "autoscaling_config" not in router
    assert router["ray_actor_options"]["num_cpus"] == 0.1
    assert model["num_replicas"] == 1 and "autoscaling_config" not in model
    assert app["args"]["model_dir"] == "/m" and "cache" not in app["args"]


def test_mean_rows_weighs_each_batch_size_by_its_count():
    assert mean_rows(Counter({32: 3, 8: 1})) == 26.0 and mean_rows(Counter()) is None


def test_the_report_shows_each_router_count():
    run = {"goodput_rps": 900.0, "p50_ms": 30.0, "p99_ms": 50.0, "statuses": {"200": 10}, "replica_batches": {32: 3},
           "replica_mean_rows": 32.0, "router_sent": {"a": {"mean_rows": 16.0}, "b": {"mean_rows": 15.5}}}  # fmt: skip
    settings = {"model": "resnet-heavy", "concurrency": 32, "seconds": 20.0}
    text = markdown({"result": {"settings": settings, "runs": {"1": run, "2": run}}})
    assert "| 2 | 900.0 | 30.0 | 50.0 | 32.0 | 16.0, 15.5 |" in text
