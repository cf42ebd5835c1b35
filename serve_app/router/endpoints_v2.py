"""Open Inference Protocol v2 (KServe v2 / Triton HTTP): health, metadata and inference."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response

from serve_app import __version__
from serve_app.errors import InvalidInput
from serve_app.manifest import Manifest
from serve_app.models.sampling import GenerationParams
from serve_app.protocols import v2
from serve_app.router import catalog, classify, generation
from serve_app.router.docs import INFER_BODY, PRIORITY_DOC, TIMEOUT_DOC, V2_ERRORS
from serve_app.router.parts import RouterParts, router_parts
from serve_app.router.qos import QoS
from serve_app.scheduling.dispatcher import RequestTiming
from serve_app.scheduling.tenants import Tenant

# Triton-style request parameters a v2 generation request may carry.
SAMPLING_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")

api = APIRouter()
PARTS = Depends(router_parts)


@api.get("/v2/health/live")
async def live() -> dict[str, bool]:
    return {"live": True}


@api.get("/v2/health/ready")
async def ready(parts: RouterParts = PARTS) -> JSONResponse:
    ok = await parts.catalog.all_ready(parts.catalog.models)
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


@api.get("/v2")
async def server_metadata() -> v2.ServerMetadata:
    return v2.ServerMetadata(name="serve-app", version=__version__, extensions=v2.EXTENSIONS)


async def _manifest(parts: RouterParts, name: str, version: str | None) -> Manifest:
    """The metadata a name shows (a route shows its light tier's), after 404 checks."""
    parts.catalog.known(name)
    manifest = await parts.catalog.manifest(parts.catalog.answering_model(name))
    parts.catalog.check_version(name, version, manifest)
    return manifest


@api.get("/v2/models/{name}", responses=V2_ERRORS)
@api.get("/v2/models/{name}/versions/{version}", responses=V2_ERRORS)
async def model_metadata(
    name: str, version: str | None = None, authorization: str | None = Header(None), parts: RouterParts = PARTS
) -> v2.ModelMetadata:
    parts.callers.authenticate(authorization)
    manifest = await _manifest(parts, name, version)
    return catalog.model_metadata(name, manifest, parts.catalog.platform(name))


@api.get("/v2/models/{name}/ready", responses=V2_ERRORS)
@api.get("/v2/models/{name}/versions/{version}/ready", responses=V2_ERRORS)
async def model_ready(name: str, version: str | None = None, parts: RouterParts = PARTS) -> JSONResponse:
    parts.catalog.known(name)
    if version is not None:
        await _manifest(parts, name, version)
    ok = await parts.catalog.all_ready(parts.catalog.members(name))
    return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)


@api.get("/v2/models/{name}/config", responses=V2_ERRORS)
@api.get("/v2/models/{name}/versions/{version}/config", responses=V2_ERRORS)
async def model_config(
    name: str, version: str | None = None, authorization: str | None = Header(None), parts: RouterParts = PARTS
) -> dict[str, Any]:
    parts.callers.authenticate(authorization)
    manifest = await _manifest(parts, name, version)
    max_batch_size = int(parts.catalog.batching[parts.catalog.answering_model(name)]["max_batch_size"])
    return catalog.triton_config(name, manifest, max_batch_size, parts.catalog.platform(name))


@api.post("/v2/models/{name}/infer", openapi_extra=INFER_BODY, responses={200: {"model": v2.InferResponse}, **V2_ERRORS})
@api.post(
    "/v2/models/{name}/versions/{version}/infer",
    openapi_extra=INFER_BODY,
    responses={200: {"model": v2.InferResponse}, **V2_ERRORS},
)
async def infer(
    request: Request,
    name: str,
    version: str | None = None,
    x_priority: str | None = Header(None, description=PRIORITY_DOC),
    x_request_timeout_ms: str | None = Header(None, description=TIMEOUT_DOC),
    authorization: str | None = Header(None, description="Bearer <API key>, when keys are configured"),
    inference_header_content_length: str | None = Header(
        None, description="binary tensor data extension: length of the JSON part of the body"
    ),
    parts: RouterParts = PARTS,
) -> Response:
    # Declared here for routing fallbacks and the OpenAPI document; requests normally arrive
    # through the fast path (serve_app.router.fastpath), which calls the same function.
    return await answer_infer(
        parts, name, version, request.body, x_priority, x_request_timeout_ms, authorization, inference_header_content_length
    )


async def answer_infer(
    parts: RouterParts,
    name: str,
    version: str | None,
    read_body: Callable[[], Awaitable[bytes]],
    x_priority: str | None,
    x_request_timeout_ms: str | None,
    authorization: str | None,
    inference_header_content_length: str | None,
) -> Response:
    """One v2 infer request, from its path parameters, headers and body to its response."""
    started = time.perf_counter()
    timing = RequestTiming()
    tenant = parts.callers.admit(authorization)
    parts.catalog.known(name)
    # Read after the key and rate checks; the edge (serve_app.router.edge) holds it to the body limit.
    body = v2.parse_request(await read_body(), inference_header_content_length)
    params = body.parameters or {}
    qos = parts.callers.qos(tenant, x_priority, x_request_timeout_ms, params)
    manifest = await _manifest(parts, name, version)
    degraded = None
    if manifest.family == "gpt":
        outputs, served_by = await _generate(parts, parts.catalog.answering_model(name), body, params, qos, tenant)
    else:
        outputs, served_by, degraded = await _classify(parts, name, manifest, body, qos, timing, tenant)
    outputs = _requested(body, outputs)
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


def _requested(body: v2.InferRequest, outputs: list[v2.ResponseOutput]) -> list[v2.ResponseOutput]:
    """The outputs the request asked for (all when it names none); 400 for a name the model lacks."""
    if body.outputs is None:
        return outputs
    wanted = [o.name for o in body.outputs]
    unknown = [w for w in wanted if w not in {o.name for o in outputs}]
    if unknown:
        raise InvalidInput(f"unknown requested outputs {unknown}; this model has {sorted(o.name for o in outputs)}")
    return [o for o in outputs if o.name in wanted]


async def _classify(
    parts: RouterParts, name: str, manifest: Manifest, body: v2.InferRequest, qos: QoS, timing: RequestTiming, tenant: Tenant
) -> tuple[list[v2.ResponseOutput], list[str], str | None]:
    payload = await classify.decode_input(parts.args, parts.catalog.answering_model(name), manifest, body)
    tenant.admit(len(payload) - 1)  # one token per item: the first was charged on arrival
    cascade = parts.cascades.get(name)
    if cascade is not None:
        result = await cascade.classify(payload, qos.priority, qos.deadline, timing)
    else:
        n = len(payload)
        logits = await parts.submit(name, payload, n, qos.priority, qos.deadline, timing)
        result = classify.ClassifierResult(logits, [name] * n)
    return classify.outputs(result, manifest.labels), result.served_by, result.degraded


async def _generate(
    parts: RouterParts, model: str, body: v2.InferRequest, params: dict[str, Any], qos: QoS, tenant: Tenant
) -> tuple[list[v2.ResponseOutput], list[str]]:
    prompts = v2.decode_bytes(classify.single_input(body, catalog.PROMPT_INPUT), parts.args.limits.max_text_chars)
    classify.check_count(parts.args, model, len(prompts))
    tenant.admit(len(prompts) - 1)
    sampling = {k: params[k] for k in SAMPLING_PARAMS if k in params}
    # Checked here too, so that a bad value is refused before any replica sees it.
    gen = parts.args.models[model].generation
    GenerationParams.from_raw(sampling, gen.default_max_tokens, gen.max_tokens_limit)
    sampling["priority"] = qos.priority.name.lower()  # the replica admits higher priorities to its batch first
    handle, breaker = parts.handles[model], parts.breakers[model]
    generation.check_breaker(model, breaker)
    deadline = qos.deadline if qos.deadline is not None else time.monotonic() + parts.args.limits.generation_timeout_s
    calls = [generation.generate_text(handle, p, sampling, breaker) for p in prompts]
    results = await generation.all_or_none(calls, deadline)
    return [v2.encode(catalog.GENERATED_OUTPUT, [r.text for r in results])], [model] * len(prompts)
