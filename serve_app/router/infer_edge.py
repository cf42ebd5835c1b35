"""v2 infer's edge as one call: the key, the header-only shedding, the body limit and the infer
fast path, for the calls Serve's direct ingress hands the router (serve_app.router.direct).

Each of those checks is an ASGI middleware of its own (serve_app.router.edge, shedgate,
fastpath), and for every other path they stay so. On the inference path, which carries nearly
every request, a layer per check meant a coroutine, a wrapped `receive` and a pass over the
headers per layer: together they cost the router more than the request's own admission. Here
the headers are read once and each check is the same call its middleware makes, in the same
order, with the same answers. A request that carries a trace context, or any request while
spans export, goes through the layers as before (TraceContext is the outermost of them).
"""

from __future__ import annotations

from serve_app.errors import ServeAppError, Unauthorized
from serve_app.observability import tracing
from serve_app.protocols.errors import error_response
from serve_app.router.direct import infer_route
from serve_app.router.edge import BodyBudget
from serve_app.router.fastpath import WANTED, answer, wanted_headers
from serve_app.router.parts import RouterParts
from serve_app.router.shedgate import ASGIApp, Check, Receive, Scope, Send

_TRACE = (b"traceparent", b"tracestate")
_READ = frozenset((*WANTED, *_TRACE, b"content-length"))
# What the header check reads, by the names HTTP gives them (serve_app.router.qos).
_GATE = ((b"x-priority", "x-priority"), (b"x-request-timeout-ms", "x-request-timeout-ms"), (b"authorization", "authorization"))


class InferEdge:
    """The edge and the fast path for v2 infer calls; `layered` is the same app layer by layer."""

    def __init__(self, parts: RouterParts, layered: ASGIApp, check: Check, max_bytes: int) -> None:
        self.parts = parts
        self.layered = layered
        self.check = check
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        route = infer_route(path)
        if route is None or scope["method"] != "POST":
            await self.layered(scope, receive, send)
            return
        h = wanted_headers(scope["headers"], _READ)  # one pass over the headers for every check
        if b"traceparent" in h or b"tracestate" in h or tracing.exporting():
            await self.layered(scope, receive, send)
            return
        parts = self.parts
        try:
            parts.callers.authenticate(h.get(b"authorization"))  # KeyGate
        except Unauthorized as e:
            await error_response(path, e)(scope, receive, send)
            return
        except ServeAppError:
            pass  # anything else is the endpoint's to answer
        gate = {header: h[key] for key, header in _GATE if key in h}
        router_gate = parts.gate  # ShedGate: the router's own overload control, then admission's check
        priority, refused = router_gate.enter(gate) if router_gate is not None else (None, None)
        if refused is not None:
            await error_response(path, refused)(scope, receive, send)
            return
        try:
            await self._checked(scope, receive, send, path, route, h, gate)
        finally:
            if router_gate is not None:
                router_gate.leave(priority)

    async def _checked(
        self, scope: Scope, receive: Receive, send: Send, path: str, route: tuple[str, str | None], h: dict[bytes, str],
        gate: dict[str, str],
    ) -> None:  # fmt: skip
        refusal = self.check(path, route[0], gate)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        budget = BodyBudget(self.max_bytes, self.parts.inflight_bytes)  # BodyLimit
        try:
            declared = h.get(b"content-length")
            too_much = budget.open(None if declared is None else declared.encode("latin-1"))
            if too_much is not None:
                await error_response(path, too_much)(scope, receive, send)
                return
            await answer(self.parts, scope, receive, send, route, h, budget.count)
        finally:
            budget.close()
