"""Refuse an inference request that admission would refuse anyway, before FastAPI sees it.

Under a flood, most of what the router spends on a request that will be shed is
not the admission check but what comes before it: FastAPI's routing, dependency
solving, reading and parsing the body (py-spy: FastAPI and Starlette around the
endpoint take far more of the router's CPU than the endpoint itself; see
benchmarks/results/profile/bench-realsize/). On a 2-core node that
CPU comes out of the models' share. This ASGI middleware reads only the path and
the headers; when the request's priority class already has more queued work
ahead than `max_queue_delay_s` (or a deadline that even a one-row request would
miss), it answers the same 503 with Retry-After, in the protocol's shape, that
admission would have given after the parse.

It decides nothing on its own: it is given a check (`HeaderCheck`, which asks
the model's dispatcher: `Dispatcher.precheck`), and anything that cannot be
judged from the headers alone (no `X-Priority` header, an unknown model, a bad
key) passes through to the full path, which answers it as before.

Before that check, the router's own overload control (`RouterGate`) may refuse the
request on every inference path, /v1 generation included, whatever admission would
say: a share of low and then of normal priority while its event loop stays late past
`scheduling.router_delay_target_ms`, and any class past its share of
`scheduling.router_max_inflight` (serve_app/router/admission/protect.py).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.errors import Overloaded, ServeAppError
from serve_app.protocols.errors import error_response
from serve_app.router.admission.callers import Callers
from serve_app.router.admission.protect import RouterGate
from serve_app.router.admission.qos import PRIORITY_HEADER
from serve_app.router.routing.catalog import ModelCatalog
from serve_app.router.routing.dispatchers import DispatcherPool

# (request path, model or route name, lower-cased headers) -> a refusal, or None to go on
Check = Callable[[str, str, dict[str, str]], Response | None]

MARKER = "/v2/models/"
GENERATION_PREFIX = "/v1/"  # judged by the router's own delay only (no dispatcher queues generation)


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
    """Pure ASGI middleware, reading only the path and the headers. With a gate, an inference
    request is also taken into the router or refused by its own overload control
    (serve_app/router/admission/protect.py), and counted in flight until answered."""

    def __init__(self, app: ASGIApp, check: Check, gate: RouterGate | None = None) -> None:
        self.app = app
        self.check = check
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            name = "" if path.startswith(GENERATION_PREFIX) else infer_target(path)
            if name is not None:
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
                await self._gated(path, name, headers, scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _gated(self, path: str, name: str, headers: dict[str, str], scope: Scope, receive: Receive, send: Send) -> None:
        priority, refused = self.gate.enter(headers) if self.gate is not None else (None, None)
        if refused is not None:
            await error_response(path, refused)(scope, receive, send)
            return
        try:
            refusal = self.check(path, name, headers)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            await self.app(scope, receive, send)
        finally:
            if self.gate is not None:
                self.gate.leave(priority)


class HeaderCheck:
    """The 503 admission would give a request, judged from its headers alone.

    Only with an `X-Priority` header (headers win over body parameters, so the class is
    final) and a valid key; everything else goes the full way."""

    def __init__(
        self,
        callers: Callers,
        catalog: ModelCatalog,
        dispatchers: DispatcherPool,
    ) -> None:
        self.callers = callers
        self.catalog = catalog
        self.dispatchers = dispatchers

    def __call__(self, path: str, name: str, headers: dict[str, str]) -> Response | None:
        if not name or PRIORITY_HEADER not in headers or not self.catalog.is_known(name):
            return None
        dispatcher = self.dispatchers.existing(self.catalog.answering_model(name))
        if dispatcher is None:
            return None
        try:
            tenant = self.callers.authenticate(headers.get("authorization"))
            qos = self.callers.qos_from_headers(tenant, headers)
            dispatcher.precheck(qos.priority, qos.deadline)
        except Overloaded as e:
            return error_response(path, e)
        except ServeAppError:  # a bad key or header: the full path gives its 4xx
            return None
        return None
