"""The shared tier: a Redis server several routers read and write. It is an optimisation, never a
dependency: a slow or failed call is a miss, and after a failure the tier is skipped for a while."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("ray.serve")
MAX_PENDING_WRITES = 64  # writes in flight at once; past it an answer is not shared (the local tier has it)


class RedisTier:
    def __init__(
        self,
        client: Any,
        prefix: str,
        ttl_s: int,
        timeout_s: float,
        retry_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client  # a redis.asyncio.Redis, or anything with its async get/set
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.clock = clock
        self.down_until = 0.0
        self.errors = 0
        self.skipped_writes = 0
        self._writes: set[asyncio.Task[None]] = set()

    @classmethod
    def from_url(cls, url: str, prefix: str, ttl_s: int, timeout_s: float, retry_s: float) -> RedisTier:
        import redis.asyncio as redis

        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, prefix, ttl_s, timeout_s, retry_s)

    @property
    def up(self) -> bool:
        return self.clock() >= self.down_until

    def _failed(self, what: str, error: BaseException) -> None:
        self.errors += 1
        if self.up:  # log once per outage, not once per request
            logger.warning("response cache: shared tier %s failed (%r); skipping it for %.0f s", what, error, self.retry_s)
        self.down_until = self.clock() + self.retry_s

    async def get(self, key: str) -> bytes | None:
        if not self.up:
            return None
        try:
            value = await asyncio.wait_for(self.client.get(self.prefix + key), self.timeout_s)
        except Exception as e:  # any failure of the shared tier is a miss
            self._failed("read", e)
            return None
        return bytes(value) if value is not None else None

    def put(self, key: str, value: bytes) -> None:
        """Write in the background: the answer goes to the client without waiting for Redis."""
        if not self.up or len(self._writes) >= MAX_PENDING_WRITES:
            self.skipped_writes += 1
            return
        task = asyncio.get_running_loop().create_task(self._write(key, value))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, key: str, value: bytes) -> None:
        try:
            await asyncio.wait_for(self.client.set(self.prefix + key, value, ex=self.ttl_s), self.timeout_s)
        except Exception as e:
            self._failed("write", e)

    async def written(self) -> None:
        """Wait for the writes in flight to end (stored or failed): for an orderly close and tests."""
        await asyncio.gather(*self._writes, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._writes):
            task.cancel()
        await asyncio.gather(*self._writes, return_exceptions=True)
        try:
            await self.client.aclose()
        except Exception:  # closing a dead connection may fail; nothing is left to do
            logger.debug("response cache: closing the shared tier failed", exc_info=True)
