"""How long a queued request may wait: a timer per ticket with a deadline that fires at the
nearest of its limits, wherever the ticket is then (queued, or in a batch the model has not
answered yet), and one timer per lane for the rest (`WaitBounds`).

No Ray here; the dispatcher says what each outcome does to the ticket.
"""

from __future__ import annotations

import asyncio
import contextvars
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


class WaitBounds:
    """The bounds on one lane's waits: each ticket with a deadline gets its own timer
    (`watch_wait`); the rest, nearly every request, share one timer that fires when the oldest
    of them has been queued `max_queued_s` (a timer per request would cost the router more than
    the request's own admission, for a bound that rarely fires). `queued()` lists the lane's
    queued tickets; `expire(ticket, queued)` and `starve(ticket)` answer one."""

    def __init__(
        self,
        queued: Callable[[], list[Ticket]],
        max_queued_s: float,
        clock: Callable[[], float],
        expire: Callable[[Ticket, bool], None],
        starve: Callable[[Ticket], None],
    ) -> None:
        self.queued, self.max_queued_s, self.clock = queued, max_queued_s, clock
        self.expire, self.starve = expire, starve
        self.timer: asyncio.TimerHandle | None = None  # the shared one, while armed

    def admitted(self, loop: asyncio.AbstractEventLoop, ticket: Ticket) -> None:
        """Bound a ticket just queued."""
        if ticket.deadline is not None:
            starve_at = ticket.enqueued + self.max_queued_s
            expire = lambda queued: self.expire(ticket, queued)  # noqa: E731
            watch_wait(loop, ticket, starve_at, self.clock, expire, lambda: self.starve(ticket))
        elif self.timer is None:  # none queued without a deadline before this one
            self._arm(loop, self.max_queued_s)

    def _arm(self, loop: asyncio.AbstractEventLoop, delay_s: float) -> None:
        # In a context of its own (see the dispatcher's `_detached`): it outlives the request that armed it.
        self.timer = loop.call_later(max(0.0, delay_s), self._starve_old, loop, context=contextvars.Context())

    def _starve_old(self, loop: asyncio.AbstractEventLoop) -> None:
        """Refuse the queued tickets without a deadline that have waited `max_queued_s`; then wait
        for the oldest one left."""
        self.timer = None
        now = self.clock() + TIMER_SLACK_S  # an event loop may fire a timer a little early
        oldest: float | None = None
        for ticket in self.queued():
            if ticket.deadline is not None or ticket.result.done():
                continue  # its own timer keeps its bounds / answered meanwhile
            if now >= ticket.enqueued + self.max_queued_s:
                self.starve(ticket)
            elif oldest is None or ticket.enqueued < oldest:
                oldest = ticket.enqueued
        if oldest is not None:
            self._arm(loop, oldest + self.max_queued_s - self.clock())
