import gc

from serve_app.router.gcwatch import GcPauses, freeze_startup_heap


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
