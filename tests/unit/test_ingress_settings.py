"""The one ingress this project ships: `serve-app serve` (README's serve command), the KubeRay pods
and the benchmarks' default name the same Ray Serve ingress settings, from one module, or the
measured setup is not the one users run."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from benchmarks.cluster import base_env
from benchmarks.scenarios import DEFAULT_INGRESS
from serve_app.tools.ingress_env import DIRECT_INFER_ENV, INGRESS_ENV, with_ingress_env
from serve_app.tools.kuberay import render

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
    # The benchmarks set the ingress switches per scenario and the direct path's hook under every one.
    assert {**DEFAULT_INGRESS.env(), **DIRECT_INFER_ENV} == INGRESS_ENV
    assert base_env().items() >= DIRECT_INFER_ENV.items()
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
