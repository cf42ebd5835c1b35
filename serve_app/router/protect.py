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
from collections.abc import Awaitable, Callable, Mapping

from serve_app.contract import Priority
from serve_app.errors import Overloaded, ServeAppError
from serve_app.router.callers import Callers
from serve_app.router.qos import PRIORITY_HEADER, TIMEOUT_HEADER
from serve_app.scheduling.protection import ClassProtection

RETRY_AFTER_S = 1.0
HOLD_S = RETRY_AFTER_S  # a refusal waits between half of this and this before it is sent
MAX_HELD = 512  # refusals held at once, at most; past it they are sent at once


class PriorityGuard:
    """Counts a request in flight by its class from the gate to its answer, and turns away the
    excess of a capped class. Only requests whose class the headers settle are counted: with an
    `X-Priority` header (headers win over body parameters), on a known model or a generation
    path. Anything else (a class in the body, a bad key or header, an unknown model) passes
    uncounted to the full path, which answers it as before."""

    def __init__(
        self,
        callers: Callers,
        protection: ClassProtection,
        is_known: Callable[[str], bool],
        max_held: int = MAX_HELD,
        rng: Callable[[], float] = random.random,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.callers = callers
        self.protection = protection
        self.is_known = is_known
        self.max_held = max_held  # see serve_app.router.parts._guard
        self.rng, self.sleep = rng, sleep
        self.held = 0

    def enter(self, name: str, headers: Mapping[str, str]) -> tuple[Priority | None, Overloaded | None]:
        """(the class now in flight, to `leave` when answered; or the refusal, to send in the
        protocol's shape after `hold`). Neither for a request this guard does not judge (see the
        class). `headers`: lower-cased names, HTTP headers or gRPC metadata alike."""
        if PRIORITY_HEADER not in headers or (name and not self.is_known(name)):
            return None, None
        try:
            tenant = self.callers.authenticate(headers.get("authorization"))
            priority = self.callers.qos_from_headers(tenant, headers).priority
        except ServeAppError:
            return None, None
        if self.protection.enter(priority):
            return priority, None
        return None, Overloaded("router busy with higher-priority work; retry later", retry_after_s=RETRY_AFTER_S)

    def leave(self, priority: Priority) -> None:
        self.protection.leave(priority)

    def hold_s(self, headers: Mapping[str, str]) -> float:
        """How long to hold a refusal: random, so refused clients do not come back in step; at most
        half the request's own timeout (a valid one: the guard judged only those); none while
        `max_held` are held."""
        if self.held >= self.max_held:
            return 0.0
        hold = HOLD_S * (0.5 + 0.5 * self.rng())
        timeout_ms = headers.get(TIMEOUT_HEADER)
        return hold if timeout_ms is None else min(hold, float(timeout_ms) / 2e3)

    async def hold(self, headers: Mapping[str, str]) -> None:
        if (seconds := self.hold_s(headers)) <= 0:
            return
        self.held += 1
        try:
            await self.sleep(seconds)
        finally:
            self.held -= 1
