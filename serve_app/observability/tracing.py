"""Distributed tracing: W3C trace context in and out, spans exported over OTLP when configured.

One request's trace: the router's server span (from the caller's `traceparent`, or a new trace),
its time in the router's queue and its model batch round trip as children, and on the model
replica the batch run, or a generation's prefill and decode steps, as children of those.

Two properties keep the request path cheap:
- Without an endpoint no SDK is installed: OpenTelemetry's API then only carries the caller's
  context, which is what propagation needs, and costs no span objects.
- Queue, batch and decode-step spans are recorded after the fact, from times the dispatcher and
  the scheduler keep anyway (`record`), so nothing on the hot path waits on a span.

Replicas get the context as the `traceparent` string (it pickles; an OTel Context does not).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from serve_app.config import TracingConfig

TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER_NAME = "serve_app"
# This process's exporting provider, once set up. Kept here rather than installed as the global
# provider, so that it can be shut down and replaced (tests), which the global cannot.
_provider: Any = None


def endpoint_of(config: TracingConfig) -> str | None:
    """Where spans go: the config's endpoint, else OpenTelemetry's own environment variables."""
    if config.otlp_endpoint:
        return config.otlp_endpoint
    env = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if env:
        return env
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return base.rstrip("/") + "/v1/traces" if base else None


def setup(config: TracingConfig, service: str) -> bool:
    """Start exporting this process's spans when an endpoint is configured (once per process);
    returns whether spans export."""
    global _provider
    endpoint = endpoint_of(config)
    if not config.enabled or endpoint is None:
        return False
    if _provider is not None:
        return True
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({"service.name": f"{config.service_name}.{service}", "service.namespace": config.service_name})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    exporter = OTLPSpanExporter(endpoint=endpoint, timeout=config.export_timeout_s)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=config.export_interval_ms))
    _provider = provider
    return True


def exporting() -> bool:
    """Whether this process records and exports spans."""
    return _provider is not None


def flush(timeout_s: float = 5.0) -> None:
    """Send what is buffered (a replica shutting down, or a test that reads the receiver)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Flush and stop exporting; a later `setup` starts afresh."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def tracer() -> trace.Tracer:
    """This process's exporting tracer; without one, OpenTelemetry's, which only carries contexts."""
    if _provider is not None:
        found: trace.Tracer = _provider.get_tracer(_TRACER_NAME)
        return found
    return trace.get_tracer(_TRACER_NAME)


def extract(headers: Mapping[str, str]) -> Context:
    """The caller's trace context from W3C `traceparent`/`tracestate` (empty when absent or malformed)."""
    return _PROPAGATOR.extract(headers)


def from_traceparent(value: str | None) -> Context | None:
    """A replica's parent context from the router's string; None when the request carries none."""
    if not value:
        return None
    ctx = extract({TRACEPARENT: value})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def current_traceparent() -> str | None:
    """The current span as a `traceparent` value for the next hop; None outside any trace."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get(TRACEPARENT)


def current() -> Context | None:
    """The current context when it belongs to a trace (recording or carried), else None: what a
    queued request keeps so that its queue and batch spans are recorded under it later."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    return otel_context.get_current()


@contextmanager
def server_span(name: str, carried: Mapping[str, str], attributes: Mapping[str, Any]) -> Iterator[trace.Span | None]:
    """The router's span for one request, a child of the caller's context (`carried`: its
    `traceparent` and `tracestate`), current while it runs. None, at no cost, when there is
    neither a caller's context to carry nor an exporter."""
    if _provider is None and not carried.get(TRACEPARENT):
        yield None
        return
    with tracer().start_as_current_span(
        name, context=extract(carried), kind=SpanKind.SERVER, attributes=dict(attributes), record_exception=False,
        set_status_on_exception=False,
    ) as span:  # fmt: skip
        yield span


def wall_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as epoch nanoseconds (what span timestamps are)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def record(
    name: str,
    parent: Context | None,
    start_s: float,
    end_s: float,
    attributes: Mapping[str, Any] | None = None,
    error: BaseException | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    links: list[Context] | None = None,
) -> Context | None:
    """A finished span between two `time.monotonic()` readings, under `parent`. Returns the
    context of the new span (for children recorded after it), or None when nothing records."""
    if parent is None or _provider is None:
        return None
    span_links = [Link(trace.get_current_span(c).get_span_context()) for c in links or ()]
    span = tracer().start_span(
        name, context=parent, kind=kind, attributes=dict(attributes or {}), start_time=wall_ns(start_s), links=span_links
    )
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        span.set_attribute("error.type", type(error).__name__)
    span.end(end_time=wall_ns(end_s))
    return trace.set_span_in_context(span, parent)


class OpenSpan:
    """A span begun at a past `time.monotonic()` reading and ended later, for work whose
    children (on another process) need its id before it ends: a batch's round trip."""

    def __init__(self, span: trace.Span | None, parent: Context) -> None:
        self.span = span
        self.context = trace.set_span_in_context(span, parent) if span is not None else parent
        self.traceparent = _traceparent_of(self.context)

    @classmethod
    def start(cls, name: str, parent: Context, start_s: float, attributes: Mapping[str, Any], internal: bool = False) -> OpenSpan:
        """`internal`: work in this process; otherwise a call to another (the span is the client's side)."""
        if _provider is None:  # nothing records: the next hop still gets the caller's context
            return cls(None, parent)
        kind = SpanKind.INTERNAL if internal else SpanKind.CLIENT
        span = tracer().start_span(name, context=parent, kind=kind, attributes=dict(attributes), start_time=wall_ns(start_s))
        return cls(span, parent)

    def set(self, key: str, value: Any) -> None:
        if self.span is not None:
            self.span.set_attribute(key, value)

    def end(self, end_s: float, error: BaseException | None = None) -> None:
        if self.span is None:
            return
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            self.span.set_attribute("error.type", type(error).__name__)
        self.span.end(end_time=wall_ns(end_s))


def _traceparent_of(ctx: Context) -> str | None:
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier.get(TRACEPARENT)
