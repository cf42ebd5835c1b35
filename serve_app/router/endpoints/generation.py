"""Generation through a generating family's token stream (`generate`, serve_app.families): whole
texts, and SSE streams in OpenAI's shapes.

The router keeps no generation state: it reads TokenEvents from a streaming
handle call and reshapes them. Closing a stream (the client went away)
cancels the replica-side generator, which frees its row in the decode loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from serve_app.errors import DeadlineExceeded, ModelFailure, Overloaded, ServeAppError, Unavailable
from serve_app.observability import tracing
from serve_app.protocols import openai
from serve_app.router.request_context import RequestContext
from serve_app.router.routing.dispatchers import replica_died
from serve_app.scheduling.protection.breaker import CircuitBreaker

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Generated:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


def generator_failed(error: BaseException) -> bool:
    """Whether an error is the generator's fault, and so counts against its breaker: a replica
    that died or failed does; a bad request, a full queue, a deadline or a client leaving does not."""
    if isinstance(error, ServeAppError):
        return error.status_code >= 500 and not isinstance(error, (Overloaded, DeadlineExceeded))
    return isinstance(error, Exception) and not isinstance(error, BackPressureError)


def record(breaker: CircuitBreaker, error: BaseException | None) -> None:
    if error is None:
        breaker.on_success()
    elif generator_failed(error):
        breaker.on_failure()


def check_breaker(model: str, breaker: CircuitBreaker) -> None:
    """Fail fast (503 + Retry-After) while the generator's circuit is open, before any work."""
    if not breaker.allow():
        retry = max(1.0, breaker.retry_after_s())
        raise Unavailable(f"{model}: circuit open after repeated failures", retry_after_s=retry)


def open_stream(handle: DeploymentHandle, prompt: str, params: dict[str, Any]) -> DeploymentResponseGenerator:
    if (traceparent := tracing.current_traceparent()) is not None:  # the replica's spans join the caller's trace
        params = {**params, tracing.TRACEPARENT: traceparent}
    stream = handle.options(stream=True).generate.remote(prompt, params)
    assert isinstance(stream, DeploymentResponseGenerator)  # stream=True: Ray's union type cannot say so
    return stream


def unavailable_if_gone(error: Exception) -> Exception:
    """A replica that died under a call whose retry failed too: a 503 with Retry-After (Serve is
    replacing it), not a 500. Serve's own refusal when every replica is full and the calls
    queued for them reached `max_queued_requests` (serve_app.app): a 503 with Retry-After too."""
    if replica_died(error):
        return Unavailable("the generator's replica went away; retry shortly", retry_after_s=1.0)
    if isinstance(error, BackPressureError):
        return Overloaded("every generator replica is full; retry later", retry_after_s=1.0)
    return error


async def generate_text(handle: DeploymentHandle, prompt: str, params: dict[str, Any], breaker: CircuitBreaker) -> Generated:
    """One whole generation. Nothing reaches the client until it ends, so a generation whose
    replica died runs once more from the start (Serve routes it to a live replica)."""
    for attempt in (1, 2):
        stream = open_stream(handle, prompt, params)
        text, finish, p_tok, c_tok = [], None, 0, 0
        try:
            async for event in stream:
                text.append(event.text)
                finish, p_tok, c_tok = event.finish_reason, event.prompt_tokens, event.completion_tokens
        except asyncio.CancelledError:
            stream.cancel()  # the client left: stop the replica decoding for nobody
            raise
        except Exception as e:
            if attempt == 1 and replica_died(e):
                continue  # counted against the breaker only if the retry fails too (see first_event)
            record(breaker, e)
            raise unavailable_if_gone(e) from None
        record(breaker, None)
        return Generated("".join(text), finish, p_tok, c_tok)
    raise AssertionError("unreachable: the second attempt returns or raises")


async def generate_all(
    handle: DeploymentHandle,
    prompts: list[str],
    body: openai.SamplingFields,
    priority: str,
    deadline: float,
    breaker: CircuitBreaker,
) -> list[Generated]:
    """n choices per prompt, prompt-major (OpenAI's choice order)."""
    calls = [generate_text(handle, p, body.sampling(i, priority), breaker) for p in prompts for i in range(body.n)]
    return await all_or_none(calls, deadline)


async def all_or_none(calls: list[Coroutine[Any, Any, Generated]], deadline: float) -> list[Generated]:
    """Every generation's result, in order. The first to fail cancels the others (their streams
    stop decoding on the replica, for nobody otherwise) and its error is the request's; at the
    deadline (monotonic seconds) all stop and the request gets a 504."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        done, pending = await asyncio.wait(
            tasks, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_EXCEPTION
        )
        if pending and not any(t.exception() is not None for t in done):
            raise DeadlineExceeded("the generation did not finish before its deadline")
    finally:  # failed, or this request was cancelled (the client left): stop the rest
        for task in tasks:
            task.cancel()
    for task in tasks:
        if task in done and (error := task.exception()) is not None:
            raise error
    return [t.result() for t in tasks]


def usage(results: list[Generated], n: int) -> openai.Usage:
    """Prompt tokens count once per prompt, as OpenAI counts them, not once per choice."""
    p_tok = sum(r.prompt_tokens for r in results[::n])
    c_tok = sum(r.completion_tokens for r in results)
    return openai.Usage(prompt_tokens=p_tok, completion_tokens=c_tok, total_tokens=p_tok + c_tok)


def event_usage(event: Any) -> openai.Usage:
    """Usage as of a stream's last TokenEvent (one prompt, one choice)."""
    return usage([Generated("", None, event.prompt_tokens, event.completion_tokens)], 1)


async def next_event(stream: DeploymentResponseGenerator, deadline: float) -> Any:
    """The stream's next token event, or DeadlineExceeded once the deadline has passed."""
    try:
        return await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise DeadlineExceeded("the generation did not finish before its deadline") from None


async def first_event(
    handle: DeploymentHandle, prompt: str, params: dict[str, Any], deadline: float, breaker: CircuitBreaker
) -> tuple[DeploymentResponseGenerator, Any]:
    """Open a stream and pull its first event before answering 200, so that a bad request is a
    4xx, not a broken stream. Nothing has reached the client yet: a stream whose replica died
    before its first token opens once more (Serve routes it to a live replica)."""
    for attempt in (1, 2):
        stream = open_stream(handle, prompt, params)
        try:
            return stream, await next_event(stream, deadline)
        except Exception as e:
            stream.cancel()
            if attempt == 1 and replica_died(e):
                # Not counted against the breaker unless the retry fails too: one replica's death
                # fails every stream it held at once, and would open the circuit for everyone.
                continue
            record(breaker, e)
            raise unavailable_if_gone(e) from None
        except BaseException:
            stream.cancel()
            raise
    raise AssertionError("unreachable: the second attempt returns or raises")


async def sse_events(
    stream: DeploymentResponseGenerator,
    first: Any,
    render: Callable[[Any, bool], dict[str, Any]],
    final: Callable[[Any], dict[str, Any] | None],
    deadline: float,
    breaker: CircuitBreaker,
) -> AsyncIterator[str]:
    """Server-sent events: `render(event, is_first)` per token event, then `final(last_event)` if
    not None; an error event when anything fails or the deadline passes; always `[DONE]` last."""
    event, is_first = first, True
    try:
        while True:
            yield f"data: {json.dumps(render(event, is_first), separators=(',', ':'))}\n\n"
            is_first = False
            if event.finish_reason is not None:
                break
            try:
                event = await next_event(stream, deadline)
            except StopAsyncIteration:
                break
        if (tail := final(event)) is not None:
            yield f"data: {json.dumps(tail, separators=(',', ':'))}\n\n"
        record(breaker, None)
    except Exception as e:
        record(breaker, e)
        # Headers are gone: an error mid-stream can only be an event, and the stream still ends
        # with [DONE] whatever failed (a replica that died mid-stream raises Ray's own errors).
        if not isinstance(e, ServeAppError):
            logger.warning("generation stream failed: %s", type(e).__name__)
            e = ModelFailure(f"generation failed ({type(e).__name__})")
        body = {"error": {"message": e.message, "type": "server_error", "param": None, "code": e.code}}
        yield f"data: {json.dumps(body)}\n\n"
    finally:
        # A no-op when the stream ended. When the client left, Starlette closes this generator
        # and the cancel reaches the replica, which stops decoding this row.
        stream.cancel()
    yield "data: [DONE]\n\n"


# (completion id, created, token event or None for the usage-only tail, first chunk?, usage) -> chunk
RenderChunk = Callable[[str, int, Any, bool, openai.Usage | None], dict[str, Any]]
# (the choices of every prompt, prompt-major) -> the whole, non-streamed answer
RenderWhole = Callable[[list[Generated]], dict[str, Any]]


async def stream_or_collect(
    handle: DeploymentHandle,
    breaker: CircuitBreaker,
    ctx: RequestContext,
    prompts: list[str],
    body: openai.SamplingFields,
    id_prefix: str,
    chunk: RenderChunk,
    whole: RenderWhole,
) -> Response:
    """One OpenAI generation request, either protocol: SSE chunks when `body.stream`, else one JSON
    answer. `ctx.deadline` is set (the request's own, or the generation timeout)."""
    assert ctx.deadline is not None, "a generation always has a deadline"
    priority, deadline = ctx.priority.name.lower(), ctx.deadline
    headers = {"X-Served-By": body.model}
    if not body.stream:
        results = await generate_all(handle, prompts, body, priority, deadline, breaker)
        return JSONResponse(whole(results), headers=headers)
    stream, first = await first_event(handle, prompts[0], body.sampling(priority=priority), deadline, breaker)
    cid, created = new_id(id_prefix), now()

    def render(event: Any, is_first: bool) -> dict[str, Any]:
        return chunk(cid, created, event, is_first, event_usage(event) if body.usage_per_chunk() else None)

    def final(last: Any) -> dict[str, Any] | None:
        return chunk(cid, created, None, False, event_usage(last)) if body.include_usage() else None

    events = sse_events(stream, first, render, final, deadline, breaker)
    return StreamOfEvents(events, stream, headers)


class StreamOfEvents(StreamingResponse):
    """An SSE response that stops its replica stream however it ends. `sse_events` cancels the
    stream when it ends, but only once it has started: a client that leaves before Starlette
    pulls the first event (or before this response is sent at all) would otherwise leave the
    replica decoding, holding a KV slot, for nobody."""

    def __init__(self, events: AsyncIterator[str], stream: DeploymentResponseGenerator, headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        # Never sent (the request was cancelled between its handler and its response): the stream
        # is stopped when the response is dropped.
        self._stop = weakref.finalize(self, stream.cancel)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stop()  # a no-op for a stream that ended


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
