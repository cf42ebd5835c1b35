"""`python -m benchmarks multiplex`: many text models sharing one pool of replicas (issue 57).

The pool's models are copies of the config's `source` text model (`bert-heavy` by default; with
`--config configs/bench-cascade.yaml` that is BERT-Medium's shape, where the model and not the
router is the bottleneck, so a second copy of a hot model has cores to use), each
under a name of its own (`review-00`, `review-01`, ...), served by one `review-*` pool entry
(serve_app.models.pool) on `replicas` replicas holding at most `max_models` each. Phases (a
subset with `phases`), each on a fresh deployment:

- zipf: 64 closed-loop clients over all the models, the k-th most popular drawn with weight k^-s
  (Zipf), with second copies on (`zipf`) and off (`zipf_no_second_copy`); and the same mix in
  open loop at `open_rate` requests/s (`zipf_open`). What each replica reports (ModelPool.stats):
  the share of batches that found their model loaded (hit ratio), every load's seconds (cold
  loads), what it holds, its resident memory.
- hot: every request for one model, with second copies on (a busy holder's model loads on the
  other replica) and off (`multiplex.second_copies: false`: every batch waits at the first holder,
  as Ray Serve's own multiplexing does, ray-project/ray#48741). With them on, the model loads on
  a second replica and its throughput follows.
- separate: `separate` of the models (as many as fit beside the rest as deployments of their
  own), Zipf again, as one deployment each against the pool serving just those.
- sizes: one model of each size (every text model under the model directory, and the
  directories in `size_sources`) in a pool of one replica that holds one model, asked in turn for
  `size_rounds` rounds: every request loads its model. Per size: the ONNX file's size, the
  replica's load time (sessions made and warmed up) and the client's first-request latency.
"""

from __future__ import annotations

import copy
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks import workloads
from benchmarks.cluster import HTTP_PORT, SERVE_CONNECT, Probe, RayCluster, last_json, run_loadgen
from benchmarks.scenarios import DEFAULT_INGRESS, single_versions

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
PATTERN = "review-*"
POOL = "review-pool"


@dataclass
class MultiplexSettings:
    models: int = 24
    replicas: int = 2
    max_models: int = 4
    zipf_s: float = 1.1
    concurrency: int = 64  # past three full batches of one model: enough for a busy holder
    seconds: float = 20.0
    warmup: float = 3.0
    separate: int = 6
    source: str = "bert-heavy"
    # Open loop (Poisson arrivals that keep coming whatever the answers, each with a 10 s timeout):
    # the same Zipf mix at a rate the pool answers when every model is loaded, as users send it.
    open_rate: float = 40.0
    phases: tuple[str, ...] = ("zipf", "zipf_no_second_copy", "zipf_open", "hot", "separate", "sizes")
    size_sources: tuple[str, ...] = ()  # further text model directories for the sizes phase
    size_rounds: int = 5

    @classmethod
    def smoke(cls) -> MultiplexSettings:
        return cls(models=6, max_models=2, concurrency=4, seconds=3.0, warmup=1.0, separate=2, size_rounds=2)


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


def pool_config(base: dict[str, Any], s: MultiplexSettings, pool_dir: Path, second_copies: bool = True) -> dict[str, Any]:
    """The user's config with its models replaced by one pool of `s.replicas` replicas, each with
    the source model's resources."""
    config, source = _bare(base, s)
    entry = {
        "family": "bert", "path": str(pool_dir), "batching": source["batching"],
        "multiplex": {"max_models_per_replica": s.max_models, "second_copies": second_copies},
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


# Each pool replica's `ModelPool.stats`, asked through Serve's handle (calls without a model go to
# any replica) until every replica answered; printed as JSON by a driver process of its own.
STATS_SCRIPT = (
    SERVE_CONNECT
    + """
import asyncio, json, sys

async def main():  # the cluster's handles run on the caller's event loop (RAY_SERVE_THROUGHPUT_OPTIMIZED)
    want, seen = int(sys.argv[2]), {}
    for _ in range(600):  # every replica running first: a deploy is ready once one answers
        states = serve.status().applications["default"].deployments[sys.argv[1]].replica_states
        if states.get("RUNNING", 0) >= want:
            break
        await asyncio.sleep(0.2)
    handle = serve.get_deployment_handle(sys.argv[1], "default")
    for _ in range(100 * want):
        answer = await handle.stats.remote()
        seen[answer["replica"]] = answer
        if len(seen) == want:
            break
        await asyncio.sleep(0.02)  # the handle's view of the replicas' queues moves on
    return list(seen.values())

print(json.dumps(asyncio.run(main())))
"""
)


def pool_stats(cluster: RayCluster, replicas: int) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-c", STATS_SCRIPT, POOL, str(replicas)], env=cluster.env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"pool stats: {done.stderr[-3000:]}")
    stats: list[dict[str, Any]] = last_json(done.stdout)
    return stats


def summarize_pool(after: list[dict[str, Any]], before: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Over a phase (each replica's stats after it, less before it where the replica was there):
    hit ratio (batches that found their model loaded), cold loads, memory against models held."""
    earlier = {r["replica"]: r for r in before or []}

    def less(now: dict[str, int], then: dict[str, int]) -> int:
        return sum(now.values()) - sum(then.values())

    batches = cold = 0
    loads: list[float] = []
    for r in after:
        b = earlier.get(r["replica"], {"batches": {}, "cold_batches": {}, "loads_s": []})
        batches += less(r["batches"], b["batches"])
        cold += less(r["cold_batches"], b["cold_batches"])
        loads += r["loads_s"][len(b["loads_s"]) :]
    loads.sort()
    return {
        "batches": batches,
        "hit_ratio": round(1 - cold / batches, 4) if batches else None,
        "loads": len(loads),
        "load_p50_s": round(statistics.median(loads), 3) if loads else None,
        "load_p99_s": round(loads[min(len(loads) - 1, int(0.99 * len(loads)))], 3) if loads else None,
        "per_replica": [{"held": r["held"], "rss_mb": r["rss_mb"], "loads": len(r["loads_s"])} for r in after],
    }


def _pool_phase(cluster: RayCluster, workload: Path, s: MultiplexSettings, rate: float | None = None) -> dict[str, Any]:
    before = pool_stats(cluster, s.replicas)
    load = _load(workload, s, rate)
    return {"load": load, "pool": summarize_pool(pool_stats(cluster, s.replicas), before)}


def settle(models_dir: Path, names: list[str], timeout_s: float = 90.0) -> None:
    """One answered request per model before a phase is measured: after a redeploy the first call
    to a model can wait out the router's batch timeout (its handle slow to learn the new
    replicas), which would otherwise sit inside the measured window."""
    for name in names:
        body = workloads.bodies_for(models_dir / name, 1)[0]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.post(f"{BASE_URL}/v2/models/{name}/infer", json=body, timeout=timeout_s).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)


def _load(workload: Path, s: MultiplexSettings, rate: float | None = None) -> dict[str, Any]:
    """Closed loop at `s.concurrency`, or open loop at `rate` requests/s."""
    load = {"concurrency": s.concurrency} if rate is None else {"rate": rate}
    out = run_loadgen(BASE_URL, workload, load, s.seconds, s.warmup, timeout_s=None if rate is None else 10.0)
    keep = ("requests", "statuses", "goodput_rps", "p50_ms", "p99_ms", "timeouts", "cpu_cores_by_role")
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
            arms = (("zipf", True, None), ("zipf_no_second_copy", False, None), ("zipf_open", True, s.open_rate))
            for label, second_copies, rate in arms:
                if label in s.phases:
                    cluster.deploy(pool_config(base, s, models_dir, second_copies), probe)
                    settle(models_dir, names)
                    out[label] = _pool_phase(cluster, zipf, s, rate)
            for label, second_copies in (("placement", True), ("no_second_copy", False)):
                if "hot" not in s.phases:
                    break
                # A pool of its own (its models' directory differs): fresh replicas, the hot model
                # loaded on one of them by the readiness probe, nowhere else.
                hot_dir = copy_models(model_dir / s.source, tmp / f"hot-{label}", names[:1])
                hot = workloads.write(streams(hot_dir, names[:1], [1.0]), tmp / f"hot-{label}.json")
                cluster.deploy(pool_config(base, s, hot_dir, second_copies), probe)
                out[f"hot_{label}"] = _pool_phase(cluster, hot, s)
            if "sizes" in s.phases:
                out["sizes"] = _sizes_phase(cluster, base, s, size_sources(model_dir, s), tmp)
            if "separate" not in s.phases:
                return out
            few_zipf = workloads.write(streams(few_dir, few, zipf_weights(len(few), s.zipf_s)), tmp / "few.json")
            cluster.deploy(separate_config(base, s, few_dir, few), probe)
            settle(few_dir, few)
            out["separate_deployments"] = {"load": _load(few_zipf, s)}
            cluster.deploy(pool_config(base, s, few_dir), probe)
            settle(few_dir, few)
            out["separate_pool"] = _pool_phase(cluster, few_zipf, s)
    return out


def size_sources(model_dir: Path, s: MultiplexSettings) -> list[Path]:
    """The text classifiers the sizes phase loads, smallest first: those under the model
    directory and `s.size_sources`, one per size (ONNX bytes)."""
    found = [d for d in sorted(model_dir.iterdir()) if _family(d) == "bert"] + [Path(p).resolve() for p in s.size_sources]
    by_size = {onnx_bytes(d): d for d in found}
    return [by_size[size] for size in sorted(by_size)]


def _family(model: Path) -> str | None:
    try:
        family: str | None = json.loads((model / "manifest.json").read_text()).get("family")
    except (OSError, ValueError):
        return None
    return family


def onnx_bytes(model: Path) -> int:
    """The size of the graph a replica loads (its FP32 ONNX file)."""
    manifest = json.loads((model / "manifest.json").read_text())
    return (model / manifest.get("onnx_file", "model.onnx")).stat().st_size


def _sizes_phase(
    cluster: RayCluster, base: dict[str, Any], s: MultiplexSettings, sources: list[Path], tmp: Path
) -> dict[str, Any]:
    """Each size loaded `s.size_rounds` times on a replica that holds one model: every request a load."""
    names = [f"review-size-{i}" for i in range(len(sources))]
    sizes_dir = tmp / "sizes"
    for name, source in zip(names, sources, strict=True):
        copy_models(source, sizes_dir, [name])
    one = MultiplexSettings(**{**asdict(s), "replicas": 1, "max_models": 1})
    bodies = {n: workloads.bodies_for(sizes_dir / n, 1)[0] for n in names}
    cluster.deploy(pool_config(base, one, sizes_dir), Probe(f"/v2/models/{names[0]}/infer", bodies[names[0]]))
    before = pool_stats(cluster, 1)[0]
    first_ms: dict[str, list[float]] = {n: [] for n in names}
    statuses: dict[str, list[int]] = {n: [] for n in names}
    for _ in range(s.size_rounds):
        for name in names:  # each evicts the one before it
            started = time.perf_counter()
            r = httpx.post(f"{BASE_URL}/v2/models/{name}/infer", json=bodies[name], timeout=300)
            first_ms[name].append(round((time.perf_counter() - started) * 1e3, 1))
            statuses[name].append(r.status_code)
    after = pool_stats(cluster, 1)[0]
    done = len(before["loads_s"])
    loads = list(zip(after["load_models"][done:], after["loads_s"][done:], strict=True))
    rows = []
    for name, source in zip(names, sources, strict=True):
        seconds = sorted(t for m, t in loads if m == name)
        rows.append({
            "source": str(source), "onnx_mb": round(onnx_bytes(source) / 2**20, 1), "loads": len(seconds),
            "load_p50_s": round(statistics.median(seconds), 3) if seconds else None,
            "load_max_s": max(seconds) if seconds else None,
            "first_request_p50_ms": statistics.median(first_ms[name]), "statuses": sorted(set(statuses[name])),
        })  # fmt: skip
    return {"rows": rows, "rss_mb": after["rss_mb"]}


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
    for phase in (
        "zipf",
        "zipf_no_second_copy",
        "zipf_open",
        "hot_placement",
        "hot_no_second_copy",
        "separate_deployments",
        "separate_pool",
    ):
        p = r.get(phase)
        if p is None:
            continue
        load, pool = p["load"], p.get("pool")
        if pool is None:
            tail = "- | - | - | -"
        else:
            held = "; ".join(_held(x["held"]) + f", {x['rss_mb']}" for x in pool["per_replica"])
            tail = f"{pool['hit_ratio']} | {pool['loads']} | {pool['load_p50_s']} / {pool['load_p99_s']} | {held}"
        measured = f"{load.get('goodput_rps')} | {load.get('p50_ms')} | {load.get('p99_ms')} | {load.get('statuses')}"
        lines.append(f"| {phase} | {measured} | {tail} |")
    if (sizes := r.get("sizes")) is not None:
        lines += [
            "",
            "Load time by model size (one replica holding one model, the sizes asked in turn: every request a load):",
            "",
            "| model | ONNX MB | loads | load p50 s | load max s | first request p50 ms | statuses |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in sizes["rows"]:
            lines.append(
                f"| {row['source']} | {row['onnx_mb']} | {row['loads']} | {row['load_p50_s']} | {row['load_max_s']} "
                f"| {row['first_request_p50_ms']} | {row['statuses']} |"
            )
    return "\n".join(lines)


def _held(models: list[str]) -> str:
    """A replica's models: by name when few (the hot phases show where the hot model is)."""
    return ", ".join(models) if len(models) <= 2 else f"{len(models)} models"
