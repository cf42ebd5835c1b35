"""The `generation` scenario: continuous batching vs the `@serve.batch` request-level version, and
vs plain Ray Serve.

Both of our generators serve the same model files in one Serve app, with the same CPU
share and the same maximum batch (KV slots = max_batch_size); plain Ray Serve
(benchmarks/baselines/plain_generate.py: the generator as its own ingress, Serve's
streaming `@serve.batch`, no router) is a second app beside it with the same
model, CPU share, threads and batch, under its own route prefix. The load is a
closed loop of streaming completions with mixed output lengths (benchmarks/genload.py),
exact lengths (ignore_eos) so both do the same work. Phases alternate
continuous, request, continuous, request... at each concurrency, so drift on
this shared machine hits both alike; each setup's figure is its median phase.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import httpx

from benchmarks import genload
from benchmarks.cluster import HTTP_PORT, Probe, RayCluster, cpu_by_role, cpu_snapshot
from benchmarks.scenarios import single_versions, with_ingress_start
from serve_app.config import advanced_of

CONTINUOUS = "gpt"
PLAIN = "plain"  # the label of plain Ray Serve's setup, and its app's route prefix


def request_name(wait_s: float) -> str:
    # No dot in the name: process titles (per-role CPU accounting) end a deployment's name there.
    return f"gpt-request-{round(wait_s * 1000)}ms"


def generation_config(
    base: dict[str, Any], model_dir: Path, batch: int, request_waits: list[float], plain_replicas: int = 2
) -> dict[str, Any]:
    """The user's config with only its generator: as configured (continuous), and as `request` once
    per `@serve.batch` wait timeout (a longer wait forms fuller batches and delays first tokens)."""
    app = single_versions(base)["applications"][0]
    args = app["args"]
    gpt = args["models"]["gpt"]
    gen = gpt.get("generation", {})
    models = {CONTINUOUS: {**gpt, "generation": {**gen, "scheduler": "continuous", "kv_slots": batch}}}
    for wait in request_waits:
        models[request_name(wait)] = {
            **gpt,
            "path": str(model_dir / "gpt"),
            "batching": {"max_batch_size": batch, "batch_wait_timeout_s": wait},
            "generation": {**gen, "scheduler": "request"},
        }
    args.update(model_dir=str(model_dir), models=models, routes={})
    gpt_deployment = next(d for d in app["deployments"] if d["name"] == "gpt")
    kept = [d for d in app["deployments"] if d["name"] in ("router", "gpt")]
    app["deployments"] = [*kept, *({**gpt_deployment, "name": request_name(w)} for w in request_waits)]
    plain = plain_app(with_ingress_start(app, gpt_deployment), model_dir / "gpt", gpt, batch, request_waits[0], plain_replicas)
    base["applications"].append(plain)
    return base


def plain_app(
    deployment: dict[str, Any], gpt_dir: Path, gpt: dict[str, Any], batch: int, wait_s: float, replicas: int
) -> dict[str, Any]:
    """Plain Ray Serve's generator: our generator deployment's resources and threads per replica."""
    options = {k: v for k, v in deployment.items() if k not in ("name", "autoscaling_config", "user_config")}
    args = {"name": PLAIN, "model_dir": str(gpt_dir), "max_batch_size": batch, "batch_wait_timeout_s": wait_s,
            "threads": advanced_of(gpt).get("intra_op_threads")}  # fmt: skip
    return {
        "name": PLAIN,
        "route_prefix": f"/{PLAIN}",
        "import_path": "benchmarks.baselines.plain_generate:build",
        "args": args,
        "deployments": [{**options, "name": "PlainGenerator", "num_replicas": replicas}],
    }


def setup_url(url: str, setup: str) -> str:
    return f"{url}/{PLAIN}" if setup == PLAIN else url


def streamed_text(url: str, model: str, prompt: str = "the", max_tokens: int = 12) -> str:
    """One greedy streamed completion's text: the setups must generate the same tokens to be compared."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def _server_stats(url: str, model: str) -> dict[str, Any] | None:
    return httpx.get(f"{url}/router/status", timeout=10).json()["generators"].get(model)


def run(config: dict[str, Any], model_dir: Path, concurrencies: list[int], seconds: float, warmup: float,
        rounds: int, ingress: Any) -> dict[str, Any]:  # fmt: skip
    models = config["applications"][0]["args"]["models"]
    setups = [*models, PLAIN]  # continuous first, then each request-level variant, then plain Ray Serve
    batch = models[CONTINUOUS]["generation"]["kv_slots"]
    limit = models[CONTINUOUS]["generation"].get("max_tokens_limit", 96)
    workload = genload.mixed_workload(400, seed=0, max_tokens_limit=limit)
    url = f"http://127.0.0.1:{HTTP_PORT}"
    phases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, RayCluster(ingress, Path(tmp), model_dir) as cluster:
        deploy_s = cluster.deploy(config, Probe("/v1/completions", {"model": CONTINUOUS, "prompt": "the", "max_tokens": 2}))
        for model in setups:
            Probe("/v1/completions", {"model": model, "prompt": "the", "max_tokens": 2}).wait(setup_url(url, model), 120)
        texts = {model: streamed_text(setup_url(url, model), model) for model in setups}
        # Random weights may greedily pick tokens that print nothing: then there is no text to compare.
        same_text = len(set(texts.values())) == 1 if any(texts.values()) else None
        for c in concurrencies:
            for r in range(rounds):
                for model in setups:
                    before = cpu_snapshot()
                    server_before = _server_stats(url, model)
                    res = genload.run_phase(setup_url(url, model), model, model, workload, c, seconds, warmup)
                    phase = {
                        **res.to_json(),
                        "round": r,
                        "cpu_cores_by_role": cpu_by_role(before, cpu_snapshot(), seconds + warmup),
                        "server_before": server_before,
                        "server": _server_stats(url, model),
                    }
                    print(f"  c={c} round {r} {model}: {res.tokens_per_s} tok/s, ttft p50 {res.ttft_ms.get('p50')} ms, "
                          f"latency p50 {res.latency_ms.get('p50')} ms, errors {res.errors}", flush=True)  # fmt: skip
                    phases.append(phase)
    plain_replicas = next(a["deployments"][0]["num_replicas"] for a in config["applications"] if a["name"] == PLAIN)
    return {"batch": batch, "deploy_s": deploy_s, "plain_replicas": plain_replicas, "setups": setups, "same_text": same_text,
            "texts": texts, "workload": _workload_summary(workload),
            "phases": phases, "summary": summarize(phases, concurrencies, setups)}  # fmt: skip


def _workload_summary(workload: list[genload.GenRequest]) -> dict[str, Any]:
    lengths = [w.max_tokens for w in workload]
    return {"requests": len(workload), "length_mix": genload.LENGTH_MIX, "max_tokens_mean": statistics.mean(lengths),
            "max_tokens_max": max(lengths)}  # fmt: skip


def batch_sizes(phase: dict[str, Any]) -> dict[int, int]:
    """Batches a request-level setup ran during one phase, by size (from its replica's counters)."""
    before = (phase.get("server_before") or {}).get("batch_sizes", {})
    after = (phase.get("server") or {}).get("batch_sizes", {})
    return {int(k): v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}


def summarize(phases: list[dict[str, Any]], concurrencies: list[int], setups: list[str]) -> list[dict[str, Any]]:
    """Per concurrency and setup, the median over rounds; then continuous / request ratios."""
    rows = []
    for c in concurrencies:
        row: dict[str, Any] = {"concurrency": c}
        for model in setups:
            mine = [p for p in phases if p["concurrency"] == c and p["label"] == model]

            def med(get: Any, mine: list[dict[str, Any]] = mine) -> float | None:
                vals = [v for p in mine if (v := get(p)) is not None]
                return round(statistics.median(vals), 2) if vals else None

            sizes: dict[int, int] = {}
            for p in mine:
                for k, v in batch_sizes(p).items():
                    sizes[k] = sizes.get(k, 0) + v
            row[model] = {
                "tokens_per_s": med(lambda p: p["tokens_per_s"]),
                "tokens_per_s_all": [p["tokens_per_s"] for p in mine],
                "ttft_p50_ms": med(lambda p: p["ttft_ms"].get("p50")),
                "ttft_p99_ms": med(lambda p: p["ttft_ms"].get("p99")),
                "itl_p99_ms": med(lambda p: p["itl_ms"].get("p99")),
                "latency_p50_ms": med(lambda p: p["latency_ms"].get("p50")),
                "latency_p99_ms": med(lambda p: p["latency_ms"].get("p99")),
                "errors": sum(p["errors"] for p in mine),
                "mean_batch": round(sum(k * v for k, v in sizes.items()) / sum(sizes.values()), 2) if sizes else None,
            }
        a = row[CONTINUOUS]
        for model in setups[1:]:
            b = row[model]
            # Per round, each phase against the other setup's phase of the same round: the spread.
            by_round = [x / y for x, y in zip(a["tokens_per_s_all"], b["tokens_per_s_all"], strict=False) if y]
            row[f"vs {model}"] = {
                "tokens_per_s": round(a["tokens_per_s"] / b["tokens_per_s"], 2) if b["tokens_per_s"] else None,
                "tokens_per_s_rounds": [round(x, 2) for x in by_round],
                "latency_p50": round(a["latency_p50_ms"] / b["latency_p50_ms"], 2) if b["latency_p50_ms"] else None,
                "ttft_p50": round(a["ttft_p50_ms"] / b["ttft_p50_ms"], 2) if b["ttft_p50_ms"] else None,
            }
        rows.append(row)
    return rows


def _same_text(same: bool | None) -> str:
    return "no text to compare (every setup printed nothing)" if same is None else "yes" if same else "NO"


def _setup_name(model: str) -> str:
    if model == CONTINUOUS:
        return "continuous"
    if model == PLAIN:
        return "plain Ray Serve"
    return f"request, {model.removeprefix('gpt-request-')} wait"


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    setups = r["setups"]
    lines = [
        "# generation: continuous batching vs `@serve.batch` (request-level), and vs plain Ray Serve",
        "",
        f"Both kinds of generator: the same model files, the same CPU share, at most {r['batch']} sequences per "
        "decode step (KV slots = max_batch_size); the request-level one once per `batch_wait_timeout_s`. Closed loop "
        "of streaming `/v1/completions` over HTTP (router + proxy), mixed output lengths (ignore_eos, exact): "
        f"{r['workload']}. Phases alternate between the setups; figures are the median over rounds (all rounds "
        "in result.json). ITL counts a chunk of n tokens as n tokens gap/n apart. Mean batch: model calls' mean "
        "rows, request-level only (from the replica's counters). Plain Ray Serve: the generator as its own "
        "ingress with Serve's streaming `@serve.batch` (the same model call, tokenizer, threads, CPU share and batch "
        f"as ours; no router), {r.get('plain_replicas', 1)} replica(s), behind the same HTTP ingress. The same greedy "
        f"text from every setup (one probe prompt): {_same_text(r.get('same_text'))}.",
        "",
        "| concurrency | setup | tokens/s (rounds) | TTFT p50 | TTFT p99 | ITL p99 | latency p50 | latency p99 "
        "| mean batch | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in r["summary"]:
        for model in setups:
            m = row[model]
            name = _setup_name(model)
            rounds = ", ".join(str(x) for x in m["tokens_per_s_all"])
            lines.append(
                f"| {row['concurrency']} | {name} | {m['tokens_per_s']} ({rounds}) | {m['ttft_p50_ms']} ms | "
                f"{m['ttft_p99_ms']} ms | {m['itl_p99_ms']} ms | {m['latency_p50_ms']} ms | {m['latency_p99_ms']} ms | "
                f"{m['mean_batch'] or '-'} | {m['errors']} |"
            )
    lines += ["", "Continuous (ours) / the others:", "", "| concurrency | vs | tokens/s | latency p50 | TTFT p50 |",
              "|---|---|---|---|---|"]  # fmt: skip
    for row in r["summary"]:
        for model in setups[1:]:
            v = row[f"vs {model}"]
            ratios: list[float] = v.get("tokens_per_s_rounds") or []
            spread = f" ({min(ratios)}-{max(ratios)}, {len(ratios)} rounds)" if len(ratios) > 1 else ""
            lines.append(
                f"| {row['concurrency']} | {model} | {v['tokens_per_s']}x{spread} | {v['latency_p50']}x | {v['ttft_p50']}x |"
            )
    return "\n".join(lines) + "\n"
