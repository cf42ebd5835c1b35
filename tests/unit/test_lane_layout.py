import pytest

from serve_app.config import ModelConfig
from serve_app.models.classifier import bulk_layout


@pytest.mark.parametrize(
    ("threads", "sessions", "layout"),
    [(2, 2, [1, 1]), (2, 1, [2]), (4, 3, [2, 1, 1]), (2, 5, [1, 1]), (1, 1, [1])],
)
def test_bulk_threads_are_split_evenly_and_never_below_one_per_session(threads, sessions, layout):
    assert bulk_layout(threads, sessions) == layout


def test_bulk_sessions_is_optional_and_positive():
    assert ModelConfig(preset="bert-light").bulk_sessions is None
    assert ModelConfig(preset="bert-light", bulk_sessions=1).bulk_sessions == 1
    with pytest.raises(ValueError):
        ModelConfig(preset="bert-light", bulk_sessions=0)
