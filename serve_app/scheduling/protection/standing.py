"""A model queue's standing delay and the share of each class it sheds (CoDel at admission).

The backstop behind the dispatcher's wait budgets (`DispatchSettings.wait_budget_s`), which
refuse from the predicted wait: should that prediction run short (a model that slowed down
since it was learned), the queue stands longer than the budgets allow, and this sheds. Its
signal is the age of the oldest request still queued, sampled at every admission and release,
which no estimate can get wrong. The level and the class order are `ClassShedding`'s
(serve_app/scheduling/protection/overload.py).

A request is drawn for once: at its precheck from the headers when it has one (before its body
is read), else at admission; drawing at both would refuse more than the share. The mark lives
in the request's own context, where its check and its admission both run.

No Ray and no event loop here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar

from serve_app.contract import Priority
from serve_app.scheduling.protection.overload import ClassShedding

# The model whose queue this request was already drawn for from its headers.
_DRAWN_FOR: ContextVar[str | None] = ContextVar("serve_app_shed_drawn_for", default=None)


class QueueShedding:
    """The standing-delay shedding of one model's queue."""

    def __init__(self, model: str, target_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        # Judged over an interval no shorter than the target: a queue that drains within the
        # target is not standing, however it looked for a moment.
        self.shedding = ClassShedding(target_s, interval_s=max(0.1, target_s), clock=clock)

    def follow(self, oldest_wait_s: float) -> None:
        """A sample of the queue: its oldest request's age now (0 when empty)."""
        self.shedding.observe(oldest_wait_s)

    def refuses(self, priority: Priority, precheck: bool) -> bool:
        """Whether to refuse this request now (counted); `precheck`: judged from its headers."""
        if precheck:
            _DRAWN_FOR.set(self.model)
        elif (drawn_for := _DRAWN_FOR.get()) is not None:
            # Any admission ends the mark: one for another queue (a version the traffic policy chose,
            # a route's other tier) draws on its own, and nothing later in this context (a shadow
            # sent off the request's path) inherits a draw it did not have.
            _DRAWN_FOR.set(None)
            if drawn_for == self.model:
                return False
        return self.shedding.refuses(priority)

    def status(self) -> dict[str, object]:
        return self.shedding.status()
