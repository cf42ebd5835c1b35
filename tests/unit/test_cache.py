"""The response cache: keys, the byte-bounded local tier, and the shared tier on a real Redis server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from benchmarks.redis_server import RedisServer
from serve_app.cache.keys import cache_key
from serve_app.cache.local import ByteLRU
from serve_app.cache.shared import RedisTier
from serve_app.cache.tiered import ResponseCache, decode_logits, encode_logits
from serve_app.config import CacheConfig
from tests.unit.fakes import Clock


def key(**change: object) -> str:
    base: dict = dict(
        target="m", deployments=["m"], input_name="image", payload=np.zeros((1, 3, 4, 4), np.float32), requested=None
    )
    base.update(change)
    return cache_key(**base)  # type: ignore[arg-type]


def test_the_key_covers_everything_that_decides_the_answer():
    k = key()
    assert key() == k
    assert key(deployments=["m-v2"]) != k  # never across versions
    assert key(tenant="acme") != k and key(tenant="acme") != key(tenant="other")
    assert key(requested=["label"]) != k
    assert key(payload=np.zeros((1, 3, 4, 4), np.uint8)) != k  # datatype
    assert key(payload=np.zeros((1, 3, 2, 8), np.float32)) != k  # shape
    assert key(payload=np.ones((1, 3, 4, 4), np.float32)) != k  # bytes
    assert key(input_name="x") != k and key(target="route") != k and key(extra="seed=1") != k
    texts = key(payload=["ab", "c"])
    assert texts != key(payload=["a", "bc"]) and texts == key(payload=["ab", "c"])
    strided = np.arange(32, dtype=np.float32).reshape(1, 2, 4, 4)[:, :, ::2, ::2]
    assert key(payload=strided) == key(payload=np.ascontiguousarray(strided))


def test_the_local_tier_holds_its_byte_bound_and_evicts_least_recent_first():
    lru = ByteLRU(max_bytes=3 * (100 + ByteLRU.KEY_OVERHEAD))
    for k in "abc":
        lru.put(k, bytes(100))
    assert lru.get("a") is not None  # a is now the most recent
    lru.put("d", bytes(100))
    assert lru.get("b") is None and lru.get("a") is not None and lru.evictions == 1
    assert lru.bytes <= lru.max_bytes and len(lru) == 3
    lru.put("huge", bytes(10_000))  # larger than the whole bound: not kept, nothing evicted for it
    assert lru.get("huge") is None and len(lru) == 3


def test_a_classifier_answer_round_trips():
    logits = np.array([[1.5, -2.0], [0.25, 3.0]], np.float32)
    back, served_by = decode_logits(encode_logits(logits, ["m", "m-v2"]))
    assert np.array_equal(back, logits) and served_by == ["m", "m-v2"]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def config(redis: RedisServer, **kw: object) -> CacheConfig:
    # A generous timeout: a loaded machine must not turn a real server's answer into a miss
    # (test_a_slow_redis_call_counts_as_a_miss covers the timeout itself).
    return CacheConfig.model_validate({"enabled": True, "redis_url": redis.url, "redis_timeout_s": 5.0, **kw})


def test_two_routers_share_answers_through_redis(redis: RedisServer):
    async def main() -> None:
        a, b = ResponseCache.from_config(config(redis)), ResponseCache.from_config(config(redis))
        a.put("k1", b"answer")
        assert a.shared is not None
        await a.shared.written()  # the write goes in the background
        assert await b.get("k1") == (b"answer", "shared")
        assert await b.get("k1") == (b"answer", "local")  # kept locally after the shared hit
        assert await b.get("k2") is None
        assert b.lookups == {("shared", "hit"): 1, ("local", "hit"): 1, ("all", "miss"): 1}
        await a.close()
        await b.close()

    asyncio.run(main())


def test_a_redis_outage_is_a_miss_never_an_error_and_the_tier_comes_back():
    async def main(server: RedisServer) -> None:
        cache = ResponseCache.from_config(config(server, redis_retry_s=30, redis_timeout_s=2))
        shared = cache.shared
        assert shared is not None
        clock = Clock()
        shared.clock = clock  # the retry window moves by the test's hand, not the machine's speed
        cache.put("k", b"v")
        await shared.written()
        server.stop()
        assert await cache.get("other") is None  # the outage: a miss
        assert shared.errors == 1 and not shared.up
        calls = Calls(shared.client)
        shared.client = calls
        for _ in range(50):  # while it is down, no call goes to it (so none waits on it)
            assert await cache.get("other") is None
        cache.put("k3", b"v3")
        assert calls.made == 0 and shared.skipped_writes == 1 and shared.errors == 1
        assert await cache.get("k") == (b"v", "local")  # the local tier still answers
        server.start()
        clock.now = 31.0  # past the retry window: the tier is tried again
        shared.client = calls.client
        cache.put("k2", b"v2")
        await shared.written()
        assert shared.up and shared.errors == 1
        other = ResponseCache.from_config(config(server))
        assert await other.get("k2") == (b"v2", "shared")
        await cache.close()
        await other.close()

    with RedisServer() as server:
        asyncio.run(main(server))


class Calls:
    """A Redis client wrapper that counts the calls made through it."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.made = 0

    async def get(self, key: str) -> Any:
        self.made += 1
        return await self.client.get(key)

    async def set(self, *args: Any, **kwargs: Any) -> Any:
        self.made += 1
        return await self.client.set(*args, **kwargs)


def test_a_slow_redis_call_counts_as_a_miss():
    class Slow:
        async def get(self, key: str) -> bytes:
            await asyncio.sleep(1)
            return b"late"

    async def main() -> None:
        tier = RedisTier(Slow(), "p:", 60, timeout_s=0.05, retry_s=5)
        assert await tier.get("k") is None and tier.errors == 1

    asyncio.run(main())


def test_only_repeatable_generations_and_requests_that_allow_it_are_cached():
    from serve_app.models.generation.sampling import GenerationParams
    from serve_app.router.endpoints.infer_v2 import InferHeaders, _opted_out, repeatable

    def params(**raw: object) -> GenerationParams:
        return GenerationParams.from_raw(dict(raw), 8, 32)

    assert repeatable(params()) and repeatable(params(temperature=0.8, seed=3))
    assert not repeatable(params(temperature=0.8))
    assert _opted_out(InferHeaders(cache_control="no-cache"), {}) and _opted_out(InferHeaders(cache_control="No-Store"), {})
    assert _opted_out(InferHeaders(), {"cache": False}) and not _opted_out(InferHeaders(), {})
