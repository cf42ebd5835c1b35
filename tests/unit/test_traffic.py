"""The traffic policy: weighted splits, sticky keys, shadows and automatic rollback (no Ray)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from serve_app.config import TrafficConfig
from serve_app.scheduling.traffic import OutcomeWindow, ShadowStats, TrafficPolicy, wilson_bound


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def policy(clock: Clock | None = None, seed: int = 0, **traffic: dict) -> TrafficPolicy:
    p = TrafficPolicy({"m": "1", "other": "1"}, clock=clock or Clock(), rng=random.Random(seed).random)
    p.update({m: TrafficConfig.model_validate(t) for m, t in traffic.items()})
    return p


def test_a_model_without_a_policy_gets_its_first_version():
    assert policy().choose("m") == "1" and policy(m={"weights": {"1": 1}}).choose("other") == "1"


def test_unversioned_requests_split_by_weight():
    p = policy(m={"weights": {"1": 90, "2": 10}})
    share = Counter(p.choose("m") for _ in range(20_000))["2"] / 20_000
    assert 0.09 < share < 0.11


def test_a_sticky_key_keeps_its_version_and_keys_spread_by_weight():
    p = policy(m={"weights": {"1": 50, "2": 50}, "sticky": "session"})
    for key in ("alice", "bob", "carol"):
        assert len({p.choose("m", session=key) for _ in range(100)}) == 1
    spread = Counter(p.choose("m", session=f"user-{i}") for i in range(4000))
    assert 0.45 < spread["2"] / 4000 < 0.55
    assert len({p.choose("m") for _ in range(100)}) == 2  # no key: drawn anew each time


def test_tenant_stickiness_uses_the_tenant_not_the_session_header():
    p = policy(m={"weights": {"1": 50, "2": 50}, "sticky": "tenant"})
    assert len({p.choose("m", session=f"s{i}", tenant="acme") for i in range(100)}) == 1


def test_shadow_draws_its_share_and_never_mirrors_to_the_answering_version():
    p = policy(m={"weights": {"1": 1}, "shadow": {"version": "2", "share": 0.25}})
    drawn = sum(p.shadow("m", "1") == "2" for _ in range(8000)) / 8000
    assert 0.22 < drawn < 0.28
    assert p.shadow("m", "2") is None and p.shadow("other", "1") is None


def _feed(p: TrafficPolicy, version: str, n: int, latency: float, failed_every: int = 0) -> None:
    for i in range(n):
        p.record("m", version, latency, failed=bool(failed_every) and i % failed_every == 0)


ROLLBACK = {"window_s": 30, "min_requests": 20, "max_error_rate_increase": 0.05, "max_p99_ratio": 2.0}


def test_a_failing_canary_is_rolled_back_and_stays_back_until_its_weight_changes():
    clock = Clock()
    p = policy(clock, m={"weights": {"1": 90, "2": 10}, "rollback": ROLLBACK})
    _feed(p, "1", 100, 0.01)
    _feed(p, "2", 19, 0.01, failed_every=1)
    assert p.check_rollbacks() == []  # not yet enough calls on the canary to judge
    _feed(p, "2", 1, 0.01, failed_every=1)
    (event,) = p.check_rollbacks()
    assert (event.model, event.version) == ("m", "2") and "error rate" in event.reason
    assert all(p.choose("m") == "1" for _ in range(200))
    assert p.effective_weights()[("m", "2")] == 0.0
    p.update({"m": TrafficConfig.model_validate({"weights": {"1": 90, "2": 10}, "rollback": ROLLBACK})})
    assert p.choose("m", session=None) == "1" and p.models["m"].rolled_back  # same weights: still rolled back
    p.update({"m": TrafficConfig.model_validate({"weights": {"1": 80, "2": 20}, "rollback": ROLLBACK})})
    assert not p.models["m"].rolled_back  # a new weight is a new decision


def test_a_slow_canary_is_rolled_back_and_a_healthy_one_is_not():
    clock = Clock()
    p = policy(clock, m={"weights": {"1": 50, "2": 50}, "rollback": ROLLBACK})
    _feed(p, "1", 200, 0.010)
    _feed(p, "2", 199, 0.015)
    _feed(p, "2", 1, 1.0)  # one slow call: not the canary's p99
    assert p.check_rollbacks() == []
    _feed(p, "2", 200, 0.100)
    (event,) = p.check_rollbacks()
    assert "p99" in event.reason


def test_a_canary_failing_as_often_as_its_baseline_is_not_rolled_back_by_chance():
    """A canary's few calls in the window are judged by the interval around their error rate, not
    the rate itself: 3 failures in 20 calls (15%) is no evidence against a baseline's 2%."""
    clock = Clock()
    p = policy(clock, m={"weights": {"1": 90, "2": 10}, "rollback": ROLLBACK})
    _feed(p, "1", 1000, 0.01, failed_every=50)
    _feed(p, "2", 20, 0.01, failed_every=7)  # calls 0, 7, 14 fail
    assert p.check_rollbacks() == []
    _feed(p, "2", 180, 0.01, failed_every=3)  # now a third of 200 calls fail: that is evidence
    (event,) = p.check_rollbacks()
    assert "error rate" in event.reason


def test_wilson_bounds_hold_the_rate_and_narrow_with_calls():
    low, high = wilson_bound(3, 20, 3.0, upper=False), wilson_bound(3, 20, 3.0, upper=True)
    assert 0 < low < 0.15 < high < 1
    assert wilson_bound(300, 2000, 3.0, upper=False) > low
    assert wilson_bound(0, 20, 3.0, upper=False) == pytest.approx(0.0, abs=1e-12)


def test_a_new_weight_or_rule_judges_a_version_afresh_not_on_its_old_outcomes():
    clock = Clock()
    p = policy(clock, m={"weights": {"1": 90, "2": 10}, "rollback": ROLLBACK})
    _feed(p, "1", 100, 0.01)
    _feed(p, "2", 40, 0.01, failed_every=1)
    assert p.check_rollbacks()
    p.update({"m": TrafficConfig.model_validate({"weights": {"1": 95, "2": 5}, "rollback": ROLLBACK})})
    assert p.check_rollbacks() == [] and not p.models["m"].rolled_back  # the old failures went with the old weight
    _feed(p, "1", 100, 0.01)
    _feed(p, "2", 40, 0.01)
    longer = {**ROLLBACK, "window_s": 300}
    p.update({"m": TrafficConfig.model_validate({"weights": {"1": 95, "2": 5}, "rollback": longer})})
    _feed(p, "2", 1, 0.01)
    assert p.windows[("m", "2")].window_s == 300  # a new rule's window, not the first one's


def test_old_outcomes_leave_the_window():
    clock = Clock()
    w = OutcomeWindow(30, clock)
    for _ in range(10):
        w.record(0.1, failed=True)
    clock.t = 31
    w.record(0.01, failed=False)
    assert w.summary() == (1, 0.0, pytest.approx(0.01))


def test_shadow_stats_count_label_agreement_and_probability_differences():
    s = ShadowStats()
    p = np.array([[0.9, 0.1], [0.4, 0.6], [0.5, 0.5]])
    q = np.array([[0.8, 0.2], [0.7, 0.3], [0.5, 0.5]])
    s.compare(p, q)
    assert (s.rows, s.agreed) == (3, 2) and s.prob_diffs == pytest.approx([0.1, 0.3, 0.0])
    assert s.agreement == pytest.approx(2 / 3)


def test_weights_must_leave_some_traffic():
    with pytest.raises(ValueError, match="at least one above 0"):
        TrafficConfig.model_validate({"weights": {"1": 0}})


def test_a_rollback_another_router_decided_applies_here_under_the_same_weight_only():
    decided = policy(m={"weights": {"1": 90, "2": 10}, "rollback": ROLLBACK})
    _feed(decided, "1", 100, 0.01)
    _feed(decided, "2", 20, 0.01, failed_every=1)
    assert decided.judges and len(decided.check_rollbacks()) == 1
    (shared,) = decided.standing()
    assert shared[:3] == ("m", "2", 10.0) and "error rate" in shared[3]

    # A router that saw none of those calls (started later, or routed other clients).
    fresh = policy(m={"weights": {"1": 90, "2": 10}, "rollback": ROLLBACK})
    (adopted,) = fresh.adopt([shared])
    assert (adopted.model, adopted.version) == ("m", "2")
    assert fresh.effective_weights()[("m", "2")] == 0.0 and all(fresh.choose("m") == "1" for _ in range(200))
    assert fresh.rollbacks == [] and fresh.adopted == [adopted]  # counted where it was decided, once
    assert fresh.adopt([shared]) == []  # already applied
    assert fresh.standing() == [shared]  # and passed on, so a third router learns it from either

    # Under another weight (the operator gave the version a new chance), or for the baseline, or a
    # model this router has no policy for: not applied.
    renewed = policy(m={"weights": {"1": 80, "2": 20}, "rollback": ROLLBACK})
    assert renewed.adopt([shared]) == [] and renewed.effective_weights()[("m", "2")] == 0.2
    assert renewed.adopt([("m", "1", 80.0, "why")]) == [] and renewed.adopt([("other", "2", 10.0, "why")]) == []
    assert not policy(m={"weights": {"1": 1}}).judges
