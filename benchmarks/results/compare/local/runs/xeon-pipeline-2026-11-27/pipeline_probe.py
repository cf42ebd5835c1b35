"""Where a bert-heavy request's time goes under 32 closed-loop clients, ours or plain Ray Serve.

One deployment (configs/local.yaml unless given), 4 s of warm-up load, then 16 s measured: the
load generator's goodput and latency, the node's CPU shares from /proc/stat over 8 s of it and,
for ours, the router's `/router/status` (learned in-flight limit, and per batch at p50/p99: the
wait in the router's queue, the round trip to the replica, the replica's queue and the run).

    PYTHONPATH=$PWD python benchmarks/results/compare/local/runs/xeon-pipeline-2026-11-27/pipeline_probe.py ours [CONFIG]
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import scenarios
from benchmarks.cluster import HTTP_PORT, RayCluster, run_loadgen

MODEL = "bert-heavy"
CPU_FIELDS = ["user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"]


def cpu_ticks() -> list[int]:
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1 : 1 + len(CPU_FIELDS)]]


def main(which: str, config: str) -> dict[str, Any]:
    s = scenarios.Settings(models=[MODEL], model_dir=Path("models").resolve(), config=Path(config))
    tmp = Path(tempfile.mkdtemp())
    url = f"http://127.0.0.1:{HTTP_PORT}"
    found: dict[str, Any] = {}
    with RayCluster(scenarios.DEFAULT_INGRESS, tmp, s.model_dir) as cluster:
        app = scenarios.ours_config(s) if which == "ours" else scenarios.plain_config(s, MODEL)
        cluster.deploy(app, scenarios.probe(s, MODEL))
        workload = scenarios.workload(s, MODEL, tmp)
        run_loadgen(url, workload, {"concurrency": 32}, 4, 0.0)

        def sample() -> None:
            time.sleep(4)
            before = cpu_ticks()
            time.sleep(8)
            after = cpu_ticks()
            total = sum(after) - sum(before)
            shares = zip(CPU_FIELDS, before, after, strict=False)
            found["cpu_percent"] = {k: round(100 * (b - a) / total, 1) for k, a, b in shares}
            if which == "ours":
                status = httpx.get(f"{url}/router/status", timeout=10).json()
                found["router_status"] = status["models"][MODEL]["lanes"]["bulk"]

        sampler = threading.Thread(target=sample)
        sampler.start()
        load = run_loadgen(url, workload, {"concurrency": 32}, 16, 0.0)
        sampler.join()
    return {"setup": which, "config": config, **{k: load[k] for k in ("goodput_rps", "p50_ms", "p99_ms")}, **found}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "configs/local.yaml"), indent=1))
