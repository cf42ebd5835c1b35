"""`python -m benchmarks simulate`: the router's scheduling policy alone, open loop, on a virtual clock.

The goodput scenario measures the whole app on this machine, where the load generator, HAProxy and
the router take cores from the model, and where a shared VM's speed drifts. This one measures what
the policy itself does with the same offered loads and mixes: the router's real `Dispatcher`, with
the settings the config gives the model (`dispatch_settings`), sends its batches to the replica's
real `BatchExecutor`, whose sessions run a batch of n rows in `batch_base_ms + n * batch_row_ms`
divided by a speed that moves each second within `1 +- drift` (a model whose share of the cores
changes). Time is virtual (`benchmarks.virtual_time`): no Ray, no model, no wall time spent
waiting, and the same seed gives the same run, so a change to the policy is judged on the same
arrivals. Each mix runs its loads in turn on one dispatcher, as the goodput scenario does, with
`gap_s` idle between them, for each of `seeds` seeds.

What it leaves out: the CPU the router, the proxy and the clients take (the goodput scenario's
subject), and a session of the urgent lane's own (`urgent_session: true`), which runs here beside
the bulk sessions as if it had a core of its own.
"""

from __future__ import annotations

import asyncio
import contextvars
import statistics
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks.goodput import CLASSES, MIXES
from benchmarks.virtual_time import VirtualTimeLoop
from serve_app.config import AppArgs
from serve_app.contract import URGENT, BatchReply, Priority
from serve_app.errors import Overloaded
from serve_app.models.executor import BatchExecutor
from serve_app.router.routing.dispatchers import dispatch_settings
from serve_app.scheduling.dispatcher import Dispatcher, DispatchSettings

LATE_MS = 50.0  # a refusal slower than this came after waiting (the bound on refusal p99)


@dataclass
class SimulateSettings:
    model: str = "resnet-heavy"
    loads: tuple[float, ...] = (0.5, 0.9, 1.5, 3.0)  # offered rate over the simulated model's capacity
    mixes: tuple[str, ...] = tuple(MIXES)
    seconds: float = 15.0
    warmup: float = 2.0  # the first seconds of each point: sent, not counted
    gap_s: float = 3.0
    seeds: int = 3
    timeout_s: float = 10.0  # the client's timeout per request
    # A batch's time on one session: the line through the demo resnet-heavy's batch times under load
    # on a 2-core VM (benchmarks/results/simulate/README.md).
    batch_base_ms: float = 3.6
    batch_row_ms: float = 3.07
    drift: float = 0.3  # the sessions' speed: a rate factor drawn in [1 - drift, 1 + drift] each second

    @classmethod
    def smoke(cls) -> SimulateSettings:
        return cls(loads=(0.5, 3.0), mixes=("10/30/60",), seconds=3.0, warmup=1.0, gap_s=1.0, seeds=1)


@dataclass
class Outcome:
    priority: Priority
    status: str  # "ok", "refused" (Overloaded), "timeout", or the error's class name
    sent: float  # seconds into the point
    seconds: float


class VirtualSessions(Executor):
    """The replica's thread pool on the virtual clock: a batch function runs at once and its result
    comes `cost(rows)` later, divided by the speed of that second. The speeds are the seed's, second
    by second, whatever the policy does: two versions of it meet the same speeds as the same arrivals."""

    def __init__(self, s: SimulateSettings, seed: int) -> None:
        self.s, self.rng = s, np.random.default_rng(seed)
        self.speeds: list[float] = []

    def _speed(self, now: float) -> float:
        while len(self.speeds) <= int(now):
            self.speeds.append(float(self.rng.uniform(1 - self.s.drift, 1 + self.s.drift)))
        return self.speeds[int(now)]

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        loop = asyncio.get_running_loop()
        done: Future[Any] = Future()
        done.set_running_or_notify_cancel()  # as a thread pool's: running, no longer cancellable
        result = fn(*args, **kwargs)
        rows = len(args[0])
        seconds = (self.s.batch_base_ms + rows * self.s.batch_row_ms) / 1e3 / self._speed(loop.time())
        loop.call_later(seconds, done.set_result, result)
        return done


def replica(app: AppArgs, s: SimulateSettings, seed: int, max_batch_size: int) -> Callable[..., Any]:
    """The model replica's side of a batch call (serve_app.models.classifier), on virtual sessions."""
    config = app.deployment_config(s.model)
    sessions = VirtualSessions(s, seed)
    clock = asyncio.get_running_loop().time

    def run(payloads: list[Any]) -> list[Any]:
        return list(payloads)

    bulk = BatchExecutor([run] * (config.advanced.bulk_sessions or 1), max_batch_size, sessions, clock=clock)
    own = (
        BatchExecutor(run, max_batch_size, sessions, clock=clock)
        if config.advanced.urgent_lane and config.advanced.urgent_session
        else None
    )

    async def send(payloads: list[Any], queued: int, lane: str = "bulk", traces: list[str | None] | None = None) -> BatchReply:
        urgent = lane == URGENT
        executor = own if urgent and own is not None else bulk
        results, wait_s, exec_s = await executor.submit(payloads, len(payloads), urgent=urgent and own is None)
        return BatchReply(results, wait_s=wait_s, exec_s=exec_s)

    return send


def capacity_rps(app: AppArgs, s: SimulateSettings, max_batch_size: int) -> float:
    """Rows per second the bulk sessions complete in full batches at speed 1 (the speeds' mean)."""
    sessions = app.deployment_config(s.model).advanced.bulk_sessions or 1
    return sessions * max_batch_size / ((s.batch_base_ms + max_batch_size * s.batch_row_ms) / 1e3)


async def request(d: Dispatcher, priority: Priority, timeout_s: float, opened: float) -> Outcome:
    """One client's request to the dispatcher, as the load generator sees it."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        await asyncio.wait_for(d.submit(None, 1, priority), timeout_s)
        status = "ok"
    except Overloaded:
        status = "refused"
    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
        status = "timeout"
    except Exception as e:  # any other answer: counted, never goodput
        status = type(e).__name__
    return Outcome(priority, status, started - opened, loop.time() - started)


async def run_mix(
    app: AppArgs, settings: DispatchSettings, s: SimulateSettings, capacity: float, mix: str, seed: int
) -> list[list[Outcome]]:
    """Each load of `s` in turn on one dispatcher: every request's outcome, per load."""
    loop = asyncio.get_running_loop()
    d = Dispatcher(s.model, replica(app, s, seed + 1, settings.max_batch_size), settings, clock=loop.time)
    rng = np.random.default_rng(seed)
    classes = [Priority[name.upper()] for name in CLASSES]
    shares = np.array(MIXES[mix], dtype=float) / sum(MIXES[mix])
    points = []
    for load in s.loads:
        opened, tasks = loop.time(), []
        while loop.time() < opened + s.seconds:
            await asyncio.sleep(rng.exponential(1 / (load * capacity)))
            priority = classes[rng.choice(len(classes), p=shares)]
            tasks.append(loop.create_task(request(d, priority, s.timeout_s, opened), context=contextvars.Context()))
        points.append(list(await asyncio.gather(*tasks)))
        await asyncio.sleep(s.gap_s)
    return points


def summary(outcomes: list[Outcome], s: SimulateSettings, capacity: float) -> dict[str, Any]:
    """One point after its warm-up: goodput (answers that came within the point, per second) over
    capacity, refusals and their latency, timeouts, each class's share of what it sent."""

    def ms(values: list[float], q: float) -> float | None:
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 1) if ordered else None

    window = s.seconds - s.warmup
    answered_in_window = sum(o.status == "ok" and s.warmup <= o.sent + o.seconds <= s.seconds for o in outcomes)
    outcomes = [o for o in outcomes if o.sent >= s.warmup]
    refused = [o.seconds for o in outcomes if o.status == "refused"]
    classes = {}
    for p in Priority:
        mine = [o for o in outcomes if o.priority == p]
        if mine:
            answered = [o.seconds for o in mine if o.status == "ok"]
            classes[p.name.lower()] = {"sent": len(mine), "answered_share": round(len(answered) / len(mine), 4),
                                       "p50_ms": ms(answered, 0.5), "p99_ms": ms(answered, 0.99)}  # fmt: skip
    return {
        "goodput_over_capacity": round(answered_in_window / window / capacity, 3),
        "refused": len(refused),
        "refused_late": sum(x * 1e3 > LATE_MS for x in refused),
        "refused_p99_ms": ms(refused, 0.99),
        "timeouts": sum(o.status == "timeout" for o in outcomes),
        "other_errors": sum(o.status not in ("ok", "refused", "timeout") for o in outcomes),
        "classes": classes,
    }


def run(s: SimulateSettings, model_dir: Path, config_path: Path) -> dict[str, Any]:
    args = yaml.safe_load(config_path.read_text())["applications"][0]["args"]
    app = AppArgs.model_validate({**args, "model_dir": str(model_dir)})
    settings = dispatch_settings(app, s.model)
    capacity = capacity_rps(app, s, settings.max_batch_size)
    points: list[dict[str, Any]] = []
    for mix in s.mixes:
        for seed in range(s.seeds):
            loop = VirtualTimeLoop()
            try:
                runs = loop.run_until_complete(run_mix(app, settings, s, capacity, mix, seed))
            finally:
                loop.close()
            for load, outcomes in zip(s.loads, runs, strict=True):
                points.append({"mix": mix, "load": load, "seed": seed, "result": summary(outcomes, s, capacity)})
    return {"settings": asdict(s), "dispatch": asdict(settings), "capacity_rps": round(capacity, 1),
            "points": points, "table": table(points)}  # fmt: skip


def table(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mix, load), over the seeds: the median and range of goodput, the least-answered class's
    share at its lowest, refusals after waiting, the worst refusal p99, timeouts."""
    rows = []
    for mix, load in dict.fromkeys((p["mix"], p["load"]) for p in points):
        mine = [p["result"] for p in points if (p["mix"], p["load"]) == (mix, load)]
        goodput = [r["goodput_over_capacity"] for r in mine]
        p99s = [r["refused_p99_ms"] for r in mine if r["refused_p99_ms"] is not None]
        least = min((c["answered_share"], name) for r in mine for name, c in r["classes"].items())
        high = [r["classes"]["high"]["p99_ms"] for r in mine if r["classes"].get("high", {}).get("p99_ms") is not None]
        rows.append({
            "mix": mix, "load": load, "goodput_median": statistics.median(goodput), "goodput_range": [min(goodput), max(goodput)],
            "least_answered": {"class": least[1], "share": least[0]},
            "high_p99_ms_max": max(high) if high else None,
            "refused_late": [r["refused_late"] for r in mine], "refused_p99_ms_max": max(p99s) if p99s else None,
            "timeouts": sum(r["timeouts"] for r in mine), "other_errors": sum(r["other_errors"] for r in mine),
        })  # fmt: skip
    return rows


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    s = r["settings"]
    lines = [
        f"`{s['model']}`'s scheduling settings from the config, simulated (see `benchmarks/simulate.py`): "
        f"{s['seeds']} seeds, {s['seconds']:.0f} s per point ({s['warmup']:.0f} s of warm-up), client timeout "
        f"{s['timeout_s']:.0f} s; a batch of n rows takes {s['batch_base_ms']} + n x {s['batch_row_ms']} ms over "
        f"a speed drawn within 1 +- {s['drift']} each second; capacity {r['capacity_rps']} rows/s (full batches at "
        "speed 1). No CPU for the router, proxy or clients: the policy alone.",
        "",
        "| mix | load | goodput / capacity: median (range) | least-answered class (lowest share) | high p99 ms (worst) "
        "| refused after waiting (each seed) | refusal p99 ms (worst) | timeouts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["table"]:
        lo, hi = row["goodput_range"]
        least = row["least_answered"]
        lines.append(
            f"| {row['mix']} | {row['load']}x | {row['goodput_median']} ({lo}-{hi}) | {least['class']} "
            f"{least['share'] * 100:.1f}% | {row['high_p99_ms_max']} | {', '.join(map(str, row['refused_late']))} "
            f"| {row['refused_p99_ms_max']} | {row['timeouts']} |"
        )
    return "\n".join(lines)
