"""Who is calling and what they may ask for: API keys, rate limits, priority and deadline."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from serve_app.config import TenantConfig
from serve_app.contract import Priority
from serve_app.errors import Forbidden
from serve_app.router.admission.qos import PRIORITY_HEADER, TIMEOUT_HEADER, QoS, parse_qos
from serve_app.scheduling.tenants import Tenant, TenantRegistry, TokenBucket, resolve_key


def build_registry(configs: list[TenantConfig], anonymous_max_priority: str = "normal") -> TenantRegistry:
    """The configured tenants; with none, every caller is anonymous, capped at `anonymous_max_priority`."""
    return TenantRegistry(
        [
            Tenant(
                c.name,
                Priority.parse(c.max_priority),
                TokenBucket(c.rate_per_s, c.burst) if c.rate_per_s else None,
                [resolve_key(c.key_sha256, c.key_env, c.key_file)],
                operator=c.operator,
            )
            for c in configs
        ],
        Tenant("anonymous", Priority.parse(anonymous_max_priority)),
    )


class Callers:
    """Authenticates (401), rate-limits (429) and caps each caller's priority at its tenant's."""

    def __init__(self, tenants: TenantRegistry, default_priority: Priority) -> None:
        self.tenants = tenants
        self.default_priority = default_priority

    def authenticate(self, authorization: str | None) -> Tenant:
        return self.tenants.authenticate(authorization)

    def operator(self, authorization: str | None) -> Tenant:
        """An operator's endpoint: with keys configured, only tenants marked `operator` (403 for the rest)."""
        tenant = self.tenants.authenticate(authorization)
        if not (self.tenants.open or tenant.operator):
            raise Forbidden(f"tenant {tenant.name!r} is not an operator")
        return tenant

    def admit(self, authorization: str | None) -> Tenant:
        """Authenticate and charge the tenant's rate limit, before any other work."""
        tenant = self.tenants.authenticate(authorization)
        tenant.admit()
        return tenant

    def qos(self, tenant: Tenant, priority: str | None, timeout_ms: str | None, parameters: dict[str, Any] | None) -> QoS:
        """Headers win over Triton's body parameters; the tenant caps the priority."""
        headers = {k: v for k, v in ((PRIORITY_HEADER, priority), (TIMEOUT_HEADER, timeout_ms)) if v is not None}
        return self.qos_from_headers(tenant, headers, parameters)

    def qos_from_headers(self, tenant: Tenant, headers: Mapping[str, str], parameters: dict[str, Any] | None = None) -> QoS:
        qos = parse_qos(headers, parameters, time.monotonic(), self.default_priority)
        return QoS(tenant.cap(qos.priority), qos.deadline)
