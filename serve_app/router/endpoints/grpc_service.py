"""`inference.GRPCInferenceService` on the router, behind Ray Serve's gRPC proxy: the calls Triton's
and KServe's gRPC clients make, answered by the same request path as HTTP (serve_app.router.endpoints.infer_v2):
the same keys, rate limits, priorities, deadlines, tiers, versions and cache.

Call metadata plays the part of HTTP's headers (`authorization`, `x-priority`,
`x-request-timeout-ms`, `x-session-key`, `cache-control`); errors become gRPC status codes with the
message as details and, after an overload, `retry-after` in the trailing metadata.

ModelStreamInfer is Triton's bidirectional stream: each request on it is answered as it finishes,
beside the others. A generator's answer streams, one response per decoded piece of text, then (when
the client asked, as tritonclient does with `enable_empty_final_response`) an empty response marked
`triton_final_response`. A failed request gets a response carrying its error; the stream goes on.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import grpc
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.grpc_util import RayServegRPCContext
from tritonclient.grpc import service_pb2 as pb

from serve_app import __version__, families
from serve_app.errors import InvalidInput, NotFound, Overloaded, PayloadTooLarge, ServeAppError
from serve_app.models.generation.sampling import GenerationParams
from serve_app.observability import tracing
from serve_app.protocols import grpc_v2, v2
from serve_app.router.edge.failures import served_error
from serve_app.router.endpoints import codecs, generation, repository
from serve_app.router.endpoints.endpoints_v2 import config, metadata, ready_members
from serve_app.router.endpoints.infer_v2 import SAMPLING_PARAMS, admitted, infer
from serve_app.router.parts import RouterParts
from serve_app.router.request_context import InferHeaders

T = TypeVar("T")

logger = logging.getLogger("ray.serve")
FINAL = "triton_final_response"
WANTS_FINAL = "triton_enable_empty_final_response"


def headers_of(context: RayServegRPCContext) -> InferHeaders:
    meta: Mapping[str, str] = dict(context.invocation_metadata())
    return InferHeaders(
        priority=meta.get("x-priority"),
        timeout_ms=meta.get("x-request-timeout-ms"),
        authorization=meta.get("authorization"),
        session_key=meta.get("x-session-key"),
        cache_control=meta.get("cache-control"),
        traceparent=meta.get("traceparent"),
        tracestate=meta.get("tracestate"),
    )


SERVICE = "inference.GRPCInferenceService"
MODEL_INFER, STREAM_INFER = f"{SERVICE}/ModelInfer", f"{SERVICE}/ModelStreamInfer"


def rpc_attributes(request: pb.ModelInferRequest) -> dict[str, str]:
    return {"rpc.system": "grpc", "rpc.service": SERVICE, "serve_app.model": request.model_name}


def fail(context: RayServegRPCContext, error: BaseException) -> None:
    """Set the call's status from an error; unexpected ones are logged and not shown to the client."""
    if isinstance(error, DeploymentUnavailableError):
        error = served_error(error)
    if isinstance(error, ServeAppError):
        context.set_code(grpc_v2.status_of(error))
        context.set_details(error.message)
        context.set_trailing_metadata(grpc_v2.trailing_metadata(error))
        return
    logger.exception("gRPC call failed", exc_info=error)
    context.set_code(grpc.StatusCode.INTERNAL)
    context.set_details("internal error")


async def answered(call: Awaitable[T | None], context: RayServegRPCContext, empty: Callable[[], T]) -> T:
    """An RPC's answer, or its empty message with the call's status set from the error (`fail`);
    an RPC with nothing to say (load, unload) answers the empty message."""
    try:
        result = await call
    except Exception as e:
        fail(context, e)
        return empty()
    return empty() if result is None else result


def message_of(error: BaseException) -> str:
    if isinstance(error, DeploymentUnavailableError):
        error = served_error(error)
    if isinstance(error, ServeAppError):
        return f"{error.code}: {error.message}"
    logger.exception("gRPC stream request failed", exc_info=error)
    return "internal_error: internal error"


class GrpcInference:
    """The service's calls for one router replica; the Router deployment's methods delegate here."""

    def __init__(self, parts: RouterParts) -> None:
        self.parts = parts

    async def server_ready(self) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self.parts.catalog.all_ready(self.parts.catalog.serving()))

    @staticmethod
    def server_metadata() -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="serve-app", version=__version__, extensions=v2.EXTENSIONS)

    async def model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        """Not ready, rather than an error, for a name or version that is not served: what a
        readiness check asks is whether to send it requests (tritonclient raises on errors)."""
        try:
            members = ready_members(self.parts, request.name, request.version or None)
        except NotFound:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=await self.parts.catalog.all_ready(members))

    async def model_metadata(self, request: pb.ModelMetadataRequest, context: RayServegRPCContext) -> pb.ModelMetadataResponse:
        self.parts.callers.authenticate(headers_of(context).authorization)
        meta = await metadata(self.parts, request.name, request.version or None)
        tensors = {
            "inputs": [pb.ModelMetadataResponse.TensorMetadata(**t.model_dump()) for t in meta.inputs],
            "outputs": [pb.ModelMetadataResponse.TensorMetadata(**t.model_dump()) for t in meta.outputs],
        }
        return pb.ModelMetadataResponse(name=meta.name, versions=meta.versions, platform=meta.platform, **tensors)

    async def model_config(self, request: pb.ModelConfigRequest, context: RayServegRPCContext) -> pb.ModelConfigResponse:
        self.parts.callers.authenticate(headers_of(context).authorization)
        return grpc_v2.config_to_proto(await config(self.parts, request.name, request.version or None))

    async def repository_index(
        self, request: pb.RepositoryIndexRequest, context: RayServegRPCContext
    ) -> pb.RepositoryIndexResponse:
        self.parts.callers.authenticate(headers_of(context).authorization)
        models = await repository.index(self.parts, ready_only=request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m) for m in models])

    async def repository_load(self, request: pb.RepositoryModelLoadRequest, context: RayServegRPCContext) -> None:
        await repository.load(self.parts, headers_of(context).authorization, request.model_name)

    async def repository_unload(self, request: pb.RepositoryModelUnloadRequest, context: RayServegRPCContext) -> None:
        await repository.unload(self.parts, headers_of(context).authorization, request.model_name)

    async def model_infer(self, request: pb.ModelInferRequest, headers: InferHeaders) -> pb.ModelInferResponse:
        limit, size = self.parts.args.limits.max_request_bytes, request.ByteSize()
        if size > limit:
            raise PayloadTooLarge(f"the request has {size} bytes; at most {limit} are accepted")
        held = self.parts.inflight_bytes
        # The same budget as HTTP bodies, checked before the rate limit charges (as over HTTP).
        if not held.take(size):
            raise Overloaded(f"the router holds {held.held} bytes of requests, its limit is {held.limit}", retry_after_s=1.0)
        try:
            return await self._infer(request, headers)
        finally:
            held.give_back(size)

    @asynccontextmanager
    async def _gated(self, headers: InferHeaders) -> AsyncIterator[None]:
        """Taken into the router by its own overload control, as an HTTP request is from its gate
        to its answer (serve_app/router/admission/protect.py), or its 503 raised."""
        gate = self.parts.gate
        priority, refused = gate.enter(headers.as_metadata()) if gate is not None else (None, None)
        if refused is not None:
            raise refused
        try:
            yield
        finally:
            if gate is not None:
                gate.leave(priority)

    async def _infer(self, request: pb.ModelInferRequest, headers: InferHeaders) -> pb.ModelInferResponse:
        async with self._gated(headers):
            tenant = self.parts.callers.admit(headers.authorization)
            self.parts.catalog.known(request.model_name)
            body = grpc_v2.request_from_proto(request)
            ctx = admitted(self.parts, request.model_name, request.model_version or None, body, headers, tenant)
            response, _ = await infer(self.parts, ctx, body)
            return grpc_v2.response_to_proto(response)

    async def model_stream_infer(
        self, requests: AsyncIterator[pb.ModelInferRequest], headers: InferHeaders
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Answer each request on the stream as it finishes, concurrently; end when the client has
        closed its side and every answer is out."""
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def answer(request: pb.ModelInferRequest) -> None:
            with tracing.server_span(STREAM_INFER, headers.trace_context(), rpc_attributes(request)) as span:
                try:
                    async for response in self._stream_one(request, headers):
                        await out.put(response)
                except Exception as e:  # this request's failure; the stream and its other requests go on
                    if span is not None:
                        span.set_attribute("error.type", type(e).__name__)
                    await out.put(pb.ModelStreamInferResponse(error_message=message_of(e)))

        async def read() -> None:
            async for request in requests:
                task = asyncio.create_task(answer(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*list(tasks))
            await out.put(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await out.get()) is not None:
                yield response
            await reader  # its errors (a broken request stream) are the call's
        finally:  # the client went away: stop everything it started
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _stream_one(
        self, request: pb.ModelInferRequest, headers: InferHeaders
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        name = request.model_name
        self.parts.catalog.known(name)
        deployment = self.parts.catalog.deployment(name, request.model_version or None)
        manifest = await self.parts.catalog.manifest(deployment)
        wants_final = WANTS_FINAL in request.parameters and bool(grpc_v2.parameter_value(request.parameters[WANTS_FINAL]))
        if not families.family(manifest.family).generates:
            answered = await self.model_infer(request, headers)
            if wants_final:
                grpc_v2.set_parameter(answered.parameters[FINAL], True)
            yield pb.ModelStreamInferResponse(infer_response=answered)
            return
        async with self._gated(headers):  # a generation is in flight for as long as it streams, as over HTTP
            async for piece in self._generate(request, headers):
                yield pb.ModelStreamInferResponse(infer_response=piece)
        if wants_final:
            last = pb.ModelInferResponse(model_name=name, model_version=request.model_version, id=request.id)
            grpc_v2.set_parameter(last.parameters[FINAL], True)
            yield pb.ModelStreamInferResponse(infer_response=last)

    async def _generate(self, request: pb.ModelInferRequest, headers: InferHeaders) -> AsyncIterator[pb.ModelInferResponse]:
        """One prompt's text as it is decoded: the same checks as the HTTP path's generation."""
        parts, name = self.parts, request.model_name
        tenant = parts.callers.admit(headers.authorization)
        body = grpc_v2.request_from_proto(request)
        ctx = admitted(parts, name, request.model_version or None, body, headers, tenant)
        deployment = parts.versions.deployment(name, ctx.version, ctx.session_key, tenant.name)
        prompts = v2.decode_bytes(codecs.single_input(body, codecs.PROMPT_INPUT), parts.args.limits.max_text_chars)
        if len(prompts) != 1:
            raise InvalidInput(f"a streamed generation takes one prompt, got {len(prompts)}")
        params = body.parameters or {}
        sampling: dict[str, Any] = {k: params[k] for k in SAMPLING_PARAMS if k in params}
        gen = parts.args.deployment_config(deployment).generation
        GenerationParams.from_raw(sampling, gen.default_max_tokens, gen.max_tokens_limit)  # 400 before any replica
        sampling["priority"] = ctx.priority.name.lower()
        parts.catalog.available(deployment)
        handle, breaker = parts.handles[deployment], parts.breakers[deployment]
        generation.check_breaker(deployment, breaker)
        deadline = ctx.deadline_or(parts.args.limits.generation_timeout_s)
        stream, event = await generation.first_event(handle, prompts[0], sampling, deadline, breaker)
        version = parts.versions.version_of(deployment)
        finished = False
        try:
            while True:
                yield _text_response(name, version, request.id, event.text, event.finish_reason)
                if event.finish_reason is not None:
                    break
                try:
                    event = await generation.next_event(stream, deadline)
                except StopAsyncIteration:
                    break
            finished = True
        except Exception as e:
            generation.record(breaker, e)
            raise generation.unavailable_if_gone(e) from None
        finally:
            if not finished:  # failed, past its deadline, or the client left: stop decoding for nobody
                stream.cancel()
        generation.record(breaker, None)


def _text_response(name: str, version: str, request_id: str, text: str, finish: str | None) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=name, model_version=version, id=request_id)
    response.outputs.add(name=codecs.GENERATED_OUTPUT, datatype="BYTES", shape=[1])
    data = text.encode()
    response.raw_output_contents.append(struct.pack("<I", len(data)) + data)
    if finish is not None:
        grpc_v2.set_parameter(response.parameters["finish_reason"], finish)
    return response
