"""`python -m benchmarks wire`: the same requests to the same running app over three wires: OIP v2
gRPC through Serve's gRPC proxy (Triton's asyncio gRPC client, `benchmarks.grpcload`), HTTP with
the binary tensor extension, and HTTP with JSON tensors (both `benchmarks.loadgen`). Closed loop;
the wires alternate within each round, so a slow spell of the shared machine hits each of them.

Reported per model and wire: goodput, p50/p99, statuses, and CPU per answered request of each
role (ingress proxy, router, model replica) in core-ms, from the cores each process used over the
measured window. The response cache is off, so every request reaches its model.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks import workloads
from benchmarks.cluster import HTTP_PORT, Probe, RayCluster, measured_client, run_loadgen
from benchmarks.scenarios import DEFAULT_INGRESS
from serve_app.protocols.grpc_v2 import SERVICER

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
GRPC_PORT = 9130
WIRES = ("grpc", "http-binary", "http-json")
INGRESS_ROLES = ("serve-proxy", "haproxy")
KEPT = ("goodput_rps", "p50_ms", "p99_ms", "statuses", "cpu_cores_by_role", "loadgen_cpu")


@dataclass
class WireSettings:
    concurrency: int = 32
    seconds: float = 15.0
    warmup: float = 3.0
    rounds: int = 2

    @classmethod
    def smoke(cls) -> WireSettings:
        return cls(4, 2.0, 0.5, 1)


def _grpc(workload: Path, s: WireSettings) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, "-m", "benchmarks.grpcload", "--target", f"127.0.0.1:{GRPC_PORT}",
           "--workload", str(workload), "--concurrency", str(s.concurrency), "--seconds", str(s.seconds),
           "--warmup", str(s.warmup), "--out", str(out)]  # fmt: skip
    return measured_client(cmd, out, s.seconds, s.warmup)


def core_ms(load: dict[str, Any], model: str) -> dict[str, float | None]:
    """CPU per answered request by role, in core-milliseconds."""
    roles = load.get("cpu_cores_by_role") or {}
    rps = load.get("goodput_rps") or 0.0

    def per(cores: float) -> float | None:
        return round(cores * 1000 / rps, 3) if rps else None

    return {
        "ingress": per(sum(roles.get(r, 0.0) for r in INGRESS_ROLES)),
        "router": per(roles.get("replica:router", 0.0)),
        "model": per(roles.get(f"replica:{model}", 0.0)),
    }


def run(s: WireSettings, models: list[str], model_dir: Path, config_path: Path) -> dict[str, Any]:
    config = yaml.safe_load(config_path.read_text())
    args = config["applications"][0]["args"]
    args["model_dir"] = str(model_dir)
    # The workloads cycle a few dozen inputs: with the response cache on, the wires would be
    # measured answering from it, not carrying requests to the models.
    args["cache"] = {**args.get("cache", {}), "enabled": False}
    config["grpc_options"] = {"port": GRPC_PORT, "grpc_servicer_functions": [SERVICER]}
    out: dict[str, Any] = {"settings": vars(s), "models": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with RayCluster(DEFAULT_INGRESS, tmp, model_dir) as cluster:
            first = workloads.bodies_for(model_dir / models[0], 1)[0]
            out["deploy_s"] = round(cluster.deploy(config, Probe(f"/v2/models/{models[0]}/infer", first)), 1)
            for model in models:
                as_json = workloads.v2_infer(model, model_dir / model)
                as_binary = workloads.v2_infer(model, model_dir / model, binary=True)
                json_wl = workloads.write([as_json], tmp / f"{model}-json.json")
                binary_wl = workloads.write([as_binary], tmp / f"{model}-bin.json")
                runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WIRES}
                for _ in range(s.rounds):
                    for wire in WIRES:
                        if wire == "grpc":
                            load = _grpc(json_wl, s)
                        else:
                            wl = binary_wl if wire == "http-binary" else json_wl
                            load = run_loadgen(BASE_URL, wl, {"concurrency": s.concurrency}, s.seconds, s.warmup)
                        kept = {k: load.get(k) for k in KEPT}
                        runs[wire].append({**kept, "core_ms": core_ms(load, model)})
                out["models"][model] = runs
    return out


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    st = r["settings"]
    lines = [
        f"Closed loop at {st['concurrency']}, {st['rounds']} rounds of {st['seconds']:g} s per wire (the wires alternate "
        "within each round); medians over the rounds. CPU in core-ms per answered request.",
        "",
        "| model | wire | goodput req/s (rounds) | vs HTTP JSON | p50 ms | p99 ms | ingress | router | model | statuses |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, runs in r["models"].items():
        base = _median([x["goodput_rps"] for x in runs["http-json"]])
        for wire, rs in runs.items():
            rps = [x["goodput_rps"] for x in rs]
            med = _median(rps)
            cm = {k: _median([x["core_ms"][k] or 0.0 for x in rs]) for k in ("ingress", "router", "model")}
            statuses: dict[str, int] = {}
            for x in rs:
                for code, n in (x["statuses"] or {}).items():
                    statuses[code] = statuses.get(code, 0) + n
            lines.append(
                f"| {model} | {wire} | {med:,.1f} ({', '.join(f'{v:,.0f}' for v in rps)}) | {med / base:.2f}x | "
                f"{_median([x['p50_ms'] for x in rs]):.1f} | {_median([x['p99_ms'] for x in rs]):.1f} | "
                f"{cm['ingress']:.2f} | {cm['router']:.2f} | {cm['model']:.2f} | {statuses} |"
            )
    return "\n".join(lines) + "\n"
