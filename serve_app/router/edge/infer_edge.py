"""Every v2 infer call's one way in: the key, the header-only shedding, the body limit and the
answer, in one call, whether Serve's wrapper or the direct path (serve_app.router.edge.direct) hands
the call to the router's app.

Each check is the same function its middleware calls for every other path (serve_app.router.edge.checks,
shedgate): the key, the router's overload gate and admission's header check, the body budget.
Layered as middlewares, a layer per check meant a coroutine, a wrapped `receive` and a pass over
the headers per layer, which together cost the router more than the request's own admission; here
the headers are read once. FastAPI's routing, dependency solving and exception middleware are
left out too; the FastAPI route stays declared (serve_app.router.endpoints.endpoints_v2) so that
`/openapi.json` documents the endpoint and Serve names its route, but no call reaches it. A call
that carries a trace context, or any call while spans export, is answered the same way inside a
server span (TraceContext). Every other request goes to `layered`, the middlewares and FastAPI.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.errors import ServeAppError, Unauthorized
from serve_app.observability import tracing
from serve_app.protocols.errors import error_response, from_http_exception
from serve_app.router.edge.checks import BodyBudget
from serve_app.router.edge.direct import infer_route
from serve_app.router.edge.failures import unexpected
from serve_app.router.edge.shedgate import Check
from serve_app.router.edge.traced import TraceContext
from serve_app.router.endpoints.infer_v2 import answer_infer
from serve_app.router.parts import RouterParts
from serve_app.router.request_context import InferHeaders

# The headers the infer endpoint reads, as ASGI gives them (lower-cased bytes).
WANTED = (
    b"x-priority", b"x-request-timeout-ms", b"authorization", b"inference-header-content-length", b"x-session-key",
    b"cache-control",
)  # fmt: skip


def wanted_headers(raw: list[tuple[bytes, bytes]], wanted: Collection[bytes] = WANTED) -> dict[bytes, str]:
    """The `wanted` headers (by default the endpoint's), the first of each when repeated (as
    Starlette's `Headers.get`)."""
    found: dict[bytes, str] = {}
    for k, v in raw:
        if k in wanted and k not in found:
            found[k] = v.decode("latin-1")
    return found


_TRACE = (b"traceparent", b"tracestate")
_READ = frozenset((*WANTED, *_TRACE, b"content-length"))
# What the header check reads, by the names HTTP gives them (serve_app.router.admission.qos).
_GATE = ((b"x-priority", "x-priority"), (b"x-request-timeout-ms", "x-request-timeout-ms"), (b"authorization", "authorization"))


def relative_path(scope: Scope) -> str:
    """The request's path under the app's route prefix (Serve passes it whole, beside `root_path`)."""
    path: str = scope["path"]
    root: str = scope.get("root_path") or ""
    return path[len(root) :] if root and path.startswith(root) else path


class InferEdge:
    """v2 infer calls, from the edge to the answer; `layered` answers every other request."""

    def __init__(self, parts: RouterParts, layered: ASGIApp, check: Check, max_bytes: int) -> None:
        self.parts = parts
        self.layered = layered
        self.check = check
        self.max_bytes = max_bytes
        self.traced = TraceContext(self._traced)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = infer_route(relative_path(scope)) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.layered(scope, receive, send)
            return
        h = wanted_headers(scope["headers"], _READ)  # one pass over the headers for every check
        if b"traceparent" in h or b"tracestate" in h or tracing.exporting():
            await self.traced(scope, receive, send)  # the same answer, inside a server span
            return
        await self._edge(scope, receive, send, route, h)

    async def _traced(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = infer_route(relative_path(scope))
        assert route is not None  # matched by __call__
        await self._edge(scope, receive, send, route, wanted_headers(scope["headers"], _READ))

    async def _edge(self, scope: Scope, receive: Receive, send: Send, route: tuple[str, str | None], h: dict[bytes, str]) -> None:
        path = scope["path"]
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


async def answer(
    parts: RouterParts,
    scope: Scope,
    receive: Receive,
    send: Send,
    route: tuple[str, str | None],
    h: dict[bytes, str],
    count: Callable[[int], None] | None = None,
) -> None:
    """Answer one v2 infer request, errors in the protocol's shape. `h`: its headers (`wanted_headers`);
    `count`, when given, is told each body chunk's size as it arrives, and may raise to refuse it."""

    async def next_chunk() -> tuple[bytes, bool]:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        if count is not None:
            count(len(chunk))
        return chunk, message.get("more_body", False)

    async def read_body() -> bytes | bytearray:
        chunk, more = await next_chunk()
        if not more:
            return chunk  # one chunk: as it came, no copy
        # Grown chunk by chunk as they arrive: a body of megabytes (a request of images) is
        # copied a chunk at a time between other requests' turns on the loop, not in one
        # join at its end that holds up every other request meanwhile.
        body = bytearray(chunk)
        while more:
            chunk, more = await next_chunk()
            body += chunk
        return body

    path = scope["path"]
    try:
        headers = InferHeaders(
            h.get(b"x-priority"), h.get(b"x-request-timeout-ms"), h.get(b"authorization"),
            h.get(b"inference-header-content-length"), h.get(b"x-session-key"), h.get(b"cache-control"),
        )  # fmt: skip
        response = await answer_infer(parts, route[0], route[1], read_body, headers)
    except ClientDisconnect:
        return  # nobody to answer
    except ServeAppError as e:
        response = error_response(path, e)
    except HTTPException as e:  # the edge's body limit, raised into the body read (router/edge/checks.py)
        response = error_response(path, from_http_exception(e))
    except Exception as e:  # as the app's last-resort handler: the protocol's shape, never bare text
        response = error_response(path, unexpected(path, e))
    await response(scope, receive, send)
