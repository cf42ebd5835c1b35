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
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.errors import Overloaded, PayloadTooLarge, ServeAppError, Unauthorized
from serve_app.protocols.errors import error_response


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


class BodyBudget:
    """One request's body against the limits: its declared length first, then each chunk as it
    comes. `close` gives its room back; call it however the request ends."""

    __slots__ = ("held", "inflight", "limit", "seen")

    def __init__(self, limit: int, inflight: InflightBytes) -> None:
        self.limit, self.inflight = limit, inflight
        self.held = self.seen = 0

    def open(self, declared: bytes | None) -> ServeAppError | None:
        """The refusal its Content-Length earns at once (413, or 503 while the router holds too
        many bytes), before any of the body is read; None to read on."""
        if declared is None or not declared.isdigit():
            return None
        n = int(declared)
        if n > self.limit:
            return PayloadTooLarge(f"request body is {n} bytes; at most {self.limit} are allowed")
        if not self.inflight.take(n):
            return full(self.inflight)
        self.held = n
        return None

    def count(self, size: int) -> None:
        """A chunk of `size` bytes arrived. Raises an HTTPException into whoever reads the body: FastAPI
        turns any other error in its own body read into a 400; the app renders it in the protocol's shape."""
        self.seen += size
        if self.seen > self.held:  # a chunked body (or one longer than it said) takes its room as it comes
            if not self.inflight.take(self.seen - self.held):
                raise HTTPException(503, full(self.inflight).message, headers={"Retry-After": "1"})
            self.held = self.seen
        if self.seen > self.limit:
            raise HTTPException(413, f"request body is over {self.limit} bytes; at most {self.limit} are allowed")

    def close(self) -> None:
        self.inflight.give_back(self.held)
        self.held = 0


def full(inflight: InflightBytes) -> Overloaded:
    return Overloaded(
        f"the router holds {inflight.held} bytes of request bodies, its limit is {inflight.limit}", retry_after_s=1.0
    )


def content_length(scope: Scope) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == b"content-length"), None)


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, inflight: InflightBytes) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.inflight = inflight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        budget = BodyBudget(self.max_bytes, self.inflight)
        refusal = budget.open(content_length(scope))
        if refusal is not None:
            await error_response(scope["path"], refusal)(scope, receive, send)
            return

        async def counted() -> Message:
            message = await receive()
            budget.count(len(message.get("body", b"")))
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            budget.close()


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
