"""The router's HTTP app: both protocols' endpoints, their error shapes, and the OpenAPI document.

Built once per router replica (`build_http_app`), around that replica's parts; its
lifespan runs the replica's startup hook before it takes traffic.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app import __version__
from serve_app.errors import InvalidInput, ServeAppError
from serve_app.protocols import v2_schema
from serve_app.protocols.errors import error_response, from_http_exception
from serve_app.router.edge.checks import BodyLimit, KeyGate
from serve_app.router.edge.failures import unexpected
from serve_app.router.edge.infer_edge import InferEdge
from serve_app.router.edge.shedgate import HeaderCheck, ShedGate
from serve_app.router.edge.traced import TraceContext
from serve_app.router.endpoints import endpoints_openai, endpoints_status, endpoints_v2, repository
from serve_app.router.parts import RouterParts


class RouterApp(FastAPI):
    """The FastAPI app behind the router's edge.

    Every v2 infer call goes to `InferEdge` (infer_edge.py), from the edge checks to the answer,
    whoever hands it over (Serve's wrapper or the direct path); nearly every request is one. The
    edge checks of every other request (trace context, key, header-only shedding, body limit) run
    before FastAPI's own middleware stack rather than inside it, and then the stack, errors and all.
    """

    edge: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.edge(scope, receive, send)
            return
        await self._last_resort(self.edge, scope, receive, send)

    async def _last_resort(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await app(scope, receive, tracked)
        except Exception as e:
            if started:  # answered already (FastAPI's last-resort handler re-raises after its 500): Serve's to log
                raise
            # As FastAPI's last-resort handler would, for a fault in the edge itself: the protocol's
            # shape, never bare text.
            await error_response(scope["path"], unexpected(scope["path"], e))(scope, receive, send)

    async def through_fastapi(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)


def build_http_app(
    parts: RouterParts, startup: Callable[[], Awaitable[None]], shutdown: Callable[[], Awaitable[None]]
) -> RouterApp:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await startup()
        yield
        await shutdown()

    # The docs' routes are added after the endpoints (`setup` below): Serve names each request's
    # route by trying the app's routes in order, and v2 infer, declared first, then matches at once.
    app = RouterApp(
        title="serve-app",
        version=__version__,
        description="Multi-model inference: Open Inference Protocol v2 and OpenAI-compatible generation.",
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.parts = parts
    for endpoints in (endpoints_v2, repository, endpoints_openai, endpoints_status):
        app.include_router(endpoints.api)
    app.openapi_url, app.docs_url, app.redoc_url = "/openapi.json", "/docs", "/redoc"
    app.setup()
    # v2 infer first, in one call; for every other request, outermost first: the trace context, the
    # key, then what admission would refuse from the headers alone, then the body limit; all before
    # routing and the body parse.
    limits = parts.args.limits
    check = HeaderCheck(parts.callers, parts.catalog, parts.dispatchers)
    layered = TraceContext(
        KeyGate(
            ShedGate(
                BodyLimit(app.through_fastapi, max_bytes=limits.max_request_bytes, inflight=parts.inflight_bytes),
                check=check,
                gate=parts.gate,
            ),
            authenticate=parts.callers.authenticate,
        )
    )
    app.edge = InferEdge(parts, layered, check, limits.max_request_bytes)
    add_error_handlers(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        defs = v2_schema.InferRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.pop("$defs", {}))
        components["InferRequest"] = defs
        app.openapi_schema = schema
    return app.openapi_schema


def add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in the protocol's own shape: OpenAI's under /v1, v2's elsewhere."""

    @app.exception_handler(ServeAppError)
    async def _app_error(request: Request, exc: ServeAppError) -> Response:
        return error_response(request.url.path, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI's own errors (an unparseable JSON body, an unknown path, a wrong method) in the
        # protocol's shape too, not FastAPI's `{"detail": ...}` (found by schemathesis).
        return error_response(request.url.path, from_http_exception(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        return error_response(request.url.path, InvalidInput(f"malformed request body: {problems}"))

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception) -> Response:
        # A replica crash or bug still answers in the protocol's shape, never as bare text.
        return error_response(request.url.path, unexpected(request.url.path, exc))
