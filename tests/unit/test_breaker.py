import pytest

from serve_app.scheduling.protection.breaker import BreakerState, CircuitBreaker
from tests.unit.fakes import Clock


def test_opens_after_consecutive_failures_only():
    b = CircuitBreaker(failure_threshold=3, open_s=5, clock=Clock())
    b.on_failure()
    b.on_failure()
    b.on_success()  # a success in between resets the count
    b.on_failure()
    b.on_failure()
    assert b.state == BreakerState.CLOSED and b.allow()
    b.on_failure()
    assert b.state == BreakerState.OPEN and not b.allow()


def test_half_open_lets_one_probe_through_and_its_result_decides():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, open_s=5, clock=clock)
    b.on_failure()
    assert not b.allow() and b.retry_after_s() == 5
    clock.now = 5
    assert b.state == BreakerState.HALF_OPEN
    assert b.allow()  # the probe
    assert not b.allow()  # nobody else while it runs
    b.on_failure()
    assert b.state == BreakerState.OPEN and not b.allow()
    clock.now = 10
    assert b.allow()
    b.on_success()
    assert b.state == BreakerState.CLOSED and b.allow() and b.allow()


def test_rejects_nonsense_settings():
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
