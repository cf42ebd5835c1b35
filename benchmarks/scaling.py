"""`python -m benchmarks scaling`: scale from zero, and a load spike, on the shipped config.

Cold start: every model deployed with `min_replicas: 0` and `initial_replicas: 0` (the router
alone is warm), then one request per model, one model at a time, each sent when Serve reports
the model at zero replicas: its status and the time to its answer, against the same request once
the replica is warm; then how long the idle model takes to go back to zero.

Spike: one classifier autoscaling between 1 and `max_replicas` replicas under open-loop load at
its one-replica capacity C (measured first, closed loop), 10% high priority and the rest low;
then 4C for `spike_s`, then C again. Its batches take a fixed extra delay (see ScalingSettings),
so that its replicas, not the node's two cores, bound its capacity. Reported: replicas over time (Serve's status), time to the
first added replica and to the most, p50/p99 and refusals per priority in each phase, and the
time back down to one replica.
"""

from __future__ import annotations

import copy
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from benchmarks import workloads
from benchmarks.cluster import HTTP_PORT, RAY_PORT, Probe, RayCluster, run_loadgen
from benchmarks.scenarios import DEFAULT_INGRESS, single_versions

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
PRIORITY_SHARES = {"high": 0.1, "low": 0.9}


@dataclass
class ScalingSettings:
    models: tuple[str, ...] = ("bert-light", "bert-heavy", "resnet-light", "resnet-heavy", "gpt")
    idle_s: float = 10.0  # downscale_to_zero_delay_s: idle time before a model goes to zero
    spike_model: str = "resnet-heavy"
    max_replicas: int = 4
    capacity_s: float = 10.0  # closed-loop measurement of one replica's capacity
    base_s: float = 20.0  # open loop at C before the spike
    spike_s: float = 30.0  # at 4C
    after_s: float = 120.0  # at C again: long enough to watch the replicas go back down
    spike_factor: float = 4.0
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 15.0
    # The spike model's replicas: batches of `spike_batch` rows that take `spike_delay_s` more (the
    # fault drill's delay, a sleep, not CPU) on `spike_cpus` logical CPUs each. On a 2-core node a
    # demo model's capacity is the node's cores, which more replicas cannot add to; a model whose
    # time is its own, as on an accelerator, is what autoscaling can follow.
    spike_batch: int = 4
    spike_delay_s: float = 0.1
    spike_cpus: float = 0.05

    @classmethod
    def smoke(cls) -> ScalingSettings:
        return cls(models=("bert-light",), idle_s=2.0, capacity_s=2.0, base_s=3.0, spike_s=4.0, after_s=6.0)


def ours_config_from(config: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """The user's config on these model files; the load generator may ask for high priority."""
    args = config["applications"][0]["args"]
    args["model_dir"] = str(model_dir)
    args["scheduling"] = {"anonymous_max_priority": "high", **args.get("scheduling", {})}
    return config


def cold_config(base: dict[str, Any], model_dir: Path, s: ScalingSettings) -> dict[str, Any]:
    """Every model scales to zero after `idle_s` idle and starts at zero."""
    config = ours_config_from(copy.deepcopy(base), model_dir)
    for d in config["applications"][0]["deployments"]:
        if d["name"] == "router":
            continue
        d.pop("num_replicas", None)
        d["autoscaling_config"] = {
            **d.get("autoscaling_config", {}),
            "min_replicas": 0,
            "initial_replicas": 0,
            "max_replicas": 1,
            "downscale_to_zero_delay_s": s.idle_s,
            "downscale_delay_s": s.idle_s,
            "look_back_period_s": 2.0,
            "metrics_interval_s": 0.5,
        }
    return config


def spike_config(base: dict[str, Any], model_dir: Path, s: ScalingSettings, max_replicas: int | None = None) -> dict[str, Any]:
    """The spike model autoscaling from one replica to `max_replicas` (default: the settings')."""
    config = ours_config_from(copy.deepcopy(base), model_dir)
    batching = {"max_batch_size": s.spike_batch, "batch_wait_timeout_s": 0.004}
    model = config["applications"][0]["args"]["models"][s.spike_model]
    model.update(batching=batching, faults={"delay_s": s.spike_delay_s})
    for d in config["applications"][0]["deployments"]:
        if d["name"] == s.spike_model:
            d.pop("num_replicas", None)
            d["ray_actor_options"] = {**d.get("ray_actor_options", {}), "num_cpus": s.spike_cpus}
            d["autoscaling_config"] = {
                **d.get("autoscaling_config", {}),
                "min_replicas": 1,
                "initial_replicas": 1,
                "max_replicas": max_replicas or s.max_replicas,
                "upscale_delay_s": s.upscale_delay_s,
                "downscale_delay_s": s.downscale_delay_s,
                "look_back_period_s": 2.0,
                "metrics_interval_s": 0.5,
            }
    return config


class ReplicaWatch:
    """Serve's replica counts per deployment, polled from a driver connection in a thread."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, dict[str, int]]]] = []  # (wall time, deployment -> state counts)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ReplicaWatch:
        os.environ["RAY_AUTH_MODE"] = "token"
        import logging

        import ray

        ray.init(address=f"127.0.0.1:{RAY_PORT}", log_to_driver=False, logging_level=logging.ERROR)
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import ray

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        ray.shutdown()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.time(), self.now()))
            except Exception:  # a deploy in progress: the next sample will do
                pass
            self._stop.wait(self.interval_s)

    @staticmethod
    def now() -> dict[str, dict[str, int]]:
        from ray import serve

        app = serve.status().applications.get("default")
        if app is None:
            return {}
        return {name: {str(k.value if hasattr(k, "value") else k): v for k, v in d.replica_states.items()}
                for name, d in app.deployments.items()}  # fmt: skip

    def running(self, deployment: str) -> int:
        return self.now().get(deployment, {}).get("RUNNING", 0)

    def wait_running(self, deployment: str, count: int, timeout_s: float) -> float | None:
        """Seconds until the deployment has exactly `count` running replicas (None: not within the timeout)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.running(deployment) == count and not self.now().get(deployment, {}).get("STARTING"):
                return time.monotonic() - started
            time.sleep(0.25)
        return None

    def timeline(self, deployment: str, since: float) -> list[tuple[float, int]]:
        return [(round(t - since, 2), states.get(deployment, {}).get("RUNNING", 0)) for t, states in self.samples if t >= since]


def request_for(model: str, model_dir: Path) -> tuple[str, dict[str, Any]]:
    if model.startswith("gpt"):
        return "/v1/completions", {"model": model, "prompt": "the food was", "max_tokens": 8, "temperature": 0}
    return f"/v2/models/{model}/infer", workloads.bodies_for(model_dir / model, 1)[0]


def cold_start(
    s: ScalingSettings, cluster: RayCluster, watch: ReplicaWatch, base: dict[str, Any], model_dir: Path
) -> dict[str, Any]:
    deploy_s = cluster.deploy(cold_config(base, model_dir, s), _router_probe(), timeout_s=300)
    out: dict[str, Any] = {"deploy_s": round(deploy_s, 1), "models": {}}
    # initial_replicas 0: nothing but the router runs after the deploy.
    out["running_after_deploy"] = {m: watch.running(m) for m in s.models}
    for model in s.models:
        path, body = request_for(model, model_dir)
        at_zero_after = watch.wait_running(model, 0, 120)
        started = time.perf_counter()
        r = httpx.post(BASE_URL + path, json=body, timeout=120, headers={"Cache-Control": "no-cache"})
        first_ms = (time.perf_counter() - started) * 1e3
        warm = []
        for _ in range(5):
            t = time.perf_counter()
            httpx.post(BASE_URL + path, json=body, timeout=60, headers={"Cache-Control": "no-cache"})
            warm.append((time.perf_counter() - t) * 1e3)
        back_to_zero = watch.wait_running(model, 0, s.idle_s * 6 + 60)
        out["models"][model] = {
            "was_at_zero_s": None if at_zero_after is None else round(at_zero_after, 1),
            "first_status": r.status_code,
            "first_answer_ms": round(first_ms, 1),
            "warm_median_ms": round(float(np.median(warm)), 1),
            "back_to_zero_s": None if back_to_zero is None else round(back_to_zero, 1),
        }
        print(f"scaling: cold start {model}: {out['models'][model]}", flush=True)
    return out


class ReadyProbe(Probe):
    """Ready when the server says so: the models are at zero, and an inference probe would wake them."""

    def wait(self, base_url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(base_url + self.path, timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{base_url}{self.path} not ready in {timeout_s}s")


def _router_probe() -> Probe:
    return ReadyProbe("/v2/health/ready", {})


def spike(
    s: ScalingSettings, cluster: RayCluster, watch: ReplicaWatch, base: dict[str, Any], model_dir: Path, tmp: Path
) -> dict[str, Any]:
    model = s.spike_model
    bodies = workloads.bodies_for(model_dir / model, 64)
    path = f"/v2/models/{model}/infer"
    probe = Probe(path, bodies[0])
    # One replica's capacity: measured with the model held at one replica, then autoscaling is
    # turned on by a config change (the running replica stays).
    cluster.deploy(spike_config(base, model_dir, s, max_replicas=1), probe, timeout_s=300)
    watch.wait_running(model, 1, 120)
    plain = workloads.write([workloads.StreamSpec(model, path, bodies)], tmp / "capacity.json")
    capacity = run_loadgen(BASE_URL, plain, {"concurrency": 16}, s.capacity_s, 1.0)
    c = float(capacity["goodput_rps"])
    cluster.deploy(spike_config(base, model_dir, s), probe, timeout_s=300)
    watch.wait_running(model, 1, 120)
    mixed = [workloads.StreamSpec(f"{model}/{p}", path, bodies, share, {"X-Priority": p}) for p, share in PRIORITY_SHARES.items()]
    workload = workloads.write(mixed, tmp / "mixed.json")
    total_s = s.base_s + s.spike_s + s.after_s
    started = time.time()
    extra: dict[str, Any] = {}

    def surge() -> None:
        time.sleep(s.base_s)
        extra["started"] = time.time() - started
        extra["load"] = run_loadgen(BASE_URL, workload, {"rate": c * (s.spike_factor - 1)}, s.spike_s, 0.0, raw=True)

    thread = threading.Thread(target=surge)
    thread.start()
    steady = run_loadgen(BASE_URL, workload, {"rate": c}, total_s, 0.0, raw=True)
    thread.join()
    spike_at = s.base_s
    timeline = watch.timeline(model, started)
    records = [(*r[:4], r[6]) for r in steady.pop("records")]
    surge_records = [(r[0], r[1] + extra["started"], r[2], r[3], r[6]) for r in extra["load"].pop("records")]
    phases = phase_figures(records + surge_records, spike_at, spike_at + s.spike_s, total_s)
    return {
        "capacity_rps": round(c, 1),
        "offered_rps": {"base": round(c, 1), "spike": round(c * s.spike_factor, 1)},
        "surge_started_s": round(extra["started"], 2),
        "phases": phases,
        **scale_times(timeline, spike_at, spike_at + s.spike_s),
        "replicas": timeline,
    }


def phase_figures(records: list[tuple[Any, ...]], spike_start: float, spike_end: float, total: float) -> dict[str, Any]:
    """Per phase and priority: requests, p50/p99 of 2xx, refusals (429/503), refusals without
    Retry-After, other failures. Records: (stream, sent s, latency ms, status, retry_after)."""
    bounds = {"before": (0.0, spike_start), "spike": (spike_start, spike_end), "after": (spike_end, total)}
    out: dict[str, Any] = {}
    for phase, (lo, hi) in bounds.items():
        out[phase] = {}
        for priority in PRIORITY_SHARES:
            rows = [r for r in records if r[0].endswith("/" + priority) and lo <= r[1] < hi]
            ok = [r[2] for r in rows if 200 <= r[3] < 300]
            refused = [r for r in rows if r[3] in (429, 503)]
            out[phase][priority] = {
                "requests": len(rows),
                "ok": len(ok),
                "p50_ms": round(float(np.percentile(ok, 50)), 1) if ok else None,
                "p99_ms": round(float(np.percentile(ok, 99)), 1) if ok else None,
                "refused": len(refused),
                "refused_without_retry_after": sum(1 for r in refused if not r[4]),
                "failed": sum(1 for r in rows if not (200 <= r[3] < 300) and r[3] not in (429, 503)),
            }
    return out


def scale_times(timeline: list[tuple[float, int]], spike_start: float, spike_end: float) -> dict[str, Any]:
    """From (seconds, running replicas) samples: replicas before the spike; seconds from its start
    to the first added replica and to the most it reached; seconds from its end back to the count before."""
    before = [n for t, n in timeline if t < spike_start]
    base = before[-1] if before else 1
    during = [(t, n) for t, n in timeline if t >= spike_start]
    peak = max((n for _, n in during), default=base)
    first_up = next((t - spike_start for t, n in during if n > base), None)
    to_peak = next((t - spike_start for t, n in during if n == peak), None) if peak > base else None
    down = next((t - spike_end for t, n in timeline if t >= spike_end and n <= base), None) if peak > base else None
    return {
        "replicas_before": base,
        "replicas_peak": peak,
        "first_replica_added_s": None if first_up is None else round(first_up, 1),
        "peak_reached_s": None if to_peak is None else round(to_peak, 1),
        "back_down_s": None if down is None else round(down, 1),
        "replicas_at_end": timeline[-1][1] if timeline else base,
    }


def run(s: ScalingSettings, model_dir: Path, config_path: Path) -> dict[str, Any]:
    base = single_versions(yaml.safe_load(config_path.read_text()))
    out: dict[str, Any] = {"settings": asdict(s)}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with RayCluster(DEFAULT_INGRESS, tmp, model_dir) as cluster, ReplicaWatch() as watch:
            out["cold_start"] = cold_start(s, cluster, watch, base, model_dir)
            out["spike"] = spike(s, cluster, watch, base, model_dir, tmp)
    return out


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    lines = ["## Cold start (first answer after idle at zero replicas)", "",
             "| model | status | first answer ms | warm median ms | back to zero s |", "|---|---|---|---|---|"]  # fmt: skip
    for model, m in r["cold_start"]["models"].items():
        lines.append(
            f"| {model} | {m['first_status']} | {m['first_answer_ms']} | {m['warm_median_ms']} | {m['back_to_zero_s']} |"
        )
    sp = r["spike"]
    lines += ["", f"## Spike ({sp['offered_rps']['base']} -> {sp['offered_rps']['spike']} req/s offered, capacity "
              f"{sp['capacity_rps']} req/s at one replica)", "",
              f"replicas {sp['replicas_before']} -> {sp['replicas_peak']}; first added after {sp['first_replica_added_s']} s, "
              f"peak after {sp['peak_reached_s']} s; back down {sp['back_down_s']} s after the spike; "
              f"{sp['replicas_at_end']} at the end", "",
              "| phase | priority | requests | ok | p50 ms | p99 ms | refused | refused w/o Retry-After | failed |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for phase, by_priority in sp["phases"].items():
        for p, f in by_priority.items():
            lines.append(f"| {phase} | {p} | {f['requests']} | {f['ok']} | {f['p50_ms']} | {f['p99_ms']} | {f['refused']} | "
                         f"{f['refused_without_retry_after']} | {f['failed']} |")  # fmt: skip
    return "\n".join(lines) + "\n"
