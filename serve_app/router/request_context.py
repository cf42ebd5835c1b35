"""One request as the router carries it, whichever wire it came on. `RouterParts` are the replica's,
wired once; a `RequestContext` is the request's, made once it is let in, and what every step of its
path reads: the name and version it asked for, who asked, how urgent it is and by when it must be
answered, whether the response cache may answer it, and where its time went."""

from __future__ import annotations

import time
from dataclasses import dataclass

from serve_app.contract import Priority
from serve_app.scheduling.dispatcher import RequestTiming
from serve_app.scheduling.tenants import Tenant


@dataclass(frozen=True)
class InferHeaders:
    """The request headers the infer endpoint reads."""

    priority: str | None = None  # X-Priority
    timeout_ms: str | None = None  # X-Request-Timeout-Ms
    authorization: str | None = None
    header_length: str | None = None  # Inference-Header-Content-Length (binary tensor extension)
    session_key: str | None = None  # X-Session-Key: sticky version assignment
    cache_control: str | None = None  # no-cache / no-store: skip the response cache
    traceparent: str | None = None  # W3C trace context (gRPC metadata; HTTP's is the middleware's)
    tracestate: str | None = None

    def as_metadata(self) -> dict[str, str]:
        """The headers the router's gate reads, by their lower-cased names, as HTTP gives them."""
        named = {"x-priority": self.priority, "x-request-timeout-ms": self.timeout_ms, "authorization": self.authorization}
        return {k: v for k, v in named.items() if v is not None}

    def trace_context(self) -> dict[str, str]:
        carried = {"traceparent": self.traceparent, "tracestate": self.tracestate}
        return {k: v for k, v in carried.items() if v}


@dataclass(slots=True)
class RequestContext:
    """What one admitted request needs on its way through the router, as one object (slots: it is
    made for every request)."""

    name: str  # the model or route it names
    version: str | None  # the version its path names; None: the model's traffic policy chooses
    tenant: Tenant  # authenticated, its arrival token charged
    priority: Priority  # capped by the tenant
    deadline: float | None  # monotonic seconds; None: the request set none
    session_key: str | None = None  # X-Session-Key: sticky version assignment
    use_cache: bool = False  # the response cache covers the name and the request did not opt out
    # Where the answer reports its time (HTTP's Server-Timing): perf_counter at its arrival, before
    # the key check and the body, and its time in queues and at replicas.
    started: float = 0.0
    timing: RequestTiming | None = None

    def deadline_or(self, timeout_s: float) -> float:
        """The request's own deadline, or one `timeout_s` from now (a generation's default)."""
        return self.deadline if self.deadline is not None else time.monotonic() + timeout_s

    def server_timing(self) -> str:
        """W3C Server-Timing: where its time went inside the router, so a client can tell it from
        the network's share."""
        assert self.timing is not None, "timed where the answer reports it"
        return self.timing.header(time.perf_counter() - self.started)
