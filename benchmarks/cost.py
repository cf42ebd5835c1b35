"""What one request costs each part of a served setup, in core-milliseconds, and what a node
with N cores would serve at that cost.

A load point records the cores each process role used over the measured window
(`cpu_cores_by_role`) and the requests answered in it; cores x 1000 / requests per
second is the CPU each request cost that role. Roles fold into the parts an operator
sizes: the ingress proxy (HAProxy, its manager, which parses HAProxy's log line of every
request for Serve's metrics, and Serve's proxy), the router, the model replica (or the
whole server, for baselines that are one process), and Ray's own overhead (controller,
daemons, other models' idle replicas). The load generator is the client and is left out.

Part of what each role uses does not grow with requests: Ray's controller and daemons,
health checks, metric pushes, other models' idle replicas. Where a run measured the
setup with no load (`idle_cores_by_role`), the ceiling keeps those cores as a fixed
cost of the node and divides the rest by what each request adds above them:
(cores - idle cores) / (core-ms per request above idle). Without an idle measurement
it divides all cores by the whole per-request cost, which counts the fixed part once
per request and so understates a large node.

The ceiling assumes the per-request cost stays what it was at the measured point and
every core does serving work: an upper bound that says which part runs out first when
a node grows, not a promise (batching changes the model's share with load).
"""

from __future__ import annotations

from typing import Any

PARTS = ("ingress", "router", "model", "ray")
INGRESS_ROLES = ("haproxy", "haproxy-manager", "serve-proxy")
RAY_ROLES = ("serve-controller", "ray-system")
CLIENT_ROLES = ("loadgen",)
MODEL_ROLES = ("replica:PlainModel", "naive-server")


def part_of(role: str, model: str) -> str | None:
    """Which part a process role belongs to when `model` is the one under load (None: the client)."""
    if role in CLIENT_ROLES:
        return None
    if role in INGRESS_ROLES:
        return "ingress"
    if role == "replica:router":
        return "router"
    if role == f"replica:{model}" or role in MODEL_ROLES:
        return "model"
    return "ray"  # Ray's processes, and other models' replicas idling beside this one


def core_ms_per_request(point: dict[str, Any], model: str, idle: dict[str, float] | None = None) -> dict[str, float] | None:
    """Core-ms per answered request (a 2xx: refusals and errors are work, not answers), per part,
    and their total (`total`); None without figures. With `idle` (cores per role with no load),
    only what each role used above its idle use: what a request adds."""
    rps = point.get("goodput_rps") or 0.0
    roles = point.get("cpu_cores_by_role") or {}
    if rps <= 0 or not roles:
        return None
    idle = idle or {}
    out = dict.fromkeys(PARTS, 0.0)
    for role, cores in roles.items():
        part = part_of(role, model)
        if part is not None:
            out[part] += max(0.0, cores - idle.get(role, 0.0)) * 1000.0 / rps
    out = {k: round(v, 3) for k, v in out.items()}
    out["total"] = round(sum(out[p] for p in PARTS), 3)
    return out


def fixed_cores(idle: dict[str, float] | None) -> float:
    """The cores a setup uses with no load, the client left out: a node's fixed cost."""
    return round(sum(c for role, c in (idle or {}).items() if role not in CLIENT_ROLES), 3)


def ceiling_rps(cost: dict[str, float], cores: int, fixed: float = 0.0) -> float | None:
    """Requests/s a node of `cores` would answer if `fixed` of them went to idle work and the
    rest spent `cost["total"]` per request (`cost` above idle where `fixed` is given)."""
    total = cost.get("total") or 0.0
    return round((cores - fixed) * 1000.0 / total, 1) if total > 0 and cores > fixed else None
