"""A direct call's lifetime on the router's HTTP server: the client that may leave, and the
whole-call time limit (serve_app.router.edge.direct says what each stands in for)."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Receive


class ClientWatch(asyncio.Event):
    """Stands in for a uvicorn request cycle's message event, which the server sets on each body
    chunk, at the response's end and when the connection is lost. On the last, with the answer not
    yet complete, it cancels the task serving the request: the same notice Serve's client-watch
    task gives, without a task. `expire` cancels it the same way when the call's time is up."""

    def __init__(self, cycle: Any, task: asyncio.Task[Any], event: asyncio.Event) -> None:
        super().__init__()
        self.cycle = cycle
        self.task = task
        self.event = event  # the cycle's own, given back by `release`
        if event.is_set():  # a body chunk that arrived before the app started
            super().set()
        self.left = False
        self.timed_out = False

    def set(self) -> None:
        super().set()
        if self.cycle.disconnected and not (self.left or self.timed_out):
            self.left = True
            self.task.cancel()

    def expire(self) -> None:
        if not (self.left or self.timed_out):
            self.timed_out = True
            self.task.cancel()

    def release(self) -> None:
        """Once the call is over: give the cycle back its own event, in this watch's state. The
        cycle holding this watch while the watch holds the cycle (and the task, its coroutine and
        context) is a reference cycle, which only a full garbage collection frees; under a spike
        thousands of them pile up and every full collection after it stops the event loop for longer."""
        if self.is_set():
            self.event.set()
        else:
            self.event.clear()
        self.cycle.message_event = self.event


class Deadlines:
    """The whole-call time limit of the calls one server sends the direct way, from one timer: a check every
    `tick_s` (a quarter of the limit, at most a second) expires the calls past their deadline.
    A timeout per call (`asyncio.timeout`) would schedule and cancel a timer handle for every
    request, for a limit that almost never fires; here a call costs a dict entry, and the
    limit fires at most a tick late."""

    def __init__(self) -> None:
        self.calls: dict[ClientWatch, float] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tick_s = 1.0

    def add(self, watch: ClientWatch, limit_s: float) -> None:
        loop = asyncio.get_running_loop()
        self.calls[watch] = loop.time() + limit_s
        # A tick pending on another loop (one that closed) or cancelled would never come here.
        if self.timer is None or self.timer.cancelled() or self.loop is not loop:
            self.tick_s = min(1.0, limit_s / 4)
            self.loop = loop
            self.timer = loop.call_later(self.tick_s, self._check, loop)

    def discard(self, watch: ClientWatch) -> None:
        self.calls.pop(watch, None)

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        now = loop.time()
        try:
            for watch in [w for w, deadline in self.calls.items() if deadline <= now]:
                del self.calls[watch]
                watch.expire()
        finally:  # whatever happened to one call, the others keep their limit
            if self.calls:
                self.timer = loop.call_later(self.tick_s, self._check, loop)


def watch_client(receive: Receive) -> ClientWatch | None:
    """Watch the client of the request whose `receive` this is; None where the server is not
    uvicorn's (no cycle to watch), or the client has left already."""
    cycle: Any = getattr(receive, "__self__", None)
    event = getattr(cycle, "message_event", None)
    task = asyncio.current_task()
    if not isinstance(event, asyncio.Event) or task is None or getattr(cycle, "disconnected", True):
        return None
    watch = ClientWatch(cycle, task, event)
    cycle.message_event = watch
    return watch
