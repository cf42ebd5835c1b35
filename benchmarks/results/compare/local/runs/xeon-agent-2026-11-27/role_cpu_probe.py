"""CPU per process label under 32 closed-loop clients on bert-heavy, ours or plain Ray Serve.

One deployment (configs/local.yaml unless given; ours with the whole demo catalog, as `bench
compare` runs it), 10 s idle, 4 s of warm-up load, then 16 s measured: the load generator's
goodput and latency, each process label's cores (Ray's daemons one by one, e.g.
`ray-system:DashboardAgent`) over 10 s of the load and of the idle spell, and TCP connections
opened per request.

    PYTHONPATH=$PWD python benchmarks/results/compare/local/runs/xeon-agent-2026-11-27/role_cpu_probe.py ours [CONFIG]
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import scenarios
from benchmarks.cluster import HTTP_PORT, RayCluster, cpu_by_role, cpu_snapshot, process_label, run_loadgen

MODEL = "bert-heavy"


def tcp_active_opens() -> int:
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("ActiveOpens")])


def over(seconds: float) -> dict[str, float]:
    """Cores per process label (Ray's daemons one by one) over the next `seconds`."""
    before, t0 = cpu_snapshot(process_label), time.perf_counter()
    time.sleep(seconds)
    return cpu_by_role(before, cpu_snapshot(process_label), time.perf_counter() - t0)


def main(which: str, config: str) -> dict[str, Any]:
    s = scenarios.Settings(models=[MODEL], model_dir=Path("models").resolve(), config=Path(config))
    tmp = Path(tempfile.mkdtemp())
    url = f"http://127.0.0.1:{HTTP_PORT}"
    found: dict[str, Any] = {}
    with RayCluster(scenarios.DEFAULT_INGRESS, tmp, s.model_dir) as cluster:
        app = scenarios.ours_config(s) if which == "ours" else scenarios.plain_config(s, MODEL)
        cluster.deploy(app, scenarios.probe(s, MODEL))
        workload = scenarios.workload(s, MODEL, tmp)
        time.sleep(5)
        found["idle"] = over(10)
        run_loadgen(url, workload, {"concurrency": 32}, 4, 0.0)
        opened = tcp_active_opens()

        def sample() -> None:
            time.sleep(3)
            found["load"] = over(10)

        sampler = threading.Thread(target=sample)
        sampler.start()
        load = run_loadgen(url, workload, {"concurrency": 32}, 16, 0.0)
        sampler.join()
        found["tcp_opens_per_req"] = round((tcp_active_opens() - opened) / (load["goodput_rps"] * 16), 3)
    return {"setup": which, "config": config, **{k: load[k] for k in ("goodput_rps", "p50_ms", "p99_ms")}, **found}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "configs/local.yaml"), indent=1))
