"""The deployment that stands in for a model whose files cannot load.

The app builder checks every model before binding it (serve_app.exports.discover). A model that
fails the check is deployed as this instead: one replica, no CPU, no model. It logs the problem
once, as one line, and answers every call the router makes for the model with that reason as a
503 with Retry-After, while the rest of the application serves. Fixing the files and deploying
again (`serve deploy`, or `serve run` once more) replaces it with the real model.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

from ray import serve

from serve_app.contract import BatchReply
from serve_app.errors import Unavailable, cannot_load

logger = logging.getLogger("ray.serve")


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class UnavailableModel:
    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        logger.error("model %s cannot load: %s", name, reason)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """The model's `user_config` (batching, drills) has nothing to tune here; Serve requires
        this method of a deployment that is given one."""

    def error(self) -> Unavailable:
        return cannot_load(self.name, self.reason)

    async def run(self, payloads: list[Any], *args: Any, **kwargs: Any) -> BatchReply:
        """A classifier batch: every request in it gets the reason."""
        return BatchReply([self.error() for _ in payloads], 0.0, 0.0)

    async def generate(self, prompt: str, raw_params: dict[str, Any]) -> AsyncGenerator[Any, None]:
        raise self.error()
        yield  # an async generator, as a generator deployment's `generate` is

    async def metadata(self) -> dict[str, Any]:
        raise self.error()

    async def stats(self) -> dict[str, Any]:
        return {"unavailable": self.reason}

    async def runtime_info(self) -> dict[str, Any]:
        return {"unavailable": self.reason}
