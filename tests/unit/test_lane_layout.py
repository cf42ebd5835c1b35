import pytest

from serve_app.config import ModelAdvanced, ModelConfig
from serve_app.models.base import own_session_threads, session_plan
from serve_app.models.classifier import bulk_layout


@pytest.mark.parametrize(
    ("threads", "sessions", "layout"),
    [(2, 2, [1, 1]), (2, 1, [2]), (4, 3, [2, 1, 1]), (2, 5, [1, 1]), (1, 1, [1])],
)
def test_bulk_threads_are_split_evenly_and_never_below_one_per_session(threads, sessions, layout):
    assert bulk_layout(threads, sessions) == layout


def test_a_setting_at_its_former_place_is_read_as_advanced():
    assert ModelConfig.model_validate({"preset": "bert-light", "bulk_sessions": 2}).advanced.bulk_sessions == 2


def test_bulk_sessions_is_optional_and_positive():
    assert ModelConfig(preset="bert-light").advanced.bulk_sessions is None
    assert ModelConfig(preset="bert-light", advanced=ModelAdvanced(bulk_sessions=1)).advanced.bulk_sessions == 1
    with pytest.raises(ValueError):
        ModelConfig(preset="bert-light", advanced=ModelAdvanced(bulk_sessions=0))


def test_the_urgent_lane_takes_its_own_threads_and_the_replicas_without_them():
    config = ModelConfig(preset="bert-heavy", advanced=ModelAdvanced(intra_op_threads=2, urgent_threads=1))
    assert own_session_threads(config, 2, lanes_enabled=True) == 1
    # Without an urgent lane the replica's own session is its only one: all of its threads.
    assert own_session_threads(config, 2, lanes_enabled=False) == 2
    assert own_session_threads(ModelConfig(preset="bert-heavy"), 2, lanes_enabled=True) == 2
    with pytest.raises(ValueError):
        ModelConfig(preset="bert-heavy", advanced=ModelAdvanced(urgent_threads=0))


def test_an_urgent_lane_without_a_session_of_its_own_runs_on_the_bulk_sessions():
    beside = ModelConfig(preset="bert-heavy")
    assert session_plan(beside, supports_lanes=True) == (True, False)
    nxt = ModelConfig(preset="bert-heavy", advanced=ModelAdvanced(urgent_session=False, bulk_sessions=2))
    assert session_plan(nxt, supports_lanes=True) == (False, True)
    assert session_plan(ModelConfig(preset="bert-heavy", advanced=ModelAdvanced(urgent_session=False)), supports_lanes=True) == (
        False,
        False,
    )
    assert session_plan(ModelConfig(preset="bert-heavy", advanced=ModelAdvanced(urgent_lane=False, bulk_sessions=2)), True) == (
        False,
        True,
    )
    assert session_plan(beside, supports_lanes=False) == (False, False)
