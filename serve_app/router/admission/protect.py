"""The router's side of its own overload control: the class of a request from its headers or
call metadata, and whether the router takes it. Two policies decide (serve_app/scheduling/):
`ClassShedding` refuses a share of the lower classes while the router's loop delay stands
over its target, and `ClassConcurrency` bounds the requests in flight on the router, with
more room for the higher classes.

A refusal is sent at once. A held refusal (a tarpit) slows clients that send again at once,
but it keeps open-loop clients, which send whatever the answers, waiting for a "no" that
could have been immediate, and it keeps the connection and the request's memory on the router
meanwhile; Retry-After says when to come back.
"""

from __future__ import annotations

from collections.abc import Mapping

from serve_app.contract import Priority
from serve_app.errors import Overloaded, ServeAppError
from serve_app.router.admission.callers import Callers
from serve_app.scheduling.protection.concurrency import ClassConcurrency
from serve_app.scheduling.protection.overload import ClassShedding

RETRY_AFTER_S = 1.0


class RouterGate:
    """Takes a request into the router, or refuses it, from its headers alone. A request whose
    class cannot be told from its headers (a bad key or header) is not judged here: the full
    path answers it with its own 4xx. A class given only in the body counts as the header's
    default (the body is not read yet)."""

    def __init__(self, callers: Callers, shedding: ClassShedding | None, concurrency: ClassConcurrency | None) -> None:
        self.callers = callers
        self.shedding = shedding
        self.concurrency = concurrency

    def enter(self, headers: Mapping[str, str]) -> tuple[Priority | None, Overloaded | None]:
        """(the class now in flight, to `leave` when answered; or the refusal to send). Neither for
        a request not judged here. `headers`: lower-cased names, HTTP headers or gRPC metadata."""
        shedding, concurrency = self.shedding, self.concurrency
        shedding_now = shedding is not None and shedding.active
        if not shedding_now and concurrency is None:
            return None, None
        try:
            tenant = self.callers.authenticate(headers.get("authorization"))
            priority = self.callers.qos_from_headers(tenant, headers).priority
        except ServeAppError:
            return None, None
        if shedding is not None and shedding_now and shedding.refuses(priority):
            late_ms = shedding.standing_s * 1e3
            return None, Overloaded(f"router overloaded ({late_ms:.0f} ms behind); retry later", retry_after_s=RETRY_AFTER_S)
        if concurrency is None:
            return None, None
        if not concurrency.enter(priority):
            return None, Overloaded("router at its in-flight limit; retry later", retry_after_s=RETRY_AFTER_S)
        return priority, None

    def leave(self, priority: Priority | None) -> None:
        if priority is not None and self.concurrency is not None:
            self.concurrency.leave(priority)

    def status(self) -> dict[str, object]:
        return {
            **(self.shedding.status() if self.shedding is not None else {}),
            "concurrency": self.concurrency.status() if self.concurrency is not None else None,
        }
