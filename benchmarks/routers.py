"""`python -m benchmarks routers`: do requests for one model still form full batches when several
router replicas hold them?

Each router forms its own batches from the requests HAProxy gives it, so with `n` routers each
sees about 1/n of the traffic and would send batches about 1/n as full. The model replica's
executor merges the calls queued behind a running batch, up to `max_batch_size` rows
(serve_app/models/executor.py): what it runs is what counts. The same closed-loop load on one
model replica, with one router and then with two: throughput, the rows per batch each router
sent, and the rows per batch the replica ran (its own histogram, read through a deployment
handle before and after the window).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks import workloads
from benchmarks.cluster import HTTP_PORT, RAY_PORT, Probe, RayCluster, last_json, run_loadgen
from benchmarks.lifecycle import wait_for_replicas
from benchmarks.scenarios import DEFAULT_INGRESS, pin_replicas, single_versions

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
BATCH_SIZES = """
import asyncio, json, sys, ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")


async def batch_sizes():  # the cluster's throughput-optimized handles run on the caller's event loop
    info = await serve.get_deployment_handle(sys.argv[2], "default").runtime_info.remote()
    return info["batch_sizes"]


print(json.dumps(asyncio.run(batch_sizes())))
"""


@dataclass
class RoutersSettings:
    model: str = "resnet-heavy"
    router_counts: tuple[int, ...] = (1, 2)
    concurrency: int = 32
    seconds: float = 20.0
    warmup: float = 3.0

    @classmethod
    def smoke(cls) -> RoutersSettings:
        return cls(concurrency=8, seconds=3.0, warmup=1.0)


def routers_config(base: dict[str, Any], model_dir: Path, model: str, routers: int) -> dict[str, Any]:
    """The user's config on these model files: the model at one replica, `routers` routers (at a
    tenth of a CPU each, so that a second fits beside the catalog on a 2-core node)."""
    config = pin_replicas(single_versions(base), [model])
    app = config["applications"][0]
    app["args"]["model_dir"] = str(model_dir)
    app["args"]["scheduling"] = {**app["args"].get("scheduling", {}), "anonymous_max_priority": "high"}
    router = next(d for d in app["deployments"] if d["name"] == "router")
    router.pop("autoscaling_config", None)
    router["num_replicas"] = routers
    router["ray_actor_options"] = {**router.get("ray_actor_options", {}), "num_cpus": 0.1}
    return config


def replica_batches(env: dict[str, str], model: str) -> Counter[int]:
    """The model replica's executed batches so far, by rows."""
    done = subprocess.run(
        [sys.executable, "-c", BATCH_SIZES, f"127.0.0.1:{RAY_PORT}", model],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"reading {model}'s batch sizes failed: {done.stderr[-2000:]}")
    return Counter({int(k): v for k, v in last_json(done.stdout).items()})


def router_batches(model: str, routers: int) -> dict[str, dict[str, int]]:
    """Batches and rows each router replica sent the model: `/router/status` answers for whichever
    replica HAProxy picks, so it is asked until every replica has answered or 40 tries are spent."""
    seen: dict[str, dict[str, int]] = {}
    for _ in range(40):
        status = httpx.get(f"{BASE_URL}/router/status", timeout=10).json()
        m = status["models"].get(model, {})
        seen[status["router"]] = {"batches": m.get("batches", 0), "rows": m.get("completed_items", 0)}
        if len(seen) >= routers:
            break
    return seen


def mean_rows(batches: Counter[int]) -> float | None:
    n = sum(batches.values())
    return round(sum(size * k for size, k in batches.items()) / n, 2) if n else None


def run(s: RoutersSettings, model_dir: Path, config_path: Path) -> dict[str, Any]:
    base = yaml.safe_load(config_path.read_text())
    out: dict[str, Any] = {"settings": asdict(s), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        wl = workloads.write([workloads.v2_infer(s.model, model_dir / s.model, "normal")], tmp / "load.json")
        body = workloads.bodies_for(model_dir / s.model, 1)[0]
        with RayCluster(DEFAULT_INGRESS, tmp, model_dir) as cluster:
            for n in s.router_counts:
                config = routers_config(yaml.safe_load(yaml.safe_dump(base)), model_dir, s.model, n)
                cluster.deploy(config, Probe(f"/v2/models/{s.model}/infer", body))
                states = wait_for_replicas(cluster, "router", n)
                time.sleep(3.0)  # HAProxy's reload with the new router set
                before = replica_batches(cluster.env, s.model)
                load = run_loadgen(BASE_URL, wl, {"concurrency": s.concurrency}, s.seconds, s.warmup)
                ran = replica_batches(cluster.env, s.model) - before
                per_router = router_batches(s.model, n)
                out["runs"][str(n)] = {
                    "router_states": states,
                    "goodput_rps": load["goodput_rps"],
                    "p50_ms": load["p50_ms"],
                    "p99_ms": load["p99_ms"],
                    "statuses": load["statuses"],
                    "replica_batches": dict(sorted(ran.items())),
                    "replica_mean_rows": mean_rows(ran),
                    # Since each router started: includes the probe and warm-up, so a mean, not a window.
                    "router_sent": {
                        r: {**v, "mean_rows": round(v["rows"] / v["batches"], 2) if v["batches"] else None}
                        for r, v in per_router.items()
                    },
                    "cpu_cores_by_role": load.get("cpu_cores_by_role"),
                }
    return out


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    s = r["settings"]
    lines = [
        f"`{s['model']}` at one replica (max_batch_size from the config), {s['concurrency']} closed-loop clients "
        f"(JSON), {s['seconds']:.0f} s per router count.",
        "",
        "| routers | req/s | p50 ms | p99 ms | rows per batch the replica ran | rows per batch each router sent | statuses |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, run_ in r["runs"].items():
        sent = ", ".join(str(v["mean_rows"]) for v in run_["router_sent"].values())
        lines.append(
            f"| {n} | {run_['goodput_rps']} | {run_['p50_ms']} | {run_['p99_ms']} | {run_['replica_mean_rows']} "
            f"| {sent} | {run_['statuses']} |"
        )
    lines += ["", "The replica's batches by rows, per router count: "]
    lines += [f"- {n}: `{run_['replica_batches']}`" for n, run_ in r["runs"].items()]
    return "\n".join(lines) + "\n"
