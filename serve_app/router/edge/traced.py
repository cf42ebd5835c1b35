"""Each HTTP request to the router runs under a server span whose parent is the caller's W3C
`traceparent`, so the router's queue and batch spans, and the replicas' spans, join the
caller's trace. Outermost middleware: a request refused at the edge is traced too.

With no exporter installed and no `traceparent` on the request there is nothing to record or
carry, and the request passes straight through.
"""

from __future__ import annotations

import re

from opentelemetry.trace import Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.observability import tracing

_TRACE_HEADERS = (b"traceparent", b"tracestate")
_MODEL = re.compile(r"^/v2/models/([^/]+)")
_VERSION = re.compile(r"/versions/[^/]+")


def route_of(path: str) -> tuple[str, str | None]:
    """The path as a low-cardinality route (the model name and version as placeholders), and the model."""
    match = _MODEL.match(path)
    if match is None:
        return path, None
    route = "/v2/models/{model}" + _VERSION.sub("/versions/{version}", path[match.end() :])
    return route, match.group(1)


class TraceContext:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carried = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in _TRACE_HEADERS}
        if not carried and not tracing.exporting():
            await self.app(scope, receive, send)
            return
        route, model = route_of(scope["path"])
        attributes = {"http.request.method": scope["method"], "http.route": route, "url.path": scope["path"]}
        if model is not None:
            attributes["serve_app.model"] = model
        with tracing.server_span(f"{scope['method']} {route}", carried, attributes) as span:
            if span is None:  # a malformed traceparent alone: nothing to carry
                await self.app(scope, receive, send)
                return

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, send_traced)
