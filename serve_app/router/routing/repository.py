"""Triton's model repository extension, load and unload, for every router of an application.

An operator unloads a model (`POST /v2/repository/models/{name}/unload`): its requests are then
refused (503, and not ready) on every router, and the call returns once the router it reached has
no work of that model left, queued or running. Loading it again (`.../load`) serves it again. The
models that can be loaded are the ones the app was built with, a multiplexed pool's among them (a
pool's model takes its replica memory only while a replica holds it); a new model directory needs
a redeploy.

Which models stand unloaded is kept in one small detached Ray actor per application, placed as
the rollback ledger is (rollback_ledger.app_actor). Each router asks it every second
(background.FOLLOW_REPOSITORY_S) and on every load and unload it serves, so another router
follows within that. An unloaded model stays so across router restarts and redeploys until an
operator loads it; to load every model at once, `ray.kill` the actor (`repository_name`,
namespace `serve_app`). Should the actor be lost, the next call makes a new, empty one: every
model is loaded again.
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
    """The models an application's operators unloaded, each with when (wall-clock seconds)."""

    def __init__(self) -> None:
        self.unloaded: dict[str, float] = {}

    def set(self, model: str, loaded: bool, at: float) -> dict[str, float]:
        if loaded:
            self.unloaded.pop(model, None)
        else:
            self.unloaded.setdefault(model, at)
        return dict(self.unloaded)

    def get(self) -> dict[str, float]:
        return dict(self.unloaded)


RepositoryActor = ray.remote(num_cpus=0, max_restarts=0)(RepositoryLedger)


def repository_name(app_name: str) -> str:
    return f"repository:{SCHEMA}:{app_name}"


class SharedRepository:
    """One router's view of its application's unloaded models; `on_change` is told each new set."""

    def __init__(
        self, app_name: str, on_change: Callable[[frozenset[str]], None] | None = None, timeout_s: float = CALL_TIMEOUT_S
    ) -> None:
        self.app_name = app_name
        self.on_change = on_change or (lambda unloaded: None)  # the router's catalog, once wired (parts.py)
        self.timeout_s = timeout_s
        self.actor: Any = None
        self.unloaded: frozenset[str] = frozenset()

    async def follow(self) -> None:
        """Adopt what the ledger holds now."""
        self._adopt(await self._call("get"))

    async def set(self, model: str, loaded: bool, at: float) -> None:
        """Load or unload `model` for every router; raises when the ledger cannot be reached."""
        self._adopt(await self._call("set", model, loaded, at))

    async def _call(self, method: str, *args: Any) -> dict[str, float]:
        try:
            if self.actor is None:
                self.actor = await asyncio.wait_for(
                    asyncio.to_thread(app_actor, RepositoryActor, repository_name(self.app_name)), self.timeout_s
                )
            result: dict[str, float] = await asyncio.wait_for(getattr(self.actor, method).remote(*args), self.timeout_s)
            return result
        except RayActorError:
            self.actor = None  # gone: looked up (or made again) next time
            raise

    def _adopt(self, unloaded: dict[str, float]) -> None:
        now = frozenset(unloaded)
        if now != self.unloaded:
            self.unloaded = now
            self.on_change(now)
