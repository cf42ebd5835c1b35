"""The router's Prometheus metrics, exported through Ray Serve's metrics API.

Recording a Ray metric costs enough to show up in the router's profile
(benchmarks/results/profile/), so the request path only bumps plain counters;
a background loop turns them into Ray metrics every `interval_s`. That loop
shares the event loop with requests, so it yields between series. The two
per-request histograms (latency, queue wait) are binned here and exported as
their bucket series (`serve_app/observability/histograms.py`): a Ray histogram
would cost Ray's metrics agent work for every request.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from ray.serve import metrics

from serve_app.observability.histograms import GaugeHistogram
from serve_app.observability.histograms import tag_keys as tags
from serve_app.scheduling.dispatcher import Dispatcher

QUEUE_WAIT_MS_BOUNDARIES = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0]


class RouterTelemetry:
    interval_s = 2.0

    def __init__(self) -> None:
        self.queue_depth = metrics.Gauge(
            "serve_app_queue_depth",
            description="Rows queued in the router per model and priority.",
            tag_keys=tags("model", "priority"),
        )
        self.inflight_limit = metrics.Gauge(
            "serve_app_inflight_limit",
            description="Batches the router may have in flight per model and lane (learned).",
            tag_keys=tags("model", "lane"),
        )
        self.drain_rate = metrics.Gauge(
            "serve_app_drain_rows_per_s",
            description="Rows per second a model's lane completed while saturated (learned; 0 before its first "
            "saturated window): what admission divides the queue by.",
            tag_keys=tags("model", "lane"),
        )
        self.admitted = metrics.Counter(
            "serve_app_admitted", description="Requests admitted to a model's queue.", tag_keys=tags("model", "priority")
        )
        self.shed = metrics.Counter(
            "serve_app_shed",
            description="Requests refused or dropped, by reason: deadline, queue_budget, queue_delay, "
            "queue_full, evicted, expired, starved, breaker_open, rate_limited.",
            tag_keys=tags("model", "reason"),
        )
        self.shed_priority = metrics.Counter(
            "serve_app_shed_by_priority",
            description="The requests serve_app_shed counts, by the priority they asked for.",
            tag_keys=tags("model", "priority"),
        )
        self.latency = GaugeHistogram(
            "serve_app_request_latency_ms",
            "Time from a request's admission to its model's answer, per model and priority",
            QUEUE_WAIT_MS_BOUNDARIES,
            ("model", "priority"),
        )
        self.queue_wait = GaugeHistogram(
            "serve_app_queue_wait_ms",
            "Time a request waited in the router before its batch was sent",
            QUEUE_WAIT_MS_BOUNDARIES,
            ("model",),
        )
        self.cascade = metrics.Counter(
            "serve_app_cascade_items",
            description="Rows per route by who answered: light, heavy, degraded (light, heavy unavailable), or fallback "
            "(heavy, light unavailable).",
            tag_keys=tags("route", "outcome"),
        )
        self.breaker_state = metrics.Gauge(
            "serve_app_breaker_state",
            description="Circuit breaker per model: 0 closed, 1 half-open, 2 open.",
            tag_keys=("model",),
        )
        self._sent: dict[str, Counter[str]] = {}

    def _delta(self, key: str, now: Counter[str]) -> dict[str, int]:
        before = self._sent.setdefault(key, Counter())
        delta = {k: v - before[k] for k, v in now.items() if v > before[k]}
        self._sent[key] = Counter(now)
        return delta

    async def export(
        self, dispatchers: dict[str, Dispatcher], cascade: Counter[tuple[str, str]], breakers: dict[str, int]
    ) -> None:
        for model, d in list(dispatchers.items()):  # a model's first request may add one while this yields
            for p, n in d.items_by_priority().items():
                self.queue_depth.set(n, tags={"model": model, "priority": p.name.lower()})
            for lane in d.lanes:
                self.inflight_limit.set(lane.limit.value, tags={"model": model, "lane": lane.name})
                self.drain_rate.set(lane.drain.rate, tags={"model": model, "lane": lane.name})
            for priority, n in self._delta(f"admitted/{model}", d.stats.admitted).items():
                self.admitted.inc(n, tags={"model": model, "priority": priority})
            for reason, n in self._delta(f"shed/{model}", d.stats.shed).items():
                self.shed.inc(n, tags={"model": model, "reason": reason})
            for priority, n in self._delta(f"shed_priority/{model}", d.stats.shed_priority).items():
                self.shed_priority.inc(n, tags={"model": model, "priority": priority})
            waits, d.stats.queue_wait_s = d.stats.queue_wait_s, []
            self.queue_wait.add({"model": model}, (w * 1000 for w in waits))
            latencies, d.stats.latency_s = d.stats.latency_s, []
            by_priority: dict[str, list[float]] = {}
            for priority, seconds in latencies:
                by_priority.setdefault(priority, []).append(seconds * 1000)
            for priority, ms in by_priority.items():
                self.latency.add({"model": model, "priority": priority}, ms)
            await asyncio.sleep(0)
        await self.queue_wait.export()
        await self.latency.export()
        flat = Counter({f"{route}\0{outcome}": n for (route, outcome), n in cascade.items()})
        for key, n in self._delta("cascade", flat).items():
            route, outcome = key.split("\0")
            self.cascade.inc(n, tags={"route": route, "outcome": outcome})
        for model, state in breakers.items():
            self.breaker_state.set(state, tags={"model": model})
