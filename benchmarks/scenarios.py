"""The scenarios `python -m benchmarks` runs. Each measures its setups side by side in
one invocation, on the same model files and machine, and returns plain data
that `benchmarks.report` writes out.

- compare: limit / naive / plain Ray Serve / ours, closed-loop curves and one
  open-loop (Poisson) point at the same rate for every setup.
- sweep:   ours at max_batch_size 1, 4, 8, 16, 32 under a fixed closed-loop load.
- ingress: ours under Ray Serve's default proxy vs HAProxy, each with and
  without RAY_SERVE_THROUGHPUT_OPTIMIZED.
- profile: ours under load with py-spy on the router and model replicas.
- priority: high-priority latency while low-priority traffic floods the stack at
  twice its capacity, with the router's priority policy and with plain FIFO.
- cascade:  each route (light first, heavy when unsure) vs its heavy model alone,
  closed loop on held-out inputs: throughput, latency, who answered.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from benchmarks import workloads
from benchmarks.baselines.limit import measure_limit
from benchmarks.cluster import (
    BUFSIZE,
    CHECK_FALL,
    HTTP_PORT,
    REPLAY_ON,
    RETRIES,
    Ingress,
    Probe,
    RayCluster,
    idle_cores_by_role,
    naive_server,
    replica_rss_mb,
    run_loadgen,
)
from benchmarks.loadgen import pooled
from serve_app.config import advanced_of
from serve_app.tools.ingress_env import local_haproxy_maxconn

# The ingress the default configs use (README's serve command, the KubeRay pods):
# chosen by the `ingress` scenario, see benchmarks/results/ingress/local/ (HAProxy plus
# throughput-optimized measured 1.7x HAProxy alone for bert-heavy at concurrency 32).
DEFAULT_INGRESS = Ingress(
    haproxy=True,
    throughput_optimized=True,
    retry_on=REPLAY_ON,
    check_fall=CHECK_FALL,
    retries=RETRIES,
    bufsize=BUFSIZE,
    observe_mark_down=False,
    maxconn=local_haproxy_maxconn(),
)


@dataclass
class Settings:
    models: list[str]
    model_dir: Path
    config: Path
    seconds: float = 8.0
    warmup: float = 2.0
    concurrencies: list[int] = field(default_factory=lambda: [1, 4, 16, 32, 64])
    headline_concurrency: int = 32
    open_rate_share: float = 0.5  # open-loop rate, as a share of the naive server's best throughput
    limit_batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8, 16, 32, 64])
    limit_seconds: float = 4.0
    sweep_batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8, 16, 32])
    sweep_concurrency: int = 32
    ingress_concurrencies: list[int] = field(default_factory=lambda: [8, 32])
    profile_seconds: float = 15.0
    idle_seconds: float = 5.0  # compare: each served setup's CPU with no load, before its load points
    # compare: after the curves, plain and ours deployed in turn this many rounds at the headline
    # concurrency (JSON), so that their ratio does not ride on how fast the machine was minutes apart.
    pairs: int = 0
    # compare: plain Ray Serve's model replicas. Two on a 2-core machine: ours runs two processes
    # there too (the router and the model replica), and a Serve user scales by replicas.
    plain_replicas: int = 2
    # compare --pairs: the setups deployed in turn; `ours-handle` is ours with `scheduling.local_link`
    # off (every batch over Serve's handle), to weigh the link against the handle in the same run.
    pair_setups: tuple[str, ...] = ("ours", "plain")
    high_share: float = 0.1  # high-priority rate, as a share of the measured capacity
    overload: float = 2.0  # low-priority rate, as a multiple of the measured capacity
    # Measured window of the priority scenario's open-loop runs: ~200 high requests, so a p99
    # is more than the second-worst of them.
    priority_seconds: float = 30.0
    smoke_ingress: bool = False  # ingress: only the shipped one, HAProxy + throughput-optimized
    # Ours with only the measured models' deployments (and the router): fewer replicas to start on a
    # small CI machine. Off for real runs, which measure the whole catalog a user deploys.
    measured_models_only: bool = False

    @classmethod
    def smoke(cls, models: list[str], model_dir: Path, config: Path) -> Settings:
        """A few seconds per step: checks the harness end to end, not the numbers."""
        return cls(
            models=models, model_dir=model_dir, config=config, seconds=1.0, warmup=0.3, concurrencies=[4],
            headline_concurrency=4, limit_batch_sizes=[1, 4], limit_seconds=0.3, sweep_batch_sizes=[4],
            sweep_concurrency=4, ingress_concurrencies=[4], profile_seconds=3.0, priority_seconds=1.5, idle_seconds=0.5,
            smoke_ingress=True, measured_models_only=True,
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def workload(s: Settings, model: str, tmp: Path, binary: bool = False) -> Path:
    stream = workloads.v2_infer(model, s.model_dir / model, binary=binary)
    return workloads.write([stream], tmp / f"{model}{'.binary' if binary else ''}.workload.json")


def probe(s: Settings, model: str) -> Probe:
    return Probe(f"/v2/models/{model}/infer", workloads.bodies_for(s.model_dir / model, 1)[0])


def _load_config(s: Settings) -> dict[str, Any]:
    config = yaml.safe_load(s.config.read_text())
    app = config["applications"][0]
    app["args"]["model_dir"] = str(s.model_dir)
    return config


def single_versions(config: dict[str, Any]) -> dict[str, Any]:
    """The config without further model versions, their traffic policy and the response cache:
    what every scenario but `lifecycle` measures, against baselines that have none of them (a
    workload that repeats its inputs would otherwise measure the cache, not the serving path)."""
    app = config["applications"][0]
    extra = set()
    for name, model in app["args"]["models"].items():
        extra |= {f"{name}-v{v}" for v in model.pop("versions", {})}
    app["args"].pop("cache", None)
    app["args"].pop("traffic", None)
    app["deployments"] = [d for d in app.get("deployments", []) if d["name"] not in extra]
    for d in app["deployments"]:
        if d["name"] == "router":
            d.pop("user_config", None)
    return config


def ours_config(
    s: Settings,
    batching: dict[str, dict[str, Any]] | None = None,
    scheduling: dict[str, Any] | None = None,
    lifecycle: bool = False,
    routes: bool = False,
) -> dict[str, Any]:
    """The user's config (default configs/local.yaml), pointed at the model dir; optional overrides.
    `lifecycle`: keep its model versions, traffic policy and response cache (off by default).
    `routes`: keep every route's tiers even when the settings ask for the measured models only."""
    config = _load_config(s) if lifecycle else single_versions(_load_config(s))
    if s.measured_models_only and not routes:
        config = only_models(config, s.models)
    args = config["applications"][0]["args"]
    for model, override in (batching or {}).items():
        args["models"][model]["batching"].update(override)
    if not args.get("tenants"):
        # The load generator sends X-Priority to an open server: let it ask for high.
        args["scheduling"] = {"anonymous_max_priority": "high", **args.get("scheduling", {})}
    if scheduling:
        args["scheduling"] = {**args.get("scheduling", {}), **scheduling}
    return config


def only_models(config: dict[str, Any], models: list[str]) -> dict[str, Any]:
    """The catalog cut to these models and the router; a route whose tiers are not all kept is dropped."""
    app = config["applications"][0]
    args = app["args"]
    args["models"] = {name: m for name, m in args["models"].items() if name in models}
    routes = args.get("routes", {})
    args["routes"] = {name: r for name, r in routes.items() if {r["light"], r["heavy"]} <= set(models)}
    app["deployments"] = [d for d in app.get("deployments", []) if d["name"] == "router" or d["name"] in models]
    return config


def pin_replicas(config: dict[str, Any], models: list[str], replicas: int = 1) -> dict[str, Any]:
    """Fix the models' replica counts: a result at one replica count, not wherever autoscaling went."""
    for d in config["applications"][0].get("deployments", []):
        if d["name"] in models:
            d.pop("autoscaling_config", None)
            d["num_replicas"] = replicas
    return config


def plain_config(s: Settings, model: str) -> dict[str, Any]:
    """Plain Ray Serve with the model's own resources, autoscaling and batching from the same config."""
    base = _load_config(s)
    app = base["applications"][0]
    deployment = next((d for d in app.get("deployments", []) if d["name"] == model), {"name": model})
    batching = app["args"]["models"][model]["batching"]
    plain_deployment = with_ingress_start(app, {k: v for k, v in deployment.items() if k != "name"})
    return {
        "proxy_location": base.get("proxy_location", "HeadOnly"),
        "http_options": dict(base.get("http_options", {})),
        "applications": [
            {
                "name": "plain",
                "route_prefix": "/",
                "import_path": "benchmarks.baselines.plain_serve:build",
                "logging_config": app.get("logging_config", {}),
                "args": {
                    "name": model,
                    "model_dir": str(s.model_dir / model),
                    "threads": _plain_threads(
                        advanced_of(app["args"]["models"][model]).get("intra_op_threads"), s.plain_replicas
                    ),
                    **batching,
                },
                "deployments": [{"name": "PlainModel", **plain_deployment}],
            }
        ],
    }


def with_ingress_start(app: dict[str, Any], deployment: dict[str, Any]) -> dict[str, Any]:
    """A plain baseline's deployment, started as ours' router is (its `runtime_env`: the niceness
    Ray starts it at): plain's replicas take requests off the socket as the router does, so
    neither side's front gets a CPU priority the other lacks."""
    router: dict[str, Any] = next((d for d in app.get("deployments", []) if d["name"] == "router"), {})
    runtime_env = router.get("ray_actor_options", {}).get("runtime_env")
    if not runtime_env:
        return deployment
    return {**deployment, "ray_actor_options": {**deployment.get("ray_actor_options", {}), "runtime_env": runtime_env}}


def _plain_threads(threads: int | None, replicas: int) -> int | None:
    """Plain's intra-op threads per replica: ours' for the model, split over plain's replicas, so both
    sides run the model on as many threads (ours' two single-threaded bulk sessions against two
    single-threaded replicas, not four threads on two cores). None: the replica's own rule, as ours."""
    return None if threads is None else max(1, -(-threads // max(1, replicas)))


def model_gpu_ids(s: Settings, model: str) -> list[str]:
    """GPU 0 for the baselines that run outside Ray (limit, naive) when ours gives this model a GPU
    share: every setup then runs the model on the same device, and only what wraps it differs."""
    deployments = _load_config(s)["applications"][0].get("deployments", [])
    options: dict[str, Any] = next((d.get("ray_actor_options", {}) for d in deployments if d["name"] == model), {})
    return ["0"] if float(options.get("num_gpus") or 0) > 0 else []


def _closed_curve(url: str, workload: Path, s: Settings, watch: tuple[str, ...]) -> list[dict[str, Any]]:
    return [run_loadgen(url, workload, {"concurrency": c}, s.seconds, s.warmup, watch) for c in s.concurrencies]


def compare(s: Settings) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    out: dict[str, Any] = {"models": {}}
    for m in s.models:
        out["models"][m] = {"limit": measure_limit(s.model_dir / m, workloads.bodies_for(s.model_dir / m), s.limit_batch_sizes,
                                                   s.limit_seconds, threads=len(os.sched_getaffinity(0)),
                                                   gpu_ids=model_gpu_ids(s, m))}  # fmt: skip
    for m in s.models:
        wl = workload(s, m, tmp)
        with naive_server(s.model_dir / m, m, probe(s, m), model_gpu_ids(s, m)) as url:
            curve = _closed_curve(url, wl, s, ())
            rate = round(max(p["goodput_rps"] for p in curve) * s.open_rate_share, 1) or 1.0
            out["models"][m]["open_rate_rps"] = rate
            out["models"][m]["naive"] = {"closed": curve, "open": run_loadgen(url, wl, {"rate": rate}, s.seconds, s.warmup)}
    with RayCluster(DEFAULT_INGRESS, tmp, s.model_dir) as cluster:
        url = f"http://127.0.0.1:{HTTP_PORT}"
        for m in s.models:
            wl, rate = workload(s, m, tmp), out["models"][m]["open_rate_rps"]
            deploy_s = cluster.deploy(pin_replicas(plain_config(s, m), ["PlainModel"], s.plain_replicas), probe(s, m))
            out["models"][m]["plain"] = {
                "deploy_s": round(deploy_s, 1),
                "idle_cores_by_role": idle_cores_by_role(s.idle_seconds),
                # False: HAProxy never reached the replicas directly, and the points measure Serve's proxy.
                "direct_backends": cluster.direct_backends,
                "closed": _closed_curve(url, wl, s, ("PlainModel",)),
                "open": run_loadgen(url, wl, {"rate": rate}, s.seconds, s.warmup),
            }
        # Replicas pinned to one, in both served setups: a second replica on a small machine only
        # adds a model load, and one that the autoscaler starts late in a model's phase runs into
        # the next model's (measured: 1.1 cores of bert-heavy during ResNet-50's c=32 point).
        deploy_s = cluster.deploy(pin_replicas(ours_config(s), s.models), probe(s, s.models[0]))
        idle = idle_cores_by_role(s.idle_seconds)
        # Whether v2 infer skipped Serve's per-request wrapper in the router (serve_app/router/edge/direct.py).
        direct_infer = router_status(url).get("direct_infer")
        for m in s.models:
            wl, rate = workload(s, m, tmp), out["models"][m]["open_rate_rps"]
            out["models"][m]["ours"] = {
                "deploy_s": round(deploy_s, 1),
                "idle_cores_by_role": idle,
                "direct_backends": cluster.direct_backends,
                "direct_infer": direct_infer,
                "closed": _closed_curve(url, wl, s, (m, "router")),
                "open": run_loadgen(url, wl, {"rate": rate}, s.seconds, s.warmup),
            }
            # The same inputs in the binary tensor extension (outputs asked for as binary too), over
            # the same curve: what a tritonclient user's requests cost, and what they reach.
            binary = workload(s, m, tmp, binary=True)
            out["models"][m]["ours-binary"] = {"closed": _closed_curve(url, binary, s, (m, "router")), "idle_cores_by_role": idle}
        if s.pairs:
            for m, rounds in _side_by_side(s, cluster, tmp).items():
                out["models"][m]["pairs"] = rounds
    out["ingress"] = DEFAULT_INGRESS.label
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def pair_orders(rounds: int, setups: tuple[str, ...] = ("ours", "plain")) -> list[tuple[str, ...]]:
    """Which setup goes when in each round: as listed in round 0 (ours first: the curves leave it
    deployed), then reversed each round, so that a machine that speeds up or slows down over the
    rounds favours none, and the setup that ends a round starts the next."""
    return [setups if i % 2 == 0 else tuple(reversed(setups)) for i in range(rounds)]


def pair_config(s: Settings, setup: str, model: str) -> dict[str, Any]:
    if setup == "plain":
        return pin_replicas(plain_config(s, model), ["PlainModel"], s.plain_replicas)
    if setup == "ours-handle":
        return pin_replicas(ours_config(s, scheduling={"local_link": False}), s.models)
    assert setup == "ours", setup
    return pin_replicas(ours_config(s), s.models)


def _side_by_side(s: Settings, cluster: RayCluster, tmp: Path) -> dict[str, list[dict[str, Any]]]:
    """The pair setups (plain and ours, by default) at the headline concurrency, deployed in turn
    (`pair_orders`); one JSON and one binary point per setup, model and round. Ours is the whole
    catalog, deployed once a turn; plain one model at a time, as in the curves."""
    url, c = f"http://127.0.0.1:{HTTP_PORT}", s.headline_concurrency
    bodies = {m: workload(s, m, tmp) for m in s.models}  # the same file for every round
    binary = {m: workload(s, m, tmp, binary=True) for m in s.models}
    deployed = "ours"  # as the curves leave the cluster
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in s.models}
    for i, order in enumerate(pair_orders(s.pairs, s.pair_setups)):
        points: dict[str, dict[str, Any]] = {m: {"round": i, "order": list(order)} for m in s.models}
        for setup in order:
            for m in s.models:
                want = f"plain:{m}" if setup == "plain" else setup  # ours serves every model at once
                if deployed != want:
                    cluster.deploy(pair_config(s, setup, m), probe(s, m))
                    deployed = want
                watch = ("PlainModel",) if setup == "plain" else (m, "router")
                points[m][setup] = run_loadgen(url, bodies[m], {"concurrency": c}, s.seconds, s.warmup, watch)
                # The same inputs in the binary tensor extension, on the same deployment.
                points[m][f"{setup}-binary"] = run_loadgen(url, binary[m], {"concurrency": c}, s.seconds, s.warmup, watch)
        for m in s.models:
            rounds[m].append(points[m])
    return rounds


def sweep(s: Settings) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    out: dict[str, Any] = {"models": {}, "ingress": DEFAULT_INGRESS.label, "concurrency": s.sweep_concurrency}
    url = f"http://127.0.0.1:{HTTP_PORT}"
    for m in s.models:
        wl, points = workload(s, m, tmp), []
        for bs in s.sweep_batch_sizes:
            # A fresh Ray per point: redeploying onto a running cluster left HAProxy sending part of
            # the load to draining replicas (throughput swung 5x between runs), and fresh replicas
            # make the memory figure this batch size's, not the largest one seen so far.
            with RayCluster(DEFAULT_INGRESS, tmp, s.model_dir) as cluster:
                cluster.deploy(pin_replicas(ours_config(s, {m: {"max_batch_size": bs}}), [m]), probe(s, m))
                idle_rss = replica_rss_mb(m)
                r = run_loadgen(url, wl, {"concurrency": s.sweep_concurrency}, s.seconds, s.warmup, (m,))
            points.append({"max_batch_size": bs, "idle_rss_mb": idle_rss, **r})
        out["models"][m] = points
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def ingress(s: Settings) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    # The HAProxy settings carry the shipped HAProxy's retry, health-check and buffer settings, so
    # that the throughput-optimized one is the ingress that README's serve command starts.
    settings = [
        replace(DEFAULT_INGRESS, throughput_optimized=t) if h else Ingress(h, t) for h in (False, True) for t in (False, True)
    ]
    if s.smoke_ingress:
        # One, since each Ray restart is much of a smoke run's time: the shipped HAProxy ingress,
        # on the Ray that CI's earlier smoke runs kept (the default proxy serves the integration tests).
        settings = [DEFAULT_INGRESS]
    out: dict[str, Any] = {"settings": []}
    for setting in settings:
        started = time.perf_counter()
        with RayCluster(setting, tmp, s.model_dir) as cluster:
            # One replica per model, as every other scenario pins it: an ingress must not win by a
            # second model replica that the autoscaler started under its load.
            deploy_s = cluster.deploy(pin_replicas(ours_config(s), s.models), probe(s, s.models[0]))
            entry: dict[str, Any] = {"label": setting.label, **asdict(setting), "deploy_s": round(deploy_s, 1), "models": {}}
            url = f"http://127.0.0.1:{HTTP_PORT}"
            for m in s.models:
                wl = workload(s, m, tmp)
                entry["models"][m] = [
                    run_loadgen(url, wl, {"concurrency": c}, s.seconds, s.warmup) for c in s.ingress_concurrencies
                ]
        entry["total_s"] = round(time.perf_counter() - started, 1)
        out["settings"].append(entry)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def pids(role: str) -> list[int]:
    import psutil

    from benchmarks.cluster import process_role

    return [p.pid for p in psutil.process_iter() if process_role(p) == role]


def profile(s: Settings, out_dir: Path) -> dict[str, Any]:
    """py-spy on the router and each model replica of ours while the load generator runs."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    out: dict[str, Any] = {"models": {}}
    py_spy = shutil.which("py-spy")
    with RayCluster(DEFAULT_INGRESS, tmp, s.model_dir) as cluster:
        cluster.deploy(pin_replicas(ours_config(s), s.models), probe(s, s.models[0]))
        url = f"http://127.0.0.1:{HTTP_PORT}"
        for m in s.models:
            wl = workload(s, m, tmp)
            procs: dict[str, subprocess.Popen[bytes]] = {}
            files: dict[str, Path] = {}
            if py_spy:
                for role in ("router", m):
                    for pid in pids(f"replica:{role}"):
                        f = out_dir / f"pyspy_{m}_{role}_{pid}.txt"
                        files[role] = f
                        # --idle off: time on the event loop's wait is not work; raw collapsed stacks are small.
                        procs[role] = subprocess.Popen(
                            [py_spy, "record", "--pid", str(pid), "--duration", str(int(s.profile_seconds)),
                             "--rate", "50", "--format", "raw", "--output", str(f), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
            load = run_loadgen(url, wl, {"concurrency": s.headline_concurrency}, s.profile_seconds, 0.0)
            errors = {}
            for role, p in procs.items():
                _, err = p.communicate(timeout=60)
                if p.returncode:
                    errors[role] = err.decode(errors="replace").strip()[-500:]
            found = {role: f for role, f in files.items() if f.exists() and f.stat().st_size}
            out["models"][m] = {
                "load": load,
                "profiled": sorted(files),  # the roles py-spy was started on
                "profile_errors": errors,  # py-spy's own words where it failed (ptrace not permitted, ...)
                "profiles": {role: f.name for role, f in found.items()},
                "top_self": {role: top_frames(f) for role, f in found.items()},
                "top_inclusive": {role: inclusive_frames(f, 25) for role, f in found.items()},
            }
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _stacks(collapsed: Path) -> list[tuple[list[str], int]]:
    """py-spy's collapsed format: `frame;frame;...;frame count` per line."""
    out = []
    for line in collapsed.read_text().splitlines():
        stack, _, num = line.rpartition(" ")
        if stack:
            out.append((stack.split(";"), int(num)))
    return out


def _shares(counts: dict[str, int], total: int, n: int) -> list[tuple[str, float]]:
    return [(f, round(c / total, 3)) for f, c in sorted(counts.items(), key=lambda kv: -kv[1])[:n]] if total else []


def top_frames(collapsed: Path, n: int = 12) -> list[tuple[str, float]]:
    """Self-time share per function (the leaf frame of each sample)."""
    counts: dict[str, int] = {}
    stacks = _stacks(collapsed)
    for frames, k in stacks:
        counts[frames[-1]] = counts.get(frames[-1], 0) + k
    return _shares(counts, sum(k for _, k in stacks), n)


def inclusive_frames(collapsed: Path, n: int = 15) -> list[tuple[str, float]]:
    """Inclusive share per function (a function counted once per sample it appears in)."""
    counts: dict[str, int] = {}
    stacks = _stacks(collapsed)
    for frames, k in stacks:
        for frame in set(frames):
            counts[frame] = counts.get(frame, 0) + k
    return _shares(counts, sum(k for _, k in stacks), n)


def router_status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/router/status", timeout=10) as r:
        return dict(json.loads(r.read()))


def priority(s: Settings) -> dict[str, Any]:
    """Capacity first (closed loop, priority policy); then, per policy on a fresh Ray: high
    priority alone at `high_share` of capacity (its unloaded latency), and the same high
    stream under a low-priority flood at `overload` x capacity (open loop, Poisson).

    Replicas are pinned to one per model: capacity and the loaded runs must measure the same
    replica set (autoscaling to a second replica on two cores only adds a model load)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    out: dict[str, Any] = {"models": {m: {} for m in s.models}, "ingress": DEFAULT_INGRESS.label}
    url = f"http://127.0.0.1:{HTTP_PORT}"
    for policy in ("priority", "fifo"):
        with RayCluster(DEFAULT_INGRESS, tmp, s.model_dir) as cluster:
            config = pin_replicas(ours_config(s, scheduling={"policy": policy}), s.models)
            cluster.deploy(config, probe(s, s.models[0]))
            for m in s.models:
                entry = out["models"][m]
                if "capacity_rps" not in entry:
                    # The best of a few closed-loop levels: a deep queue means full batches, and
                    # full batches are not always the fastest (BERT-base on CPU is not).
                    wl = workload(s, m, tmp)
                    levels = sorted({max(2, s.headline_concurrency // 4), s.headline_concurrency})
                    curve = [run_loadgen(url, wl, {"concurrency": c}, s.seconds, s.warmup) for c in levels]
                    entry["capacity"] = curve
                    entry["capacity_rps"] = max(p["goodput_rps"] for p in curve)
                cap = entry["capacity_rps"]
                high_rate, low_rate = round(cap * s.high_share, 2), round(cap * s.overload, 2)
                entry["rates_rps"] = {"high": high_rate, "low": low_rate}
                high = workloads.v2_infer(m, s.model_dir / m, "high", weight=high_rate)
                low = workloads.v2_infer(m, s.model_dir / m, "low", weight=low_rate)
                alone = workloads.write([high], tmp / f"{m}.high.json")
                mixed = workloads.write([high, low], tmp / f"{m}.mixed.json")
                window = s.priority_seconds
                # The client must not shed the flood for the server: its in-flight cap sits above
                # what the router can hold (a full queue), so every refusal is the server's. At
                # the loadgen's default cap (512) a 10 s queue kept the cap full and the client
                # dropped ~40% of the low stream: the server saw ~1.2x capacity, not 2x.
                cap_in_flight = 2 * int(config["applications"][0]["args"].get("scheduling", {}).get("max_queue_items", 1024))
                entry[policy] = {
                    "unloaded": run_loadgen(url, alone, {"rate": high_rate}, window, s.warmup, (m, "router")),
                    "loaded": run_loadgen(
                        url, mixed, {"rate": high_rate + low_rate}, window, s.warmup, (m, "router"), cap_in_flight
                    ),
                }
                # The router's own view right after the flood: shed counts by reason, lanes, limits.
                status = router_status(url)
                entry[policy]["router_status"] = status.get("models", {}).get(m)
                entry[policy]["router_gc"] = status.get("gc")
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def cascade(s: Settings) -> dict[str, Any]:
    """Throughput of each route against its heavy tier alone, on one deployment of ours, in
    alternated rounds (`--pairs`, at least one): the route's ratio is the median of the rounds'.
    Every answer is scored against its input's true label, so the accuracy is this run's own; the
    calibration's (on the test split, from `serve-app calibrate`) stands beside it."""
    from serve_app.config import AppArgs
    from serve_app.manifest import Manifest

    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    config = ours_config(s, routes=True)
    args = AppArgs.model_validate(config["applications"][0]["args"])
    if s.measured_models_only:  # CI: the routes' tiers only, not the rest of the catalog
        config = only_models(config, sorted({m for r in args.routes.values() for m in (r.light, r.heavy)}))
    rounds = max(1, s.pairs)
    out: dict[str, Any] = {"routes": {}, "ingress": DEFAULT_INGRESS.label, "concurrency": s.headline_concurrency,
                           "rounds": rounds}  # fmt: skip
    url = f"http://127.0.0.1:{HTTP_PORT}"
    with RayCluster(DEFAULT_INGRESS, tmp, s.model_dir) as cluster:
        cluster.deploy(config, probe(s, next(iter(args.routes.values())).heavy))
        for name, route in args.routes.items():
            heavy_dir = s.model_dir / route.heavy
            load = {"concurrency": s.headline_concurrency}
            setups = {
                "route": (workloads.v2_infer(name, heavy_dir, scored=True), (route.light, route.heavy, "router")),
                "heavy_only": (workloads.v2_infer(route.heavy, heavy_dir, scored=True), (route.heavy, "router")),
            }
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in setups}
            for rnd in range(rounds):
                for setup in list(setups) if rnd % 2 == 0 else reversed(list(setups)):
                    spec, roles = setups[setup]
                    path = workloads.write([spec], tmp / f"{setup}.json")
                    runs[setup].append(run_loadgen(url, path, load, s.seconds, s.warmup, roles))
            ratios = [r["goodput_rps"] / h["goodput_rps"] for r, h in zip(runs["route"], runs["heavy_only"], strict=True)]
            median = statistics.median(ratios)
            out["routes"][name] = {
                "light": route.light,
                "heavy": route.heavy,
                "calibration": Manifest.load(s.model_dir / route.light).calibrations.get(route.heavy),
                # The round whose ratio is the median's (the middle one of an odd count) stands for the rest.
                **{k: v[_median_index(ratios)] for k, v in runs.items()},
                "ratio": {"median": round(median, 3), "min": round(min(ratios), 3), "max": round(max(ratios), 3)},
                "rounds": [
                    {"route_rps": r["goodput_rps"], "heavy_only_rps": h["goodput_rps"], "ratio": round(x, 3)}
                    for r, h, x in zip(runs["route"], runs["heavy_only"], ratios, strict=True)
                ],
                "accuracy": {k: pooled([r.get("scored") or {} for r in v], "accuracy", "answers") for k, v in runs.items()},
            }
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _median_index(values: list[float]) -> int:
    return sorted(range(len(values)), key=values.__getitem__)[(len(values) - 1) // 2]


SCENARIOS = {"compare": compare, "sweep": sweep, "ingress": ingress, "priority": priority, "cascade": cascade}
