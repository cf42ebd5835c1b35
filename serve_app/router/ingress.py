"""The HTTP ingress: Open Inference Protocol v2 and OpenAI over every model and route.

A thin shell: protocol parsing lives in `serve_app.protocols`, routing policy
in `serve_app.router.cascade`; this module wires them to deployment handles.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import Counter
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app import __version__
from serve_app.config import AppArgs, TenantConfig
from serve_app.cpu_priority import renice_process
from serve_app.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelFailure,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    ServeAppError,
    Unavailable,
)
from serve_app.manifest import Manifest
from serve_app.protocols import openai, v2
from serve_app.protocols.errors import error_response
from serve_app.protocols.images import decode_images
from serve_app.router import catalog, generation
from serve_app.router.cascade import CascadePolicy, softmax
from serve_app.router.gcwatch import FullCollectionSchedule, GcPauses, freeze_startup_heap
from serve_app.router.qos import PRIORITY_HEADER, TIMEOUT_HEADER, QoS, parse_qos
from serve_app.router.shedgate import ShedGate, set_check
from serve_app.router.telemetry import RouterTelemetry
from serve_app.scheduling.dispatcher import BatchReply, Dispatcher, DispatchSettings, RequestTiming
from serve_app.scheduling.queue import Priority
from serve_app.scheduling.tenants import Tenant, TenantRegistry, TokenBucket, resolve_key

logger = logging.getLogger("ray.serve")
READY_TIMEOUT_S = 5.0
# Triton-style request parameters a v2 generation request may carry.
SAMPLING_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
PRIORITY_DOC = "high, normal or low (capped by the caller's tenant)"

app = FastAPI(
    title="serve-app",
    version=__version__,
    description="Multi-model inference: Open Inference Protocol v2 and OpenAI-compatible generation.",
)
# Refuses what admission would refuse from the headers alone, before routing and the body parse.
app.add_middleware(ShedGate)


class V2Error(BaseModel):
    """The Open Inference Protocol's error shape."""

    error: str


V2_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": V2Error, "description": why}
    for code, why in [
        (400, "invalid input"),
        (401, "missing or unknown API key"),
        (404, "unknown model, route or version"),
        (413, "body too large"),
        (429, "tenant rate limit (Retry-After)"),
        (503, "overloaded or circuit open (Retry-After)"),
        (504, "deadline passed while queued"),
    ]
}
OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {code: {**v, "model": openai.ErrorBody} for code, v in V2_ERRORS.items()}

# /infer reads its body itself (the binary extension is not JSON), so its schema is added here.
INFER_BODY = {
    "requestBody": {
        "required": True,
        "description": "JSON tensors; or, with the Inference-Header-Content-Length header, this JSON followed by "
        "binary tensor data (Triton's binary_tensor_data extension)",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/InferRequest"}}},
    }
}


async def _the_request(request: Request) -> Request:
    """Serve's class-based views rebuild method signatures, which leaves a bare `Request`
    parameter unresolved (it becomes a query parameter); a dependency resolves it.

    `async` on purpose: FastAPI runs a plain `def` dependency in a worker thread, one hop
    per request, and anyio's hop walks every task on the loop (`find_root_task`). Under a
    flood with hundreds of requests held in the router's queues that was a quarter of the
    router's CPU (py-spy, `serve-app bench priority`)."""
    return request


THE_REQUEST = Depends(_the_request)


def _openapi() -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        defs = v2.InferRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.pop("$defs", {}))
        components["InferRequest"] = defs
        app.openapi_schema = schema
    return app.openapi_schema


app.openapi = _openapi  # type: ignore[method-assign]


@app.exception_handler(ServeAppError)
async def _app_error(request: Request, exc: ServeAppError) -> Response:
    return error_response(request.url.path, exc)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    # FastAPI's own errors (an unparseable JSON body, an unknown path, a wrong method) in the
    # protocol's shape too, not FastAPI's `{"detail": ...}` (found by schemathesis).
    error = ServeAppError(f"malformed request body: {exc.detail}" if exc.status_code == 400 else str(exc.detail))
    error.status_code = exc.status_code
    error.code = "invalid_input" if exc.status_code == 400 else "http_error"
    return error_response(request.url.path, error)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
    return error_response(request.url.path, InvalidInput(f"malformed request body: {problems}"))


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> Response:
    # A replica crash or bug still answers in the protocol's shape, never as bare text.
    logger.exception("unhandled error on %s", request.url.path)
    return error_response(request.url.path, ModelFailure(f"internal error: {type(exc).__name__}"))


def build_registry(configs: list[TenantConfig]) -> TenantRegistry:
    return TenantRegistry(
        [
            Tenant(
                c.name,
                Priority.parse(c.max_priority),
                TokenBucket(c.rate_per_s, c.burst) if c.rate_per_s else None,
                [resolve_key(c.key_sha256, c.key_env, c.key_file)],
            )
            for c in configs
        ]
    )


class ClassifierResult:
    """Logits for N items, which model answered each, and why the heavy tier was skipped, if it was."""

    def __init__(self, logits: np.ndarray, served_by: list[str], degraded: str | None = None) -> None:
        self.logits = logits
        self.served_by = served_by
        self.degraded = degraded


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(app)
class Router:
    def __init__(self, args: dict[str, Any], handles: dict[str, DeploymentHandle]) -> None:
        self.args = AppArgs.model_validate(args)
        self.handles = handles
        self.policies = {name: self._cascade_policy(name) for name in self.args.routes}
        self._manifests: dict[str, Manifest] = {}
        self._batching: dict[str, dict[str, Any]] = {}
        self.dispatchers: dict[str, Dispatcher] = {}
        self.cascade_items: Counter[tuple[str, str]] = Counter()
        self.default_priority = Priority.parse(self.args.scheduling.default_priority)
        self.router_id = serve.get_replica_context().replica_id.unique_id
        self._telemetry_task: asyncio.Task[None] | None = None
        self._gc_task: asyncio.Task[None] | None = None
        self.gc_pauses = GcPauses()
        self.gc_pauses.install()
        set_check(self._early_refusal)
        if self.args.scheduling.router_nice is not None:
            renice_process(self.args.scheduling.router_nice)
        self.tenants = build_registry(self.args.tenants)
        if self.tenants.open:
            logger.warning("no API keys configured: this server is OPEN to every caller (set `tenants` in the config)")
        if self.args.scheduling.policy == "fifo":
            logger.warning("router scheduling policy is fifo: no priorities, deadlines or shedding (a benchmark baseline)")
        logger.info("router: %d startup objects frozen out of garbage collection", freeze_startup_heap())

    def _cascade_policy(self, name: str) -> CascadePolicy:
        route = self.args.routes[name]
        if route.threshold is not None:
            return CascadePolicy(route.threshold, route.signal)
        fitted = Manifest.load(self.args.model_path(route.light)).calibrations.get(route.heavy)
        if fitted is None:
            raise ValueError(
                f"route {name!r} has no threshold and {route.light} was never calibrated against {route.heavy}: "
                "run `serve-app calibrate --config <this config>` or set `threshold`"
            )
        logger.info("route %s: calibrated %s >= %.4f answers from %s", name, fitted["signal"], fitted["threshold"], route.light)
        return CascadePolicy(float(fitted["threshold"]), fitted["signal"])

    # -- scheduling ----------------------------------------------------------------

    def _dispatcher(self, model: str) -> Dispatcher:
        if model not in self.dispatchers:
            config, sched = self.args.models[model], self.args.scheduling
            batching = config.batching
            settings = DispatchSettings(
                policy=sched.policy,
                max_queue_items=sched.max_queue_items,
                max_queue_delay_s=sched.max_queue_delay_s,
                max_batch_size=batching.max_batch_size,
                batch_wait_timeout_s=batching.batch_wait_timeout_s,
                batch_timeout_s=sched.batch_timeout_s,
                breaker_failures=sched.breaker_failures,
                breaker_open_s=sched.breaker_open_s,
                urgent_lane=config.urgent_lane,
            )
            handle = self.handles[model]

            async def send(payloads: list[Any], queued: int, lane: str) -> BatchReply:
                return await handle.run.remote(payloads, self.router_id, queued, lane)

            self.dispatchers[model] = Dispatcher(model, send, settings)
            if self._telemetry_task is None:
                self._telemetry_task = asyncio.get_running_loop().create_task(self._export_metrics())
                if sched.router_full_gc_max_interval_s is not None:
                    # Started with the queues it watches, so Python's full collections are never
                    # turned off without a schedule that runs them instead.
                    schedule = FullCollectionSchedule(max_interval_s=sched.router_full_gc_max_interval_s)
                    self._gc_task = asyncio.get_running_loop().create_task(self._collect_garbage(schedule))
        return self.dispatchers[model]

    async def _collect_garbage(self, schedule: FullCollectionSchedule) -> None:
        threshold = gc.get_threshold()
        FullCollectionSchedule.take_over()
        try:
            while True:
                await asyncio.sleep(0.25)
                busy = any(d.queued_items or d.inflight for d in self.dispatchers.values())
                if schedule.due(busy):
                    gc.collect()
                    schedule.ran()
        finally:  # whatever ends this loop, Python collects on its own again
            gc.set_threshold(*threshold)

    async def _export_metrics(self) -> None:
        telemetry = RouterTelemetry()
        while True:
            await asyncio.sleep(telemetry.interval_s)
            try:
                breakers = {m: int(d.breaker.state) for m, d in self.dispatchers.items()}
                await telemetry.export(self.dispatchers, self.cascade_items, breakers)
            except Exception:  # metrics must never take the router down
                logger.exception("exporting router metrics failed")

    def _early_refusal(self, path: str, name: str, headers: dict[str, str]) -> Response | None:
        """ShedGate's check: the 503 admission would give this request, judged from its headers.
        Only with an `X-Priority` header (headers win over body parameters, so the class is
        final) and a valid key; everything else goes the full way."""
        if PRIORITY_HEADER not in headers or (name not in self.handles and name not in self.args.routes):
            return None
        dispatcher = self.dispatchers.get(self._answering_model(name))
        if dispatcher is None:
            return None
        try:
            tenant = self.tenants.authenticate(headers.get("authorization"))
            qos = parse_qos(headers, None, time.monotonic(), self.default_priority)
            dispatcher.precheck(tenant.cap(qos.priority), qos.deadline)
        except Overloaded as e:
            return error_response(path, e)
        except ServeAppError:  # a bad key or header: the full path gives its 4xx
            return None
        return None

    def _caller(self, authorization: str | None) -> Tenant:
        """Authenticate (401) and rate-limit (429) before any other work."""
        tenant = self.tenants.authenticate(authorization)
        tenant.admit()
        return tenant

    def _qos(self, tenant: Tenant, priority: str | None, timeout_ms: str | None, parameters: dict[str, Any] | None) -> QoS:
        headers = {k: v for k, v in ((PRIORITY_HEADER, priority), (TIMEOUT_HEADER, timeout_ms)) if v is not None}
        qos = parse_qos(headers, parameters, time.monotonic(), self.default_priority)
        return QoS(tenant.cap(qos.priority), qos.deadline)

    # -- catalog -------------------------------------------------------------

    def _known(self, name: str) -> None:
        if name not in self.handles and name not in self.args.routes:
            known = sorted([*self.handles, *self.args.routes])
            raise NotFound(f"unknown model {name!r}; available: {known}")

    async def _manifest(self, model: str) -> Manifest:
        if model not in self._manifests:
            meta = await self.handles[model].metadata.remote()
            self._manifests[model] = Manifest.model_validate(meta["manifest"])
            self._batching[model] = meta["batching"]
            if len(self._manifests) == len(self.handles):
                # Every model has answered once (readiness, before traffic as a rule): the
                # handles' routing state is built, and lives as long as the router. Once.
                logger.info("router: %d objects frozen out of garbage collection", freeze_startup_heap())
        return self._manifests[model]

    def _answering_model(self, name: str) -> str:
        """The model whose metadata a name shows: itself, or a route's light tier."""
        return self.args.routes[name].light if name in self.args.routes else name

    async def _is_ready(self, model: str) -> bool:
        try:
            await asyncio.wait_for(self._manifest(model), READY_TIMEOUT_S)
            return True
        except Exception:  # any failure to answer means not ready
            return False

    # -- health and metadata ---------------------------------------------------

    @app.get("/v2/health/live")
    async def live(self) -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready(self) -> JSONResponse:
        states = await asyncio.gather(*(self._is_ready(m) for m in self.handles))
        ok = all(states)
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/router/status")
    async def router_status(self, authorization: str | None = Header(None)) -> dict[str, Any]:
        """This router replica's queues, learned limits, shedding and cascade counts."""
        self.tenants.authenticate(authorization)
        cascade: dict[str, dict[str, int]] = {}
        for (route, outcome), n in self.cascade_items.items():
            cascade.setdefault(route, {})[outcome] = n
        generators = self._generators()
        # One replica of each generator: its decode loop's running and waiting sequences, KV occupancy, TTFT, ITL.
        stats = await asyncio.gather(*(self._generator_stats(g) for g in generators))
        return {
            "router": self.router_id,
            "models": {m: d.snapshot() for m, d in self.dispatchers.items()},
            "routes": cascade,
            "generators": dict(zip(generators, stats, strict=True)),
            "gc": self.gc_pauses.snapshot(),
        }

    async def _generator_stats(self, name: str) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(self.handles[name].stats.remote(), READY_TIMEOUT_S)
        except Exception:  # status must answer even when a generator does not
            return None

    @app.get("/v2")
    async def server_metadata(self) -> v2.ServerMetadata:
        return v2.ServerMetadata(name="serve-app", version=__version__, extensions=v2.EXTENSIONS)

    def _check_version(self, name: str, version: str | None, manifest: Manifest) -> None:
        if version is not None and version != manifest.version:
            raise NotFound(f"model {name!r} has no version {version!r}; available: [{manifest.version!r}]")

    @app.get("/v2/models/{name}", responses=V2_ERRORS)
    @app.get("/v2/models/{name}/versions/{version}", responses=V2_ERRORS)
    async def model_metadata(
        self, name: str, version: str | None = None, authorization: str | None = Header(None)
    ) -> v2.ModelMetadata:
        self.tenants.authenticate(authorization)
        self._known(name)
        manifest = await self._manifest(self._answering_model(name))
        self._check_version(name, version, manifest)
        platform = "ensemble" if name in self.args.routes else "onnxruntime_onnx"
        return catalog.model_metadata(name, manifest, platform)

    @app.get("/v2/models/{name}/ready", responses=V2_ERRORS)
    @app.get("/v2/models/{name}/versions/{version}/ready", responses=V2_ERRORS)
    async def model_ready(self, name: str, version: str | None = None) -> JSONResponse:
        self._known(name)
        if version is not None:
            self._check_version(name, version, await self._manifest(self._answering_model(name)))
        models = [self.args.routes[name].light, self.args.routes[name].heavy] if name in self.args.routes else [name]
        ok = all(await asyncio.gather(*(self._is_ready(m) for m in models)))
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2/models/{name}/config", responses=V2_ERRORS)
    @app.get("/v2/models/{name}/versions/{version}/config", responses=V2_ERRORS)
    async def model_config(
        self, name: str, version: str | None = None, authorization: str | None = Header(None)
    ) -> dict[str, Any]:
        self.tenants.authenticate(authorization)
        self._known(name)
        model = self._answering_model(name)
        manifest = await self._manifest(model)
        self._check_version(name, version, manifest)
        platform = "ensemble" if name in self.args.routes else "onnxruntime_onnx"
        return catalog.triton_config(name, manifest, int(self._batching[model]["max_batch_size"]), platform)

    # -- inference -------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to pass the limit (never buffered past it)."""
        limit = self.args.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body is {int(declared)} bytes; at most {limit} are allowed")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body is over {limit} bytes; at most {limit} are allowed")
            chunks.append(chunk)
        return b"".join(chunks)

    @app.post("/v2/models/{name}/infer", openapi_extra=INFER_BODY, responses={200: {"model": v2.InferResponse}, **V2_ERRORS})
    @app.post(
        "/v2/models/{name}/versions/{version}/infer",
        openapi_extra=INFER_BODY,
        responses={200: {"model": v2.InferResponse}, **V2_ERRORS},
    )
    async def infer(
        self,
        name: str,
        version: str | None = None,
        request: Request = THE_REQUEST,
        x_priority: str | None = Header(None, description=PRIORITY_DOC),
        x_request_timeout_ms: str | None = Header(None, description="deadline; refused at once if it cannot be met"),
        authorization: str | None = Header(None, description="Bearer <API key>, when keys are configured"),
        inference_header_content_length: str | None = Header(
            None, description="binary tensor data extension: length of the JSON part of the body"
        ),
    ) -> Response:
        started = time.perf_counter()
        timing = RequestTiming()
        tenant = self._caller(authorization)
        self._known(name)
        body = v2.parse_request(await self._read_body(request), inference_header_content_length)
        model = self._answering_model(name)
        params = body.parameters or {}
        qos = self._qos(tenant, x_priority, x_request_timeout_ms, params)
        manifest = await self._manifest(model)
        self._check_version(name, version, manifest)
        degraded = None
        if manifest.family == "gpt":
            outputs, served_by = await self._infer_generate(model, body, params, qos)
        else:
            outputs, served_by, degraded = await self._infer_classify(name, manifest, body, qos, timing)
        if body.outputs is not None:
            wanted = [o.name for o in body.outputs]
            available = {o.name for o in outputs}
            unknown = [w for w in wanted if w not in available]
            if unknown:
                raise InvalidInput(f"unknown requested outputs {unknown}; this model has {sorted(available)}")
            outputs = [o for o in outputs if o.name in wanted]
        parameters: dict[str, Any] = {"served_by": served_by}
        headers = {"X-Served-By": ",".join(dict.fromkeys(served_by))}
        if degraded:
            parameters["degraded"] = headers["X-Degraded"] = degraded
        response = v2.InferResponse.model_construct(
            model_name=name, model_version=manifest.version, id=body.id, parameters=parameters, outputs=outputs
        )
        content, extra = v2.render_response(response, v2.binary_outputs(body, [o.name for o in outputs]))
        # Where the time went inside the server, so a client can tell it from the network's share.
        headers["Server-Timing"] = timing.header(time.perf_counter() - started)
        return Response(content, headers={**headers, **extra})

    def _single_input(self, body: v2.InferRequest, expected: str) -> v2.RequestInput:
        match = [t for t in body.inputs if t.name == expected]
        if len(body.inputs) != 1 or not match:
            raise InvalidInput(f"expected exactly one input named {expected!r}, got {[t.name for t in body.inputs]}")
        return match[0]

    def _check_count(self, model: str, n: int) -> None:
        limit = self.args.models[model].max_items_per_request
        if n == 0:
            raise InvalidInput("empty batch: the input tensor has no items")
        if n > limit:
            raise InvalidInput(f"{n} items in one request; at most {limit} are allowed")

    def _decode_classifier_input(self, model: str, manifest: Manifest, body: v2.InferRequest) -> list[str] | np.ndarray:
        if manifest.family == "bert":
            texts = v2.decode_bytes(self._single_input(body, catalog.TEXT_INPUT), self.args.limits.max_text_chars)
            self._check_count(model, len(texts))
            return texts
        tensor = self._single_input(body, catalog.IMAGE_INPUT)
        s = manifest.image_size or 0
        if tensor.datatype == "BYTES":
            # Encoded PNG/JPEG, one per element: decoded and resized here, sent on as uint8 pixels.
            if len(tensor.shape) != 1:
                raise InvalidInput(f"input 'image' as BYTES (encoded PNG/JPEG) must have shape [N], got {tensor.shape}")
            self._check_count(model, tensor.element_count())
            return decode_images(v2.decode_raw_bytes(tensor), s)
        if tensor.datatype not in ("FP32", "UINT8"):
            raise InvalidInput(f"input 'image' must be FP32 in [0, 1], UINT8, or BYTES (encoded PNG/JPEG), got {tensor.datatype}")
        if len(tensor.shape) != 4 or tensor.shape[1:] != [3, s, s]:
            raise InvalidInput(f"input 'image' must have shape [N, 3, {s}, {s}], got {tensor.shape}")
        self._check_count(model, tensor.shape[0])
        images = v2.decode_numeric(tensor)
        # uint8 travels to the replica as is (4x fewer bytes); it scales to [0, 1] there.
        if images.dtype != np.uint8 and not np.isfinite(images).all():
            raise InvalidInput("input 'image' contains NaN or Inf")
        return images

    async def _classify(
        self, name: str, payload: list[str] | np.ndarray, qos: QoS, timing: RequestTiming | None = None
    ) -> ClassifierResult:
        n = len(payload)
        if name not in self.args.routes:
            logits = await self._dispatcher(name).submit(payload, n, qos.priority, qos.deadline, timing)
            return ClassifierResult(logits, [name] * n)
        route = self.args.routes[name]
        try:
            light = await self._dispatcher(route.light).submit(payload, n, qos.priority, qos.deadline, timing)
        except Exception as e:
            # A client error, or a light tier merely busy or too slow for the deadline, is the
            # answer. A failing light tier (circuit open, model error, timeout) is not: the
            # heavy one answers and the response says so. The light breaker's half-open probe
            # also comes through here, so route traffic alone can close it again.
            if isinstance(e, Overloaded | DeadlineExceeded) or (isinstance(e, ServeAppError) and e.status_code < 500):
                raise
            logits = await self._dispatcher(route.heavy).submit(payload, n, qos.priority, qos.deadline, timing)
            self.cascade_items[(name, "fallback")] += n
            return ClassifierResult(logits, [route.heavy] * n, f"{route.light} unavailable; answered by {route.heavy}")
        escalate = self.policies[name].escalate(light)
        escalated = int(escalate.sum())
        served_by = [route.heavy if e else route.light for e in escalate]
        degraded = None
        if escalated:
            idx = np.flatnonzero(escalate)
            subset = [payload[i] for i in idx] if isinstance(payload, list) else payload[idx]
            try:
                heavy = await self._dispatcher(route.heavy).submit(subset, escalated, qos.priority, qos.deadline, timing)
                light = light.copy()
                light[idx] = heavy
            except (Overloaded, DeadlineExceeded, Unavailable) as e:
                # Overloaded, too late or circuit open: the light answer now beats an error later.
                degraded = f"{route.heavy} {e.code}; answered by {route.light}"
                served_by = [route.light] * n
        self.cascade_items[(name, "light")] += n - escalated
        self.cascade_items[(name, "degraded" if degraded else "heavy")] += escalated
        return ClassifierResult(light, served_by, degraded)

    async def _infer_classify(
        self, name: str, manifest: Manifest, body: v2.InferRequest, qos: QoS, timing: RequestTiming
    ) -> tuple[list[v2.ResponseOutput], list[str], str | None]:
        model = self._answering_model(name)
        payload = self._decode_classifier_input(model, manifest, body)
        result = await self._classify(name, payload, qos, timing)
        probs = softmax(result.logits).astype(np.float32)
        labels = [manifest.labels[i] for i in probs.argmax(axis=1)]
        return (
            [
                v2.encode("logits", result.logits.astype(np.float32)),
                v2.encode("probabilities", probs),
                v2.encode("label", labels),
            ],
            result.served_by,
            result.degraded,
        )

    async def _infer_generate(
        self, model: str, body: v2.InferRequest, params: dict[str, Any], qos: QoS
    ) -> tuple[list[v2.ResponseOutput], list[str]]:
        prompts = v2.decode_bytes(self._single_input(body, catalog.PROMPT_INPUT), self.args.limits.max_text_chars)
        self._check_count(model, len(prompts))
        sampling = {k: params[k] for k in SAMPLING_PARAMS if k in params}
        sampling["priority"] = qos.priority.name.lower()  # the replica admits higher priorities to its batch first
        handle = self.handles[model]
        results = await asyncio.gather(*(generation.generate_text(handle, p, sampling) for p in prompts))
        return [v2.encode(catalog.GENERATED_OUTPUT, [r.text for r in results])], [model] * len(prompts)

    # -- OpenAI ----------------------------------------------------------------

    def _generators(self) -> list[str]:
        return [n for n, m in self.args.models.items() if m.family == "gpt"]

    def _generator_for(self, body: openai.SamplingFields, prompts: list[str]) -> DeploymentHandle:
        if body.model not in self._generators():
            raise NotFound(f"model {body.model!r} does not generate text; available: {self._generators()}")
        self._check_count(body.model, len(prompts) * body.n)
        limit = self.args.limits.max_text_chars
        for i, p in enumerate(prompts):
            if len(p) > limit:
                raise InvalidInput(f"prompt {i} has {len(p)} characters; at most {limit} are allowed")
        if body.stream and (len(prompts) != 1 or body.n != 1):
            raise InvalidInput("streaming takes exactly one prompt and n = 1")
        return self.handles[body.model]

    @app.get("/v1/models", responses=OPENAI_ERRORS)
    async def openai_models(self, authorization: str | None = Header(None)) -> openai.ModelList:
        self.tenants.authenticate(authorization)
        return openai.ModelList(data=[openai.ModelCard(id=n) for n in self._generators()])

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={200: {"model": openai.CompletionResponse, "description": "JSON, or SSE when stream"}, **OPENAI_ERRORS},
    )
    async def completions(
        self,
        body: openai.CompletionRequest,
        authorization: str | None = Header(None),
        x_priority: str | None = Header(None, description=PRIORITY_DOC),
    ) -> Response:
        priority = self._qos(self._caller(authorization), x_priority, None, None).priority.name.lower()
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        handle = self._generator_for(body, prompts)
        headers = {"X-Served-By": body.model}
        if body.stream:
            stream = generation.open_stream(handle, prompts[0], body.sampling(priority=priority))
            first = await generation.first_event(stream)
            cid, created = generation.new_id("cmpl"), generation.now()

            def render(event: Any, is_first: bool) -> dict[str, Any]:
                choice = openai.CompletionChoice(index=0, text=event.text, finish_reason=event.finish_reason)
                use = generation.event_usage(event) if body.usage_per_chunk() else None
                chunk = openai.CompletionResponse(id=cid, created=created, model=body.model, choices=[choice], usage=use)
                return chunk.model_dump()

            def final(last: Any) -> dict[str, Any] | None:
                if not body.include_usage():
                    return None
                use = generation.event_usage(last)
                return openai.CompletionResponse(id=cid, created=created, model=body.model, choices=[], usage=use).model_dump()

            events = generation.sse_events(stream, first, render, final)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        results = await generation.generate_all(handle, prompts, body, priority)
        choices = [openai.CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason) for i, r in enumerate(results)]  # type: ignore[arg-type]
        response = openai.CompletionResponse(model=body.model, choices=choices, usage=generation.usage(results, body.n))
        return JSONResponse(response.model_dump(), headers=headers)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: {"model": openai.ChatCompletionResponse, "description": "JSON, or SSE when stream"}, **OPENAI_ERRORS},
    )
    async def chat_completions(
        self,
        body: openai.ChatCompletionRequest,
        authorization: str | None = Header(None),
        x_priority: str | None = Header(None, description=PRIORITY_DOC),
    ) -> Response:
        priority = self._qos(self._caller(authorization), x_priority, None, None).priority.name.lower()
        prompt = body.prompt()
        handle = self._generator_for(body, [prompt])
        headers = {"X-Served-By": body.model}
        if body.stream:
            stream = generation.open_stream(handle, prompt, body.sampling(priority=priority))
            first = await generation.first_event(stream)
            cid, created = generation.new_id("chatcmpl"), generation.now()

            def render(event: Any, is_first: bool) -> dict[str, Any]:
                # OpenAI's first chunk carries the role; later ones only content.
                delta = openai.ChatDelta(role="assistant" if is_first else None, content=event.text)
                choice = openai.ChatChunkChoice(index=0, delta=delta, finish_reason=event.finish_reason)
                use = generation.event_usage(event) if body.usage_per_chunk() else None
                chunk = openai.ChatCompletionChunk(id=cid, created=created, model=body.model, choices=[choice], usage=use)
                return chunk.model_dump(exclude_none=True)

            def final(last: Any) -> dict[str, Any] | None:
                if not body.include_usage():
                    return None
                use = generation.event_usage(last)
                chunk = openai.ChatCompletionChunk(id=cid, created=created, model=body.model, choices=[], usage=use)
                return chunk.model_dump(exclude_none=True)

            events = generation.sse_events(stream, first, render, final)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        results = await generation.generate_all(handle, [prompt], body, priority)
        choices = [
            openai.ChatChoice(index=i, message=openai.ChatReply(content=r.text), finish_reason=r.finish_reason)  # type: ignore[arg-type]
            for i, r in enumerate(results)
        ]
        response = openai.ChatCompletionResponse(model=body.model, choices=choices, usage=generation.usage(results, body.n))
        return JSONResponse(response.model_dump(), headers=headers)
