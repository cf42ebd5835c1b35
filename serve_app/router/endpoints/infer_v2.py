"""One v2 infer request, from its path parameters, headers and body to its response: its context
(serve_app.router.request_context), the version that answers (traffic policy), the response cache,
then, as its family says (serve_app.families), the queue of a batched model (a route's cascade) or
a generator."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response

from serve_app import families
from serve_app.cache import tiered
from serve_app.cache.keys import cache_key
from serve_app.errors import InvalidInput
from serve_app.manifest import Manifest
from serve_app.models.generation.sampling import GenerationParams
from serve_app.protocols import v2, v2_render
from serve_app.router.endpoints import codecs, generation
from serve_app.router.endpoints.codecs import Codec
from serve_app.router.parts import RouterParts
from serve_app.router.request_context import InferHeaders, RequestContext
from serve_app.router.routing import catalog
from serve_app.router.routing.cascade import ClassifierResult
from serve_app.scheduling.dispatcher import RequestTiming
from serve_app.scheduling.tenants import Tenant

# Triton-style request parameters a v2 generation request may carry.
SAMPLING_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


class ReadyResponse(Response):
    """A response whose body is rendered and whose headers are final: starlette's constructor would
    look both over again, on every answer."""

    def __init__(self, body: bytes, headers: dict[str, str]) -> None:
        self.status_code = 200
        self.background = None
        self.body = body
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        raw.append((b"content-length", str(len(body)).encode()))
        self.raw_headers = raw


@dataclass
class Answer:
    outputs: list[v2.ResponseOutput]
    served_by: list[str]
    version: str
    degraded: str | None = None
    cache: str | None = None  # "hit-local", "hit-shared", "miss"; None when the cache was not consulted


async def answer_infer(
    parts: RouterParts,
    name: str,
    version: str | None,
    read_body: Callable[[], Awaitable[bytes | bytearray]],
    headers: InferHeaders,
) -> Response:
    started = time.perf_counter()
    tenant = parts.callers.admit(headers.authorization)
    parts.catalog.known(name)
    # Read after the key and rate checks; the edge (serve_app.router.edge.checks) holds it to the body limit.
    body = v2.parse_request(await read_body(), headers.header_length)
    ctx = admitted(parts, name, version, body, headers, tenant, started)
    response, out_headers = await infer(parts, ctx, body)
    content, extra = v2_render.render_response(response, v2.binary_outputs(body, [o.name for o in response.outputs]))
    out_headers["Server-Timing"] = ctx.server_timing()
    return ReadyResponse(content, {**out_headers, **extra})


def admitted(
    parts: RouterParts,
    name: str,
    version: str | None,
    body: v2.InferRequest,
    headers: InferHeaders,
    tenant: Tenant,
    started: float | None = None,
) -> RequestContext:
    """The context of a parsed request from an admitted caller: its class and deadline (headers
    win over Triton's parameters, the tenant caps the class) and whether the cache may answer it.
    With `started` (HTTP), its time is kept for Server-Timing."""
    params = body.parameters or {}
    qos = parts.callers.qos(tenant, headers.priority, headers.timeout_ms, params)
    use_cache = parts.cache.covers(name) and not _opted_out(headers, params)
    timing = RequestTiming() if started is not None else None
    return RequestContext(
        name, version, tenant, qos.priority, qos.deadline, headers.session_key, use_cache, started or 0.0, timing
    )


async def infer(parts: RouterParts, ctx: RequestContext, body: v2.InferRequest) -> tuple[v2.InferResponse, dict[str, str]]:
    """A parsed request from an admitted caller, whichever wire it came on (HTTP or gRPC): the
    response and the headers that describe it (who answered, cache, degradation)."""
    manifest = await parts.catalog.manifest(parts.catalog.deployment(ctx.name, ctx.version))
    family = families.family(manifest.family)
    codec = codecs.codec_of(family)
    if family.generates:
        answer = await _generate(parts, ctx, codec, manifest, body)
    else:
        with codecs.urgent(codec, body, ctx.priority):
            answer = await _batched(parts, ctx, codec, manifest, body)
    outputs = _requested(body, answer.outputs)
    parameters: dict[str, Any] = {"served_by": answer.served_by}
    out_headers = {"X-Served-By": ",".join(dict.fromkeys(answer.served_by))}
    if answer.degraded:
        parameters["degraded"] = out_headers["X-Degraded"] = answer.degraded
    if answer.cache:
        out_headers["X-Cache"] = answer.cache
    response = v2.made_response(ctx.name, answer.version, body.id, parameters, outputs)
    return response, out_headers


def repeatable(params: GenerationParams) -> bool:
    """Whether a generation gives the same text every time, so that its answer may be kept:
    greedy or seeded; sampled text without a seed differs from call to call."""
    return params.temperature == 0.0 or params.seed is not None


def _opted_out(headers: InferHeaders, params: dict[str, Any]) -> bool:
    control = (headers.cache_control or "").lower()
    return "no-cache" in control or "no-store" in control or params.get("cache") is False


def _requested(body: v2.InferRequest, outputs: list[v2.ResponseOutput]) -> list[v2.ResponseOutput]:
    """The outputs the request asked for (all when it names none); 400 for a name the model lacks."""
    if body.outputs is None:
        return outputs
    wanted = [o.name for o in body.outputs]
    unknown = [w for w in wanted if w not in {o.name for o in outputs}]
    if unknown:
        raise InvalidInput(f"unknown requested outputs {unknown}; this model has {sorted(o.name for o in outputs)}")
    return [o for o in outputs if o.name in wanted]


def _key(
    parts: RouterParts, ctx: RequestContext, deployments: list[str], payload: Any, body: v2.InferRequest, extra: str = ""
) -> str:
    requested = sorted(o.name for o in body.outputs) if body.outputs is not None else None
    per_tenant = ctx.tenant.name if parts.cache.config.per_tenant else None
    answering = [parts.answer_ids.of(d) for d in deployments]
    return cache_key(ctx.name, answering, body.inputs[0].name, payload, requested, per_tenant, extra)


async def _batched(parts: RouterParts, ctx: RequestContext, codec: Codec, manifest: Manifest, body: v2.InferRequest) -> Answer:
    """A family whose deployment answers batches: the request's payload through its queue (a
    route's through its cascade), one answer per payload."""
    cascade = parts.cascades.get(ctx.name)
    if cascade is not None:
        # A route has one version of its own; each tier's version is its model's policy's choice.
        tiers = [parts.versions.deployment(m, None, ctx.session_key, ctx.tenant.name) for m in (cascade.light, cascade.heavy)]
        answered_version = catalog.ROUTE_VERSION
    else:
        tiers = [parts.versions.deployment(ctx.name, ctx.version, ctx.session_key, ctx.tenant.name)]
        answered_version = parts.versions.version_of(tiers[0])
        manifest = await parts.catalog.manifest(tiers[0])  # the chosen version's labels and shapes
    payload = await codec.decode(body, manifest, parts.args, tiers[0])
    ctx.tenant.admit(len(payload), charged=1)  # one token per item: the first was charged on arrival
    # A route's answers also depend on when it escalates (its threshold and signal).
    policy = "" if cascade is None else f"{cascade.policy.threshold!r}:{cascade.policy.signal}"
    key = _key(parts, ctx, tiers, payload, body, policy) if ctx.use_cache else None
    if key is not None and (hit := await parts.cache.get(key)) is not None:
        logits, served_by = tiered.decode_logits(hit[0])
        return Answer(codec.outputs(logits, manifest), served_by, answered_version, cache=f"hit-{hit[1]}")
    if cascade is not None:
        result = await cascade.classify(payload, ctx.priority, ctx.deadline, ctx.timing, (tiers[0], tiers[1]))
    else:
        n = len(payload)
        logits = await parts.versions.submit(tiers[0], payload, n, ctx.priority, ctx.deadline, ctx.timing)
        result = ClassifierResult(logits, [tiers[0]] * n)
    if key is not None and result.degraded is None:  # a fallback answer is not the route's answer to keep
        parts.cache.put(key, tiered.encode_logits(result.logits, result.served_by))
    return Answer(
        codec.outputs(result.logits, manifest), result.served_by, answered_version, result.degraded,
        "miss" if key is not None else None,
    )  # fmt: skip


async def _generate(parts: RouterParts, ctx: RequestContext, codec: Codec, manifest: Manifest, body: v2.InferRequest) -> Answer:
    """A family whose deployment streams tokens: each prompt's whole text, generated side by side."""
    deployment = parts.versions.deployment(ctx.name, ctx.version, ctx.session_key, ctx.tenant.name)
    prompts = await codec.decode(body, manifest, parts.args, deployment)
    params = body.parameters or {}
    sampling = {k: params[k] for k in SAMPLING_PARAMS if k in params}
    # Checked here too, so that a bad value is refused before any replica sees it.
    gen = parts.args.deployment_config(deployment).generation
    checked = GenerationParams.from_raw(sampling, gen.default_max_tokens, gen.max_tokens_limit)
    ctx.tenant.admit(len(prompts), charged=1)  # after the request's own checks: a refusal costs the arrival token only
    answered_version = parts.versions.version_of(deployment)
    key = None
    if ctx.use_cache and repeatable(checked):
        key = _key(parts, ctx, [deployment], prompts, body, json.dumps(sampling, sort_keys=True))
        if (hit := await parts.cache.get(key)) is not None:
            texts, served_by = tiered.decode_texts(hit[0])
            return Answer(codec.outputs(texts, manifest), served_by, answered_version, cache=f"hit-{hit[1]}")
    sampling["priority"] = ctx.priority.name.lower()  # the replica admits higher priorities to its batch first
    parts.catalog.available(deployment)
    handle, breaker = parts.handles[deployment], parts.breakers[deployment]
    generation.check_breaker(deployment, breaker)
    deadline = ctx.deadline_or(parts.args.limits.generation_timeout_s)
    calls = [generation.generate_text(handle, p, sampling, breaker) for p in prompts]
    results = await generation.all_or_none(calls, deadline)
    texts = [r.text for r in results]
    if key is not None:
        parts.cache.put(key, tiered.encode_texts(texts, [deployment] * len(prompts)))
    return Answer(
        codec.outputs(texts, manifest), [deployment] * len(prompts), answered_version,
        cache="miss" if key is not None else None,
    )  # fmt: skip
