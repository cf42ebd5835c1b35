"""The one ingress this project ships: README's serve command, the KubeRay pods and the
benchmarks' default must name the same Ray Serve ingress settings, or the measured setup is not
the one users run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from benchmarks.scenarios import DEFAULT_INGRESS
from serve_app.kuberay import render

ROOT = Path(__file__).resolve().parents[2]


def _readme_serve_env() -> dict[str, str]:
    block = re.search(r"```bash\n(.*?serve run configs/local\.yaml)\n```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README's serve command"
    words = shlex.split(block.group(1).split("&&")[-1])
    return dict(w.split("=", 1) for w in words if re.match(r"RAY_SERVE_\w+=", w))


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
    shipped = DEFAULT_INGRESS.env()
    assert shipped["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert _readme_serve_env() == shipped
    pods = _pod_envs()
    assert len(pods) >= 3  # head, ingress group, GPU workers
    for env in pods:
        assert env == shipped
