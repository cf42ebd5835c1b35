"""The `generation` scenario: continuous batching vs the `@serve.batch` request-level version.

Both generators serve the same model files in one Serve app, with the same CPU
share and the same maximum batch (KV slots = max_batch_size); the load is a
closed loop of streaming completions with mixed output lengths (benchmarks/genload.py),
exact lengths (ignore_eos) so both do the same work. Phases alternate
continuous, request, continuous, request... at each concurrency, so drift on
this shared machine hits both alike; each setup's figure is its median phase.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import httpx

from benchmarks import genload
from benchmarks.cluster import HTTP_PORT, Probe, RayCluster, cpu_by_role, cpu_snapshot

CONTINUOUS, REQUEST = "gpt", "gpt-request"


def generation_config(base: dict[str, Any], model_dir: Path, batch: int) -> dict[str, Any]:
    """The user's config with only its generator, twice: as configured (continuous) and as `request`."""
    app = base["applications"][0]
    args = app["args"]
    gpt = args["models"]["gpt"]
    gen = gpt.get("generation", {})
    continuous = {**gpt, "generation": {**gen, "scheduler": "continuous", "kv_slots": batch}}
    request = {
        **gpt,
        "path": str(model_dir / "gpt"),
        "batching": {"max_batch_size": batch, "batch_wait_timeout_s": gpt.get("batching", {}).get("batch_wait_timeout_s", 0.01)},
        "generation": {**gen, "scheduler": "request"},
    }  # fmt: skip
    args.update(model_dir=str(model_dir), models={CONTINUOUS: continuous, REQUEST: request}, routes={})
    gpt_deployment = next(d for d in app["deployments"] if d["name"] == "gpt")
    kept = [d for d in app["deployments"] if d["name"] in ("router", "gpt")]
    app["deployments"] = [*kept, {**gpt_deployment, "name": REQUEST}]
    return base


def _server_stats(url: str) -> dict[str, Any] | None:
    return httpx.get(f"{url}/router/status", timeout=10).json()["generators"].get(CONTINUOUS)


def run(config: dict[str, Any], model_dir: Path, concurrencies: list[int], seconds: float, warmup: float,
        rounds: int, ingress: Any) -> dict[str, Any]:  # fmt: skip
    batch = config["applications"][0]["args"]["models"][CONTINUOUS]["generation"]["kv_slots"]
    limit = config["applications"][0]["args"]["models"][CONTINUOUS]["generation"].get("max_tokens_limit", 96)
    workload = genload.mixed_workload(400, seed=0, max_tokens_limit=limit)
    url = f"http://127.0.0.1:{HTTP_PORT}"
    probe = Probe("/v1/completions", {"model": REQUEST, "prompt": "the", "max_tokens": 2})
    phases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, RayCluster(ingress, Path(tmp), model_dir) as cluster:
        deploy_s = cluster.deploy(config, probe)
        Probe("/v1/completions", {"model": CONTINUOUS, "prompt": "the", "max_tokens": 2}).wait(url, 120)
        for c in concurrencies:
            for r in range(rounds):
                for model in (CONTINUOUS, REQUEST):
                    before = cpu_snapshot()
                    res = genload.run_phase(url, model, model, workload, c, seconds, warmup)
                    phase = {
                        **res.to_json(),
                        "round": r,
                        "cpu_cores_by_role": cpu_by_role(before, cpu_snapshot(), seconds + warmup),
                    }
                    if model == CONTINUOUS:
                        phase["server"] = _server_stats(url)
                    print(f"  c={c} round {r} {model}: {res.tokens_per_s} tok/s, ttft p50 {res.ttft_ms.get('p50')} ms, "
                          f"latency p50 {res.latency_ms.get('p50')} ms, errors {res.errors}", flush=True)  # fmt: skip
                    phases.append(phase)
    return {"batch": batch, "deploy_s": deploy_s, "workload": _workload_summary(workload), "phases": phases,
            "summary": summarize(phases, concurrencies)}  # fmt: skip


def _workload_summary(workload: list[genload.GenRequest]) -> dict[str, Any]:
    lengths = [w.max_tokens for w in workload]
    return {"requests": len(workload), "length_mix": genload.LENGTH_MIX, "max_tokens_mean": statistics.mean(lengths),
            "max_tokens_max": max(lengths)}  # fmt: skip


def summarize(phases: list[dict[str, Any]], concurrencies: list[int]) -> list[dict[str, Any]]:
    """Per concurrency and setup, the median over rounds; then continuous / request ratios."""
    rows = []
    for c in concurrencies:
        row: dict[str, Any] = {"concurrency": c}
        for model in (CONTINUOUS, REQUEST):
            mine = [p for p in phases if p["concurrency"] == c and p["label"] == model]

            def med(get: Any, mine: list[dict[str, Any]] = mine) -> float | None:
                vals = [v for p in mine if (v := get(p)) is not None]
                return round(statistics.median(vals), 2) if vals else None

            row[model] = {
                "tokens_per_s": med(lambda p: p["tokens_per_s"]),
                "tokens_per_s_all": [p["tokens_per_s"] for p in mine],
                "ttft_p50_ms": med(lambda p: p["ttft_ms"].get("p50")),
                "ttft_p99_ms": med(lambda p: p["ttft_ms"].get("p99")),
                "itl_p99_ms": med(lambda p: p["itl_ms"].get("p99")),
                "latency_p50_ms": med(lambda p: p["latency_ms"].get("p50")),
                "latency_p99_ms": med(lambda p: p["latency_ms"].get("p99")),
                "errors": sum(p["errors"] for p in mine),
            }
        a, b = row[CONTINUOUS], row[REQUEST]
        row["tokens_per_s_ratio"] = round(a["tokens_per_s"] / b["tokens_per_s"], 2) if b["tokens_per_s"] else None
        row["latency_p50_ratio"] = round(a["latency_p50_ms"] / b["latency_p50_ms"], 2) if b["latency_p50_ms"] else None
        row["ttft_p50_ratio"] = round(a["ttft_p50_ms"] / b["ttft_p50_ms"], 2) if b["ttft_p50_ms"] else None
        rows.append(row)
    return rows


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    lines = [
        "# generation: continuous batching vs `@serve.batch` (request-level)",
        "",
        f"Command: `{res['command']}`",
        "",
        f"Both generators: the same model files, the same CPU share, at most {r['batch']} sequences per decode step "
        "(KV slots = max_batch_size). Closed loop of streaming `/v1/completions` over HTTP (router + proxy), "
        f"mixed output lengths (ignore_eos, exact): {r['workload']}. Phases alternate between the two setups; "
        "figures are the median over rounds, all rounds in result.json.",
        "",
        "| concurrency | setup | tokens/s (rounds) | TTFT p50 | TTFT p99 | ITL p99 | latency p50 | latency p99 | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["summary"]:
        for model in (CONTINUOUS, REQUEST):
            m = row[model]
            name = "continuous" if model == CONTINUOUS else "request (@serve.batch)"
            lines.append(
                f"| {row['concurrency']} | {name} | {m['tokens_per_s']} ({', '.join(str(x) for x in m['tokens_per_s_all'])}) | "
                f"{m['ttft_p50_ms']} ms | {m['ttft_p99_ms']} ms | {m['itl_p99_ms']} ms | {m['latency_p50_ms']} ms | "
                f"{m['latency_p99_ms']} ms | {m['errors']} |"
            )
    lines += ["", "Continuous / request, per concurrency:", "",
              "| concurrency | tokens/s | latency p50 | TTFT p50 |", "|---|---|---|---|"]  # fmt: skip
    for row in r["summary"]:
        lines.append(
            f"| {row['concurrency']} | {row['tokens_per_s_ratio']}x | {row['latency_p50_ratio']}x | {row['ttft_p50_ratio']}x |"
        )
    return "\n".join(lines) + "\n"
