"""Soak: the whole app at several times its capacity for minutes, with mixed models and priorities.

What must hold, and is measured here:
- every answer is 200, or a refusal (429/503) that carries Retry-After: never another
  5xx, a timeout or a reset;
- the resident memory of every process (router, each model replica, proxy, controller)
  is flat after warm-up: the slope of a least-squares line through its samples, as a
  share of its mean per minute;
- nothing in the router grows per request: its asyncio task count and queued items,
  sampled from /router/status, stay bounded.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from benchmarks import haproxy_stats, workloads
from benchmarks.cluster import HTTP_PORT, Probe, RayCluster, process_label, run_loadgen
from benchmarks.scenarios import DEFAULT_INGRESS, single_versions

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"


@dataclass
class SoakSettings:
    seconds: float = 600.0
    warmup_s: float = 120.0  # excluded from the memory slope: caches, arenas and pools fill first
    overload: float = 3.0  # offered rate, as a multiple of the measured capacity
    sample_every_s: float = 10.0
    capacity_seconds: float = 10.0

    @classmethod
    def smoke(cls) -> SoakSettings:
        return cls(seconds=5.0, warmup_s=1.0, sample_every_s=1.0, capacity_seconds=2.0)


def mixed_streams(model_dir: Path) -> list[workloads.StreamSpec]:
    """Every model family and route, at every priority."""
    return [
        workloads.v2_infer("bert-heavy", model_dir / "bert-heavy", "high", weight=0.1),
        workloads.v2_infer("resnet-heavy", model_dir / "resnet-heavy", "normal", weight=0.25),
        workloads.v2_infer("text-classify", model_dir / "bert-light", "low", weight=0.25),
        workloads.v2_infer("image-classify", model_dir / "resnet-light", "low", weight=0.3),
        workloads.StreamSpec("gpt/normal", "/v1/completions", [{"model": "gpt", "prompt": "the", "max_tokens": 8}], weight=0.1),
    ]


def slope_pct_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) samples, in percent of their mean per minute."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0 or mv == 0:
        return None
    slope = sum((t - mt) * (v - mv) for t, v in samples) / var
    return round(slope * 60 / mv * 100, 3)


class Sampler(threading.Thread):
    """Every `every_s`: RSS of each process by role, and the router's task count and queued items."""

    def __init__(self, every_s: float) -> None:
        super().__init__(daemon=True)
        self.every_s = every_s
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.rss: dict[str, list[tuple[float, float]]] = {}
        self.router: list[dict[str, Any]] = []
        self.haproxy: list[list[dict[str, str]]] = []
        self.haproxy_info: list[dict[str, float]] = []  # with the time of each sample, `t`

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            t = time.monotonic() - self.started
            for p in psutil.process_iter():
                role = process_label(p)
                if role is None or role in ("loadgen", "ray-idle-worker"):
                    continue
                with contextlib.suppress(psutil.Error):
                    self.rss.setdefault(f"{role}#{p.pid}", []).append((t, p.memory_info().rss / 2**20))
            self.haproxy.append(haproxy_stats.servers())
            if found := haproxy_stats.info():
                self.haproxy_info.append({"t": round(t, 1), **found})
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                # Bounded by the sampling period: a router slow to answer under the overload must not
                # thin out the memory samples taken in the same loop.
                status = httpx.get(f"{BASE_URL}/router/status", timeout=max(2.0, self.every_s)).json()
                queued = sum(sum(m["queued_items"].values()) for m in status["models"].values())
                delay = (status.get("router_delay") or {}).get("lag_ms")
                self.router.append({"t": round(t, 1), "tasks": status["tasks"], "queued_items": queued, "lag_ms": delay})


def run(s: SoakSettings, model_dir: Path, config_path: Path) -> dict[str, Any]:
    config = single_versions(yaml.safe_load(config_path.read_text()))
    app = config["applications"][0]
    app["args"]["model_dir"] = str(model_dir)
    app["args"].setdefault("scheduling", {})["anonymous_max_priority"] = "high"  # the load asks for high
    out: dict[str, Any] = {"settings": asdict(s)}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with RayCluster(DEFAULT_INGRESS, tmp, model_dir) as cluster:
            probe = Probe("/v2/models/bert-heavy/infer", workloads.text_bodies(1)[0])
            out["deploy_s"] = round(cluster.deploy(config, probe), 1)
            workload = workloads.write(mixed_streams(model_dir), tmp / "soak.json")
            capacity = run_loadgen(BASE_URL, workload, {"concurrency": 32}, s.capacity_seconds, 2.0)
            out["capacity_rps"] = capacity["goodput_rps"]
            rate = max(1.0, s.overload * capacity["goodput_rps"])
            sampler = Sampler(s.sample_every_s)
            sampler.start()
            load = run_loadgen(BASE_URL, workload, {"rate": rate}, s.seconds, 2.0, max_in_flight=256, raw=True)
            sampler.stop.set()
            sampler.join()
    out["offered_rps"] = round(rate, 1)
    kept = ("requests", "statuses", "goodput_rps", "p50_ms", "p99_ms", "client_dropped", "stale_connection_retries")
    out["load"] = {k: load[k] for k in kept}
    out["load"]["refused_without_retry_after"] = load["refused_without_retry_after"]
    out["load"]["streams"] = {k: {"statuses": v["statuses"], "p99_ms": v["p99_ms"]} for k, v in load["streams"].items()}
    out["unexpected_statuses"] = {k: v for k, v in load["statuses"].items() if k not in ("200", "429", "503")}
    records = load.pop("records")
    out["unexpected_by_minute"] = unexpected_by_minute(records)
    out["goodput_by_minute"] = goodput_by_minute(records, out["capacity_rps"])
    out["memory"] = memory_report(sampler.rss, s.warmup_s)
    out["rss_series_mb"] = {k: [[round(t), round(v, 1)] for t, v in samples] for k, samples in sorted(sampler.rss.items())}
    out["router_samples"] = sampler.router
    out["haproxy_servers"] = haproxy_stats.summary(sampler.haproxy)
    out["haproxy_info"] = sampler.haproxy_info
    return out


def unexpected_by_minute(records: list[list[Any]]) -> dict[str, dict[str, int]]:
    """Answers other than 200/429/503, by minute of the run they were sent in and by stream."""
    out: dict[str, dict[str, int]] = {}
    for stream, sent, _lat, status, *_ in records:
        if status not in (200, 429, 503):
            key = f"{int(sent // 60)}:{stream}:{status}"
            minute, _, rest = key.partition(":")
            out.setdefault(minute, {})[rest] = out.get(minute, {}).get(rest, 0) + 1
    return out


def goodput_by_minute(records: list[list[Any]], capacity_rps: float) -> list[dict[str, Any]]:
    """Per minute of the run (by when each request was sent): 200s per second and that over capacity,
    timeouts (status 0) and connection errors: whether the server kept giving useful answers."""
    minutes: dict[int, list[int]] = {}
    for _stream, sent, _lat, status, *_ in records:
        counts = minutes.setdefault(int(sent // 60), [0, 0, 0, 0])  # sent, 200, timeouts, connection errors
        counts[0] += 1
        counts[1] += status == 200
        counts[2] += status == 0
        counts[3] += status < 0
    return [
        {
            "minute": m,
            "sent": c[0],
            "goodput_rps": round(c[1] / 60, 1),
            "goodput_over_capacity": round(c[1] / 60 / capacity_rps, 3) if capacity_rps else None,
            "timeouts": c[2],
            "connection_errors": c[3],
        }
        for m, c in sorted(minutes.items())
    ]


def memory_report(rss: dict[str, list[tuple[float, float]]], warmup_s: float) -> dict[str, Any]:
    """Per process: RSS at the end of warm-up and at the end, and the slope after warm-up."""
    report = {}
    for key, samples in sorted(rss.items()):
        after = [(t, v) for t, v in samples if t >= warmup_s]
        if len(after) < 3:
            continue
        # The last half too: a process whose memory climbs to a plateau after warm-up (a router
        # filling with in-flight requests) shows a slope over the whole that its last half does not.
        half = [(t, v) for t, v in samples if t >= samples[-1][0] / 2]
        report[key] = {"rss_mb_start": round(after[0][1], 1), "rss_mb_end": round(after[-1][1], 1),
                       "slope_pct_per_min": slope_pct_per_min(after),
                       "last_half_slope_pct_per_min": slope_pct_per_min(half)}  # fmt: skip
    return report


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    load = r["load"]
    lines = [
        f"Capacity (closed loop, 32 clients, mixed): {r['capacity_rps']} req/s; offered {r['offered_rps']} req/s "
        f"({r['settings']['overload']:.0f}x) open loop for {r['settings']['seconds']:.0f} s.",
        "",
        f"Answers: {load['statuses']}; refused without Retry-After: {load['refused_without_retry_after']}; "
        f"other statuses: {r['unexpected_statuses'] or 'none'}; client-side drops (in-flight cap): {load['client_dropped']}; "
        f"sent again on a new connection after the old one closed under it: {load.get('stale_connection_retries', '-')}.",
        "",
        "Goodput by minute (by when each request was sent; the last minute may be partial): "
        + ", ".join(
            f"{m['minute']}: {m['goodput_over_capacity']}x ({m['timeouts']} timeouts)" for m in r.get("goodput_by_minute", [])
        ),
        "",
        f"Memory after the first {r['settings']['warmup_s']:.0f} s (least-squares slope, % of mean per minute):",
        "",
        "| process | RSS MiB after warm-up | at the end | slope %/min | slope over the last half %/min |",
        "|---|---|---|---|---|",
    ]
    for key, m in r["memory"].items():
        lines.append(
            f"| {key} | {m['rss_mb_start']} | {m['rss_mb_end']} | {m['slope_pct_per_min']} "
            f"| {m.get('last_half_slope_pct_per_min', '-')} |"
        )
    if r.get("haproxy_servers"):
        lines += ["", "HAProxy's servers, sampled with the memory (`show stat`; the backup is Serve's Python proxy):", "",
                  "| server | backup | samples not UP | transitions to DOWN | observed failures | requests | last check |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, h in r["haproxy_servers"].items():
            lines.append(f"| {name} | {h['backup']} | {h['not_up']} of {h['samples']} | {h['chkdown']} | {h['hanafail']} "
                         f"| {h['requests']} | {h['last_check']} |")  # fmt: skip
    pools = r.get("haproxy_info") or []
    if pools:
        peak = max(pools, key=lambda x: x.get("PoolAlloc_bytes", 0))
        mib = 2**20
        lines += ["", f"HAProxy's pools (`show info`, {len(pools)} samples): allocated "
                  f"{pools[0].get('PoolAlloc_bytes', 0) / mib:.1f} MiB at the first sample, "
                  f"{peak.get('PoolAlloc_bytes', 0) / mib:.1f} at most (at {peak['t']:.0f} s, "
                  f"{peak.get('CurrConns', '-')} connections open), {pools[-1].get('PoolAlloc_bytes', 0) / mib:.1f} at the last; "
                  f"in use at most {max(x.get('PoolUsed_bytes', 0) for x in pools) / mib:.1f} MiB; "
                  f"connections open at most {max(x.get('CurrConns', 0) for x in pools)}."]  # fmt: skip
    tasks = [x["tasks"] for x in r["router_samples"]]
    if tasks:
        lines += ["", f"Router asyncio tasks over the run (one replica per sample): min {min(tasks)}, max {max(tasks)}."]
        lags = [x["lag_ms"] for x in r["router_samples"] if x.get("lag_ms") is not None]
        if lags:
            lines[-1] += f" Its event loop's lateness (EWMA): median {sorted(lags)[len(lags) // 2]} ms, max {max(lags)} ms."
    return "\n".join(lines)
