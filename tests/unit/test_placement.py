"""The placement rule for multiplexed models (serve_app.scheduling.placement), on a fake clock."""

from __future__ import annotations

import pytest

from serve_app.scheduling.placement import PoolView


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # every event a second after the last: orders are plain to read
        return self.now


def pool(max_models: int = 2, busy: int = 2, replicas: tuple[str, ...] = ("a", "b")) -> PoolView:
    view = PoolView(max_models, busy, clock=Clock())
    view.set_replicas({r: [] for r in replicas})
    return view


def test_a_model_goes_to_the_replica_that_holds_it_while_it_has_room() -> None:
    view = pool()
    view.routed("b", "m1")
    view.completed("b", "m1")
    choice = view.choose("m1")
    assert choice.reason == "holder" and choice.ranks[0] == ["b"]
    view.routed("b", "m1")  # one batch in flight: still room under busy_batches=2
    assert view.choose("m1").ranks[0] == ["b"]


def test_a_model_held_nowhere_loads_into_a_free_slot_before_evicting() -> None:
    view = pool(max_models=1)
    view.routed("a", "m1")
    view.completed("a", "m1")
    choice = view.choose("m2")
    # b has a free slot; a would have to evict m1
    assert choice.reason == "load" and choice.ranks == [["b"], ["a"]]


def test_least_recently_used_idle_models_are_evicted_first() -> None:
    view = pool(max_models=2, replicas=("a",))
    for m in ("m1", "m2"):
        view.routed("a", m)
        view.completed("a", m)
    view.routed("a", "m1")  # m1 used again: m2 is now the least recently used
    view.completed("a", "m1")
    assert view.replicas["a"].idle_lru() == "m2"
    view.routed("a", "m3")
    assert list(view.replicas["a"].models) == ["m1", "m3"]


def test_a_model_in_use_is_not_evicted_in_the_view() -> None:
    view = pool(max_models=1, busy=4, replicas=("a",))
    view.routed("a", "m1")  # in flight
    view.routed("a", "m2")
    assert set(view.replicas["a"].models) == {"m1", "m2"}
    view.completed("a", "m1")
    view.routed("a", "m2")
    assert list(view.replicas["a"].models) == ["m2"]


def test_an_evicting_load_goes_to_the_replica_whose_idle_model_is_oldest() -> None:
    view = pool(max_models=1)
    view.routed("a", "old")
    view.completed("a", "old")
    view.routed("b", "newer")
    view.completed("b", "newer")
    assert view.choose("m").ranks == [["a"], ["b"]]


def test_a_hot_model_gets_a_second_replica_when_its_holder_is_busy() -> None:
    """ray-project/ray#48741: with every holder busy, the next batch loads the model elsewhere."""
    view = pool(max_models=2, busy=2)
    view.routed("a", "hot")
    view.routed("a", "hot")  # two batches in flight: a is busy
    choice = view.choose("hot")
    assert choice.reason == "second copy" and choice.ranks == [["b"], ["a"]]
    view.routed("b", "hot")
    assert sorted(view.holders("hot")) == ["a", "b"]
    # Both hold it now: the next batch goes to the holder with room, without loading anywhere.
    choice = view.choose("hot")
    assert choice.reason == "holder" and choice.ranks[0] == ["b"]


def test_with_second_copies_off_a_busy_model_waits_at_its_holder() -> None:
    """The comparison's other arm: Ray Serve's own multiplexed routing, one replica a model."""
    view = PoolView(2, 2, clock=Clock(), second_copies=False)
    view.set_replicas({"a": [], "b": []})
    view.routed("a", "hot")
    view.routed("a", "hot")
    choice = view.choose("hot")
    assert choice.reason == "wait for a holder" and choice.ranks == [["a"]]
    assert view.choose("cold").reason == "load"  # a model held nowhere still loads where there is room


def test_no_second_copy_where_it_would_evict_a_model_in_use() -> None:
    view = pool(max_models=1, busy=2)
    view.routed("a", "hot")
    view.routed("a", "hot")
    view.routed("b", "other")  # b's only slot holds a model with a batch in flight
    choice = view.choose("hot")
    assert choice.reason == "wait for a holder" and choice.ranks == [["a"]]


def test_a_model_held_nowhere_goes_to_one_replica_first() -> None:
    """Batches chosen together, before either is seen routed, load the model once, not once each."""
    view = pool(max_models=2, replicas=("a", "b", "c"))
    view.routed("b", "x")  # b is busier
    assert view.choose("m").ranks == [["a"], ["c"], ["b"]]


def test_a_busy_replica_takes_no_load() -> None:
    view = pool(max_models=2, busy=1)
    view.routed("a", "hot")  # a busy with hot
    view.routed("b", "x")  # b busy with x, a free slot left
    assert view.choose("hot").reason == "wait for a holder"
    view.completed("b", "x")
    assert view.choose("hot").ranks == [["b"], ["a"]]


def test_reports_add_models_loaded_elsewhere_and_drop_evicted_idle_ones() -> None:
    view = pool(max_models=2)
    view.report_lag_s = 3.0  # the clock moves a second per event
    view.routed("a", "m1")  # in flight: kept though the report predates its load
    view.set_replicas({"a": ["m9"], "b": ["m2"]})
    assert set(view.replicas["a"].models) == {"m1", "m9"} and view.holders("m2") == ["b"]
    view.completed("a", "m1")
    view.set_replicas({"a": ["m9"], "b": ["m2"]})  # done, but routed there a moment ago: still held
    assert set(view.replicas["a"].models) == {"m1", "m9"}
    view.set_replicas({"a": ["m9"], "b": ["m2"]})
    view.set_replicas({"a": ["m9"], "b": ["m2"]})  # the report still lacks it, past the lag: evicted
    assert list(view.replicas["a"].models) == ["m9"]
    view.set_replicas({"b": ["m2"]})  # a replica gone takes its state with it
    assert list(view.replicas) == ["b"] and view.choose("m9").ranks == [["b"]]


def test_candidates_limit_the_choice_and_none_known_is_said() -> None:
    view = pool()
    view.routed("a", "m")
    view.completed("a", "m")
    assert view.choose("m", candidates=["b"]).ranks == [["b"]]
    assert view.choose("m", candidates=["zzz"]).reason == "no replica"


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        PoolView(0)


def test_a_second_copy_evicts_only_a_model_idle_for_a_while() -> None:
    """Many models asked for at once: a model between two batches is not pushed out for a second
    copy of another, which would only load it again a moment later."""
    clock = Clock()
    view = PoolView(1, 2, clock=clock, copy_evicts_idle_s=10.0)
    view.set_replicas({"a": [], "b": []})
    view.routed("a", "hot")
    view.routed("a", "hot")  # a is busy with hot
    view.routed("b", "warm")
    view.completed("b", "warm")  # b's only model is idle, but used a moment ago
    assert view.choose("hot").reason == "wait for a holder"
    clock.now += 30  # warm has not been asked for since
    choice = view.choose("hot")
    assert choice.reason == "second copy" and choice.ranks == [["b"], ["a"]]
    # A model held nowhere still loads over a recently used one: it has to load somewhere.
    assert view.choose("new").ranks[0] == ["b"]
