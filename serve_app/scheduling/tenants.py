"""Who is calling: API keys -> tenants with a priority ceiling and a rate limit.

Keys are never configured in clear text: the config holds a key's SHA-256, or
names an environment variable or a file (a Kubernetes secret mount) that holds
it. A presented key is hashed and compared in constant time against every
configured hash, so timing reveals neither a key nor which tenant matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from serve_app.contract import Priority
from serve_app.errors import RateLimited, Unauthorized


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TokenBucket:
    """`rate_per_s` tokens a second, at most `burst` saved up; a request takes one per item.

    With several router replicas each keeps a bucket of its own, holding its `share` of the
    configured rate and burst (1 / the replica count), so that the tenant's rate holds over
    all of them while the proxy spreads requests evenly.
    """

    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"need rate_per_s > 0 and burst >= 1, got {rate_per_s}, {burst}")
        self.configured = (rate_per_s, burst)
        self.rate, self.burst, self.clock = rate_per_s, burst, clock
        self.tokens = burst
        self.updated = clock()

    def set_share(self, share: float) -> None:
        """Hold `share` (0 < share <= 1) of the configured rate and burst; never less than one token of burst."""
        rate, burst = self.configured
        self.rate, self.burst = rate * share, max(1.0, burst * share)
        self.tokens = min(self.tokens, self.burst)

    def take(self, n: float = 1.0) -> float:
        """0 when granted; otherwise the seconds until `n` tokens will be there."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= n:
            self.tokens -= n
            return 0.0
        return (n - self.tokens) / self.rate


@dataclass
class Tenant:
    name: str
    max_priority: Priority = Priority.HIGH  # the best class this tenant may ask for
    bucket: TokenBucket | None = None
    digests: list[bytes] = field(default_factory=list, repr=False)
    operator: bool = False  # may read the router's internals (/router/status)

    def cap(self, requested: Priority) -> Priority:
        return max(requested, self.max_priority)  # larger value = lower priority

    def admit(self, items: int = 1, charged: int = 0) -> None:
        """Charge `items` tokens (rows or choices; at most the burst, so any request can pass
        at some point), less the `charged` ones it already took (one on arrival, before its
        body was read), or raise RateLimited with when they will be there."""
        if self.bucket is None:
            return
        if (n := min(float(items), self.bucket.burst) - charged) > 0 and (wait := self.bucket.take(n)) > 0:
            raise RateLimited(f"tenant {self.name!r} is over its rate limit", retry_after_s=wait)


ANONYMOUS = Tenant("anonymous")


def resolve_key(key_sha256: str | None, key_env: str | None, key_file: str | None) -> bytes:
    """The digest of one configured key, from wherever the config says it lives."""
    if key_sha256:
        digest = bytes.fromhex(key_sha256)
        if len(digest) != 32:
            raise ValueError("key_sha256 must be 64 hex characters")
        return digest
    if key_env:
        value = os.environ.get(key_env)
        if not value:
            raise ValueError(f"environment variable {key_env} (an API key) is not set")
        return key_digest(value.strip())
    if key_file:
        return key_digest(Path(key_file).read_text().strip())
    raise ValueError("an API key needs key_sha256, key_env or key_file")


class TenantRegistry:
    def __init__(self, tenants: list[Tenant], anonymous: Tenant = ANONYMOUS) -> None:
        self.tenants = tenants
        self.anonymous = anonymous  # who every caller is when no keys are configured
        self._index = [(d, t) for t in tenants for d in t.digests]

    def set_share(self, replicas: int) -> None:
        """Each of `replicas` router replicas enforces its share of every tenant's rate."""
        for tenant in self.tenants:
            if tenant.bucket is not None:
                tenant.bucket.set_share(1.0 / max(1, replicas))

    @property
    def open(self) -> bool:
        """No keys configured: every caller is the anonymous tenant."""
        return not self._index

    def authenticate(self, authorization: str | None) -> Tenant:
        if self.open:
            return self.anonymous
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        presented = key_digest(token.strip())
        found: Tenant | None = None
        for digest, tenant in self._index:  # no early exit: the same work whichever key matches
            if hmac.compare_digest(presented, digest):
                found = tenant
        if found is None:
            raise Unauthorized("invalid API key")
        return found
