import numpy as np
import pytest

from serve_app.router.routing.cascade import CascadePolicy, confidence
from serve_app.tools.calibrate import calibrate_threshold, score


def synthetic(n: int = 4000, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A light model that is right when it is confident and guesses otherwise; a heavy one right 95% of the time."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    sure = rng.random(n)  # how easy each item is
    light = np.zeros((n, 2))
    right = rng.random(n) < 0.5 + 0.5 * sure
    pred = np.where(right, labels, 1 - labels)
    light[np.arange(n), pred] = 4 * sure
    heavy = np.zeros((n, 2))
    heavy_pred = np.where(rng.random(n) < 0.95, labels, 1 - labels)
    heavy[np.arange(n), heavy_pred] = 3.0
    return light, heavy, labels


def test_threshold_meets_the_accuracy_target_and_uses_the_light_model():
    light, heavy, labels = synthetic()
    cal = calibrate_threshold(light, heavy, labels, max_drop=0.005)
    s = cal.calibration
    assert s.cascade_acc >= s.heavy_acc - 0.005
    assert 0.05 < s.light_share < 0.95
    assert s.light_acc < s.cascade_acc
    # The router's policy escalates exactly the items the calibration gave the heavy model.
    escalated = CascadePolicy(cal.threshold, cal.signal).escalate(light)
    assert escalated.mean() == pytest.approx(1 - s.light_share)


def test_the_signal_is_chosen_by_light_share():
    light, heavy, labels = synthetic(seed=1)
    cal = calibrate_threshold(light, heavy, labels)
    assert cal.candidates[cal.signal] == max(cal.candidates.values())
    assert set(cal.candidates) == {"max_prob", "margin", "entropy"}


def test_held_out_data_stays_near_the_target():
    light, heavy, labels = synthetic(seed=2)
    cal = calibrate_threshold(light, heavy, labels, max_drop=0.005)
    test = score(*synthetic(seed=3), cal.signal, cal.threshold)
    assert test.cascade_acc >= test.heavy_acc - 0.02


def test_a_useless_light_model_escalates_everything():
    light, heavy, labels = synthetic()
    rng = np.random.default_rng(5)
    noise = rng.normal(size=light.shape)
    cal = calibrate_threshold(noise, heavy, labels, max_drop=0.0)
    assert cal.calibration.light_share <= 0.01
    assert cal.calibration.cascade_acc >= cal.calibration.heavy_acc - 1e-9


def test_entropy_confidence_is_one_for_certain_and_zero_for_uniform():
    c = confidence(np.array([[50.0, 0.0, 0.0], [1.0, 1.0, 1.0]]), "entropy")
    assert c[0] == pytest.approx(1.0, abs=1e-6) and c[1] == pytest.approx(0.0, abs=1e-9)


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError):
        calibrate_threshold(np.zeros((3, 2)), np.zeros((2, 2)), np.zeros(3))
