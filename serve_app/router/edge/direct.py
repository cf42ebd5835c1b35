"""v2 infer calls straight from the router's HTTP server to its app, ahead of Serve's per-request wrapper.

Behind HAProxy, Serve's direct ingress hands each request to the router's app through a wrapper
that, per request, parses every header into a dict, makes two request ids, builds Serve's request
metadata, starts a task that watches the client and another that runs the app, waits on both, and
counts the request in Serve's metrics. On the inference path that costs the router a large share
of its CPU (`python -m benchmarks compare`). Serve's hook for HTTP middlewares, the environment
variable `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` that Serve reads in each of its processes,
wraps that server's app; `DirectInfer`, named there (serve_app/tools/ingress_env.py), sends
`POST /v2/models/{name}[/versions/{v}]/infer` to the router's app at once and everything else
(health checks, status, OpenAI, docs) on through Serve, unchanged.

What Serve's wrapper gave these calls, and what stands in for it here:
- the client watch: when the client leaves (its connection closes before the answer), the call is
  cancelled, as Serve cancels it, so its queued work is dropped; `watch_client` does this without
  a task per request, from the connection's own event;
- the `X-Request-ID` response header: the caller's, or a new one, as Serve's middleware gives it;
- draining: uvicorn's own shutdown, which Serve runs after its drain, waits for these calls;
- the whole-call timeout: `limits.infer_timeout_s` (a 504 in v2's shape), where Serve's wrapper
  applied `http_options.request_timeout_s` (a 408);
- not kept: Serve's request headers `x-request-timeout-seconds` (a per-call timeout; the
  router's own is `X-Request-Timeout-Ms`) and `x-request-disconnect-disabled` (a call here is
  always cancelled when its client leaves);
- backpressure: the router's admission (queue caps, deadlines, body limits) bounds these calls,
  as it does behind Serve's proxy; the router deployment's `max_ongoing_requests` sits above
  everything admission allows (serve_app.router.parts.router_capacity) and does not count them.
Serve's per-request metrics and access log for the router leave these calls out; the router's own
metrics count them (serve_app.router.telemetry).

The hook is an environment variable of the processes Ray starts (`serve-app serve`, the KubeRay
manifest and the benchmarks set it with the other ingress settings); each server Serve starts asks
`middlewares` for its middlewares, after the router's constructor. Only a router's process has an
app to send to (`install`, from its constructor): every other process (Serve's proxy, the model
replicas) gets none, so the hook costs them nothing. Without the variable (a plain `serve run`),
or with an operator's own hook in it, v2 infer goes through Serve's wrapper (logged); so it does
on Python 3.10, whose asyncio lacks the uncancel this path uses. And where Serve runs the router's
code on an event loop of its own (RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD, on unless
RAY_SERVE_THROUGHPUT_OPTIMIZED): the server's loop is then another thread's, and only Serve's
wrapper may cross to the router's. Paths under a route prefix other than `/`, or under uvicorn's
`root_path`, do not match here and go through Serve too. Whether the path is on shows in
`/router/status` (`direct_infer`); the benchmark smoke test checks it, so an upgrade of Ray that
drops the hook fails there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.errors import DeadlineExceeded
from serve_app.protocols.errors import error_response
from serve_app.router.edge.callwatch import Deadlines, watch_client

logger = logging.getLogger("ray.serve")

HOOK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
HOOK = "serve_app.router.edge.direct:middlewares"
PREFIX = "/v2/models/"
SUFFIX = "/infer"
REQUEST_ID = b"x-request-id"


# This process's router app and the event loop it runs on, once `install` ran; None in any other
# process (Serve's proxy, if the operator passes the hook there too).
APP: Any = None
APP_LOOP: asyncio.AbstractEventLoop | None = None
TIMEOUT_S = 60.0
# Whether Serve built the middleware into a server of this process: the path is really on.
BUILT = False


def infer_route(path: str) -> tuple[str, str | None] | None:
    """(model, version) for a v2 infer path, as the FastAPI routes would match it; else None."""
    if not (path.startswith(PREFIX) and path.endswith(SUFFIX)):
        return None
    parts = path[len(PREFIX) : -len(SUFFIX)].split("/")
    if len(parts) == 1 and parts[0]:
        return parts[0], None
    if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2]:
        return parts[0], parts[2]
    return None


def request_id(scope: Scope) -> bytes:
    """The caller's X-Request-ID, else a new one (as Serve's RequestIdMiddleware makes them)."""
    for name, value in scope["headers"]:
        if name == REQUEST_ID:
            return bytes(value)
    return new_request_id()


# A version-4 UUID's fixed bits, as `uuid.UUID(int=..., version=4)` sets them.
_UUID4_CLEAR = ~((0xC000 << 48) | (0xF000 << 64))
_UUID4_SET = (0x8000 << 48) | (4 << 76)


def new_request_id() -> bytes:
    """A random version-4 UUID in its text form, without building a `uuid.UUID` on every request."""
    h = "%032x" % (random.getrandbits(128) & _UUID4_CLEAR | _UUID4_SET)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}".encode()


class DirectInfer:
    """The middleware Serve puts around its direct-ingress app (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        global BUILT
        self.app = app  # Serve's per-request path
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        # The router's app only on the loop it runs on (see the module docstring).
        self.router = APP if APP is not None and loop is APP_LOOP else None
        self.deadlines = Deadlines()
        BUILT = BUILT or self.router is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        router = self.router
        if router is None or scope["type"] != "http" or scope["method"] != "POST" or infer_route(scope["path"]) is None:
            await self.app(scope, receive, send)
            return
        watch = watch_client(receive)
        if watch is None:
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)
        started = False
        head: Message | None = None

        async def send_with_id(message: Message) -> None:
            # The head is held until the first body message and both go out back to back: uvicorn
            # writes each at once, and a router killed between the two would leave an answer whose
            # head HAProxy has already passed on, which nobody but the client can send again.
            nonlocal started, head
            if message["type"] == "http.response.start":
                started = True
                head = {**message, "headers": [*message.get("headers", ()), (REQUEST_ID, rid)]}
                return
            if head is not None:
                held, head = head, None
                await send(held)
            await send(message)

        self.deadlines.add(watch, TIMEOUT_S)
        try:
            await router(scope, receive, send_with_id)
        except asyncio.CancelledError:
            # The watch's own cancel (the client left, or the time limit passed). Any other cancel
            # (the server shutting down) goes on up.
            if not (watch.left or watch.timed_out) or watch.task.uncancel() > 0:
                raise
            if watch.left:  # nobody to answer, and not an error of the server's
                return
            if started and head is None:  # the answer is cut short, and uvicorn closes the connection
                logger.warning("v2 infer on %s passed limits.infer_timeout_s while answering; cut short", scope["path"])
                return
            late = DeadlineExceeded(f"the request took longer than {TIMEOUT_S:g} s (limits.infer_timeout_s)")
            head, started = None, False  # a head held back never went out: the error answers instead
            await error_response(scope["path"], late)(scope, receive, send_with_id)
        finally:
            self.deadlines.discard(watch)
            watch.release()


def active() -> bool:
    """Whether this process's HTTP server sends v2 infer calls the direct way."""
    return BUILT and APP is not None


def middlewares() -> list[Middleware]:
    """Serve's HTTP middleware hook (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`): `DirectInfer` in
    a router's process, nothing in any other."""
    return [Middleware(DirectInfer)] if APP is not None else []


def install(app: Any, timeout_s: float) -> bool:
    """Send this process's v2 infer calls to `app` (the router's, running on this thread's event
    loop) ahead of Serve's wrapper, from the server Serve starts after the constructor, each
    within `timeout_s`; False where it stays off."""
    global APP, APP_LOOP, TIMEOUT_S
    if sys.version_info < (3, 11):
        logger.warning("router: Python 3.10; v2 infer goes through Serve's wrapper")
        return False
    hook = os.environ.get(HOOK_ENV)
    if hook != HOOK:
        if hook:
            logger.warning("router: %s is %r; v2 infer goes through Serve's wrapper", HOOK_ENV, hook)
        return False
    try:
        APP_LOOP = asyncio.get_running_loop()
    except RuntimeError:
        return False  # no loop to tell the server's by
    APP, TIMEOUT_S = app, timeout_s
    return True
