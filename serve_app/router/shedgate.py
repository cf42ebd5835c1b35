"""Refuse an inference request that admission would refuse anyway, before FastAPI sees it.

Under a flood, most of what the router spends on a request that will be shed is
not the admission check but what comes before it: FastAPI's routing, dependency
solving, reading and parsing the body (py-spy: the endpoint itself is ~12% of
the router's CPU; FastAPI and Starlette around it ~40%). On a 2-core node that
CPU comes out of the models' share. This ASGI middleware reads only the path and
the headers; when the request's priority class already has more queued work
ahead than `max_queue_delay_s` (or a deadline that even a one-row request would
miss), it answers the same 503 with Retry-After, in the protocol's shape, that
admission would have given after the parse.

It decides nothing on its own: the router installs a check (`set_check`) that
asks the model's dispatcher (`Dispatcher.precheck`), and anything it cannot
judge from the headers alone (no `X-Priority` header, an unknown model, a bad
key) passes through to the full path, which answers it as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import Response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# (request path, model or route name, lower-cased headers) -> a refusal, or None to go on
Check = Callable[[str, str, dict[str, str]], Response | None]

MARKER = "/v2/models/"
_check: Check | None = None


def set_check(check: Check | None) -> None:
    """One router replica per process: the replica's check serves the module-level app."""
    global _check
    _check = check


def infer_target(path: str) -> str | None:
    """The model or route a v2 infer path names (`/v2/models/{name}[/versions/{v}]/infer`)."""
    start = path.find(MARKER)
    if start < 0 or not path.endswith("/infer"):
        return None
    parts = path[start + len(MARKER) : -len("/infer")].split("/")
    if len(parts) == 1 or (len(parts) == 3 and parts[1] == "versions"):
        return parts[0] or None
    return None


class ShedGate:
    """Pure ASGI middleware (no per-request objects unless it refuses)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        check = _check
        if check is not None and scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            name = infer_target(path)
            if name is not None:
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
                refusal = check(path, name, headers)
                if refusal is not None:
                    await refusal(scope, receive, send)
                    return
        await self.app(scope, receive, send)
