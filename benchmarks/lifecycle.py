"""Model lifecycle on the shipped config: the traffic split, versioned paths and sticky keys; the
response cache under a Zipf workload with and without it, shared by two routers through a real
Redis server that is stopped mid-run; and shadowing a route's heavy tier, its cost to the client's
p99, and its candidate's replicas killed under load.

Cache on and off run on the same deployment, side by side: "off" sends `Cache-Control: no-cache`,
which the router honours by skipping the cache, so nothing else differs. Shadow on and off
alternate on the same replicas: the policy changes through the router's user_config only.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from benchmarks import workloads
from benchmarks.cluster import HTTP_PORT, RAY_PORT, Probe, RayCluster, last_json, run_loadgen
from benchmarks.redis_server import RedisServer
from benchmarks.scenarios import DEFAULT_INGRESS, pin_replicas
from serve_app.zoo.data import sentiment_dataset, shapes_dataset

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
SPLIT_MODEL = "bert-heavy"  # the model the shipped config splits between two versions
CACHED_MODELS = ("bert-heavy", "resnet-heavy")
ROUTE = "text-classify"  # whose heavy tier (bert-heavy) is shadowed to version 2
SETTLE_S = 5.0  # after a redeploy that restarts the app: HAProxy's reload and the new replicas' first calls
RECONFIGURE_S = 3.0  # `serve run` returns before Serve has reconfigured the routers: time for that


@dataclass
class LifecycleSettings:
    split_requests: int = 1000
    sticky_requests: int = 100
    distinct: int = 10_000  # distinct inputs per cached model
    zipf_s: float = 1.1
    cache_concurrency: int = 16
    seconds: float = 30.0
    warmup: float = 3.0
    shadow_rounds: int = 8  # off/on pairs, the order alternating
    shadow_load: float = 0.5  # the open-loop rate, as a share of the route's closed-loop capacity
    outage_seconds: float = 30.0

    @classmethod
    def smoke(cls) -> LifecycleSettings:
        return cls(200, 20, 300, 1.1, 4, 3.0, 0.5, 1, 0.5, 6.0)


def zipf_order(n_items: int, n_draws: int, s: float, seed: int) -> list[int]:
    """`n_draws` indices over `n_items` with P(rank k) proportional to 1/k^s; ranks shuffled over items."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_items + 1) ** s
    ranks = rng.choice(n_items, size=n_draws, p=p / p.sum())
    return [int(i) for i in rng.permutation(n_items)[ranks]]


def distinct_bodies(model: str, n: int) -> tuple[list[dict[str, Any]], bool]:
    """n distinct request bodies for a demo model, and whether they go as binary tensors."""
    if model.startswith("resnet"):
        images, _ = shapes_dataset(n, seed=7, size=32)
        pixels = np.round(images * 255).astype(np.uint8)
        pixels[:, 0, 0, 0] = np.arange(n) % 256  # distinct even where two shapes came out alike
        pixels[:, 0, 0, 1] = np.arange(n) // 256 % 256
        bodies = [
            {"inputs": [{"name": "image", "shape": [1, 3, 32, 32], "datatype": "UINT8", "data": p[None].ravel().tolist()}]}
            for p in pixels
        ]
        return bodies, True
    return [_text(t) for t in distinct_texts(n, seed=7)], False


def distinct_texts(n: int, seed: int) -> list[str]:
    """n different sentences from the models' own task (held-out seeds), none repeated: inputs the
    models answer as they would in use, not out-of-distribution variants of a few."""
    texts, _ = sentiment_dataset(4 * n, seed)
    unique = list(dict.fromkeys(texts))
    if len(unique) < n:
        raise ValueError(f"only {len(unique)} distinct texts for {n}")
    return unique[:n]


def cache_workload(path: Path, model: str, bodies: list[dict[str, Any]], binary: bool, order: list[int], cached: bool) -> Path:
    headers = {} if cached else {"Cache-Control": "no-cache"}
    spec = workloads.StreamSpec(model, f"/v2/models/{model}/infer", bodies, 1.0, headers, binary, order)
    return workloads.write([spec], path)


def hits(load: dict[str, Any]) -> dict[str, Any]:
    """Answers by cache outcome (X-Cache joins X-Served-By after '|' in the load generator)."""
    by: Counter[str] = Counter()
    for served, n in load.get("served_by", {}).items():
        by[served.split("|", 1)[1] if "|" in served else "none"] += n
    total = sum(by.values())
    hit = by["hit-local"] + by["hit-shared"]
    return {"answers": dict(by), "hit_ratio": round(hit / total, 4) if total else None}


REPLICA_STATES = """
import json, sys, ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(json.dumps(serve.status().applications["default"].deployments[sys.argv[2]].replica_states))
"""


def wait_for_replicas(cluster: RayCluster, deployment: str, n: int, timeout_s: float = 180.0) -> dict[str, int]:
    """Until the deployment has exactly `n` replicas, all RUNNING: a redeploy that restarts the app
    replaces routers one by one, and an old one drains for up to its graceful shutdown timeout
    while HAProxy may still send it requests. A run measured during that measures the rollout."""
    deadline = time.monotonic() + timeout_s
    states: dict[str, int] = {}
    while time.monotonic() < deadline:
        done = subprocess.run(
            [sys.executable, "-c", REPLICA_STATES, f"127.0.0.1:{RAY_PORT}", deployment],
            env=cluster.env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if done.returncode == 0:
            states = last_json(done.stdout)
            if states == {"RUNNING": n}:
                return states
        time.sleep(2)
    return states


def status() -> dict[str, Any]:
    return dict(httpx.get(f"{BASE_URL}/router/status", timeout=30).json())


async def _post_all(requests: list[tuple[str, dict[str, Any], dict[str, str]]], concurrency: int = 8) -> list[httpx.Response]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=BASE_URL, timeout=60) as client:

        async def one(path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
            async with limit:
                return await client.post(path, json=body, headers=headers)

        return await asyncio.gather(*(one(*r) for r in requests))


def split_check(s: LifecycleSettings) -> dict[str, Any]:
    """Unversioned requests by the version that answered; versioned paths; sticky keys."""
    path = f"/v2/models/{SPLIT_MODEL}/infer"
    answers = asyncio.run(_post_all([(path, _text(t), {}) for t in distinct_texts(s.split_requests, seed=11)]))
    versions = Counter(r.json().get("model_version") if r.status_code == 200 else f"status {r.status_code}" for r in answers)
    exact = {}
    for v in ("1", "2"):
        got = asyncio.run(
            _post_all([(f"/v2/models/{SPLIT_MODEL}/versions/{v}/infer", _text(f"exact {i}"), {}) for i in range(50)])
        )
        exact[v] = dict(Counter(r.json().get("model_version") for r in got))
    sticky = {}
    for key in ("alice", "bob", "carol", "dave"):
        reqs = [(path, _text(f"{key} asks {i}"), {"X-Session-Key": key}) for i in range(s.sticky_requests)]
        sticky[key] = dict(Counter(r.json().get("model_version") for r in asyncio.run(_post_all(reqs))))
    return {
        "requests": s.split_requests,
        "by_version": dict(versions),
        "share_v2": round(versions["2"] / s.split_requests, 4),
        "versioned_paths": exact,
        "sticky": sticky,
    }


def _text(text: str) -> dict[str, Any]:
    return {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}]}


def _cache_phase(s: LifecycleSettings, tmp: Path, models: tuple[str, ...], seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    draws = max(200_000, s.distinct * 20)
    for m in models:
        bodies, binary = distinct_bodies(m, s.distinct)
        runs: dict[str, Any] = {}
        for i, cached in enumerate((False, True)):
            order = zipf_order(s.distinct, draws, s.zipf_s, seed + i)
            wl = cache_workload(tmp / f"{m}-{cached}.json", m, bodies, binary, order, cached)
            load = run_loadgen(BASE_URL, wl, {"concurrency": s.cache_concurrency}, s.seconds, s.warmup)
            runs["with_cache" if cached else "without_cache"] = {
                **{k: load[k] for k in ("goodput_rps", "p50_ms", "p99_ms", "statuses")},
                **hits(load),
                "cpu_cores_by_role": load.get("cpu_cores_by_role"),
            }
        on, off = runs["with_cache"], runs["without_cache"]
        runs["throughput_ratio"] = round(on["goodput_rps"] / off["goodput_rps"], 2) if off["goodput_rps"] else None
        out[m] = runs
    return out


def _shared_phase(s: LifecycleSettings, tmp: Path, redis: RedisServer) -> dict[str, Any]:
    """Two routers on one Redis: hits one router gets from what the other stored; then Redis
    stops for the middle third of a run and comes back."""
    m = "bert-heavy"
    bodies, binary = distinct_bodies(m, s.distinct)
    order = zipf_order(s.distinct, max(200_000, s.distinct * 20), s.zipf_s, 99)
    wl = cache_workload(tmp / "shared.json", m, bodies, binary, order, True)
    shared = run_loadgen(BASE_URL, wl, {"concurrency": s.cache_concurrency}, s.seconds, s.warmup)
    kept = ("requests", "goodput_rps", "p50_ms", "statuses", "client_dropped")
    out: dict[str, Any] = {"two_routers": {**{k: shared.get(k) for k in kept}, **hits(shared)}}
    order = zipf_order(s.distinct, max(200_000, s.distinct * 20), s.zipf_s, 100)
    wl = cache_workload(tmp / "outage.json", m, bodies, binary, order, True)
    events: dict[str, float] = {}

    def outage() -> None:
        time.sleep(s.warmup + s.outage_seconds / 3)
        redis.stop()
        events["stopped_s"] = round(s.outage_seconds / 3, 1)
        time.sleep(s.outage_seconds / 3)
        redis.start()
        events["restarted_s"] = round(2 * s.outage_seconds / 3, 1)

    t = threading.Thread(target=outage)
    t.start()
    during = run_loadgen(BASE_URL, wl, {"concurrency": s.cache_concurrency}, s.outage_seconds, s.warmup)
    t.join()
    out["redis_outage"] = {
        **events,
        **{k: during[k] for k in ("goodput_rps", "p50_ms", "p99_ms", "statuses")},
        **hits(during),
        "errors": sum(n for code, n in during["statuses"].items() if code != "200"),
    }
    out["router_cache_status"] = status().get("cache")
    return out


KILL = """
import sys, ray
from ray.util import list_named_actors
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
names = [a["name"] for a in list_named_actors(all_namespaces=True)
         if a["name"].startswith("SERVE_REPLICA::") and f"#{sys.argv[2]}#" in a["name"]]
for name in names:
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
print(len(names))
"""


def _shadow_phase(s: LifecycleSettings, cluster: RayCluster, config: dict[str, Any], tmp: Path) -> dict[str, Any]:
    bodies = [_text(t) for t in distinct_texts(4000, seed=13)]
    spec = workloads.StreamSpec(ROUTE, f"/v2/models/{ROUTE}/infer", bodies, 1.0, {"Cache-Control": "no-cache"})
    wl = workloads.write([spec], tmp / "shadow.json")
    # Open loop at a share of the route's capacity: the operating point of a served model, with
    # the headroom a deployment keeps; at saturation any extra work raises every latency.
    _set_traffic(cluster, config, False)
    capacity = run_loadgen(BASE_URL, wl, {"concurrency": 8}, s.seconds / 2, s.warmup)["goodput_rps"]
    rate = round(max(1.0, s.shadow_load * capacity), 1)
    rounds: list[dict[str, Any]] = []
    pooled: dict[bool, list[float]] = {False: [], True: []}
    for i in range(s.shadow_rounds):
        # Every other pair runs the shadow first: a machine that drifts (warms up, or meets a
        # neighbour's load) then weighs on both sides alike.
        order = (False, True) if i % 2 == 0 else (True, False)
        pair: dict[str, Any] = {"first": "on" if order[0] else "off"}
        for shadow in order:
            _set_traffic(cluster, config, shadow)
            load = run_loadgen(BASE_URL, wl, {"rate": rate}, s.seconds, s.warmup, max_in_flight=64, raw=True)
            pooled[shadow] += [rec[2] for rec in load.pop("records") if rec[3] == 200]
            pair["on" if shadow else "off"] = {k: load[k] for k in ("goodput_rps", "p50_ms", "p99_ms", "statuses")}
        pair["p99_ratio"] = round(pair["on"]["p99_ms"] / pair["off"]["p99_ms"], 3) if pair["off"]["p99_ms"] else None
        rounds.append(pair)
    p99 = {k: float(np.percentile(v, 99)) if v else 0.0 for k, v in pooled.items()}
    # The candidate's replicas die in the middle of a shadowed run: what clients see of it.
    kill: dict[str, Any] = {}
    killer = threading.Thread(target=_kill_later, args=(cluster, s.warmup + s.seconds / 2, kill))
    killer.start()
    during = run_loadgen(BASE_URL, wl, {"rate": rate}, s.seconds, s.warmup, max_in_flight=64)
    killer.join()
    versions = status()["versions"]
    return {
        "capacity_rps": capacity,
        "rate_rps": rate,
        "rounds": rounds,
        "pooled_p99_ms": {"off": p99[False], "on": p99[True]},
        "pooled_p99_ratio": round(p99[True] / p99[False], 3) if p99[True] and p99[False] else None,
        "median_pair_p99_ratio": _median([p["p99_ratio"] for p in rounds if p["p99_ratio"] is not None]),
        "pair_p99_ratio_interval": pair_ratio_interval(rounds),
        "kill": {**kill, **{k: during[k] for k in ("goodput_rps", "p50_ms", "p99_ms", "statuses")}},
        "shadows": versions["shadows"],
        "calls": versions["calls"],
    }


def pair_ratio_interval(rounds: list[dict[str, Any]], draws: int = 20_000, seed: int = 0) -> dict[str, float] | None:
    """The geometric mean of the pairs' p99 ratios, with a 90% bootstrap interval over the pairs:
    how far the shadow moves the client's p99 beyond what the machine's drift between runs does."""
    logs = np.log([p["p99_ratio"] for p in rounds if p.get("p99_ratio")])
    if len(logs) < 2:
        return None
    means = np.random.default_rng(seed).choice(logs, (draws, len(logs))).mean(axis=1)
    low, high = np.exp(np.percentile(means, [5, 95]))
    return {"geomean": round(float(np.exp(logs.mean())), 3), "low": round(float(low), 3), "high": round(float(high), 3)}


def _interval_text(interval: dict[str, float] | None) -> str:
    if not interval:
        return "too few pairs for an interval."
    return f"their geometric mean {interval['geomean']}x, 90% interval {interval['low']}x-{interval['high']}x."


def _median(values: list[float]) -> float | None:
    return round(float(np.median(values)), 3) if values else None


def _kill_later(cluster: RayCluster, after_s: float, into: dict[str, Any]) -> None:
    time.sleep(after_s)
    done = subprocess.run(
        [sys.executable, "-c", KILL, f"127.0.0.1:{RAY_PORT}", f"{SPLIT_MODEL}-v2"],
        env=cluster.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    into["killed_replicas"] = done.stdout.strip().splitlines()[-1:] or done.stderr[-500:]


def _set_traffic(cluster: RayCluster, config: dict[str, Any], shadow: bool) -> None:
    """Only the router's user_config changes: Serve reconfigures running routers, no restart."""
    live = copy.deepcopy(config)
    router = _router(live)
    policy: dict[str, Any] = {"weights": {"1": 1}}
    if shadow:
        policy["shadow"] = {"version": "2", "share": 1.0}
    router["user_config"] = {"traffic": {SPLIT_MODEL: policy}}
    cluster.deploy(live, Probe(f"/v2/models/{ROUTE}/infer", _text("probe")))
    time.sleep(RECONFIGURE_S)


def run(s: LifecycleSettings, model_dir: Path, config_path: Path) -> dict[str, Any]:
    shipped = yaml.safe_load(config_path.read_text())
    shipped["applications"][0]["args"]["model_dir"] = str(model_dir)
    # The router asks for 0.1 CPU in every phase, so the two-router phase changes the replica
    # count only: moving its CPU request between phases made Serve replace the router on a node
    # the catalog fills to its last tenth of a CPU, and the replacement could wait for room.
    router = _router(shipped)
    router["ray_actor_options"] = {**router.get("ray_actor_options", {}), "num_cpus": 0.1}
    # Every model at one replica throughout: each phase compares runs on the same deployment, and a
    # replica the autoscaler starts in one of them (seconds of CPU on a small node) is not what
    # either run measures.
    pin_replicas(shipped, [d["name"] for d in shipped["applications"][0]["deployments"] if d["name"] != "router"])
    out: dict[str, Any] = {"settings": asdict(s)}
    with tempfile.TemporaryDirectory() as tmp_name, RedisServer() as redis:
        tmp = Path(tmp_name)
        with RayCluster(DEFAULT_INGRESS, tmp, model_dir) as cluster:
            probe = Probe(f"/v2/models/{SPLIT_MODEL}/infer", _text("probe"))
            out["deploy_s"] = round(cluster.deploy(shipped, probe), 1)
            out["split"] = split_check(s)
            out["cache_one_router"] = _cache_phase(s, tmp, CACHED_MODELS, seed=1)
            out["shadow"] = _shadow_phase(s, cluster, shipped, tmp)
            # Last, so no phase runs after the app has been redeployed: going back from two
            # routers to one left /v2/health/ready at 503 for minutes in a run that did.
            two = copy.deepcopy(shipped)
            app = two["applications"][0]
            app["args"]["cache"] = {**app["args"].get("cache", {}), "enabled": True, "redis_url": redis.url}
            _router(two)["num_replicas"] = 2
            cluster.deploy(two, probe)
            out["router_replicas"] = wait_for_replicas(cluster, "router", 2)
            time.sleep(SETTLE_S)
            out["cache_two_routers_redis"] = _shared_phase(s, tmp, redis)
    return out


def _router(config: dict[str, Any]) -> dict[str, Any]:
    """The router's entry itself (not a copy): callers edit it in place."""
    router: dict[str, Any] = next(d for d in config["applications"][0]["deployments"] if d["name"] == "router")
    return router


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    sp = r["split"]
    lines = [
        f"**Split** ({sp['requests']} unversioned `{SPLIT_MODEL}` requests, shipped weights 90/10): answered by "
        f"version {sp['by_version']}, version 2's share {sp['share_v2']:.1%}. Versioned paths: {sp['versioned_paths']}. "
        f"Sticky keys ({res['result']['settings']['sticky_requests']} requests each): {sp['sticky']}.",
        "",
        "**Cache, one router** (Zipf s={zipf_s} over {distinct} distinct inputs, closed loop at {c}):".format(
            zipf_s=r["settings"]["zipf_s"], distinct=r["settings"]["distinct"], c=r["settings"]["cache_concurrency"]
        ),
        "",
        "| model | cache | hit ratio | goodput req/s | p50 ms | p99 ms | statuses |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, runs in r["cache_one_router"].items():
        for k in ("without_cache", "with_cache"):
            x = runs[k]
            lines.append(
                f"| {m} | {k} | {x['hit_ratio']} | {x['goodput_rps']} | {x['p50_ms']} | {x['p99_ms']} | {x['statuses']} |"
            )
        lines.append(f"| {m} | ratio | | {runs['throughput_ratio']}x | | | |")
    two, outage = r["cache_two_routers_redis"]["two_routers"], r["cache_two_routers_redis"]["redis_outage"]
    lines += [
        "",
        f"**Two routers, one Redis**: answers by cache outcome {two['answers']} (hit ratio {two['hit_ratio']}), "
        f"{two['goodput_rps']} req/s. **Redis stopped** at {outage.get('stopped_s')} s and restarted at "
        f"{outage.get('restarted_s')} s of a {r['settings']['outage_seconds']:.0f} s run: statuses {outage['statuses']}, "
        f"errors {outage['errors']}, answers {outage['answers']}.",
        "",
        f"**Shadow** (`{ROUTE}`'s heavy tier `{SPLIT_MODEL}` mirrored 100% to version 2; open loop at "
        f"{r['shadow']['rate_rps']} req/s, {r['settings']['shadow_load']:.0%} of the route's closed-loop capacity "
        f"{r['shadow']['capacity_rps']} req/s):",
        "",
        "| round | first | p99 off ms | p99 on ms | ratio | p50 off ms | p50 on ms | statuses on |",
        "|---|---|---|---|---|---|---|---|",
    ]
    sh = r["shadow"]
    for i, p in enumerate(sh["rounds"], 1):
        lines.append(
            f"| {i} | {p.get('first', 'off')} | {p['off']['p99_ms']} | {p['on']['p99_ms']} | {p['p99_ratio']}x | "
            f"{p['off']['p50_ms']} | {p['on']['p50_ms']} | {p['on']['statuses']} |"
        )
    pooled = sh["pooled_p99_ms"]
    lines += [
        "",
        f"Pooled over the rounds: p99 {pooled['off']:.1f} ms without the shadow, {pooled['on']:.1f} ms with it "
        f"({sh['pooled_p99_ratio']}x); median of the pairs' ratios {sh.get('median_pair_p99_ratio')}x; "
        + _interval_text(sh.get("pair_p99_ratio_interval")),
        f"Candidate's replicas killed mid-run (shadow on): killed {sh['kill'].get('killed_replicas')}, client statuses "
        f"{sh['kill']['statuses']}, p99 {sh['kill']['p99_ms']} ms.",
    ]
    lines += ["", f"Shadow agreement (router status): {r['shadow']['shadows']}"]
    return "\n".join(lines)
