"""The response cache the router consults: local tier first, then the shared one."""

from __future__ import annotations

import json
import struct
from collections import Counter

import numpy as np

from serve_app.cache.local import ByteLRU
from serve_app.cache.shared import RedisTier
from serve_app.config import CacheConfig


class ResponseCache:
    """`lookups` counts ("local", "hit"), ("shared", "hit") and ("all", "miss")."""

    def __init__(self, config: CacheConfig, shared: RedisTier | None = None) -> None:
        self.config = config
        self.local = ByteLRU(config.max_bytes)
        self.shared = shared
        self.lookups: Counter[tuple[str, str]] = Counter()
        self.skipped_large = 0

    @classmethod
    def from_config(cls, config: CacheConfig) -> ResponseCache:
        url = config.url()
        shared = (
            RedisTier.from_url(url, config.key_prefix, config.ttl_s, config.redis_timeout_s, config.redis_retry_s)
            if url
            else None
        )
        return cls(config, shared)

    def covers(self, name: str) -> bool:
        return self.config.enabled and (self.config.models is None or name in self.config.models)

    async def get(self, key: str) -> tuple[bytes, str] | None:
        """The stored answer and the tier that had it ("local" or "shared"), or None."""
        value = self.local.get(key) if self.config.max_bytes else None
        if value is not None:
            self.lookups[("local", "hit")] += 1
            return value, "local"
        if self.shared is not None:
            value = await self.shared.get(key)
            if value is not None:
                self.lookups[("shared", "hit")] += 1
                if self.config.max_bytes:
                    self.local.put(key, value)
                return value, "shared"
        self.lookups[("all", "miss")] += 1
        return None

    def put(self, key: str, value: bytes) -> None:
        if len(value) > self.config.max_entry_bytes:
            self.skipped_large += 1
            return
        if self.config.max_bytes:
            self.local.put(key, value)
        if self.shared is not None:
            self.shared.put(key, value)

    def snapshot(self) -> dict[str, object]:
        """Lookups by outcome, the local tier's fill, the shared tier's health: for /router/status."""
        shared = None
        if self.shared is not None:
            shared = {"up": self.shared.up, "errors": self.shared.errors, "skipped_writes": self.shared.skipped_writes}
        return {
            "enabled": self.config.enabled,
            "lookups": {f"{tier}/{outcome}": n for (tier, outcome), n in self.lookups.items()},
            "entries": len(self.local),
            "bytes": self.local.bytes,
            "evictions": self.local.evictions,
            "too_large": self.skipped_large,
            "shared": shared,
        }

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.close()


# What a classifier answer is stored as: its logits and who answered each row.
HEADER = struct.Struct("<I")


def encode_logits(logits: np.ndarray, served_by: list[str]) -> bytes:
    meta = json.dumps({"shape": list(logits.shape), "served_by": served_by}).encode()
    return HEADER.pack(len(meta)) + meta + np.ascontiguousarray(logits, dtype=np.float32).tobytes()


def decode_logits(blob: bytes) -> tuple[np.ndarray, list[str]]:
    (n,) = HEADER.unpack_from(blob)
    meta = json.loads(blob[HEADER.size : HEADER.size + n])
    logits = np.frombuffer(blob, dtype=np.float32, offset=HEADER.size + n).reshape(meta["shape"])
    return logits, list(meta["served_by"])


def encode_texts(texts: list[str], served_by: list[str]) -> bytes:
    return json.dumps({"texts": texts, "served_by": served_by}).encode()


def decode_texts(blob: bytes) -> tuple[list[str], list[str]]:
    doc = json.loads(blob)
    return list(doc["texts"]), list(doc["served_by"])
