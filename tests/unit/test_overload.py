"""The router's own overload control without Ray: its delay, who is refused, and where."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from serve_app.config import AppArgs
from serve_app.contract import Priority
from serve_app.router.background import BackgroundLoops
from serve_app.router.parts import build_parts
from serve_app.router.shedgate import HeaderCheck
from serve_app.scheduling.overload import LagShedding, LoopLag
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


def test_low_goes_first_then_normal_and_high_never():
    shedding = LagShedding(target_s=0.05)
    assert not any(shedding.refuses(p, 0.05) for p in Priority)
    assert shedding.refuses(Priority.LOW, 0.06) and not shedding.refuses(Priority.NORMAL, 0.06)
    assert shedding.refuses(Priority.NORMAL, 0.11) and not shedding.refuses(Priority.HIGH, 10.0)
    assert shedding.refused == {"low": 1, "normal": 1}
    with pytest.raises(ValueError):
        LagShedding(0.0)


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


def _check(model_dir: Path, lag_s: float, **scheduling: object) -> HeaderCheck:
    args = tiny_args(model_dir)
    args["scheduling"] = {"router_delay_target_ms": 50, "anonymous_max_priority": "high", **scheduling}
    parts = build_parts(AppArgs.model_validate(args), {}, "r", lambda model: None)  # type: ignore[arg-type,return-value]
    assert parts.loop_lag is not None and parts.lag_shedding is not None
    parts.loop_lag.lag_s = lag_s
    return HeaderCheck(parts.callers, parts.catalog, parts.dispatchers, parts.loop_lag, parts.lag_shedding)


def test_an_overloaded_router_refuses_low_from_the_headers_on_every_inference_path(tiny_model_dir: Path):
    check = _check(tiny_model_dir, lag_s=0.08)
    v2 = check("/v2/models/bert-heavy/infer", "bert-heavy", {"x-priority": "low"})
    assert v2 is not None and v2.status_code == 503 and v2.headers["retry-after"] == "1"
    assert b"router overloaded" in v2.body and b'"error":"router' in v2.body  # v2's shape
    gen = check("/v1/completions", "", {"x-priority": "low"})
    assert gen is not None and gen.status_code == 503 and b'"code":"overloaded"' in gen.body  # OpenAI's shape
    # Normal priority (the default without a header) and high still go on at this delay.
    assert check("/v2/models/bert-heavy/infer", "bert-heavy", {}) is None
    assert check("/v1/completions", "", {"x-priority": "high"}) is None
    # Past twice the target, normal is refused too; high never.
    check.loop_lag.lag_s = 0.2  # type: ignore[union-attr]
    assert check("/v1/chat/completions", "", {}) is not None
    assert check("/v2/models/bert-heavy/infer", "bert-heavy", {"x-priority": "high"}) is None


def test_a_router_on_time_or_without_the_control_refuses_nothing_for_its_delay(tiny_model_dir: Path):
    assert _check(tiny_model_dir, lag_s=0.01)("/v1/completions", "", {"x-priority": "low"}) is None
    args = AppArgs.model_validate(tiny_args(tiny_model_dir))
    assert args.scheduling.router_delay_target_ms is None  # off unless configured
    parts = build_parts(args, {}, "r", lambda model: None)  # type: ignore[arg-type,return-value]
    assert parts.loop_lag is None and parts.lag_shedding is None
