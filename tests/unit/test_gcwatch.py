import gc
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest

from serve_app.process.gcwatch import FullCollectionSchedule, GcPauses, freeze_startup_heap


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_pauses_are_recorded_per_generation():
    clock = Clock()
    pauses = GcPauses(keep=4, clock=clock)
    for ms, gen in [(1, 0), (2, 0), (50, 2)]:
        pauses("start", {"generation": gen})
        clock.t += ms / 1e3
        pauses("stop", {"generation": gen})
    snap = pauses.snapshot()
    assert snap["gen0"]["collections"] == 2 and snap["gen0"]["max_ms"] == 2.0
    assert snap["gen1"] == {"collections": 0, "total_ms": 0.0, "last_30s": {"collections": 0, "max_ms": 0.0}}
    assert snap["gen2"]["p99_ms"] == 50.0 and snap["gen2"]["total_ms"] == 50.0
    clock.t += 31  # the window forgets, the totals do not
    later = pauses.snapshot()
    assert later["gen2"]["last_30s"] == {"collections": 0, "max_ms": 0.0} and later["gen2"]["collections"] == 1


class AppendsWhileRead(deque[tuple[float, float]]):
    """A deque to which a collection is recorded once while it is being read, as happens when a
    collection starts, in any thread, in the middle of `snapshot`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mutated = False

    def __iter__(self) -> Iterator[tuple[float, float]]:
        for i, item in enumerate(super().__iter__()):
            if i == 1 and not self.mutated:
                self.mutated = True
                self.append((0.0, 0.004))
            yield item


def test_a_collection_recorded_while_the_snapshot_reads_does_not_fail_it():
    pauses = GcPauses(keep=4, clock=Clock())
    pauses.recent[0] = AppendsWhileRead([(0.0, 0.001), (0.0, 0.002), (0.0, 0.003)], maxlen=4)
    snap = pauses.snapshot()
    assert pauses.recent[0].mutated  # type: ignore[attr-defined]
    assert snap["gen0"]["max_ms"] == 4.0 and snap["gen0"]["last_30s"]["collections"] == 4


def test_installed_watcher_sees_a_real_collection_and_uninstalls():
    pauses = GcPauses()
    pauses.install()
    try:
        gc.collect()
    finally:
        pauses.uninstall()
    assert pauses.counts[2] >= 1 and pauses not in gc.callbacks


def test_frozen_startup_heap_is_left_out_of_collections():
    try:
        assert freeze_startup_heap() > 0 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_status_reports_the_frozen_count_taken_at_the_freeze_without_counting_again(monkeypatch: pytest.MonkeyPatch):
    try:
        frozen = freeze_startup_heap()
        counted: list[int] = []

        def count() -> int:  # walks every frozen object (a router's whole startup heap) on the caller's loop
            counted.append(1)
            return frozen

        monkeypatch.setattr(gc, "get_freeze_count", count)
        pauses = GcPauses()
        assert [pauses.snapshot()["frozen_objects"] for _ in range(3)] == [frozen] * 3
        assert counted == []
    finally:
        gc.unfreeze()


def test_full_collections_run_once_per_idle_spell_or_after_the_longest_interval():
    clock = Clock()
    schedule = FullCollectionSchedule(idle_s=1.0, max_interval_s=10.0, clock=clock)
    assert not schedule.due(busy=True)
    clock.t = 0.5
    assert not schedule.due(busy=False)  # idle, but not for long enough
    clock.t = 1.6
    assert schedule.due(busy=False)
    schedule.ran()
    clock.t = 3.0
    assert not schedule.due(busy=False)  # the same idle spell: collected already
    clock.t = 3.5
    assert not schedule.due(busy=True)
    clock.t = 12.0
    assert schedule.due(busy=True)  # a flood that never ends still gets one, 10 s on
    schedule.ran()
    clock.t = 13.0
    assert not schedule.due(busy=True)


def test_take_over_keeps_the_young_generations_thresholds():
    before = gc.get_threshold()
    try:
        FullCollectionSchedule.take_over()
        after = gc.get_threshold()
        assert after[:2] == before[:2] and after[2] >= 1_000_000
    finally:
        gc.set_threshold(*before)
