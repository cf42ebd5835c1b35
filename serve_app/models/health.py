"""How long a replica's running work has run: what its `check_health` reads.

Serve calls a deployment's `check_health` every few seconds and replaces a replica whose
check raises. A replica can be alive and still useless: a batch or a decode step that
never returns (a wedged device, a deadlocked library) holds every request queued behind
it. Each unit of work is stamped when it starts and cleared when it ends; work older
than the replica's `stall_timeout_s` fails the check.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Stalled(RuntimeError):
    """Work has run past its limit: the replica reports itself unhealthy."""


class StallWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._started: dict[int, float] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # work is stamped from worker threads, read from the event loop

    @contextmanager
    def running(self) -> Iterator[None]:
        """Stamp one unit of work for as long as the block runs."""
        with self._lock:
            key = next(self._ids)
            self._started[key] = self.clock()
        try:
            yield
        finally:
            with self._lock:
                del self._started[key]

    def __len__(self) -> int:
        """Units of work running now."""
        return len(self._started)

    def longest_s(self) -> float:
        """Seconds the longest-running unit has run so far; 0 when nothing runs."""
        with self._lock:
            oldest = min(self._started.values(), default=None)
        return 0.0 if oldest is None else self.clock() - oldest

    def check(self, limit_s: float, what: str) -> None:
        if (longest := self.longest_s()) > limit_s:
            raise Stalled(f"{what} has run for {longest:.0f} s (limit {limit_s:g} s)")


class LoopProgress:
    """Whether a loop that owes work is stepping: the other half of a decode loop's health.

    `StallWatch` sees a step that never returns; this sees the loop that takes no step at all
    while sequences wait (it died, or waits on a wake-up that never comes). Progress is the
    end of a step, or work arriving at a loop that had none: an idle loop owes nothing."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last = clock()

    def arrived(self, had_work: bool) -> None:
        """Work was submitted; `had_work`: whether the loop owed work before it."""
        if not had_work:
            self.last = self.clock()

    def stepped(self) -> None:
        self.last = self.clock()

    def check(self, has_work: bool, stepping: bool, alive: bool, limit_s: float, what: str) -> None:
        if not has_work or stepping:
            return
        if not alive:
            raise Stalled(f"{what}: work is waiting and the loop is not running")
        if (idle := self.clock() - self.last) > limit_s:
            raise Stalled(f"{what}: work has waited {idle:.0f} s without a step (limit {limit_s:g} s)")
