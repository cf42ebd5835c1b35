"""The router's in-flight ceiling per class, without Ray."""

from __future__ import annotations

import pytest

from serve_app.contract import Priority
from serve_app.scheduling.protection.concurrency import ClassConcurrency


def test_each_class_fills_the_router_up_to_its_share_and_no_further():
    c = ClassConcurrency(limit=4, normal_share=1.5, high_share=2.0)
    assert all(c.enter(Priority.LOW) for _ in range(4))
    assert not c.enter(Priority.LOW)  # low's share is full
    assert c.enter(Priority.NORMAL) and c.enter(Priority.NORMAL)
    assert not c.enter(Priority.NORMAL)  # 6: normal's share is full too
    assert c.enter(Priority.HIGH) and c.enter(Priority.HIGH)
    assert not c.enter(Priority.HIGH)  # 8: the whole router
    assert c.refused == {"low": 1, "normal": 1, "high": 1}
    assert c.status()["in_flight"] == {"high": 2, "normal": 2, "low": 4}


def test_a_flood_of_low_never_takes_the_room_of_the_higher_classes():
    c = ClassConcurrency(limit=10)
    admitted_low = sum(c.enter(Priority.LOW) for _ in range(1000))
    assert admitted_low == 10
    assert sum(c.enter(Priority.HIGH) for _ in range(100)) == 10  # what is left above low's share


def test_leaving_frees_the_place_for_any_class():
    c = ClassConcurrency(limit=1)
    assert c.enter(Priority.LOW) and not c.enter(Priority.LOW)
    c.leave(Priority.LOW)
    assert c.in_flight == 0 and c.enter(Priority.LOW)


def test_settings_that_cannot_work_are_refused_at_construction():
    with pytest.raises(ValueError):
        ClassConcurrency(0)
    with pytest.raises(ValueError):
        ClassConcurrency(4, normal_share=2.0, high_share=1.5)
