"""What Serve's controller says of this application's deployments: status and running replicas.
The router asks it before it asks a model's replicas anything, so that a model scaled
to zero (`min_replicas: 0`) is ready to take requests without being woken by a health probe.

One answer serves every caller for `ttl_s`: readiness probes in a burst ask the controller once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

# Statuses in which a deployment at zero running replicas takes requests: its target is zero
# (HEALTHY), or Serve is starting replicas for the requests that arrived (UPSCALING), or it is
# on its way down. UPDATING (a deploy in progress), UNHEALTHY and DEPLOY_FAILED are not ready.
TAKES_REQUESTS_AT_ZERO = frozenset({"HEALTHY", "UPSCALING", "DOWNSCALING"})
ROUTER_DEPLOYMENT = "router"  # the router's own deployment in the application (serve_app.app)


@dataclass(frozen=True)
class DeploymentState:
    status: str
    running: int  # replicas in state RUNNING

    @property
    def scaled_to_zero(self) -> bool:
        return self.running == 0 and self.status in TAKES_REQUESTS_AT_ZERO


FetchStates = Callable[[], Awaitable[dict[str, DeploymentState]]]


class DeploymentStates:
    def __init__(
        self, fetch: FetchStates, ttl_s: float = 1.0, clock: Callable[[], float] = time.monotonic, timeout_s: float = 5.0
    ) -> None:
        self.fetch = fetch
        self.ttl_s = ttl_s
        self.clock = clock
        self.timeout_s = timeout_s  # a controller slow to answer must not hold readiness probes
        self._last: tuple[float, dict[str, DeploymentState]] | None = None
        self._pending: asyncio.Future[dict[str, DeploymentState]] | None = None

    async def get(self) -> dict[str, DeploymentState]:
        if self._last is not None and self.clock() - self._last[0] < self.ttl_s:
            return self._last[1]
        if self._pending is None:
            pending = self._pending = asyncio.ensure_future(self._refresh())
            pending.add_done_callback(self._forget)
        return await asyncio.shield(self._pending)

    def _forget(self, done: asyncio.Future[dict[str, DeploymentState]]) -> None:
        """The finished refresh is never reused: the next one past the TTL asks again. Its
        exception, if any, reached its callers; marked seen here for those that went away."""
        if self._pending is done:
            self._pending = None
        if not done.cancelled():
            done.exception()

    async def _refresh(self) -> dict[str, DeploymentState]:
        states = await asyncio.wait_for(self.fetch(), self.timeout_s)
        self._last = (self.clock(), states)
        return states

    async def running(self, deployment: str) -> int:
        """Replicas of `deployment` running now, at least 1 (the caller is one). Serve's replica
        context cannot say: its `world_size` is the configured count, not the autoscaled one."""
        state = (await self.get()).get(deployment)
        return max(1, state.running) if state is not None else 1

    async def takes_requests(self, deployment: str) -> bool:
        """Whether the controller has a replica of `deployment` running, or holds it at zero on
        purpose (its requests start one); False when it cannot be asked."""
        try:
            state = (await self.get()).get(deployment)
        except Exception:
            return False
        return state is not None and (state.running > 0 or state.scaled_to_zero)

    async def scaled_to_zero(self, deployment: str) -> bool:
        """True only when the controller says so; when it cannot be asked, the replicas are."""
        try:
            state = (await self.get()).get(deployment)
        except Exception:
            return False
        return state is not None and state.scaled_to_zero


def parse_status(status: Any, app: str) -> dict[str, DeploymentState]:
    """Serve's public `serve.status()` (a `ServeStatus`), for one app's deployments."""
    overview = status.applications.get(app)
    if overview is None:
        return {}
    return {
        name: DeploymentState(status=_name(d.status), running=int(d.replica_states.get("RUNNING", 0)))
        for name, d in overview.deployments.items()
    }


def _name(value: Any) -> str:
    """An enum member or its string value, as Serve's status holds either."""
    return str(getattr(value, "value", value))


def controller_states(app: str) -> FetchStates:
    """The states of `app`'s deployments, from `serve.status()` (a blocking call to Serve's
    controller: off the router's event loop)."""

    async def fetch() -> dict[str, DeploymentState]:
        from ray import serve

        return parse_status(await asyncio.to_thread(serve.status), app)

    return fetch
