"""Ours alone under a closed loop per model, with each router replica's own view after each run.

    python -m benchmarks.router_probe CONFIG ROUTER_REPLICAS OUT.json

Answers what `compare` cannot: where a served setup sheds (the router's shed counts by reason)
and what its dispatcher believes a batch costs (`batch_ms`), at a router replica count given
on the command line. Used on the GPU machine (benchmarks/results/gpu/).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks import cluster, probe_args, scenarios

MODELS = ["bert-heavy", "resnet-heavy"]


def main(argv: list[str]) -> int:
    ns = probe_args.parse(argv, __doc__, "python -m benchmarks.router_probe", "CONFIG", "ROUTER_REPLICAS", "OUT")
    cfg, routers, out = Path(ns.CONFIG), int(ns.ROUTER_REPLICAS), Path(ns.OUT)
    conf = yaml.safe_load(cfg.read_text())
    for d in conf["applications"][0]["deployments"]:
        if d["name"] == "router":
            d["num_replicas"] = routers
    tmp = Path(tempfile.mkdtemp())
    config = tmp / f"router{routers}.yaml"
    config.write_text(yaml.safe_dump(conf, sort_keys=False))
    model_dir = Path(conf["applications"][0]["args"]["model_dir"]).resolve()
    s = scenarios.Settings(models=MODELS, model_dir=model_dir, config=config)
    url = f"http://127.0.0.1:{cluster.HTTP_PORT}"
    res: dict[str, Any] = {}
    with cluster.RayCluster(scenarios.DEFAULT_INGRESS, tmp, s.model_dir) as c:
        c.deploy(scenarios.pin_replicas(scenarios.ours_config(s), MODELS), scenarios._probe(s, MODELS[0]))
        for m in MODELS:
            for conc in (32, 128):
                r = cluster.run_loadgen(url, scenarios._workload(s, m, tmp), {"concurrency": conc}, 6, 2, (m, "router"))
                # Requests spread over the router replicas: ask twice as often as there are replicas.
                status = [httpx.get(url + "/router/status", timeout=10).json() for _ in range(2 * routers)]
                res[f"{m}@c{conc}"] = {"load": r, "router_status": status}
                views = [x["models"].get(m, {}) for x in status]
                print(f"{m}@c{conc}", "goodput", r["goodput_rps"], "p50", r["p50_ms"], r["statuses"],
                      "shed", [v.get("shed") for v in views], flush=True)  # fmt: skip
    out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
