"""One Serve application per test module, started the way `serve run` users start it: `ray start`
in token mode, then `serve run CONFIG`. No Ray import here: a Ray client in the test process
would need the token-auth setting before `import ray`, for every module."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.cluster import ensure_auth_token, stop_ray, wait_for_ray_exit

REPLICAS_SCRIPT = """
import sys, ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
states = serve.status().applications["default"].deployments[sys.argv[2]].replica_states
print("running replicas:", states.get("RUNNING", 0))
"""


def serve_run(
    env: dict[str, str], start: list[str], ray_port: int, config: dict[str, Any], path: Path, url: str
) -> Iterator[None]:
    """`ray start` (the arguments after `ray start --head`), `serve run` the config, wait until the
    app is ready at `url`; yields, then stops Ray and whatever it leaves behind."""
    wait_for_ray_exit()
    ensure_auth_token(env)  # a fresh machine has none, and token mode will not start without one
    subprocess.run(["ray", "start", "--head", f"--port={ray_port}", *start], check=True, env=env, capture_output=True)
    path.write_text(yaml.safe_dump(config))
    try:
        run = ["serve", "run", f"--address=127.0.0.1:{ray_port}", "--non-blocking", str(path)]
        subprocess.run(run, check=True, env=env, capture_output=True, timeout=180)
        wait_for(lambda: ready(url), 120, "application never became ready")
        yield
    finally:
        stop_ray()


def app_config(port: int, args: dict[str, Any], deployments: list[dict[str, Any]]) -> dict[str, Any]:
    """A Serve config of this app as users write one: one application, the router behind the
    proxy on the head node, on 127.0.0.1:`port`."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {"name": "default", "route_prefix": "/", "import_path": "serve_app.app:build_app", "args": args,
             "deployments": deployments}
        ],
    }  # fmt: skip


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(condition: Callable[[], bool], timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.5)


def running_replicas(env: dict[str, str], ray_port: int, deployment: str) -> int:
    """Running replicas of a deployment, from Serve's own status (in a child process)."""
    args = [sys.executable, "-c", REPLICAS_SCRIPT, f"127.0.0.1:{ray_port}", deployment]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    # The last line of ours: Ray's raylet may print warnings to the same stdout, after it as well.
    ours = [line for line in out.stdout.splitlines() if line.startswith("running replicas: ")]
    assert ours, out.stdout[-2000:]
    return int(ours[-1].split(": ", 1)[1])
