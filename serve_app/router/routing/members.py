"""A multiplexed pool's models added at run time: a model directory put under a pool's path (or S3
prefix) after the build, loaded by an operator through the repository extension
(`POST /v2/repository/models/{name}/load`, endpoints/repository.py), is served from then on
without a redeploy, by the pool's replicas like the models they were built with.

The router that takes the load checks the directory first (it exists, its name fits the pool's
pattern, and its files would load); every router of the application then adds the model when it
follows the repository's ledger (repository.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from serve_app.config import AppArgs
from serve_app.errors import InvalidInput, NotFound
from serve_app.exports import export_problem
from serve_app.sources import SourceError, is_remote

logger = logging.getLogger("ray.serve")


class PoolMembers:
    """Adds models to the pools of one router: its config, its handles and its traffic policy's
    first versions learn each one."""

    def __init__(
        self,
        args: AppArgs,
        handles: dict[str, Any],
        pool_handles: dict[str, Any],
        first_versions: dict[str, str],
        multiplexed: Callable[[Any, str], Any] = lambda handle, name: handle.options(multiplexed_model_id=name),
    ) -> None:
        self.args = args
        self.handles = handles  # model -> its handle: what the router's senders and metadata calls use
        self.pool_handles = pool_handles  # pool pattern -> its deployment's handle
        self.first_versions = first_versions  # the traffic policy's: a request naming no version gets this one
        self.multiplexed = multiplexed

    def candidates(self) -> list[str]:
        """The model directories under the pools' paths that fit a pool and are not served yet.
        Blocking: it reads each pool's directory or lists its prefix."""
        found: list[str] = []
        for pattern in self.args.pools:
            try:
                found += [name for name in self.args.pool_candidates(pattern) if name not in self.args.models]
            except SourceError as e:
                logger.warning("pool %s: its models cannot be listed: %s", pattern, e)
        return sorted(found)

    def check(self, name: str) -> None:
        """Raise NotFound unless `name` fits a pool and has a model directory under its path, and
        InvalidInput when that directory's model would not load. Blocking, as `candidates`."""
        config = self.args.pool_member_config(name)
        if config is None:
            raise NotFound(f"unknown model {name!r}; the repository holds {sorted(self.args.models)}")
        pattern, source = config.pool, str(config.path)
        try:
            present = name in self.args.pool_candidates(str(pattern))
        except SourceError as e:
            raise NotFound(f"model {name!r}: pool {pattern!r} cannot be listed: {e}") from None
        if not present:
            raise NotFound(f"unknown model {name!r}: no model directory {name} under pool {pattern!r}'s path")
        # A model in an object store is checked by the replica that first loads it, as at the build:
        # checking it here would fetch it to the router's node.
        if not is_remote(source) and (problem := export_problem(source, name, config)) is not None:
            raise InvalidInput(f"failed to load {name!r}: {problem}")

    def adopt(self, names: list[str]) -> None:
        """Serve each of `names` from now on as a model of the pool it fits (the ledger's added
        models: checked by the router that took their load)."""
        for name in names:
            if name in self.args.models:
                continue
            pattern = self.args.pool_for(name)
            if pattern is None or pattern not in self.pool_handles:
                logger.warning("router: %s was added to a pool, but fits none of this application's", name)
                continue
            self.args.add_pool_member(name)
            self.handles[name] = self.multiplexed(self.pool_handles[pattern], name)
            self.first_versions[name] = self.args.models[name].version
            logger.info("router: %s is now a model of pool %s", name, pattern)
