"""The router's own overload control without Ray: its delay, who is refused, and where."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from serve_app.config import AppArgs
from serve_app.contract import Priority
from serve_app.router.background import BackgroundLoops
from serve_app.router.edge.shedgate import HeaderCheck, ShedGate
from serve_app.router.parts import RouterParts, build_parts
from serve_app.scheduling.protection.overload import ClassShedding, LoopLag
from tests.conftest import tiny_args


def test_one_pause_moves_the_delay_a_little_and_a_late_loop_all_the_way():
    lag = LoopLag(weight=0.2)
    lag.observe(0.2)  # one 200 ms pause: well under a 50 ms target
    assert lag.lag_s == pytest.approx(0.04)
    lag.observe(-0.01)  # a timer that fired early counts as on time
    assert lag.lag_s == pytest.approx(0.032)
    for _ in range(30):  # a loop that stays 80 ms late
        lag.observe(0.08)
    assert lag.lag_s == pytest.approx(0.08, abs=0.001)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _feed(shedding: ClassShedding, clock: FakeClock, late_s: list[float], seconds: float, tick_s: float = 0.01) -> None:
    """Lateness samples every `tick_s` for `seconds`, cycling through `late_s` (a loop's pattern)."""
    for i in range(round(seconds / tick_s)):
        clock.now = round(clock.now + tick_s, 9)
        shedding.observe(late_s[i % len(late_s)])


def _shedding(clock: FakeClock, draws: list[float] | None = None) -> ClassShedding:
    values = iter(draws or [])
    return ClassShedding(target_s=0.005, clock=clock, draw=lambda: next(values, 0.5))


def test_below_capacity_nothing_is_refused_whatever_the_bursts():
    clock = FakeClock()
    shedding = _shedding(clock)
    # A loop that keeps up is on time at least once per interval, however late its bursts
    # (a garbage collection of 200 ms, a slow handler) make it in between.
    _feed(shedding, clock, [0.0, 0.2, 0.03, 0.001, 0.05], seconds=30.0)
    assert shedding.level == 0.0 and not shedding.active
    assert not any(shedding.refuses(p) for p in Priority)
    assert shedding.refused == {}


def test_one_pause_longer_than_the_interval_refuses_nothing_wherever_it_falls():
    # The loop on time every 10 ms, then stopped for 150 ms: the sample after the pause is the only
    # one taken in its interval when the pause starts just after an interval closed. Every phase.
    for phase in range(12):
        clock = FakeClock()
        shedding = _shedding(clock)
        _feed(shedding, clock, [0.0], seconds=1.0 + phase * 0.01)
        clock.now = round(clock.now + 0.15, 9)
        shedding.observe(0.14)
        for _ in range(20):
            assert not shedding.active and not shedding.refuses(Priority.LOW), phase
            _feed(shedding, clock, [0.0], seconds=0.01)


def test_a_loop_late_by_more_than_the_interval_at_every_sample_still_sheds():
    clock = FakeClock()
    shedding = _shedding(clock)
    for _ in range(6):  # each tick 150 ms late: one sample per interval, every one of them late
        clock.now = round(clock.now + 0.16, 9)
        shedding.observe(0.15)
    assert shedding.level > 0.0 and shedding.standing_s == pytest.approx(0.15)


def test_a_standing_delay_sheds_low_first_then_normal_and_never_high():
    clock = FakeClock()
    shedding = _shedding(clock)
    _feed(shedding, clock, [0.02], seconds=0.2)  # four targets of standing delay, two intervals
    assert 0.0 < shedding.level < 1.0  # a share of low only
    assert shedding.share(Priority.LOW) == shedding.level and shedding.share(Priority.NORMAL) == 0.0
    _feed(shedding, clock, [0.02], seconds=5.0)
    assert shedding.level == 2.0  # all of low, all of normal
    assert shedding.share(Priority.LOW) == 1.0 and shedding.share(Priority.NORMAL) == 1.0
    assert shedding.share(Priority.HIGH) == 0.0 and not shedding.refuses(Priority.HIGH)
    assert shedding.refuses(Priority.NORMAL) and shedding.refuses(Priority.LOW)
    assert shedding.refused == {"normal": 1, "low": 1}


def test_normal_keeps_at_least_low_s_share_at_every_level():
    shedding = _shedding(FakeClock())
    for level in (0.0, 0.3, 0.99, 1.0, 1.4, 2.0):
        shedding.level = level
        assert shedding.share(Priority.NORMAL) <= shedding.share(Priority.LOW)
        assert shedding.share(Priority.HIGH) == 0.0


def test_the_refused_share_is_drawn_per_request():
    clock = FakeClock()
    shedding = _shedding(clock, draws=[0.1, 0.9, 0.29, 0.31, 0.5, 0.05])
    shedding.level = 1.3  # all of low; 30% of normal
    assert [shedding.refuses(Priority.NORMAL) for _ in range(4)] == [True, False, True, False]
    assert shedding.refuses(Priority.LOW)  # all of low, without a draw
    assert shedding.refused == {"normal": 2, "low": 1}


def test_the_level_settles_where_the_delay_meets_the_target_and_falls_back_when_load_goes():
    clock = FakeClock()
    shedding = _shedding(clock)
    # A router whose standing delay follows how much of low it still takes: over the target
    # while it takes more than 60% of low, under it below.
    for _ in range(600):  # 60 s of 100 ms intervals
        late = 0.012 if shedding.share(Priority.LOW) < 0.4 else 0.001
        _feed(shedding, clock, [late], seconds=0.1)
    assert 0.3 <= shedding.level <= 0.55  # about 40% of low refused, no normal
    # The spike ends: the loop is on time and the level goes back to nothing within seconds.
    _feed(shedding, clock, [0.0], seconds=12.0)
    assert shedding.level == 0.0 and not shedding.refuses(Priority.LOW)


def test_the_level_moves_once_per_interval_and_more_the_later_the_loop():
    clock = FakeClock()
    slightly, far = _shedding(clock), _shedding(clock)
    for _ in range(10):  # 100 ms of samples: one interval
        clock.now = round(clock.now + 0.01, 9)
        slightly.observe(0.006)
        far.observe(0.05)
    assert 0.0 < slightly.level < far.level
    assert far.level == pytest.approx(0.4)  # capped at four targets' worth per interval
    status = far.status()
    assert status["level"] == 0.4 and status["refused_share"] == {"normal": 0.0, "low": 0.4}
    assert status["standing_delay_ms"] == 50.0 and status["target_ms"] == 5.0
    with pytest.raises(ValueError):
        ClassShedding(0.0)


def test_a_blocked_event_loop_is_seen_as_delay():
    lag = LoopLag()

    async def go() -> float:
        watcher = asyncio.ensure_future(BackgroundLoops._measure_lag(lag))
        await asyncio.sleep(0.05)
        time.sleep(0.1)  # a handler that holds the loop
        await asyncio.sleep(0.001)  # the watcher's overdue tick runs first, and sees how late it is
        watcher.cancel()
        return lag.lag_s

    assert asyncio.run(go()) >= 0.2 * 0.09  # one sample at least 90 ms late, weighted


def _gate(model_dir: Path, **scheduling: object) -> tuple[RouterParts, ShedGate]:
    """The router's parts from the tiny catalog's args, and its inference gate in front of an app
    that answers 200 (what the full path would do with a request let through)."""
    args = tiny_args(model_dir)
    args["scheduling"] = {"router_delay_target_ms": 50, "anonymous_max_priority": "high", **scheduling}
    parts = build_parts(AppArgs.model_validate(args), {}, "r", lambda model: None)  # type: ignore[arg-type,return-value]
    assert parts.loop_lag is not None and parts.gate is not None

    async def ok(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    check = HeaderCheck(parts.callers, parts.catalog, parts.dispatchers)
    return parts, ShedGate(ok, check, parts.gate)


def _post(gate: ShedGate, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(gate(scope, receive, send))
    answer = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], answer, b"".join(m.get("body", b"") for m in sent[1:])


def test_an_overloaded_router_refuses_low_from_the_headers_on_every_inference_path(tiny_model_dir: Path):
    parts, gate = _gate(tiny_model_dir)
    assert parts.gate is not None and parts.gate.shedding is not None
    parts.gate.shedding.level = 1.0  # all of low
    status, headers, body = _post(gate, "/v2/models/bert-heavy/infer", {"x-priority": "low"})
    assert status == 503 and headers["retry-after"] == "1"
    assert b"router overloaded" in body and b'"error":"router' in body  # v2's shape
    status, _, body = _post(gate, "/v1/completions", {"x-priority": "low"})
    assert status == 503 and b'"code":"overloaded"' in body  # OpenAI's shape
    # Normal priority (the default without a header) and high still go on at this level.
    assert _post(gate, "/v2/models/bert-heavy/infer", {})[0] == 200
    assert _post(gate, "/v1/completions", {"x-priority": "high"})[0] == 200
    # Past all of low, normal is refused too; high never.
    parts.gate.shedding.level = 2.0
    assert _post(gate, "/v1/chat/completions", {})[0] == 503
    assert _post(gate, "/v2/models/bert-heavy/infer", {"x-priority": "high"})[0] == 200
    assert parts.gate.shedding.refused == {"low": 2, "normal": 1}


def test_a_router_past_its_in_flight_limit_refuses_low_first_and_high_last(tiny_model_dir: Path):
    parts, gate = _gate(tiny_model_dir, router_max_inflight=2)
    assert parts.gate is not None and parts.gate.concurrency is not None
    concurrency = parts.gate.concurrency
    assert concurrency.ceiling == {Priority.LOW: 2, Priority.NORMAL: 3, Priority.HIGH: 4}
    # Requests answered leave: the count goes back to nothing.
    assert [_post(gate, "/v2/models/bert-heavy/infer", {"x-priority": "low"})[0] for _ in range(3)] == [200] * 3
    assert concurrency.in_flight == 0
    concurrency.in_flight = 2  # two held elsewhere: low is refused, normal and high go on
    status, headers, body = _post(gate, "/v2/models/bert-heavy/infer", {"x-priority": "low"})
    assert status == 503 and headers["retry-after"] == "1" and b"in-flight limit" in body
    assert _post(gate, "/v2/models/bert-heavy/infer", {"x-priority": "normal"})[0] == 200
    concurrency.in_flight = 3
    assert _post(gate, "/v2/models/bert-heavy/infer", {})[0] == 503  # normal, the default
    assert _post(gate, "/v2/models/bert-heavy/infer", {"x-priority": "high"})[0] == 200
    assert concurrency.refused == {"low": 1, "normal": 1}


def test_a_router_on_time_or_without_the_control_refuses_nothing_for_its_delay(tiny_model_dir: Path):
    parts, gate = _gate(tiny_model_dir)
    assert _post(gate, "/v1/completions", {"x-priority": "low"})[0] == 200
    args = AppArgs.model_validate(tiny_args(tiny_model_dir))
    assert args.scheduling.advanced.router_delay_target_ms is None  # off unless configured
    parts = build_parts(args, {}, "r", lambda model: None)  # type: ignore[arg-type,return-value]
    assert parts.loop_lag is None and parts.gate is None
