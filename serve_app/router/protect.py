"""The router's side of priority protection (serve_app/scheduling/protection.py): the class of a
request from its headers, in flight from the gate to its answer, and the refusals it gives.

A refusal is answered after a short random hold, as HAProxy's tarpit answers a client it turns
away. A closed-loop client that ignores Retry-After and sends again at once would otherwise
keep every connection ready on the router's loop with refusals alone, and a loop turn full of
refusals delays a high-priority request's steps as much as one full of served requests. The hold
costs a timer, not CPU; it is capped by the request's own timeout and by how many are held.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from starlette.responses import Response

from serve_app.contract import Priority
from serve_app.errors import Overloaded, ServeAppError
from serve_app.protocols.errors import error_response
from serve_app.router.callers import Callers
from serve_app.router.qos import TIMEOUT_HEADER
from serve_app.scheduling.protection import ClassProtection

RETRY_AFTER_S = 1.0
HOLD_S = RETRY_AFTER_S  # a refusal waits between half of this and this before it is sent
MAX_HELD = 512  # refusals held at once; past it they are sent at once


class PriorityGuard:
    def __init__(self, callers: Callers, protection: ClassProtection, rng: Callable[[], float] = random.random) -> None:
        self.callers = callers
        self.protection = protection
        self.rng = rng
        self.held = 0

    def enter(self, path: str, headers: dict[str, str]) -> tuple[Priority | None, Response | None]:
        """(the class now in flight, to `leave` when answered; or the refusal to send). A request
        whose key or headers are bad is neither: the full path answers it with its 4xx."""
        try:
            tenant = self.callers.authenticate(headers.get("authorization"))
            priority = self.callers.qos_from_headers(tenant, headers).priority
        except ServeAppError:
            return None, None
        if self.protection.enter(priority):
            return priority, None
        busy = Overloaded("router busy with higher-priority work; retry later", retry_after_s=RETRY_AFTER_S)
        return None, error_response(path, busy)

    def leave(self, priority: Priority) -> None:
        self.protection.leave(priority)

    def hold_s(self, headers: dict[str, str]) -> float:
        """How long to hold a refusal: random, so refused clients do not come back in step."""
        if self.held >= MAX_HELD:
            return 0.0
        hold = HOLD_S * (0.5 + 0.5 * self.rng())
        try:
            timeout_s = float(headers.get(TIMEOUT_HEADER, "")) / 1e3
        except ValueError:
            return hold
        return min(hold, max(0.0, timeout_s / 2))

    async def hold(self, headers: dict[str, str]) -> None:
        if (seconds := self.hold_s(headers)) <= 0:
            return
        self.held += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self.held -= 1
