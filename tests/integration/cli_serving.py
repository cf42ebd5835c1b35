"""One Serve application per test module, started the way `serve run` users start it: `ray start`
in token mode, then `serve run CONFIG`. No Ray import here: a Ray client in the test process
would need the token-auth setting before `import ray`, for every module."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.cluster import ensure_auth_token, stop_ray, wait_for_ray_exit

# A driver that stays connected to the cluster and runs the scripts sent on its stdin, one JSON
# line each ([script, args]), with `ray`, `serve` and `args` in scope; a script's answer is its
# lines that start "= " (Ray's raylet may print warnings to the same stdout), then "==". A new
# driver per question took seconds of the 2 cores (Python, Ray's import, the connection).
DRIVER_SCRIPT = """
import json, sys, ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
for line in sys.stdin:
    script, args = json.loads(line)
    try:
        exec(script, {"ray": ray, "serve": serve, "args": args})
        print("== ok", flush=True)
    except Exception as e:
        print("== error", repr(e).replace(chr(10), " "), flush=True)
"""

RUNNING_REPLICAS = """
states = serve.status().applications["default"].deployments[args[0]].replica_states
print("=", states.get("RUNNING", 0))
"""


def serve_run(
    env: dict[str, str], start: list[str], ray_port: int, config: dict[str, Any], path: Path, url: str
) -> Generator[None, None, None]:
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
        driver = _DRIVERS.pop(ray_port, None)
        if driver is not None:
            driver.close()
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


class ClusterDriver:
    """One driver process connected to a cluster, running scripts for the tests (DRIVER_SCRIPT)."""

    def __init__(self, env: dict[str, str], ray_port: int) -> None:
        args = [sys.executable, "-c", DRIVER_SCRIPT, f"127.0.0.1:{ray_port}"]
        self.proc = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.reader = ThreadPoolExecutor(max_workers=1)  # a read with a timeout: a hung driver fails the test

    def run(self, script: str, *args: str, timeout_s: float = 90) -> list[str]:
        """The script's "= " lines, without the prefix; its exception fails the test."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([script, list(args)]) + "\n")
        self.proc.stdin.flush()
        stdout, answer = self.proc.stdout, list[str]()
        while True:
            line = self.reader.submit(stdout.readline).result(timeout=timeout_s)
            assert line, f"the test driver ended (exit code {self.proc.poll()})"
            if line.startswith("== "):
                assert line == "== ok\n", line
                return answer
            if line.startswith("= "):
                answer.append(line[2:].rstrip("\n"))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.reader.shutdown(wait=False, cancel_futures=True)


# One driver per cluster (its Ray port), closed by `serve_run` before it stops Ray.
_DRIVERS: dict[int, ClusterDriver] = {}


def cluster_driver(env: dict[str, str], ray_port: int) -> ClusterDriver:
    if ray_port not in _DRIVERS:
        _DRIVERS[ray_port] = ClusterDriver(env, ray_port)
    return _DRIVERS[ray_port]


def running_replicas(env: dict[str, str], ray_port: int, deployment: str) -> int:
    """Running replicas of a deployment, from Serve's own status."""
    (count,) = cluster_driver(env, ray_port).run(RUNNING_REPLICAS, deployment)
    return int(count)
