"""OpenAI-compatible generation: `/v1/models`, `/v1/completions`, `/v1/chat/completions`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Header
from fastapi.responses import Response

from serve_app.errors import InvalidInput, NotFound
from serve_app.models.generation.sampling import GenerationParams
from serve_app.protocols import openai
from serve_app.router.endpoints import generation
from serve_app.router.endpoints.codecs import check_count
from serve_app.router.endpoints.docs import OPENAI_ERRORS, PRIORITY_DOC, TIMEOUT_DOC
from serve_app.router.endpoints.generation import Generated
from serve_app.router.parts import RouterParts, router_parts
from serve_app.router.request_context import RequestContext
from serve_app.tokenization import not_unicode

api = APIRouter()
PARTS = Depends(router_parts)


@dataclass
class CallerHeaders:
    """The headers both generation endpoints take: who calls, at what priority, by when."""

    authorization: str | None
    priority: str | None
    timeout_ms: str | None


async def caller_headers(
    authorization: str | None = Header(None),
    x_priority: str | None = Header(None, description=PRIORITY_DOC),
    x_request_timeout_ms: str | None = Header(None, description=TIMEOUT_DOC),
) -> CallerHeaders:
    return CallerHeaders(authorization, x_priority, x_request_timeout_ms)


CALLER = Depends(caller_headers)


def _admit(parts: RouterParts, headers: CallerHeaders, model: str) -> RequestContext:
    """The caller (401, and 429 for its first token), the priority its tenant allows, and the
    deadline: the request's own, or the configured generation timeout."""
    tenant = parts.callers.admit(headers.authorization)
    qos = parts.callers.qos(tenant, headers.priority, headers.timeout_ms, None)
    deadline = qos.deadline if qos.deadline is not None else time.monotonic() + parts.args.limits.generation_timeout_s
    return RequestContext(model, None, tenant, qos.priority, deadline)


def _generator_for(parts: RouterParts, ctx: RequestContext, body: openai.SamplingFields, prompts: list[str]) -> Any:
    generators = parts.catalog.generators()
    if body.model not in generators:
        raise NotFound(f"model {body.model!r} does not generate text; available: {generators}")
    check_count(parts.args, body.model, len(prompts) * body.n)
    limit = parts.args.limits.max_text_chars
    for i, p in enumerate(prompts):
        if len(p) > limit:
            raise InvalidInput(f"prompt {i} has {len(p)} characters; at most {limit} are allowed")
    if (bad := not_unicode(prompts)) is not None:
        raise bad
    # Checked here as on the v2 path, so that a bad value is refused before any replica sees it
    # (the last choice's: its seed is the largest).
    gen = parts.args.deployment_config(body.model).generation
    GenerationParams.from_raw(body.sampling(body.n - 1), gen.default_max_tokens, gen.max_tokens_limit)
    if body.stream and (len(prompts) != 1 or body.n != 1):
        raise InvalidInput("streaming takes exactly one prompt and n = 1")
    parts.catalog.available(body.model)  # a model that cannot load: 503 before the tenant is charged
    # Charged after every check of the request itself, so that a refused request costs its
    # caller only the arrival token, as on the v2 path.
    ctx.tenant.admit(len(prompts) * body.n, charged=1)  # one token per generation: the first was charged on arrival
    generation.check_breaker(body.model, parts.breakers[body.model])
    return parts.handles[body.model]


@api.get("/v1/models", responses=OPENAI_ERRORS)
async def openai_models(authorization: str | None = Header(None), parts: RouterParts = PARTS) -> openai.ModelList:
    parts.callers.authenticate(authorization)
    # A generator that cannot load is left out: OpenAI clients pick a model from this list.
    serving = [n for n in parts.catalog.generators() if n not in parts.args.unavailable]
    return openai.ModelList(data=[openai.ModelCard(id=n) for n in serving])


@api.post(
    "/v1/completions",
    response_model=None,
    responses={200: {"model": openai.CompletionResponse, "description": "JSON, or SSE when stream"}, **OPENAI_ERRORS},
)
async def completions(
    body: openai.CompletionRequest,
    headers: CallerHeaders = CALLER,
    parts: RouterParts = PARTS,
) -> Response:
    ctx = _admit(parts, headers, body.model)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt

    def chunk(cid: str, created: int, event: Any, is_first: bool, use: openai.Usage | None) -> dict[str, Any]:
        choices = [] if event is None else [openai.CompletionChoice(index=0, text=event.text, finish_reason=event.finish_reason)]
        return openai.CompletionResponse(id=cid, created=created, model=body.model, choices=choices, usage=use).model_dump()

    def whole(results: list[Generated]) -> dict[str, Any]:
        choices = [openai.CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason) for i, r in enumerate(results)]  # type: ignore[arg-type]
        usage = generation.usage(results, body.n)
        return openai.CompletionResponse(model=body.model, choices=choices, usage=usage).model_dump()

    handle = _generator_for(parts, ctx, body, prompts)
    return await generation.stream_or_collect(handle, parts.breakers[body.model], ctx, prompts, body, "cmpl", chunk, whole)


@api.post(
    "/v1/chat/completions",
    response_model=None,
    responses={200: {"model": openai.ChatCompletionResponse, "description": "JSON, or SSE when stream"}, **OPENAI_ERRORS},
)
async def chat_completions(
    body: openai.ChatCompletionRequest,
    headers: CallerHeaders = CALLER,
    parts: RouterParts = PARTS,
) -> Response:
    ctx = _admit(parts, headers, body.model)
    prompts = [body.prompt()]

    def chunk(cid: str, created: int, event: Any, is_first: bool, use: openai.Usage | None) -> dict[str, Any]:
        choices = []
        if event is not None:
            # OpenAI's first chunk carries the role; later ones only content.
            delta = openai.ChatDelta(role="assistant" if is_first else None, content=event.text)
            choices = [openai.ChatChunkChoice(index=0, delta=delta, finish_reason=event.finish_reason)]
        reply = openai.ChatCompletionChunk(id=cid, created=created, model=body.model, choices=choices, usage=use)
        return reply.model_dump(exclude_none=True)

    def whole(results: list[Generated]) -> dict[str, Any]:
        choices = [
            openai.ChatChoice(index=i, message=openai.ChatReply(content=r.text), finish_reason=r.finish_reason)  # type: ignore[arg-type]
            for i, r in enumerate(results)
        ]
        usage = generation.usage(results, body.n)
        return openai.ChatCompletionResponse(model=body.model, choices=choices, usage=usage).model_dump()

    handle = _generator_for(parts, ctx, body, prompts)
    return await generation.stream_or_collect(handle, parts.breakers[body.model], ctx, prompts, body, "chatcmpl", chunk, whole)
