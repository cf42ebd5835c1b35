"""The router deployment: wires one replica's parts together and serves them over HTTP.

Everything it does lives elsewhere: the endpoints in `endpoints/` (`endpoints_v2`,
`endpoints_openai`), the parts in `parts` (callers, catalog, per-model
dispatchers, route cascades, background loops), process setup in `startup`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle
from tritonclient.grpc import service_pb2 as pb

from serve_app.config import AppArgs, RouterLiveConfig
from serve_app.observability import tracing
from serve_app.router.edge import direct
from serve_app.router.endpoints.grpc_service import MODEL_INFER, GrpcInference, answered, fail, headers_of, rpc_attributes
from serve_app.router.http import build_http_app
from serve_app.router.parts import build_parts
from serve_app.router.routing.dispatchers import handle_sender
from serve_app.router.routing.replicas import ROUTER_DEPLOYMENT, DeploymentStates, controller_states
from serve_app.router.routing.repository import SharedRepository
from serve_app.router.routing.rollback_ledger import SharedRollbacks
from serve_app.router.startup import ingress_report, prepare_process
from serve_app.scheduling.autoscale import ROUTER_CPU
from serve_app.scheduling.protection.overload import CpuMeter

logger = logging.getLogger("ray.serve")


@serve.deployment(max_ongoing_requests=256)
@serve.ingress()
class Router:
    """One router replica. The constructor only wires; `startup` runs before traffic arrives."""

    def __init__(
        self, args: dict[str, Any], handles: dict[str, DeploymentHandle], pools: dict[str, DeploymentHandle] | None = None
    ) -> None:
        self.args = AppArgs.model_validate(args)
        # A pool's models share its deployment: each one's calls name it, so that a replica runs them
        # on that model (loading it first) and the pool's request router places them (models/pool.py).
        handles = {
            name: h.options(multiplexed_model_id=name) if self.args.served[name].config.pool else h for name, h in handles.items()
        }
        context = serve.get_replica_context()
        router_id = context.replica_id.unique_id
        node_id = ray.get_runtime_context().get_node_id()
        states = DeploymentStates(controller_states(context.app_name))
        self.rollbacks = SharedRollbacks(context.app_name)
        self.repository = SharedRepository(context.app_name)
        self.parts = build_parts(
            self.args,
            handles,
            router_id,
            lambda model: handle_sender(handles[model], router_id, node_id if self.linked(model) else None),
            router_count=lambda: states.running(ROUTER_DEPLOYMENT),
            states=states,
            share_rollbacks=self.rollbacks.exchange,
            repository=self.repository,
            pool_handles=pools,
        )
        self.grpc = GrpcInference(self.parts)
        self.cpu = CpuMeter()

    def linked(self, model: str) -> bool:
        """Whether batches for `model` may take a same-node link (never a pool's: Serve places those)."""
        return self.args.scheduling.advanced.local_link and self.args.served[model].config.pool is None

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve asks for this replica's app after the constructor (late-bound `serve.ingress()`)."""
        app = build_http_app(self.parts, self.startup, self.shutdown)
        level, line = ingress_report(os.environ, direct.install(app, self.args.limits.infer_timeout_s))
        logger.log(level, line)
        return app

    async def startup(self) -> None:
        """The replica's one startup hook (the app's lifespan): process setup, then the background loops."""
        prepare_process(self.args.scheduling, self.parts.gc_pauses, open_to_all=self.parts.callers.tenants.open)
        tracing.setup(self.args.tracing, service="router")
        self.parts.loops.start()

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """The live part of the config (RouterLiveConfig): applied without a restart on `serve deploy`.
        Serve calls it before the replica takes traffic, so a new router adopts the rollbacks the
        others stand by (rollback_ledger.py) before it routes a request to a canary they condemned."""
        live = RouterLiveConfig.model_validate(user_config or {})
        self.parts.versions.update(live.traffic)
        if self.parts.versions.policy.judges:
            await self.rollbacks.exchange(self.parts.versions.policy)

    def check_health(self) -> None:
        """Serve's periodic probe: unhealthy when a background loop has died."""
        self.parts.loops.check()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The cores this replica used since Serve last asked: what `RouterLoadPolicy` scales on."""
        return {ROUTER_CPU: self.cpu.sample()}

    # inference.GRPCInferenceService, through Serve's gRPC proxy (`grpc_options` in the configs):
    # each RPC is the method of its name; serve_app.router.endpoints.grpc_service does the work.

    async def ServerLive(self, request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        return await self.grpc.server_ready()

    async def ServerMetadata(self, request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        return self.grpc.server_metadata()

    async def ModelReady(self, request: pb.ModelReadyRequest, grpc_context: RayServegRPCContext) -> pb.ModelReadyResponse:
        return await answered(self.grpc.model_ready(request), grpc_context, pb.ModelReadyResponse)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, grpc_context: RayServegRPCContext
    ) -> pb.ModelMetadataResponse:
        return await answered(self.grpc.model_metadata(request, grpc_context), grpc_context, pb.ModelMetadataResponse)

    async def ModelConfig(self, request: pb.ModelConfigRequest, grpc_context: RayServegRPCContext) -> pb.ModelConfigResponse:
        return await answered(self.grpc.model_config(request, grpc_context), grpc_context, pb.ModelConfigResponse)

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, grpc_context: RayServegRPCContext
    ) -> pb.RepositoryIndexResponse:
        return await answered(self.grpc.repository_index(request, grpc_context), grpc_context, pb.RepositoryIndexResponse)

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, grpc_context: RayServegRPCContext
    ) -> pb.RepositoryModelLoadResponse:
        return await answered(self.grpc.repository_load(request, grpc_context), grpc_context, pb.RepositoryModelLoadResponse)

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, grpc_context: RayServegRPCContext
    ) -> pb.RepositoryModelUnloadResponse:
        return await answered(self.grpc.repository_unload(request, grpc_context), grpc_context, pb.RepositoryModelUnloadResponse)

    async def ModelInfer(self, request: pb.ModelInferRequest, grpc_context: RayServegRPCContext) -> pb.ModelInferResponse:
        headers = headers_of(grpc_context)
        with tracing.server_span(MODEL_INFER, headers.trace_context(), rpc_attributes(request)) as span:
            try:
                return await self.grpc.model_infer(request, headers)
            except Exception as e:
                if span is not None:
                    span.set_attribute("error.type", type(e).__name__)
                fail(grpc_context, e)
                return pb.ModelInferResponse()

    async def ModelStreamInfer(
        self, request_stream: AsyncIterator[pb.ModelInferRequest], grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        async for response in self.grpc.model_stream_infer(request_stream, headers_of(grpc_context)):
            yield response

    async def shutdown(self) -> None:
        tracing.flush()
        await self.parts.loops.stop()
        await self.parts.versions.stop()
        await self.parts.cache.close()
        self.parts.gc_pauses.uninstall()
