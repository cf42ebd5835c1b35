import numpy as np
import pytest

from serve_app.router.cascade import CascadePolicy, confidence, softmax


def test_softmax_rows_sum_to_one():
    p = softmax(np.array([[1.0, 2.0, 3.0], [1000.0, 0.0, 0.0]]))
    assert np.allclose(p.sum(axis=1), 1.0)
    assert np.isfinite(p).all()


def test_max_prob_and_margin():
    logits = np.log(np.array([[0.7, 0.2, 0.1]]))
    assert confidence(logits, "max_prob")[0] == pytest.approx(0.7)
    assert confidence(logits, "margin")[0] == pytest.approx(0.5)


def test_escalates_only_uncertain_rows():
    logits = np.log(np.array([[0.95, 0.05], [0.6, 0.4], [0.05, 0.95]]))
    assert CascadePolicy(0.9).escalate(logits).tolist() == [False, True, False]


def test_threshold_zero_never_escalates_and_one_always_does():
    logits = np.log(np.array([[0.99, 0.01], [0.5, 0.5]]))
    assert not CascadePolicy(0.0).escalate(logits).any()
    assert CascadePolicy(1.0).escalate(logits).all()
