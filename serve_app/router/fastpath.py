"""v2 infer without FastAPI's per-request machinery.

FastAPI earns its keep on the many small endpoints (docs, validation of query and
path parameters, dependency injection), but on the inference path, which carries
nearly every request, its routing over every route, dependency solving and
exception middleware cost the router more CPU than the request's own work. This
pure ASGI middleware answers `POST /v2/models/{name}[/versions/{v}]/infer` itself:
it reads the headers the endpoint declares and calls the same
`endpoints_v2.answer_infer` the FastAPI route does, and gives errors the same
shapes the app's exception handlers give. Every other request goes on to FastAPI,
and the route stays declared there, so `/openapi.json` still documents it.

It sits innermost among the middlewares: the key check, the header-only shedding
and the body limit (serve_app.router.edge, serve_app.router.shedgate) hold for it
as for every path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from serve_app.errors import ServeAppError
from serve_app.protocols.errors import error_response, from_http_exception
from serve_app.router.direct import infer_route
from serve_app.router.failures import served_error
from serve_app.router.infer_v2 import InferHeaders, answer_infer
from serve_app.router.parts import RouterParts
from serve_app.router.shedgate import ASGIApp, Receive, Scope, Send

logger = logging.getLogger("ray.serve")

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


class InferFastPath:
    def __init__(self, app: ASGIApp, parts: RouterParts) -> None:
        self.app = app
        self.parts = parts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = infer_route(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        await answer(self.parts, scope, receive, send, route, wanted_headers(scope["headers"]))


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
    except HTTPException as e:  # the edge's body limit, raised into the body read (router/edge.py)
        response = error_response(path, from_http_exception(e))
    except Exception as e:  # as the app's last-resort handler: the protocol's shape, never bare text
        logger.exception("unhandled error on %s", path)
        response = error_response(path, served_error(e))
    await response(scope, receive, send)
