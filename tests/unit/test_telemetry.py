"""The metrics export shares the router's event loop with requests: it must yield while it
records a flood's queue waits, and must record every one of them."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from serve_app.contract import BatchReply
from serve_app.router.telemetry import RouterTelemetry
from serve_app.scheduling.dispatcher import Dispatcher


class FakeHistogram:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values.append(value)


async def _noop(payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
    return BatchReply([None] * len(payloads), 0.0, 0.0)


def test_queue_waits_are_all_recorded_in_chunks_that_yield_to_the_loop() -> None:
    async def scenario() -> tuple[list[float], int]:
        telemetry = RouterTelemetry()
        telemetry.queue_wait = FakeHistogram()  # type: ignore[assignment]
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
        return telemetry.queue_wait.values, ticks - before  # type: ignore[attr-defined]

    values, ticks = asyncio.run(scenario())
    assert values == [float(i) for i in range(200)]
    assert ticks >= 200 // RouterTelemetry.chunk  # the other coroutine ran between chunks


class FakeGauge:
    def __init__(self) -> None:
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[tuple(sorted((tags or {}).items()))] = value


def test_the_learned_drain_rate_is_exported_per_model_and_lane() -> None:
    telemetry = RouterTelemetry()
    telemetry.drain_rate = FakeGauge()  # type: ignore[assignment]
    d = Dispatcher("m", _noop)
    d.bulk.drain.rate = 106.4
    asyncio.run(telemetry.export({"m": d}, Counter(), {"m": 0}))
    assert telemetry.drain_rate.values == {(("lane", "bulk"), ("model", "m")): 106.4}  # type: ignore[attr-defined]


class TaggedHistogram:
    def __init__(self) -> None:
        self.values: list[tuple[dict[str, str], float]] = []

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values.append((dict(tags or {}), value))


class FakeCounter:
    def __init__(self) -> None:
        self.values: Counter[tuple[tuple[str, str], ...]] = Counter()

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.values[tuple(sorted((tags or {}).items()))] += int(value)


def test_latency_and_shedding_are_exported_per_priority_once_each() -> None:
    telemetry = RouterTelemetry()
    telemetry.latency = TaggedHistogram()  # type: ignore[assignment]
    telemetry.shed_priority = FakeCounter()  # type: ignore[assignment]
    d = Dispatcher("m", _noop)
    d.stats.latency_s = [("high", 0.004), ("low", 0.25)]
    d.stats.shed_priority.update({"low": 3})
    asyncio.run(telemetry.export({"m": d}, Counter(), {"m": 0}))
    d.stats.shed_priority.update({"low": 1, "high": 1})
    asyncio.run(telemetry.export({"m": d}, Counter(), {"m": 0}))  # only what changed since, and no latency twice
    assert telemetry.latency.values == [  # type: ignore[attr-defined]
        ({"model": "m", "priority": "high"}, 4.0),
        ({"model": "m", "priority": "low"}, 250.0),
    ]
    assert telemetry.shed_priority.values == {  # type: ignore[attr-defined]
        (("model", "m"), ("priority", "low")): 4,
        (("model", "m"), ("priority", "high")): 1,
    }
