"""docs/models.md's three models served as written: the guide's exports, then `serve run
my-models.yaml` from the reader's directory onto a Ray cluster with room for what the guide's
`deployments:` ask (one CPU for each model, one for the router: more than this 2-core machine
has, so the cluster is started with logical CPUs). Each model answers the guide's requests, and
its replica holds the resources its entry names."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from tests.guide import blocks, reader_dir, run_block
from tests.integration.cli_serving import ClusterDriver, serve_run

pytestmark = pytest.mark.integration
RAY_PORT = 6398
URL = "http://127.0.0.1:8000"  # the guide's config names no port: Serve's default

REPLICA_RESOURCES = """
import json
for name in args:
    info = serve.get_deployment_handle(name, "default").runtime_info.remote().result(timeout_s=60)
    print("=", json.dumps([name, info["resources"]]))
"""


def _guide_requests() -> list[tuple[str, dict[str, Any]]]:
    """The guide's curl lines: their path and JSON body."""
    (text,) = [b for b in blocks("text") if "curl" in b]
    out = []
    for line in text.splitlines():
        url, body = line.split("curl -s ", 1)[1].split(" -d ", 1)
        out.append((url.removeprefix("localhost:8000"), json.loads(body.strip("'"))))
    return out


def test_the_guides_models_serve_on_the_resources_their_entries_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    workdir = reader_dir(tmp_path)
    (config_text,) = blocks("yaml")
    exports = [line for line in blocks("bash")[0].splitlines() if line.startswith("optimum-cli export")]
    run_block(exports, workdir)
    config = yaml.safe_load(config_text)
    entries = {d["name"]: d["ray_actor_options"] for d in config["applications"][0]["deployments"]}
    monkeypatch.chdir(workdir)  # the reader's directory: the config's paths are relative to it
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    start = ["--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats"]
    cluster = serve_run(env, start, RAY_PORT, config, workdir / "my-models.yaml", URL)
    next(cluster)
    try:
        with httpx.Client(base_url=URL, timeout=120) as client:
            for path, body in _guide_requests():
                r = client.post(path, json=body)
                assert r.status_code == 200, (path, r.text)
            image = np.random.default_rng(0).random((1, 3, 64, 64), dtype=np.float32)
            body = {"inputs": [{"name": "image", "shape": list(image.shape), "datatype": "FP32", "data": image.ravel().tolist()}]}
            r = client.post("/v2/models/my-resnet/infer", json=body)
            assert r.status_code == 200, r.text
            assert len(r.json()["outputs"][0]["data"]) == 10
        driver = ClusterDriver(env, RAY_PORT)
        try:
            held = [json.loads(line) for line in driver.run(REPLICA_RESOURCES, *entries)]
        finally:
            driver.close()
        by_model = {name: resources for name, resources in held if name in entries}
        assert set(by_model) == set(entries), held
        for name, options in entries.items():
            assert by_model[name].get("CPU") == options["num_cpus"], (name, by_model[name])
            assert by_model[name].get("GPU", 0) == options.get("num_gpus", 0), (name, by_model[name])
    finally:
        cluster.close()
