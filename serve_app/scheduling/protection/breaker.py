"""Per-model circuit breaker: stop sending work to a model that keeps failing.

closed -> open after `failure_threshold` failed batches in a row (errors or
timeouts; a client's bad input is not a model failure). While open, requests
fail fast (or fall back to the route's other tier) without reaching the model.
After `open_s` one probe batch is let through (half-open): success closes the
breaker, failure opens it again for another `open_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import IntEnum


class BreakerState(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 5, open_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1 or open_s <= 0:
            raise ValueError(f"need failure_threshold >= 1 and open_s > 0, got {failure_threshold}, {open_s}")
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.clock = clock
        self._state = BreakerState.CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.probing = False
        self.probe_started = 0.0

    @property
    def state(self) -> BreakerState:
        if self._state == BreakerState.OPEN and self.clock() >= self.opened_at + self.open_s:
            return BreakerState.HALF_OPEN
        return self._state

    def retry_after_s(self) -> float:
        return max(0.0, self.opened_at + self.open_s - self.clock())

    def allow(self) -> bool:
        """May a request go to the model now? In half-open, only one probe at a time."""
        state = self.state
        if state == BreakerState.CLOSED:
            return True
        now = self.clock()
        # A probe that never reported (its request was refused or cancelled) stops blocking after open_s.
        if state == BreakerState.HALF_OPEN and (not self.probing or now - self.probe_started > self.open_s):
            self._state = BreakerState.HALF_OPEN
            self.probing = True
            self.probe_started = now
            return True
        return False

    def on_success(self) -> None:
        self._state = BreakerState.CLOSED
        self.failures = 0
        self.probing = False

    def on_failure(self) -> None:
        self.failures += 1
        if self._state == BreakerState.HALF_OPEN or self.failures >= self.failure_threshold:
            self._state = BreakerState.OPEN
            self.opened_at = self.clock()
        self.probing = False
