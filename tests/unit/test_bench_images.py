"""The images scenario's account of where the text requests' time went (no Ray, no load)."""

from __future__ import annotations

import pytest

from benchmarks.images import TAIL_PARTS, tail_parts


def timing(queue: float, model: float, replica: float, total: float) -> dict[str, float]:
    return {"queue": queue, "model": model, "replica": replica, "total": total}


def test_tail_parts_split_each_request_and_average_the_slowest_percent() -> None:
    # 99 quick requests and one slow one whose extra time is in the replica.
    quick = [(3.0, timing(0.5, 1.5, 1.0, 2.5))] * 99
    slow = (13.0, timing(0.5, 11.5, 11.0, 12.5))
    parts = tail_parts([*quick, slow])
    assert set(parts["all"]) == set(TAIL_PARTS)
    assert parts["tail"] == {"queue": 0.5, "transport": 0.5, "replica": 11.0, "router_own": 0.5, "outside": 0.5}
    assert parts["all"]["replica"] == pytest.approx(1.1)
    # The parts of a request add up to its latency.
    assert sum(parts["tail"].values()) == pytest.approx(13.0)


def test_tail_parts_take_a_missing_metric_as_zero() -> None:
    parts = tail_parts([(2.0, {"total": 1.5})])
    assert parts["tail"] == {"queue": 0.0, "transport": 0.0, "replica": 0.0, "router_own": 1.5, "outside": 0.5}
