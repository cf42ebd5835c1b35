"""`python -m benchmarks flood`: priority when the router itself is the bottleneck.

One high-priority closed-loop client sends JSON images to `resnet-heavy`, alone (unloaded), then
beside `low_clients` low-priority closed-loop clients sending the same (loaded). On the demo
model the router's CPU, not the model, saturates first: what stands in front of its priority
queues (the proxy, the event loop, the body parse) is first come, first served, so only the
router's own overload control (refusing low priority from its headers while its event loop runs
late, serve_app/scheduling/protection/overload.py) can keep the high client's latency.

Reported per phase: the high client's p50/p99 and refusals; the low clients' statuses, refusals
without Retry-After and answers lost (no answer within the client's timeout); the cores each
process role used.
"""

from __future__ import annotations

import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks import workloads
from benchmarks.cluster import HTTP_PORT, Probe, RayCluster, run_loadgen
from benchmarks.scenarios import DEFAULT_INGRESS, pin_replicas, single_versions
from serve_app.config import ROUTER_ADVANCED, advanced_of

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"


@dataclass
class FloodSettings:
    model: str = "resnet-heavy"
    low_clients: int = 64
    seconds: float = 30.0
    warmup: float = 3.0
    router_delay_target_ms: float | None = None  # the router's own overload target; None: the config's

    @classmethod
    def smoke(cls) -> FloodSettings:
        return cls(low_clients=8, seconds=4.0, warmup=1.0)


def flood_config(base: dict[str, Any], model_dir: Path, model: str, delay_target_ms: float | None = None) -> dict[str, Any]:
    """The user's config on these model files, the model at one replica; anonymous clients may
    ask for high priority (the load generator sends no key)."""
    config = pin_replicas(single_versions(base), [model])
    args = config["applications"][0]["args"]
    args["model_dir"] = str(model_dir)
    args["scheduling"] = {**args.get("scheduling", {}), "anonymous_max_priority": "high"}
    if delay_target_ms is not None:
        args["scheduling"]["router_delay_target_ms"] = delay_target_ms
    return config


def client(load: dict[str, Any]) -> dict[str, Any]:
    """What one phase's load generator saw, without its per-request records."""
    keep = ("requests", "statuses", "p50_ms", "p99_ms", "goodput_rps", "refused_without_retry_after", "cpu_cores_by_role",
            "server_ms", "outside_server_ms")  # fmt: skip
    return {k: load[k] for k in keep if k in load}


def run(s: FloodSettings, model_dir: Path, config_path: Path) -> dict[str, Any]:
    base = yaml.safe_load(config_path.read_text())
    out: dict[str, Any] = {"settings": asdict(s)}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        high = workloads.write([workloads.v2_infer(s.model, model_dir / s.model, "high")], tmp / "high.json")
        low = workloads.write([workloads.v2_infer(s.model, model_dir / s.model, "low")], tmp / "low.json")
        with RayCluster(DEFAULT_INGRESS, tmp, model_dir) as cluster:
            body = workloads.bodies_for(model_dir / s.model, 1)[0]
            config = flood_config(base, model_dir, s.model, s.router_delay_target_ms)
            scheduling = config["applications"][0]["args"]["scheduling"]
            out["router_delay_target_ms"] = advanced_of(scheduling, ROUTER_ADVANCED).get("router_delay_target_ms")
            cluster.deploy(config, Probe(f"/v2/models/{s.model}/infer", body))
            out["unloaded"] = client(run_loadgen(BASE_URL, high, {"concurrency": 1}, s.seconds, s.warmup))
            out["loaded"], out["low"] = _flood(s, high, low, honor_retry_after=False)
            out["lanes_after_flood"] = lanes(s.model)
            out["shedding_after_flood"] = shedding()
            out["loaded_polite"], out["low_polite"] = _flood(s, high, low, honor_retry_after=True)
    u = out["unloaded"]
    for suffix in ("", "_polite"):
        loaded = out["loaded" + suffix]
        ratio = round(loaded["p99_ms"] / u["p99_ms"], 2) if u.get("p99_ms") and loaded.get("p99_ms") else None
        out["high_p99_ratio" + suffix] = ratio
        out["high_refused" + suffix] = sum(n for code, n in loaded["statuses"].items() if not code.startswith("2"))
    return out


def lanes(model: str) -> dict[str, Any]:
    """Per lane, the router's recent batches split into its queue, the round trip, the replica's
    wait and the run (p50/p99 ms): where a high-priority request's model time went."""
    try:
        status = httpx.get(f"{BASE_URL}/router/status", timeout=10).json()
        return {name: lane["recent_ms"] for name, lane in status["models"][model]["lanes"].items()}
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return {"error": type(e).__name__}


def shedding() -> dict[str, Any] | None:
    """The router's own overload control after a phase: its shed level and refusals by class."""
    try:
        found: dict[str, Any] | None = httpx.get(f"{BASE_URL}/router/status", timeout=10).json().get("router_delay")
        return found
    except (httpx.HTTPError, ValueError) as e:
        return {"error": type(e).__name__}


def _flood(s: FloodSettings, high: Path, low: Path, honor_retry_after: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The high client beside the low clients; the low ones start with it and outlast it by its
    warm-up at each end. `honor_retry_after`: they wait what a refusal's Retry-After asks."""
    flood: dict[str, Any] = {}

    def low_clients() -> None:
        flood.update(
            run_loadgen(BASE_URL, low, {"concurrency": s.low_clients}, s.seconds + s.warmup, s.warmup,
                        honor_retry_after=honor_retry_after)
        )  # fmt: skip

    thread = threading.Thread(target=low_clients)
    thread.start()
    loaded = client(run_loadgen(BASE_URL, high, {"concurrency": 1}, s.seconds, s.warmup))
    thread.join()
    return loaded, client(flood)


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    s = r["settings"]
    u = r["unloaded"]
    rows = [f"| unloaded | - | {u['p50_ms']} | {u['p99_ms']} | - | {u['statuses']} | - | - |"]
    for suffix, clients in (("", "send again at once"), ("_polite", "wait Retry-After")):
        loaded, low = r.get("loaded" + suffix), r.get("low" + suffix)
        if loaded is None or low is None:  # a run from before the polite phase
            continue
        rows.append(
            f"| flood | {clients} | {loaded['p50_ms']} | {loaded['p99_ms']} | **{r['high_p99_ratio' + suffix]}x** "
            f"| {loaded['statuses']} | {low['statuses']} | {low.get('refused_without_retry_after', '-')} |"
        )
    return "\n".join(
        [
            f"`{s['model']}`, JSON images, closed loop: one high-priority client alone, then beside {s['low_clients']} "
            f"low-priority clients, which after a refusal either send again at once or wait what its "
            f"Retry-After asks; {s['seconds']:.0f} s each. The router's delay target: {r.get('router_delay_target_ms')} ms.",
            "",
            "| phase | low clients | high p50 ms | high p99 ms | high p99 / unloaded | high statuses | low statuses "
            "| low refused without Retry-After |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Cores by role under the flood (high client's window, low clients sending again at once): "
            f"`{r['loaded'].get('cpu_cores_by_role')}`",
            "",
        ]
    )
