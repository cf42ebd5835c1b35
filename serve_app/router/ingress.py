"""The router deployment: wires one replica's parts together and serves them over HTTP.

Everything it does lives elsewhere: the endpoints in `endpoints_v2` and
`endpoints_openai`, the parts in `parts` (callers, catalog, per-model
dispatchers, route cascades, background loops), process setup in `startup`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppArgs, RouterLiveConfig
from serve_app.router.dispatchers import handle_sender
from serve_app.router.http import build_http_app
from serve_app.router.parts import build_parts
from serve_app.router.startup import prepare_process


@serve.deployment(max_ongoing_requests=256)
@serve.ingress()
class Router:
    """One router replica. The constructor only wires; `startup` runs before traffic arrives."""

    def __init__(self, args: dict[str, Any], handles: dict[str, DeploymentHandle]) -> None:
        self.args = AppArgs.model_validate(args)
        router_id = serve.get_replica_context().replica_id.unique_id
        self.parts = build_parts(
            self.args,
            handles,
            router_id,
            lambda model: handle_sender(handles[model], router_id),
            router_count=lambda: serve.get_replica_context().world_size,
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve asks for this replica's app after the constructor (late-bound `serve.ingress()`)."""
        return build_http_app(self.parts, self.startup, self.shutdown)

    async def startup(self) -> None:
        """The replica's one startup hook (the app's lifespan): process setup, then the background loops."""
        prepare_process(self.args.scheduling, self.parts.gc_pauses, open_to_all=self.parts.callers.tenants.open)
        self.parts.loops.start()

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """The live part of the config (RouterLiveConfig): applied without a restart on `serve deploy`."""
        live = RouterLiveConfig.model_validate(user_config or {})
        self.parts.versions.update(live.traffic)

    def check_health(self) -> None:
        """Serve's periodic probe: unhealthy when a background loop has died."""
        self.parts.loops.check()

    async def shutdown(self) -> None:
        await self.parts.loops.stop()
        await self.parts.versions.stop()
        await self.parts.cache.close()
        self.parts.gc_pauses.uninstall()
