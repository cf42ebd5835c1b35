"""One behaviour whatever the launcher: the same table of requests through plain `serve run` (Serve's
Python proxy) and through the settings `serve-app serve` starts Ray with (HAProxy, throughput
optimized), each on a cluster started with `ray start` as a VM cluster would be. Status codes,
bodies and Serve's request counter for the router must move the same way on both.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from serve_app.tools.ingress_env import with_ingress_env
from tests.integration.cli_serving import app_config, serve_run, wait_for

pytestmark = pytest.mark.integration
PORT = 8141
URL = f"http://127.0.0.1:{PORT}"
RAY_PORT = 6397
METRICS_PORT = 8142
KEY, LIMITED_KEY = "launcher-test-key", "launcher-limited-key"
TIMEOUT_S = 2  # Serve's http_options.request_timeout_s
SLOW_S = 4.0  # each batch of the model `slow` takes this long: past the timeout
MAX_BYTES = 4096  # limits.max_request_bytes
COUNTER = "ray_serve_deployment_request_counter_total"


def _config(model_dir: Path) -> dict[str, Any]:
    tenants = [
        {"name": "main", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest()},
        {"name": "limited", "key_sha256": hashlib.sha256(LIMITED_KEY.encode()).hexdigest(), "rate_per_s": 0.01, "burst": 1},
    ]
    args = {
        "model_dir": str(model_dir),
        "models": {"bert-light": {"preset": "bert-tiny"}, "slow": {"preset": "bert-tiny", "faults": {"delay_s": SLOW_S}}},
        "tenants": tenants,
        "limits": {"max_request_bytes": MAX_BYTES},
    }
    deployments = [
        {"name": "router", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}},
        {"name": "bert-light", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}},
        {"name": "slow", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25}},
    ]
    config = app_config(PORT, args, deployments)
    config["http_options"]["request_timeout_s"] = TIMEOUT_S
    return config


def _text(text: str = "the food was great") -> dict[str, Any]:
    return {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}]}


AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITED = {"Authorization": f"Bearer {LIMITED_KEY}"}
# (what it is, path, JSON body or raw bytes, headers)
TABLE: list[tuple[str, str, Any, dict[str, str]]] = [
    ("valid", "/v2/models/bert-light/infer", _text(), AUTH),
    ("malformed JSON", "/v2/models/bert-light/infer", b"{not json", AUTH),
    (
        "wrong input name",
        "/v2/models/bert-light/infer",
        {"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": ["a"]}]},
        AUTH,
    ),
    ("unknown model", "/v2/models/nope/infer", _text(), AUTH),
    ("no key", "/v2/models/bert-light/infer", _text(), {}),
    ("oversize", "/v2/models/bert-light/infer", _text("x" * 2 * MAX_BYTES), AUTH),
    ("within the tenant's burst", "/v2/models/bert-light/infer", _text(), LIMITED),
    ("over the tenant's rate", "/v2/models/bert-light/infer", _text(), LIMITED),
    ("past request_timeout_s", "/v2/models/slow/infer", _text(), AUTH),
]


def _answer(resp: httpx.Response) -> tuple[int, Any]:
    """Status and body, with what differs per request (ids, timings) taken out."""
    try:
        body: Any = resp.json()
    except ValueError:
        body = re.sub(r"Request \S+ timed out", "Request <id> timed out", resp.text)
    if isinstance(body, dict):
        body.pop("id", None)
    return resp.status_code, body


def _router_requests() -> float:
    """Serve's request counter for the router deployment, summed over its routes and codes."""
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith(COUNTER + "{") and 'deployment="router"' in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def _settled(read: Any, at_least: float, timeout_s: float = 60) -> float:
    """The counter once it has reached `at_least` and then stayed put for a few seconds (Ray exports metrics late)."""
    wait_for(lambda: read() >= at_least, timeout_s, f"{COUNTER} never reached {at_least}")
    last = read()
    while True:
        time.sleep(6)
        now = read()
        if now == last:
            return now
        last = now


Answers = list[tuple[str, int, Any, str | None]]


def _run_table() -> tuple[Answers, float, bool]:
    """The table's answers, how far Serve's request counter for the router moved, and whether HAProxy ran."""
    haproxy = any(p.info["name"] == "haproxy" for p in psutil.process_iter(["name"]))
    before = _settled(_router_requests, 0)
    answers = []
    with httpx.Client(base_url=URL, timeout=30) as client:
        for what, path, body, headers in TABLE:
            sent = body if isinstance(body, bytes) else None
            resp = client.post(
                path, content=sent, json=None if sent else body, headers={"Content-Type": "application/json", **headers}
            )
            answers.append((what, *_answer(resp), resp.headers.get("retry-after")))
    return answers, _settled(_router_requests, before + len(TABLE)) - before, haproxy


def _launch(tiny_model_dir: Path, env: dict[str, str], path: Path) -> tuple[Answers, float, bool]:
    start = ["--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats", f"--metrics-export-port={METRICS_PORT}"]
    link = tiny_model_dir / "slow"
    if not link.exists():
        link.symlink_to(tiny_model_dir / "bert-light")
    cluster = serve_run(env, start, RAY_PORT, _config(tiny_model_dir), path, URL)
    next(cluster)
    try:
        return _run_table()
    finally:
        cluster.close()  # stops Ray


def test_plain_serve_run_and_serve_app_serve_answer_a_table_of_requests_the_same(tiny_model_dir: Path, tmp_path: Path) -> None:
    plain_env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_SERVE_ENABLE_HA_PROXY": "0"}
    plain, plain_count, plain_haproxy = _launch(tiny_model_dir, plain_env, tmp_path / "plain.yaml")
    ours_env = with_ingress_env({**os.environ, "RAY_AUTH_MODE": "token"})  # what `serve-app serve` starts Ray with
    ours, ours_count, ours_haproxy = _launch(tiny_model_dir, ours_env, tmp_path / "ours.yaml")
    assert (plain_haproxy, ours_haproxy) == (False, True), "Serve's Python proxy, then HAProxy"
    assert ours == plain
    statuses = {what: status for what, status, _, _ in plain}
    assert statuses == {
        "valid": 200,
        "malformed JSON": 400,
        "wrong input name": 400,
        "unknown model": 404,
        "no key": 401,
        "oversize": 413,
        "within the tenant's burst": 200,
        "over the tenant's rate": 429,
        "past request_timeout_s": 408,
    }
    assert plain[7][3] is not None, "a 429 says when to come back"
    assert ours_count == plain_count == len(TABLE)
