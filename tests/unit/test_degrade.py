"""The degradation policy of a tiered route (serve_app/scheduling/protection/degrade.py): which
classes, when, and how much, on a fake clock and a fixed draw. No Ray."""

import pytest

from serve_app.contract import Priority
from serve_app.scheduling.protection.degrade import Degrading

from .fakes import Clock

LOW, NORMAL, HIGH = Priority.LOW, Priority.NORMAL, Priority.HIGH
TARGET = 0.2  # the heavy queue's standing delay over which degrading starts; its window too


def stand(policy: Degrading, clock: Clock, delay_s: float, seconds: float, step: float = 0.01) -> None:
    """The heavy queue's oldest request `delay_s` old, sampled every `step` for `seconds`."""
    for _ in range(round(seconds / step)):
        clock.now += step
        policy.follow(delay_s)


def make(priorities=(LOW, NORMAL), draw: float = 0.5) -> tuple[Degrading, Clock]:
    clock = Clock()
    return Degrading(priorities, TARGET, clock=clock, draw=lambda: draw), clock


def test_below_the_target_nothing_degrades_whatever_the_class():
    policy, clock = make(draw=0.0)
    stand(policy, clock, TARGET * 0.9, 10.0)
    assert not any(policy.before_heavy(p) for p in (LOW, NORMAL, HIGH))
    assert policy.degraded == {}


def test_a_burst_shorter_than_the_window_degrades_nothing():
    policy, clock = make(draw=0.0)
    stand(policy, clock, 0.0, 0.05)
    stand(policy, clock, 5.0, TARGET * 0.5)  # one very late half-window, then on time again
    stand(policy, clock, 0.0, 0.2)
    assert policy.share(LOW) == 0.0 and not policy.before_heavy(LOW)


def test_a_standing_queue_degrades_low_first_then_normal_never_high():
    policy, clock = make(draw=0.0)
    stand(policy, clock, 2 * TARGET, 0.6)  # a little over: part of low
    assert 0.0 < policy.share(LOW) < 1.0 and policy.share(NORMAL) == 0.0
    assert policy.before_heavy(LOW) and not policy.before_heavy(NORMAL)
    stand(policy, clock, 5 * TARGET, 3.0)  # far over for long: all of low, then normal
    assert policy.share(LOW) == 1.0 and policy.share(NORMAL) > 0.0
    assert policy.before_heavy(NORMAL)
    assert not policy.before_heavy(HIGH) and policy.share(HIGH) == 0.0


def test_how_much_follows_the_draw_at_the_level():
    clock = Clock()
    draws = iter([0.1, 0.9])
    policy = Degrading((LOW,), TARGET, clock=clock, draw=lambda: next(draws))
    stand(policy, clock, 2 * TARGET, 0.6)
    share = policy.share(LOW)
    assert 0.1 < share < 0.9
    assert policy.before_heavy(LOW) is True  # drew under the share
    assert policy.before_heavy(LOW) is False  # drew over it
    assert policy.degraded == {"low": 1}


def test_the_level_falls_back_once_the_queue_is_under_its_target():
    policy, clock = make(draw=0.0)
    stand(policy, clock, 5 * TARGET, 3.0)
    assert policy.share(NORMAL) > 0.0
    stand(policy, clock, 0.0, 10.0)
    assert policy.share(LOW) == 0.0 and not policy.before_heavy(LOW)


def test_a_class_the_route_does_not_list_never_degrades_and_takes_the_refusal():
    policy, clock = make(priorities=(LOW,), draw=0.0)
    stand(policy, clock, 5 * TARGET, 3.0)
    assert policy.share(NORMAL) == 0.0 and not policy.before_heavy(NORMAL)
    assert policy.after_refusal(LOW) is True
    assert policy.after_refusal(NORMAL) is False


def test_after_a_refusal_a_listed_high_class_gets_the_light_answer():
    policy, _ = make(priorities=(LOW, NORMAL, HIGH))
    assert policy.after_refusal(HIGH) is True
    assert policy.before_heavy(HIGH) is False  # never ahead of the heavy tier
    assert policy.degraded == {"high": 1}


def test_an_empty_list_turns_degrading_off():
    policy, clock = make(priorities=(), draw=0.0)
    stand(policy, clock, 10 * TARGET, 5.0)
    assert not policy.enabled and policy.share(LOW) == 0.0
    assert not policy.before_heavy(LOW) and not policy.after_refusal(LOW)
    assert policy.status()["priorities"] == []


def test_status_reports_the_level_shares_and_counts():
    policy, clock = make(draw=0.0)
    stand(policy, clock, 5 * TARGET, 3.0)
    policy.before_heavy(LOW)
    status = policy.status()
    assert status["priorities"] == ["low", "normal"] and status["target_ms"] == pytest.approx(TARGET * 1e3)
    assert status["share"] == {"normal": policy.share(NORMAL), "low": 1.0} and status["degraded"] == {"low": 1}
