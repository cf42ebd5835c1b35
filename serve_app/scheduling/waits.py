"""How long a queued request may wait: one timer per ticket that fires at the nearest of its
limits, wherever the ticket is then (queued, or in a batch the model has not answered yet).

No Ray here; the dispatcher says what each outcome does to the ticket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from serve_app.scheduling.queue import Ticket

TIMER_SLACK_S = 0.002  # how early an event loop's timer may fire (uvloop: whole milliseconds)


def watch_wait(
    loop: asyncio.AbstractEventLoop,
    ticket: Ticket,
    starve_at: float,
    clock: Callable[[], float],
    expire: Callable[[bool], None],
    starve: Callable[[], None],
) -> None:
    """Call `expire(queued)` when the ticket's deadline passes, or `starve()` when it is still
    queued at `starve_at`; nothing once its result is set (the timer goes with it)."""
    timer: asyncio.Handle | None = None

    def check() -> None:
        nonlocal timer
        if ticket.result.done():
            return
        # uvloop rounds a timer to whole milliseconds and may fire it that much early.
        now, queued = clock() + TIMER_SLACK_S, not ticket.done
        if ticket.deadline is not None and now >= ticket.deadline:
            expire(queued)
        elif queued and now >= starve_at:
            starve()
        else:  # early, or in a batch now: wait for the nearest limit still to keep
            limits = [b for b in (starve_at if queued else None, ticket.deadline) if b is not None]
            if limits:
                timer = loop.call_later(max(0.0, min(limits) - clock()), check)

    first = starve_at if ticket.deadline is None else min(starve_at, ticket.deadline)
    timer = loop.call_later(max(0.0, first - clock()), check)
    ticket.result.add_done_callback(lambda _: timer.cancel() if timer is not None else None)
