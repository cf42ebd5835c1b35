"""The router's side of its own overload control (serve_app/scheduling/overload.py): the class
of a request from its headers or call metadata, and the refusal it gets while the router's
standing delay sheds that class.

A refusal is sent at once. A held refusal (a tarpit) slows clients that send again at once,
but it keeps open-loop clients, which send whatever the answers, waiting for a "no" that
could have been immediate, and it keeps the connection and the request's memory on the router
meanwhile; Retry-After says when to come back.
"""

from __future__ import annotations

from collections.abc import Mapping

from serve_app.errors import Overloaded, ServeAppError
from serve_app.router.callers import Callers
from serve_app.scheduling.overload import ClassShedding

RETRY_AFTER_S = 1.0


class RouterShedding:
    """Refuses the share of each class that `ClassShedding` sheds now. A request whose class
    cannot be told from its headers (a bad key or header) is not judged here: the full path
    answers it with its own 4xx."""

    def __init__(self, callers: Callers, shedding: ClassShedding) -> None:
        self.callers = callers
        self.shedding = shedding

    def refusal(self, headers: Mapping[str, str]) -> Overloaded | None:
        """The 503 for this request, or None to go on. `headers`: lower-cased names, HTTP
        headers or gRPC metadata alike; the class is the header's, else the default, capped
        by the caller's tenant."""
        if not self.shedding.active:
            return None
        try:
            tenant = self.callers.authenticate(headers.get("authorization"))
            priority = self.callers.qos_from_headers(tenant, headers).priority
        except ServeAppError:
            return None
        if not self.shedding.refuses(priority):
            return None
        return Overloaded(
            f"router overloaded ({self.shedding.standing_s * 1e3:.0f} ms behind); retry later", retry_after_s=RETRY_AFTER_S
        )
