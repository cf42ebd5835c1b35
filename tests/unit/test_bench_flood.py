"""The flood scenario's config: the user's config, its model pinned to one replica, open to high priority."""

from __future__ import annotations

from pathlib import Path

import yaml

from benchmarks.flood import client, flood_config
from serve_app.config import ROUTER_ADVANCED, advanced_of


def test_the_flood_runs_the_shipped_config_with_the_model_pinned_and_high_priority_open():
    base = yaml.safe_load(Path("configs/local.yaml").read_text())
    config = flood_config(base, Path("/m"), "resnet-heavy")
    app = config["applications"][0]
    assert app["args"]["model_dir"] == "/m" and app["args"]["scheduling"]["anonymous_max_priority"] == "high"
    # The router's own overload control stays on.
    assert advanced_of(app["args"]["scheduling"], ROUTER_ADVANCED)["router_delay_target_ms"] == 20
    tried = flood_config(base, Path("/m"), "resnet-heavy", 7.5)["applications"][0]["args"]["scheduling"]
    assert advanced_of(tried, ROUTER_ADVANCED)["router_delay_target_ms"] == 7.5
    (model,) = [d for d in app["deployments"] if d["name"] == "resnet-heavy"]
    assert model["num_replicas"] == 1 and "autoscaling_config" not in model
    assert "cache" not in app["args"] and not any(d["name"].endswith("-v2") for d in app["deployments"])


def test_a_phase_keeps_the_clients_figures_and_drops_its_records():
    kept = client({"requests": 3, "statuses": {"200": 3}, "p99_ms": 1.0, "records": [[1]], "other": 0})
    assert kept == {"requests": 3, "statuses": {"200": 3}, "p99_ms": 1.0}
