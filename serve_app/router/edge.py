"""Checks at the router's edge, before any endpoint reads a body: the body limit and the API key.

Pure ASGI middleware, so they hold on every path alike (v2 and OpenAI), and a request
refused here costs no body read and no parse.
- `BodyLimit`: a body past `limits.max_request_bytes` is a 413, from its Content-Length
  at once, or as soon as the streamed bytes pass the limit (never buffered past it).
- `BodyLimit` also bounds the router's memory: the bodies of all requests in flight together
  stay under `limits.max_inflight_bytes`; past it a request gets 503 with Retry-After
  instead of a share of memory the router does not have.
- `KeyGate`: with tenants configured, a POST without a valid key is a 401 before its
  body is read. Rate limits are charged later, by the endpoint, once per request.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import HTTPException

from serve_app.errors import Overloaded, PayloadTooLarge, ServeAppError, Unauthorized
from serve_app.protocols.errors import error_response
from serve_app.router.shedgate import ASGIApp, Message, Receive, Scope, Send


class InflightBytes:
    """Body bytes held by the requests in flight, bounded (no Ray, no locks: one event loop)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give_back(self, n: int) -> None:
        self.held -= n


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, inflight: InflightBytes) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.inflight = inflight

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
        held = 0
        if declared is not None and declared.isdigit():
            if not self.inflight.take(int(declared)):
                await error_response(scope["path"], self._full())(scope, receive, send)
                return
            held = int(declared)
        seen = 0

        async def counted() -> Message:
            nonlocal seen, held
            message = await receive()
            size = len(message.get("body", b""))
            seen += size
            if seen > held:  # a chunked body (or one longer than it said) takes its room as it comes
                if not self.inflight.take(seen - held):
                    raise HTTPException(503, self._full().message, headers={"Retry-After": "1"})
                held = seen
            if seen > limit:
                # Raised into whoever reads the body. An HTTPException, because FastAPI turns any
                # other error in its own body read into a 400; the app renders it in the protocol's shape.
                raise HTTPException(413, f"request body is over {limit} bytes; at most {limit} are allowed")
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            self.inflight.give_back(held)

    def _full(self) -> Overloaded:
        return Overloaded(
            f"the router holds {self.inflight.held} bytes of request bodies, its limit is {self.inflight.limit}",
            retry_after_s=1.0,
        )


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
