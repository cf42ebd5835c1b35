"""What a request refused at the router's header gate costs the router, with a py-spy profile.

    python -m benchmarks.refusal_cost CONFIG MODEL OUT.json

Ours with `max_queue_delay_s` lowered to 0.2 s, so that a low-priority open loop at
`RATE` req/s (well above capacity) is mostly refused at the router's header gate
(serve_app/router/shedgate.py). First a closed loop at concurrency 32, where refusals
come back to back, then the open loop (Poisson arrivals, one at a time) with py-spy on
the router: the router's CPU per request in each, and the status mix. Why: under the
priority scenario's 2x flood, the router's CPU per request decides how much of a
2-core node the flood takes from the models, and so the goodput
(benchmarks/results/priority/).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks import cluster, probe_args, scenarios, workloads

RATE = 250.0
SECONDS = 12.0


def _router_ms_per_request(point: dict[str, Any]) -> float:
    cores = float(point["cpu_cores_by_role"].get("replica:router", 0.0))
    return round(cores * 1e3 / max(point["throughput_rps"], 1e-9), 3)


def main(argv: list[str]) -> int:
    ns = probe_args.parse(argv, __doc__, "python -m benchmarks.refusal_cost", "CONFIG", "MODEL", "OUT")
    config, model, out = Path(ns.CONFIG), ns.MODEL, Path(ns.OUT)
    model_dir = Path(yaml.safe_load(config.read_text())["applications"][0]["args"]["model_dir"]).resolve()
    s = scenarios.Settings(models=[model], model_dir=model_dir, config=config)
    tmp = Path(tempfile.mkdtemp())
    url = f"http://127.0.0.1:{cluster.HTTP_PORT}"
    low = workloads.write([workloads.v2_infer(model, s.model_dir / model, "low")], tmp / "low.json")
    result: dict[str, Any] = {"config": str(config), "model": model, "rate_rps": RATE}
    with cluster.RayCluster(scenarios.DEFAULT_INGRESS, tmp, s.model_dir) as c:
        deployed = scenarios.pin_replicas(scenarios.ours_config(s, scheduling={"max_queue_delay_s": 0.2}), [model])
        c.deploy(deployed, scenarios.probe(s, model))
        closed = cluster.run_loadgen(url, low, {"concurrency": 32}, 8.0, 2.0, (model, "router"))
        router_pid = scenarios.pids("replica:router")[0]
        profile = out.with_suffix(".pyspy.txt")
        py_spy = shutil.which("py-spy")
        spy = None
        if py_spy:
            spy = subprocess.Popen(
                [py_spy, "record", "--pid", str(router_pid), "--duration", str(int(SECONDS)), "--rate", "100",
                 "--format", "raw", "--output", str(profile), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        flood = cluster.run_loadgen(url, low, {"rate": RATE}, SECONDS, 1.0, (model, "router"))
        if spy is not None:
            spy.wait(timeout=60)
    result |= {
        "closed_c32": closed,
        "flood": flood,
        "router_ms_cpu_per_request": {"closed_c32": _router_ms_per_request(closed), "flood": _router_ms_per_request(flood)},
    }
    if profile.exists() and profile.stat().st_size:
        result["profile"] = profile.name
        result["top_self"] = scenarios.top_frames(profile, 25)
        result["top_inclusive"] = scenarios.inclusive_frames(profile, 40)
    out.write_text(json.dumps(result, indent=1))
    print(f"router CPU per request (ms): {result['router_ms_cpu_per_request']}; statuses: closed "
          f"{closed['statuses']}, flood {flood['statuses']} -> {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
