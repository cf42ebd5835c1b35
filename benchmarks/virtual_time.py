"""An asyncio event loop on a virtual clock: timers take no wall time. The policy tests run on it,
and so does the scheduling simulation (benchmarks/simulate.py): what they measure is exact
however loaded the machine is."""

from __future__ import annotations

import asyncio
import selectors


class Clock:
    """A clock the test moves by hand: `clock.now = 5`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _TimeTravellingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Instead of sleeping until the loop's next timer, moves the virtual clock there."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout > 0:
            self.clock.now += timeout
            timeout = 0
        return super().select(timeout)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock: `asyncio.sleep` and timers take no wall time, and
    `loop.time()` moves only when every task waits on a timer, by exactly that timer's delay.
    Tests of timing policies on it are exact however loaded the machine is."""

    def __init__(self) -> None:
        self.clock = Clock()
        super().__init__(_TimeTravellingSelector(self.clock))

    def time(self) -> float:
        return self.clock.now
