"""Writing a scenario's results: result.json (every raw figure), README.md (the summary
tables) and PNG plots, with the machine and the exact command, in one directory."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks import (
    chaos,
    contention,
    cores,
    cost,
    flood,
    generation,
    goodput,
    history,
    images,
    lifecycle,
    multiplex,
    precision,
    routers,
    scaling,
    simulate,
    soak,
    wire,
)

SETUPS = ("naive", "plain", "ours")
SETUP_TITLES = {
    "limit": "limit (ORT in-process, best batch)",
    "naive": "naive (FastAPI + ORT, 1 worker)",
    "plain": "plain Ray Serve (@serve.batch, no router)",
    "ours": "ours (router + model deployments)",
}


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next(
            line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line
        )
    except (OSError, StopIteration):
        cpu = platform.processor()
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        mem_gib = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        # The server's cores: fewer than the machine's where the client has its own
        # (benchmarks/cores.py) or `taskset` narrowed the whole run.
        "usable_cores": _server_cores(),
        "cores_plan": cores.in_force(),
        "memory_gib": mem_gib,
        "gpu": gpu_info(),
        "python": platform.python_version(),
        "packages": {p: version(p) for p in ("ray", "onnxruntime-gpu", "numpy", "fastapi", "uvicorn") if _installed(p)},
        "commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _server_cores() -> int | None:
    """The cores the server ran on: the plan's where clients had cores of their own
    (benchmarks/cores.py), else every core this process may use."""
    if (server := cores.in_force().get("server_cores")) is not None:
        return len(cores.parse(str(server)))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def gpu_info() -> list[dict[str, str]] | None:
    """The machine's GPUs as nvidia-smi names them; None where there is none (or no driver)."""
    fields = ("name", "memory.total", "driver_version")
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = [dict(zip(fields, (v.strip() for v in line.split(",")), strict=False)) for line in out.splitlines() if line.strip()]
    return gpus or None


def _installed(pkg: str) -> bool:
    try:
        version(pkg)
        return True
    except Exception:  # PackageNotFoundError and friends
        return False


def model_size(model_dir: Path) -> dict[str, Any]:
    """Parameters and input shape of an exported model, as stated in every report."""
    from serve_app.manifest import Manifest

    manifest = Manifest.load(model_dir)
    onnx_path = model_dir / manifest.onnx_file
    params = None
    try:
        import onnx

        graph = onnx.load(str(onnx_path), load_external_data=False).graph
        params = sum(int(_prod(t.dims)) for t in graph.initializer)
    except ImportError:  # onnx comes with the [build] extra; the file size still says something
        pass
    return {
        "preset": manifest.source.get("preset"),
        "family": manifest.family,
        "parameters": params,
        "onnx_mb": round(onnx_path.stat().st_size / 2**20, 1),
        "image_size": manifest.image_size,
    }


def _prod(dims: Any) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _at(curve: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    return next((p for p in curve if p.get("concurrency") == concurrency), curve[-1])


def _size_line(size: dict[str, Any]) -> str:
    params = f"{size['parameters'] / 1e6:.2f}M parameters" if size.get("parameters") else "parameters unknown"
    image = f", {size['image_size']}x{size['image_size']} input" if size.get("image_size") else ""
    return f"preset `{size.get('preset')}`, {params}, ONNX {size['onnx_mb']} MB{image}"


def compare_markdown(res: dict[str, Any]) -> str:
    c = res["settings"]["headline_concurrency"]
    lines = []
    for m, r in res["result"]["models"].items():
        limit = r["limit"]["best"]
        provider = r["limit"].get("providers", ["CPUExecutionProvider"])[0]
        lines += [f"## {m}", "", f"Model: {_size_line(res['model_sizes'][m])}.", ""]
        lines += [
            f"Closed loop at concurrency {c} (served setups) vs ONNX Runtime alone at its best batch size "
            f"({limit['batch_size']}, {r['limit']['threads']} threads, {provider}). "
            "Latency of *limit* is one batch call.",
            "",
            # Latency is over the answered (2xx) requests only: the non-2xx column says how many were not.
            "| setup | throughput | non-2xx | p50 ms | p90 ms | p99 ms | throughput / limit | p50 / limit p50 | "
            "p99 / limit p99 |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {SETUP_TITLES['limit']} | {limit['items_per_s']} items/s | 0 | {limit['p50_ms']} | {limit['p90_ms']} | "
            f"{limit['p99_ms']} | 1.00x | 1.00x | 1.00x |",
        ]
        for setup in SETUPS:
            p = _at(r[setup]["closed"], c)
            lines.append(
                f"| {SETUP_TITLES[setup]} | {p['goodput_rps']} req/s | {_not_answered(p)} | {_fmt(p['p50_ms'])} | "
                f"{_fmt(p['p90_ms'])} | {_fmt(p['p99_ms'])} | {_ratio(p['goodput_rps'], limit['items_per_s'])} | "
                f"{_ratio(p['p50_ms'], limit['p50_ms'])} | {_ratio(p['p99_ms'], limit['p99_ms'])} |"
            )
        naive, plain, ours = (_at(r[s]["closed"], c) for s in SETUPS)
        proxied = [SETUP_TITLES[s] for s in SETUPS if r[s].get("direct_backends") is False]
        lines += [
            "",
            *(
                [f"- **Through Serve's Python proxy** (HAProxy never reached the replicas directly): {', '.join(proxied)}"]
                if proxied
                else []
            ),
            f"- ours vs naive: throughput **{_ratio(ours['goodput_rps'], naive['goodput_rps'])}**, "
            f"p50 {_ratio(ours['p50_ms'], naive['p50_ms'])}, p99 {_ratio(ours['p99_ms'], naive['p99_ms'])}",
            f"- ours vs plain Ray Serve: throughput **{_ratio(ours['goodput_rps'], plain['goodput_rps'])}**, "
            f"p50 {_ratio(ours['p50_ms'], plain['p50_ms'])}, p99 {_ratio(ours['p99_ms'], plain['p99_ms'])}",
            *(
                [
                    f"- ours with binary inputs vs plain Ray Serve (JSON): throughput "
                    f"**{_ratio(_at(r['ours-binary']['closed'], c)['goodput_rps'], plain['goodput_rps'])}**"
                ]
                if "ours-binary" in r
                else []
            ),
            "- best throughput over the curve: "
            + ", ".join(f"{s} {max(p['goodput_rps'] for p in r[s]['closed'])} req/s" for s in (*SETUPS, "ours-binary") if s in r),
            *pairs_lines(r.get("pairs"), c, res["settings"].get("plain_replicas", 1)),
            "",
            f"Open loop, Poisson arrivals at {r['open_rate_rps']} req/s (half the naive server's best), same for every setup:",
            "",
            "| setup | answered req/s | p50 ms | p90 ms | p99 ms | errors | client-dropped |",
            "|---|---|---|---|---|---|---|",
        ]
        machine = res.get("machine", {})
        lines += _open_loop_and_cpu(r, c, machine.get("usable_cores") or machine.get("cores"))
        lines += ["", *cost_table(r, m, c)]
        lines += ["", f"![latency vs throughput]({plot_name('curve', m)})", ""]
    return "\n".join(lines)


def pairs_lines(rounds: list[dict[str, Any]] | None, c: int, plain_replicas: int = 1) -> list[str]:
    """compare --pairs: the setups deployed in turn at concurrency `c`, a row per round and setup
    against plain, and the median of the rounds' ratios (what a drifting machine moves least)."""
    if not rounds:
        return []
    lines = [
        "",
        f"Side by side: the setups deployed in turn, {len(rounds)} round{'s' * (len(rounds) != 1)} at "
        f"concurrency {c}, plain with {plain_replicas} model replica{'s' * (plain_replicas != 1)} "
        "(`--pairs`, `--pair-setups`, `--plain-replicas`; the order each round deployed them in); JSON inputs on "
        "every side, then the binary tensor extension on every side (plain answers in JSON); `ours-handle` is "
        "ours with `scheduling.local_link` off:",
    ]
    setups = [x for x in rounds[0]["order"] if x != "plain"]
    for encoding, suffix in (("JSON", ""), ("binary", "-binary")):
        rows = [r for r in rounds if f"plain{suffix}" in r]
        if not rows:
            continue
        lines += [
            "",
            "| round | order | inputs | setup | plain req/s | setup req/s | setup / plain | non-2xx (plain, setup) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        medians = []
        for setup in setups:
            ratios = []
            for r in rows:
                plain, ours = r[f"plain{suffix}"], r.get(f"{setup}{suffix}")
                if ours is None:
                    continue
                if plain["goodput_rps"]:
                    ratios.append(ours["goodput_rps"] / plain["goodput_rps"])
                lines.append(
                    f"| {r['round'] + 1} | {', '.join(r['order'])} | {encoding} | {setup} | {plain['goodput_rps']} | "
                    f"{ours['goodput_rps']} | {_ratio(ours['goodput_rps'], plain['goodput_rps'])} | "
                    f"{_not_answered(plain)}, {_not_answered(ours)} |"
                )
            if ratios:
                medians.append(f"- {setup} / plain, {encoding}: median of the rounds' ratios "
                               f"**{statistics.median(ratios):.2f}x** (range {min(ratios):.2f}x-{max(ratios):.2f}x)")  # fmt: skip
        lines += ["", *medians] if medians else []
    return lines


def _not_answered(point: dict[str, Any]) -> int:
    """Requests that got no 2xx: refused, failed, timed out or dropped by the connection."""
    return sum(v for k, v in point.get("statuses", {}).items() if not k.startswith("2"))


def _open_loop_and_cpu(r: dict[str, Any], c: int, cores: int | None) -> list[str]:
    """compare: the open-loop rows of each setup, then the cores each process role used at `c`."""
    lines = []
    for setup in SETUPS:
        o = r[setup]["open"]
        errors = _not_answered(o)
        lines.append(
            f"| {setup} | {o['goodput_rps']} | {_fmt(o['p50_ms'])} | {_fmt(o['p90_ms'])} | {_fmt(o['p99_ms'])} | "
            f"{errors} | {o['client_dropped']} |"
        )
    lines += ["", f"Where the CPU went at concurrency {c} (cores; {cores} = the whole machine):", ""]
    for setup in SETUPS:
        roles = _at(r[setup]["closed"], c).get("cpu_cores_by_role", {})
        lines.append(f"- {setup}: " + ", ".join(f"{k} {v}" for k, v in roles.items()))
    return lines


def cost_table(r: dict[str, Any], model: str, c: int) -> list[str]:
    """Core-ms per request by part at concurrency `c`, and the ceilings they imply (benchmarks/cost.py)."""
    lines = [
        f"CPU per request at concurrency {c}, core-ms (the load generator left out); the cores each setup used with no "
        "load; and the throughput a node would reach if, beyond those idle cores, every core did what a request adds "
        "above idle (benchmarks/cost.py; without an idle measurement, all cores at the whole cost):",
        "",
        "| setup | inputs | ingress | router | model | Ray | total | throughput | idle cores | total above idle "
        "| ceiling, 2 cores | ceiling, 16 cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setup in (*SETUPS, "ours-binary"):
        if setup not in r:
            continue
        point = _at(r[setup]["closed"], c)
        cost_ = cost.core_ms_per_request(point, model)
        idle = r[setup].get("idle_cores_by_role")
        above = cost.core_ms_per_request(point, model, idle)
        if cost_ is None or above is None:
            continue
        fixed = cost.fixed_cores(idle)
        name, inputs = ("ours", "binary") if setup == "ours-binary" else (setup, "JSON")
        parts = " | ".join(_fmt(cost_[p], 3) for p in (*cost.PARTS, "total"))
        idle_cells = f"{_fmt(fixed, 3)} | {_fmt(above['total'], 3)}" if idle else "- | -"
        lines.append(
            f"| {name} | {inputs} | {parts} | {point['throughput_rps']} req/s | {idle_cells} | "
            f"{_fmt(cost.ceiling_rps(above, 2, fixed))} req/s | {_fmt(cost.ceiling_rps(above, 16, fixed))} req/s |"
        )
    return lines


def sweep_markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    lines = [f"Ours (full application through the router, {r['ingress']}), closed loop at concurrency {r['concurrency']}; "
             "each batch size deployed fresh.", ""]  # fmt: skip
    for m, points in r["models"].items():
        best = max(points, key=lambda p: p["goodput_rps"])
        lines += [
            f"## {m}",
            "",
            f"Model: {_size_line(res['model_sizes'][m])}.",
            "",
            "| max_batch_size | throughput req/s | p50 ms | p99 ms | replica RSS idle MB | replica RSS peak MB |",
            "|---|---|---|---|---|---|",
        ]
        for p in points:
            lines.append(
                f"| {p['max_batch_size']} | {p['goodput_rps']} | {_fmt(p['p50_ms'])} | {_fmt(p['p99_ms'])} | "
                f"{p['idle_rss_mb']} | {p.get('replica_rss_mb', {}).get(m, '-')} |"
            )
        lines += ["", f"Best throughput at max_batch_size {best['max_batch_size']}.", "",
                  f"![sweep]({plot_name('sweep', m)})", ""]  # fmt: skip
    return "\n".join(lines)


def ingress_markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    models = list(r["settings"][0]["models"])
    concurrencies = [p["concurrency"] for p in r["settings"][0]["models"][models[0]]]
    head = " | ".join(f"{m} c={c} req/s (p50 ms)" for m in models for c in concurrencies)
    lines = [f"| ingress | {head} | deploy s |", "|---" * (1 + len(models) * len(concurrencies) + 1) + "|"]
    for s in r["settings"]:
        cells = " | ".join(f"{p['goodput_rps']} ({_fmt(p['p50_ms'])})" for m in models for p in s["models"][m])
        lines.append(f"| {s['label']} | {cells} | {s['deploy_s']} |")
    return "\n".join(lines)


def _in_window(point: dict[str, Any]) -> float:
    return float(point.get("goodput_in_window_rps", point["goodput_rps"]))


def priority_markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    lines = [
        f"Ours ({r['ingress']}). Capacity: the best closed-loop throughput at concurrency "
        f"{max(2, res['settings']['headline_concurrency'] // 4)} and {res['settings']['headline_concurrency']} "
        "(priority policy). "
        "Then, open loop (Poisson), per policy on a fresh Ray: *unloaded* = the high-priority stream "
        "alone; *loaded* = the same high stream plus low priority at the overload rate. Latency percentiles are of "
        "answered (2xx) requests; *high refused* counts every other outcome of a high-priority request; goodput "
        "counts 2xx answers that arrived inside the measured window.",
        "",
    ]
    for m, e in r["models"].items():
        if "priority" not in e:
            continue
        cap, rates = e["capacity_rps"], e["rates_rps"]
        lines += [
            f"## {m}",
            "",
            f"Model: {_size_line(res['model_sizes'][m])}. Capacity {cap} req/s; high {rates['high']} req/s, "
            f"low {rates['low']} req/s ({rates['low'] / cap:.1f}x capacity).",
            "",
            "| policy | high p50 unloaded ms | high p99 unloaded ms | high p50 loaded ms | high p99 loaded ms | "
            "p99 loaded / unloaded | high refused | low sent | low refused by server | low dropped by client | "
            "low answered req/s | goodput req/s | goodput / capacity | goodput / best seen | model cores |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        # The closed-loop capacity can read low (an open loop keeps the queue fuller); the best
        # throughput seen in the run, either policy's flood included, is the stricter denominator.
        best = max([cap] + [_in_window(e[p]["loaded"]) for p in ("priority", "fifo")])
        for policy in ("priority", "fifo"):
            un, lo = e[policy]["unloaded"]["streams"], e[policy]["loaded"]["streams"]
            hu, hl = un[f"{m}/high"], lo[f"{m}/high"]
            ll = lo.get(f"{m}/low", {"goodput_rps": 0, "requests": 0, "statuses": {}})
            # Arrivals the client dropped at its in-flight cap count as refused: the server never answered them.
            refused = hl["requests"] - hl["statuses"].get("200", 0) + hl.get("client_dropped", 0)
            sent = hl["requests"] + hl.get("client_dropped", 0)
            loaded = e[policy]["loaded"]
            low_ok = _in_window(ll)
            goodput = _in_window(loaded)
            # The model replica's cores during the flood: the urgent lane's own session can use cores
            # beyond the bulk lane's threads when the node has them idle.
            model_cores = loaded.get("cpu_cores_by_role", {}).get(f"replica:{m}")
            lines.append(
                f"| {policy} | {_fmt(hu['p50_ms'])} | {_fmt(hu['p99_ms'])} | {_fmt(hl['p50_ms'])} | {_fmt(hl['p99_ms'])} | "
                f"{_ratio(hl['p99_ms'], hu['p99_ms'])} | {refused} of {sent} | "
                # Who shed the flood: the server (any non-2xx) or the client at its in-flight cap.
                f"{ll['requests'] + ll.get('client_dropped', 0)} | {ll['requests'] - ll['statuses'].get('200', 0)} | "
                f"{ll.get('client_dropped', 0)} | {low_ok} | {goodput} | "
                f"{_ratio(goodput, cap)} | {_ratio(goodput, best)} | {_fmt(model_cores, 2)} |"
            )
        lines.append("")
        lines += _priority_notes(m, e)
        lines.append("")
    return "\n".join(lines)


def _priority_notes(m: str, e: dict[str, Any]) -> list[str]:
    """Per policy: where the high-priority request's time went (Server-Timing), and the router's
    full garbage collections during the flood."""
    lines: list[str] = []
    for policy in ("priority", "fifo"):
        split = [(phase, e[policy][phase]["streams"][f"{m}/high"]) for phase in ("unloaded", "loaded")]
        if all("server_ms" in h for _, h in split):
            # Server-Timing: the router's handling vs everything before and after it.
            parts = [
                f"{phase}: in the router p50/p99 {h['server_ms']['p50']}/{h['server_ms']['p99']} ms, "
                f"outside it {h['outside_server_ms']['p50']}/{h['outside_server_ms']['p99']} ms"
                for phase, h in split
            ]
            lines.append(f"- {policy}, high priority, {'; '.join(parts)}")
    for policy in ("priority", "fifo"):
        gen2 = (e[policy].get("router_gc") or {}).get("gen2", {})
        if "last_30s" in gen2:
            # Read right after the flood: the last 30 s are its measured window.
            window, frozen = gen2["last_30s"], e[policy]["router_gc"].get("frozen_objects", 0)
            lines.append(
                f"- {policy}, router garbage collection during the flood (last 30 s): {window['collections']} full "
                f"collections, longest {window['max_ms']} ms; {frozen} objects frozen"
            )
    return lines


def cascade_markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    rounds = r.get("rounds", 1)
    lines = [
        f"Ours ({r['ingress']}), closed loop at concurrency {r['concurrency']}, held-out inputs, route and heavy-only "
        f"alternated over {rounds} round(s): the ratio is the median of the rounds' (range in brackets), the req/s "
        "and p50 columns are the median round's. Accuracy: every answer of this run scored against its input's true "
        "label (pooled over the rounds), beside `serve-app calibrate`'s on the test split (threshold fitted on the "
        "validation split).",
        "",
        "| route | signal >= threshold | light answers (calibration) | light answered (this run) | cascade acc (this run) "
        "| heavy-only acc (this run) | cascade acc (calibration) | heavy-only acc (calibration) | light-only acc "
        "| route req/s | heavy-only req/s | route / heavy-only | route p50 ms | heavy p50 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    pct = lambda v: f"{v:.2%}" if isinstance(v, float) else "-"  # noqa: E731
    for name, e in r["routes"].items():
        cal, run, heavy = e["calibration"] or {}, e["route"], e["heavy_only"]
        test = cal.get("test", {})
        served = run.get("served_by", {})
        light_share = served.get(e["light"], 0) / max(1, sum(served.values()))
        rule = f"{cal['signal']} >= {cal['threshold']:.3f}" if cal else "pinned"
        acc = e.get("accuracy", {})
        ratio = e.get("ratio")
        single = _ratio(run["goodput_rps"], heavy["goodput_rps"])
        spread = f"**{ratio['median']}x** ({ratio['min']}-{ratio['max']})" if ratio else single
        lines.append(
            f"| {name} | {rule} | {pct(test.get('light_share'))} | {light_share:.1%} | {pct(acc.get('route'))} "
            f"| {pct(acc.get('heavy_only'))} | {pct(test.get('cascade_acc'))} | {pct(test.get('heavy_acc'))} "
            f"| {pct(test.get('light_acc'))} | {run['goodput_rps']} | {heavy['goodput_rps']} | {spread} "
            f"| {_fmt(run['p50_ms'])} | {_fmt(heavy['p50_ms'])} |"
        )
    lines += ["", "CPU per answered request by process role, in core-milliseconds (the median round's cores over its req/s):", ""]
    lines += ["| route | setup | " + " | ".join(CASCADE_ROLES) + " | all |", "|---|---|" + "---|" * (len(CASCADE_ROLES) + 1)]
    for name, e in r["routes"].items():
        for setup in ("route", "heavy_only"):
            run = e[setup]
            cores = run.get("cpu_cores_by_role", {})
            rps = run["goodput_rps"] or 1.0
            per = {role: cores.get(_role_key(role, e), 0.0) / rps * 1e3 for role in CASCADE_ROLES}
            total = sum(cores.values()) / rps * 1e3
            lines.append(f"| {name} | {setup} | " + " | ".join(f"{v:.2f}" for v in per.values()) + f" | {total:.2f} |")
    return "\n".join(lines)


CASCADE_ROLES = ("router", "light replica", "heavy replica", "proxy", "load generator")


def _role_key(role: str, entry: dict[str, Any]) -> str:
    """The `cpu_cores_by_role` key of a role of the cascade's table."""
    return {
        "light replica": f"replica:{entry['light']}",
        "heavy replica": f"replica:{entry['heavy']}",
        "router": "replica:router",
        "proxy": "haproxy",
        "load generator": "loadgen",
    }[role]


def profile_markdown(res: dict[str, Any]) -> str:
    lines = []
    for m, r in res["result"]["models"].items():
        load = r["load"]
        lines += [
            f"## {m}",
            "",
            f"Ours under closed-loop load (concurrency {load['concurrency']}): {load['goodput_rps']} req/s, "
            f"p50 {_fmt(load['p50_ms'])} ms, p99 {_fmt(load['p99_ms'])} ms.",
            "",
            "Cores per process role: " + ", ".join(f"{k} {v}" for k, v in load.get("cpu_cores_by_role", {}).items()),
            "",
        ]
        for role in r.get("profiles", {}):
            lines += [f"### py-spy, {role} replica (share of samples; idle threads excluded)", "",
                      "| self time | function |", "|---|---|"]  # fmt: skip
            lines += [f"| {share:.1%} | `{frame}` |" for frame, share in r["top_self"][role]]
            lines += ["", "| inclusive | function |", "|---|---|"]
            lines += [f"| {share:.1%} | `{frame}` |" for frame, share in r["top_inclusive"][role]]
            lines.append("")
    return "\n".join(lines)


def plot_name(kind: str, model: str) -> str:
    return f"{kind}_{model}.png"


def plots(scenario: str, res: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if scenario == "compare":
        for m, r in res["result"]["models"].items():
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for setup, color in zip(SETUPS, ("tab:gray", "tab:blue", "tab:green"), strict=True):
                pts = [p for p in r[setup]["closed"] if p["p50_ms"] is not None]
                x = [p["goodput_rps"] for p in pts]
                ax.plot(x, [p["p50_ms"] for p in pts], "o-", color=color, label=f"{setup} p50")
                ax.plot(x, [p["p99_ms"] for p in pts], "s--", color=color, alpha=0.6, label=f"{setup} p99")
                for p in pts:
                    ax.annotate(f"c={p['concurrency']}", (p["goodput_rps"], p["p50_ms"]), fontsize=7, alpha=0.7)
            ax.axvline(r["limit"]["best"]["items_per_s"], color="tab:red", linestyle=":", label="limit (items/s)")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("throughput (req/s, log)")
            ax.set_ylabel("latency (ms, log)")
            ax.set_title(f"{m}: latency vs throughput, closed loop")
            ax.legend(fontsize=7, ncol=2)
            fig.tight_layout()
            name = plot_name("curve", m)
            fig.savefig(out_dir / name, dpi=110)
            plt.close(fig)
            written.append(name)
    elif scenario == "sweep":
        for m, points in res["result"]["models"].items():
            fig, ax = plt.subplots(figsize=(7, 4.5))
            labels = [str(p["max_batch_size"]) for p in points]
            ax.bar(labels, [p["goodput_rps"] for p in points], color="tab:green", alpha=0.6, label="throughput")
            ax.set_xlabel("max_batch_size")
            ax.set_ylabel("throughput (req/s)")
            ax2 = ax.twinx()
            ax2.plot(labels, [p["p50_ms"] or 0 for p in points], "o-", color="tab:blue", label="p50")
            ax2.plot(labels, [p["p99_ms"] or 0 for p in points], "s--", color="tab:red", label="p99")
            ax2.set_ylabel("latency (ms)")
            ax.set_title(f"{m}: batch-size sweep (concurrency {res['result']['concurrency']})")
            fig.legend(loc="upper left", fontsize=8)
            fig.tight_layout()
            name = plot_name("sweep", m)
            fig.savefig(out_dir / name, dpi=110)
            plt.close(fig)
            written.append(name)
    return written


MARKDOWN = {
    "chaos": chaos.markdown,
    "images": images.markdown,
    "lifecycle": lifecycle.markdown,
    "scaling": scaling.markdown,
    "flood": flood.markdown,
    "goodput": goodput.markdown,
    "simulate": simulate.markdown,
    "routers": routers.markdown,
    "soak": soak.markdown,
    "generation": generation.markdown,
    "contention": contention.markdown,
    "precision": precision.markdown,
    "wire": wire.markdown,
    "multiplex": multiplex.markdown,
    "compare": compare_markdown,
    "sweep": sweep_markdown,
    "ingress": ingress_markdown,
    "profile": profile_markdown,
    "priority": priority_markdown,
    "cascade": cascade_markdown,
}


def write(scenario: str, res: dict[str, Any], out_dir: Path) -> Path:
    """result.json + README.md + PNGs in out_dir; returns the Markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    res["plots"] = plots(scenario, res, out_dir)
    (out_dir / "result.json").write_text(json.dumps(res, indent=1))
    lg = res.get("loadgen_cpu")
    body = MARKDOWN[scenario](res) if scenario in MARKDOWN else ""
    text = "\n".join(
        [
            f"# Benchmark: {scenario}",
            "",
            f"Reproduce: `{res['command']}`",
            "",
            f"Machine: {res['machine']['cpu']}, {_cores_text(res['machine'])}, {res['machine']['memory_gib']} GiB, "
            f"{_gpu_text(res['machine'].get('gpu'))}; Python {res['machine']['python']}; "
            + ", ".join(f"{k} {v}" for k, v in res["machine"]["packages"].items())
            + f"; commit {res['machine']['commit']}; {res['machine']['date']}.",
            "",
            f"Load generator: its own process, {lg['max_core_share']:.0%} of one core at most "
            f"(median {lg['median_us_per_request']:.0f} µs CPU per request); its share is in every point's "
            "`loadgen_cpu` and `cpu_cores_by_role` in result.json."
            if lg
            else "",
            "",
            body,
            "",
        ]
    )
    (out_dir / "README.md").write_text(text)
    history.append(res, out_dir)  # the folder keeps this run only; the history keeps its row
    return out_dir / "README.md"


def _cores_text(machine: dict[str, Any]) -> str:
    usable = machine.get("usable_cores", machine["cores"])
    if usable == machine["cores"]:
        return f"{machine['cores']} cores"
    return f"{machine['cores']} cores ({usable} usable: the run was pinned with CPU affinity)"


def _gpu_text(gpus: list[dict[str, str]] | None) -> str:
    if not gpus:
        return "no GPU"
    return ", ".join(f"{g.get('name')} ({g.get('memory.total')})" for g in gpus)


def loadgen_cost(res: Any) -> dict[str, float] | None:
    """The load generator's CPU over every run in a result (found anywhere in the tree)."""
    found: list[dict[str, float]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if "loadgen_cpu" in x:
                found.append(x["loadgen_cpu"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(res)
    if not found:
        return None
    per_req = sorted(f["cpu_us_per_request"] for f in found)
    return {"max_core_share": max(f["core_share"] for f in found), "median_us_per_request": per_req[len(per_req) // 2]}


if __name__ == "__main__":
    # Re-render committed results after the report's format changed, without re-running them:
    # python -m benchmarks.report benchmarks/results/priority/bench-realsize [...]
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description="Re-render committed results' README.md.")
    p.add_argument("folders", nargs="+", help="results folders holding a result.json")
    for arg in p.parse_args().folders:
        saved = json.loads((Path(arg) / "result.json").read_text())
        print(write(saved["scenario"], saved, Path(arg)))
