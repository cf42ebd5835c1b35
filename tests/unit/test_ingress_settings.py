"""The one ingress this project ships: `serve-app serve` (README's serve command), the KubeRay pods
and the benchmarks' default name the same Ray Serve ingress settings, from one module, or the
measured setup is not the one users run."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

import yaml

from benchmarks.cluster import base_env
from benchmarks.scenarios import DEFAULT_INGRESS
from serve_app.router.startup import FAST_INGRESS, ingress_report
from serve_app.tools.ingress_env import (
    DIRECT_INFER_ENV,
    HAPROXY_MAXCONN,
    INGRESS_ENV,
    RAY_DEFAULT_MAXCONN,
    export_lines,
    haproxy_maxconn,
    with_ingress_env,
)
from serve_app.tools.kuberay import render, serve_config_of

ROOT = Path(__file__).resolve().parents[2]


def _pod_envs() -> list[dict[str, str]]:
    manifest = yaml.safe_load(render(ROOT / "configs" / "gpu.yaml"))
    spec = manifest["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [
        {e["name"]: str(e["value"]) for e in c["env"] if e["name"].startswith("RAY_SERVE_")}
        for g in groups
        for c in g["template"]["spec"]["containers"]
    ]


def test_readme_kuberay_and_the_benchmarks_run_the_same_ingress() -> None:
    assert INGRESS_ENV["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    # The benchmarks set the ingress switches per scenario, HAProxy's connections fitted to this
    # machine's limit on open files as `serve-app serve` fits them; none adds the opt-in direct path.
    assert DEFAULT_INGRESS.env() == with_ingress_env({})
    assert not base_env().keys() & DIRECT_INFER_ENV.keys() - os.environ.keys()
    pods = _pod_envs()
    assert len(pods) >= 3  # head, ingress group, GPU workers
    for env in pods:
        assert env == INGRESS_ENV
    block = re.search(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    assert block and block.group(1).endswith("serve-app serve --config configs/local.yaml"), "README's serve command"
    assert len(block.group(1).split("&&")[-1]) < 120


def test_an_operator_s_own_setting_wins_over_the_shipped_one() -> None:
    env = with_ingress_env({"RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL": "9", "PATH": "/bin"})
    assert env["RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL"] == "9" and env["PATH"] == "/bin"
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"


def test_haproxy_s_connections_fit_the_open_files_limit_it_inherits() -> None:
    """HAProxy takes about 2.5 descriptors a connection (maxsock: both sides plus maxconn/4 splice
    pipes, two each) and refuses to start above the hard limit; a limit too low for Ray's own
    default is left as Ray would."""
    assert haproxy_maxconn(None) == HAPROXY_MAXCONN == int(INGRESS_ENV["RAY_SERVE_HAPROXY_MAXCONN"])
    assert haproxy_maxconn(1 << 20) == haproxy_maxconn(-1) == HAPROXY_MAXCONN  # -1: RLIM_INFINITY
    for limit in (20_000, 16_384, 12_000):
        maxconn = haproxy_maxconn(limit)
        assert RAY_DEFAULT_MAXCONN < maxconn <= HAPROXY_MAXCONN
        assert 2 * maxconn + 2 * (maxconn // 4) + 64 <= limit, limit  # what HAProxy 2.8 asked for, plus its listeners
    assert haproxy_maxconn(16_384) < HAPROXY_MAXCONN  # fitted, not the whole
    assert haproxy_maxconn(4_096) == haproxy_maxconn(1_024) == RAY_DEFAULT_MAXCONN


def test_every_shipped_config_and_the_kuberay_manifest_release_idle_connections_within_seconds() -> None:
    """uvicorn keeps a connection reset while idle until its keep-alive timer fires; at Serve's
    default (90 s) a spike's connections outlived it in the router's heap (configs/local.yaml)."""
    from ray.serve.schema import HTTPOptionsSchema

    serve_default = HTTPOptionsSchema().keep_alive_timeout_s

    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        timeout = yaml.safe_load(path.read_text())["http_options"].get("keep_alive_timeout_s")
        assert timeout is not None and 0 < timeout <= 10 < serve_default, path.name
    serve_config = serve_config_of((ROOT / "k8s" / "rayservice.yaml").read_text())
    assert serve_config["http_options"]["keep_alive_timeout_s"] == 5


def test_the_ingress_settings_print_as_exports_a_shell_reads_back() -> None:
    lines = export_lines(with_ingress_env({}))
    out = subprocess.run(["bash", "-c", f"{lines}\nenv"], capture_output=True, text=True, check=True, env={}).stdout
    assert set(with_ingress_env({}).items()) <= {tuple(line.split("=", 1)) for line in out.splitlines()}


def test_the_router_says_which_ingress_runs_and_what_makes_it_fast() -> None:
    level, line = ingress_report({}, direct_infer=False)
    assert level == logging.WARNING and "Python proxy" in line and "serve-app ingress-env" in line
    assert ingress_report(INGRESS_ENV, direct_infer=False) == (logging.INFO, "ingress: HAProxy, throughput-optimized")
    assert "504" in ingress_report(INGRESS_ENV, direct_infer=True)[1]
    assert FAST_INGRESS.items() <= INGRESS_ENV.items()
