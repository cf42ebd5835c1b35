"""Autoscaling policies: model replicas on the work routers hold (not only the requests at
replicas), and router replicas on their own CPU.

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

from serve_app.contract import LINK_ONGOING, RouterLoad


def router_demand(aggregated_metrics: dict[str, dict[Any, float]] | None) -> float:
    """Full batches waiting in routers. Every replica hears the same routers, so take the
    largest report rather than the sum; a partly filled batch is normal batching, not demand."""
    reports = (aggregated_metrics or {}).get(RouterLoad.METRIC, {})
    return float(math.floor(max(reports.values(), default=0.0)))


def linked_calls(aggregated_metrics: dict[str, dict[Any, float]] | None) -> float:
    """Batches running that routers sent over replicas' links, which Serve's ongoing count misses:
    each replica reports its own, so these add up."""
    return float(sum((aggregated_metrics or {}).get(LINK_ONGOING, {}).values()))


def desired_replicas(ongoing: float, router_batches: float, target_per_replica: float) -> int:
    demand = ongoing + router_batches
    return math.ceil(demand / target_per_replica) if demand > 0 else 0


def router_demand_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    router_batches = router_demand(ctx.aggregated_metrics)
    ongoing = ctx.total_num_requests + linked_calls(ctx.aggregated_metrics)
    desired = desired_replicas(ongoing, router_batches, ctx.config.target_ongoing_requests)
    state = dict(ctx.policy_state)
    state["router_queued_batches"] = router_batches
    return desired, state


ROUTER_CPU = "router_cpu_cores"  # what each router replica reports (`Router.record_autoscaling_stats`)


class RouterLoadPolicy:
    """Router replicas that follow the routers' own load: the cores they use together over
    `target_cores` per replica. A router is one event loop, so past about one core it queues
    requests where no admission sees them; the target keeps each below that, with room for a
    burst while Serve starts another. Queue lengths say nothing here: a router answers or refuses
    what it is given, so its ongoing requests stay near the proxy's concurrency however busy it is.

    Use in the Serve YAML, on the router deployment:
        autoscaling_config:
          policy: {policy_function: serve_app.scheduling.autoscale:RouterLoadPolicy,
                   policy_kwargs: {target_cores: 0.6}}
    Serve applies the config's min/max replicas and up/downscale delays to what it returns."""

    def __init__(self, target_cores: float = 0.6) -> None:
        if not 0.0 < target_cores <= 1.0:
            raise ValueError(f"target_cores must be in (0, 1] (a router uses one core at most), got {target_cores}")
        self.target_cores = target_cores

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        reports = (ctx.aggregated_metrics or {}).get(ROUTER_CPU, {})
        state = dict(ctx.policy_state)
        if not reports:  # replicas starting, nothing measured yet: keep what runs
            return ctx.current_num_replicas, state
        cores = float(sum(reports.values()))
        state["router_cpu_cores"] = round(cores, 3)
        return max(1, math.ceil(cores / self.target_cores)), state
