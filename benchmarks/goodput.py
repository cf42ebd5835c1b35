"""`python -m benchmarks goodput`: open-loop overload, judged by the useful answers per second.

Arrivals are Poisson and keep their schedule whatever the server answers, as real users and
upstream services send them (a closed loop slows down with the server and hides collapse). Each
request has a client timeout; an answer after it counts as a timeout, never as goodput.

First the capacity: the goodput of `capacity_clients` closed-loop normal-priority clients on one
model (one replica). Then the unloaded high-priority latency: high priority alone, open loop, at
a tenth of capacity. Then every (mix, offered load) point, each on the same deployment, in turn:
- per class: answered share (200s over requests sent), p50/p99 of the 200s, refusals (503/429)
  with their own p50/p99 and whether each carried Retry-After, timeouts, other statuses;
- overall: goodput (200s/s) as a fraction of capacity, 5xx other than refusals, timeouts;
- the load generator's own CPU, so that it is known not to be the bottleneck, and the cores of
  every process role;
- the router's overload control after the point (its shed level and refusals by class).
Last, the capacity point again: on a machine whose speed drifts (a shared VM) the ratios of a run
whose second capacity differs from its first are read with that in mind.

On a tiered route (`--models text-classify`) the answers are scored against the inputs' true
labels, and `--degrade on off` runs every point on the route as configured and on a copy of it
that never degrades (`degrade: {priorities: []}`), in alternated rounds: goodput, accuracy, and
how many answers came degraded (X-Degraded) and how accurate they were.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks import workloads
from benchmarks.cluster import HTTP_PORT, Probe, RayCluster, run_loadgen
from benchmarks.flood import flood_config, shedding
from benchmarks.loadgen import pooled
from benchmarks.scenarios import DEFAULT_INGRESS

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
CLASSES = ("high", "normal", "low")
# Priority mixes (high/normal/low percent): none high, a trickle, the spike mix, mostly high.
MIXES: dict[str, tuple[int, int, int]] = {
    "no-high": (0, 30, 70),
    "trickle": (1, 99, 0),
    "10/30/60": (10, 30, 60),
    "mostly-high": (80, 15, 5),
}


@dataclass
class GoodputSettings:
    model: str = "resnet-heavy"
    loads: tuple[float, ...] = (0.5, 0.9, 1.5, 3.0)  # offered rate over measured capacity
    mixes: tuple[str, ...] = tuple(MIXES)
    seconds: float = 15.0
    warmup: float = 2.0
    timeout_s: float = 10.0  # the client's timeout per request
    capacity_clients: int = 32
    capacity_seconds: float = 10.0
    capacity_points: int = 3  # closed-loop runs; the capacity is their median
    # The rate the loads are multiples of, instead of this run's measured capacity (still measured
    # and reported): runs that compare two configs offer the same requests per second, however
    # fast the machine was when each measured its capacity.
    capacity_rps: float | None = None
    max_in_flight: int = 4096  # per class: far above what a server answering in time holds
    # On a route: "on" (the route as configured) and "off" (never degrades), each point run for
    # both, alternated, `rounds` times.
    degrade: tuple[str, ...] = ()
    rounds: int = 1

    @classmethod
    def smoke(cls) -> GoodputSettings:
        return cls(
            loads=(0.5, 2.0),
            mixes=("10/30/60",),
            seconds=3.0,
            warmup=1.0,
            capacity_seconds=3.0,
            capacity_clients=8,
            capacity_points=1,
        )


@dataclass
class Point:
    """One offered load with one mix: what each class and the whole got."""

    mix: str
    load: float
    offered_rps: float
    result: dict[str, Any] = field(default_factory=dict)
    degrade: str | None = None  # the arm on a route: "on" or "off"
    round: int = 0


STRICT_SUFFIX = "-no-degrade"


def target_dir(config: dict[str, Any], model_dir: Path, name: str) -> Path:
    """Where a model's inputs come from: its own directory, or a route's heavy tier's."""
    route = config["applications"][0]["args"].get("routes", {}).get(name)
    return model_dir / (route["heavy"] if route else name)


def with_strict_route(config: dict[str, Any], route: str) -> dict[str, Any]:
    """The config plus a copy of `route` that never degrades: the "off" arm, on the same tiers."""
    config = copy.deepcopy(config)
    routes = config["applications"][0]["args"]["routes"]
    routes[route + STRICT_SUFFIX] = {**routes[route], "degrade": {"priorities": []}}
    return config


def streams(model: str, inputs: Path, mix: tuple[int, int, int], scored: bool = False) -> list[workloads.StreamSpec]:
    return [
        workloads.v2_infer(model, inputs, name, weight=share, scored=scored)
        for name, share in zip(CLASSES, mix, strict=True)
        if share > 0
    ]


def per_class(stream: dict[str, Any]) -> dict[str, Any]:
    """One class's figures from the load generator's stream summary."""
    statuses: dict[str, int] = stream["statuses"]
    sent = stream["requests"] + stream.get("client_dropped", 0)
    ok = sum(n for code, n in statuses.items() if code.startswith("2"))
    refused = statuses.get("503", 0) + statuses.get("429", 0)
    return {
        "sent": sent,
        "answered_share": round(ok / sent, 4) if sent else None,
        "p50_ms": stream.get("p50_ms"),
        "p99_ms": stream.get("p99_ms"),
        "refused": refused,
        "refused_p50_ms": stream.get("refused_p50_ms"),
        "refused_p99_ms": stream.get("refused_p99_ms"),
        "refused_without_retry_after": stream.get("refused_without_retry_after", 0),
        "timeouts": stream.get("timeouts", 0),
        "client_dropped": stream.get("client_dropped", 0),
        "statuses": statuses,
        **({"scored": stream["scored"]} if "scored" in stream else {}),
    }


def summary(load: dict[str, Any], capacity_rps: float) -> dict[str, Any]:
    """The whole point: goodput over capacity, the failures that must not happen, the client's CPU."""
    statuses: dict[str, int] = load["statuses"]
    server_errors = sum(n for code, n in statuses.items() if code.startswith("5") and code != "503")
    return {
        "goodput_rps": load["goodput_rps"],
        "goodput_over_capacity": round(load["goodput_rps"] / capacity_rps, 3) if capacity_rps else None,
        "timeouts": load.get("timeouts", 0),
        "connection_errors": sum(n for code, n in statuses.items() if code.startswith("-")),
        "server_errors_5xx": server_errors,
        "refused_without_retry_after": load["refused_without_retry_after"],
        "refused_p99_ms": load.get("refused_p99_ms"),
        "loadgen_cpu": load.get("loadgen_cpu"),
        "cpu_cores_by_role": load.get("cpu_cores_by_role"),
        "classes": {name.rsplit("/", 1)[-1]: per_class(stream) for name, stream in load["streams"].items()},
        **({"scored": load["scored"]} if "scored" in load else {}),
    }


class QueueSampler:
    """The model's queue in the router while a point runs, read from /router/status twice a second:
    whether the model was kept busy (batches in flight against the limit while work was queued)
    and how the shedding level moved. Where goodput falls short, this says whether the model ran
    out of work or the work ran out of model."""

    def __init__(self, model: str, every_s: float = 0.5) -> None:
        self.model, self.every_s = model, every_s
        self.samples: list[dict[str, Any]] = []
        self.lanes: dict[str, Any] = {}  # each lane's learned batch times and recent latency split, last read
        # The queue's refusal counters (by reason, by class) at the point's start and at its end.
        self.counters: list[dict[str, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> QueueSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            self._count(self._read(client))
            while not self._stop.wait(self.every_s):
                if (model := self._read(client)) is None:
                    continue
                bulk = model["lanes"]["bulk"]
                self.lanes = {
                    name: {"batch_ms": lane["batch_ms"], "recent_ms": lane["recent_ms"]} for name, lane in model["lanes"].items()
                }
                self.samples.append({
                    "queued": sum(model["queued_items"].values()),
                    "inflight": bulk["inflight_batches"],
                    "limit": bulk["inflight_limit"],
                    "refused": sum(model["shed_by_priority"].values()),
                })  # fmt: skip
            self._count(self._read(client))

    def _read(self, client: httpx.Client) -> dict[str, Any] | None:
        try:
            model: dict[str, Any] = client.get(f"{BASE_URL}/router/status").json()["models"][self.model]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        return model

    def _count(self, model: dict[str, Any] | None) -> None:
        if model is not None:
            self.counters.append({"reason": model["shed"], "class": model["shed_by_priority"]})

    def summary(self) -> dict[str, Any]:
        n = len(self.samples)
        if not n:
            return {"samples": 0}
        queued = [x for x in self.samples if x["queued"]]
        limits = [x["limit"] for x in self.samples]
        return {
            "samples": n,
            "queued_share": round(len(queued) / n, 3),
            # Work waiting in the router while the lane had a free slot: the model was kept short of it.
            "idle_slot_share": round(sum(1 for x in queued if x["inflight"] < int(x["limit"])) / n, 3),
            "inflight_limit": {"min": min(limits), "median": statistics.median(limits)},
            "inflight_median": statistics.median(x["inflight"] for x in self.samples),
            "queued_median": statistics.median(x["queued"] for x in self.samples),
            # (queued rows, batches in flight, the limit, refusals so far) per sample
            "trace": [(x["queued"], x["inflight"], x["limit"], x["refused"]) for x in self.samples],
            "lanes": self.lanes,
            **refusals(self.counters),
        }


def refusals(counters: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """What the model's queue in the router refused during the point, from its counters read at the
    start and at the end: by reason (`queue_budget`, `queue_delay`, `queue_full`, `deadline` at
    admission; `evicted` for a higher class and `starved` after `max_queued_s`, both once queued;
    `expired` past a deadline) and by class. The router's own gates (its delay target, its
    requests in flight) count theirs in `router_delay_after`."""
    if len(counters) < 2:
        return {}
    first, last = counters[0], counters[-1]

    def delta(key: str) -> dict[str, int]:
        return {k: n - first[key].get(k, 0) for k, n in sorted(last[key].items()) if n > first[key].get(k, 0)}

    return {"refused_by_reason": delta("reason"), "refused_by_class": delta("class")}


def run(s: GoodputSettings, model_dir: Path, config_path: Path) -> dict[str, Any]:
    base = yaml.safe_load(config_path.read_text())
    config = flood_config(base, model_dir, s.model)
    is_route = s.model in config["applications"][0]["args"].get("routes", {})
    if s.degrade and not is_route:
        raise ValueError(f"--degrade compares a tiered route with and without degrading; {s.model} is not a route")
    if s.degrade:
        config = with_strict_route(config, s.model)
    arms = {"on": s.model, "off": s.model + STRICT_SUFFIX}
    inputs = target_dir(config, model_dir, s.model)
    out: dict[str, Any] = {"settings": asdict(s), "scheduling": config["applications"][0]["args"]["scheduling"]}
    points: list[Point] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with RayCluster(DEFAULT_INGRESS, tmp, model_dir) as cluster:
            body = workloads.bodies_for(inputs, 1)[0]
            out["deploy_s"] = round(cluster.deploy(config, Probe(f"/v2/models/{s.model}/infer", body)), 1)
            # A route's capacity is the strict copy's: its escalations all go to the heavy tier.
            measured = arms["off"] if s.degrade else s.model
            normal = workloads.write([workloads.v2_infer(measured, inputs, "normal", scored=is_route)], tmp / "normal.json")
            out["capacity"] = capacity_point(normal, s)
            capacity = s.capacity_rps or out["capacity"]["goodput_rps"]
            out["capacity_basis_rps"] = capacity
            high = workloads.write(streams(measured, inputs, (1, 0, 0)), tmp / "high.json")
            unloaded = run_loadgen(BASE_URL, high, {"rate": max(1.0, capacity / 10)}, s.seconds, s.warmup, timeout_s=s.timeout_s)
            out["unloaded_high"] = {"p50_ms": unloaded["p50_ms"], "p99_ms": unloaded["p99_ms"], "statuses": unloaded["statuses"]}
            for mix in s.mixes:
                for load in s.loads:
                    for rnd in range(s.rounds):
                        # Alternated: each round starts with the arm the last one ended with.
                        order: list[str | None] = list(s.degrade if rnd % 2 == 0 else reversed(s.degrade)) or [None]
                        for arm in order:
                            name = arms[arm] if arm else s.model
                            workload = workloads.write(streams(name, inputs, MIXES[mix], scored=is_route), tmp / "mix.json")
                            point = Point(mix, load, round(load * capacity, 1), degrade=arm, round=rnd)
                            with QueueSampler(name) as sampler:
                                got = run_loadgen(
                                    BASE_URL, workload, {"rate": point.offered_rps}, s.seconds, s.warmup,
                                    max_in_flight=s.max_in_flight, timeout_s=s.timeout_s,
                                )  # fmt: skip
                            point.result = {**summary(got, capacity), "router_delay_after": shedding(),
                                            "model_queue": sampler.summary()}  # fmt: skip
                            points.append(point)
                            label = f" degrade {arm} round {rnd + 1}" if arm else ""
                            print(
                                f"goodput {mix} at {load}x{label}: {point.result['goodput_over_capacity']}x of capacity",
                                flush=True,
                            )
            # The same point again, once the last point's queues have drained: a machine that got slower or
            # faster during the run shows here, and its ratios are read with that in mind.
            time.sleep(s.timeout_s)
            out["capacity_after"] = capacity_point(normal, s)
    out["points"] = [asdict(p) for p in points]
    out["checks"] = checks(out)
    if s.degrade:
        out["degrade"] = degrade_table(out["points"])
    return out


def capacity_point(workload: Path, s: GoodputSettings) -> dict[str, Any]:
    """Closed-loop normal-priority clients on the model, `capacity_points` times: its capacity is
    the median point (one point is one draw of the machine's noise, and every ratio divides by
    it), with every point's rate beside it. Its cores by role too: a point that answers less than
    capacity is read against them."""
    runs = [
        run_loadgen(BASE_URL, workload, {"concurrency": s.capacity_clients}, s.capacity_seconds, s.warmup)
        for _ in range(s.capacity_points)
    ]
    cap = median_run(runs)
    return {"goodput_rps": float(cap["goodput_rps"]), "p99_ms": cap["p99_ms"], "statuses": cap["statuses"],
            "points_rps": [float(r["goodput_rps"]) for r in runs],
            "cpu_cores_by_role": cap.get("cpu_cores_by_role"),
            **({"scored": cap["scored"]} if "scored" in cap else {})}  # fmt: skip


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose goodput is the median (the lower middle of an even count)."""
    ranked = sorted(runs, key=lambda r: float(r["goodput_rps"]))
    return ranked[(len(ranked) - 1) // 2]


def drift(out: dict[str, Any]) -> float | None:
    """The capacity measured after the points over the one before them (None in runs without it)."""
    before = (out.get("capacity") or {}).get("goodput_rps")
    after = (out.get("capacity_after") or {}).get("goodput_rps")
    return round(after / before, 3) if after is not None and before else None


def degrade_table(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mix, load): each arm's median goodput over capacity across rounds with its range,
    the on/off ratio of the medians, accuracy, and the degraded answers with their accuracy."""
    rows = []
    keys = sorted({(p["mix"], p["load"]) for p in points}, key=lambda k: (k[0], k[1]))
    for mix, load in keys:
        row: dict[str, Any] = {"mix": mix, "load": load}
        for arm in ("on", "off"):
            mine = [p["result"] for p in points if (p["mix"], p["load"], p["degrade"]) == (mix, load, arm)]
            if not mine:
                continue
            goodput = [r["goodput_over_capacity"] for r in mine]
            scored = [r.get("scored") or {} for r in mine]
            answers = sum(x.get("answers", 0) for x in scored)
            degraded = sum(x.get("degraded", 0) for x in scored)
            row[arm] = {
                "goodput_over_capacity": statistics.median(goodput),
                "range": [min(goodput), max(goodput)],
                "accuracy": pooled(scored, "accuracy", "answers"),
                "degraded_share": round(degraded / answers, 4) if answers else None,
                "degraded_accuracy": pooled(scored, "degraded_accuracy", "degraded"),
                "unmarked_accuracy": pooled(scored, "unmarked_accuracy", None),
                "timeouts": sum(r["timeouts"] for r in mine),
                "server_errors_5xx": sum(r["server_errors_5xx"] for r in mine),
            }
        if "on" in row and "off" in row and row["off"]["goodput_over_capacity"]:
            row["on_over_off"] = round(row["on"]["goodput_over_capacity"] / row["off"]["goodput_over_capacity"], 3)
        rows.append(row)
    return rows


def checks(out: dict[str, Any]) -> dict[str, Any]:
    """The acceptance figures, computed from this run's points."""
    unloaded_p99 = out["unloaded_high"]["p99_ms"]

    def over_unloaded(p99: float | None) -> float | None:
        return round(p99 / unloaded_p99, 2) if p99 and unloaded_p99 else None

    below, over = [], []
    for p in out["points"]:
        r, classes = p["result"], p["result"]["classes"]
        if p["load"] <= 0.9:
            below.append(
                {"mix": p["mix"], "load": p["load"], "min_answered_share": min(c["answered_share"] for c in classes.values())}
            )
        elif p["mix"] == "10/30/60":
            high = classes.get("high", {})
            over.append(
                {
                    "load": p["load"],
                    "goodput_over_capacity": r["goodput_over_capacity"],
                    "high_answered_share": high.get("answered_share"),
                    "high_p99_over_unloaded": round(high["p99_ms"] / unloaded_p99, 2)
                    if high.get("p99_ms") and unloaded_p99
                    else None,
                    "normal_at_least_low": classes["normal"]["answered_share"] >= classes["low"]["answered_share"],
                    "timeouts": r["timeouts"],
                    "server_errors_5xx": r["server_errors_5xx"],
                    "refused_without_retry_after": r["refused_without_retry_after"],
                    "refused_p99_ms": r["refused_p99_ms"],
                }
            )
    return {"capacity_after_over_before": drift(out), "at_or_below_0.9x": below, "over_capacity_10_30_60": over}


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    s = r["settings"]
    rows = []
    for p in r["points"]:
        x = p["result"]
        cells = []
        for name in CLASSES:
            c = x["classes"].get(name)
            cells.append(
                "-"
                if c is None
                else f"{c['answered_share'] * 100:.1f}% · {c['p50_ms']}/{c['p99_ms']} · {c['refused']} "
                f"({c['refused_p99_ms']}) · {c['timeouts']}"
            )
        cpu = (x.get("loadgen_cpu") or {}).get("core_share")
        arm = f" (degrade {p['degrade']}, round {p['round'] + 1})" if p.get("degrade") else ""
        rows.append(
            f"| {p['mix']}{arm} | {p['load']}x | {p['offered_rps']} | **{x['goodput_over_capacity']}x** | {' | '.join(cells)} "
            f"| {x['timeouts']} | {x['server_errors_5xx']} | {cpu} |"
        )
    u = r["unloaded_high"]
    given = s.get("capacity_rps")
    basis = f"; loads and goodput are over {given} req/s, given with --capacity-rps" if given else ""
    if (after := r.get("capacity_after")) is not None:
        basis += f"; measured again after the points: {after['goodput_rps']} req/s ({drift(r)} of the first)"
    return "\n".join(
        [
            f"`{s['model']}` (one replica), open loop (Poisson), {s['seconds']:.0f} s per point, client timeout "
            f"{s['timeout_s']:.0f} s. Capacity: {r['capacity']['goodput_rps']} req/s ({s['capacity_clients']} closed-loop "
            f"normal clients){basis}. Unloaded high priority (alone at a tenth of capacity): p50 {u['p50_ms']} ms, "
            f"p99 {u['p99_ms']} ms. Router scheduling: `{r['scheduling']}`.",
            "",
            "Per class: answered 200 · p50/p99 ms of the 200s · refused (refusal p99 ms) · timeouts.",
            "",
            "| mix h/n/l | offered | req/s | goodput / capacity | high | normal | low | timeouts | other 5xx "
            "| load generator cores |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Checks: `{r['checks']}`",
            "",
            *refusals_markdown(r["points"]),
            *degrade_markdown(r.get("degrade")),
        ]
    )


def refusals_markdown(points: list[dict[str, Any]]) -> list[str]:
    """Each point's refusals by the model's queue in the router, by reason and by class."""
    lines = []
    for p in points:
        q = p["result"].get("model_queue", {})
        if q.get("refused_by_reason"):
            reasons = ", ".join(f"{k} {n}" for k, n in q["refused_by_reason"].items())
            classes = ", ".join(f"{k} {n}" for k, n in q["refused_by_class"].items())
            lines.append(f"| {p['mix']} | {p['load']}x | {reasons} | {classes} |")
    if not lines:
        return []
    head = ["The model's queue in the router refused, by reason and by class:", "",
            "| mix | load | by reason | by class |", "|---|---|---|---|"]  # fmt: skip
    return [*head, *lines, ""]


def degrade_markdown(rows: list[dict[str, Any]] | None) -> list[str]:
    if not rows:
        return []

    def arm(a: dict[str, Any] | None) -> str:
        if a is None:
            return "- | - | - | -"
        lo, hi = a["range"]
        return (
            f"{a['goodput_over_capacity']}x ({lo}-{hi}) | {a['accuracy']} | {a['degraded_share']} "
            f"| {a['degraded_accuracy']} / {a['unmarked_accuracy']}"
        )

    return [
        "Degrading before refusing, on the route and on its copy that never degrades, median of the alternated "
        "rounds (range): goodput over capacity, accuracy of every 200 against the true labels, the share of 200s "
        "marked X-Degraded, the accuracy of the marked / unmarked 200s.",
        "",
        "| mix | load | on: goodput | accuracy | degraded share | marked / unmarked accuracy "
        "| off: goodput | accuracy | degraded share | marked / unmarked accuracy | on / off |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {r['mix']} | {r['load']}x | {arm(r.get('on'))} | {arm(r.get('off'))} | {r.get('on_over_off')} |" for r in rows),
        "",
    ]
