"""Triton's model repository extension, load and unload, for every router of an application.

An operator unloads a model (`POST /v2/repository/models/{name}/unload`): its requests are then
refused (503, and not ready) on every router, and the call returns once the router it reached has
no work of that model left, queued or running. Loading it again (`.../load`) serves it again.
Loading a name that fits a multiplexed pool (`reviews-*`) and names a model directory added under
the pool's path (or S3 prefix) since the build makes it one of the pool's models, with no
redeploy: the pool's replicas load it on its first batch, like the others.

Which models stand unloaded, and which were added so, is kept in one small detached Ray actor per
application, placed as the rollback ledger is (rollback_ledger.app_actor). Each router asks it
every second (background.FOLLOW_REPOSITORY_S) and on every load and unload it serves, so another
router follows within that. An unloaded model stays so across router restarts and redeploys
until an operator loads it; to load every model at once, `ray.kill` the actor (`repository_name`,
namespace `serve_app`). Should the actor be lost, the next call makes a new, empty one: every
model is loaded again, and models added at run time are served once loaded again (a redeploy
finds their directories anyway).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from serve_app.router.routing.rollback_ledger import SCHEMA, app_actor

logger = logging.getLogger("ray.serve")
CALL_TIMEOUT_S = 5.0


class RepositoryLedger:
    """The models an application's operators unloaded, and those they added to a pool since the
    build, each with when (wall-clock seconds)."""

    def __init__(self) -> None:
        self.unloaded: dict[str, float] = {}
        self.added: dict[str, str] = {}  # model -> the pool (its pattern) it was added to

    def set(self, model: str, loaded: bool, at: float, pool: str | None = None) -> dict[str, dict[str, Any]]:
        """Load or unload `model`; `pool`: a load that adds it to that pool."""
        if loaded:
            self.unloaded.pop(model, None)
            if pool is not None:
                self.added.setdefault(model, pool)
        else:
            self.unloaded.setdefault(model, at)
        return self.get()

    def get(self) -> dict[str, dict[str, Any]]:
        return {"unloaded": dict(self.unloaded), "added": dict(self.added)}


RepositoryActor = ray.remote(num_cpus=0, max_restarts=0)(RepositoryLedger)
LEDGER_SCHEMA = "2"  # the ledger's own: it keeps the added models, with their pools, since 2


def repository_name(app_name: str) -> str:
    return f"repository:{SCHEMA}.{LEDGER_SCHEMA}:{app_name}"


class SharedRepository:
    """One router's view of its application's repository: `on_added` is told each model added at run
    time, with its pool (before `on_change` may name it), `on_change` each new set of unloaded models."""

    def __init__(
        self,
        app_name: str,
        on_change: Callable[[frozenset[str]], None] | None = None,
        timeout_s: float = CALL_TIMEOUT_S,
        on_added: Callable[[dict[str, str]], None] | None = None,
    ) -> None:
        self.app_name = app_name
        self.on_change = on_change or (lambda unloaded: None)  # the router's catalog, once wired (parts.py)
        self.on_added = on_added or (lambda added: None)  # the router's pool members, once wired (parts.py)
        self.timeout_s = timeout_s
        self.actor: Any = None
        self.unloaded: frozenset[str] = frozenset()
        self.added: dict[str, str] = {}

    async def follow(self) -> None:
        """Adopt what the ledger holds now."""
        self._adopt(await self._call("get"))

    async def set(self, model: str, loaded: bool, at: float, pool: str | None = None) -> None:
        """Load or unload `model` for every router (`pool`: a model new since the build, added to
        that pool); raises when the ledger cannot be reached."""
        self._adopt(await self._call("set", model, loaded, at, pool))

    async def _call(self, method: str, *args: Any) -> dict[str, dict[str, Any]]:
        try:
            if self.actor is None:
                self.actor = await asyncio.wait_for(
                    asyncio.to_thread(app_actor, RepositoryActor, repository_name(self.app_name)), self.timeout_s
                )
            result: dict[str, dict[str, Any]] = await asyncio.wait_for(getattr(self.actor, method).remote(*args), self.timeout_s)
            return result
        except RayActorError:
            self.actor = None  # gone: looked up (or made again) next time
            raise

    def _adopt(self, state: dict[str, dict[str, Any]]) -> None:
        added: dict[str, str] = state["added"]
        if new := {model: pool for model, pool in added.items() if model not in self.added}:
            self.on_added(new)
        self.added = dict(added)
        unloaded = frozenset(state["unloaded"])
        if unloaded != self.unloaded:
            self.unloaded = unloaded
            self.on_change(unloaded)
