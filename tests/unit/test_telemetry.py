"""The metrics export shares the router's event loop with requests: it must yield while it
exports a flood's queue waits, and must count every one of them."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from serve_app.contract import BatchReply
from serve_app.router.telemetry import RouterTelemetry
from serve_app.scheduling.dispatcher import Dispatcher


class FakeGauge:
    def __init__(self) -> None:
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[tuple(sorted((tags or {}).items()))] = value


async def _noop(payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
    return BatchReply([None] * len(payloads), 0.0, 0.0)


def test_queue_waits_are_all_counted_and_the_export_yields_to_the_loop() -> None:
    async def scenario() -> tuple[RouterTelemetry, int]:
        telemetry = RouterTelemetry()
        gauges = [FakeGauge(), FakeGauge(), FakeGauge()]
        telemetry.queue_wait.bucket, telemetry.queue_wait.sum, telemetry.queue_wait.count = gauges  # type: ignore[assignment]
        d = Dispatcher("m", _noop)
        d.stats.queue_wait_s = [i / 1000 for i in range(200)]  # two seconds of a 100 req/s flood
        ticks = 0

        async def other_request() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other_request())
        await asyncio.sleep(0)
        before = ticks
        await telemetry.export({"m": d}, Counter(), {"m": 0})
        task.cancel()
        return telemetry, ticks - before

    telemetry, ticks = asyncio.run(scenario())
    bucket, total, count = telemetry.queue_wait.bucket, telemetry.queue_wait.sum, telemetry.queue_wait.count
    assert count.values == {(("model", "m"),): 200}  # type: ignore[attr-defined]
    assert total.values == {(("model", "m"),): float(sum(range(200)))}  # type: ignore[attr-defined]
    # 0..199 ms against bounds 1, 2, 5, 10, 20, 50, 100, 200 ...: at or below each bound
    assert bucket.values[(("le", "1.0"), ("model", "m"))] == 2  # type: ignore[attr-defined]
    assert bucket.values[(("le", "50.0"), ("model", "m"))] == 51  # type: ignore[attr-defined]
    assert bucket.values[(("le", "+Inf"), ("model", "m"))] == 200  # type: ignore[attr-defined]
    assert ticks >= 1  # the other coroutine ran while the export went on


def test_the_learned_drain_rate_is_exported_per_model_and_lane() -> None:
    telemetry = RouterTelemetry()
    telemetry.drain_rate = FakeGauge()  # type: ignore[assignment]
    d = Dispatcher("m", _noop)
    d.bulk.drain.rate = 106.4
    asyncio.run(telemetry.export({"m": d}, Counter(), {"m": 0}))
    assert telemetry.drain_rate.values == {(("lane", "bulk"), ("model", "m")): 106.4}  # type: ignore[attr-defined]


class FakeCounter:
    def __init__(self) -> None:
        self.values: Counter[tuple[tuple[str, str], ...]] = Counter()

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.values[tuple(sorted((tags or {}).items()))] += int(value)


def test_latency_and_shedding_are_exported_per_priority_once_each() -> None:
    telemetry = RouterTelemetry()
    count = telemetry.latency.count = FakeGauge()  # type: ignore[assignment]
    telemetry.latency.bucket = telemetry.latency.sum = FakeGauge()  # type: ignore[assignment]
    telemetry.shed_priority = FakeCounter()  # type: ignore[assignment]
    d = Dispatcher("m", _noop)
    d.stats.latency_s = [("high", 0.004), ("low", 0.25)]
    d.stats.shed_priority.update({"low": 3})
    asyncio.run(telemetry.export({"m": d}, Counter(), {"m": 0}))
    d.stats.shed_priority.update({"low": 1, "high": 1})
    asyncio.run(telemetry.export({"m": d}, Counter(), {"m": 0}))  # only what changed since, and no latency twice
    assert count.values == {  # type: ignore[attr-defined]
        (("model", "m"), ("priority", "high")): 1,
        (("model", "m"), ("priority", "low")): 1,
    }
    assert telemetry.shed_priority.values == {  # type: ignore[attr-defined]
        (("model", "m"), ("priority", "low")): 4,
        (("model", "m"), ("priority", "high")): 1,
    }
