"""`python -m benchmarks multiplex`: many text models sharing one pool of replicas (issue 57).

The pool's models are copies of the config's `source` text model (`bert-light` by default), each
under a name of its own (`review-00`, `review-01`, ...), served by one `review-*` pool entry
(serve_app.models.pool) on `replicas` replicas holding at most `max_models` each. Three phases,
each on a fresh deployment, closed-loop clients throughout:

- zipf: requests over all the models, the k-th most popular drawn with weight k^-s (Zipf). What
  each replica reports (ModelPool.stats): the share of batches that found their model loaded
  (hit ratio), every load's seconds (cold loads), what it holds, its resident memory.
- hot: every request for one model, the pool's placement on (`busy_batches`, default 2) and off
  (a threshold no replica reaches: every batch waits at the first holder, as Ray Serve's own
  multiplexing does, ray-project/ray#48741). With it on, the model loads on a second replica
  and its throughput follows.
- separate: `separate` of the models (as many as fit beside the rest as deployments of their
  own), Zipf again, as one deployment each against the pool serving just those.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks import workloads
from benchmarks.cluster import HTTP_PORT, RAY_PORT, Probe, RayCluster, run_loadgen
from benchmarks.scenarios import DEFAULT_INGRESS, single_versions

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
PATTERN = "review-*"
POOL = "review-pool"
NEVER = 64  # the largest busy_batches, past the 16 calls a pool replica takes at once: never a second copy


@dataclass
class MultiplexSettings:
    models: int = 24
    replicas: int = 2
    max_models: int = 4
    zipf_s: float = 1.1
    concurrency: int = 16
    seconds: float = 20.0
    warmup: float = 3.0
    separate: int = 6
    source: str = "bert-light"

    @classmethod
    def smoke(cls) -> MultiplexSettings:
        return cls(models=6, max_models=2, concurrency=4, seconds=3.0, warmup=1.0, separate=2)


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of the k-th model (k = 1..n), normalised to sum to 1."""
    raw = [k**-s for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def model_names(n: int) -> list[str]:
    return [f"review-{i:02d}" for i in range(n)]


def copy_models(source: Path, out: Path, names: list[str]) -> Path:
    """`names` as copies of the model in `source`, each manifest naming its own model."""
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copytree(source, out / name)
        manifest = json.loads((out / name / "manifest.json").read_text())
        (out / name / "manifest.json").write_text(json.dumps({**manifest, "name": name}))
    return out


def pool_config(base: dict[str, Any], s: MultiplexSettings, pool_dir: Path, busy_batches: int) -> dict[str, Any]:
    """The user's config with its models replaced by one pool of `s.replicas` replicas, each with
    the source model's resources."""
    config, source = _bare(base, s)
    entry = {
        "family": "bert", "path": str(pool_dir), "batching": source["batching"],
        "multiplex": {"max_models_per_replica": s.max_models, "busy_batches": busy_batches},
    }  # fmt: skip
    app = config["applications"][0]
    app["args"]["models"] = {PATTERN: entry}
    app["deployments"].append({**source["deployment"], "name": POOL, "num_replicas": s.replicas})
    return config


def separate_config(base: dict[str, Any], s: MultiplexSettings, models_dir: Path, names: list[str]) -> dict[str, Any]:
    """The same models as deployments of their own, one replica each."""
    config, source = _bare(base, s)
    app = config["applications"][0]
    app["args"]["models"] = {n: {"family": "bert", "path": str(models_dir / n), "batching": source["batching"]} for n in names}
    app["deployments"] += [{**source["deployment"], "name": n, "num_replicas": 1} for n in names]
    return config


def _bare(base: dict[str, Any], s: MultiplexSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config with no models, routes or policies, keeping the router; and the source model's
    batching and deployment options (no autoscaling)."""
    config = single_versions(copy.deepcopy(base))
    app = config["applications"][0]
    args = app["args"]
    batching = args["models"][s.source].get("batching", {})
    deployment = next((d for d in app.get("deployments", []) if d["name"] == s.source), {"name": s.source})
    options = {k: v for k, v in deployment.items() if k not in ("name", "autoscaling_config", "num_replicas")}
    for key in ("routes", "traffic", "cache", "tenants"):
        args.pop(key, None)
    args["models"] = {}
    app["deployments"] = [d for d in app.get("deployments", []) if d["name"] == "router"]
    return config, {"batching": batching, "deployment": options}


def streams(models_dir: Path, names: list[str], weights: list[float]) -> list[workloads.StreamSpec]:
    return [workloads.v2_infer(n, models_dir / n, weight=w, n=16) for n, w in zip(names, weights, strict=True)]


def pool_stats(replicas: int) -> list[dict[str, Any]]:
    """Each pool replica's `ModelPool.stats`, asked through Serve's handle until every replica answered."""
    import ray
    from ray import serve

    os.environ["RAY_AUTH_MODE"] = "token"
    ray.init(address=f"127.0.0.1:{RAY_PORT}", log_to_driver=False, logging_level=logging.ERROR)
    try:
        handle = serve.get_deployment_handle(POOL, "default")
        seen: dict[str, dict[str, Any]] = {}
        for _ in range(20 * replicas):
            answer = handle.stats.remote().result(timeout_s=30)
            seen[answer["replica"]] = answer
            if len(seen) == replicas:
                break
        handle.shutdown()
        return list(seen.values())
    finally:
        ray.shutdown()


def summarize_pool(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Hit ratio (batches that found their model loaded), cold loads, memory against models held."""
    batches = sum(sum(r["batches"].values()) for r in stats)
    cold = sum(sum(r["cold_batches"].values()) for r in stats)
    loads = sorted(x for r in stats for x in r["loads_s"])
    return {
        "batches": batches,
        "hit_ratio": round(1 - cold / batches, 4) if batches else None,
        "loads": len(loads),
        "load_p50_s": round(statistics.median(loads), 3) if loads else None,
        "load_p99_s": round(loads[min(len(loads) - 1, int(0.99 * len(loads)))], 3) if loads else None,
        "per_replica": [{"held": r["held"], "rss_mb": r["rss_mb"], "loads": len(r["loads_s"])} for r in stats],
    }


def _load(workload: Path, s: MultiplexSettings) -> dict[str, Any]:
    out = run_loadgen(BASE_URL, workload, {"concurrency": s.concurrency}, s.seconds, s.warmup)
    keep = ("requests", "statuses", "goodput_rps", "p50_ms", "p99_ms", "cpu_cores_by_role")
    return {k: out[k] for k in keep if k in out}


def run(s: MultiplexSettings, model_dir: Path, config_path: Path) -> dict[str, Any]:
    base = yaml.safe_load(config_path.read_text())
    names = model_names(s.models)
    weights = zipf_weights(s.models, s.zipf_s)
    out: dict[str, Any] = {"settings": asdict(s), "weights": [round(w, 4) for w in weights]}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        models_dir = copy_models(model_dir / s.source, tmp / "pool", names)
        few = names[: s.separate]
        few_dir = copy_models(model_dir / s.source, tmp / "few", few)
        probe = Probe(f"/v2/models/{names[0]}/infer", workloads.bodies_for(models_dir / names[0], 1)[0])
        # Logical CPUs for every replica of the widest phase (a replica each, for the separate
        # models); the machine's cores are what they share either way.
        with RayCluster(DEFAULT_INGRESS, tmp, model_dir, ("--num-cpus=8",)) as cluster:
            zipf = workloads.write(streams(models_dir, names, weights), tmp / "zipf.json")
            cluster.deploy(pool_config(base, s, models_dir, busy_batches=2), probe)
            out["zipf"] = {"load": _load(zipf, s), "pool": summarize_pool(pool_stats(s.replicas))}
            hot = workloads.write(streams(models_dir, names[:1], [1.0]), tmp / "hot.json")
            for label, busy in (("placement", 2), ("no_second_copy", NEVER)):
                cluster.deploy(pool_config(base, s, models_dir, busy_batches=busy), probe)
                out[f"hot_{label}"] = {"load": _load(hot, s), "pool": summarize_pool(pool_stats(s.replicas))}
            few_zipf = workloads.write(streams(few_dir, few, zipf_weights(len(few), s.zipf_s)), tmp / "few.json")
            cluster.deploy(separate_config(base, s, few_dir, few), probe)
            out["separate_deployments"] = {"load": _load(few_zipf, s)}
            cluster.deploy(pool_config(base, s, few_dir, busy_batches=2), probe)
            out["separate_pool"] = {"load": _load(few_zipf, s), "pool": summarize_pool(pool_stats(s.replicas))}
    return out


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    s = r["settings"]
    lines = [
        f"{s['models']} copies of `{s['source']}` as `{PATTERN}` on {s['replicas']} pool replicas holding at most "
        f"{s['max_models']} each; {s['concurrency']} closed-loop clients, {s['seconds']:.0f} s per phase; Zipf s = "
        f"{s['zipf_s']} (the most popular model gets {r['weights'][0]:.0%} of requests, the least "
        f"{r['weights'][-1]:.1%}).",
        "",
        "| phase | req/s answered | p50 ms | p99 ms | statuses | hit ratio | loads | load p50 / p99 s "
        "| held, RSS MiB per replica |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in ("zipf", "hot_placement", "hot_no_second_copy", "separate_deployments", "separate_pool"):
        p = r.get(phase)
        if p is None:
            continue
        load, pool = p["load"], p.get("pool")
        if pool is None:
            tail = "- | - | - | -"
        else:
            held = "; ".join(f"{len(x['held'])} models, {x['rss_mb']}" for x in pool["per_replica"])
            tail = f"{pool['hit_ratio']} | {pool['loads']} | {pool['load_p50_s']} / {pool['load_p99_s']} | {held}"
        measured = f"{load.get('goodput_rps')} | {load.get('p50_ms')} | {load.get('p99_ms')} | {load.get('statuses')}"
        lines.append(f"| {phase} | {measured} | {tail} |")
    return "\n".join(lines)
