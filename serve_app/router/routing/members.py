"""A multiplexed pool's models added at run time: a model directory put under a pool's path (or S3
prefix) after the build, loaded by an operator through the repository extension
(`POST /v2/repository/models/{name}/load`, endpoints/repository.py), is served from then on
without a redeploy, by the pool's replicas like the models they were built with.

The router that takes the load finds the directory first (under the path of a pool whose pattern
the name fits, and its files would load); every router of the application then adds the model,
to that pool, when it follows the repository's ledger (repository.py). Not done: a directory
removed after its model was added stays a model of the pool (its loads then fail), and a
symbolic link under a pool's path is followed like a directory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from serve_app.config import AppArgs, ModelConfig
from serve_app.errors import InvalidInput, NotFound, Unavailable
from serve_app.exports import export_problem
from serve_app.sources import SourceError, is_remote

logger = logging.getLogger("ray.serve")
LISTING_TTL_S = 5.0


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
        listing_ttl_s: float = LISTING_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.args = args
        self.handles = handles  # model -> its handle: what the router's senders and metadata calls use
        self.pool_handles = pool_handles  # pool pattern -> its deployment's handle
        self.first_versions = first_versions  # the traffic policy's: a request naming no version gets this one
        self.multiplexed = multiplexed
        self.listing_ttl_s = listing_ttl_s
        self.clock = clock
        self._listed: tuple[float, dict[str, list[str]]] | None = None

    def listed(self) -> dict[str, list[str]]:
        """Each pool's model directories now (kept for `listing_ttl_s`: an index call lists no
        S3 prefix more often). Blocking: it reads each pool's directory or lists its prefix."""
        now = self.clock()
        if self._listed is not None and now - self._listed[0] < self.listing_ttl_s:
            return self._listed[1]
        found: dict[str, list[str]] = {}
        for pattern in list(self.args.pools):
            try:
                found[pattern] = self.args.pool_candidates(pattern)
            except SourceError as e:
                logger.warning("pool %s: its models cannot be listed: %s", pattern, e)
        self._listed = (now, found)
        return found

    def candidates(self, listed: dict[str, list[str]]) -> list[str]:
        """Of what `listed` found, the directories no router serves yet (on the event loop: it
        reads the models, which `adopt` changes)."""
        return sorted({name for names in listed.values() for name in names if name not in self.args.models})

    def find(self, name: str) -> tuple[str, ModelConfig]:
        """The pool whose path holds a model directory `name`, and the model's entry there; raises
        NotFound when none does, Unavailable when a pool cannot be listed, InvalidInput when the
        directory's model would not load. Blocking, as `listed`; reads only the pools' entries."""
        patterns = self.args.pools_for(name)
        if not patterns:
            raise NotFound(f"unknown model {name!r}: no model of the repository and no pool's pattern fits it")
        for pattern in patterns:
            try:
                present = name in self.args.pool_candidates(pattern)
            except SourceError as e:
                raise Unavailable(f"model {name!r}: pool {pattern!r} cannot be listed now: {e}", retry_after_s=5.0) from None
            if not present:
                continue
            config = self.args.pool_member_config(pattern, name)
            # A model in an object store is checked by the replica that first loads it, as at the
            # build: checking it here would fetch it to the router's node.
            source = str(config.path)
            if not is_remote(source) and (problem := export_problem(source, name, config)) is not None:
                raise InvalidInput(f"failed to load {name!r}: {problem}")
            return pattern, config
        raise NotFound(f"unknown model {name!r}: no model directory {name} under the path of pool {', '.join(patterns)}")

    def adopt(self, added: dict[str, str]) -> None:
        """Serve each model of `added` (model -> its pool) from now on (the ledger's added models:
        checked by the router that took their load). One that cannot be added is logged and left."""
        for name, pattern in added.items():
            if name in self.args.models or pattern not in self.pool_handles:
                continue
            if not self.args.add_pool_member(pattern, name):
                logger.warning("router: %s cannot be added to pool %s (it does not fit, or is a route's name)", name, pattern)
                continue
            self.handles[name] = self.multiplexed(self.pool_handles[pattern], name)
            self.first_versions[name] = self.args.models[name].version
            self._listed = None
            logger.info("router: %s is now a model of pool %s", name, pattern)
