"""Checks at the router's edge, before any endpoint reads a body: the body limit and the API key.

Pure ASGI middleware, so they hold on every path alike (v2 and OpenAI), and a request
refused here costs no body read and no parse.
- `BodyLimit`: a body past `limits.max_request_bytes` is a 413, from its Content-Length
  at once, or as soon as the streamed bytes pass the limit (never buffered past it).
- `KeyGate`: with tenants configured, a POST without a valid key is a 401 before its
  body is read. Rate limits are charged later, by the endpoint, once per request.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import HTTPException

from serve_app.errors import PayloadTooLarge, ServeAppError, Unauthorized
from serve_app.protocols.errors import error_response
from serve_app.router.shedgate import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            too_large = PayloadTooLarge(f"request body is {int(declared)} bytes; at most {limit} are allowed")
            await error_response(scope["path"], too_large)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                # Raised into whoever reads the body. An HTTPException, because FastAPI turns any
                # other error in its own body read into a 400; the app renders it in the protocol's shape.
                raise HTTPException(413, f"request body is over {limit} bytes; at most {limit} are allowed")
            return message

        await self.app(scope, counted, send)


class KeyGate:
    def __init__(self, app: ASGIApp, authenticate: Callable[[str | None], object]) -> None:
        self.app = app
        self.authenticate = authenticate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            try:
                self.authenticate(authorization)
            except Unauthorized as e:
                await error_response(scope["path"], e)(scope, receive, send)
                return
            except ServeAppError:
                pass  # anything else is the endpoint's to answer
        await self.app(scope, receive, send)
