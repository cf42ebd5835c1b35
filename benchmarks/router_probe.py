"""Ours alone under a closed loop per model, with each router replica's own view after each run.

    python -m benchmarks.router_probe CONFIG ROUTER_REPLICAS OUT.json [CONCURRENCIES]

Answers what `compare` cannot: where a served setup sheds (the router's shed counts by reason)
and what its dispatcher believes a batch costs (`batch_ms`), at a router replica count given
on the command line. Used on the GPU machine (benchmarks/results/gpu/).

CONCURRENCIES (default `32,128`) are the closed loop's client counts, comma-separated. With one
router replica, each point also says how many requests the router put in each batch it sent the
model (one deployment-handle call per batch) and what each role's CPU came to per request:
between concurrency 1 (a call per request) and a loaded point, this shows what a handle call
costs the router and the model replica beside the request's own work.
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
    ns = probe_args.parse(
        argv, __doc__, "python -m benchmarks.router_probe", "CONFIG", "ROUTER_REPLICAS", "OUT", optional=("CONCURRENCIES",)
    )
    cfg, routers, out = Path(ns.CONFIG), int(ns.ROUTER_REPLICAS), Path(ns.OUT)
    concurrencies = [int(c) for c in (ns.CONCURRENCIES or "32,128").split(",")]
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
        c.deploy(scenarios.pin_replicas(scenarios.ours_config(s), MODELS), scenarios.probe(s, MODELS[0]))
        for m in MODELS:
            for conc in concurrencies:
                before = _router_model_view(url, m) if routers == 1 else None
                r = cluster.run_loadgen(url, scenarios.workload(s, m, tmp), {"concurrency": conc}, 6, 2, (m, "router"))
                # Requests spread over the router replicas: ask twice as often as there are replicas.
                status = [httpx.get(url + "/router/status", timeout=10).json() for _ in range(2 * routers)]
                views = [x["models"].get(m, {}) for x in status]
                point = {"load": r, "router_status": status, "core_ms_per_request": per_request(r)}
                if before is not None:
                    point["batches"] = batches_between(before, views[-1])
                res[f"{m}@c{conc}"] = point
                print(f"{m}@c{conc}", "goodput", r["goodput_rps"], "p50", r["p50_ms"], r["statuses"],
                      "shed", [v.get("shed") for v in views], "batches", point.get("batches"),
                      "core-ms", point["core_ms_per_request"], flush=True)  # fmt: skip
    out.write_text(json.dumps(res, indent=1))
    return 0


def _router_model_view(url: str, model: str) -> dict[str, Any]:
    view: dict[str, Any] = httpx.get(url + "/router/status", timeout=10).json()["models"].get(model, {})
    return view


def batches_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Batches the router sent the model between two views of one router replica (warmup included)."""
    batches = after.get("batches", 0) - before.get("batches", 0)
    items = after.get("completed_items", 0) - before.get("completed_items", 0)
    return {"batches": batches, "items": items, "items_per_batch": round(items / batches, 2) if batches else 0.0}


def per_request(load: dict[str, Any]) -> dict[str, float]:
    """Each role's CPU per answered request, in core-ms (the load generator's own share included)."""
    rps = load.get("goodput_rps") or 0
    if not rps:
        return {}
    return {role: round(cores / rps * 1e3, 3) for role, cores in sorted(load["cpu_cores_by_role"].items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
