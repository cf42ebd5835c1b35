"""Autoscaling that sees the work routers hold, not only the requests at replicas.

The router keeps requests in its own queues and releases about one batch per
replica plus one, so Serve's default policy (ongoing requests per replica)
would see a steady ~1-2 however long the router's queue grows. This policy
adds the full batches that routers report holding (see `RouterLoad`) to the
ongoing requests, and divides by `target_ongoing_requests` like the default.
Serve wraps it with the config's bounds, delays and scaling factors.

Use in the Serve YAML:
    autoscaling_config:
      policy: {policy_function: serve_app.scheduling.autoscale:router_demand_policy}
No Ray import: the context is Serve's `AutoscalingContext`, read by attribute.
"""

from __future__ import annotations

import math
from typing import Any

from serve_app.contract import RouterLoad


def router_demand(aggregated_metrics: dict[str, dict[Any, float]] | None) -> float:
    """Full batches waiting in routers. Every replica hears the same routers, so take the
    largest report rather than the sum; a partly filled batch is normal batching, not demand."""
    reports = (aggregated_metrics or {}).get(RouterLoad.METRIC, {})
    return float(math.floor(max(reports.values(), default=0.0)))


def desired_replicas(ongoing: float, router_batches: float, target_per_replica: float) -> int:
    demand = ongoing + router_batches
    return math.ceil(demand / target_per_replica) if demand > 0 else 0


def router_demand_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    router_batches = router_demand(ctx.aggregated_metrics)
    desired = desired_replicas(ctx.total_num_requests, router_batches, ctx.config.target_ongoing_requests)
    state = dict(ctx.policy_state)
    state["router_queued_batches"] = router_batches
    return desired, state
